"""Averaging benchmark: one CPU averaging round through relay and reducer against a gloo all_reduce.

Run: ``python benchmarks/averaging.py [--sizes 1,16,64] [--rounds 20,10,5] [--warmup 3] [--json
out.json]`` (``--smoke``: one round of 1 MiB and of resnet20, no warm-up, for the test suite)

Two rank processes hold both a gloo process group and a
:class:`~flodl_async.relay.datalink.DataLink`.
A third process is the launcher's side of one host, as a ``flodl-launch`` with its in-process
agent runs it: a real :class:`~flodl_async.net.mux.PortMux` with the
:class:`~flodl_async.controller.reducer.Reducer` on its data channel and a real
:class:`~flodl_async.relay.control.Relay` whose data socket the ranks dial (one event loop, uvloop
where installed). Per round and size, the same float32 tensor, variants interleaved (their
order alternates every round), each after a gloo barrier:

* ``flodl``: ``link.contribute(...)`` (rank → unix socket → relay fold of both ranks → TCP →
  reducer → relay → both ranks) and ``param.copy_(consensus)``;
* ``gloo``: ``dist.all_reduce(param)`` and ``param.div_(2)``.

The ``check ms`` column is what the plan checks add to each contribution on top of that: the one
pass over its tensors (:func:`~flodl_async.training.plancheck.first_bad_tensor`, an ``aminmax``
per float tensor) that the relay's fold runs in its executor before folding it (and the reducer
for a rank whose bytes no relay folded), timed alone on one rank's tensors; the flodl column
includes it.

``--uplink tcp`` makes the relay dial the port as a worker host's relay does (the sealed TCP
leg) instead of handing its frames to the in-process reducer. A round's latency is the slower
rank's (max over ranks). The table prints median (min–max) per
variant and the ratio flodl / gloo as the median of per-round ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import multiprocessing.connection
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 1 << 20


def _model(size: str, seed: int) -> dict[str, Any]:
    """``"16"``: one float32 tensor of 16 MiB; ``"resnet"``: a ResNet-20-like list (65 tensors, 1.1
    MB)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if size != "resnet":
        return {"w": torch.randn(int(size) * MiB // 4, generator=g)}
    shapes: list[tuple[int, ...]] = [(16, 3, 3, 3)]
    for c_in, c_out in ((16, 16), (16, 32), (32, 64)):
        for block in range(3):
            first_in = c_in if block == 0 else c_out
            shapes += [
                (c_out, first_in, 3, 3),
                (c_out,),
                (c_out,),
                (c_out, c_out, 3, 3),
                (c_out,),
                (c_out,),
            ]
            if block == 0 and c_in != c_out:
                shapes += [(c_out, c_in, 1, 1), (c_out,), (c_out,)]
    shapes += [(16,), (16,), (10, 64), (10,)]
    return {f"t{i}": torch.randn(shape, generator=g) for i, shape in enumerate(shapes)}


def _label(size: str) -> str:
    return "resnet20" if size == "resnet" else f"{size} MiB"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----- the host: mux + reducer + relay
# -------------------------------------------------------------


def _host(
    conns: list[multiprocessing.connection.Connection],
    sizes: list[str],
    rounds: list[int],
    warmup: int,
    uplink: str,
) -> None:
    from flodl_async.net.loop import run

    run(_host_main(conns, sizes, rounds, warmup, uplink))


async def _host_main(
    conns: list[multiprocessing.connection.Connection],
    sizes: list[str],
    rounds: list[int],
    warmup: int,
    uplink: str,
) -> None:
    import tempfile

    from flodl_async.controller.reducer import Reducer
    from flodl_async.deadlines import Deadlines
    from flodl_async.net.framed import FramedProtocol
    from flodl_async.net.mux import PortMux
    from flodl_async.net.service import FramedService
    from flodl_async.relay.control import Relay
    from flodl_async.training.modelschema import ModelSchema
    from flodl_async.training.outer import OuterAvg
    from flodl_async.wire import Channel, Credential, new_session_secret
    from flodl_async.wire.handshake import session_resolver

    async def drain(link: FramedProtocol) -> None:
        while True:
            await link.recv_message()

    scratch = tempfile.mkdtemp(prefix="fl-avgbench-", dir="/tmp")
    for size, n_rounds in zip(sizes, rounds, strict=True):
        model = _model(size, 0)
        schema = ModelSchema.from_state_dict(model, list(model))
        secret = new_session_secret()
        run_id = f"bench-{size}"
        mux = PortMux(host="127.0.0.1", port=0)
        reducer = Reducer(schema, OuterAvg(), 1.0, digest="bench")
        async with asyncio.TaskGroup() as tg:
            control = FramedService(
                channel=Channel.CONTROL,
                resolve=session_resolver(secret),
                run_id=run_id,
                handler=drain,
                task_group=tg,
            )
            mux.register(Channel.CONTROL, control.protocol_factory)
            service = reducer.attach(task_group=tg, resolve=session_resolver(secret), run_id=run_id)
            mux.register(Channel.DATA, service.protocol_factory)
            await mux.start()
            relay = Relay(
                socket_path=f"{scratch}/relay-{size}.sock",
                data_socket_path=f"{scratch}/data-{size}.sock",
                secret=secret,
                run_id=run_id,
                ranks=frozenset({0, 1}),
                controller_host="127.0.0.1",
                controller_port=mux.port,
                task_group=tg,
                deadlines=Deadlines(),
                host="bench",
                # the launcher's own host: its controller hands the relay its reducer
                local_reducer=(lambda r=reducer: r) if uplink == "in-process" else None,
            )
            await relay.start()
            relay.open_round(0)
            for rank, conn in enumerate(conns):
                key = Credential.for_rank(secret, run_id=run_id, round=0, rank=rank).key
                cfg = {
                    "size": size,
                    "data_socket": relay.data_socket_path,
                    "credential": key.hex(),
                    "run_id": run_id,
                    "total": warmup + n_rounds,
                }
                conn.send(cfg)
            for k in range(1, warmup + n_rounds + 1):
                reducer.open_round(k, "model", frozenset({0, 1}))
                await reducer.wait_round(k)
            for conn in conns:
                # the rank closed its link
                await asyncio.get_running_loop().run_in_executor(None, conn.recv)
            await relay.aclose()
            await reducer.aclose()
            await mux.aclose()
    for conn in conns:
        conn.send(None)


# ----- a rank
# ------------------------------------------------------------------------------------------


def _rank(
    rank: int,
    conn: multiprocessing.connection.Connection,
    master_port: int,
    warmup: int,
    out: multiprocessing.connection.Connection | None,
) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(master_port),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
        }
    )
    from flodl_async.net.loop import run

    run(_rank_main(rank, conn, warmup, out))


