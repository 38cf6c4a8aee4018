"""A Trainer run's failures that its coordinator may absorb: how each is held, and what the
coordinator is told of it.

In a Trainer run a rank's failed exit, or the loss of its host, is first the coordinator's to
judge: it drops the rank and trains on (an elastic run), or ends the run with its own cause. The
supervisor holds each such failure (:class:`~flodl_async.control.supervision.HeldFailure`) while it
tells the coordinator (:class:`~flodl_async.control.supervision.TellCoordinator`); a failure nobody
absorbs in time is the verdict.

Pure.
"""

from __future__ import annotations

from ..wire import messages as m
from .exits import describe_exit, exit_cause, failure_details
from .membership import JoinedMember
from .supervision import HeldFailure, TellCoordinator
from .vocab import Announce, Level


def held_exit(report: m.RankExited, *, after: str = "") -> HeldFailure:
    """A rank's failed exit; ``after``: the restarts it came after (`` after 2 restarts``)."""
    return HeldFailure(
        rank=report.rank,
        reason=describe_exit(report) + after,
        details=failure_details(report),
        details_if_shown=failure_details(report, shown_live=True),
    )


def tell_exit(report: m.RankExited) -> TellCoordinator:
    """The coordinator's word of a rank's failed exit (its agent's own KILL of a rank declared
    dead refines nothing)."""
    return TellCoordinator(
        rank=report.rank,
        reason=f"its process {exit_cause(report)}",
        details=failure_details(report),
        refines=not report.killed_because,
    )


def held_host(
    member: JoinedMember, reason: str, *, gone: frozenset[int]
) -> tuple[tuple[HeldFailure, ...], tuple[TellCoordinator, ...]]:
    """Each rank of a lost host that had not exited yet (``gone``: those that had): held, and
    told."""
    ranks = [r for r in member.ranks if r not in gone]
    verdict = f"agent on host {member.host!r} was lost mid-run: {reason}"
    held = tuple(HeldFailure(rank=r, reason=verdict) for r in ranks)
    told = tuple(
        TellCoordinator(rank=r, reason=f"its host {member.host!r} was lost: {reason}")
        for r in ranks
    )
    return held, told


def restarts_unused(max_restarts: int) -> tuple[Announce, ...]:
    """What a Trainer run says of ``--max-restarts``, once, as its training starts: it restarts a
    plain script's world, and a Trainer's lost ranks are dropped instead (an option silently
    ignored would look honoured)."""
    if max_restarts <= 0:
        return ()
    text = (
        f"--max-restarts {max_restarts} does not apply to a Trainer run: a lost rank is dropped "
        "and the survivors train on (restarting it alone is not built yet); it restarts a plain "
        "script's world"
    )
    return (Announce(text=text, level=Level.WARNING),)
