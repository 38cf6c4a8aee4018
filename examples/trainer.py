"""The Trainer, complete: one script that trains inline, as a launcher with its ranks, or as a rank
of flodl-launch.

    python examples/trainer.py             # one process (inline)
    python examples/trainer.py --ranks 2   # this process launches 2 CPU ranks and coordinates them
    flodl-launch --nproc 2 --devices cpu -- python examples/trainer.py
                                           # flodl-launch coordinates, the script is a rank

It fits a two-layer MLP to a fixed random linear target. Every process builds the same Trainer;
`run.primary` is True in exactly one process per run, which prints.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import tempfile

import torch
from torch import nn
from torch.utils.data import TensorDataset

import flodl_async as fa


def dataset(n: int = 2048, d: int = 16) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, 1, generator=g)
    return TensorDataset(x, x @ w + 0.01 * torch.randn(n, 1, generator=g))


def model(device: torch.device) -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)


def optimizer(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.05)


def train_step(m: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(m(x), y)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local_cluster(ranks: int) -> str:
    """A one-host cluster file with `ranks` CPU ranks on a free port (what `cluster=` takes)."""
    path = os.path.join(tempfile.mkdtemp(prefix="flodl-example-"), "cluster.yml")
    with open(path, "w") as f:
        f.write(
            f"controller:\n  host: 127.0.0.1\n  port: {free_port()}\nworkers:\n  - host: "
            f"{socket.gethostname()}\n    devices: cpu:{ranks}\n"
        )
    return path


def build(ranks: int, cluster: str | None) -> fa.Trainer:
    return fa.Trainer(
        model=model,
        optimizer=optimizer,
        train_step=train_step,
        dataset=dataset(),
        batch_size=64,
        epochs=5,
        policy=fa.Policy.CADENCE,
        backend=fa.Backend.CPU,
        cluster=cluster if ranks > 1 else None,
    )


async def main(trainer: fa.Trainer) -> None:
    run = trainer.start()
    async for m in run.metrics():
        if run.primary:
            shares = "/".join(f"{r.batch_share:.2f}" for r in m.per_rank)
            print(
                f"epoch {m.epoch}: loss {m.avg_loss:.4f} in {m.epoch_ms:.0f} ms, shares {shares}",
                flush=True,
            )
    state = await run.join()
    if state.primary:
        print(
            f"done: {state.epochs_completed} epochs on {state.world_size} rank(s), "
            f"{len(state.state_dict)} tensors",
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="2 or more: launch that many CPU ranks from this process",
    )
    parser.add_argument(
        "--cluster", help="a cluster file (the ranks re-run this script with the same arguments)"
    )
    args = parser.parse_args()
    # The ranks re-execute this command line; they must build the same Trainer, so the cluster file
    # is made once (by the launcher) and handed to the ranks through the same --cluster argument.
    if args.ranks > 1 and args.cluster is None:
        os.execv(
            sys.executable,
            [sys.executable, *sys.orig_argv[1:], "--cluster", local_cluster(args.ranks)],
        )
    asyncio.run(main(build(args.ranks, args.cluster)))