async def _rank_main(
    rank: int,
    conn: multiprocessing.connection.Connection,
    warmup: int,
    out: multiprocessing.connection.Connection | None,
) -> None:
    import torch
    import torch.distributed as dist

    from flodl_async.config.rankenv import RankSpec
    from flodl_async.relay.datalink import DataLink
    from flodl_async.training import plancheck
    from flodl_async.training.foldmath import schema_specs
    from flodl_async.training.modelschema import ModelSchema

    dist.init_process_group("gloo", rank=rank, world_size=2)
    results: dict[str, dict[str, list[float]]] = {}
    loop = asyncio.get_running_loop()
    while True:
        cfg = await loop.run_in_executor(None, conn.recv)
        if cfg is None:
            break
        size = cfg["size"]
        params = _model(size, rank)
        schema = ModelSchema.from_state_dict(params, list(params))
        spec = RankSpec(
            run_id=cfg["run_id"],
            host="bench",
            relay_socket="",
            data_socket=cfg["data_socket"],
            round=0,
            credential_hex=cfg["credential"],
        )
        link = await DataLink.connect(spec, rank, schema, "bench")
        times: dict[str, list[float]] = {"flodl": [], "gloo": []}
        for k in range(1, cfg["total"] + 1):
            order = ["flodl", "gloo"] if k % 2 else ["gloo", "flodl"]
            for variant in order:
                dist.barrier()
                t0 = time.perf_counter()
                if variant == "flodl":
                    res = await link.contribute(k, "model", params, steps=1, weight=1.0)
                    assert res.tensors is not None
                    for name, t in params.items():
                        t.copy_(res.tensors[name])
                    del res
                elif len(params) == 1:
                    (param,) = params.values()
                    dist.all_reduce(param)
                    param.div_(2)
                else:
                    # A flat bucket, as DDP does: one all_reduce instead of 65 small ones.
                    flat = torch._utils._flatten_dense_tensors(list(params.values()))
                    dist.all_reduce(flat)
                    flat.div_(2)
                    for t, back in zip(
                        params.values(),
                        torch._utils._unflatten_dense_tensors(flat, list(params.values())),
                        strict=True,
                    ):
                        t.copy_(back)
                elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if k > warmup:
                    times[variant].append(float(elapsed.item()) * 1000.0)
        await link.aclose()
        conn.send("closed")
        # the plan checks' pass over one contribution, alone (the relay runs it per rank)
        specs = schema_specs(schema.tensors)[0]
        ordered = [params[meta.name] for meta in schema.tensors]
        for k in range(1, cfg["total"] + 1):
            t0 = time.perf_counter()
            assert plancheck.first_bad_tensor(specs, ordered, 1.0) is None
            if k > warmup:
                times.setdefault("check", []).append((time.perf_counter() - t0) * 1000.0)
        results[size] = times
    dist.destroy_process_group()
    if out is not None:
        out.send(results)


