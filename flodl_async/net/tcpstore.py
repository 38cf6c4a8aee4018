"""The asyncio shell around :mod:`flodl_async.wire.storeproto`: a TCPStore server in the agent's
loop."""

from __future__ import annotations

import asyncio
import logging
import socket
import typing

from ..wire.storeproto import StoreConnection, StoreProtocolError, StoreState

log = logging.getLogger("flodl_async.net.torchstore")


class StoreServer:
    """Serves torch's TCPStore protocol on an already-listening socket."""

    def __init__(self) -> None:
        self.state = StoreState()
        self._transports: dict[StoreConnection, asyncio.Transport] = {}
        self._server: asyncio.Server | None = None

    async def start(self, listener: socket.socket) -> None:
        """Serve on ``listener`` (bound and listening; the store takes it over)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _StoreProtocol(self), sock=listener)

    def _deliver(self, replies: list[tuple[StoreConnection, bytes]]) -> None:
        for conn, payload in replies:
            transport = self._transports.get(conn)
            if transport is not None and not transport.is_closing():
                transport.write(payload)

    async def aclose(self) -> None:
        """Stop listening and drop every client."""
        if self._server is not None:
            self._server.close()
        for transport in list(self._transports.values()):
            transport.abort()
        self._transports.clear()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None


class _StoreProtocol(asyncio.Protocol):
    def __init__(self, server: StoreServer) -> None:
        self._server = server
        self._conn = StoreConnection(server.state)
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass it
        self._transport = typing.cast(asyncio.Transport, transport)
        self._server._transports[self._conn] = self._transport

    def data_received(self, data: bytes) -> None:
        try:
            replies = self._conn.receive_data(data)
        except StoreProtocolError as exc:
            log.warning("store: dropping a client: %s", exc)
            if self._transport is not None:
                self._transport.abort()
            return
        self._server._deliver(replies)

    def connection_lost(self, exc: Exception | None) -> None:
        self._conn.closed()
        self._server._transports.pop(self._conn, None)
