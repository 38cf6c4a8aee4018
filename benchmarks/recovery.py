"""Recovery benchmark: one rank of an elastic Trainer run SIGKILLed mid-epoch, against a plain
script restarting its world.

Run: ``python benchmarks/recovery.py [--kills 10] [--ranks 3] [--policy cadence|sync|async]``
(``--smoke``: one kill of each kind, 2 ranks, a small dataset, for the test suite)

Each trial is one run with one kill, and the two paths alternate trial by trial so they share the
machine's state:

- ``elastic``: this file run as a Trainer launcher on the CPU backend (``cluster=`` a one-host
  ``cpu:N`` cluster file; it re-executes itself as the N ranks). ``train_step`` sleeps
  ``--step-ms`` (a device's compute, without CPU contention on a small box). One rank, a different
  one and at a different step of the second epoch each trial, writes ``time.time()`` to a file and
  SIGKILLs itself. The launcher process (the controller) logs every record of its Trainer shell
  with ``record.created`` (``time.time()`` too) to a file: *detection* is the coordinator's
  ``rank R on … lost`` line, the *next round* is the first ``round N (kind) committed`` line
  after it (the first consensus formed once the rank is declared dead), and the one after that
  shows the survivors going on.
- ``restart``: a plain torchrun-contract script (gloo, an ``all_reduce`` per step, the same step
  time) under ``flodl-launch --max-restarts 1``; one rank of the first attempt writes its kill time
  and SIGKILLs itself, the world is torn down and started again, and each rank of the restarted
  world writes ``time.time()`` as its script starts and after its first ``all_reduce``: kill → the
  earliest of each. The restarted script reloads nothing, which favours it.

All times are ``time.time()`` (CLOCK_REALTIME) taken by processes on one machine. The table gives
p50 and p99 (linear interpolation; with 10 kills p99 is close to the maximum) per stage, where the
next round's time goes (detection, then until the survivors' round opens, then the reduce itself),
and the Trainer's ordinary round period for scale. Goal (issue 17): kill → next committed round
<= 1 s p50, <= 3 s p99 on the CPU backend; on the COLLECTIVE backend (``--backend collective``,
gloo), where the survivors re-form their process group in place, <= 3 s p50. With ``--fault stop``
the rank freezes (SIGSTOP) instead: it is declared dead by its silence, within the default
``heartbeat_timeout`` (10 s). With ``--fault rejoin`` (CPU backend) the run has ``max_restarts=1``:
the killed rank's agent restarts it alone, and the table adds kill → its new process's hello, and
hello (the join) → admitted at a round boundary → its first committed round (its warm start). The
others wait at their next step for the restarted process to start, so the run outlasts it; the
times after its hello are the Trainer's own.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import itertools
import logging
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BATCH = 32
GOAL_P50_S, GOAL_P99_S = 1.0, 3.0
GOAL_COLLECTIVE_P50_S = 3.0
#: the default heartbeat_timeout: a frozen rank's silence is noticed after it
GOAL_FROZEN_S = 10.0
#: the Trainer shell's records, as the coordinator words them (flodl_async/training/coordinator.py)
#: and as the shell logs each consensus (flodl_async/controller/training.py)
LOST = re.compile(r"rank (?P<rank>\d+) on .+? lost: (?P<reason>.*)")
EPOCH = re.compile(r"epoch \d+/\d+: ")
COMMITTED = re.compile(r"round (?P<round>\d+) \((?P<kind>\w+)\) committed in (?P<ms>[\d.]+) ms")
HELLO = re.compile(r"rank (?P<rank>\d+) restarted \(incarnation \d+\) said hello; .*")
ADMITTED = re.compile(r"rank (?P<rank>\d+) restarted \(\d+ of \d+\) and rejoined at round \d+")


# ----- the ranks' side -----------------------------------------------------------------------


def _die(out: Path, rank: int, *, freeze: bool = False) -> None:
    """The kill (``freeze``: a SIGSTOP, which its agent turns into a KILL once the rank is declared
    dead), timed where it is done: the stamp is on disk before the signal is sent."""
    (out / "killed").write_text(f"{rank} {time.time()!r}\n")
    os.kill(os.getpid(), signal.SIGSTOP if freeze else signal.SIGKILL)


def _log_to(path: Path) -> None:
    """The controller's records, each with the moment it was made, to ``path``; the usual lines on
    stderr (the launcher adds its own handler only when the script set none)."""
    stamped = logging.FileHandler(path)
    stamped.setFormatter(logging.Formatter("%(created).6f %(message)s"))
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("flodl: %(message)s"))
    console.setLevel(logging.INFO)
    root = logging.getLogger("flodl_async")
    root.addHandler(stamped)
    root.addHandler(console)
    root.setLevel(logging.INFO)
    root.propagate = False
    # only the Trainer shell's debug records (the round commits), not every module's
    logging.getLogger("flodl_async.cli.launch").setLevel(logging.DEBUG)


def _await_hello(log: Path, rank: int) -> None:
    """``--fault rejoin``: the others wait until the controller heard the restarted rank's hello,
    so that the run outlasts the restart (the rejoin's own stages run at the Trainer's speed)."""
    said = f"rank {rank} restarted (incarnation 1) said hello"
    while said not in log.read_text():
        time.sleep(0.01)


def elastic_role(args: argparse.Namespace) -> None:
    """One elastic trial, in the launcher and (re-executed) in each rank."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    import flodl_async as fa

    out = Path(args.out)
    rank = int(os.environ.get("RANK", "-1"))
    if rank < 0:
        _log_to(out / "controller.log")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batches * BATCH, 16, generator=g)
    data = TensorDataset(x, x @ torch.randn(16, 1, generator=g))
    steps = 0
    rejoin = args.fault == "rejoin"
    incarnation = int(os.environ.get("FLODL_INCARNATION", "0"))

    def train_step(m: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        nonlocal steps
        if rank == args.kill_rank and steps == args.kill_step and not incarnation:
            _die(out, rank, freeze=args.fault == "stop")
        if rejoin and rank != args.kill_rank and (out / "killed").exists():
            _await_hello(out / "controller.log", args.kill_rank)
        steps += 1
        time.sleep(args.step_ms / 1e3)
        return nn.functional.mse_loss(m(batch[0]), batch[1])

    trainer = fa.Trainer(
        model=lambda d: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(d),
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
        train_step=train_step,
        dataset=data,
        batch_size=BATCH,
        epochs=args.epochs,
        policy={"sync": fa.Policy.SYNC, "cadence": fa.Policy.CADENCE, "async": fa.Policy.ASYNC}[
            args.policy
        ],
        backend=fa.Backend.COLLECTIVE if args.backend == "collective" else fa.Backend.CPU,
        max_restarts=1 if rejoin else 0,
        cluster=args.cluster,
    )
    asyncio.run(trainer.run())


def restart_role(args: argparse.Namespace) -> None:
    """One rank of the plain script: an all_reduce per step; the first attempt loses a rank."""
    out = Path(args.out)
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt > 0:  # before torch is imported: the launcher's share of the restart ends here
        (out / f"started-{rank}").write_text(f"{time.time()!r}\n")
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    grad = torch.ones(16 * 32 + 32 + 32 + 1)  # the elastic trial's model, flat
    for step in range(args.kill_step + 10 if attempt == 0 else 2):
        if attempt == 0 and rank == args.kill_rank and step == args.kill_step:
            _die(out, rank)
        time.sleep(args.step_ms / 1e3)
        dist.all_reduce(grad)
        if attempt > 0 and step == 0:
            (out / f"first-{rank}").write_text(f"{time.time()!r}\n")
    dist.barrier()  # no rank tears its group down while a peer still uses it
    dist.destroy_process_group()


# ----- the benchmark's side ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ElasticKill:
    """One elastic trial's stages, in seconds after the kill."""

    epoch: int  # the epoch the kill landed in, from 1
    detect: float
    opened: float  # the survivors' next round opened (before ``detect``: it was in flight)
    committed: float
    second: float  # and the one after it: the survivors go on
    reason: str
    period: float | None  # the median time between rounds before the kill
    rejoin: Rejoin | None = None  # --fault rejoin: the restarted rank's


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejoin:
    """A restarted rank's stages: its hello after the kill, then admission and its first committed
    round after its hello (the join)."""

    hello: float
    admitted: float
    committed: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartKill:
    """One restart trial's stages, in seconds after the kill (the new world's earliest rank)."""

    started: float  # a restarted rank's script runs (torch not yet imported)
    progress: float  # past its first all_reduce


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(role: str, args: argparse.Namespace, out: Path, **extra: object) -> list[str]:
    cmd = [sys.executable, __file__, "--role", role, "--out", str(out)]
    for flag in ("policy", "backend", "fault", "epochs", "batches", "step_ms"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    for flag, value in extra.items():
        cmd += [f"--{flag.replace('_', '-')}", str(value)]
    return cmd


def _run(cmd: Sequence[str], out: Path, what: str) -> str:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
    }
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT, check=False
    )
    output = done.stdout + done.stderr
    if done.returncode != 0 or not (out / "killed").exists():
        raise SystemExit(f"{what} failed (exit {done.returncode}):\n{output[-4000:]}")
    return output


