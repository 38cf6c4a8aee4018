"""The one-port mux: one listening socket, connections routed by their first four bytes, admission
enforced.

Theory of operation. Each accepted connection starts under a small sniffing protocol. When
:func:`~flodl_async.wire.channels.sniff` names a channel, the transport is handed to that
channel's protocol (``transport.set_protocol``) together with the bytes that followed the magic,
so the hot path runs on plain ``asyncio.Protocol`` callbacks with no extra copy or task; a thin
watcher in between (:mod:`flodl_async.net.handover`) only forwards them and notices the close.

Until its peer proves the key, a connection is under admission
(:mod:`flodl_async.net.admission`): capped per peer address and in total, the oldest evicted
when a cap is full, with a deadline for the magic and another for the handshake. A framed
channel's protocol is told of its connection's admission through an
:class:`~flodl_async.net.admission.AdmissionTicket` — ``protocol.bind_admission(ticket)``,
before ``connection_made`` — and calls ``ticket.authenticated()`` once the peer proved the key,
or ``ticket.rejected(reason, detail)``. A protocol without ``bind_admission`` on a framed
channel cannot say when its peer authenticated, so its connections are admitted once routed,
as before admission existed. Status HTTP, which proves nothing, has its own small budget until
its connection closes, and a request for the live event stream moves its connection to the
stream budget (the protocol asks through the ``bind_stream`` hook, and answers 503 when
refused); so has the TCPStore channel (torch's client carries no credential), whose cap turns
newcomers away rather than evict a rank's connection, and whose total is fitted to the
descriptor limit when the port starts, so held store connections leave room for the rest.

Two more guards sit in front of admission. The accept-rate breaker
(:mod:`flodl_async.net.arrivals`) closes a connection at once, before any admission or sniffing
work, when its address opens them faster than the port can afford (``churning``); and the proof
throttle (:mod:`flodl_async.net.proofthrottle`) holds back the answer to a hello from an address
whose handshakes failed their proofs (the ticket's ``answer``): a timer writes it later, or the
connection is closed first by whatever ends it (eviction, its deadline, its peer), and counted.

Every refusal (unknown magic, silence, an early close, no handler, eviction, a handshake that
timed out or failed) closes that one connection and is counted by reason
(:meth:`PortMux.statistics`,
``/state.json``); the log gets at most one summary line per interval, never a line per
connection, and a clear one when accept() runs out of descriptors. The accept path never
waits on any peer.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import errno
import functools
import ipaddress
import logging
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass

from ..deadlines import Deadlines
from ..errors import ConfigError, PortInUseError
from ..wire.channels import MAGIC_LEN, UNCONSUMED, Channel, NeedMore, Routed, sniff
from .admission import (
    Admission,
    AdmissionLimits,
    AdmissionTicket,
    Cap,
    Eviction,
    Refused,
    Stage,
    peer_key,
)
from .arrivals import ArrivalBreaker, ArrivalPolicy
from .fdlimit import AcceptFailureHook, DescriptorLimit, accept_advice, descriptor_limit
from .handover import feed, watch
from .loop import WakeUp
from .proofthrottle import ProofThrottle, ThrottlePolicy
from .refusals import SUMMARY_INTERVAL, RejectionSummary, SummaryLine

log = logging.getLogger("flodl_async.mux")

ProtocolFactory = Callable[[], asyncio.BaseProtocol]

#: Longest prefix we buffer while sniffing: the magic is 4 bytes, more is a peer that talks past it.
_MAX_SNIFF_BYTES = 64 * 1024
#: A delayed answer comes at most this share of the handshake deadline after the hello: the rest
#: is the client's, to prove.
_MAX_DELAY_SHARE = 0.4
#: An answered connection's grace against eviction, beyond its delay, as a share of that deadline.
_PROOF_GRACE_SHARE = 0.2


@dataclass(frozen=True, slots=True, kw_only=True)
class MuxStatistics:
    """A snapshot of what the mux has seen since it started, and what it holds now."""

    accepted: int
    routed: dict[str, int]
    #: Connections closed by the mux or refused by their protocol, by reason (cumulative).
    dropped: dict[str, int]
    #: accept() failures by errno name (EMFILE...): connections the process had no descriptor for.
    accept_errors: dict[str, int]
    #: Connections open now: unauthenticated, status and authenticated.
    open_now: int
    #: Connections that have not sent their channel magic yet.
    unsniffed_now: int
    #: Connections routed to a framed channel whose peer has not proved the key yet.
    handshaking_now: int
    #: Status HTTP connections open now.
    status_now: int
    #: TCPStore connections open now.
    store_now: int = 0
    #: Live event streams (``/events``) open now.
    streams_now: int = 0
    #: The proof throttle: ``failed_proofs``, ``delayed_answers`` (cumulative), ``addresses_now``.
    throttle: dict[str, int] = dataclasses.field(default_factory=dict)
    #: The accept-rate breaker: ``closed`` (cumulative, also ``dropped["churning"]``),
    #: ``addresses_now``.
    breaker: dict[str, int] = dataclasses.field(default_factory=dict)


def check_bind_host(host: str) -> str:
    """Only the wildcard address or a loopback address may be bound: the port faces only the
    networks the operator chose."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(
            f"bind address {host!r} is not an IP address; use 0.0.0.0 (all interfaces) or "
            "127.0.0.1 (loopback only)"
        ) from None
    if not (address.is_unspecified or address.is_loopback):
        raise ConfigError(
            f"bind address {host} is neither the wildcard nor loopback; use 0.0.0.0 (all "
            "interfaces) or 127.0.0.1 (loopback only)"
        )
    return host


