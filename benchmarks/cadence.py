"""Cadence benchmark: CADENCE vs SYNC epoch time on 2 CPU ranks, one of them 3x slower.

Run: ``python benchmarks/cadence.py [--rounds 2] [--epochs 6] [--backend cpu|collective]``
(``--smoke``: one round of 3 epochs of 24 batches, for the test suite)

Each trial is this very file run as a Trainer launcher (``cluster=`` a one-host ``cpu:2`` cluster
file): it re-executes itself as the two ranks. ``train_step`` sleeps 4 ms on rank 0 and 12 ms on
rank 1 (sleep models a slower device without CPU contention on a 2-vCPU box), 96 batches per
epoch. SYNC gives each rank half the epoch, so the slow rank sets the pace (~48 x 12 ms); CADENCE
lets ElChe give the fast rank three batches for each of the slow rank's (ideal: the harmonic bound,
96 / (1/4 + 1/12) = 288 ms of compute per epoch). Variants are interleaved round by round. The table
gives the median epoch time over epochs 2.. (epochs 0-1 calibrate), the speedup over SYNC, rank 0's
batch share, reduces per epoch and the mean reduce time. Goal: CADENCE >= 1.5x faster than SYNC.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FAST_MS, SLOW_MS, BATCHES, BATCH = 4.0, 12.0, 96, 32


def _trainer(policy: str, backend: str, epochs: int, cluster: str, batches: int) -> object:
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    import flodl_async as fa

    g = torch.Generator().manual_seed(0)
    x = torch.randn(batches * BATCH, 16, generator=g)
    data = TensorDataset(x, x @ torch.randn(16, 1, generator=g))
    rank = int(os.environ.get("RANK", "-1"))
    sleep_s = (SLOW_MS if rank == 1 else FAST_MS) / 1e3

    def train_step(m: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        time.sleep(sleep_s)
        return nn.functional.mse_loss(m(batch[0]), batch[1])

    return fa.Trainer(
        model=lambda d: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(d),
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
        train_step=train_step,
        dataset=data,
        batch_size=BATCH,
        epochs=epochs,
        policy={"sync": fa.Policy.SYNC, "cadence": fa.Policy.CADENCE}[policy],
        backend={"cpu": fa.Backend.CPU, "collective": fa.Backend.COLLECTIVE}[backend],
        cluster=cluster,
    )


async def _trial(args: argparse.Namespace) -> None:
    """One run, in the launcher (and, re-executed, in each rank)."""
    trainer = _trainer(args.trial, args.backend, args.epochs, args.cluster, args.batches)
    run = trainer.start()  # type: ignore[attr-defined]
    epochs = [
        {
            "epoch_ms": m.epoch_ms,
            "share0": m.per_rank[0].batch_share,
            "reduces": m.reduces,
            "reduce_ms": m.avg_reduce_ms,
            "loss": m.avg_loss,
        }
        async for m in run.metrics()
    ]
    await run.join()
    if run.primary:
        print("RESULT " + json.dumps(epochs), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(
    policy: str, backend: str, epochs: int, workdir: Path, batches: int
) -> list[dict[str, float]]:
    cluster = workdir / f"cluster-{policy}.yml"
    cluster.write_text(
        f"controller:\n  host: 127.0.0.1\n  port: {_free_port()}\nworkers:\n  - host: "
        f"{socket.gethostname()}\n    devices: cpu:2\n"
    )
    cmd = [
        sys.executable,
        __file__,
        "--trial",
        policy,
        "--backend",
        backend,
        "--epochs",
        str(epochs),
        "--cluster",
        str(cluster),
        "--batches",
        str(batches),
    ]
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return list(json.loads(line.removeprefix("RESULT ")))
    raise SystemExit(f"{policy} trial failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--backend", default="cpu", choices=["cpu", "collective"])
    parser.add_argument("--trial", help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=int, default=BATCHES, help="batches per epoch")
    parser.add_argument("--smoke", action="store_true", help="one round of 3 epochs of 24 batches")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.epochs, args.batches = 1, 3, 24
    if args.trial:
        asyncio.run(_trial(args))
        return
    results: dict[str, list[dict[str, float]]] = {"sync": [], "cadence": []}
    ratios: list[float] = []
    with tempfile.TemporaryDirectory(prefix="flodl-bench-cadence-") as tmp:
        for _ in range(args.rounds):
            medians = {}
            # interleaved: both variants see the machine in the same state
            for policy in ("sync", "cadence"):
                epochs = _run(policy, args.backend, args.epochs, Path(tmp), args.batches)[2:]
                results[policy].extend(epochs)
                medians[policy] = statistics.median(e["epoch_ms"] for e in epochs)
            ratios.append(medians["sync"] / medians["cadence"])
    ideal_ms = args.batches / (1 / FAST_MS + 1 / SLOW_MS)
    setup = (
        f"2 ranks, {args.backend}, {args.batches} batches/epoch, rank 0 {FAST_MS:g} ms/batch, rank "
        f"1 {SLOW_MS:g} ms/batch"
    )
    print(f"{setup}; epochs 2..{args.epochs - 1}, {args.rounds} round(s)")
    print(
        f"{'policy':<9} {'epoch ms median (min-max)':<28} {'rank 0 share':>12} "
        f"{'reduces/epoch':>14} {'reduce ms':>10}"
    )
    for policy, epochs in results.items():
        times = [e["epoch_ms"] for e in epochs]
        print(
            f"{policy:<9} {statistics.median(times):>8.0f} "
            f"({min(times):.0f}-{max(times):.0f}){'':<12} "
            f"{statistics.median(e['share0'] for e in epochs):>12.2f} "
            f"{statistics.median(e['reduces'] for e in epochs):>14.0f} "
            f"{statistics.mean(e['reduce_ms'] for e in epochs):>10.1f}"
        )
    print(
        f"CADENCE speedup over SYNC: {statistics.median(ratios):.2f}x (median of per-round ratios; "
        "goal >= 1.5x)"
    )
    print(
        f"ideal CADENCE epoch (harmonic bound, compute only): {ideal_ms:.0f} ms; SYNC's slow half: "
        f"{args.batches / 2 * SLOW_MS:.0f} ms"
    )


if __name__ == "__main__":
    main()
