"""The one-port mux: one listening socket, connections routed by their first four bytes.

Each accepted connection starts under a small sniffing protocol with a
deadline. When :func:`~flodl_async.wire.channels.sniff` names a channel, the
transport is handed to that channel's protocol (``transport.set_protocol``)
together with the bytes that followed the magic, so the hot path runs on
plain ``asyncio.Protocol`` callbacks with no extra copy or task. Unknown magic,
silence past the deadline, an early close, or a channel with no handler this
run closes that one connection, logs one line and counts it; the accept path
never waits on any peer.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import ipaddress
import logging
import typing
from collections.abc import Callable
from dataclasses import dataclass

from ..deadlines import Deadlines
from ..errors import ConfigError, PortInUseError
from ..wire.channels import Channel, NeedMore, Routed, sniff

log = logging.getLogger("flodl_async.mux")

ProtocolFactory = Callable[[], asyncio.BaseProtocol]

DEFAULT_MAX_UNSNIFFED = 512
#: Longest prefix we buffer while sniffing: the magic is 4 bytes, more is a peer that talks past it.
_MAX_SNIFF_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class MuxStatistics:
    """A snapshot of what the mux has seen since it started."""

    accepted: int
    routed: dict[str, int]
    dropped: dict[str, int]
    unsniffed_now: int


def check_bind_host(host: str) -> str:
    """Only the wildcard address or a loopback address may be bound (design §4 trust model)."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(f"bind address {host!r} is not an IP address; use 0.0.0.0 (all interfaces) or 127.0.0.1 (loopback only)") from None
    if not (address.is_unspecified or address.is_loopback):
        raise ConfigError(f"bind address {host} is neither the wildcard nor loopback; use 0.0.0.0 (all interfaces) or 127.0.0.1 (loopback only)")
    return host


class PortMux:
    """Owns the controller's listening socket and routes connections to channel handlers."""

    def __init__(
        self,
        *,
        host: str = "0.0.0.0",
        port: int = 1337,
        sniff_timeout: float | None = None,
        max_unsniffed: int = DEFAULT_MAX_UNSNIFFED,
    ) -> None:
        self._host = check_bind_host(host)
        self._port = port
        self._sniff_timeout = Deadlines.resolve().sniff if sniff_timeout is None else sniff_timeout
        self._max_unsniffed = max_unsniffed
        self._handlers: dict[Channel, ProtocolFactory] = {}
        self._server: asyncio.Server | None = None
        self._unsniffed: set[_Sniffer] = set()
        self._routed_transports: set[asyncio.BaseTransport] = set()
        self._prune_at = 1024
        self._accepted = 0
        self._routed: collections.Counter[str] = collections.Counter()
        self._dropped: collections.Counter[str] = collections.Counter()

    def register(self, channel: Channel, factory: ProtocolFactory) -> None:
        """Route ``channel`` to protocols made by ``factory`` (called once per connection)."""
        self._handlers[channel] = factory

    async def start(self) -> None:
        """Bind and listen. A port held by a live listener raises :class:`PortInUseError`."""
        loop = asyncio.get_running_loop()
        try:
            # reuse_address: a previous run's TIME_WAIT sockets never block a rebind,
            # while a live listener still makes bind fail (the double-run guard).
            self._server = await loop.create_server(lambda: _Sniffer(self), self._host, self._port, reuse_address=True, backlog=1024)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(self._host, self._port) from exc
            raise ConfigError(f"cannot listen on {self._host}:{self._port}: {exc.strerror or exc}") from exc

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

    def statistics(self) -> MuxStatistics:
        """What the mux has accepted, routed and dropped so far."""
        return MuxStatistics(
            accepted=self._accepted,
            routed=dict(self._routed),
            dropped=dict(self._dropped),
            unsniffed_now=len(self._unsniffed),
        )

    async def aclose(self) -> None:
        """Stop accepting, then close every connection the mux accepted that is still open."""
        if self._server is not None:
            self._server.close()
        for sniffer in list(self._unsniffed):
            sniffer.drop("mux closing", count=False)
        for transport in list(self._routed_transports):
            if not transport.is_closing():
                transport.close()
        self._routed_transports.clear()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    # ----- called by _Sniffer ---------------------------------------------------------------

    def _admit(self, sniffer: _Sniffer) -> bool:
        self._accepted += 1
        if len(self._unsniffed) >= self._max_unsniffed:
            return False
        self._unsniffed.add(sniffer)
        return True

    def _count_drop(self, reason: str) -> None:
        self._dropped[reason] += 1

    def _route(self, sniffer: _Sniffer, transport: asyncio.Transport, routed: Routed) -> None:
        self._unsniffed.discard(sniffer)
        factory = self._handlers.get(routed.channel)
        if factory is None:
            sniffer.drop(f"no {routed.channel.value} service in this run", reason="no_handler")
            return
        self._routed[routed.channel.value] += 1
        protocol = factory()
        transport.set_protocol(protocol)
        self._track(transport)
        protocol.connection_made(transport)
        if routed.leftover and not transport.is_closing():
            _feed(protocol, routed.leftover)
        if sniffer.saw_eof and not transport.is_closing() and not typing.cast(asyncio.Protocol, protocol).eof_received():
            transport.close()

    def _track(self, transport: asyncio.BaseTransport) -> None:
        self._routed_transports.add(transport)
        if len(self._routed_transports) >= self._prune_at:
            self._routed_transports = {t for t in self._routed_transports if not t.is_closing()}
            self._prune_at = max(1024, 2 * len(self._routed_transports))

    def _forget(self, sniffer: _Sniffer) -> None:
        self._unsniffed.discard(sniffer)

    @property
    def sniff_timeout(self) -> float:
        """Seconds a new connection has to send its channel magic."""
        return self._sniff_timeout


