"""Wire and mux benchmark: handshaken, authenticated, encrypted throughput against its physical
baselines.

Run: ``python benchmarks/wire.py [--rounds 3] [--total-mib 1024]`` (``--smoke``: tiny sizes, one
round, every stage, in seconds: the test suite runs it)

Measured in one run, side by side, rounds interleaved (median of rounds):

The data frames are the Trainer's own, as production sends them: a host's ``HostContribution``
frames to the controller after its ``HostDataHello`` was welcomed, a rank's ``Contribution``
frames to its relay after its ``DataHello``; the end of a trial is an empty contribution, answered
by a ``Consensus`` whose mass is the byte count that arrived.

(a) bulk: 4 MiB tensor frames through the mux, client process -> controller process, on
    one connection after its handshake: payloads AES-256-GCM-sealed, frames HMAC'd. Against
    a raw Protocol socket pair moving the same bytes on the same loop, and against the CPU's
    own AES-GCM speed (one core, in-process) and a blocking socket pair that runs AES-GCM on
    both ends with no framing and no loop (what two processes sharing these cores reach);
(b) one relay hop: rank process -> relay process (a real Relay: unix socket in, TCP out,
    each leg with its own handshake and keys; the rank's leg, an owner-only socket, carries
    plain payloads as a rank's DataLink sends them, the TCP leg sealed ones) -> controller
    process, against a bare uvloop byte forwarder between the same kinds of sockets;
(c) small control frames per second through the mux (pipelined heartbeats);
(d) what a connection's handshake costs: dial-to-established against a bare TCP connect;
(e) encode/decode cost per control frame and per 16 MiB tensor frame, in-process.

Targets (issue 7): (a) >= 0.8x raw; (b) >= 0.8x the bare forwarder; (c) >= 100k frames/s;
(d) at most one extra round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.connection
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from flodl_async.deadlines import Deadlines
from flodl_async.net.bufpool import BufferPool
from flodl_async.net.framed import FramedProtocol, open_framed, open_unix_framed
from flodl_async.net.mux import PortMux
from flodl_async.net.service import FramedService
from flodl_async.relay.control import Relay
from flodl_async.relay.fold import HELLO_LIMITS
from flodl_async.wire import Channel, Credential, FrameConnection, Side
from flodl_async.wire import messages as m
from flodl_async.wire.frame import NEED_DATA, Frame, FrameLimits
from flodl_async.wire.handshake import session_resolver

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from wirekit import handshake_keys  # the benchmark's codec pairs come from a real handshake too

MiB = 1024 * 1024
SECRET = bytes(range(16))
RUN_ID = "bench"
CHUNK = 4 * MiB
LIMITS = FrameLimits(max_payload=64 * MiB)


def _loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


DIGEST = "bench"
#: Each data frame is a round of its own; rounds only go up (the relay refuses a finished one).
_ROUNDS = iter(range(1, 1 << 62))


def _spec(nbytes: int) -> m.TensorSpec:
    return m.TensorSpec(name="x", dtype="uint8", shape=(nbytes,), offset=0, nbytes=nbytes)


def _host_frame(nbytes: int) -> m.HostContribution:
    """What a host's relay sends the controller: one rank's raw tensors (``nbytes == 0``: the
    end-of-trial marker, an empty contribution)."""
    return m.HostContribution(
        round=next(_ROUNDS),
        kind="model",
        host="bench",
        ranks=(0,),
        weight=1.0 if nbytes else 0.0,
        prescaled=False,
        tensors=(_spec(nbytes),) if nbytes else (),
        steps=(1 if nbytes else 0,),
    )


def _rank_frame(nbytes: int) -> m.Contribution:
    """What a rank sends its relay (``nbytes == 0``: the end-of-trial marker)."""
    return m.Contribution(
        round=next(_ROUNDS),
        kind="model",
        rank=0,
        weight=1.0 if nbytes else 0.0,
        steps=1 if nbytes else 0,
        tensors=(_spec(nbytes),) if nbytes else (),
    )


async def _welcomed(link: FramedProtocol, hello: m.DataHello | m.HostDataHello) -> FramedProtocol:
    """Say the data channel's hello and take the welcome, which raises the link's tensor
    ceiling."""
    link.send(hello)
    welcome = await link.recv_message()
    assert isinstance(welcome, m.DataWelcome), welcome
    assert link.codec is not None
    link.codec.limits = FrameLimits(max_payload=welcome.max_payload)
    return link


# ----- the controller side (a child process) -------------------------------------------------


POOL = BufferPool(max_per_size=32)


async def _count_frames(link: FramedProtocol) -> None:
    """Consume frames; on a marker, answer with how many payload bytes (or frames) arrived.

    A data connection is welcomed first, as the reducer welcomes a host: its tensor ceiling is
    zero until then.
    """
    if link.channel is Channel.DATA:
        hello = await link.recv_message()
        assert isinstance(hello, m.HostDataHello), hello
        assert link.codec is not None
        link.codec.limits = LIMITS
        link.send(m.DataWelcome(max_payload=LIMITS.max_payload))
    received = 0
    while True:
        frame = await link.recv()
        msg = frame.message
        if isinstance(msg, m.HostContribution) and not msg.tensors:
            done = m.Consensus(round=msg.round, kind=msg.kind, mass=float(received))
            await link.send_tensors(done, [])
            received = 0
        elif isinstance(msg, m.Heartbeat):
            link.send(m.Heartbeat(sent_at=float(received)))
            received = 0
        elif frame.payload is not None:
            received += frame.payload.nbytes
            POOL.release(frame.payload)
        else:
            received += 1


class _RawSink(asyncio.Protocol):
    """Counts raw bytes; writes one byte back when ``expected`` arrived."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.seen = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.seen += len(data)
        if self.seen >= self.expected:
            self.seen -= self.expected
            self.transport.write(b"!")  # type: ignore[attr-defined]


