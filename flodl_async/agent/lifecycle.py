"""What a host session tells an observer about its progress (for ``systemctl status``, and anyone
else watching).

A :class:`HostSession <flodl_async.agent.session.HostSession>` calls its observer
with one :class:`SessionEvent` at each step of its life; the observer must not
block or raise (it runs on the session's loop, inline). The session knows
nothing of systemd: :mod:`flodl_async.agent.systemd` turns events into
notifications.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass


class Phase(enum.Enum):
    """The steps of a session, in the order they happen (STOPPING may come at any point after
    CONNECTED)."""

    DIALING = "dialing"  # about to connect to the controller
    CONNECTED = "connected"  # the join link is up (handshake done), the join request goes out
    ADMITTED = "admitted"  # the controller accepted the join: waiting for the world to form
    RUNNING = "running"  # a round's ranks were started
    STOPPING = "stopping"  # the first ending began: the ranks are being stopped


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionEvent:
    """One step of one session: which, against which controller, and what is known of the run by
    then."""

    phase: Phase
    host: str
    controller: str
    run_id: str | None = None
    ranks: tuple[int, ...] = ()
    round: int | None = None
    reason: str = ""


#: What a session calls at each step.
SessionObserver = Callable[[SessionEvent], None]


def ignore(event: SessionEvent) -> None:
    """The observer of a session nobody watches."""