def _feed(protocol: asyncio.BaseProtocol, data: bytes) -> None:
    """Hand bytes the sniffer already read to a protocol, whichever read style it uses."""
    if isinstance(protocol, asyncio.BufferedProtocol):
        view = memoryview(data)
        while view:
            target = memoryview(protocol.get_buffer(len(view)))
            n = min(len(target), len(view))
            target[:n] = view[:n]
            protocol.buffer_updated(n)
            view = view[n:]
    else:
        typing.cast(asyncio.Protocol, protocol).data_received(data)


class _Sniffer(asyncio.Protocol):
    """Holds a new connection until its first bytes name a channel."""

    def __init__(self, mux: PortMux) -> None:
        self._mux = mux
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._peer = "?"
        self._done = False
        self.saw_eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = typing.cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self._peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if not self._mux._admit(self):
            self.drop(f"more than {self._mux._max_unsniffed} connections have not sent a channel magic yet", reason="over_capacity")
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._mux.sniff_timeout, self._expire)

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
            self._finish()
            assert self._transport is not None
            leftover = bytes(self._buf) if result.channel.value == "status" else bytes(self._buf[4:])
            self._mux._route(self, self._transport, Routed(channel=result.channel, leftover=leftover))
            return
        self.drop(result.reason, reason="unknown_magic")

    def eof_received(self) -> bool | None:
        self.saw_eof = True
        if not self._done:
            self.drop(f"closed after {len(self._buf)} bytes, before sending a channel magic", reason="early_close")
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._done:
            self.drop("connection lost before sending a channel magic", reason="early_close")

    def _expire(self) -> None:
        self._timer = None
        if not self._done:
            self.drop(f"no channel magic within {self._mux.sniff_timeout:g}s", reason="sniff_timeout")

    def _finish(self) -> None:
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._mux._forget(self)

    def drop(self, why: str, *, reason: str = "", count: bool = True) -> None:
        """Close this connection, log one line, and count it under ``reason``."""
        if self._done and reason != "no_handler":
            return
        self._finish()
        if count:
            self._mux._count_drop(reason)
            log.info("port mux: dropping connection from %s (%s); continuing to accept", self._peer, why)
        if self._transport is not None:
            self._transport.abort()
