"""Admission on the one port under a flood (issue 7, items 4–6): real sockets on loopback, a real PortMux.

Linux routes all of 127/8 on lo, so the flood binds its client sockets to 127.0.0.2 as source
and the well-behaved clients stay on 127.0.0.1 — or share 127.0.0.2 with the flood, as an agent
and an attacker on one host share 127.0.0.1. Every assertion is on counts and outcomes, never on
how long something took.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
import typing
from collections.abc import AsyncIterator

import pytest

from flodl_async.net.admission import AdmissionLimits
from flodl_async.net.framed import FramedProtocol
from flodl_async.net.http import StatusHttpProtocol
from flodl_async.net.mux import PortMux
from flodl_async.net.service import FramedService
from flodl_async.status import Phase, StatusBoard, StatusSnapshot
from flodl_async.wire import CHANNEL_MAGIC, Channel
from flodl_async.wire.handshake import session_resolver

from .launchkit import script

pytestmark = pytest.mark.skipif(
    sys.platform != "linux",
    reason="needs Linux: the flood binds 127.0.0.2 as source, and fds are counted in /proc",
)

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
        assert self.transport is not None
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            if line == b"bad key":
                self.ticket.rejected("auth_failed", "the peer's proof did not verify")
                self.transport.abort()
                return
            if self.ticket is not None:
                self.ticket.authenticated()
            self.transport.write(line + b"\n")


class PlainEcho(asyncio.Protocol):
    """A protocol with no bind_admission: it cannot say when its peer authenticated."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)


