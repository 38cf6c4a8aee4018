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

from flodl_async.host.sockdiag import Endpoint
from flodl_async.net.mux import PortMux
from flodl_async.net.portstore import PortStore, normalise_host
from flodl_async.net.storegate import PeerCheck, Standing, StoreGate
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


# ----- another host's connections: its agent says who made them ----------------------------------


class _EveryoneRemote(StoreGate):
    """A gate that sees every peer as another host's (loopback stands in for a worker host)."""

    def check(self, peer: Endpoint, ours: Endpoint) -> PeerCheck:
        return PeerCheck(standing=Standing.REMOTE)


class _Agent:
    """The port store's owner oracle, answered by the test: each question waits in ``asked``."""

    def __init__(self) -> None:
        self.asked: asyncio.Queue[tuple[Endpoint, asyncio.Future[tuple[str, str, str]]]] = (
            asyncio.Queue()
        )

    def __call__(self, peer: Endpoint, ours: Endpoint) -> asyncio.Future[tuple[str, str, str]]:
        answer: asyncio.Future[tuple[str, str, str]] = asyncio.get_running_loop().create_future()
        self.asked.put_nowait((peer, answer))
        return answer


@contextlib.asynccontextmanager
async def remote_store() -> AsyncIterator[tuple[PortMux, PortStore, _Agent]]:
    mux = PortMux(host="127.0.0.1", port=0, sniff_timeout=30.0, handshake_timeout=30.0)
    store, agent = PortStore(gate=_EveryoneRemote()), _Agent()
    store.admit_host(ADMITTED)
    store.owner_oracle = agent
    mux.register(Channel.STORE, store.protocol_factory)
    await mux.start()
    try:
        yield mux, store, agent
    finally:
        store.close()
        await mux.aclose()


SET_THEN_CHECK = (
    STORE_PREFIX
    + bytes([Query.SET])
    + _vector(b"init/")
    + _vector(b"1")
    + bytes([Query.CHECK])
    + (1).to_bytes(8, "little")
    + _vector(b"init/")
)


async def test_another_hosts_connection_is_read_only_once_its_agent_vouches_for_it() -> None:
    async with remote_store() as (mux, store, agent):
        reader, writer = await raw_client(mux.port, ADMITTED)
        writer.write(SET_THEN_CHECK)
        await writer.drain()
        async with asyncio.timeout(30):
            peer, answer = await agent.asked.get()
        assert peer[0] == ADMITTED
        assert store.state.data == {}  # held, unread, while its agent is asked
        answer.set_result(("served", "", "h1"))
        async with asyncio.timeout(30):
            assert (
                await reader.readexactly(1) == b"\x00"
            )  # READY: what it sent meanwhile was served
        writer.close()
        assert store.state.data == {"init/": b"1"}
        assert store.connections == 1


@pytest.mark.parametrize("reason", ["store_foreign_uid", "store_not_run", "store_owner_unknown"])
async def test_a_connection_its_agent_does_not_vouch_for_changes_nothing_and_is_named_once(
    reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with remote_store() as (mux, store, agent):
        for _try in range(3):
            reader, writer = await raw_client(mux.port, ADMITTED)
            writer.write(SET_THEN_CHECK)
            async with asyncio.timeout(30):
                _peer, answer = await agent.asked.get()
            answer.set_result((reason, "uid 65534 (nobody), pid 7 (python3)", "h1"))
            try:
                assert await closed_by_peer(reader)
            finally:
                writer.close()
        assert store.state.data == {}
        assert mux.statistics().dropped.get(reason) == 3
    lines = [r.getMessage() for r in caplog.records if f"({reason})" in r.getMessage()]
    assert len(lines) == 1, lines  # three refusals, one line
    assert 'on host "h1": uid 65534 (nobody), pid 7 (python3)' in lines[0], lines[0]


async def test_a_reset_closes_a_connection_still_waiting_for_its_agent() -> None:
    async with remote_store() as (mux, store, agent):
        reader, writer = await raw_client(mux.port, ADMITTED)
        writer.write(SET_THEN_CHECK)
        async with asyncio.timeout(30):
            _peer, answer = await agent.asked.get()
        store.reset(1)
        try:
            assert await closed_by_peer(reader)
        finally:
            writer.close()
        answer.set_result(("served", "", "h1"))  # too late: it reads nothing of the old round
        assert store.state.data == {}
        assert store.connections == 0
