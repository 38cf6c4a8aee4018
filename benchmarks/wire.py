"""Wire and mux benchmark: framed, authenticated throughput against its physical baselines.

Run: ``python benchmarks/wire.py [--rounds 3] [--total-mib 1024]``

Measured in one run, side by side, rounds interleaved (median of rounds):

(a) bulk: 4 MiB tensor frames through the mux (client process -> controller process,
    HMAC on both ends, payload copied once into the frame's buffer) against a raw
    Protocol socket pair moving the same bytes, and against bare HMAC-SHA256 speed;
(b) small control frames per second through the mux (pipelined heartbeats);
(c) encode/decode cost per control frame and per 16 MiB tensor frame, in-process.

Both stock asyncio and uvloop are reported. Targets (issue 2): (a) >= 0.8x the
lower of raw socket and HMAC speed; (b) >= 100k frames/s.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import multiprocessing
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flodl_async.net.framed import FramedProtocol, open_framed
from flodl_async.net.mux import PortMux
from flodl_async.net.service import FramedService
from flodl_async.wire import Channel, FrameConnection, SessionKeys, Side
from flodl_async.wire import messages as m
from flodl_async.wire.frame import Frame, FrameLimits, PayloadPool

MiB = 1024 * 1024
SECRET = bytes(range(16))
KEYS = SessionKeys.derive(SECRET, "bench")
CHUNK = 4 * MiB
LIMITS = FrameLimits(max_payload=64 * MiB)


def _loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


# ----- the controller side (a child process) -------------------------------------------------


POOL = PayloadPool(max_per_size=32)


def _marker(channel: Channel, count: float) -> m.Heartbeat | m.TensorBundle:
    """The end-of-trial marker and its answer (carrying ``count``): a kind the channel carries both ways."""
    if channel is Channel.DATA:
        return m.TensorBundle(round=-1, weight=count, tensors=())
    return m.Heartbeat(sent_at=count)


def _marked_count(msg: m.Heartbeat | m.TensorBundle) -> float:
    return msg.weight if isinstance(msg, m.TensorBundle) else msg.sent_at


async def _count_frames(link: FramedProtocol) -> None:
    """Consume frames; on a marker, answer with how many payload bytes (or frames) arrived."""
    received = 0
    while True:
        frame = await link.recv()
        if isinstance(frame.message, m.Heartbeat | m.TensorBundle) and frame.payload is None:
            link.send(_marker(link.channel, float(received)))
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
                service = FramedService(channel=channel, keys=KEYS, handler=_count_frames, task_group=tg, limits=LIMITS, allocate=POOL.acquire)
                mux.register(channel, service.protocol_factory)
            await mux.start()
            port_out.send((mux.port, raw.sockets[0].getsockname()[1]))
            await loop.run_in_executor(None, port_out.recv)  # parent says stop
            raw.close()
            await mux.aclose()

    with asyncio.Runner(loop_factory=_loop_factory(kind)) as runner:
        runner.run(main())


# ----- the client side -------------------------------------------------------------------------


async def _bulk_framed(port: int, total: int) -> float:
    link = await open_framed("127.0.0.1", port, channel=Channel.DATA, keys=KEYS, limits=LIMITS)
    payload = memoryview(os.urandom(CHUNK))
    bundle = m.TensorBundle(round=0, weight=1.0, tensors=(m.TensorSpec(name="x", dtype="uint8", shape=(CHUNK,), offset=0, nbytes=CHUNK),))
    start = time.perf_counter()
    for _ in range(total // CHUNK):
        await link.send_tensors(bundle, [payload])
    link.send(_marker(Channel.DATA, 0.0))
    reply = await link.recv_message()
    elapsed = time.perf_counter() - start
    assert isinstance(reply, m.TensorBundle) and int(_marked_count(reply)) == total, reply
    await link.aclose()
    return total / elapsed / 1e6


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


async def _bulk_raw(port: int, total: int) -> float:
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_connection(_RawSource, "127.0.0.1", port)
    payload = os.urandom(CHUNK)
    start = time.perf_counter()
    for _ in range(total // CHUNK):
        transport.write(payload)
        await proto.can_write.wait()
    await proto.acked
    elapsed = time.perf_counter() - start
    transport.close()
    return total / elapsed / 1e6


async def _small_frames(port: int, count: int) -> float:
    link = await open_framed("127.0.0.1", port, channel=Channel.CONTROL, keys=KEYS)
    msg = m.RankHello(rank=3, local_rank=1, world_size=4, pid=1234)
    start = time.perf_counter()
    batch: list[bytes] = []
    for _ in range(count):
        batch.append(link.codec.send(msg))
        if len(batch) == 256:
            link._writable().write(b"".join(batch))  # coalesced writes, as a busy sender's buffer would be
            batch.clear()
            await link.drain()
    link._writable().write(b"".join(batch))
    link.send(_marker(Channel.CONTROL, -1.0))
    reply = await link.recv_message()
    elapsed = time.perf_counter() - start
    assert isinstance(reply, m.Heartbeat) and int(_marked_count(reply)) == count, reply
    await link.aclose()
    return count / elapsed


def _blocking_sink(port_out: multiprocessing.connection.Connection, total: int) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port_out.send(listener.getsockname()[1])
    conn, _ = listener.accept()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    for _ in range(total // CHUNK):
        got = 0
        while got < CHUNK:
            got += conn.recv_into(view[got:], CHUNK - got)
        hmac.new(SECRET, buf, hashlib.sha256).digest()
    conn.sendall(b"!")
    conn.close()
    listener.close()


def _blocking_hmac_pair(total: int) -> float:
    """The simplest design with HMAC on both ends: blocking sockets, no framing, no event loop."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    sink = ctx.Process(target=_blocking_sink, args=(child, total), daemon=True)
    sink.start()
    conn = socket.create_connection(("127.0.0.1", parent.recv()))
    data = os.urandom(CHUNK)
    start = time.perf_counter()
    for _ in range(total // CHUNK):
        hmac.new(SECRET, data, hashlib.sha256).digest()
        conn.sendall(data)
    conn.recv(1)
    elapsed = time.perf_counter() - start
    conn.close()
    sink.join(10)
    return total / elapsed / 1e6


def _hmac_speed(total: int) -> float:
    buf = os.urandom(CHUNK)
    start = time.perf_counter()
    for _ in range(total // CHUNK):
        hmac.new(SECRET, buf, hashlib.sha256).digest()
    return total / (time.perf_counter() - start) / 1e6


def _codec_costs(repeat: int = 20000) -> dict[str, float]:
    # A control frame where the kind table allows it: an agent's RankExited on the join channel.
    agent = FrameConnection(channel=Channel.JOIN, side=Side.PEER, keys=KEYS)
    controller = FrameConnection(channel=Channel.JOIN, side=Side.CONTROLLER, keys=KEYS)
    msg = m.RankExited(round=1, rank=3, local_rank=1, host="node-a", exit_code=1, stderr_tail=("line",))
    start = time.perf_counter()
    frames = [agent.send(msg) for _ in range(repeat)]
    encode = (time.perf_counter() - start) / repeat * 1e6
    start = time.perf_counter()
    for data in frames:
        controller.receive_data(data)
        assert isinstance(controller.next_frame(), Frame)
    decode = (time.perf_counter() - start) / repeat * 1e6
    sender = FrameConnection(channel=Channel.DATA, side=Side.PEER, keys=KEYS, limits=LIMITS)
    pool = PayloadPool()
    receiver = FrameConnection(channel=Channel.DATA, side=Side.CONTROLLER, keys=KEYS, limits=LIMITS, allocate=pool.acquire)
    big = memoryview(os.urandom(16 * MiB))
    bundle = m.TensorBundle(round=0, weight=1.0, tensors=(m.TensorSpec(name="x", dtype="uint8", shape=(16 * MiB,), offset=0, nbytes=16 * MiB),))
    enc_t, dec_t = [], []
    for _ in range(5):
        start = time.perf_counter()
        parts = sender.send_parts(bundle, [big])
        enc_t.append(time.perf_counter() - start)
        wire = [bytes(p) for p in parts]
        start = time.perf_counter()
        for piece in wire:
            for offset in range(0, len(piece), 256 * 1024):  # as a socket hands it over
                receiver.receive_data(piece[offset : offset + 256 * 1024])
        frame = receiver.next_frame()
        dec_t.append(time.perf_counter() - start)
        assert isinstance(frame, Frame)
        assert frame.payload is not None
        pool.release(frame.payload)
    return {
        "control encode us": encode,
        "control decode us": decode,
        "16MiB tensor encode ms": statistics.median(enc_t) * 1e3,
        "16MiB tensor decode ms": statistics.median(dec_t) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes per bulk trial")
    parser.add_argument("--frames", type=int, default=200_000, help="control frames per trial")
    args = parser.parse_args()
    total = args.total_mib * MiB
    ctx = multiprocessing.get_context("fork")
    results: dict[str, dict[str, list[float]]] = {}
    for kind in ("asyncio", "uvloop"):
        parent, child = ctx.Pipe()
        server = ctx.Process(target=_serve, args=(kind, child, total), daemon=True)
        server.start()
        mux_port, raw_port = parent.recv()
        rows = results.setdefault(kind, {"raw MB/s": [], "framed MB/s": [], "ratio": [], "frames/s": []})

        async def trial(mux_port: int = mux_port, raw_port: int = raw_port, rows: dict[str, list[float]] = rows) -> None:
            for _ in range(args.rounds):
                raw = await _bulk_raw(raw_port, total)
                framed = await _bulk_framed(mux_port, total)
                rows["raw MB/s"].append(raw)
                rows["framed MB/s"].append(framed)
                rows["frames/s"].append(await _small_frames(mux_port, args.frames))

        with asyncio.Runner(loop_factory=_loop_factory(kind)) as runner:
            runner.run(trial())
        parent.send("stop")
        server.join(10)
    hmac_speeds = [_hmac_speed(total // 2) for _ in range(args.rounds)]
    hmac_mbs = statistics.median(hmac_speeds)
    blocking_mbs = statistics.median(_blocking_hmac_pair(total) for _ in range(args.rounds))
    print(f"\nbulk: {args.total_mib} MiB per trial in {CHUNK // MiB} MiB frames, {args.rounds} rounds, medians")
    print(f"{'loop':<8} {'raw socket MB/s':>16} {'framed+HMAC MB/s':>18} {'bare HMAC MB/s':>15} {'framed / min(raw,HMAC)':>24} {'control frames/s':>17}")
    for kind, rows in results.items():
        raw = statistics.median(rows["raw MB/s"])
        framed = statistics.median(rows["framed MB/s"])
        ratio = framed / min(raw, hmac_mbs)
        print(f"{kind:<8} {raw:>16.0f} {framed:>18.0f} {hmac_mbs:>15.0f} {ratio:>24.2f} {statistics.median(rows['frames/s']):>17.0f}")
    print(
        f"\nreference: blocking sockets with HMAC on both ends (no framing, no loop): {blocking_mbs:.0f} MB/s "
        f"({blocking_mbs / hmac_mbs:.2f}x bare HMAC) — what two processes sharing this machine's cores reach"
    )
    print("\ncodec cost, in-process")
    for name, value in _codec_costs().items():
        print(f"  {name:<24} {value:8.2f}")
    print("\ntargets: framed >= 0.80 x min(raw, HMAC); control frames >= 100000/s")


if __name__ == "__main__":
    main()
