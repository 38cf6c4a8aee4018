"""The one-port mux on real loopback sockets."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import typing
from collections.abc import AsyncIterator, Callable

import pytest

from flodl_async.errors import AuthenticationFailed, ConfigError, ConnectionClosed, PortInUseError
from flodl_async.net.admission import AdmissionLimits
from flodl_async.net.framed import FramedProtocol, open_framed
from flodl_async.net.http import StatusHttpProtocol
from flodl_async.net.mux import PortMux, check_bind_host
from flodl_async.net.service import FramedService
from flodl_async.status import StatusBoard
from flodl_async.wire import CHANNEL_MAGIC, Channel, Credential
from flodl_async.wire import messages as m
from flodl_async.wire.frame import FrameLimits
from flodl_async.wire.handshake import session_resolver
from flodl_async.wire.schema import Message

from .wirekit import raw_handshake

FRAMED_CHANNELS = [Channel.JOIN, Channel.RENDEZVOUS, Channel.DATA, Channel.CONTROL]


# What each channel's probe and answer are, by the kind table: the probe is a kind a peer may send
# there, the answer one the controller may send back, carrying the text "<channel>:<tag>".
_PROBES: dict[Channel, Callable[[float], Message]] = {
    Channel.JOIN: lambda tag: m.Heartbeat(sent_at=tag),
    Channel.RENDEZVOUS: lambda tag: m.StoreAddress(round=0, host=repr(tag), port=0),
    Channel.DATA: lambda tag: m.Contribution(round=0, kind="model", rank=0, weight=tag, steps=1),
    Channel.CONTROL: lambda tag: m.Heartbeat(sent_at=tag),
}
_ANSWERS: dict[Channel, Callable[[str], Message]] = {
    Channel.JOIN: lambda text: m.JoinReject(reason=text),
    Channel.DATA: lambda text: m.Consensus(
        round=0,
        kind="model",
        mass=0.0,
        tensors=(m.TensorSpec(name=text, dtype="uint8", shape=(0,), offset=0, nbytes=0),),
    ),
    Channel.CONTROL: lambda text: m.RankWelcome(rank=0, run_id=text),
}
_TEXT_OF: dict[type[Message], Callable[[typing.Any], str]] = {
    m.JoinReject: lambda msg: msg.reason,
    m.Consensus: lambda msg: msg.tensors[0].name,
    m.RankWelcome: lambda msg: msg.run_id,
}
_TAG_OF: dict[type[Message], Callable[[typing.Any], float]] = {
    m.Heartbeat: lambda msg: msg.sent_at,
    m.StoreAddress: lambda msg: float(msg.host),
    m.Contribution: lambda msg: msg.weight,
}
#: Nothing may travel down the rendezvous channel: its answers come back through memory (one process).
_RENDEZVOUS_ANSWERS: dict[float, str] = {}


async def _echo_channel_name(link: FramedProtocol) -> None:
    """Answer every probe with a message naming the channel it arrived on."""
    while True:
        msg = await link.recv_message()
        text = f"{link.channel.value}:{_TAG_OF[type(msg)](msg)}"
        answer = _ANSWERS.get(link.channel)
        if answer is None:
            _RENDEZVOUS_ANSWERS[_TAG_OF[type(msg)](msg)] = text
            link.close()  # the peer's signal that the answer is in
            return
        link.send(answer(text))
        await link.drain()


@pytest.fixture
async def mux(secret: bytes) -> AsyncIterator[PortMux]:
    # Every client here is 127.0.0.1 and these tests are about routing: the per-address cap must not bite.
    mux = PortMux(
        host="127.0.0.1",
        port=0,
        sniff_timeout=3.0,
        limits=AdmissionLimits(max_unauthenticated=1024, max_unauthenticated_per_peer=1024),
    )
    async with asyncio.TaskGroup() as tg:
        for channel in FRAMED_CHANNELS:
            service = FramedService(
                channel=channel,
                resolve=session_resolver(secret),
                run_id="test-run",
                handler=_echo_channel_name,
                task_group=tg,
            )
            mux.register(channel, service.protocol_factory)
        await mux.start()
        try:
            yield mux
        finally:
            await mux.aclose()


async def _ask(port: int, secret: bytes, channel: Channel, tag: float) -> str:
    link = await open_framed(
        "127.0.0.1", port, channel=channel, credential=Credential.session(secret)
    )
    try:
        link.send(_PROBES[channel](tag))
        if channel is Channel.RENDEZVOUS:
            with pytest.raises(ConnectionClosed):
                await link.recv()
            return _RENDEZVOUS_ANSWERS.pop(tag)
        reply = await link.recv_message()
        return _TEXT_OF[type(reply)](reply)
    finally:
        await link.aclose()


async def test_hundreds_of_concurrent_connections_are_routed(mux: PortMux, secret: bytes) -> None:
    jobs = [(FRAMED_CHANNELS[i % 4], float(i)) for i in range(400)]
    async with asyncio.timeout(30):
        answers = await asyncio.gather(
            *(_ask(mux.port, secret, channel, tag) for channel, tag in jobs)
        )
    assert answers == [f"{channel.value}:{tag}" for channel, tag in jobs]
    stats = mux.statistics()
    assert stats.accepted == 400
    assert stats.routed == {channel.value: 100 for channel in FRAMED_CHANNELS}
    assert stats.dropped == {}


async def _raw(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def test_bad_peers_do_not_delay_good_ones(mux: PortMux, secret: bytes) -> None:
    silent = [await _raw(mux.port) for _ in range(50)]
    half_magic = [await _raw(mux.port) for _ in range(20)]
    for _, writer in half_magic:
        writer.write(CHANNEL_MAGIC[Channel.JOIN][:2])
        await writer.drain()
    half_open = [await _raw(mux.port) for _ in range(20)]
    for _, writer in half_open:
        writer.write(b"\xf1")
        writer.write_eof()
    garbage = [await _raw(mux.port) for _ in range(20)]
    for _, writer in garbage:
        writer.write(b"\x00garbage that names no channel")
    answers = await asyncio.gather(
        *(_ask(mux.port, secret, FRAMED_CHANNELS[i % 4], float(i)) for i in range(40))
    )
    assert len(answers) == 40
    # The good peers finished while the silent ones still hold their slots: nobody waited for the deadline.
    stats = mux.statistics()
    assert stats.dropped.get("sniff_timeout", 0) == 0
    assert stats.unsniffed_now >= 70
    # Garbage and half-open peers are closed at once, without waiting for the deadline.
    for reader, _ in garbage + half_open:
        assert await asyncio.wait_for(reader.read(), 2) == b""
    stats = mux.statistics()
    assert stats.dropped["unknown_magic"] == 20
    assert stats.dropped["early_close"] == 20
    # Silent peers are dropped at the deadline.
    for reader, _ in silent + half_magic:
        assert await asyncio.wait_for(reader.read(), 10) == b""
    assert mux.statistics().dropped["sniff_timeout"] == 70
    for _, writer in silent + half_magic + half_open + garbage:
        writer.close()


async def test_channel_without_handler_closes_at_once(secret: bytes) -> None:
    mux = PortMux(host="127.0.0.1", port=0)
    await mux.start()
    try:
        reader, writer = await _raw(mux.port)
        writer.write(CHANNEL_MAGIC[Channel.DATA] + b"x")
        assert await asyncio.wait_for(reader.read(), 2) == b""
        writer.close()
        assert mux.statistics().dropped == {"no_handler": 1}
    finally:
        await mux.aclose()


async def test_a_full_cap_evicts_the_oldest_unsniffed_connection_for_the_newcomer() -> None:
    mux = PortMux(
        host="127.0.0.1",
        port=0,
        limits=AdmissionLimits(max_unauthenticated=10, max_unauthenticated_per_peer=5),
        sniff_timeout=30,
    )
    await mux.start()
    try:
        held = [await _raw(mux.port) for _ in range(5)]
        newcomer = await _raw(mux.port)
        oldest_reader, _ = held[0]
        with contextlib.suppress(
            ConnectionResetError
        ):  # evicted: aborted, so the peer may see a reset
            assert await asyncio.wait_for(oldest_reader.read(), 2) == b""
        stats = mux.statistics()
        assert stats.dropped == {"evicted": 1}
        assert stats.unsniffed_now == 5
        for _, w in [*held, newcomer]:
            w.close()
    finally:
        await mux.aclose()


async def test_status_switched_off_refuses_requests_as_over_capacity() -> None:
    mux = PortMux(
        host="127.0.0.1", port=0, limits=AdmissionLimits(max_status=0, max_status_per_peer=0)
    )
    mux.register(Channel.STATUS, lambda: StatusHttpProtocol(StatusBoard()))
    await mux.start()
    try:
        reader, writer = await _raw(mux.port)
        writer.write(b"GET / HTTP/1.1\r\n\r\n")
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(reader.read(), 2) == b""
        writer.close()
        assert mux.statistics().dropped == {"over_capacity": 1}
    finally:
        await mux.aclose()


async def test_wrong_secret_frame_closes_only_that_connection(mux: PortMux, secret: bytes) -> None:
    # The controller's handshake proof does not verify under another secret: the dial fails, no frame is sent.
    with pytest.raises(
        AuthenticationFailed, match=r"handshake proof did not verify .*--secret-file"
    ):
        await asyncio.wait_for(
            open_framed(
                "127.0.0.1",
                mux.port,
                channel=Channel.CONTROL,
                credential=Credential.session(b"\x01" * 16),
            ),
            5,
        )
    assert await _ask(mux.port, secret, Channel.CONTROL, 2.0) == "control:2.0"


async def test_live_listener_gives_a_clear_error(mux: PortMux) -> None:
    second = PortMux(host="127.0.0.1", port=mux.port)
    with pytest.raises(PortInUseError, match=rf"port {mux.port} .*flodl status"):
        await second.start()


async def test_time_wait_never_blocks_a_rebind(secret: bytes) -> None:
    first = PortMux(host="127.0.0.1", port=0)
    async with asyncio.TaskGroup() as tg:
        service = FramedService(
            channel=Channel.CONTROL,
            resolve=session_resolver(secret),
            run_id="test-run",
            handler=_echo_channel_name,
            task_group=tg,
        )
        first.register(Channel.CONTROL, service.protocol_factory)
        await first.start()
        port = first.port
        link = await open_framed(
            "127.0.0.1", port, channel=Channel.CONTROL, credential=Credential.session(secret)
        )
        link.send(m.Heartbeat(sent_at=1.0))
        await link.recv()
        await first.aclose()  # the server side closes first: its socket goes to TIME_WAIT
        await link.aclose()
    second = PortMux(host="127.0.0.1", port=port)
    await second.start()
    await second.aclose()


def test_bind_scope_is_wildcard_or_loopback() -> None:
    assert check_bind_host("0.0.0.0") == "0.0.0.0"
    assert check_bind_host("localhost") == "127.0.0.1"
    assert check_bind_host("::1") == "::1"
    with pytest.raises(ConfigError, match="neither the wildcard nor loopback"):
        check_bind_host("10.1.2.3")
    with pytest.raises(ConfigError, match="not an IP address"):
        check_bind_host("example.org")


def test_port_mux_binds_for_real() -> None:
    async def main() -> int:
        mux = PortMux(host="127.0.0.1", port=0)
        await mux.start()
        port = mux.port
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
        await mux.aclose()
        return port

    assert asyncio.run(main()) > 0


def test_routing_and_bad_peers_on_uvloop(secret: bytes) -> None:
    """The same mux on uvloop (the loop the launcher uses): routing, garbage and silence."""
    import uvloop

    async def main() -> None:
        mux = PortMux(host="127.0.0.1", port=0, sniff_timeout=30)
        async with asyncio.TaskGroup() as tg:
            for channel in FRAMED_CHANNELS:
                service = FramedService(
                    channel=channel,
                    resolve=session_resolver(secret),
                    run_id="test-run",
                    handler=_echo_channel_name,
                    task_group=tg,
                )
                mux.register(channel, service.protocol_factory)
            await mux.start()
            silent = [await _raw(mux.port) for _ in range(10)]
            reader, writer = await _raw(mux.port)
            writer.write(b"garbage!")
            answers = await asyncio.gather(
                *(_ask(mux.port, secret, FRAMED_CHANNELS[i % 4], float(i)) for i in range(200))
            )
            assert answers == [f"{FRAMED_CHANNELS[i % 4].value}:{float(i)}" for i in range(200)]
            assert await asyncio.wait_for(reader.read(), 2) == b""
            assert mux.statistics().dropped == {"unknown_magic": 1}
            for _, w in [*silent, (reader, writer)]:
                w.close()
            await mux.aclose()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


def test_sniff_deadline_scales_with_the_one_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", "3")
    assert PortMux(host="127.0.0.1", port=0).sniff_timeout == 15.0
    assert PortMux(host="127.0.0.1", port=0).handshake_timeout == 15.0
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", "0.01")
    with pytest.raises(
        ConfigError,
        match=r"FLODL_NET_TIMEOUT_SCALE='0\.01' must be a finite number of at least 0\.1",
    ):
        PortMux(host="127.0.0.1", port=0)


async def test_tensor_frames_cross_the_data_channel_and_tampering_is_caught(secret: bytes) -> None:
    """Real sockets: buffered receive into the payload, MAC checked in a worker thread, in order."""
    received: list[tuple[int, bytes]] = []
    all_in = asyncio.Event()

    async def collect(link: FramedProtocol) -> None:
        while True:
            frame = await link.recv()
            assert isinstance(frame.message, m.Contribution)
            assert frame.payload is not None
            received.append((frame.message.round, bytes(frame.payload)))
            if len(received) == 4:
                all_in.set()

    mux = PortMux(host="127.0.0.1", port=0)
    async with asyncio.TaskGroup() as tg:
        service = FramedService(
            channel=Channel.DATA,
            resolve=session_resolver(secret),
            run_id="test-run",
            handler=collect,
            task_group=tg,
        )
        mux.register(Channel.DATA, service.protocol_factory)
        await mux.start()
        payloads = [bytes([i]) * (3 * 1024 * 1024 + i) for i in range(4)]
        link = await open_framed(
            "127.0.0.1", mux.port, channel=Channel.DATA, credential=Credential.session(secret)
        )
        for i, payload in enumerate(payloads):
            spec = m.TensorSpec(
                name="x", dtype="uint8", shape=(len(payload),), offset=0, nbytes=len(payload)
            )
            await link.send_tensors(
                m.Contribution(round=i, kind="model", rank=0, weight=1.0, steps=1, tensors=(spec,)),
                [payload],
            )
        await link.drain()
        async with asyncio.timeout(30):
            await all_in.wait()
        assert received == list(enumerate(payloads))
        await link.aclose()

        # A flipped payload bit closes the connection; nothing of that frame is delivered.
        raw_reader, raw_writer = await asyncio.open_connection("127.0.0.1", mux.port)
        sender = await raw_handshake(
            raw_reader, raw_writer, secret, Channel.DATA, limits=FrameLimits(max_payload=1 << 26)
        )
        spec = m.TensorSpec(name="x", dtype="uint8", shape=(2 << 20,), offset=0, nbytes=2 << 20)
        wire = bytearray(
            b"".join(
                bytes(p)
                for p in sender.send_parts(
                    m.Contribution(
                        round=9, kind="model", rank=0, weight=1.0, steps=1, tensors=(spec,)
                    ),
                    [b"\x07" * (2 << 20)],
                )
            )
        )
        wire[len(wire) // 2] ^= 1
        raw_writer.write(bytes(wire))
        assert await asyncio.wait_for(raw_reader.read(), 10) == b""
        raw_writer.close()
        assert [r for r, _ in received] == [0, 1, 2, 3]
        await mux.aclose()
