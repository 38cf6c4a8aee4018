"""The supervisor's watch on its hosts' links: join-link heartbeats, relay-link silence and the
frozen-process excuse (pure: ``now`` passed in).

Theory of operation. The supervisor owns one :class:`HostWatch` and hands it the link events
(:data:`LinkEvent`: a join link bound or heard, a control link named, beating or closed); the
controller's pump wakes at :meth:`HostWatch.next_deadline` and the supervisor asks
:meth:`HostWatch.woke` what the wake means, in this order:

1. woken more than one heartbeat ``interval`` late, this process was itself frozen: every link is
   excused (a host that could not be heard by a process that was not running is not accused);
2. a relay's control link silent past the deadline loses its host (:class:`Lost`), unless the
   host is silent on its join link too (:class:`~flodl_async.control.links.ControlLinks`);
3. each join link in turn: silent past the deadline, it is cut (:class:`CutJoinLink`) and its host
   lost; else, our beat due, a :class:`SendHeartbeat`.

A host lost for any reason gives up its control links (:meth:`HostWatch.drop`, an
:class:`AbortLinks` for the shell). Links are opaque keys (:class:`Link`): nothing here sends or
closes anything.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

from .dispatch import TypeTable
from .links import ControlLinks
from .liveness import Liveness


class Link(Hashable, Protocol):
    """A control link as the watch keeps it: a key the shell can abort."""

    def abort(self) -> None:
        """Close it at once (the shell does, on :class:`AbortLinks`)."""


#: Names the host of an admitted rank (None: no host has it).
HostOf = Callable[[int], str | None]

# ----- events ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class JoinBound:
    """The accept reached ``host``: its join link is watched from now on."""

    host: str


@dataclass(frozen=True, slots=True, kw_only=True)
class JoinHeard:
    """A frame arrived on ``host``'s current join link (any frame is a sign of life)."""

    host: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlLinkNamed:
    """A ``RankHello`` on ``link`` named ``rank``: the link belongs to that rank's host."""

    link: Link
    rank: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayBeat:
    """A relay's own beat (``Heartbeat(relay=True)``) on ``link``, naming one of its ranks."""

    link: Link
    rank: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlLinkClosed:
    """``link``'s reader returned."""

    link: Link


LinkEvent = JoinBound | JoinHeard | ControlLinkNamed | RelayBeat | ControlLinkClosed


@dataclass(frozen=True, slots=True, kw_only=True)
class Woke:
    """The pump woke ``late`` seconds after the deadline it slept for."""

    late: float


# ----- actions -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SendHeartbeat:
    """Beat down ``host``'s join link (``Heartbeat(sent_at=sent_at)``)."""

    host: str
    sent_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class CutJoinLink:
    """``host``'s join link went silent: abort it and forget it, so that its reader ending reports
    no second loss."""

    host: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AbortLinks:
    """``host`` is lost: abort its control links (relay upstream) with it."""

    host: str
    links: frozenset[Link]


@dataclass(frozen=True, slots=True, kw_only=True)
class Lost:
    """The watch's verdict on a wake: ``host`` is lost for ``reason`` (the supervisor's
    ``HostLost``)."""

    host: str
    reason: str


WatchAction = SendHeartbeat | CutJoinLink | AbortLinks


# ----- the watch ---------------------------------------------------------------------------------


