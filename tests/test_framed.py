"""The asyncio shell around the codec, on real loopback sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from flodl_async.errors import (
    AuthenticationFailed,
    BusyError,
    ConnectionClosed,
    FlodlError,
    TruncatedFrame,
    VersionMismatch,
)
from flodl_async.net.framed import FramedProtocol, server_protocol
from flodl_async.wire import ClientHandshake, Credential, FrameConnection, Side
from flodl_async.wire import messages as m
from flodl_async.wire.channels import Channel
from flodl_async.wire.frame import HEADER_LEN, Frame
from flodl_async.wire.handshake import session_resolver


@pytest.fixture
async def link_and_raw_peer(
    secret: bytes,
) -> AsyncIterator[
    tuple[FramedProtocol, asyncio.StreamReader, asyncio.StreamWriter, FrameConnection]
]:
    """A controller-side framed link on a loopback socket; the raw socket at its other end, handshake
    done by hand; and that end's frame codec (to forge, cut and tamper with frames)."""
    accepted: asyncio.Future[FramedProtocol] = asyncio.get_running_loop().create_future()

    def factory() -> FramedProtocol:
        link = server_protocol(Channel.CONTROL, session_resolver(secret), run_id="test-run")
        accepted.set_result(link)
        return link

    server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    link = await accepted
    try:
        async with asyncio.timeout(5):
            handshake = ClientHandshake(
                channel=Channel.CONTROL, credential=Credential.session(secret), version="test"
            )
            writer.write(handshake.hello())
            step = handshake.receive_data(await reader.read(4096))
            assert step.established is not None
            writer.write(step.send)
            await link.established()
        peer = FrameConnection(channel=Channel.CONTROL, side=Side.PEER, keys=step.established.keys)
        yield link, reader, writer, peer
    finally:
        writer.close()
        link.abort()
        server.close()
        await server.wait_closed()


RawPeer = tuple[FramedProtocol, asyncio.StreamReader, asyncio.StreamWriter, FrameConnection]


async def _receive(link: FramedProtocol) -> Frame | FlodlError:
    """One ``recv()``, its error returned rather than raised (so a TaskGroup keeps its siblings)."""
    try:
        return await link.recv()
    except FlodlError as exc:
        return exc


async def test_a_peer_abort_wakes_the_first_receiver_even_after_a_second_recv(
    link_and_raw_peer: RawPeer,
) -> None:
    link, _reader, writer, _peer = link_and_raw_peer
    async with asyncio.timeout(5), asyncio.TaskGroup() as tg:
        first = tg.create_task(_receive(link), name="first-receiver")
        second = tg.create_task(_receive(link), name="second-receiver")
        await asyncio.sleep(0)  # one loop turn, not a delay: both receivers start, in order
        writer.transport.abort()  # the peer breaks the connection
    closed = first.result()
    assert isinstance(closed, ConnectionClosed)
    assert closed.by_peer
    assert isinstance(second.result(), BusyError)


async def test_a_second_concurrent_receiver_is_busy_and_the_first_keeps_the_stream(
    link_and_raw_peer: RawPeer,
) -> None:
    link, _reader, writer, peer = link_and_raw_peer
    async with asyncio.timeout(5), asyncio.TaskGroup() as tg:
        first = tg.create_task(link.recv(), name="first-receiver")
        await asyncio.sleep(0)  # one loop turn: the first receiver is now waiting
        with pytest.raises(BusyError, match="one receiver at a time"):
            await link.recv()
        writer.write(peer.send(m.Heartbeat(sent_at=1.0)))
    assert first.result().message == m.Heartbeat(sent_at=1.0)
    # Once the first receiver has returned, the link has no receiver: the next recv is fine.
    writer.write(peer.send(m.Heartbeat(sent_at=2.0)))
    async with asyncio.timeout(5):
        assert (await link.recv()).message == m.Heartbeat(sent_at=2.0)


async def test_bad_bytes_wake_the_waiting_receiver_with_the_wire_error(
    link_and_raw_peer: RawPeer,
) -> None:
    link, reader, writer, _peer = link_and_raw_peer
    async with asyncio.timeout(5), asyncio.TaskGroup() as tg:
        waiting = tg.create_task(_receive(link), name="receiver")
        await asyncio.sleep(0)  # one loop turn: the receiver is now waiting
        writer.write(bytes(HEADER_LEN + 40))  # version 0: not a frame
        assert await reader.read() == b""  # dropped without a reply
    assert isinstance(waiting.result(), VersionMismatch)


