"""The TCPStore server: pure protocol tests, and torch's own client against the real server."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
from datetime import timedelta

import pytest

from flodl_async import errors
from flodl_async.wire.storeproto import (
    CHECK_NOT_READY,
    CHECK_READY,
    STOP_WAITING,
    VALIDATION_MAGIC,
    Query,
    StoreConnection,
    StoreProtocolError,
    StoreState,
)


def _s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _validated(state: StoreState) -> StoreConnection:
    conn = StoreConnection(state)
    assert conn.receive_data(bytes([Query.VALIDATE]) + struct.pack("<I", VALIDATION_MAGIC)) == []
    return conn


@pytest.mark.parametrize("bytewise", [False, True], ids=["whole", "bytewise"])
def test_set_get_add_check_in_any_split(bytewise: bool) -> None:
    conn = StoreConnection(StoreState())
    stream = (
        bytes([Query.VALIDATE]) + struct.pack("<I", VALIDATION_MAGIC)
        + bytes([Query.PING]) + b"\x01\x02\x03\x04"
        + bytes([Query.SET]) + _s(b"k") + _s(b"v")
        + bytes([Query.GET]) + _s(b"k")
        + bytes([Query.ADD]) + _s(b"n") + struct.pack("<q", 5)
        + bytes([Query.ADD]) + _s(b"n") + struct.pack("<q", -2)
        + bytes([Query.CHECK]) + struct.pack("<Q", 2) + _s(b"k") + _s(b"n")
        + bytes([Query.CHECK]) + struct.pack("<Q", 1) + _s(b"missing")
        + bytes([Query.GETNUMKEYS])
    )  # fmt: skip
    chunks = [stream[i : i + 1] for i in range(len(stream))] if bytewise else [stream]
    out = b"".join(payload for chunk in chunks for _, payload in conn.receive_data(chunk))
    assert out == b"\x01\x02\x03\x04" + _s(b"v") + struct.pack("<q", 5) + struct.pack(
        "<q", 3
    ) + CHECK_READY + CHECK_NOT_READY + struct.pack("<q", 2)


def test_wait_is_answered_when_the_last_key_is_set_by_another_client() -> None:
    state = StoreState()
    waiter, setter = _validated(state), _validated(state)
    assert (
        waiter.receive_data(bytes([Query.WAIT]) + struct.pack("<Q", 2) + _s(b"a") + _s(b"b")) == []
    )
    assert setter.receive_data(bytes([Query.SET]) + _s(b"a") + _s(b"1")) == []
    assert setter.receive_data(bytes([Query.SET]) + _s(b"b") + _s(b"2")) == [(waiter, STOP_WAITING)]


def test_a_client_that_leaves_stops_waiting() -> None:
    state = StoreState()
    waiter, setter = _validated(state), _validated(state)
    waiter.receive_data(bytes([Query.WAIT]) + struct.pack("<Q", 1) + _s(b"a"))
    waiter.closed()
    assert setter.receive_data(bytes([Query.SET]) + _s(b"a") + _s(b"1")) == []


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (bytes([Query.SET]) + _s(b"k") + _s(b"v"), "first request was not a valid VALIDATE"),
        (bytes([Query.VALIDATE]) + b"\x00\x00\x00\x00", "first request was not a valid VALIDATE"),
        (
            bytes([Query.VALIDATE]) + struct.pack("<I", VALIDATION_MAGIC) + b"\xff",
            "unknown store query type 255",
        ),
        (
            bytes([Query.VALIDATE])
            + struct.pack("<I", VALIDATION_MAGIC)
            + bytes([Query.GET])
            + struct.pack("<Q", 1 << 40),
            "key of",
        ),
        (
            bytes([Query.VALIDATE])
            + struct.pack("<I", VALIDATION_MAGIC)
            + bytes([Query.SET])
            + _s(b"k")
            + struct.pack("<Q", 1 << 40),
            "value of",
        ),
    ],
)
def test_bad_clients_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(StoreProtocolError, match=match):
        StoreConnection(StoreState()).receive_data(data)


def test_store_protocol_errors_are_wire_errors() -> None:
    # Bytes that are not the protocol, like a bad frame: one family, so one handler closes either.
    assert StoreProtocolError is errors.StoreProtocolError
    assert issubclass(StoreProtocolError, errors.WireError)


SERVER = """
import asyncio, socket, sys
from flodl_async.net.tcpstore import StoreServer
async def main():
    server = StoreServer()
    await server.start(socket.socket(fileno=int(sys.argv[1])))
    print("serving", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.aclose()
asyncio.run(main())
"""


def test_torch_tcpstore_client_against_our_server() -> None:
    import torch.distributed as dist

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    # Another process: torch's client blocks while holding the GIL in some calls.
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(listener.fileno())],
        pass_fds=[listener.fileno()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    listener.close()
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "serving"
        store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=10))
        store.set("a", "1")
        assert store.get("a") == b"1"
        assert store.add("n", 5) == 5
        assert store.add("n", 2) == 7
        assert store.check(["a", "n"])
        assert not store.check(["missing"])
        store.wait(["a"])
        assert store.compare_set("a", "1", "2") == b"2"
        assert store.compare_set("a", "1", "3") == b"2"
        store.append("ap", "x")
        store.append("ap", "y")
        assert store.multi_get(["ap", "n"]) == [b"xy", b"7"]
        store.multi_set(["m1", "m2"], ["v1", "v2"])
        assert store.get("m2") == b"v2"
        assert store.num_keys() == 6  # with a world size, the client itself adds "init/" on connect
        assert store.delete_key("m1")
        store.queue_push("q", "one")
        store.queue_push("q", "two")
        assert store.queue_len("q") == 2
        assert store.queue_pop("q") == b"one"
        with pytest.raises(dist.DistStoreError):
            store.wait(["never"], timedelta(seconds=0.3))
        store.set("after-timeout", "ok")  # the cancelled wait left the connection usable
        assert store.get("after-timeout") == b"ok"
        other = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=10))
        assert other.get("a") == b"2"
    finally:
        server.communicate(timeout=10)
