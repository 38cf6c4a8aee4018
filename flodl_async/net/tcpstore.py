"""The asyncio shell around :mod:`flodl_async.wire.storeproto`: a TCPStore server in the agent's
loop, and the per-client protocol the controller's port store shares with it.

Theory of operation. :class:`StoreClients` holds one store's state and its open client
connections: it routes each reply to the connection it is for and tells the state how many
reply bytes each transport still holds unsent (the budget for clients that do not read).
:class:`StoreClientProtocol` serves one connection: it pauses reading while its transport's
write buffer is above the high-water mark and asks the parser for the requests it held back
once there is room again. A client that breaks the protocol or a limit is refused: counted by
reason, logged once per address with what it did, and closed (gracefully when nothing of ours
is still unsent to it, else at once). Torch's TCPStore protocol has no error reply — torch's
own server closes the connection too — so the close is how the client is told: its next
request fails with ``DistNetworkError`` (``Connection reset by peer`` or ``Broken pipe``, or
``Failed to recv, got 0 bytes``). The store's other keys are untouched.

A store with a :class:`~flodl_async.net.storegate.StoreGate` judges each connection by who made
it before it reads a byte: one from this host is served only to the run's processes, any other
is refused the same way (``store_foreign_uid``, ``store_not_run``, ``store_owner_unknown``), its
requests unread.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import typing

from ..wire.storeproto import (
    StoreConnection,
    StoreLimitExceeded,
    StoreLimits,
    StoreProtocolError,
    StoreState,
)
from .storegate import Standing, StoreGate, describe_peer

log = logging.getLogger("flodl_async.net.torchstore")

#: Addresses whose refusals one store logs by name; later offenders are only counted, so a flood
#: of addresses (IPv6) cannot grow the set or the log.
MAX_NAMED_OFFENDERS = 256


def refusal_reason(exc: StoreProtocolError) -> str:
    """The counter a store client refused for ``exc`` is counted under."""
    return "store_limit" if isinstance(exc, StoreLimitExceeded) else "store_protocol"


class StoreClients:
    """One store's state and its open client connections."""

    def __init__(
        self,
        *,
        limits: StoreLimits | None = None,
        subject: str = "store",
        gate: StoreGate | None = None,
    ) -> None:
        self.state = StoreState(limits)
        self._subject = subject
        #: Who on this host may connect (None: anyone the caller's own rule lets in).
        self.gate = gate
        self._protocols: dict[StoreConnection, StoreClientProtocol] = {}
        self._named: set[str] = set()
        self.refused: collections.Counter[str] = collections.Counter()

    @property
    def connections(self) -> int:
        """Store connections open now."""
        return len(self._protocols)

    def renew(self) -> None:
        """An empty store (same limits), every client closed."""
        self.state = StoreState(self.state.limits)
        self.close_all()

    def close_all(self) -> None:
        """Close every client at once: nothing it could still say matters."""
        protocols = list(self._protocols.values())
        self._protocols.clear()
        for protocol in protocols:
            protocol.abort()

    def attach(self, protocol: StoreClientProtocol) -> None:
        self._protocols[protocol.conn] = protocol

    def detach(self, protocol: StoreClientProtocol) -> None:
        if self._protocols.get(protocol.conn) is protocol:
            del self._protocols[protocol.conn]

    def deliver(self, replies: list[tuple[StoreConnection, bytes]]) -> None:
        """Write each reply to the connection it is for."""
        for conn, payload in replies:
            protocol = self._protocols.get(conn)
            if protocol is not None:
                protocol.send(payload)

    def names(self, host: str) -> bool:
        """Whether a refusal of ``host`` now would be logged (what costs a look-up to say is only
        looked up for a line that is written)."""
        return host not in self._named and len(self._named) < MAX_NAMED_OFFENDERS

    def record_refusal(self, host: str, label: str, reason: str, detail: str) -> None:
        """Count a refused client; the first refusal of each address is logged with what it did."""
        self.refused[reason] += 1
        if host in self._named:
            return
        if len(self._named) < MAX_NAMED_OFFENDERS:
            self._named.add(host)
            log.warning(
                "%s: closed the store connection of %s (%s): %s; the store's other keys are "
                "untouched (further refusals from %s are only counted)",
                self._subject,
                label,
                reason,
                detail,
                host,
            )