# ----- the table
# ---------------------------------------------------------------------------------------


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} ({min(values):.1f}–{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        default="1,16,64,resnet",
        help="MiB of one float32 tensor, or resnet (65 tensors, 1.1 MB); comma separated",
    )
    parser.add_argument("--rounds", default="20,10,5,20", help="timed rounds per size")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--uplink",
        choices=["in-process", "tcp"],
        default="in-process",
        help="in-process: the relay hands host frames to the reducer in memory (the launcher's own "
        "host); "
        "tcp: it dials the controller port like a worker host's relay (sealed TCP leg)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="one round of 1 MiB and resnet20, no warm-up"
    )
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.rounds, args.warmup = "1,resnet", "1,1", 0
    sizes = args.sizes.split(",")
    rounds = [int(r) for r in args.rounds.split(",")]
    if len(rounds) != len(sizes):
        parser.error("--rounds needs one count per size")

    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    result_rx, result_tx = ctx.Pipe(duplex=False)
    port = _free_port()
    host_conns = [p[0] for p in pipes]

    ranks = [
        ctx.Process(
            target=_rank,
            args=(r, pipes[r][1], port, args.warmup, result_tx if r == 0 else None),
            name=f"rank{r}",
        )
        for r in range(2)
    ]
    for p in ranks:
        p.start()
    host = ctx.Process(
        target=_host, args=(host_conns, sizes, rounds, args.warmup, args.uplink), name="host"
    )
    host.start()
    results: dict[str, dict[str, list[float]]] = result_rx.recv()
    host.join(60)
    for p in ranks:
        p.join(60)

    rows: list[dict[str, Any]] = []
    print(
        f"CPU averaging round (2 ranks → relay fold → reducer → back, uplink {args.uplink}) vs "
        "gloo all_reduce+div, "
        f"float32, max over ranks, {args.warmup} warm-ups"
    )
    print(
        f"{'size':>8} | {'rounds':>6} | {'flodl ms':>24} | {'gloo ms':>24} | {'check ms':>8} | "
        "ratio (median of per-round)"
    )
    for size in sizes:
        t = results[size]
        ratios = [a / b for a, b in zip(t["flodl"], t["gloo"], strict=True)]
        ratio = statistics.median(ratios)
        check = statistics.median(t["check"])
        print(
            f"{_label(size):>8} | {len(t['flodl']):>6} | {_fmt(t['flodl']):>24} | "
            f"{_fmt(t['gloo']):>24} | {check:8.2f} | "
            f"{ratio:.2f}× ({min(ratios):.2f}–{max(ratios):.2f})"
        )
        rows.append(
            {
                "size": _label(size),
                "flodl_ms": t["flodl"],
                "gloo_ms": t["gloo"],
                "check_ms": t["check"],
                "ratio_median": ratio,
            }
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps({"benchmark": "averaging", "uplink": args.uplink, "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