def _killed(out: Path) -> tuple[int, float]:
    rank, stamp = (out / "killed").read_text().split()
    return int(rank), float(stamp)


def elastic_trial(
    args: argparse.Namespace, out: Path, kill_rank: int, kill_step: int
) -> ElasticKill:
    out.mkdir(parents=True)
    cluster = out / "cluster.yml"
    cluster.write_text(
        f"controller:\n  host: 127.0.0.1\n  port: {_free_port()}\nworkers:\n  - host: "
        f"{socket.gethostname()}\n    devices: cpu:{args.ranks}\n"
    )
    cmd = _child("elastic", args, out, cluster=cluster, kill_rank=kill_rank, kill_step=kill_step)
    output = _run(cmd, out, f"elastic trial (rank {kill_rank} killed at step {kill_step})")
    ending = "1 restart (" if args.fault == "rejoin" else "DEGRADED"
    if ending not in output:
        raise SystemExit(f"elastic trial did not end with {ending!r}:\n{output[-4000:]}")
    rank, killed = _killed(out)
    records = []
    for line in (out / "controller.log").read_text().splitlines():
        stamp, _, message = line.partition(" ")
        records.append((float(stamp), message))
    found = stages(records, rank, killed)
    if args.fault == "rejoin":
        return dataclasses.replace(found, rejoin=rejoin_stages(records, rank, killed))
    return found


