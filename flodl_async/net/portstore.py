"""The run's TCPStore on the controller's one port: torch's ranks rendezvous through the mux.

Theory of operation. The mux routes a connection that opens with torch's ``VALIDATE``
(:data:`~flodl_async.wire.channels.STORE_PREFIX`) here, those bytes unconsumed, and the
sans-IO :mod:`flodl_async.wire.storeproto` serves it from the controller's own loop: no store
host, no second port, no extra process.

torch's store protocol carries no credential, so the peer's address is the credential: a
connection is served only from the address of a host admitted to the run (the address its
agent's join link came from, and every routable address its agent reported at join, for a
multi-homed host's ranks; loopback is one of them only when the controller's own host runs
ranks, never because a remote agent says so). Any other is closed at once and counted
(``store_not_admitted``). An admitted one is
under admission until its VALIDATE has been parsed, then leaves that pool for the rest of
the run (``ticket.authenticated()``): ranks hold their store connection for hours.

A restart is a new round (:meth:`PortStore.reset`): the keys go and every old connection is
closed, since torch adds no per-attempt prefix under the agent-store contract.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import typing

from ..wire.storeproto import StoreConnection, StoreProtocolError, StoreState
from .admission import AdmissionTicket

log = logging.getLogger("flodl_async.net.torchstore")


def normalise_host(host: str) -> str:
    """One spelling per address: an IPv4-mapped IPv6 peer (``::ffff:a.b.c.d``) is its IPv4
    address."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


class PortStore:
    """One store per round, served to the admitted hosts' connections on the mux."""

    def __init__(self) -> None:
        self.state = StoreState()
        self.round = 0
        self._admitted: set[str] = set()
        self._transports: dict[StoreConnection, asyncio.Transport] = {}

    def admit_host(self, address: str) -> None:
        """Store connections from ``address`` are served from now on (an admitted host's)."""
        self._admitted.add(normalise_host(address))

    def is_admitted(self, address: str) -> bool:
        """Whether a store connection from ``address`` is served."""
        return normalise_host(address) in self._admitted

    @property
    def connections(self) -> int:
        """Store connections open now."""
        return len(self._transports)

    def protocol_factory(self) -> asyncio.BaseProtocol:
        """A protocol for one routed store connection (the mux's handler for the store channel)."""
        return _PortStoreProtocol(self)

    def reset(self, round_: int) -> None:
        """Start ``round_`` from an empty store: drop every key, queue and waiter, close every
        client."""
        self.round = round_
        self.state = StoreState()
        self._close_all()

    def close(self) -> None:
        """Close every client (the run is over)."""
        self._close_all()

    def _close_all(self) -> None:
        transports = list(self._transports.values())
        self._transports.clear()
        for transport in transports:
            transport.abort()  # a rank of the last round: nothing it could still say matters

    def _deliver(self, replies: list[tuple[StoreConnection, bytes]]) -> None:
        for conn, payload in replies:
            transport = self._transports.get(conn)
            if transport is not None and not transport.is_closing():
                transport.write(payload)


class _PortStoreProtocol(asyncio.Protocol):
    def __init__(self, store: PortStore) -> None:
        self._store = store
        self._conn = StoreConnection(store.state)
        self._transport: asyncio.Transport | None = None
        self._ticket: AdmissionTicket | None = None

    def bind_admission(self, ticket: AdmissionTicket) -> None:
        self._ticket = ticket

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass it
        self._transport = typing.cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) else ""
        if not self._store.is_admitted(host):
            self._refuse(
                "store_not_admitted",
                f"store connection from {host or 'an unknown address'}, which is no host of this "
                "run",
            )
            return
        self._store._transports[self._conn] = self._transport

    def data_received(self, data: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        try:
            replies = self._conn.receive_data(data)
        except StoreProtocolError as exc:
            self._refuse("store_protocol", str(exc))
            return
        if self._conn.validated and self._ticket is not None:
            # idempotent: a torch client now, off the unauthenticated caps
            self._ticket.authenticated()
        self._store._deliver(replies)

    def _refuse(self, reason: str, detail: str) -> None:
        if self._ticket is not None:
            self._ticket.rejected(reason, detail)
        self._store._transports.pop(self._conn, None)
        if self._transport is not None:
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._conn.closed()
        if self._store._transports.get(self._conn) is self._transport:
            del self._store._transports[self._conn]
