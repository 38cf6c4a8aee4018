"""Liveness of one link: when we last heard the peer, when our next heartbeat is due, and whether
the peer went silent.

Theory of operation. A TCP connection to a frozen host (SIGSTOP, a hung kernel) or
behind a pulled cable stays open for minutes: nothing fails, nothing arrives. So
both ends of every agent's join link send a :class:`~flodl_async.wire.messages.Heartbeat`
every ``interval`` seconds, and each counts *any* frame from the peer as a sign of
life. A peer unheard for ``silence`` seconds is gone. This object only keeps the
two instants and answers questions about them, with ``now`` passed in; the shells
(the controller's pump, the agent's ticker, the relay's beat loop) send, read the
clock, and act. A shell that wakes more than one interval late was itself frozen;
it excuses every peer (:meth:`Liveness.excused`) rather than accuse a host that
could not be heard by a process that was not running. A loop that watches one
link asks :meth:`Liveness.woke` what to do on each wake (lost, beat, or sleep).

What is covered, link by link (defaults: ``interval`` 2 s, ``silence`` 10 s, both scaled by
``FLODL_NET_TIMEOUT_SCALE``):

- **Join link** (agent ↔ controller): heartbeats both ways. The controller loses a silent host
  by name (exit 4 mid-run); the agent stops its ranks when the controller is silent.
- **Relay upstream control link** (one per host, the relay ↔ controller): the relay beats
  (``Heartbeat(relay=True)`` naming one of its host's ranks) and the controller echoes. A
  controller silent there ends the agent's session like a silent join link (the relay's
  ``on_upstream_lost``); a relay silent there loses its host at the controller, by name —
  unless the host is silent on its join link too, which then names it with the join link's
  reason. Any loss of a host (either link, or its agent failing) makes the controller abort
  that host's control links at once.
- **Relay data upstream link**: no heartbeats of its own; it is closed with its session (which
  ends with the join link's or the control link's liveness) and at the controller's teardown.
- **Ranks' links to their relay** (unix sockets on the same host): none; a rank that dies
  closes its socket, and the agent watches its rank processes directly.
- **The store's connections** (torch's protocol, no frames of ours): none; they are closed
  between rounds and at the end of the run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace


class Wake(enum.Enum):
    """What a link's heartbeat loop does when it wakes (:meth:`Liveness.woke`)."""

    #: The peer was silent for the whole deadline: report it lost and stop beating.
    LOST = enum.auto()
    #: Our heartbeat is due: send it now.
    BEAT = enum.auto()
    #: Nothing is due: sleep until :meth:`Liveness.next_deadline`.
    SLEEP = enum.auto()


@dataclass(frozen=True, slots=True, kw_only=True)
class Liveness:
    """One link's liveness; build with :meth:`start`, advance with :meth:`heard` and :meth:`sent`
    (each returns a new one)."""

    #: Seconds between our heartbeats.
    interval: float
    #: Seconds of the peer's silence after which it is lost.
    silence: float
    last_heard: float
    next_send: float

    def __post_init__(self) -> None:
        if not 0 < self.interval < self.silence:
            # A silence shorter than the interval would expire a healthy peer between two beats.
            raise ValueError(
                f"heartbeat interval {self.interval:g}s must be positive and shorter than the "
                f"silence deadline {self.silence:g}s"
            )

    @classmethod
    def start(cls, now: float, *, interval: float, silence: float) -> Liveness:
        """A link that was just heard from (it was established now); our first beat is due at
        once."""
        return cls(interval=interval, silence=silence, last_heard=now, next_send=now)

    def heard(self, now: float) -> Liveness:
        """Any frame arrived from the peer."""
        return replace(self, last_heard=max(self.last_heard, now))

    def excused(self, now: float) -> Liveness:
        """We ourselves did not run (our process was frozen, the machine suspended): the peer's
        silence meanwhile is not its own.

        The shell calls this when it wakes later than one ``interval`` past the time it meant to;
        the peer then gets a whole deadline from now, as a freshly heard one.
        """
        return self.heard(now)

    def sent(self, now: float) -> Liveness:
        """We just sent a heartbeat."""
        return replace(self, next_send=now + self.interval)

    def send_due(self, now: float) -> bool:
        """Time to send our next heartbeat."""
        return now >= self.next_send

    def expires_at(self) -> float:
        """When the peer is lost unless it is heard from before."""
        return self.last_heard + self.silence

    def expired(self, now: float) -> bool:
        """The peer was silent for the whole deadline."""
        return now >= self.expires_at()

    def silent_for(self, now: float) -> float:
        """Seconds since the peer was last heard."""
        return max(now - self.last_heard, 0.0)

    def woke(self, now: float, *, meant: float) -> tuple[Liveness, Wake]:
        """A heartbeat loop that meant to wake at ``meant`` woke at ``now``: what it does, and the
        liveness to keep (already :meth:`sent` on a :attr:`Wake.BEAT`).

        Waking more than one ``interval`` late means this process was frozen: the peer is excused
        first, so a host that could not be heard by a process that was not running is not accused.
        After a beat or a sleep the loop sleeps until :meth:`next_deadline` of what this returns.
        """
        live = self.excused(now) if now - meant > self.interval else self
        if live.expired(now):
            return live, Wake.LOST
        if live.send_due(now):
            return live.sent(now), Wake.BEAT
        return live, Wake.SLEEP

    def next_deadline(self) -> float:
        """When to look again if nothing arrives: the next beat or the expiry, whichever is
        first."""
        return min(self.next_send, self.expires_at())
