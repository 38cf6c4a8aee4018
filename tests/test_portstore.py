"""The store on the controller's one port: a real PortMux, real sockets, torch's own TCPStore client.

Linux routes all of 127/8 on lo, so a client bound to 127.0.0.2 as source stands for a host
that was never admitted while 127.0.0.1 is (and the reverse). Assertions are on outcomes and
counts, never on how long something took.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import sys
from collections.abc import AsyncIterator

import pytest

from flodl_async.net.mux import PortMux
from flodl_async.net.portstore import PortStore, normalise_host
from flodl_async.wire import Channel
from flodl_async.wire.channels import STORE_PREFIX
from flodl_async.wire.storeproto import Query

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="needs Linux: clients bind 127.0.0.2 as source"
)

ADMITTED, OTHER = "127.0.0.1", "127.0.0.2"


@contextlib.asynccontextmanager
async def store_on_port(admitted: str) -> AsyncIterator[tuple[PortMux, PortStore]]:
    mux = PortMux(host="127.0.0.1", port=0, sniff_timeout=30.0, handshake_timeout=30.0)
    store = PortStore()
    store.admit_host(admitted)
    mux.register(Channel.STORE, store.protocol_factory)
    await mux.start()
    try:
        yield mux, store
    finally:
        store.close()
        await mux.aclose()


def _vector(data: bytes) -> bytes:
    return len(data).to_bytes(8, "little") + data


async def raw_client(port: int, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def closed_by_peer(reader: asyncio.StreamReader) -> bool:
    try:
        async with asyncio.timeout(30):
            return await reader.read(1) == b""
    except ConnectionResetError:
        return True


def torch_client(port: int) -> object:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=60))


@pytest.mark.parametrize(("admitted", "source"), [(ADMITTED, OTHER), (OTHER, ADMITTED)])
async def test_a_store_connection_from_an_address_not_admitted_is_closed_and_counted(
    admitted: str, source: str
) -> None:
    async with store_on_port(admitted) as (mux, store):
        reader, writer = await raw_client(mux.port, source)
        writer.write(STORE_PREFIX + bytes([Query.SET]) + _vector(b"k") + _vector(b"v"))
        try:
            assert await closed_by_peer(reader)
        finally:
            writer.close()
        assert mux.statistics().dropped.get("store_not_admitted") == 1
        assert store.state.data == {}  # its SET never reached the store
        assert store.connections == 0


async def test_torch_clients_share_the_store_through_the_port_and_leave_the_admission_pool() -> (
    None
):
    async with store_on_port(ADMITTED) as (mux, store):
        a = await asyncio.to_thread(torch_client, mux.port)
        b = await asyncio.to_thread(torch_client, mux.port)
        await asyncio.to_thread(a.set, "key", "value")  # type: ignore[attr-defined]
        assert await asyncio.to_thread(b.get, "key") == b"value"  # type: ignore[attr-defined]
        assert await asyncio.to_thread(b.add, "n", 3) == 3  # type: ignore[attr-defined]
        assert await asyncio.to_thread(a.add, "n", 4) == 7  # type: ignore[attr-defined]
        await asyncio.to_thread(a.wait, ["key", "n"])  # type: ignore[attr-defined]
        stats = mux.statistics()
        assert stats.routed == {"store": 2}
        assert (stats.unsniffed_now, stats.handshaking_now) == (
            0,
            0,
        )  # validated: off the unauthenticated caps
        assert stats.dropped == {}
        assert store.connections == 2
        del a, b


async def test_reset_empties_the_store_and_closes_the_last_rounds_connections() -> None:
    async with store_on_port(ADMITTED) as (mux, store):
        reader, writer = await raw_client(mux.port, ADMITTED)
        writer.write(STORE_PREFIX + bytes([Query.SET]) + _vector(b"stale") + _vector(b"1"))
        writer.write(bytes([Query.CHECK]) + (1).to_bytes(8, "little") + _vector(b"stale"))
        await writer.drain()
        async with asyncio.timeout(30):
            assert await reader.readexactly(1) == b"\x00"  # READY: the SET landed
        assert store.state.data == {"stale": b"1"}
        store.reset(1)
        try:
            assert await closed_by_peer(reader)
        finally:
            writer.close()
        assert store.state.data == {}
        assert store.round == 1
        fresh = await asyncio.to_thread(torch_client, mux.port)
        assert await asyncio.to_thread(fresh.check, ["stale"]) is False  # type: ignore[attr-defined]
        del fresh


async def test_a_non_validate_after_the_zero_byte_is_never_routed_to_the_store() -> None:
    async with store_on_port(ADMITTED) as (mux, _store):
        reader, writer = await raw_client(mux.port, ADMITTED)
        writer.write(b"\x00\x01\x02\x03\x04")
        try:
            assert await closed_by_peer(reader)
        finally:
            writer.close()
        assert mux.statistics().dropped.get("unknown_magic") == 1
        assert mux.statistics().routed == {}


def test_ipv4_mapped_peers_are_their_ipv4_address() -> None:
    assert normalise_host("::ffff:10.0.0.7") == "10.0.0.7"
    assert normalise_host("127.0.0.1") == "127.0.0.1"
    assert normalise_host("not-an-ip") == "not-an-ip"
