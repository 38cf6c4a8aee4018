"""Chaos benchmark: an elastic Trainer run under a fault every few seconds, against the same run
with none. Scaled down from the 32-rank published chaos runs to a few CPU ranks on one machine.

Run: ``python benchmarks/chaos.py [--ranks 4] [--duration 180] [--every 15] [--step-ms 20]``
(``--smoke``: 2 ranks, 20 s, a fault every 6 s, all on rank 0, for the test suite: a fault on every
rank faster than a restart takes would lose the whole world, which ends the run)

Two runs of the same Trainer (this file as a launcher on the CPU backend, CADENCE, ``cluster=`` a
one-host ``cpu:N`` cluster file, ``max_restarts`` large enough for every fault, epochs enough to
outlast ``--duration``), one after the other; the launcher stops each in order (``shutdown()``)
``--duration`` seconds after its first epoch. In the chaos run the launcher hits one rank every
``--every`` seconds, in turn, with the next fault of a cycle of three:

- ``SIGKILL``: a crash; its agent restarts it alone and it rejoins at a round boundary;
- ``SIGSTOP`` for ``--stop-s`` (20 s): frozen; declared dead by its silence after
  ``heartbeat_timeout`` (10 s), KILLed by its agent and restarted (the late ``SIGCONT`` finds it
  gone);
- ``raise``: the rank raises in its ``train_step`` (a rank restart by an exception).

It reports samples committed per second (the samples of the epochs aggregated between the first
epoch's end and the stop, over that time: an epoch the stop cut counts in neither run) of the chaos
run as a fraction of the fault-free run's at the same world size (goal: >= 80 %), and the final
epoch's loss of both.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BATCH = 32
GOAL = 0.80
FAULTS = ("SIGKILL", "SIGSTOP", "raise")


# ----- the launcher's and the ranks' side ------------------------------------------------------


def _fault(out: Path, n: int, ranks: int, stop_s: float) -> str:
    """Fault ``n`` (from 0) on rank ``n % ranks`` (``ranks``: how many the faults cycle over), the
    kind cycling through :data:`FAULTS`."""
    rank, kind = n % ranks, FAULTS[n % len(FAULTS)]
    if kind == "raise":
        (out / f"raise-{rank}").touch()
        return f"raise on rank {rank}"
    pid = int((out / f"pid-{rank}").read_text())
    with_signal = signal.SIGKILL if kind == "SIGKILL" else signal.SIGSTOP
    try:
        os.kill(pid, with_signal)
    except ProcessLookupError:
        return f"{kind} on rank {rank}: gone already"
    if kind == "SIGSTOP":

        def resume() -> None:
            time.sleep(stop_s)
            with contextlib.suppress(ProcessLookupError):  # declared dead and KILLed meanwhile
                os.kill(pid, signal.SIGCONT)

        asyncio.get_running_loop().run_in_executor(None, resume)
    return f"{kind} on rank {rank} (pid {pid})"


def trainer_role(args: argparse.Namespace) -> None:
    """One run, in the launcher and (re-executed) in each rank."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    import flodl_async as fa

    out = Path(args.out)
    rank = int(os.environ.get("RANK", "-1"))
    if rank >= 0:
        (out / f"pid-{rank}").write_text(str(os.getpid()))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batches * BATCH, 16, generator=g)
    data = TensorDataset(x, x @ torch.randn(16, 1, generator=g))

    def train_step(m: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        raise_file = out / f"raise-{rank}"
        if raise_file.exists():
            raise_file.unlink()
            raise RuntimeError(f"chaos: rank {rank} raises")
        time.sleep(args.step_ms / 1e3)
        return nn.functional.mse_loss(m(batch[0]), batch[1])

    trainer = fa.Trainer(
        model=lambda d: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(d),
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.01),
        train_step=train_step,
        dataset=data,
        batch_size=BATCH,
        epochs=100_000,
        policy=fa.Policy.CADENCE,
        max_restarts=10_000,
        cluster=args.cluster,
    )
    if rank >= 0:
        asyncio.run(trainer.run())
        return
    asyncio.run(_launch(args, trainer, out))