class HostWatch:
    """The liveness of every admitted host's join link and of its relays' control links."""

    def __init__(
        self,
        *,
        interval: float,
        silence: float,
        launched_hosts: frozenset[str] = frozenset(),
        agent_reason_wait: float = 2.0,
    ) -> None:
        self._interval = interval
        self._silence = silence
        self._launched = launched_hosts
        self._reason_wait = agent_reason_wait
        # a launched host whose join link closed: lost with its reason at its instant, unless its
        # launcher says why first
        self._link_losses: dict[str, tuple[str, float]] = {}
        # per admitted host's join link, until it closes or goes silent
        self._joins: dict[str, Liveness] = {}
        # hosts whose join link is bound and not cut: their relays' beats are watched
        self._bound: set[str] = set()
        self._relays: ControlLinks[Link] = ControlLinks(interval=interval, silence=silence)
        # each control link's host, from its first naming until it closes
        self._link_hosts: dict[Link, str] = {}
        self._table: TypeTable[LinkEvent, [float, HostOf], None] = TypeTable(
            "the host watch's link events"
        )
        self._table.add(JoinBound, self._join_bound)
        self._table.add(JoinHeard, self._join_heard)
        self._table.add(ControlLinkNamed, self._named)
        self._table.add(RelayBeat, self._relay_beat)
        self._table.add(ControlLinkClosed, self._closed)
        self._table.require(LinkEvent)

    def next_deadline(self) -> float | None:
        """When a beat is due or a link could go silent past the deadline (None: nothing
        watched)."""
        due = [live.next_deadline() for live in self._joins.values()]
        relay = self._relays.next_deadline()
        if relay is not None:
            due.append(relay)
        due.extend(until for _reason, until in self._link_losses.values())
        return min(due, default=None)

    def handle(self, event: LinkEvent, now: float, host_of: HostOf) -> None:
        """Take a link event; ``host_of`` names the host of an admitted rank (None: none)."""
        self._table(event, now, host_of)

    def _join_bound(self, event: JoinBound, now: float, host_of: HostOf) -> None:
        self._joins[event.host] = Liveness.start(
            now, interval=self._interval, silence=self._silence
        )
        self._bound.add(event.host)

    def _join_heard(self, event: JoinHeard, now: float, host_of: HostOf) -> None:
        live = self._joins.get(event.host)
        if live is not None:
            self._joins[event.host] = live.heard(now)

    def _named(self, event: ControlLinkNamed, now: float, host_of: HostOf) -> None:
        self._bind(event.link, event.rank, host_of)

    def _bind(self, link: Link, rank: int, host_of: HostOf) -> str | None:
        # bound by the first rank it names whose host is known; a link speaks for one host
        host = self._link_hosts.get(link)
        if host is None:
            host = host_of(rank)
            if host is not None:
                self._link_hosts[link] = host
                self._relays.bind(link, host)
        return host

    def _relay_beat(self, event: RelayBeat, now: float, host_of: HostOf) -> None:
        host = self._bind(event.link, event.rank, host_of)
        # a host of this run, still in it: watch this link
        if host is not None and host in self._bound:
            self._relays.heard(event.link, host, now)

    def _closed(self, event: ControlLinkClosed, now: float, host_of: HostOf) -> None:
        self._relays.closed(event.link, self._link_hosts.pop(event.link, None))

    def held(self, host: str, reason: str, link_closed: bool, now: float, *, ended: bool) -> bool:
        """``host`` was lost for ``reason``: True while the loss waits for a better reason.

        The join link of a host a launcher runs closed (``link_closed``): the agent, if it failed,
        tells its launcher what went wrong and what to do, which says more than that its link
        closed; the loss waits ``agent_reason_wait`` for it (:meth:`due_losses`). Any other loss
        of the host, its launcher's report included, is the verdict's at once.
        """
        if link_closed:
            self._joins.pop(host, None)
            if host in self._launched and not ended:
                self._link_losses.setdefault(host, (reason, now + self._reason_wait))
                return True
        self._link_losses.pop(host, None)  # the launcher's reason came first
        return False

    def due_losses(self, now: float) -> tuple[Lost, ...]:
        """The held losses whose wait ended by ``now`` (each once)."""
        due = [host for host, (_reason, until) in self._link_losses.items() if now >= until]
        return tuple(Lost(host=host, reason=self._link_losses.pop(host)[0]) for host in due)

    def drop(self, host: str) -> tuple[AbortLinks, ...]:
        """``host`` is lost: its control links go with it (none: nothing to do)."""
        links = self._relays.drop(host)
        return (AbortLinks(host=host, links=frozenset(links)),) if links else ()

    def woke(self, now: float, *, late: float) -> tuple[Lost | CutJoinLink | SendHeartbeat, ...]:
        """What a wake at ``now``, ``late`` seconds after its deadline, means, in order (the
        module's theory of operation)."""
        if late > self._interval:
            # this process was frozen: no host could be heard meanwhile
            self._joins = {host: live.excused(now) for host, live in self._joins.items()}
            self._relays.excused(now)
        silence = f"{self._silence:g}s"
        out: list[Lost | CutJoinLink | SendHeartbeat] = [
            Lost(
                host=host,
                reason=f"its relay's control link sent nothing for {silence} (the host is "
                "frozen, down or cut off)",
            )
            for host in self._relays.silent_hosts(now, self._joins)
        ]
        for host, live in list(self._joins.items()):
            if live.expired(now):
                del self._joins[host]
                self._bound.discard(host)
                out.append(CutJoinLink(host=host))
                reason = f"no heartbeat for {silence} (the host is frozen, down or cut off)"
                out.append(Lost(host=host, reason=reason))
            elif live.send_due(now):
                out.append(SendHeartbeat(host=host, sent_at=now))
                self._joins[host] = live.sent(now)
        return tuple(out)
