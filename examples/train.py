"""A small but real DDP training script: runs unchanged under torchrun and flodl-launch.

    flodl-launch --nproc 2 -- python examples/train.py
    torchrun --standalone --nproc-per-node 2 examples/train.py

It fits a two-layer MLP to a fixed random linear target on synthetic data, with
DistributedSampler and DistributedDataParallel. The backend follows the
hardware: NCCL with one GPU per rank (LOCAL_RANK picks it), gloo on CPU.
Rank 0 prints the mean loss of every epoch and, at the end, the first and last.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def synthetic_dataset(samples: int, features: int, seed: int = 0) -> TensorDataset:
    """Every rank builds the same dataset from the same seed; the sampler splits it."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=generator)
    true_weight = torch.randn(features, 1, generator=generator)
    y = x @ true_weight + 0.01 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(x, y)


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(1234)  # identical initial weights on every rank (DDP also broadcasts them)
    model = nn.Sequential(nn.Linear(args.features, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None)
    dataset = synthetic_dataset(args.samples, args.features)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()

    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, device=device)
        for batch_x, batch_y in loader:
            x, y = batch_x.to(device), batch_y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(ddp(x), y)
            loss.backward()
            optimizer.step()
            total += torch.stack(
                [loss.detach() * len(x), torch.tensor(float(len(x)), device=device)]
            )
        dist.all_reduce(total)
        mean = (total[0] / total[1]).item()
        losses.append(mean)
        if rank == 0:
            print(f"epoch {epoch} loss {mean:.6f} (world {world})", flush=True)
    if rank == 0:
        print(f"first loss {losses[0]:.6f} last loss {losses[-1]:.6f}", flush=True)
    # Every rank reaches the end before any tears its group down: a gloo rank whose peer destroyed
    # the group and exited first can abort in its own teardown ("terminate called without an
    # active exception", SIGABRT), seen on a loaded machine under torchrun and flodl-launch alike.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