async def _launch(args: argparse.Namespace, trainer: object, out: Path) -> None:
    import flodl_async as fa

    assert isinstance(trainer, fa.Trainer)
    run = trainer.start()
    epochs: list[tuple[float, int, float]] = []  # (when, samples, loss)
    faults: list[str] = []

    async def chaos() -> None:
        await first.wait()
        n = 0
        while args.chaos:
            await asyncio.sleep(args.every)
            faults.append(_fault(out, n, args.hit or args.ranks, args.stop_s))
            print(f"fault {n + 1}: {faults[-1]}", flush=True)
            n += 1

    stopped: list[float] = []

    async def stop() -> None:
        await first.wait()
        await asyncio.sleep(args.duration)
        stopped.append(time.monotonic())
        await run.shutdown()

    first = asyncio.Event()
    tasks = [asyncio.create_task(chaos()), asyncio.create_task(stop())]
    async for metrics in run.metrics():
        epochs.append((time.monotonic(), metrics.samples, metrics.avg_loss))
        first.set()
    await run.join()
    for task in tasks:
        task.cancel()
    # the epochs aggregated between the first one's end and the stop, over that time
    start, end, loss = epochs[0][0], stopped[0], epochs[-1][2]
    samples = sum(s for t, s, _ in epochs[1:] if t <= end)
    (out / "result").write_text(f"{samples / (end - start)!r} {loss!r} {len(epochs)} {len(faults)}")


# ----- the benchmark's side ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_run(args: argparse.Namespace, out: Path, *, chaos: bool) -> tuple[float, float, int, int]:
    """(samples/s, final loss, epochs, faults) of one run."""
    out.mkdir(parents=True)
    cluster = out / "cluster.yml"
    cluster.write_text(
        f"controller:\n  host: 127.0.0.1\n  port: {_free_port()}\nworkers:\n  - host: "
        f"{socket.gethostname()}\n    devices: cpu:{args.ranks}\n"
    )
    cmd = [
        sys.executable,
        __file__,
        "--role",
        "trainer",
        "--out",
        str(out),
        "--cluster",
        str(cluster),
    ]
    for flag in ("ranks", "hit", "duration", "every", "stop_s", "step_ms", "batches"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    cmd += ["--chaos"] if chaos else []
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
    }
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=args.duration + 300, env=env, cwd=ROOT,
        check=False,
    )  # fmt: skip
    output = done.stdout + done.stderr
    result = out / "result"
    if done.returncode != 0 or not result.exists():
        raise SystemExit(f"the {'chaos' if chaos else 'fault-free'} run failed:\n{output[-4000:]}")
    rate, loss, epochs, faults = result.read_text().split()
    return float(rate), float(loss), int(epochs), int(faults)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument(
        "--hit", type=int, default=0, help="the faults cycle over ranks 0..HIT-1 (default: all)"
    )
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of training")
    parser.add_argument("--every", type=float, default=15.0, help="seconds between faults")
    parser.add_argument("--stop-s", type=float, default=20.0, help="how long a SIGSTOP lasts")
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--batches", type=int, default=64, help="batches per epoch")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="2 ranks, 20 s, a fault every 6 s, all on rank 0 (the other one outlives them)",
    )
    parser.add_argument("--keep", metavar="DIR", help="keep each run's files under DIR")
    for hidden in ("role", "out", "cluster"):
        parser.add_argument(f"--{hidden}", help=argparse.SUPPRESS)
    parser.add_argument("--chaos", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "trainer":
        trainer_role(args)
        return
    if args.smoke:
        args.ranks, args.hit, args.duration, args.every, args.stop_s = 2, 1, 20.0, 6.0, 12.0
    with tempfile.TemporaryDirectory(prefix="flodl-bench-chaos-") as scratch:
        tmp = Path(args.keep or scratch)
        calm = one_run(args, tmp / "fault-free", chaos=False)
        hit = one_run(args, tmp / "chaos", chaos=True)
    print(
        f"\nchaos: {args.ranks} CPU ranks on this machine, CADENCE on the CPU backend, "
        f"{args.duration:g} s of training, a fault every {args.every:g} s (SIGKILL, SIGSTOP for "
        f"{args.stop_s:g} s, raise, in turn); scaled down from the 32-rank published runs"
    )
    print(f"{'run':<12} {'epochs':>7} {'faults':>7} {'samples/s':>10} {'final loss':>11}")
    for name, (rate, loss, epochs, faults) in (("fault-free", calm), ("chaos", hit)):
        print(f"{name:<12} {epochs:>7} {faults:>7} {rate:>10.1f} {loss:>11.5f}")
    fraction = hit[0] / calm[0]
    print(
        f"goal (samples committed per second >= {GOAL:.0%} of the fault-free run's at the same "
        f"world size): {'met' if fraction >= GOAL else 'NOT met'}; {fraction:.0%}"
    )


if __name__ == "__main__":
    main()