def _serve(kind: str, port_out: multiprocessing.connection.Connection, raw_expected: int) -> None:
    async def main() -> None:
        mux = PortMux(host="127.0.0.1", port=0)
        loop = asyncio.get_running_loop()
        raw = await loop.create_server(lambda: _RawSink(raw_expected), "127.0.0.1", 0)
        async with asyncio.TaskGroup() as tg:
            for channel in (Channel.DATA, Channel.CONTROL):
                service = FramedService(
                    channel=channel,
                    resolve=session_resolver(SECRET),
                    run_id=RUN_ID,
                    handler=_count_frames,
                    task_group=tg,
                    limits=HELLO_LIMITS if channel is Channel.DATA else LIMITS,
                    allocate=POOL.acquire,
                )
                mux.register(channel, service.protocol_factory)
            await mux.start()
            port_out.send((mux.port, raw.sockets[0].getsockname()[1]))
            await loop.run_in_executor(None, port_out.recv)  # parent says stop
            raw.close()
            await mux.aclose()

    with asyncio.Runner(loop_factory=_loop_factory(kind)) as runner:
        runner.run(main())


# ----- the client side -------------------------------------------------------------------------


async def _send_bulk(
    link: FramedProtocol, total: int, frame: Callable[[int], m.Contribution | m.HostContribution]
) -> float:
    """Send ``total`` bytes in ``CHUNK`` frames, then the marker; MB/s until its answer came."""
    payload = memoryview(os.urandom(CHUNK))
    start = time.perf_counter()
    for _ in range(total // CHUNK):
        await link.send_tensors(frame(CHUNK), [payload])
    marker = frame(0)
    await link.send_tensors(marker, [])
    while True:
        # a relay hands a rank that dials it the consensus that went by before (the last trial's)
        reply = (await link.recv()).message
        if isinstance(reply, m.Consensus) and reply.round == marker.round:
            break
    elapsed = time.perf_counter() - start
    assert int(reply.mass) == total, reply
    await link.aclose()
    return total / elapsed / 1e6


async def _bulk_framed(port: int, total: int) -> float:
    link = await open_framed(
        "127.0.0.1",
        port,
        channel=Channel.DATA,
        credential=Credential.session(SECRET),
        limits=HELLO_LIMITS,
        allocate=POOL.acquire,
    )
    hello = m.HostDataHello(host="bench", ranks=(0,), model_bytes=CHUNK, digest=DIGEST)
    return await _send_bulk(await _welcomed(link, hello), total, _host_frame)


class _RawSource(asyncio.Protocol):
    def __init__(self) -> None:
        self.can_write = asyncio.Event()
        self.can_write.set()
        self.acked = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def data_received(self, data: bytes) -> None:
        if not self.acked.done():
            self.acked.set_result(None)


async def _pump_raw(transport: asyncio.BaseTransport, proto: _RawSource, total: int) -> float:
    payload = os.urandom(CHUNK)
    start = time.perf_counter()
    for _ in range(total // CHUNK):
        transport.write(payload)  # type: ignore[attr-defined]
        await proto.can_write.wait()
    await proto.acked
    elapsed = time.perf_counter() - start
    transport.close()
    return total / elapsed / 1e6


async def _bulk_raw(port: int, total: int) -> float:
    transport, proto = await asyncio.get_running_loop().create_connection(
        _RawSource, "127.0.0.1", port
    )
    return await _pump_raw(transport, proto, total)


async def _small_frames(port: int, count: int) -> float:
    link = await open_framed(
        "127.0.0.1", port, channel=Channel.CONTROL, credential=Credential.session(SECRET)
    )
    assert link.codec is not None
    msg = m.RankHello(rank=3, local_rank=1, world_size=4, pid=1234)
    start = time.perf_counter()
    batch: list[bytes] = []
    for _ in range(count):
        batch.append(link.codec.send(msg))
        if len(batch) == 256:
            link._write(b"".join(batch))  # coalesced writes, as a busy sender's buffer would be
            batch.clear()
            await link.drain()
    link._write(b"".join(batch))
    link.send(m.Heartbeat(sent_at=-1.0))
    reply = await link.recv_message()
    elapsed = time.perf_counter() - start
    assert isinstance(reply, m.Heartbeat) and int(reply.sent_at) == count, reply
    await link.aclose()
    return count / elapsed


async def _connect_costs(port: int, raw_port: int, count: int = 200) -> tuple[float, float]:
    """Median ms from dial to a usable link: bare TCP connect, and connect + handshake."""
    loop = asyncio.get_running_loop()
    bare, handshaken = [], []
    for _ in range(count):
        start = time.perf_counter()
        transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", raw_port)
        bare.append(time.perf_counter() - start)
        transport.close()
        start = time.perf_counter()
        link = await open_framed(
            "127.0.0.1", port, channel=Channel.CONTROL, credential=Credential.session(SECRET)
        )
        handshaken.append(time.perf_counter() - start)
        link.abort()
    return statistics.median(bare) * 1e3, statistics.median(handshaken) * 1e3


# ----- (b) one relay hop: three processes ---------------------------------------------------------


def _relay_process(
    socket_dir: str, controller_port: int, ready: multiprocessing.connection.Connection
) -> None:
    """A real Relay, as an agent runs it: rank sockets in, its own upstream connections out."""

    async def main() -> None:
        async with asyncio.TaskGroup() as tg:
            relay = Relay(
                socket_path=os.path.join(socket_dir, "relay.sock"),
                data_socket_path=os.path.join(socket_dir, "data.sock"),
                secret=SECRET,
                run_id=RUN_ID,
                ranks=frozenset({0}),
                controller_host="127.0.0.1",
                controller_port=controller_port,
                task_group=tg,
                deadlines=Deadlines.resolve(),
            )
            await relay.start()
            relay.open_round(0)
            ready.send("ready")
            await asyncio.get_running_loop().run_in_executor(None, ready.recv)
            await relay.aclose()
            for task in tg._tasks:  # the relay's pumps end with their links; nothing else runs here
                task.cancel()

    with asyncio.Runner(loop_factory=_loop_factory("uvloop")) as runner:
        runner.run(main())


class _Forward(asyncio.Protocol):
    """One direction of a bare byte forwarder, with flow control both ways."""

    def __init__(self) -> None:
        self.peer: asyncio.Transport | None = None
        self.transport: asyncio.Transport | None = None
        self.pending: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.peer is None:
            self.pending.append(data)
        else:
            self.peer.write(data)

    def pause_writing(self) -> None:
        assert self.peer is not None
        self.peer.pause_reading()

    def resume_writing(self) -> None:
        assert self.peer is not None
        self.peer.resume_reading()


def _bare_forwarder(
    path: str, target_port: int, ready: multiprocessing.connection.Connection
) -> None:
    """unix socket in, TCP out, bytes copied as they come: the least a relay hop can do."""

    async def main() -> None:
        loop = asyncio.get_running_loop()

        dials: set[asyncio.Task[None]] = set()

        def accept() -> asyncio.Protocol:
            inbound = _Forward()

            async def dial() -> None:
                outbound = _Forward()
                out_transport, _ = await loop.create_connection(
                    lambda: outbound, "127.0.0.1", target_port
                )
                assert inbound.transport is not None
                outbound.peer, inbound.peer = inbound.transport, out_transport  # type: ignore[assignment]
                for chunk in inbound.pending:
                    out_transport.write(chunk)

            task = loop.create_task(dial())
            dials.add(task)
            task.add_done_callback(dials.discard)
            return inbound

        server = await loop.create_unix_server(accept, path)
        ready.send("ready")
        await loop.run_in_executor(None, ready.recv)
        server.close()

    with asyncio.Runner(loop_factory=_loop_factory("uvloop")) as runner:
        runner.run(main())


async def _relay_hop_framed(data_socket: str, total: int) -> float:
    """A rank's data link as :class:`~flodl_async.relay.datalink.DataLink` dials it: its own
    credential, plain payloads on the owner-only socket, ``DataHello`` first."""
    credential = Credential.for_rank(SECRET, run_id=RUN_ID, round=0, rank=0)
    link = await open_unix_framed(
        data_socket,
        channel=Channel.DATA,
        credential=credential,
        peer_label="relay",
        limits=HELLO_LIMITS,
        allocate=POOL.acquire,
        plain_payloads=True,
    )
    hello = m.DataHello(rank=0, model_bytes=CHUNK, digest=DIGEST)
    return await _send_bulk(await _welcomed(link, hello), total, _rank_frame)


async def _relay_hop_bare(path: str, total: int) -> float:
    transport, proto = await asyncio.get_running_loop().create_unix_connection(_RawSource, path)
    return await _pump_raw(transport, proto, total)


def _relay_hops(mux_port: int, raw_port: int, total: int, rounds: int) -> tuple[float, float]:
    ctx = multiprocessing.get_context("fork")
    scratch = tempfile.mkdtemp(prefix="fl-bench-")
    relay_parent, relay_child = ctx.Pipe()
    fwd_parent, fwd_child = ctx.Pipe()
    relay = ctx.Process(target=_relay_process, args=(scratch, mux_port, relay_child), daemon=True)
    forwarder = ctx.Process(
        target=_bare_forwarder,
        args=(os.path.join(scratch, "bare.sock"), raw_port, fwd_child),
        daemon=True,
    )
    relay.start()
    forwarder.start()
    relay_parent.recv()
    fwd_parent.recv()
    framed, bare = [], []

    async def trial() -> None:
        for _ in range(rounds):
            bare.append(await _relay_hop_bare(os.path.join(scratch, "bare.sock"), total))
            framed.append(await _relay_hop_framed(os.path.join(scratch, "data.sock"), total))

    try:
        with asyncio.Runner(loop_factory=_loop_factory("uvloop")) as runner:
            runner.run(trial())
    finally:
        relay_parent.send("stop")
        fwd_parent.send("stop")
        relay.join(10)
        forwarder.join(10)
        shutil.rmtree(scratch, ignore_errors=True)
    return statistics.median(framed), statistics.median(bare)


# ----- physical bounds --------------------------------------------------------------------------


def _aead_speed(total: int) -> tuple[float, float]:
    """One core's AES-256-GCM, encrypt and decrypt, MB/s (what sealing costs, per side)."""
    aead = AESGCM(bytes(32))
    plain = os.urandom(CHUNK)
    sealed = bytearray(CHUNK + 16)
    out = bytearray(CHUNK)
    aead.encrypt_into(bytes(12), plain, None, sealed)
    start = time.perf_counter()
    for _ in range(total // CHUNK):
        aead.encrypt_into(bytes(12), plain, None, sealed)
    enc = total / (time.perf_counter() - start) / 1e6
    start = time.perf_counter()
    for _ in range(total // CHUNK):
        aead.decrypt_into(bytes(12), sealed, None, out)
    return enc, total / (time.perf_counter() - start) / 1e6


def _blocking_sink(port_out: multiprocessing.connection.Connection, total: int) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port_out.send(listener.getsockname()[1])
    conn, _ = listener.accept()
    aead = AESGCM(bytes(32))
    buf = bytearray(CHUNK + 16)
    out = bytearray(CHUNK)
    view = memoryview(buf)
    for _ in range(total // CHUNK):
        got = 0
        while got < len(buf):
            got += conn.recv_into(view[got:], len(buf) - got)
        aead.decrypt_into(bytes(12), buf, None, out)
    conn.sendall(b"!")
    conn.close()
    listener.close()


def _blocking_aead_pair(total: int) -> float:
    """The simplest design with AES-GCM on both ends: blocking sockets, no framing, no event
    loop."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    sink = ctx.Process(target=_blocking_sink, args=(child, total), daemon=True)
    sink.start()
    conn = socket.create_connection(("127.0.0.1", parent.recv()))
    aead = AESGCM(bytes(32))
    data = os.urandom(CHUNK)
    sealed = bytearray(CHUNK + 16)
    start = time.perf_counter()
    for _ in range(total // CHUNK):
        aead.encrypt_into(bytes(12), data, None, sealed)
        conn.sendall(sealed)
    conn.recv(1)
    elapsed = time.perf_counter() - start
    conn.close()
    sink.join(10)
    return total / elapsed / 1e6


def _codec_costs(repeat: int = 20000, tensor_repeat: int = 5) -> dict[str, float]:
    # A control frame where the kind table allows it (an agent's heartbeat on the join channel), and
    # a
    # sealed one (RankExited: its body is encrypted as well as authenticated).
    keys = handshake_keys(SECRET, Channel.JOIN)
    agent = FrameConnection(channel=Channel.JOIN, side=Side.PEER, keys=keys.peer)
    controller = FrameConnection(channel=Channel.JOIN, side=Side.CONTROLLER, keys=keys.controller)
    costs: dict[str, float] = {}
    for name, msg in (
        ("control", m.Heartbeat(sent_at=1.0, rank=3)),
        (
            "sealed control",
            m.RankExited(
                round=1, rank=3, local_rank=1, host="node-a", exit_code=1, stderr_tail=("line",)
            ),
        ),
    ):
        start = time.perf_counter()
        frames = [agent.send(msg) for _ in range(repeat)]
        costs[f"{name} encode us"] = (time.perf_counter() - start) / repeat * 1e6
        start = time.perf_counter()
        for data in frames:
            controller.receive_data(data)
            assert isinstance(controller.next_frame(), Frame)
        costs[f"{name} decode us"] = (time.perf_counter() - start) / repeat * 1e6
    data_keys = handshake_keys(SECRET, Channel.DATA)
    sender = FrameConnection(
        channel=Channel.DATA, side=Side.PEER, keys=data_keys.peer, limits=LIMITS
    )
    pool = BufferPool()
    receiver = FrameConnection(
        channel=Channel.DATA,
        side=Side.CONTROLLER,
        keys=data_keys.controller,
        limits=LIMITS,
        allocate=pool.acquire,
    )
    big = memoryview(os.urandom(16 * MiB))
    buffer = bytearray(sender.wire_payload_length(16 * MiB))
    enc_t, dec_t = [], []
    for _ in range(tensor_repeat):
        start = time.perf_counter()
        sealing = sender.start_parts(_host_frame(16 * MiB), [big], buffer=buffer)
        sealing.seal()
        parts = sealing.parts()
        enc_t.append(time.perf_counter() - start)
        wire = [bytes(p) for p in parts]
        stream = memoryview(b"".join(wire))
        start = time.perf_counter()
        offset, frame = 0, None
        # the data channel's read path: the socket writes into get_buffer()
        while offset < len(stream):
            target = receiver.get_buffer(-1)
            n = min(len(target), len(stream) - offset)
            target[:n] = stream[offset : offset + n]
            receiver.buffer_updated(n)
            offset += n
            if (item := receiver.next_frame()) is not NEED_DATA:
                frame = item
        dec_t.append(time.perf_counter() - start)
        assert isinstance(frame, Frame)
        assert frame.payload is not None
        pool.release(frame.payload)
    costs["16MiB tensor encode ms"] = statistics.median(enc_t) * 1e3
    costs["16MiB tensor decode ms"] = statistics.median(dec_t) * 1e3
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes per bulk trial")
    parser.add_argument("--frames", type=int, default=200_000, help="control frames per trial")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes, one round: every stage in seconds"
    )
    args = parser.parse_args()
    dials, codec_repeat, tensor_repeat = 200, 20000, 5
    if args.smoke:
        args.rounds, args.total_mib, args.frames = 1, 2 * CHUNK // MiB, 2000
        dials, codec_repeat, tensor_repeat = 5, 200, 1
    total = args.total_mib * MiB
    ctx = multiprocessing.get_context("fork")
    results: dict[str, dict[str, list[float]]] = {}
    hops: tuple[float, float] | None = None
    connect: dict[str, tuple[float, float]] = {}
    for kind in ("asyncio", "uvloop"):
        parent, child = ctx.Pipe()
        server = ctx.Process(target=_serve, args=(kind, child, total), daemon=True)
        server.start()
        mux_port, raw_port = parent.recv()
        rows = results.setdefault(kind, {"raw MB/s": [], "framed MB/s": [], "frames/s": []})

        async def trial(
            mux_port: int = mux_port,
            raw_port: int = raw_port,
            rows: dict[str, list[float]] = rows,
            kind: str = kind,
        ) -> None:
            for _ in range(args.rounds):
                rows["raw MB/s"].append(await _bulk_raw(raw_port, total))
                rows["framed MB/s"].append(await _bulk_framed(mux_port, total))
                rows["frames/s"].append(await _small_frames(mux_port, args.frames))
            connect[kind] = await _connect_costs(mux_port, raw_port, dials)

        with asyncio.Runner(loop_factory=_loop_factory(kind)) as runner:
            runner.run(trial())
        if kind == "uvloop":
            hops = _relay_hops(mux_port, raw_port, total, args.rounds)
        parent.send("stop")
        server.join(10)
    enc, dec = (
        statistics.median(x)
        for x in zip(*(_aead_speed(total // 2) for _ in range(args.rounds)), strict=True)
    )
    blocking = statistics.median(_blocking_aead_pair(total) for _ in range(args.rounds))
    print(
        f"\n(a) bulk: {args.total_mib} MiB per trial in {CHUNK // MiB} MiB frames, {args.rounds} "
        "rounds, medians"
    )
    heads = (
        ("raw socket MB/s", 16),
        ("handshaken+AES-GCM MB/s", 24),
        ("framed / raw", 13),
        ("framed / blocking AES pair", 27),
        ("control frames/s", 17),
    )
    print(f"{'loop':<8} " + " ".join(f"{name:>{width}}" for name, width in heads))
    for kind, rows in results.items():
        raw = statistics.median(rows["raw MB/s"])
        framed = statistics.median(rows["framed MB/s"])
        print(
            f"{kind:<8} {raw:>16.0f} {framed:>24.0f} {framed / raw:>13.2f} "
            f"{framed / blocking:>27.2f} {statistics.median(rows['frames/s']):>17.0f}"
        )
    print(
        f"\nphysical bounds, same run: AES-256-GCM on one core {enc:.0f} MB/s encrypt, {dec:.0f} "
        "MB/s decrypt; "
        f"blocking sockets with AES-GCM on both ends (no framing, no loop): {blocking:.0f} MB/s"
    )
    assert hops is not None
    framed_hop, bare_hop = hops
    print(
        f"\n(b) one relay hop (rank -> relay -> controller, uvloop, {args.total_mib} MiB per "
        "trial):"
    )
    print(
        f"    bare uvloop forwarder {bare_hop:.0f} MB/s; flodl relay (two handshaken legs, TCP "
        f"sealed) {framed_hop:.0f} MB/s",
        end="",
    )
    print(f"; ratio {framed_hop / bare_hop:.2f}")
    print(f"\n(d) dial to a usable link, median of {dials}:")
    for kind, (bare_ms, hs_ms) in connect.items():
        print(
            f"    {kind:<8} bare TCP connect {bare_ms:.3f} ms; connect + handshake {hs_ms:.3f} ms "
            f"(+{hs_ms - bare_ms:.3f} ms)"
        )
    print("\n(e) codec cost, in-process")
    for name, value in _codec_costs(codec_repeat, tensor_repeat).items():
        print(f"    {name:<24} {value:8.2f}")
    print(
        "\ntargets: (a) framed >= 0.80 x raw; (b) relay >= 0.80 x bare forwarder; (c) control "
        "frames >= 100000/s; (d) one round trip"
    )


if __name__ == "__main__":
    main()