async def test_frames_before_a_bad_one_are_delivered_then_the_error(
    link_and_raw_peer: RawPeer,
) -> None:
    link, reader, writer, peer = link_and_raw_peer
    good = [m.Heartbeat(sent_at=float(i)) for i in range(3)]
    stream = b"".join(peer.send(msg) for msg in good)
    tampered = bytearray(peer.send(m.Heartbeat(sent_at=9.0)))
    tampered[-1] ^= 1
    writer.write(stream + bytes(tampered))  # one write: most likely one read
    async with asyncio.timeout(5):
        assert [(await link.recv()).message for _ in good] == good
        with pytest.raises(AuthenticationFailed, match="did not verify"):
            await link.recv()
        assert await reader.read() == b""  # and the connection was dropped without a reply


async def test_a_peer_that_stops_mid_frame_is_a_truncated_frame_not_a_clean_close(
    link_and_raw_peer: RawPeer,
) -> None:
    link, _reader, writer, peer = link_and_raw_peer
    whole = peer.send(m.Heartbeat(sent_at=1.0))
    writer.write(whole + peer.send(m.Heartbeat(sent_at=2.0))[:-5])
    writer.write_eof()
    async with asyncio.timeout(5):
        assert (await link.recv()).message == m.Heartbeat(sent_at=1.0)
        with pytest.raises(TruncatedFrame):
            await link.recv()


def _small_kernel_buffers(link: FramedProtocol) -> None:
    import socket

    sock = link._transport.get_extra_info("socket") if link._transport is not None else None
    assert sock is not None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)


def test_sealing_buffers_are_reused_only_once_the_transport_wrote_them(secret: bytes) -> None:
    """uvloop writes from our buffers without copying: a buffer reused too early would corrupt a queued frame,
    and its GCM tag would then fail at the receiver. A slow receiver keeps frames queued while more are sealed."""
    import uvloop

    from flodl_async.net.framed import open_framed
    from flodl_async.net.mux import PortMux
    from flodl_async.net.service import FramedService
    from flodl_async.wire import Credential
    from flodl_async.wire.frame import FrameLimits

    count, size = 40, 1 << 20
    payloads = [bytes([i]) * size for i in range(count)]

    async def main() -> tuple[list[bytes], int]:
        received: list[bytes] = []
        done, sent_some = asyncio.Event(), asyncio.Event()

        async def slow_reader(link: FramedProtocol) -> None:
            _small_kernel_buffers(link)
            await sent_some.wait()  # not reading yet: the sender's frames queue up in its transport
            while len(received) < count:
                frame = await link.recv()
                received.append(bytes(frame.payload or b""))
            done.set()

        mux = PortMux(host="127.0.0.1", port=0)
        limits = FrameLimits(max_payload=2 * size)
        try:
            async with asyncio.timeout(60), asyncio.TaskGroup() as tg:
                service = FramedService(
                    channel=Channel.DATA,
                    resolve=session_resolver(secret),
                    run_id="r",
                    handler=slow_reader,
                    task_group=tg,
                    limits=limits,
                )
                mux.register(Channel.DATA, service.protocol_factory)
                await mux.start()
                link = await open_framed(
                    "127.0.0.1",
                    mux.port,
                    channel=Channel.DATA,
                    credential=Credential.session(secret),
                    limits=limits,
                )
                try:
                    _small_kernel_buffers(
                        link
                    )  # so frames wait in the transport, not in the kernel
                    for i, payload in enumerate(payloads):
                        spec = m.TensorSpec(
                            name="x", dtype="uint8", shape=(size,), offset=0, nbytes=size
                        )
                        if i == 20:
                            sent_some.set()
                        await link.send_tensors(
                            m.Contribution(
                                round=i, kind="model", rank=0, weight=1.0, steps=1, tensors=(spec,)
                            ),
                            [payload],
                        )
                    sent_some.set()
                    await done.wait()
                    allocations = link.sealing_allocations
                finally:
                    link.abort()
                await mux.aclose()
        finally:
            await mux.aclose()
        return received, allocations

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        received, allocations = runner.run(main())
    assert (
        received == payloads
    )  # every frame decrypted under its tag: no buffer was reused while queued
    assert allocations < count  # and buffers were reused once written