def _snapshot() -> StatusSnapshot:
    now = time.time()
    return StatusSnapshot(
        run_id="flood",
        phase=Phase.TRAINING,
        started_at=now,
        updated_at=now,
        world_size=1,
        joined_ranks=1,
        min_rank_start=1,
        target_ranks=1,
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
    mux.register(Channel.RENDEZVOUS, PlainEcho)
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


async def _get_status(port: int, *, source: str = "127.0.0.1") -> int:
    """One GET /state.json; the HTTP status, or 0 when the connection ended without an answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
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


async def test_an_idle_flood_from_many_addresses_is_held_to_the_total_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", SCALE)
    board = StatusBoard()
    board.publish(_snapshot())
    mux = PortMux(
        host="127.0.0.1",
        port=0,
        limits=AdmissionLimits(max_unauthenticated=100, max_unauthenticated_per_peer=64),
    )
    mux.register(Channel.STATUS, lambda: StatusHttpProtocol(board))
    await mux.start()
    try:
        held = [await _connect(mux.port, source=f"127.0.0.{10 + i % 10}") for i in range(500)]
        answers = await asyncio.gather(*(_get_status(mux.port) for _ in range(20)))
        assert answers == [200] * 20
        stats = mux.statistics()
        assert stats.unsniffed_now <= 100
        assert stats.dropped["evicted"] >= 400
        for sock in held:
            sock.close()
    finally:
        await mux.aclose()


async def test_status_has_its_own_small_budget_per_address(port_mux: PortMux) -> None:
    # Requests that never finish (slowloris) hold status slots, never more than the per-address budget.
    slow = [
        await _connect(port_mux.port, source=FLOOD, first=b"GET /state.json HTTP/1.1\r\n")
        for _ in range(20)
    ]
    assert (
        await _get_status(port_mux.port, source=FLOOD) == 200
    )  # the newcomer from the same address still gets in
    stats = port_mux.statistics()
    assert stats.dropped == {"evicted": 5}  # 21 requests, 16 slots
    assert stats.status_now <= 16
    assert sum([await _closed_by_server(sock) for sock in slow[:5]]) == 5
    for sock in slow:
        sock.close()


# ----- item 4: connections that send only the control magic -----------------------------------------


async def test_magic_only_flood_is_ended_while_an_authenticated_peer_stays(
    port_mux: PortMux,
) -> None:
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
            server_side_peak = max(
                server_side_peak, _open_fds() - baseline - len(flood) - (late is not None)
            )
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


async def test_rejections_reported_by_the_protocol_are_counted_and_summarised(
    port_mux: PortMux, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="flodl_async.mux")
    bad = [
        await _connect(
            port_mux.port, source=FLOOD, first=CHANNEL_MAGIC[Channel.CONTROL] + b"bad key\n"
        )
        for _ in range(300)
    ]
    async with asyncio.timeout(60):
        assert all(await asyncio.gather(*(_closed_by_server(sock) for sock in bad)))
    assert port_mux.statistics().dropped == {"auth_failed": 300}
    assert port_mux.statistics().handshaking_now == 0
    await port_mux.aclose()
    summaries = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert 1 <= len(summaries) <= 2
    assert "300" in summaries[-1].getMessage() or "299 auth_failed" in summaries[-1].getMessage()
    assert (
        sum(
            "the peer's proof did not verify" in r.getMessage()
            for r in caplog.records
            if r.levelno == logging.DEBUG
        )
        == 300
    )
    for sock in bad:
        sock.close()


async def test_a_peer_that_leaves_mid_handshake_is_counted_as_an_early_close(
    port_mux: PortMux,
) -> None:
    leaving = [
        await _connect(port_mux.port, source=FLOOD, first=CHANNEL_MAGIC[Channel.CONTROL])
        for _ in range(10)
    ]
    for sock in leaving:
        sock.shutdown(socket.SHUT_WR)
    assert all(
        [await _closed_by_server(sock) for sock in leaving]
    )  # the server closed after its connection_lost ran
    stats = port_mux.statistics()
    assert stats.dropped == {"early_close": 10}
    assert (stats.handshaking_now, stats.open_now) == (0, 0)
    for sock in leaving:
        sock.close()


async def test_a_protocol_without_bind_admission_is_admitted_once_routed(port_mux: PortMux) -> None:
    unbound = await _connect(port_mux.port, source=FLOOD, first=CHANNEL_MAGIC[Channel.RENDEZVOUS])
    ticketed = await _connect(port_mux.port, source=FLOOD, first=CHANNEL_MAGIC[Channel.CONTROL])
    assert await _closed_by_server(ticketed)  # its handshake deadline passed
    assert port_mux.statistics().dropped == {"handshake_timeout": 1}
    assert await _line_echo(unbound, b"still here\n") == b"still here\n"
    for sock in (unbound, ticketed):
        sock.close()


def test_the_flood_is_held_off_on_uvloop_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvloop (the loop the launcher uses) with the watchers in place: evicted, timed out, the authenticated peer stays."""
    import uvloop

    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", SCALE)
    magic = CHANNEL_MAGIC[Channel.CONTROL]

    async def main() -> None:
        board = StatusBoard()
        board.publish(_snapshot())
        mux = PortMux(host="127.0.0.1", port=0)
        mux.register(Channel.STATUS, lambda: StatusHttpProtocol(board))
        mux.register(Channel.CONTROL, LineEcho)
        await mux.start()
        try:
            good = await _connect(mux.port, source=FLOOD, first=magic + b"hello\n")
            assert await _line_echo(good, b"") == b"hello\n"
            flood = [await _connect(mux.port, source=FLOOD, first=magic) for _ in range(300)]
            assert await _get_status(mux.port) == 200
            async with asyncio.timeout(60):
                assert all(await asyncio.gather(*(_closed_by_server(sock) for sock in flood)))
            dropped = mux.statistics().dropped
            assert dropped.get("evicted", 0) + dropped.get("handshake_timeout", 0) == 300
            assert dropped["evicted"] == 300 - 64
            assert await _line_echo(good, b"bye\n") == b"bye\n"
            for sock in [*flood, good]:
                sock.close()
        finally:
            await mux.aclose()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


async def test_idle_connections_on_the_real_control_channel_meet_the_handshake_deadline(
    monkeypatch: pytest.MonkeyPatch, secret: bytes
) -> None:
    """Item 4 with the controller's own protocol: magic-only connections are closed at the handshake deadline."""
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", SCALE)

    async def wait_for_a_frame(link: FramedProtocol) -> None:
        await link.recv()

    mux = PortMux(host="127.0.0.1", port=0)
    timed_out: TimeoutError | None = None
    idle: list[socket.socket] = []
    async with asyncio.TaskGroup() as tg:
        service = FramedService(
            channel=Channel.CONTROL,
            resolve=session_resolver(secret),
            run_id="r",
            handler=wait_for_a_frame,
            task_group=tg,
        )
        mux.register(Channel.CONTROL, service.protocol_factory)
        await mux.start()
        try:
            idle = [
                await _connect(mux.port, source=FLOOD, first=CHANNEL_MAGIC[Channel.CONTROL])
                for _ in range(20)
            ]
            async with asyncio.timeout(5):  # the deadline is 1 s
                assert all(await asyncio.gather(*(_closed_by_server(sock) for sock in idle)))
            assert mux.statistics().dropped == {"handshake_timeout": 20}
        except (
            TimeoutError
        ) as exc:  # raised out of the task group, it would arrive wrapped in a group
            timed_out = exc
        finally:
            for sock in idle:
                sock.close()
            await mux.aclose()  # the handlers' links close, and the handlers end
    if timed_out is not None:
        raise timed_out


# ----- item 6: log flooding -------------------------------------------------------------------------


async def test_a_flood_of_refusals_logs_a_few_summary_lines(
    port_mux: PortMux, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="flodl_async.mux")
    idle = [await _connect(port_mux.port, source=FLOOD) for _ in range(500)]
    garbage = [
        await _connect(port_mux.port, source=FLOOD, first=b"\x00 names no channel")
        for _ in range(500)
    ]
    async with asyncio.timeout(60):
        assert all(await asyncio.gather(*(_closed_by_server(sock) for sock in idle + garbage)))
    await port_mux.aclose()  # reports what the summary still holds
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "flodl_async.mux" and r.levelno >= logging.INFO
    ]
    assert 1 <= len(lines) <= 3, lines
    assert port_mux.statistics().dropped["unknown_magic"] == 500
    for sock in idle + garbage:
        sock.close()


