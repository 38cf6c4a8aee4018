"""The messages of a Trainer rank restarted alone (``--max-restarts``), re-exported by
:mod:`.messages` with the rest: the agent is asked to start the rank again, and relays and ranks
learn when the coordinator readmits it. Kept here only so that :mod:`.messages` stays short enough
to read; the kinds follow its numbering.
"""

from __future__ import annotations

from dataclasses import dataclass

from .schema import Message, message


@message(kind=0x0113)
@dataclass(frozen=True, slots=True, kw_only=True)
class RestartRank(Message):
    """Start ``rank`` of ``round`` again, alone, as its ``incarnation`` (1, 2, …): a Trainer rank
    lost to a crash under ``--max-restarts`` (its peers train on; the world is not restarted)."""

    round: int
    rank: int
    incarnation: int


@message(kind=0x0419)
@dataclass(frozen=True, slots=True, kw_only=True)
class Readmitted(Message):
    """``readmitted``'s restarted process (its ``incarnation``) is back in the run from round
    ``round`` on: relays fold it again, ranks no longer count it lost."""

    readmitted: int
    incarnation: int
    round: int
    rank: int = -1
