"""TCP-leg benchmark: a sealed tensor frame to another process and back, as a worker host's relay
and the controller exchange them.

Run: ``python benchmarks/tcpleg.py [--sizes 16,64] [--rounds 20] [--warmup 3]`` (``--smoke``: one
1 MiB round, for the test suite)

A server process runs a real :class:`~flodl_async.net.mux.PortMux` with a data-channel
:class:`~flodl_async.net.service.FramedService` that sends every tensor frame it receives
straight back (a host's ``HostContribution`` up, its payload back as a ``Consensus``, as the
reducer sends one). The client dials it with
:func:`~flodl_async.net.framed.open_framed`, sends one float payload of each size and waits
for the echo: one round is seal → write → read → open, twice, on two processes (AES-256-GCM
payloads, HMAC'd frames, pooled buffers on both ends). Unlike ``averaging.py --uplink tcp``,
whose relay and reducer share one event loop, the two ends here have their own, as on two
hosts. Prints median, 25th percentile and minimum round trip per size (the machine may be shared).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.connection
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 1 << 20
SECRET = bytes(range(16))
RUN_ID = "bench"


def _server(conn: multiprocessing.connection.Connection, max_payload: int) -> None:
    from flodl_async.net.loop import run

    run(_server_main(conn, max_payload))


async def _server_main(conn: multiprocessing.connection.Connection, max_payload: int) -> None:
    from flodl_async.errors import ConnectionClosed
    from flodl_async.net.bufpool import BufferPool
    from flodl_async.net.framed import FramedProtocol
    from flodl_async.net.mux import PortMux
    from flodl_async.net.service import FramedService
    from flodl_async.wire import Channel
    from flodl_async.wire import messages as m
    from flodl_async.wire.frame import FrameLimits
    from flodl_async.wire.handshake import session_resolver

    pool = BufferPool()

    async def echo(link: FramedProtocol) -> None:
        try:
            while True:
                frame = await link.recv()
                msg = frame.message
                assert isinstance(msg, m.HostContribution), msg
                parts = [frame.payload] if frame.payload is not None else []
                back = m.Consensus(round=msg.round, kind=msg.kind, mass=1.0, tensors=msg.tensors)
                await link.send_tensors(back, parts)
                if frame.payload is not None:
                    pool.release(frame.payload)  # its ciphertext is in the sealing buffer now
        except ConnectionClosed:
            return

    mux = PortMux(host="127.0.0.1", port=0)
    async with asyncio.TaskGroup() as tg:
        limits = FrameLimits(max_payload=max_payload)
        service = FramedService(
            channel=Channel.DATA,
            resolve=session_resolver(SECRET),
            run_id=RUN_ID,
            handler=echo,
            task_group=tg,
            limits=limits,
            allocate=pool.acquire,
        )
        mux.register(Channel.DATA, service.protocol_factory)
        await mux.start()
        conn.send(mux.port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # the client says stop
        await mux.aclose()


async def _client(
    port: int, sizes: list[int], rounds: int, warmup: int, max_payload: int
) -> dict[int, list[float]]:
    from flodl_async.net.bufpool import BufferPool
    from flodl_async.net.framed import open_framed
    from flodl_async.wire import Channel, Credential
    from flodl_async.wire import messages as m
    from flodl_async.wire.frame import FrameLimits

    pool = BufferPool()
    limits = FrameLimits(max_payload=max_payload)
    async with asyncio.timeout(10):
        link = await open_framed(
            "127.0.0.1",
            port,
            channel=Channel.DATA,
            credential=Credential.session(SECRET),
            limits=limits,
            allocate=pool.acquire,
        )
    results: dict[int, list[float]] = {}
    try:
        for size in sizes:
            payload = bytearray(os.urandom(size * MiB))
            spec = m.TensorSpec(
                name="w", dtype="float32", shape=(len(payload) // 4,), offset=0, nbytes=len(payload)
            )
            times: list[float] = []
            for k in range(warmup + rounds):
                up = m.HostContribution(
                    round=k + 1,
                    kind="model",
                    host="bench",
                    ranks=(0,),
                    weight=1.0,
                    prescaled=False,
                    tensors=(spec,),
                    steps=(1,),
                )
                t0 = time.perf_counter()
                await link.send_tensors(up, [payload])
                frame = await link.recv()
                if k >= warmup:
                    times.append((time.perf_counter() - t0) * 1000.0)
                assert frame.payload is not None and frame.payload.nbytes == len(payload)
                pool.release(frame.payload)
            results[size] = times
    finally:
        await link.aclose()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,64", help="MiB per payload, comma separated")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="one 1 MiB round, no warm-up")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.rounds, args.warmup = "1", 1, 0
    sizes = [int(s) for s in args.sizes.split(",")]
    max_payload = max(sizes) * MiB

    from flodl_async.net.loop import run

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    server = ctx.Process(target=_server, args=(there, max_payload), name="tcpleg-server")
    server.start()
    try:
        port = here.recv()
        results = run(_client(port, sizes, args.rounds, args.warmup, max_payload))
    finally:
        here.send(None)
        server.join(30)
        if server.is_alive():
            server.kill()
            server.join()
    print(
        "sealed tensor frame, client → server process → back over loopback TCP (ms per round trip)"
    )
    print(f"{'size':>8} | {'rounds':>6} | {'median':>8} | {'p25':>8} | {'min':>8}")
    for size in sizes:
        t = sorted(results[size])
        print(
            f"{size:>4} MiB | {len(t):>6} | {statistics.median(t):8.1f} | {t[len(t) // 4]:8.1f} | "
            f"{t[0]:8.1f}"
        )


if __name__ == "__main__":
    main()