class StoreClientProtocol(asyncio.Protocol):
    """One client connection of a :class:`StoreClients` store."""

    def __init__(self, clients: StoreClients) -> None:
        self._clients = clients
        self.conn = StoreConnection(clients.state)
        self._transport: asyncio.Transport | None = None
        self.host = ""
        self.label = "an unknown peer"
        self._peer: tuple[str, int] | None = None
        self._ours: tuple[str, int] | None = None
        self._paused = False
        self._refused = False
        #: The gate's judgement of the peer (``REMOTE``: another host's, judged by its address).
        self.standing = Standing.SERVED
        #: Reply bytes the transport held unsent when last asked (what the state was told).
        self._unsent = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass it
        self._transport = typing.cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        ours = transport.get_extra_info("sockname")
        if isinstance(peer, tuple):
            self.host, self.label = str(peer[0]), f"{peer[0]}:{peer[1]}"
            self._peer = (str(peer[0]), int(peer[1]))
        if isinstance(ours, tuple):
            self._ours = (str(ours[0]), int(ours[1]))
        if self.accept():
            self._clients.attach(self)

    def accept(self) -> bool:
        """Whether this connection is served: the gate's judgement (a subclass adds its own)."""
        gate = self._clients.gate
        if gate is None or self._peer is None or self._ours is None:
            return True
        check = gate.check(self._peer, self._ours)
        self.standing = check.standing
        if not check.refused:
            return True
        # one line per address and user: every other user dialling loopback is named too
        offender = self.host or self.label
        if check.uid >= 0:
            offender = f"{offender} (uid {check.uid})"
        detail = gate.named(check) if self._clients.names(offender) else describe_peer(check)
        self.refuse(check.standing.value, detail, at_once=True, offender=offender)
        return False

    def data_received(self, data: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        self._serve(data)

    def _serve(self, data: bytes) -> None:
        assert self._transport is not None
        try:
            self._clients.deliver(self.conn.receive_data(data))
            while self.conn.wants_more and not self._paused and not self._transport.is_closing():
                self._clients.deliver(self.conn.receive_data(b""))
        except StoreProtocolError as exc:
            self.refuse(refusal_reason(exc), str(exc))

    def send(self, payload: bytes) -> None:
        """Write one reply; a client that leaves too much unread is refused."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        transport.write(payload)
        self._account()

    def _account(self) -> None:
        assert self._transport is not None
        unsent = self._transport.get_write_buffer_size()
        if unsent == self._unsent:
            return  # the usual case: the kernel took it all, as it took the last one
        self._unsent = unsent
        try:
            self._clients.state.owe(self.conn, unsent)
        except StoreLimitExceeded as exc:
            self.refuse("store_limit", str(exc))

    def pause_writing(self) -> None:
        # the client reads slower than it asks: stop reading its requests until it catches up
        self._paused = True
        if self._transport is not None and not self._transport.is_closing():
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        if self._transport is None or self._transport.is_closing():
            return
        self._account()
        if self._transport.is_closing():
            return
        self._transport.resume_reading()
        if self.conn.wants_more:
            self._serve(b"")

    def refuse(
        self, reason: str, detail: str, *, at_once: bool = False, offender: str = ""
    ) -> None:
        """Count, log (once per ``offender``: by default its address) and close this client; its
        charges are given back.

        ``at_once``: abort, whatever is unsent (a peer refused before it was served is owed
        nothing)."""
        if self._refused:
            return
        self._refused = True
        self._clients.record_refusal(
            offender or self.host or self.label, self.label, reason, detail
        )
        self.refused(reason, detail)
        self._clients.detach(self)
        self.conn.closed()
        transport = self._transport
        if transport is None:
            return
        if at_once or transport.get_write_buffer_size():
            transport.abort()  # a client that does not read would hold a graceful close open
        else:
            transport.close()

    def refused(self, reason: str, detail: str) -> None:
        """A hook: this client was just refused (the port store tells admission)."""

    def abort(self) -> None:
        """Close at once (the store is done with this client)."""
        self.conn.closed()
        if self._transport is not None:
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.closed()
        self._clients.detach(self)


class StoreServer:
    """Serves torch's TCPStore protocol on an already-listening socket."""

    def __init__(self, *, limits: StoreLimits | None = None, gate: StoreGate | None = None) -> None:
        self._clients = StoreClients(limits=limits, gate=gate)
        self._server: asyncio.Server | None = None

    @property
    def state(self) -> StoreState:
        """The store's keys, queues and waiters."""
        return self._clients.state

    @property
    def refused(self) -> dict[str, int]:
        """Clients refused so far, by reason."""
        return dict(self._clients.refused)

    async def start(self, listener: socket.socket) -> None:
        """Serve on ``listener`` (bound and listening; the store takes it over)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: StoreClientProtocol(self._clients), sock=listener
        )

    async def aclose(self) -> None:
        """Stop listening and drop every client."""
        if self._server is not None:
            self._server.close()
        self._clients.close_all()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
