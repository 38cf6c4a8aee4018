"""Connection admission on the controller's one port: who may hold a descriptor before proving the
key.

Theory of operation
-------------------
Every connection the port accepts is *unauthenticated* until its protocol says that its peer
proved the key: first while it has not sent a channel magic (:attr:`Stage.SNIFFING`), then,
routed to a framed channel, while its handshake runs (:attr:`Stage.HANDSHAKING`). A flood is
made of such connections, so they — and only they — are capped, per peer address and in total.
A full cap never turns the newcomer away: it evicts the *oldest* unauthenticated connection (of
that peer for the per-peer cap, overall for the total). A flood therefore churns through its own
connections. The oldest goes first within an order of progress: a connection that has sent
nothing (sniffing), then one whose proof is overdue (its hello was answered more than a grace
ago), then one routed to a handshake whose hello has not been accepted yet, and only when
nothing else of that scope is left one whose hello was accepted within its grace
(:meth:`Admission.answered`). An honest peer that arrives in the middle of a flood — even from
the same address, as an agent and an attacker on one host share 127.0.0.1 — sends its hello at
once, so idle connections and half-sent handshakes of a flood are evicted before it, and it
needs only to prove the key within its grace. Each stage has a short deadline
(:meth:`Admission.expire`) that ends the stragglers. A connection that authenticated leaves
admission altogether: it is never counted and never evicted.

Status HTTP connections prove nothing (the page is public), so they move to a separate, small
budget with the same rule (:meth:`Admission.to_status`) and stay there until they close; their
request deadline is the HTTP protocol's own.

A status connection that asks for the live event stream (``/events``) moves once more, to the
stream budget (:meth:`Admission.to_stream`), and stays there until it closes. Streams are
long-lived, like a rank's store connection, so a full stream cap turns the *newcomer* away
(``503``) and never evicts a watching dashboard; and since they are a budget of their own, no
flood of short status requests can evict them either.

Store connections (torch's TCPStore protocol, which carries no credential) move to a third
budget (:meth:`Admission.to_store`) and stay there until they close, capped per address and in
total like the others. Ranks hold theirs for hours, so a full store cap turns the *newcomer*
away and never evicts: evicting would break a rank's rendezvous. The store's total cap is
fitted to the descriptor limit (:meth:`AdmissionLimits.within_descriptors`), so held store
connections always leave descriptors for the unauthenticated and status pools and the
authenticated links.

The pieces are sans-IO: :class:`Admission` takes connection ids, peer keys and ``now`` (a
monotonic clock) and answers which connection to evict or which have expired;
:class:`~flodl_async.net.refusals.RejectionSummary` turns refusals into at most one log line
per interval;
:class:`AdmissionTicket` is the seam through which a framed protocol reports its handshake. The
port mux (:mod:`flodl_async.net.mux`) performs what they decide.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import (
    AuthenticationFailed,
    ConfigError,
    HandshakeFailed,
    HandshakeRefused,
    VersionMismatch,
    WireError,
    WrongToken,
)


class Pool(enum.Enum):
    """The budgets: connections that have not proved the key, status HTTP, the live event streams
    of status HTTP, and the TCPStore."""

    UNAUTHENTICATED = "unauthenticated"
    STATUS = "status"
    STREAM = "stream"
    STORE = "store"


class Stage(enum.Enum):
    """Where an admitted connection is; the first two are the unauthenticated pool and have
    deadlines."""

    SNIFFING = "sniffing"
    HANDSHAKING = "handshaking"
    STATUS = "status"
    STREAM = "stream"
    STORE = "store"


_POOL_OF = {
    Stage.SNIFFING: Pool.UNAUTHENTICATED,
    Stage.HANDSHAKING: Pool.UNAUTHENTICATED,
    Stage.STATUS: Pool.STATUS,
    Stage.STREAM: Pool.STREAM,
    Stage.STORE: Pool.STORE,
}
#: Descriptors the store's cap leaves, beyond the unauthenticated and status pools, to the
#: authenticated links (a few per host) and the controller's own files, pipes and loop.
RESERVED_DESCRIPTORS = 128
#: The store's total cap never goes below this, however low the descriptor limit: a run must be
#: able to rendezvous at all (a limit that low is reported by the mux's descriptor warning).
MIN_STORE_CONNECTIONS = 16


class Cap(enum.Enum):
    """Which cap made room for a newcomer."""

    PER_PEER = "per peer"
    TOTAL = "total"


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionLimits:
    """The caps; a full cap evicts the oldest connection of its pool (of that peer, or overall).

    Why these defaults. Descriptors are what a flood exhausts, and the common soft limit is
    1,024: 512 unauthenticated plus 64 status connections leave the other half to the
    authenticated links (which scale with hosts: agents, relays and store hosts, not ranks) and
    to the controller's own files, even where the limit cannot be raised. An unauthenticated
    connection costs only kernel buffers and a few Python objects, so memory is not the bound.
    An honest host opens a handful of connections at once (join, rendezvous, its relay's
    control link, data links), so 64 per address leaves headroom for several hosts behind one
    NAT or on one machine while holding a single flooding address to an eighth of the pool.
    Status is one short request per connection (``Connection: close``): 16 concurrent from one
    address covers a few dashboards, ``flodl status`` and a scraper; 64 in all. An event stream
    (``/events``) is one open dashboard or terminal view for as long as it watches: 8 from one
    address covers a few browser tabs and a ``flodl top``, 32 in all a team. A rank holds one
    store connection (torch's TCPStore client; its process groups share it), so 1,024 per
    address covers the largest hosts and 4,096 in all a large world; under a low descriptor
    limit the total shrinks to fit (:meth:`within_descriptors`): 320 under 1,024.
    """

    max_unauthenticated: int = 512
    max_unauthenticated_per_peer: int = 64
    #: 0 turns status HTTP away (counted as ``over_capacity``).
    max_status: int = 64
    max_status_per_peer: int = 16
    #: 0 turns ``/events`` away (503).
    max_streams: int = 32
    max_streams_per_peer: int = 8
    max_store: int = 4096
    max_store_per_peer: int = 1024

    def __post_init__(self) -> None:
        if not 1 <= self.max_unauthenticated_per_peer <= self.max_unauthenticated:
            raise ConfigError(
                "admission caps: need 1 <= unauthenticated per peer "
                f"({self.max_unauthenticated_per_peer}) <= "
                f"unauthenticated in total ({self.max_unauthenticated}); the port must be able to "
                "admit its own agents"
            )
        if not 0 <= self.max_status_per_peer <= self.max_status:
            raise ConfigError(
                f"admission caps: need 0 <= status per peer ({self.max_status_per_peer}) <= status "
                f"in total ({self.max_status})"
            )
        if not 0 <= self.max_streams_per_peer <= self.max_streams:
            raise ConfigError(
                f"admission caps: need 0 <= event streams per peer ({self.max_streams_per_peer}) "
                f"<= event streams in total ({self.max_streams})"
            )
        if not 1 <= self.max_store_per_peer <= self.max_store:
            raise ConfigError(
                f"admission caps: need 1 <= store connections per peer "
                f"({self.max_store_per_peer}) <= store connections in total ({self.max_store}); "
                "the ranks must be able to rendezvous"
            )

    def cap(self, pool: Pool, cap: Cap) -> int:
        """The value of one cap."""
        if pool is Pool.UNAUTHENTICATED:
            return (
                self.max_unauthenticated_per_peer
                if cap is Cap.PER_PEER
                else self.max_unauthenticated
            )
        if pool is Pool.STORE:
            return self.max_store_per_peer if cap is Cap.PER_PEER else self.max_store
        if pool is Pool.STREAM:
            return self.max_streams_per_peer if cap is Cap.PER_PEER else self.max_streams
        return self.max_status_per_peer if cap is Cap.PER_PEER else self.max_status

    def within_descriptors(self, soft_limit: int | None) -> AdmissionLimits:
        """These caps with the store's lowered, if need be, to leave the other pools and
        :data:`RESERVED_DESCRIPTORS` their descriptors under ``soft_limit`` (None: unlimited)."""
        if soft_limit is None:
            return self
        room = (
            soft_limit
            - self.max_unauthenticated
            - self.max_status
            - self.max_streams
            - RESERVED_DESCRIPTORS
        )
        total = min(self.max_store, max(room, MIN_STORE_CONNECTIONS))
        if total == self.max_store:
            return self
        return dataclasses.replace(
            self, max_store=total, max_store_per_peer=min(self.max_store_per_peer, total)
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Eviction:
    """Connection ``conn`` of ``peer`` was evicted from ``pool`` to make room: the shell closes
    it."""

    conn: int
    peer: str
    pool: Pool
    cap: Cap
    limit: int

    def describe(self) -> str:
        """The note a summary line carries, the same for every eviction of this kind."""
        scope = f"from {self.peer}" if self.cap is Cap.PER_PEER else "in total"
        return f"evicting the oldest {self.pool.value} connections: more than {self.limit} {scope}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Refused:
    """The newcomer is turned away: the pool admits nobody (a cap of 0), or it is the store's and
    full (its cap ``cap`` of ``limit``, reached by ``peer``'s connections or in total)."""

    pool: Pool
    cap: Cap = Cap.PER_PEER
    limit: int = 0
    peer: str = ""

    def describe(self) -> str:
        """The note a summary line carries, the same for every refusal of this kind."""
        if self.limit == 0:
            return f"{self.pool.value} connections are switched off ({self.pool.value} cap 0)"
        scope = f"from {self.peer}" if self.cap is Cap.PER_PEER else "in total"
        return f"refusing new {self.pool.value} connections: {self.limit} held {scope}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Expired:
    """Connection ``conn`` overran the deadline of ``stage``: the shell closes it."""

    conn: int
    stage: Stage


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionStatistics:
    """How many connections each stage holds now, and how many were evicted from each pool so
    far."""

    sniffing: int
    handshaking: int
    status: int
    store: int
    evicted: dict[str, int]
    streams: int = 0


def peer_key(host: str) -> str:
    """The address a per-peer cap counts by.

    IPv4 and IPv6 loopback addresses count as themselves; an IPv4-mapped IPv6 address as its
    IPv4 address; any other IPv6 address by its /64, the block one subscriber or one host is
    handed, so that an attacker cannot take a fresh cap from each of its 2**64 addresses.
    """
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host or "local"  # a unix socket has no address; all of its peers are this host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        if not address.is_loopback:
            return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class _Progress(enum.Enum):
    """How far an unauthenticated connection got, in the order a full cap evicts them."""

    SILENT = "sniffing"  # no channel magic yet
    ROUTED = "routed"  # routed to a handshake; its hello not accepted yet
    ANSWERED = "answered"  # its hello was accepted: it is one proof from authenticating


class _Entry:
    __slots__ = ("grace_until", "peer", "progress", "stage")

    def __init__(self, peer: str, stage: Stage) -> None:
        self.peer = peer
        self.stage = stage
        self.progress = _Progress.SILENT
        self.grace_until = 0.0


_Ordered = dict[_Progress, OrderedDict[int, None]]


class Admission:
    """The bookkeeper of admitted connections, by id; every answer is for the shell to carry out.

    ``now`` must come from one monotonic clock: each stage's deadlines are then in arrival
    order, and :meth:`expire` and :meth:`next_deadline` cost O(1) per connection. Ordered dicts
    (a linked list inside) give the oldest of a pool or a peer in O(1) under constant churn.
    """

    def __init__(
        self, limits: AdmissionLimits, *, sniff_timeout: float, handshake_timeout: float
    ) -> None:
        self.limits = limits
        self._timeouts = {Stage.SNIFFING: sniff_timeout, Stage.HANDSHAKING: handshake_timeout}
        self._entries: dict[int, _Entry] = {}
        self._oldest: dict[Pool, OrderedDict[int, None]] = {pool: OrderedDict() for pool in Pool}
        self._by_peer: dict[Pool, dict[str, OrderedDict[int, None]]] = {pool: {} for pool in Pool}
        self._due: dict[Stage, OrderedDict[int, float]] = {
            stage: OrderedDict() for stage in self._timeouts
        }
        self._evicted: Counter[Pool] = Counter()
        # The unauthenticated pool again, by progress: in all, and by peer (the eviction order).
        self._progress: _Ordered = {progress: OrderedDict() for progress in _Progress}
        self._progress_by_peer: dict[str, _Ordered] = {}

    def admit(self, conn: int, peer: str, now: float) -> Eviction | None:
        """A newly accepted connection, sniffing until ``now`` + the sniff deadline; it always gets
        in."""
        if conn in self._entries:
            raise ValueError(f"connection {conn} is already admitted")
        outcome = self._make_room(Pool.UNAUTHENTICATED, peer, now)
        assert not isinstance(outcome, Refused)  # unauthenticated caps are at least 1
        self._insert(conn, _Entry(peer, Stage.SNIFFING), now)
        return outcome

    def handshake(self, conn: int, now: float) -> None:
        """``conn`` was routed to a framed channel: it stays unauthenticated, now under the
        handshake deadline."""
        entry = self._entries[conn]
        if entry.stage is not Stage.SNIFFING:
            raise ValueError(f"connection {conn} is {entry.stage.value}, not sniffing")
        del self._due[Stage.SNIFFING][conn]
        entry.stage = Stage.HANDSHAKING
        self._due[Stage.HANDSHAKING][conn] = now + self._timeouts[Stage.HANDSHAKING]
        self._move(conn, entry, _Progress.ROUTED)

    def answered(self, conn: int, now: float, *, grace: float) -> None:
        """``conn``'s hello was accepted (our answer goes out now or later): until ``now`` +
        ``grace`` a full cap evicts it last. Its deadline holds; an untracked one is ignored."""
        entry = self._entries.get(conn)
        if entry is None or entry.stage is not Stage.HANDSHAKING:
            return
        entry.grace_until = now + grace
        self._move(conn, entry, _Progress.ANSWERED)

    def to_status(self, conn: int) -> Eviction | Refused | None:
        """``conn`` was routed to status HTTP: it moves to the status budget (refused: it stays
        where it was)."""
        entry = self._entries[conn]
        if entry.stage is not Stage.SNIFFING:
            raise ValueError(f"connection {conn} is {entry.stage.value}, not sniffing")
        outcome = self._make_room(Pool.STATUS, entry.peer, 0.0)
        if isinstance(outcome, Refused):
            return outcome
        self._remove(conn)
        self._insert(conn, _Entry(entry.peer, Stage.STATUS), 0.0)
        return outcome

    def to_store(self, conn: int) -> Refused | None:
        """``conn`` was routed to the store: it moves to the store's budget, or is refused (it
        stays where it was; a full store cap never evicts a rank's connection)."""
        return self._move_held(conn, Stage.SNIFFING, Stage.STORE)

    def to_stream(self, conn: int) -> Refused | None:
        """``conn``, a status connection, asked for the event stream: it moves to the stream
        budget, or is refused (it stays a status connection; a full cap never evicts a stream)."""
        return self._move_held(conn, Stage.STATUS, Stage.STREAM)

    def _move_held(self, conn: int, source: Stage, target: Stage) -> Refused | None:
        """Move ``conn`` from ``source`` into a pool whose full cap refuses newcomers."""
        entry = self._entries[conn]
        if entry.stage is not source:
            raise ValueError(f"connection {conn} is {entry.stage.value}, not {source.value}")
        pool = _POOL_OF[target]
        mine = self._by_peer[pool].get(entry.peer, ())
        # the total first: once fitted to the descriptor limit it is what a refusal must name
        for cap, held in ((Cap.TOTAL, len(self._oldest[pool])), (Cap.PER_PEER, len(mine))):
            limit = self.limits.cap(pool, cap)
            if held >= limit:
                return Refused(pool=pool, cap=cap, limit=limit, peer=entry.peer)
        self._remove(conn)
        self._insert(conn, _Entry(entry.peer, target), 0.0)
        return None

    def release(self, conn: int) -> Stage | None:
        """Forget ``conn`` (it authenticated, closed or was dropped); the stage it was in, or None
        if untracked."""
        entry = self._entries.get(conn)
        if entry is None:
            return None
        self._remove(conn)
        return entry.stage

    def expire(self, now: float) -> list[Expired]:
        """Forget and name every connection whose stage's deadline is at or before ``now``."""
        expired: list[Expired] = []
        for stage, due in self._due.items():
            while due:
                conn, at = next(iter(due.items()))
                if at > now:
                    break
                self._remove(conn)
                expired.append(Expired(conn=conn, stage=stage))
        return expired

    def next_deadline(self) -> float | None:
        """When :meth:`expire` next has something to say, or None while no connection has a
        deadline."""
        heads = [next(iter(due.values())) for due in self._due.values() if due]
        return min(heads) if heads else None

    def stage(self, conn: int) -> Stage | None:
        """Where ``conn`` is, or None if admission does not track it."""
        entry = self._entries.get(conn)
        return None if entry is None else entry.stage

    def count(self, pool: Pool, peer: str | None = None) -> int:
        """Connections in ``pool`` now (of ``peer``, if given)."""
        if peer is None:
            return len(self._oldest[pool])
        return len(self._by_peer[pool].get(peer, ()))

    def conns(self) -> list[int]:
        """Every tracked connection, oldest first within each pool."""
        return [conn for pool in Pool for conn in self._oldest[pool]]

    def statistics(self) -> AdmissionStatistics:
        """A snapshot of the gauges and eviction counts."""
        return AdmissionStatistics(
            sniffing=len(self._due[Stage.SNIFFING]),
            handshaking=len(self._due[Stage.HANDSHAKING]),
            status=len(self._oldest[Pool.STATUS]),
            store=len(self._oldest[Pool.STORE]),
            streams=len(self._oldest[Pool.STREAM]),
            evicted={pool.value: n for pool, n in self._evicted.items()},
        )

    # ----- internals -----------------------------------------------------------------------------

    def _make_room(self, pool: Pool, peer: str, now: float) -> Eviction | Refused | None:
        per_peer = self.limits.cap(pool, Cap.PER_PEER)
        if per_peer == 0:
            return Refused(pool=pool)
        mine = self._by_peer[pool].get(peer)
        # The per-peer cap first: a flooding peer evicts its own oldest and leaves the others alone.
        # After that the pool has room unless it is full in total, so at most one connection goes.
        if mine is not None and len(mine) >= per_peer:
            cap = Cap.PER_PEER
            victim = (
                self._least_progressed(self._progress_by_peer[peer], now)
                if pool is Pool.UNAUTHENTICATED
                else next(iter(mine))
            )
        elif len(self._oldest[pool]) >= self.limits.cap(pool, Cap.TOTAL):
            cap = Cap.TOTAL
            victim = (
                self._least_progressed(self._progress, now)
                if pool is Pool.UNAUTHENTICATED
                else next(iter(self._oldest[pool]))
            )
        else:
            return None
        victim_peer = self._entries[victim].peer
        self._remove(victim)
        self._evicted[pool] += 1
        return Eviction(
            conn=victim, peer=victim_peer, pool=pool, cap=cap, limit=self.limits.cap(pool, cap)
        )

    def _least_progressed(self, by_progress: _Ordered, now: float) -> int:
        """The oldest silent, else the oldest overdue for its proof, else the oldest routed, else
        the oldest answered (grace notwithstanding: the newcomer always gets in)."""
        silent, routed, answered = (by_progress.get(p) for p in _Progress)
        if silent:
            return next(iter(silent))
        if answered:
            oldest = next(iter(answered))
            if self._entries[oldest].grace_until <= now or not routed:
                return oldest
        assert routed  # the scope is full, so it holds at least one connection
        return next(iter(routed))

    def _move(self, conn: int, entry: _Entry, progress: _Progress) -> None:
        self._unlist(conn, entry)
        entry.progress = progress
        self._list(conn, entry)

    def _list(self, conn: int, entry: _Entry) -> None:
        self._progress[entry.progress][conn] = None
        mine = self._progress_by_peer.setdefault(entry.peer, {})
        mine.setdefault(entry.progress, OrderedDict())[conn] = None

    def _unlist(self, conn: int, entry: _Entry) -> None:
        del self._progress[entry.progress][conn]
        mine = self._progress_by_peer[entry.peer]
        listed = mine[entry.progress]
        del listed[conn]
        if not listed:
            del mine[entry.progress]
            if not mine:
                del self._progress_by_peer[entry.peer]

    def _insert(self, conn: int, entry: _Entry, now: float) -> None:
        pool = _POOL_OF[entry.stage]
        self._entries[conn] = entry
        self._oldest[pool][conn] = None
        self._by_peer[pool].setdefault(entry.peer, OrderedDict())[conn] = None
        if entry.stage in self._due:
            self._due[entry.stage][conn] = now + self._timeouts[entry.stage]
        if pool is Pool.UNAUTHENTICATED:
            self._list(conn, entry)

    def _remove(self, conn: int) -> None:
        entry = self._entries.pop(conn)
        pool = _POOL_OF[entry.stage]
        del self._oldest[pool][conn]
        mine = self._by_peer[pool][entry.peer]
        del mine[conn]
        if not mine:
            del self._by_peer[pool][entry.peer]
        due = self._due.get(entry.stage)
        if due is not None:
            del due[conn]
        if pool is Pool.UNAUTHENTICATED:
            self._unlist(conn, entry)


class TicketState(enum.Enum):
    """What a ticket has been told."""

    PENDING = "pending"
    AUTHENTICATED = "authenticated"
    REJECTED = "rejected"


class AdmissionTicket:
    """One routed connection's admission, handed to its protocol by ``bind_admission(ticket)``.

    The mux binds it before ``connection_made``. The protocol calls :meth:`authenticated` once
    the peer proved the key, or :meth:`rejected` when the peer turned out bad; until the first,
    the connection counts against the unauthenticated caps and must authenticate within the
    handshake deadline, or the mux aborts it (``handshake_timeout``). The protocol hands its
    answer to the peer's hello to :meth:`answer`, which the mux may delay (the proof throttle).
    """

    __slots__ = ("_on_answer", "_on_authenticated", "_on_rejected", "_state")

    def __init__(
        self,
        *,
        on_authenticated: Callable[[], None],
        on_rejected: Callable[[str, str], None],
        on_answer: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        """``on_answer(write)``: the mux's say in when the answer to the peer's hello goes out (it
        calls ``write`` now or after the proof throttle's delay); None writes it at once."""
        self._on_authenticated = on_authenticated
        self._on_rejected = on_rejected
        self._on_answer = on_answer
        self._state = TicketState.PENDING

    @property
    def state(self) -> TicketState:
        """What the protocol has reported so far."""
        return self._state

    def answer(self, write: Callable[[], None]) -> None:
        """The peer's hello was accepted: ``write()`` sends our answer (the server's proof), at once
        or after the delay the proof throttle gives the peer's address; never both, and never
        after the connection was closed (the closer counted why)."""
        if self._on_answer is None or self._state is not TicketState.PENDING:
            write()
        else:
            self._on_answer(write)

    def authenticated(self) -> None:
        """The peer proved the key: stop counting it as unauthenticated, cancel its handshake
        deadline. Idempotent."""
        if self._state is TicketState.PENDING:
            self._state = TicketState.AUTHENTICATED
            self._on_authenticated()

    def rejected(self, reason: str, detail: str) -> None:
        """The peer is bad: count it under ``reason`` (summarised in the log, never a line each) and
        forget it.

        The protocol aborts its transport itself. Only the first call counts; one after
        :meth:`authenticated` (a bad frame from an authenticated peer) counts too.
        """
        if self._state is not TicketState.REJECTED:
            self._state = TicketState.REJECTED
            self._on_rejected(reason, detail)


def rejection_reason(exc: WireError) -> str:
    """The counter a connection whose handshake or frames failed with ``exc`` is refused under."""
    if isinstance(exc, VersionMismatch):
        return "version_mismatch"
    if isinstance(exc, WrongToken):
        return "wrong_token"
    if isinstance(exc, AuthenticationFailed):
        return "auth_failed"
    if isinstance(exc, HandshakeRefused):
        return "refused_credential"
    if isinstance(exc, HandshakeFailed):
        return "bad_handshake"
    return "bad_frame"
