"""Admission on the one port under a flood (issue 7, items 4–6): real sockets on loopback, a real PortMux.

Linux routes all of 127/8 on lo, so the flood binds its client sockets to 127.0.0.2 as source
and the well-behaved clients stay on 127.0.0.1 — or share 127.0.0.2 with the flood, as an agent
and an attacker on one host share 127.0.0.1. Every assertion is on counts and outcomes, never on
how long something took.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
import typing
from collections.abc import AsyncIterator

import pytest

from flodl_async.net.http import StatusHttpProtocol
from flodl_async.net.mux import PortMux
from flodl_async.status import Phase, StatusBoard, StatusSnapshot
from flodl_async.wire import CHANNEL_MAGIC, Channel

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs Linux: the flood binds 127.0.0.2 as source, and fds are counted in /proc")

FLOOD = "127.0.0.2"
#: Every network deadline at a fifth (sniff and handshake 1 s): the flood's leftovers expire within the test.
SCALE = "0.2"


class LineEcho(asyncio.Protocol):
    """Stands in for a framed handshake: the peer 'proves the key' by sending one whole line; lines are echoed."""

    bound_before_connection_made: typing.ClassVar[list[bool]] = []

    def __init__(self) -> None:
        self.ticket: typing.Any = None
        self.transport: asyncio.Transport | None = None
        self._buf = b""

    def bind_admission(self, ticket: typing.Any) -> None:
        self.ticket = ticket

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)
        LineEcho.bound_before_connection_made.append(self.ticket is not None)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            if self.ticket is not None:
                self.ticket.authenticated()
            assert self.transport is not None
            self.transport.write(line + b"\n")


def _snapshot() -> StatusSnapshot:
    now = time.time()
    return StatusSnapshot(
        run_id="flood", phase=Phase.TRAINING, started_at=now, updated_at=now, world_size=1, joined_ranks=1, min_rank_start=1, target_ranks=1
    )


@pytest.fixture
async def port_mux(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[PortMux]:
    """A mux with the default caps, status and a LineEcho control channel, deadlines scaled down."""
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", SCALE)
    board = StatusBoard()
    board.publish(_snapshot())
    mux = PortMux(host="127.0.0.1", port=0)
    mux.register(Channel.STATUS, lambda: StatusHttpProtocol(board))
    mux.register(Channel.CONTROL, LineEcho)
    await mux.start()
    try:
        yield mux
    finally:
        await mux.aclose()


async def _connect(port: int, *, source: str, first: bytes = b"") -> socket.socket:
    """A raw non-blocking client socket from ``source``, having sent ``first``."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.bind((source, 0))
    await loop.sock_connect(sock, ("127.0.0.1", port))
    if first:
        await loop.sock_sendall(sock, first)
    return sock


async def _closed_by_server(sock: socket.socket) -> bool:
    """Waits until the server ends the connection (EOF or reset); False if it sent bytes instead."""
    try:
        data = await asyncio.get_running_loop().sock_recv(sock, 1)
    except ConnectionResetError:
        return True
    return data == b""


async def _get_status(port: int) -> int:
    """One GET /state.json from 127.0.0.1; the HTTP status, or 0 when the connection ended without an answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /state.json HTTP/1.1\r\nHost: flood\r\n\r\n")
        with contextlib.suppress(ConnectionResetError):
            answer = await reader.read()
            if answer.startswith(b"HTTP/1.1 "):
                return int(answer[9:12])
        return 0
    finally:
        writer.close()


async def _line_echo(sock: socket.socket, line: bytes) -> bytes:
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, line)
    got = b""
    while not got.endswith(b"\n"):
        chunk = await loop.sock_recv(sock, 64)
        if not chunk:
            break
        got += chunk
    return got


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ----- item 5: idle unsniffed connections from one address ------------------------------------------


async def test_idle_flood_from_one_address_leaves_status_answering(port_mux: PortMux) -> None:
    held = [await _connect(port_mux.port, source=FLOOD) for _ in range(1000)]
    answers = await asyncio.gather(*(_get_status(port_mux.port) for _ in range(50)))
    more = [await _connect(port_mux.port, source=FLOOD) for _ in range(200)]
    answers += await asyncio.gather(*(_get_status(port_mux.port) for _ in range(50)))
    assert answers.count(200) == 100
    for sock in held + more:
        sock.close()


# ----- item 4: connections that send only the control magic -----------------------------------------


async def test_magic_only_flood_is_ended_while_an_authenticated_peer_stays(port_mux: PortMux) -> None:
    magic = CHANNEL_MAGIC[Channel.CONTROL]
    LineEcho.bound_before_connection_made.clear()
    early = await _connect(port_mux.port, source=FLOOD, first=magic)
    assert await _line_echo(early, b"early\n") == b"early\n"
    baseline = _open_fds()
    flood: list[socket.socket] = []
    server_side_peak = 0
    late: socket.socket | None = None
    statuses: list[int] = []
    for i in range(1000):
        flood.append(await _connect(port_mux.port, source=FLOOD, first=magic))
        if i == 500:
            # A newcomer from the flooding address, mid-flood, gets in and authenticates.
            late = await _connect(port_mux.port, source=FLOOD, first=magic + b"late\n")
            assert await _line_echo(late, b"") == b"late\n"
        if i % 100 == 99:
            statuses.append(await _get_status(port_mux.port))
            await asyncio.sleep(0)  # let evicted transports finish closing before counting
            server_side_peak = max(server_side_peak, _open_fds() - baseline - len(flood) - (late is not None))
    assert statuses == [200] * 10
    # The server holds at most the per-address cap of the flood, not one descriptor per connection.
    assert server_side_peak <= 64 + 8
    async with asyncio.timeout(60):
        ended = await asyncio.gather(*(_closed_by_server(sock) for sock in flood))
    assert all(ended)
    stats = port_mux.statistics()
    assert stats.dropped.get("evicted", 0) + stats.dropped.get("handshake_timeout", 0) == 1000
    # Those that authenticated were never evicted, and still talk.
    assert await _line_echo(early, b"still here\n") == b"still here\n"
    assert late is not None
    assert await _line_echo(late, b"me too\n") == b"me too\n"
    assert all(LineEcho.bound_before_connection_made)
    for sock in [*flood, early, late]:
        sock.close()


# ----- item 6: log flooding -------------------------------------------------------------------------


async def test_a_flood_of_refusals_logs_a_few_summary_lines(port_mux: PortMux, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flodl_async.mux")
    idle = [await _connect(port_mux.port, source=FLOOD) for _ in range(500)]
    garbage = [await _connect(port_mux.port, source=FLOOD, first=b"\x00 names no channel") for _ in range(500)]
    async with asyncio.timeout(60):
        assert all(await asyncio.gather(*(_closed_by_server(sock) for sock in idle + garbage)))
    await port_mux.aclose()  # reports what the summary still holds
    lines = [r.getMessage() for r in caplog.records if r.name == "flodl_async.mux" and r.levelno >= logging.INFO]
    assert 1 <= len(lines) <= 3, lines
    assert port_mux.statistics().dropped["unknown_magic"] == 500
    for sock in idle + garbage:
        sock.close()