def rejoin_stages(records: Sequence[tuple[float, str]], rank: int, killed: float) -> Rejoin:
    """The restarted rank's hello, admission and first committed round after it."""

    def first(pattern: re.Pattern[str], after: float) -> float:
        for t, text in records:
            match = pattern.fullmatch(text)
            if (
                t >= after
                and match
                and ("rank" not in pattern.groupindex or int(match["rank"]) == rank)
            ):
                return t
        raise SystemExit(f"no {pattern.pattern!r} record after {after:.3f} for rank {rank}")

    hello = first(HELLO, killed)
    admitted = first(ADMITTED, hello)
    committed = first(COMMITTED, admitted)
    return Rejoin(hello=hello - killed, admitted=admitted - hello, committed=committed - hello)


def stages(records: Sequence[tuple[float, str]], rank: int, killed: float) -> ElasticKill:
    """One elastic trial's stages, from the controller's timed records (in the order it made them)
    and the kill."""
    lost = [
        (i, t, match)
        for i, (t, text) in enumerate(records)
        if (match := LOST.fullmatch(text)) and int(match["rank"]) == rank
    ]
    if not lost:
        raise SystemExit(f"the controller never declared rank {rank} dead")
    index, detected, why = lost[0]
    after = [(t, match) for t, text in records[index + 1 :] if (match := COMMITTED.fullmatch(text))]
    if len(after) < 2:
        raise SystemExit(f"{len(after)} round(s) committed after rank {rank} died; need 2")
    before = [t for t, text in records if t < killed and COMMITTED.fullmatch(text)]
    committed = after[0][0] - killed
    return ElasticKill(
        epoch=1 + sum(t < killed and EPOCH.match(text) is not None for t, text in records),
        detect=detected - killed,
        opened=committed - float(after[0][1]["ms"]) / 1e3,
        committed=committed,
        second=after[1][0] - killed,
        reason=why["reason"],
        period=statistics.median(b - a for a, b in itertools.pairwise(before))
        if len(before) > 1
        else None,
    )


