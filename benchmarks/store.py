"""Store benchmark: torch's own TCPStore clients against our store on the controller port and
against torch's server.

Run: ``python benchmarks/store.py [--clients 8] [--ops 2000] [--rounds 3]`` (``--smoke``: 2
clients x 50 requests, one round, for the test suite)

Measured in one run, side by side, rounds interleaved (median of rounds). Each round starts
``--clients`` client processes, each a real ``torch.distributed.TCPStore(is_master=False)``,
and times the same work against both servers:

* ours: a real :class:`~flodl_async.net.mux.PortMux` serving a
  :class:`~flodl_async.net.portstore.PortStore` from its own process and loop (uvloop where
  installed), as the controller serves it: every connection sniffed on the one port and
  admitted by address;
* torch: torch's own ``TCPStore(is_master=True)`` server (its C++ libuv backend) in its own
  process.

Our store judges every connection as the controller does: the peer's socket owner from the
kernel, its process from ``/proc`` (:mod:`flodl_async.net.storegate`; the clients are this
benchmark's children, its tree is "the run"). ``connect`` is what that costs a client: the mean
time a ``TCPStore(is_master=False)`` takes to be constructed (connect, ``VALIDATE``, its first
round trip), all clients dialling at once.

Per client and operation, ``--ops`` sequential requests (one round trip each): ``set`` of a
64-byte value on its own keys, ``get`` of them, ``add`` on one counter shared by every client
(contended), and ``wait`` on a key that exists. The clients start together (a barrier) and the
time of an operation is from the first client starting to the last one done; the table prints
aggregate
requests per second and our throughput as a ratio of torch's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing
import multiprocessing.connection
import multiprocessing.synchronize
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

OPS = ("set", "get", "add", "wait")
COLUMNS = ("connect", *OPS)


def _serve_ours(
    ready: multiprocessing.connection.Connection, stop: multiprocessing.synchronize.Event
) -> None:
    from flodl_async.net.loop import run
    from flodl_async.net.mux import PortMux
    from flodl_async.net.portstore import PortStore
    from flodl_async.net.storegate import StoreGate
    from flodl_async.wire import Channel

    async def main() -> None:
        mux = PortMux(host="127.0.0.1", port=0, sniff_timeout=60.0, handshake_timeout=60.0)
        # the clients are our parent's children, as ranks are the controller's
        store = PortStore(gate=StoreGate(roots=(os.getppid(),), uids=(os.geteuid(),)))
        store.admit_host("127.0.0.1")
        mux.register(Channel.STORE, store.protocol_factory)
        await mux.start()
        ready.send(mux.port)
        try:
            await asyncio.to_thread(stop.wait)
        finally:
            store.close()
            await mux.aclose()

    run(main())


def _serve_torch(
    ready: multiprocessing.connection.Connection, stop: multiprocessing.synchronize.Event
) -> None:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    ready.send(store.port)
    stop.wait()
    del store


def _client(
    port: int,
    index: int,
    ops: int,
    barrier: multiprocessing.synchronize.Barrier,
    out: multiprocessing.connection.Connection,
) -> None:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    barrier.wait()
    dialled = time.perf_counter()
    store = TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=300))
    connect = time.perf_counter() - dialled
    value = b"v" * 64
    keys = [f"c{index}/k{i}" for i in range(ops)]
    store.set("present", "1")
    spans: dict[str, tuple[float, float]] = {}
    for op in OPS:
        barrier.wait()
        start = time.perf_counter()
        if op == "set":
            for key in keys:
                store.set(key, value)
        elif op == "get":
            for key in keys:
                store.get(key)
        elif op == "add":
            for _ in range(ops):
                store.add("shared", 1)
        else:
            for _ in range(ops):
                store.wait(["present"])
        spans[op] = (start, time.perf_counter())
    out.send((connect, spans))
    del store


def _trial(server: str, clients: int, ops: int) -> dict[str, float]:
    """Requests per second for each op, all clients together, against one server; and the mean
    seconds a client took to connect."""
    ctx = multiprocessing.get_context("spawn")
    ready_r, ready_w = ctx.Pipe(duplex=False)
    stop = ctx.Event()
    serve = _serve_ours if server == "ours" else _serve_torch
    srv = ctx.Process(target=serve, args=(ready_w, stop), daemon=True)
    srv.start()
    port = ready_r.recv()
    barrier = ctx.Barrier(clients + 1)
    pipes = [ctx.Pipe(duplex=False) for _ in range(clients)]
    procs = [
        ctx.Process(target=_client, args=(port, i, ops, barrier, w), daemon=True)
        for i, (_, w) in enumerate(pipes)
    ]
    try:
        for proc in procs:
            proc.start()
        for _ in COLUMNS:
            barrier.wait()
        answers = [r.recv() for r, _ in pipes]
        for proc in procs:
            proc.join()
    finally:
        stop.set()
        srv.join(timeout=30)
        for proc in (*procs, srv):
            if proc.is_alive():
                proc.kill()
                proc.join()
    spans = [s for _, s in answers]
    # perf_counter is CLOCK_MONOTONIC on Linux: one clock for every process on the machine.
    return {
        "connect": statistics.mean(c for c, _ in answers),
        **{
            op: clients * ops / (max(s[op][1] for s in spans) - min(s[op][0] for s in spans))
            for op in OPS
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=8, help="client processes per trial")
    parser.add_argument("--ops", type=int, default=2000, help="requests per client per operation")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--smoke", action="store_true", help="2 clients x 50 requests per op, one round"
    )
    args = parser.parse_args()
    if args.smoke:
        args.clients, args.ops, args.rounds = 2, 50, 1
    results: dict[str, list[dict[str, float]]] = {"ours": [], "torch": []}
    for _ in range(args.rounds):
        for server in ("ours", "torch"):  # interleaved: load from other work hits both alike
            results[server].append(_trial(server, args.clients, args.ops))
    print(
        f"TCPStore requests/s, {args.clients} torch client processes x {args.ops} requests per op, "
        f"median of {args.rounds} round(s)"
    )
    print(f"{'op':<6} {'ours (controller port)':>24} {'torch TCPStore server':>22} {'ratio':>7}")
    for op in OPS:
        ours = statistics.median(r[op] for r in results["ours"])
        torch_ = statistics.median(r[op] for r in results["torch"])
        print(f"{op:<6} {ours:>24,.0f} {torch_:>22,.0f} {ours / torch_:>6.2f}x")
    ours = statistics.median(r["connect"] for r in results["ours"]) * 1e3
    torch_ = statistics.median(r["connect"] for r in results["torch"]) * 1e3
    print(f"{'connect':<7} {ours:>20.2f} ms {torch_:>19.2f} ms {ours / torch_:>6.2f}x (time, mean)")


if __name__ == "__main__":
    main()