class PortMux:
    """Owns the controller's listening socket, admits connections and routes them to channel
    handlers."""

    def __init__(
        self,
        *,
        host: str = "0.0.0.0",
        port: int = 1337,
        sniff_timeout: float | None = None,
        handshake_timeout: float | None = None,
        limits: AdmissionLimits | None = None,
        summary_interval: float = SUMMARY_INTERVAL,
        throttle: ThrottlePolicy | None = None,
        arrivals: ArrivalPolicy | None = None,
    ) -> None:
        self._host = check_bind_host(host)
        self._port = port
        defaults = (
            Deadlines.resolve()
            if sniff_timeout is None or handshake_timeout is None
            else Deadlines()
        )
        self._sniff_timeout = defaults.sniff if sniff_timeout is None else sniff_timeout
        self._handshake_timeout = (
            defaults.handshake if handshake_timeout is None else handshake_timeout
        )
        self._limits = limits or AdmissionLimits()
        self._admission = Admission(
            self._limits,
            sniff_timeout=self._sniff_timeout,
            handshake_timeout=self._handshake_timeout,
        )
        self._summary = RejectionSummary(interval=summary_interval)
        self._throttle = ProofThrottle(
            (throttle or ThrottlePolicy()).capped_at(self._handshake_timeout * _MAX_DELAY_SHARE)
        )
        self._proof_grace = self._handshake_timeout * _PROOF_GRACE_SHARE
        self._breaker = ArrivalBreaker(arrivals)
        self._handlers: dict[Channel, ProtocolFactory] = {}
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: What to close for each connection admission tracks, by connection id.
        self._held: dict[int, _Sniffer | _Routed] = {}
        self._next_conn = 0
        self._open = 0
        self._routed_transports: set[asyncio.BaseTransport] = set()
        self._prune_at = 1024
        self._accepted = 0
        self._routed: collections.Counter[str] = collections.Counter()
        self._accept_errors: collections.Counter[str] = collections.Counter()
        self._unbound_channels: set[Channel] = set()
        self._deadlines_due = WakeUp(self._on_deadline)  # the admission core's next deadline
        self._summary_due = WakeUp(self._report)  # the rejection summary's next line
        self._fd_limit = DescriptorLimit(soft=None, hard=None)
        self._fd_warn_at = math.inf
        self._accept_hook = AcceptFailureHook(self._accept_failed)
        #: Whether the descriptor limit lowered the store's total cap (a refusal says so).
        self._store_fitted = False

    def register(self, channel: Channel, factory: ProtocolFactory) -> None:
        """Route ``channel`` to protocols made by ``factory`` (called once per connection)."""
        self._handlers[channel] = factory

    async def start(self) -> None:
        """Bind and listen. A port held by a live listener raises :class:`PortInUseError`."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._fd_limit = descriptor_limit()
        fitted = self._limits.within_descriptors(self._fd_limit.soft)
        if fitted != self._limits:
            log.debug(
                "port mux: at most %d store connections (%d asked for): the descriptor limit (%s) "
                "keeps the rest for the other channels",
                fitted.max_store,
                self._limits.max_store,
                self._fd_limit.describe(),
            )
            self._limits = fitted
            self._store_fitted = True
            # nothing is admitted before the port listens: the bookkeeper starts over with the caps
            self._admission = Admission(
                fitted, sniff_timeout=self._sniff_timeout, handshake_timeout=self._handshake_timeout
            )
        if self._fd_limit.soft is not None:
            # Past this many open connections the process is close to its limit (its other files,
            # pipes and the loop's own descriptors need the rest): warn before accept() fails.
            self._fd_warn_at = self._fd_limit.soft - max(64, self._fd_limit.soft // 8)
        try:
            # reuse_address: a previous run's TIME_WAIT sockets never block a rebind,
            # while a live listener still makes bind fail (the double-run guard).
            self._server = await loop.create_server(
                lambda: _Sniffer(self), self._host, self._port, reuse_address=True, backlog=1024
            )
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(self._host, self._port) from exc
            raise ConfigError(
                f"cannot listen on {self._host}:{self._port}: {exc.strerror or exc}"
            ) from exc
        # accept() failing for want of descriptors becomes one summary line that names the limit
        self._accept_hook.install(loop, self._server)

    @property
    def port(self) -> int:
        """The bound port (useful with ``port=0``)."""
        if self._server is None:
            raise RuntimeError("mux not started")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def serving(self) -> bool:
        """True between :meth:`start` and :meth:`aclose`."""
        return self._server is not None and self._server.is_serving()

    @property
    def host(self) -> str:
        """The bound address."""
        return self._host

    @property
    def sniff_timeout(self) -> float:
        """Seconds a new connection has to send its channel magic."""
        return self._sniff_timeout

    @property
    def handshake_timeout(self) -> float:
        """Seconds a connection routed to a framed channel has to authenticate."""
        return self._handshake_timeout

    @property
    def limits(self) -> AdmissionLimits:
        """The admission caps."""
        return self._limits

    def statistics(self) -> MuxStatistics:
        """What the mux has accepted, routed and dropped so far, and what it holds now."""
        admission = self._admission.statistics()
        throttle, breaker = self._throttle.statistics(), self._breaker.statistics()
        return MuxStatistics(
            accepted=self._accepted,
            routed=dict(self._routed),
            dropped=self._summary.totals(),
            accept_errors=dict(self._accept_errors),
            open_now=self._open,
            unsniffed_now=admission.sniffing,
            handshaking_now=admission.handshaking,
            status_now=admission.status,
            store_now=admission.store,
            streams_now=admission.streams,
            throttle={
                "failed_proofs": throttle.failed_proofs,
                "delayed_answers": throttle.delayed_answers,
                "addresses_now": throttle.addresses_now,
            },
            breaker={"closed": breaker.closed, "addresses_now": breaker.addresses_now},
        )

    async def aclose(self) -> None:
        """Stop accepting, then close every connection the mux accepted that is still open."""
        if self._server is not None:
            self._server.close()
        for conn, held in list(self._held.items()):
            self._admission.release(conn)
            held.abort()
        self._held.clear()
        for transport in list(self._routed_transports):
            if not transport.is_closing():
                transport.close()
        self._routed_transports.clear()
        self._deadlines_due.cancel()
        self._summary_due.cancel()
        if self._loop is not None:
            line = self._summary.flush(self._loop.time())  # nothing refused goes unreported
            if line is not None:
                _log_summary(line)
            self._accept_hook.uninstall(self._loop)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    # ----- admission ---------------------------------------------------------------------------

    def _now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    def _admit(self, sniffer: _Sniffer, host: str) -> int:
        """A new connection: admitted (always; the oldest may make room), under the sniff
        deadline; or, from an address that churns, closed at once (-1)."""
        now = self._now()
        self._accepted += 1
        peer = sniffer.peer = peer_key(host)
        if not self._breaker.arrive(peer, now):
            # no admission, eviction or log line: what the flood costs the loop stays small
            rate = self._breaker.policy.rate
            self._summary.record(
                "churning",
                now,
                note=f"closing new connections at once: more than {rate:g} a second from {peer}",
            )
            sniffer.abort()
            self._report(now)
            return -1
        self._open += 1
        conn = self._next_conn
        self._next_conn += 1
        eviction = self._admission.admit(conn, peer, now)
        self._held[conn] = sniffer
        if eviction is not None:
            self._evict(eviction)
        self._arm_deadline()
        if self._open >= self._fd_warn_at:
            self._summary.note(
                f"near the descriptor limit: more than {int(self._fd_warn_at)} connections open "
                f"({self._fd_limit.describe()}); "
                "more will fail: raise `ulimit -n`",
                now,
            )
            self._report(now)
        return conn

    def _evict(self, eviction: Eviction) -> None:
        self._end(
            eviction.conn,
            "evicted",
            f"{eviction.describe()} ({eviction.cap.value} cap)",
            note=eviction.describe(),
        )

    def _end(self, conn: int, reason: str, why: str, *, note: str = "") -> None:
        """Close a connection admission tracks, and count it under ``reason``."""
        self._admission.release(conn)
        held = self._held.pop(conn, None)
        if held is None:
            return
        self._refuse(reason, held.label, why, note=note)
        held.abort()

    def _refuse(self, reason: str, label: str, why: str, *, note: str = "") -> None:
        now = self._now()
        self._summary.record(reason, now, note=note)
        log.debug("port mux: dropping connection from %s (%s: %s)", label, reason, why)
        self._report(now)

    def _arm_deadline(self) -> None:
        assert self._loop is not None
        self._deadlines_due.arm(self._loop, self._admission.next_deadline())

    def _on_deadline(self, now: float) -> None:
        for expired in self._admission.expire(now):
            if expired.stage is Stage.SNIFFING:
                self._end(
                    expired.conn,
                    "sniff_timeout",
                    f"no channel magic within {self._sniff_timeout:g}s",
                )
            else:
                held = self._held.get(expired.conn)
                if held is not None and held.answered:
                    self._throttle.failed(held.peer, now)
                self._end(
                    expired.conn,
                    "handshake_timeout",
                    f"not authenticated within {self._handshake_timeout:g}s",
                )
        self._arm_deadline()

    def _report(self, now: float) -> None:
        line = self._summary.due(now)
        if line is not None:
            _log_summary(line)
        assert self._loop is not None
        self._summary_due.arm(self._loop, self._summary.next_due())

    def _accept_failed(self, exc: OSError) -> None:
        code = exc.errno if exc.errno is not None else 0
        self._accept_errors[errno.errorcode.get(code, str(code))] += 1
        now = self._now()
        self._summary.note(accept_advice(code, self._fd_limit), now)
        self._report(now)

    # ----- routing (called by _Sniffer) --------------------------------------------------------

    def _route(self, sniffer: _Sniffer, transport: asyncio.Transport, routed: Routed) -> None:
        conn = sniffer.conn
        factory = self._handlers.get(routed.channel)
        if factory is None:
            self._end(conn, "no_handler", f"no {routed.channel.value} service in this run")
            return
        protocol = factory()
        record = _Routed(conn, transport, sniffer.label, sniffer.peer)
        ticket: AdmissionTicket | None = None
        binds = callable(getattr(protocol, "bind_admission", None))
        if routed.channel is Channel.STORE:
            if not self._to_store(record):
                return
            if binds:
                ticket = AdmissionTicket(
                    on_authenticated=_held_until_closed,
                    on_rejected=functools.partial(self._rejected, record),
                )
        elif binds:
            ticket = self._handshake(record)
        elif routed.channel is Channel.STATUS:
            outcome = self._admission.to_status(conn)
            if isinstance(outcome, Refused):
                self._end(conn, "over_capacity", "status HTTP is switched off (status cap 0)")
                return
            self._held[conn] = record
            if outcome is not None:
                self._evict(outcome)
            bind_stream = getattr(protocol, "bind_stream", None)
            if callable(bind_stream):
                bind_stream(functools.partial(self._to_stream, record))
        else:
            self._admit_unbound(record, routed.channel)
        self._routed[routed.channel.value] += 1
        sniffer.handed_over = True
        transport.set_protocol(watch(protocol, functools.partial(self._routed_lost, record)))
        self._track(transport)
        if ticket is not None:
            typing.cast(_BindsAdmission, protocol).bind_admission(ticket)
        protocol.connection_made(transport)
        if routed.leftover and not transport.is_closing():
            feed(protocol, routed.leftover)
        if (
            sniffer.saw_eof
            and not transport.is_closing()
            and not typing.cast(asyncio.Protocol, protocol).eof_received()
        ):
            transport.close()

    def _to_store(self, record: _Routed) -> bool:
        refused = self._admission.to_store(record.conn)
        if refused is None:
            self._held[record.conn] = record
            return True
        advice = (
            f"; the descriptor limit ({self._fd_limit.describe()}) sets it: raise `ulimit -n`"
            if refused.cap is Cap.TOTAL and self._store_fitted
            else ""
        )
        self._end(
            record.conn,
            "store_over_capacity",
            f"{refused.describe()} ({refused.cap.value} cap)",
            note=refused.describe() + advice,
        )
        return False

    def _to_stream(self, record: _Routed) -> str | None:
        """A status connection asks to become an event stream: None when admitted to the stream
        budget, else why not (counted; the protocol answers 503 and closes)."""
        if record.ended or self._admission.stage(record.conn) is not Stage.STATUS:
            return "the connection is closing"
        refused = self._admission.to_stream(record.conn)
        if refused is not None:
            why = refused.describe()
            self._refuse("stream_over_capacity", record.label, why, note=why)
            return why
        return None

    def _handshake(self, record: _Routed) -> AdmissionTicket:
        self._admission.handshake(record.conn, self._now())
        self._held[record.conn] = record
        self._arm_deadline()
        return AdmissionTicket(
            on_authenticated=functools.partial(self._authenticated, record),
            on_rejected=functools.partial(self._rejected, record),
            on_answer=functools.partial(self._answer, record),
        )

    def _answer(self, record: _Routed, write: Callable[[], None]) -> None:
        """The peer's hello was accepted: our answer goes out now, or after the proof throttle's
        delay for its address (a connection closed meanwhile was counted by its closer)."""
        if record.ended:
            return
        now = self._now()
        delay = self._throttle.delay(record.peer, now)
        self._admission.answered(record.conn, now, grace=delay + self._proof_grace)
        if delay <= 0.0:
            record.answered = True
            write()
            return
        assert self._loop is not None
        record.timer = self._loop.call_later(delay, self._answer_late, record, write)

    def _answer_late(self, record: _Routed, write: Callable[[], None]) -> None:
        record.timer = None
        if record.ended or record.transport.is_closing():
            return
        record.answered = True
        write()

    def _admit_unbound(self, record: _Routed, channel: Channel) -> None:
        # A protocol that cannot report its handshake: nothing would ever end the deadline, so
        # the connection is admitted as it is routed (the framed protocols bind a ticket).
        if channel not in self._unbound_channels:
            self._unbound_channels.add(channel)
            log.debug(
                "port mux: the %s channel's protocol has no bind_admission: its connections are "
                "admitted once routed",
                channel.value,
            )
        self._admission.release(record.conn)
        self._held.pop(record.conn, None)

    def _authenticated(self, record: _Routed) -> None:
        if record.ended:
            return  # too late: the mux already closed it
        self._admission.release(record.conn)
        self._held.pop(record.conn, None)
        self._throttle.succeeded(record.peer)

    def _rejected(self, record: _Routed, reason: str, detail: str) -> None:
        if record.ended:
            return  # the mux closed it first and counted that
        record.ended = True
        self._admission.release(record.conn)
        self._held.pop(record.conn, None)
        if record.answered:  # it had our proof and did not prove: a guess, or the wrong key
            self._throttle.failed(record.peer, self._now())
        self._refuse(reason, record.label, detail)

    def _routed_lost(self, record: _Routed) -> None:
        self._open -= 1
        stage = self._admission.release(record.conn)
        if stage is None:
            return
        self._held.pop(record.conn, None)
        if stage is Stage.HANDSHAKING and not record.ended:
            record.ended = True
            record.cancel_timer()
            if record.answered:
                self._throttle.failed(record.peer, self._now())
            self._refuse("early_close", record.label, "closed before authenticating")

    def _sniffer_lost(self, sniffer: _Sniffer) -> None:
        if sniffer.conn < 0:
            return  # the breaker closed it: it was never counted open
        self._open -= 1
        self._end(sniffer.conn, "early_close", "connection lost before sending a channel magic")

    def _track(self, transport: asyncio.BaseTransport) -> None:
        self._routed_transports.add(transport)
        if len(self._routed_transports) >= self._prune_at:
            self._routed_transports = {t for t in self._routed_transports if not t.is_closing()}
            self._prune_at = max(1024, 2 * len(self._routed_transports))


def _log_summary(line: SummaryLine) -> None:
    log.log(logging.WARNING if line.warning else logging.INFO, "%s", line.text)


def _held_until_closed() -> None:
    """A store connection's ticket: the magic was its VALIDATE, and it stays in the store's pool
    until it closes."""


class _BindsAdmission(typing.Protocol):
    def bind_admission(self, ticket: AdmissionTicket) -> None: ...


class _Routed:
    """A routed connection, for as long as admission tracks it (handshake or status)."""

    __slots__ = ("answered", "conn", "ended", "label", "peer", "timer", "transport")

    def __init__(self, conn: int, transport: asyncio.Transport, label: str, peer: str) -> None:
        self.conn = conn
        self.transport = transport
        self.label = label
        self.peer = peer
        self.ended = False
        #: Our answer to its hello (with our proof) was written.
        self.answered = False
        #: The proof throttle's pending answer.
        self.timer: asyncio.TimerHandle | None = None

    def cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def abort(self) -> None:
        self.ended = True
        self.cancel_timer()
        self.transport.abort()


class _Sniffer(asyncio.Protocol):
    """Holds a new connection until its first bytes name a channel (its deadline is admission's)."""

    def __init__(self, mux: PortMux) -> None:
        self._mux = mux
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self.conn = -1
        self.label = "?"
        self.peer = ""
        #: Never: a sniffer has not reached a handshake (a field the mux reads of either kind).
        self.answered = False
        self._done = False
        self.saw_eof = False
        self.handed_over = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = typing.cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) else ""
        self.label = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "local")
        self.conn = self._mux._admit(self, host)

    def data_received(self, data: bytes) -> None:
        if self._done:
            return
        self._buf += data
        self._classify()

    def _classify(self) -> None:
        result = sniff(bytes(self._buf[:_MAX_SNIFF_BYTES]))
        if isinstance(result, NeedMore):
            return
        if isinstance(result, Routed):
            self._done = True
            assert self._transport is not None
            leftover = (
                bytes(self._buf) if result.channel in UNCONSUMED else bytes(self._buf[MAGIC_LEN:])
            )
            self._buf.clear()
            self._mux._route(
                self, self._transport, Routed(channel=result.channel, leftover=leftover)
            )
            return
        self._mux._end(self.conn, "unknown_magic", result.reason)

    def eof_received(self) -> bool | None:
        self.saw_eof = True
        if not self._done:
            self._mux._end(
                self.conn,
                "early_close",
                f"closed after {len(self._buf)} bytes, before sending a channel magic",
            )
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.handed_over:
            self._mux._sniffer_lost(self)

    def abort(self) -> None:
        """Close at once (the mux counted why)."""
        self._done = True
        if self._transport is not None:
            self._transport.abort()