def restart_trial(
    args: argparse.Namespace, out: Path, kill_rank: int, kill_step: int
) -> RestartKill:
    out.mkdir(parents=True)
    cmd = [
        sys.executable, "-m", "flodl_async.cli.launch", "--nproc", str(args.ranks),
        "--devices", "cpu", "--port", "0", "--max-restarts", "1", "-q", "--",
        *_child("restart", args, out, kill_rank=kill_rank, kill_step=kill_step),
    ]  # fmt: skip
    _run(cmd, out, f"restart trial (rank {kill_rank} killed at step {kill_step})")
    _, killed = _killed(out)
    started = [float(p.read_text()) for p in out.glob("started-*")]
    firsts = [float(p.read_text()) for p in out.glob("first-*")]
    if len(firsts) != args.ranks or len(started) != args.ranks:
        raise SystemExit(f"restart trial: {len(firsts)} of {args.ranks} ranks made progress")
    return RestartKill(started=min(started) - killed, progress=min(firsts) - killed)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile, interpolated linearly between the nearest ranks."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def _row(name: str, values: Sequence[float]) -> str:
    return (
        f"{name:<48} {percentile(values, 50):>7.3f} {percentile(values, 99):>7.3f} "
        f"{min(values):>7.3f} {max(values):>7.3f}"
    )


