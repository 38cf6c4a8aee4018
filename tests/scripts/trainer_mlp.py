"""The e2e tests' one Trainer script: a small deterministic regression, run inline, as launcher or as a rank.

    python trainer_mlp.py --out DIR [--policy sync|cadence|async] [--backend cpu|collective]
                          [--outer avg|slowmo|diloco] [--epochs N] [--cluster FILE]
                          [--slow-rank R --slow-ms MS] [--fail-rank R] [--cooperative] [--hold-file F --hold-host H]
                          [--mixed] [--lockstep] [--twice]

Each process writes its TrainedState to DIR/<entry>-<RANK>.pt (the launcher and the inline process
as -1) with its epoch losses and its batch shares, and prints one `TRAINER-DONE` line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import flodl_async as fa

FEATURES = 8


def dataset(n: int = 512, *, indexed: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g)
    y = x @ w + 0.01 * torch.randn(n, 1, generator=g)
    # --usage: each sample carries its index, so a rank can say which samples it trained
    return TensorDataset(x, y, torch.arange(n)) if indexed else TensorDataset(x, y)


def model(device: torch.device) -> nn.Module:
    torch.manual_seed(1)  # every rank starts the same (the init round makes it so anyway)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)


class Mixed(nn.Module):
    """``--mixed``: what the spec's averaging rules are about — a tied weight, an int64 buffer (BatchNorm's
    ``num_batches_tracked``), a bf16 buffer, bool and int64 buffers that differ by rank (their consensus rounds half to even).
    """

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(FEATURES, FEATURES)
        self.b = nn.Linear(FEATURES, FEATURES)
        self.b.weight = self.a.weight  # tied: one tensor, two state_dict keys
        self.bn = nn.BatchNorm1d(FEATURES)
        self.head = nn.Linear(FEATURES, 1)
        self.register_buffer("ema", torch.zeros(3, dtype=torch.bfloat16))
        self.register_buffer("flag", torch.zeros(2, dtype=torch.bool))
        self.register_buffer("marker", torch.zeros(2, dtype=torch.int64))
        self.rank = max(int(os.environ.get("RANK", "0")), 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.ema.add_(
                0.125
            )  # the same on every rank: exact in bf16, so the consensus must be exact too
            self.flag.copy_(torch.tensor([True, self.rank == 0]))
            self.marker.copy_(torch.tensor([5 * self.rank, 7 * self.rank]))
        return self.head(torch.relu(self.bn(self.b(torch.relu(self.a(x))))))


def mixed(device: torch.device) -> nn.Module:
    torch.manual_seed(1)
    return Mixed().to(device)


def optimizer(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.05)


def momentum(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)


def adam(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(m.parameters(), lr=0.01)


def mse(m: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch[0], batch[1]
    return nn.functional.mse_loss(m(x), y)


POLICIES = {"sync": fa.Policy.SYNC, "cadence": fa.Policy.CADENCE, "async": fa.Policy.ASYNC}
BACKENDS = {"cpu": fa.Backend.CPU, "collective": fa.Backend.COLLECTIVE}
OUTERS = {"avg": fa.OuterAvg(), "slowmo": fa.SlowMo(lr=0.5, momentum=0.5), "diloco": fa.DiLoCo()}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--policy", default="cadence", choices=POLICIES)
    p.add_argument("--backend", default="cpu", choices=BACKENDS)
    p.add_argument("--outer", default="avg", choices=OUTERS)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--cluster")
    p.add_argument("--slow-rank", type=int, default=-2)
    p.add_argument("--slow-ms", type=float, default=0.0)
    p.add_argument("--fast-ms", type=float, default=0.0)
    p.add_argument("--fail-rank", type=int, default=-2)
    p.add_argument("--kill-rank", type=int, default=-2, help="this rank SIGKILLs itself ...")
    p.add_argument("--kill-batch", type=int, default=0, help="... at its Nth batch (from 0)")
    p.add_argument("--max-failure", type=int, default=None, help="the Trainer's max_failure")
    p.add_argument("--max-restarts", type=int, default=0, help="the Trainer's max_restarts")
    p.add_argument(
        "--await-restart",
        action="store_true",
        help="after --kill-rank's kill, the others wait (at their next batch) for its restarted "
        "process to start, then train 300 ms a batch until it trained one (with --usage)",
    )
    p.add_argument(
        "--kill-again",
        action="store_true",
        help="--kill-rank kills a restarted incarnation too (by default only the first process)",
    )
    p.add_argument(
        "--usage",
        action="store_true",
        help="each rank appends the sample indices of every batch it trained to DIR/used-RANK.txt",
    )
    p.add_argument("--cooperative", action="store_true")
    p.add_argument(
        "--ticker", action="store_true", help="run another asyncio task next to the training"
    )
    p.add_argument("--anchor", type=int, default=None)
    p.add_argument("--no-adapt", action="store_true")
    p.add_argument(
        "--mixed",
        action="store_true",
        help="train the Mixed model (tied weight, int64/bf16/bool buffers)",
    )
    p.add_argument(
        "--lockstep",
        action="store_true",
        help="SYNC with max_batch_diff=0: one step per rank per reduce",
    )
    p.add_argument(
        "--twice",
        action="store_true",
        help="a rank runs trainer.run() a second time after the first",
    )
    p.add_argument(
        "--hold-file",
        help="with --hold-host: that host's local rank 0 prints HOLDING before its first step and waits for this file",
    )
    p.add_argument(
        "--hold-steps",
        default="",
        help="with --hold-file F: RANK 0 prints HELD STEP S at each of these steps (comma-separated, from 1) "
        "and waits for the file F.1, F.2, ... (a test watches the run between)",
    )
    p.add_argument(
        "--hold-host",
        help="the hostname whose local rank 0 holds (a test inspects the running world meanwhile)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="the Trainer's -v: the flodl_async logger at DEBUG (the launcher keeps the level)",
    )
    p.add_argument(
        "--app-logging",
        action="store_true",
        help="the application configures logging itself (logging.basicConfig, an APP prefix)",
    )
    add_stop_flags(p)
    add_checkpoint_flags(p)
    return p.parse_args(argv)


def configure_logging(args: argparse.Namespace) -> None:
    if args.app_logging:
        logging.basicConfig(level=logging.INFO, format="APP %(name)s: %(message)s")
    if args.verbose:
        logging.getLogger("flodl_async").setLevel(logging.DEBUG)


def build(args: argparse.Namespace) -> fa.Trainer:
    rank = int(os.environ.get("RANK", "-1"))
    sleep_s = (args.slow_ms if rank == args.slow_rank else args.fast_ms) / 1e3
    hold_steps = [int(s) for s in args.hold_steps.split(",") if s]
    holding = (
        args.hold_file is not None
        and not hold_steps
        and rank >= 0
        and socket.gethostname() == args.hold_host
        and os.environ.get("LOCAL_RANK") == "0"
    )

    steps = 0
    incarnation = int(os.environ.get("FLODL_INCARNATION", "0"))  # >0: restarted alone
    killing = rank == args.kill_rank and (incarnation == 0 or args.kill_again)
    used = f"used-{rank}.txt" if incarnation == 0 else f"used-{rank}.i{incarnation}.txt"

    def train_step(m: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        nonlocal holding, steps
        out = Path(args.out)
        if killing and steps == args.kill_batch:
            if args.await_restart:
                out.mkdir(parents=True, exist_ok=True)
                (out / f"killed-{rank}").touch()
            os.kill(os.getpid(), signal.SIGKILL)
        if args.await_restart and (out / f"killed-{args.kill_rank}").exists():
            while not (out / f"started-{args.kill_rank}.i1").exists():
                time.sleep(0.02)
            if not (out / f"used-{args.kill_rank}.i1.txt").exists():
                time.sleep(0.3)  # slowly, so that the run outlasts the restarted rank's rejoin
        steps += 1
        if rank == 0 and steps in hold_steps:
            print(f"HELD STEP {steps}", flush=True)
            release = f"{args.hold_file}.{hold_steps.index(steps) + 1}"
            while not os.path.exists(release):
                time.sleep(0.05)
        if args.usage:
            # one line per batch, written whole before the step: a rank killed later keeps it
            Path(args.out).mkdir(parents=True, exist_ok=True)
            with open(Path(args.out) / used, "a") as f:
                f.write(" ".join(str(i) for i in batch[2].tolist()) + "\n")
        if holding:
            holding = False
            print(f"HOLDING rank {rank} pid {os.getpid()} on {socket.gethostname()}", flush=True)
            while not os.path.exists(args.hold_file):
                time.sleep(0.05)
        if rank == args.fail_rank:
            raise RuntimeError(f"rank {rank} fails on purpose")
        if sleep_s:
            time.sleep(sleep_s)  # models a slower device without CPU contention
        return mse(m, batch)

    if incarnation:  # a restarted rank: --await-restart's survivors wait for this
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"started-{rank}.i{incarnation}").touch()

    elche = fa.ElCheConfig(
        anchor=args.anchor, adapt=not args.no_adapt, max_batch_diff=0 if args.lockstep else None
    )
    return fa.Trainer(
        model=mixed if args.mixed else model,
        optimizer=adam if args.outer == "diloco" else momentum if args.momentum else optimizer,
        train_step=train_step,
        dataset=dataset(indexed=args.usage),
        batch_size=32,
        epochs=args.epochs,
        policy=POLICIES[args.policy],
        backend=BACKENDS[args.backend],
        outer=OUTERS[args.outer],
        elche=elche,
        max_failure=args.max_failure,
        max_restarts=args.max_restarts,
        cluster=args.cluster,
        checkpoint=checkpointing(args),
    )


def save(
    args: argparse.Namespace,
    trainer: fa.Trainer,
    state: fa.TrainedState,
    losses: list[float],
    shares: list[list[float]],
) -> None:
    rank = int(os.environ.get("RANK", "-1"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    entry = trainer.entry.value
    torch.save(
        {
            "state": dict(state.state_dict),
            "primary": state.primary,
            "world_size": state.world_size,
            "epochs_completed": state.epochs_completed,
            "interrupted": state.interrupted,
            "losses": losses,
            "shares": shares,
            "global_step": state.global_step,
            "checkpoint": state.checkpoint,
        },
        out / f"{entry}-{rank}.pt",
    )
    print(
        f"TRAINER-DONE entry={entry} rank={rank} primary={state.primary} world={state.world_size} epochs={state.epochs_completed} "
        f"interrupted={state.interrupted}",
        flush=True,
    )


async def managed(args: argparse.Namespace) -> None:
    trainer = build(args)
    ticks = 0
    ticking = asyncio.Event()

    async def ticker() -> None:
        """Other work of the same program, on the same loop, while the run trains."""
        nonlocal ticks
        while True:
            ticks += 1
            ticking.set()
            await asyncio.sleep(0.01)

    if (
        args.ticker
    ):  # the plain form, `state = await trainer.run()`, inside a program doing other things
        other = asyncio.create_task(ticker(), name="ticker")
        await ticking.wait()
        state = await trainer.run()
        other.cancel()
        print(f"TICKS {ticks}", flush=True)
        save(args, trainer, state, [], [])
        return
    run = trainer.start()
    losses: list[float] = []
    shares: list[list[float]] = []
    async for m in run.metrics():
        losses.append(m.avg_loss)
        shares.append([r.batch_share for r in m.per_rank])
        if run.primary:
            print(
                f"EPOCH {m.epoch} loss {m.avg_loss:.5f} shares {[round(s, 3) for s in shares[-1]]}",
                flush=True,
            )
        await maybe_shut_down(args, run, m)
        await maybe_checkpoint(args, run, m)
    state = await run.join()
    save(args, trainer, state, losses, shares)
    if args.twice and trainer.entry is fa.Entry.RANK:
        await trainer.run()  # one session per process in a rank: this must be refused clearly


# ----- stopping (tests/test_trainer_stop_e2e.py) ---------------------------------------------------


def add_stop_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shutdown-rank",
        type=int,
        default=None,
        help="the process with this RANK (-1: the launcher or the inline process) calls run.shutdown() ...",
    )
    p.add_argument(
        "--shutdown-epoch", type=int, default=1, help="... once it has this epoch's metrics"
    )


async def maybe_shut_down(
    args: argparse.Namespace, run: fa.TrainingRun, m: fa.EpochMetrics
) -> None:
    rank = int(os.environ.get("RANK", "-1"))
    if rank == args.shutdown_rank and m.epoch == args.shutdown_epoch:
        print(f"SHUTDOWN rank {rank} after epoch {m.epoch}", flush=True)
        await run.shutdown()


def cooperative(args: argparse.Namespace) -> None:
    trainer = build(args)
    losses: list[float] = []
    shares: list[list[float]] = []
    with trainer.worker() as w:
        for _plan in w.plans():
            for batch in w.batches():
                if int(os.environ.get("RANK", "-1")) == args.fail_rank:
                    raise RuntimeError(f"rank {args.fail_rank} fails on purpose in its own loop")
                loss = mse(w.model, batch)
                loss.backward()
                if w.step(loss).shutdown:
                    break
            for m in w.poll_metrics():
                losses.append(m.avg_loss)
                shares.append([r.batch_share for r in m.per_rank])
        state = w.finish()
        for m in w.poll_metrics():
            losses.append(m.avg_loss)
            shares.append([r.batch_share for r in m.per_rank])
    save(args, trainer, state, losses, shares)



# ----- checkpoints (tests/test_trainer_checkpoint_e2e.py) ------------------------------------------


def add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--save-path", help="Checkpointing(save_path=...)")
    p.add_argument("--resume-from", help="Checkpointing(resume_from=...)")
    p.add_argument("--every-epochs", type=int, default=None)
    p.add_argument("--every-rounds", type=int, default=None)
    p.add_argument("--keep-last", type=int, default=None)
    p.add_argument("--momentum", action="store_true", help="SGD with momentum 0.9 (inner state)")
    p.add_argument(
        "--checkpoint-rank",
        type=int,
        default=None,
        help="the process with this RANK (-1: the launcher) calls run.checkpoint() ...",
    )
    p.add_argument("--checkpoint-epoch", type=int, default=1, help="... after this epoch")


def checkpointing(args: argparse.Namespace) -> fa.Checkpointing | None:
    if args.save_path is None and args.resume_from is None:
        return None
    return fa.Checkpointing(
        save_path=args.save_path,
        resume_from=args.resume_from,
        every_epochs=args.every_epochs,
        every_rounds=args.every_rounds,
        keep_last=args.keep_last,
    )


async def maybe_checkpoint(
    args: argparse.Namespace, run: fa.TrainingRun, m: fa.EpochMetrics
) -> None:
    rank = int(os.environ.get("RANK", "-1"))
    if rank == args.checkpoint_rank and m.epoch == args.checkpoint_epoch:
        print(f"CHECKPOINT rank {rank} after epoch {m.epoch}", flush=True)
        await run.checkpoint()


if __name__ == "__main__":
    arguments = parse(sys.argv[1:])
    configure_logging(arguments)
    if arguments.cooperative:
        cooperative(arguments)
    else:
        asyncio.run(managed(arguments))