# ----- out of descriptors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loop", "says"),
    [("asyncio", "out of file descriptors (EMFILE"), ("uvloop", "near the descriptor limit")],
)
def test_running_out_of_descriptors_is_named_in_a_few_lines(loop: str, says: str) -> None:
    """asyncio reports accept() failing, up to a thousand times a second; uvloop hides it: either way, a few clear lines."""
    child = subprocess.Popen(
        [sys.executable, script("mux_at_fd_limit.py"), loop, "128"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdin is not None
    flood: list[socket.socket] = []
    try:
        port = int(child.stdout.readline().split()[1])
        flood = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(300)]
        lines = []
        # Read the log until the summary names the limit (it comes at once: the first line after a quiet interval).
        while not any(says in line for line in lines):
            line = child.stdout.readline()
            assert line, f"the child ended before naming the limit: {''.join(lines)}"
            lines.append(line)
        child.stdin.write("done\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=60)
    finally:
        for sock in flood:
            sock.close()
        child.kill()
    lines += out.splitlines(keepends=True)
    log_lines = [line for line in lines if line.startswith("log ")]
    assert all(line.startswith("log WARNING port mux: ") for line in log_lines), log_lines
    assert "raise `ulimit -n`" in log_lines[0]
    assert "soft limit 128" in log_lines[0]
    # A handful of summaries (one per 0.2 s at most, plus the one at close), not a line per attempt.
    assert len(log_lines) <= 30
    assert "socket.accept() out of system resource" not in err + out
    stats = json.loads(lines[-1].removeprefix("stats "))
    if loop == "asyncio":
        assert stats["accept_errors"]["EMFILE"] >= 1
