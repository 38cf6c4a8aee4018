"""The store's bounds (issue 19 §2): bytes, values, ADD's range, flow control, and store connections
on the port.

Pure tests drive :mod:`flodl_async.wire.storeproto` with small limits; the rest use real sockets
against a real PortMux, in this process or in a process of its own (``scripts/store_server.py``)
where memory and descriptors are measured. Assertions are on outcomes, counts and bytes, never on
how long something took.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
import subprocess
import sys
import typing
from collections.abc import AsyncIterator, Iterator

import pytest

from flodl_async.errors import StoreLimitExceeded, StoreProtocolError
from flodl_async.net.admission import AdmissionLimits
from flodl_async.net.mux import PortMux
from flodl_async.net.portstore import PortStore
from flodl_async.net.tcpstore import StoreServer
from flodl_async.wire import Channel
from flodl_async.wire.channels import STORE_PREFIX
from flodl_async.wire.storeproto import (
    ENTRY_OVERHEAD,
    REPLY_BATCH,
    STOP_WAITING,
    VALIDATION_MAGIC,
    Query,
    StoreConnection,
    StoreLimits,
    StoreState,
)

from .launchkit import script

MiB = 1 << 20
SMALL = StoreLimits(max_bytes=64 * 1024, max_value=8 * 1024)


def _s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _keys(*keys: bytes) -> bytes:
    return struct.pack("<Q", len(keys)) + b"".join(_s(k) for k in keys)


def _set(key: bytes, value: bytes) -> bytes:
    return bytes([Query.SET]) + _s(key) + _s(value)


def _validated(state: StoreState) -> StoreConnection:
    conn = StoreConnection(state)
    assert conn.receive_data(bytes([Query.VALIDATE]) + struct.pack("<I", VALIDATION_MAGIC)) == []
    return conn


# ----- the budget and the value limit (pure) ---------------------------------------------------


def test_a_set_past_the_budget_is_refused_and_the_other_keys_stay() -> None:
    state = StoreState(SMALL)
    good, bad = _validated(state), _validated(state)
    good.receive_data(_set(b"init/", b"keep"))
    # A value is charged twice while it is applied (the request's bytes and the stored copy
    # coexist), so six of these fit and the seventh does not.
    for i in range(6):
        bad.receive_data(_set(f"big{i}".encode(), b"x" * 8 * 1024))
    with pytest.raises(StoreLimitExceeded, match="budget is 65536"):
        bad.receive_data(_set(b"big6", b"x" * 8 * 1024))
    assert state.data["init/"] == b"keep"
    assert "big6" not in state.data
    assert state.held <= SMALL.max_bytes
    with pytest.raises(StoreLimitExceeded):  # a connection that failed stays failed
        bad.receive_data(_set(b"k", b"v"))


def test_a_value_header_past_the_limit_is_refused_before_its_bytes_arrive() -> None:
    state = StoreState(SMALL)
    conn = _validated(state)
    with pytest.raises(StoreLimitExceeded, match="value of 8193 bytes"):
        conn.receive_data(bytes([Query.SET]) + _s(b"k") + struct.pack("<Q", 8 * 1024 + 1))
    assert state.held == 0


def test_append_cannot_grow_a_value_past_the_limit() -> None:
    state = StoreState(StoreLimits(max_bytes=MiB, max_value=10))
    conn = _validated(state)
    conn.receive_data(bytes([Query.APPEND]) + _s(b"ap") + _s(b"x" * 6))
    with pytest.raises(StoreLimitExceeded, match="APPEND would make key 'ap' 12 bytes"):
        conn.receive_data(bytes([Query.APPEND]) + _s(b"ap") + _s(b"y" * 6))
    assert state.data["ap"] == b"x" * 6


def test_five_appends_of_4_mib_stop_at_8_mib() -> None:
    state = StoreState()
    conn = _validated(state)
    chunk = bytes([Query.APPEND]) + _s(b"ap") + _s(b"y" * 4 * MiB)
    conn.receive_data(chunk)
    conn.receive_data(chunk)
    with pytest.raises(StoreLimitExceeded):
        conn.receive_data(chunk)
    assert len(state.data["ap"]) == 8 * MiB


def test_a_multi_set_past_the_budget_changes_nothing() -> None:
    state = StoreState(SMALL)
    conn = _validated(state)
    for i in range(4):
        conn.receive_data(_set(f"k{i}".encode(), b"x" * 8000))
    before = dict(state.data)
    pairs = [(f"m{i}".encode(), b"v" * 8000) for i in range(3)]
    request = bytes([Query.MULTI_SET]) + struct.pack("<Q", len(pairs))
    request += b"".join(_s(k) + _s(v) for k, v in pairs)
    with pytest.raises(StoreLimitExceeded, match="MULTI_SET of 3 keys"):
        conn.receive_data(request)
    assert state.data == before


def test_requests_still_arriving_count_against_the_budget() -> None:
    state = StoreState(SMALL)
    conns = [_validated(state) for _ in range(9)]
    partial = bytes([Query.SET]) + _s(b"k") + struct.pack("<Q", 8000) + b"v" * 7990
    for conn in conns[:8]:
        conn.receive_data(partial)  # none complete: nothing stored, all of it buffered
    assert state.data == {}
    with pytest.raises(StoreLimitExceeded, match="requests would take the store"):
        conns[8].receive_data(partial)
    for conn in conns:
        conn.closed()
    assert state.held == 0  # closing gives back what was buffered


def test_waits_are_charged_and_given_back() -> None:
    state = StoreState(SMALL)
    waiter, setter = _validated(state), _validated(state)
    waiter.receive_data(bytes([Query.WAIT]) + _keys(b"a", b"b"))
    assert state.held == 2 * (1 + ENTRY_OVERHEAD)
    assert setter.receive_data(_set(b"a", b"1")) == []
    assert setter.receive_data(_set(b"b", b"2")) == [(waiter, STOP_WAITING)]
    assert state.held == 2 * (2 + ENTRY_OVERHEAD)  # only the two keys now
    waiter.receive_data(bytes([Query.WAIT]) + _keys(b"c"))
    waiter.receive_data(bytes([Query.CANCEL_WAIT]))
    waiter.receive_data(bytes([Query.WAIT]) + _keys(b"d" * 100))
    waiter.closed()
    assert state.held == 2 * (2 + ENTRY_OVERHEAD)
    for key in (b"a", b"b"):
        setter.receive_data(bytes([Query.DELETE_KEY]) + _s(key))
    assert state.held == 0


def test_a_flood_of_waits_is_bounded_by_the_budget() -> None:
    state = StoreState(SMALL)
    conn = _validated(state)
    request = bytes([Query.WAIT]) + _keys(*[f"w{i:04}".encode() for i in range(64)])
    waits = 0
    with contextlib.suppress(StoreLimitExceeded):
        while waits < 100:
            conn.receive_data(request)
            waits += 1
    assert waits < 8  # each registers 64 waits of 133 bytes: the budget holds seven such requests
    assert state.held <= SMALL.max_bytes


def test_queue_pops_of_missing_queues_leave_nothing_behind() -> None:
    state = StoreState(SMALL)
    conn = _validated(state)
    for i in range(1000):
        conn.receive_data(bytes([Query.QUEUE_POP]) + _s(f"q{i}".encode()))
    conn.receive_data(bytes([Query.QUEUE_PUSH]) + _s(b"q") + _s(b"item"))
    assert state.held == 1 + 4 + ENTRY_OVERHEAD
    out = conn.receive_data(bytes([Query.QUEUE_POP]) + _s(b"q"))
    assert out == [(conn, struct.pack("<q", 1) + _s(b"item"))]
    assert (state.queues, state.held) == ({}, 0)


def test_a_multi_get_of_a_repeated_key_is_refused_before_its_reply_is_made() -> None:
    state = StoreState(SMALL)
    conn = _validated(state)
    conn.receive_data(_set(b"big", b"x" * 8 * 1024))
    with pytest.raises(StoreLimitExceeded, match="MULTI_GET of 9 keys"):
        conn.receive_data(bytes([Query.MULTI_GET]) + _keys(*[b"big"] * 9))
    assert state.data == {"big": b"x" * 8 * 1024}


@pytest.mark.parametrize(
    ("start", "delta"), [((1 << 63) - 1, 1), (-(1 << 63), -1), (1 << 62, 1 << 62)]
)
def test_an_add_that_overflows_int64_is_a_store_protocol_error(start: int, delta: int) -> None:
    state = StoreState()
    conn = _validated(state)
    conn.receive_data(_set(b"n", str(start).encode()))
    with pytest.raises(StoreProtocolError, match="overflows a 64-bit integer"):
        conn.receive_data(bytes([Query.ADD]) + _s(b"n") + struct.pack("<q", delta))
    assert state.data["n"] == str(start).encode()


def test_an_add_up_to_the_int64_bounds_is_answered() -> None:
    state = StoreState()
    conn = _validated(state)
    conn.receive_data(_set(b"n", str((1 << 63) - 2).encode()))
    out = conn.receive_data(bytes([Query.ADD]) + _s(b"n") + struct.pack("<q", 1))
    assert out == [(conn, struct.pack("<q", (1 << 63) - 1))]


# ----- flow control and framing (pure) ----------------------------------------------------------


def test_pipelined_gets_are_answered_a_batch_at_a_time() -> None:
    state = StoreState()
    conn = _validated(state)
    value = b"x" * 40_000
    conn.receive_data(_set(b"k", value))
    replies = conn.receive_data((bytes([Query.GET]) + _s(b"k")) * 100)
    batches = [replies]
    while conn.wants_more:
        batches.append(conn.receive_data(b""))
    assert all(sum(len(p) for _, p in b) < REPLY_BATCH + len(value) + 8 for b in batches)
    assert [p for b in batches for _, p in b] == [_s(value)] * 100
    assert conn.buffered == 0


def test_replies_made_before_a_bad_request_go_out_and_the_error_follows() -> None:
    state = StoreState()
    waiter, setter = _validated(state), _validated(state)
    waiter.receive_data(bytes([Query.WAIT]) + _keys(b"go"))
    out = setter.receive_data(_set(b"go", b"1") + b"\xfe")
    assert out == [(waiter, STOP_WAITING)]  # the waiter is woken although the setter failed
    assert setter.wants_more
    with pytest.raises(StoreProtocolError, match="unknown store query type 254"):
        setter.receive_data(b"")
    assert not setter.wants_more


REQUESTS = (
    bytes([Query.PING]) + b"abcd",
    _set(b"k", b"v1"),
    bytes([Query.COMPARE_SET]) + _s(b"k") + _s(b"v1") + _s(b"v2"),
    bytes([Query.GET]) + _s(b"k"),
    bytes([Query.ADD]) + _s(b"n") + struct.pack("<q", 5),
    bytes([Query.CHECK]) + _keys(b"k", b"n"),
    bytes([Query.WAIT]) + _keys(b"k"),
    bytes([Query.GETNUMKEYS]),
    bytes([Query.APPEND]) + _s(b"ap") + _s(b"xy"),
    bytes([Query.MULTI_GET]) + _keys(b"k", b"ap", b"none"),
    bytes([Query.MULTI_SET]) + struct.pack("<Q", 2) + _s(b"m1") + _s(b"a") + _s(b"m2") + _s(b""),
    bytes([Query.DELETE_KEY]) + _s(b"m1"),
    bytes([Query.QUEUE_PUSH]) + _s(b"q") + _s(b"one"),
    bytes([Query.QUEUE_LEN]) + _s(b"q"),
    bytes([Query.QUEUE_POP]) + _s(b"q"),
    bytes([Query.MULTI_SET]) + struct.pack("<Q", 0),
    bytes([Query.CANCEL_WAIT]),
)


def _transcript(chunks: Iterator[bytes]) -> tuple[bytes, dict[str, bytes], int]:
    state = StoreState()
    conn = StoreConnection(state)
    out = b"".join(p for chunk in chunks for c, p in conn.receive_data(chunk) if c is conn)
    return out, state.data, state.held


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 1000], ids=lambda n: f"{n}-byte reads")
def test_every_request_split_anywhere_gives_what_it_gives_whole(cut: int) -> None:
    stream = bytes([Query.VALIDATE]) + struct.pack("<I", VALIDATION_MAGIC) + b"".join(REQUESTS)
    whole = _transcript(iter([stream]))
    assert _transcript(stream[i : i + cut] for i in range(0, len(stream), cut)) == whole
    assert whole[0].startswith(b"abcd")


# ----- on the port: real sockets ----------------------------------------------------------------


@contextlib.asynccontextmanager
async def port_store(
    *, admission: AdmissionLimits | None = None, store: StoreLimits | None = None
) -> AsyncIterator[tuple[PortMux, PortStore]]:
    mux = PortMux(
        host="127.0.0.1", port=0, sniff_timeout=30.0, handshake_timeout=30.0, limits=admission
    )
    served = PortStore(limits=store)
    served.admit_host("127.0.0.1")
    served.admit_host("127.0.0.2")
    mux.register(Channel.STORE, served.protocol_factory)
    await mux.start()
    try:
        yield mux, served
    finally:
        served.close()
        await mux.aclose()


async def _store_client(
    port: int, source: str = "127.0.0.1"
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    writer.write(STORE_PREFIX)
    return reader, writer


async def _ping(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """True if the store answers a PING; False if it closed the connection."""
    try:
        writer.write(bytes([Query.PING]) + b"ping")
        return await reader.readexactly(4) == b"ping"
    except (asyncio.IncompleteReadError, ConnectionError):
        # closed before the PING (the write's EPIPE, under load often the first to show) or after
        return False


async def test_an_offender_is_closed_counted_and_named_once_and_the_other_keys_stay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="flodl_async.net.torchstore")
    async with port_store(store=SMALL) as (mux, store):
        good = await _store_client(mux.port)
        good[1].write(_set(b"init/", b"keep"))
        assert await _ping(*good)
        for attempt in range(2):
            reader, writer = await _store_client(mux.port)
            writer.write(b"".join(_set(f"b{attempt}/{i}".encode(), b"x" * 8000) for i in range(9)))
            assert not await _ping(reader, writer)
            writer.close()
        assert await _ping(*good)
        assert store.state.data["init/"] == b"keep"
        assert mux.statistics().dropped == {"store_limit": 2}
        named = [r.getMessage() for r in caplog.records if "127.0.0.1" in r.getMessage()]
        assert len(named) == 1, named
        assert "store_limit" in named[0]
        assert "budget is 65536" in named[0]
        good[1].close()


async def test_the_agents_own_store_server_keeps_the_same_bounds() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    server = StoreServer(limits=SMALL)
    await server.start(listener)
    port = listener.getsockname()[1]
    try:
        good = await _store_client(port)
        good[1].write(_set(b"init/", b"keep") + bytes([Query.APPEND]) + _s(b"a") + _s(b"x" * 8000))
        assert await _ping(*good)
        good[1].write(bytes([Query.APPEND]) + _s(b"a") + _s(b"x" * 8000))
        assert not await _ping(*good)  # the APPEND would pass the value limit
        again = await _store_client(port)
        again[1].write(bytes([Query.GET]) + _s(b"init/"))
        assert await again[0].readexactly(12) == _s(b"keep")
        assert server.refused == {"store_limit": 1}
        for _, writer in (good, again):
            writer.close()
    finally:
        await server.aclose()


async def test_a_client_that_reads_slowly_gets_every_reply_in_order() -> None:
    async with port_store() as (mux, store):
        reader, writer = await _store_client(mux.port)
        value = b"z" * 300_000
        writer.write(_set(b"k", value) + (bytes([Query.GET]) + _s(b"k")) * 64)
        for _ in range(64):
            assert await reader.readexactly(8 + len(value)) == _s(value)
        assert await _ping(reader, writer)
        assert store.state.owed <= 2 * REPLY_BATCH
        writer.close()


async def test_store_connections_are_capped_per_address_and_in_total() -> None:
    admission = AdmissionLimits(max_store=6, max_store_per_peer=4)
    async with port_store(admission=admission) as (mux, _store):
        first = [await _store_client(mux.port) for _ in range(5)]
        assert [await _ping(*c) for c in first] == [True] * 4 + [False]
        other = [await _store_client(mux.port, "127.0.0.2") for _ in range(3)]
        assert [await _ping(*c) for c in other] == [True, True, False]
        stats = mux.statistics()
        assert stats.store_now == 6
        assert stats.dropped == {"store_over_capacity": 2}
        first[0][1].close()
        assert await first[0][0].read() == b""
        again = await _store_client(mux.port)
        assert await _ping(*again)  # a closed connection gives its place back
        for _, writer in (*first, *other, again):
            writer.close()


def test_the_store_cap_is_fitted_to_the_descriptor_limit() -> None:
    limits = AdmissionLimits()
    assert limits.within_descriptors(None) is limits
    assert limits.within_descriptors(1 << 20) is limits
    fitted = limits.within_descriptors(1024)
    # 1024 less the handshakes', status', /events streams' and reserved descriptors
    assert (fitted.max_store, fitted.max_store_per_peer) == (288, 288)
    assert limits.within_descriptors(100).max_store == 16


# ----- in a process of its own: descriptors and memory --------------------------------------------


class StoreProcess:
    """``scripts/store_server.py`` in a child process."""

    def __init__(self, **settings: object) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, script("store_server.py"), json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.port = int(self._line("port ").split()[1])

    def _line(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        while line := self.proc.stdout.readline():
            self.lines.append(line)
            if line.startswith(prefix):
                return line
        raise AssertionError(f"the store process ended: {''.join(self.lines)}")

    def stats(self) -> dict[str, typing.Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return dict(json.loads(self._line("stats ").removeprefix("stats ")))

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        try:
            assert self.proc.stdout is not None
            self.lines += self.proc.stdout.readlines()  # what it logged while closing
            self.proc.wait(timeout=60)
        finally:
            self.proc.kill()
            if self.proc.stdout is not None:
                self.proc.stdout.close()


async def _status(port: int) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /state.json HTTP/1.1\r\nHost: test\r\n\r\n")
        with contextlib.suppress(ConnectionResetError):
            answer = await reader.read()
            if answer.startswith(b"HTTP/1.1 "):
                return int(answer[9:12])
        return 0
    finally:
        writer.close()


@pytest.mark.skipif(sys.platform != "linux", reason="needs Linux: RLIMIT_NOFILE and /proc")
async def test_status_is_answered_while_store_connections_hold_all_they_may() -> None:
    """Without a store cap, 450 held store connections take every descriptor of a process limited
    to 400, and status is never answered; with it, the store holds what the limit leaves."""
    admission = {
        "max_unauthenticated": 64,
        "max_unauthenticated_per_peer": 64,
        "max_status": 16,
        "max_status_per_peer": 16,
    }
    server = StoreProcess(admission=admission, nofile=400)
    clients: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        async with asyncio.timeout(
            90
        ):  # no cap: the 385th connection waits in the backlog for ever
            for _ in range(450):
                clients.append(await _store_client(server.port))
            held = [await _ping(*client) for client in clients]
            assert await _status(server.port) == 200
        stats = server.stats()
        assert stats["max_store"] == 400 - 64 - 16 - AdmissionLimits().max_streams - 128
        assert held.count(True) == stats["max_store"] == stats["store_now"]
        assert stats["dropped"] == {"store_over_capacity": 450 - stats["max_store"]}
    finally:
        for _, writer in clients:
            writer.close()
        server.close()
    assert any("raise `ulimit -n`" in line for line in server.lines)


@pytest.mark.skipif(sys.platform != "linux", reason="needs Linux: VmHWM in /proc")
async def test_forty_sets_of_8_mib_grow_the_store_process_by_well_under_100_mb() -> None:
    server = StoreProcess()
    clients: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        before = server.stats()
        value = b"x" * (8 * MiB)
        for _ in range(40):
            clients.append(await _store_client(server.port))
        for i, (_, writer) in enumerate(clients):
            writer.write(_set(f"big{i}".encode(), value))
        answered = [await _ping(*client) for client in clients]
        after = server.stats()
    finally:
        for _, writer in clients:  # closed here, not by the garbage collector in a later test
            writer.close()
        server.close()
    grown_mb = (after["VmHWM"] - before["VmRSS"]) / 1000
    print(
        f"store process: VmRSS {before['VmRSS']} kB before, {after['VmRSS']} kB after, peak "
        f"{after['VmHWM']} kB: +{grown_mb:.1f} MB at the peak; {answered.count(True)} of 40 SETs "
        f"kept, {after['keys']} keys, {after['held']} bytes held"
    )
    assert grown_mb < 100
    # which SETs get in depends on how the 40 streams interleave: at most 7 of 8 MiB fit in 64 MiB
    assert 1 <= answered.count(True) == after["keys"] <= 7
    assert after["dropped"] == {"store_limit": 40 - after["keys"]}