def report(
    args: argparse.Namespace, elastic: list[ElasticKill], restart: list[RestartKill]
) -> None:
    fault = args.fault
    signame = "SIGSTOP" if fault == "stop" else "SIGKILL"
    print(
        f"\n{args.ranks} CPU ranks, {args.policy.upper()} on the {args.backend.upper()} backend, "
        f"{args.batches} batches/epoch, {args.step_ms:g} ms/step; {len(elastic)} elastic "
        f"{fault}(s), {len(restart)} restart kill(s), one {signame} per run; seconds after it, "
        "time.time() on one machine"
    )
    print(f"{'stage':<48} {'p50 s':>7} {'p99 s':>7} {'min s':>7} {'max s':>7}")
    print(_row(f"elastic: {fault} -> declared dead", [k.detect for k in elastic]))
    print(_row(f"elastic: {fault} -> survivors' round opened", [k.opened for k in elastic]))
    print(_row(f"elastic: {fault} -> survivors' round committed", [k.committed for k in elastic]))
    print(_row(f"elastic: {fault} -> survivors' 2nd round committed", [k.second for k in elastic]))
    rejoins = [k.rejoin for k in elastic if k.rejoin is not None]
    if rejoins:
        print(_row("rejoin: kill -> restarted rank's hello", [r.hello for r in rejoins]))
        print(_row("rejoin: hello -> admitted at a round boundary", [r.admitted for r in rejoins]))
        print(_row("rejoin: hello -> its first committed round", [r.committed for r in rejoins]))
    if restart:
        print(_row("restart: kill -> restarted ranks running", [k.started for k in restart]))
        print(_row("restart: kill -> restarted world's all_reduce", [k.progress for k in restart]))
    for reason, count in collections.Counter(k.reason for k in elastic).most_common():
        print(f"  declared dead by: {reason} (x{count})")
    landed = collections.Counter(k.epoch for k in elastic)
    print(
        "  the kills landed in "
        + ", ".join(f"epoch {e} (x{n})" for e, n in sorted(landed.items()))
        + f" of {args.epochs}"
    )
    in_flight = sum(k.opened < k.detect for k in elastic)
    print(
        f"  the next round was already open at the death in {in_flight} of {len(elastic)} kill(s)"
    )
    periods = [k.period for k in elastic if k.period is not None]
    if periods:
        print(f"  round period before the kill (median): {statistics.median(periods):.3f} s")
    if args.fault == "stop":
        # a frozen rank says nothing: its silence is the only sign, heartbeat_timeout long
        detect = percentile([k.detect for k in elastic], 50)
        met = detect <= GOAL_FROZEN_S
        print(
            f"goal (a frozen rank declared dead within {GOAL_FROZEN_S:g} s, p50): "
            f"{'met' if met else 'NOT met'}; the slowest {max(k.detect for k in elastic):.3f} s"
        )
        return
    p50 = percentile([k.committed for k in elastic], 50)
    p99 = percentile([k.committed for k in elastic], 99)
    if rejoins:
        # the issue sets no goal for the join; the kill's own goal still holds for the survivors
        joined = [r.committed for r in rejoins]
        hello = percentile([r.hello for r in rejoins], 50)
        print(
            f"rejoin (hello) -> first committed round: {percentile(joined, 50):.3f} s p50, "
            f"{percentile(joined, 99):.3f} s p99 (no goal set); the process restart (kill -> "
            f"hello) {hello:.3f} s p50. The others waited for the hello, so the survivors' rows "
            "time that wait, not their recovery (run --fault kill for it)"
        )
        return
    if args.backend == "collective":
        # the re-form (a new process group's rendezvous) is the COLLECTIVE goal's whole budget
        goal = f"<= {GOAL_COLLECTIVE_P50_S:g} s p50"
        met = p50 <= GOAL_COLLECTIVE_P50_S
    else:
        goal = f"<= {GOAL_P50_S:g} s p50, <= {GOAL_P99_S:g} s p99"
        met = p50 <= GOAL_P50_S and p99 <= GOAL_P99_S
    print(
        f"goal (kill -> next committed round {goal}): "
        f"{'met' if met else 'NOT met'}; restart-the-world / elastic (p50): "
        f"{percentile([k.progress for k in restart], 50) / p50:.1f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=10, help="kills per path (one per run)")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--policy", default="cadence", choices=["sync", "cadence", "async"])
    parser.add_argument(
        "--backend",
        default="cpu",
        choices=["cpu", "collective"],
        help="the Trainer's (collective: gloo, the survivors re-form their group in place)",
    )
    parser.add_argument(
        "--fault",
        default="kill",
        choices=["kill", "stop", "rejoin"],
        help="SIGKILL the rank (against a plain script's restart), SIGSTOP it (a frozen rank, "
        "noticed by its silence; no restart path to compare), or SIGKILL it under max_restarts=1 "
        "(CPU backend: restarted alone, it rejoins; no restart path to compare)",
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=96, help="batches per epoch")
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0, help="where each trial's kill lands")
    parser.add_argument("--keep", metavar="DIR", help="keep each trial's files under DIR")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one kill of each kind, 2 ranks, 2 epochs of 24 batches",
    )
    for hidden in ("role", "out", "cluster", "kill_rank", "kill_step"):
        parser.add_argument(f"--{hidden.replace('_', '-')}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role is not None:
        args.kill_rank, args.kill_step = int(args.kill_rank), int(args.kill_step)
        {"elastic": elastic_role, "restart": restart_role}[args.role](args)
        return
    if args.smoke:
        args.kills, args.ranks, args.epochs, args.batches = 1, 2, 2, 24
    if args.ranks < 2 or args.kills < 1 or args.epochs < 2:
        parser.error("need --ranks >= 2, --kills >= 1 and --epochs >= 2")
    if args.fault == "rejoin" and args.backend != "cpu":
        parser.error("--fault rejoin needs --backend cpu: a COLLECTIVE run restarts no rank")
    if args.fault == "rejoin" and args.smoke:
        args.epochs = 3  # an epoch after the kill's for the rejoin
    per_epoch = args.batches // args.ranks  # each rank's steps in an epoch, at equal speeds
    draw = random.Random(args.seed)
    elastic: list[ElasticKill] = []
    restart: list[RestartKill] = []
    with tempfile.TemporaryDirectory(prefix="flodl-bench-recovery-") as scratch:
        tmp = args.keep or scratch
        for trial in range(args.kills):
            kill_rank = trial % args.ranks
            # mid-epoch, in the second epoch: the run has warmed up and has an epoch left after
            kill_step = per_epoch + draw.randint(per_epoch // 4, per_epoch * 3 // 4)
            elastic.append(
                elastic_trial(args, Path(tmp) / f"elastic-{trial}", kill_rank, kill_step)
            )
            if args.fault == "kill":
                restart.append(
                    restart_trial(args, Path(tmp) / f"restart-{trial}", kill_rank, kill_step)
                )
            then = f"; restart {restart[-1].progress:.3f} s" if restart else ""
            print(
                f"{args.fault} {trial + 1}/{args.kills}: rank {kill_rank} at step {kill_step}: "
                f"elastic (epoch {elastic[-1].epoch}) detect {elastic[-1].detect:.3f} s, next "
                f"round {elastic[-1].committed:.3f} s{then}",
                flush=True,
            )
    report(args, elastic, restart)


if __name__ == "__main__":
    main()
