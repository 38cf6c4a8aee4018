"""Launch benchmark: time from command start until every rank has passed its first all_reduce, and
until the launcher has exited.

Run: ``python benchmarks/launch.py [--rounds 5] [--nproc 2 4]`` (``--smoke``: one round of
``--nproc 2``, for the test suite)

Three launchers run the same rank script (gloo init + one 1-element all_reduce),
alternated round by round so they share the machine's state:

- ``floor``: the ranks started by hand with ``subprocess.Popen`` and the env:// variables set
  (rank 0 hosts the store), the least any launcher can do;
- ``flodl-launch --nproc N``;
- ``torchrun --standalone --nproc-per-node N``.

Each rank writes the wall-clock times it started at and right after its first all_reduce. Per trial:
``spawn`` is the earliest start of a rank, ``all_reduce`` the latest all_reduce, ``exit`` when the
command returned (for the floor: when its last rank was reaped), each minus the moment the command
started. The tables give medians and the median of the per-round ratios (target: flodl-launch
<= 1.05x the floor to the all_reduce and to the exit, its ranks spawned within 100 ms).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

RANK_SCRIPT = """
import os, sys, time
started = time.time()
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
with open(os.path.join(sys.argv[1], f"t-{dist.get_rank()}"), "w") as out:
    out.write(f"{started!r} {time.time()!r}")
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: One trial: seconds from the command's start to its first rank's start, to every rank past its
#: first all_reduce, and to the command's exit.
Trial = tuple[float, float, float]
STAGES = ("spawn", "all_reduce", "exit")


def _trial(out_dir: Path, nproc: int, started: float) -> Trial:
    exited = time.time()
    stamps = [
        tuple(float(word) for word in (out_dir / f"t-{rank}").read_text().split())
        for rank in range(nproc)
    ]
    return (
        min(s[0] for s in stamps) - started,
        max(s[1] for s in stamps) - started,
        exited - started,
    )


def run_floor(script: Path, out_dir: Path, nproc: int) -> Trial:
    port = _free_port()
    started = time.time()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(out_dir)],
            env={
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "WORLD_SIZE": str(nproc),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "OMP_NUM_THREADS": "1",
            },
        )
        for rank in range(nproc)
    ]
    for proc in procs:
        if proc.wait() != 0:
            raise RuntimeError("floor rank failed")
    return _trial(out_dir, nproc, started)


def run_flodl(script: Path, out_dir: Path, nproc: int, tree: str | None = None) -> Trial:
    """``tree``: a checkout whose flodl_async runs instead of this one (``--compare-tree``)."""
    env = {**os.environ, "PYTHONPATH": tree} if tree is not None else None
    started = time.time()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "flodl_async.cli.launch",
            "--nproc",
            str(nproc),
            "--devices",
            "cpu",
            "--port",
            "0",
            "-q",
            "--",
            sys.executable,
            str(script),
            str(out_dir),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        env=env,
    )
    return _trial(out_dir, nproc, started)


def run_torchrun(script: Path, out_dir: Path, nproc: int) -> Trial:
    started = time.time()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(script),
            str(out_dir),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return _trial(out_dir, nproc, started)


LAUNCHERS: dict[str, Callable[[Path, Path, int], Trial]] = {
    "floor": run_floor,
    "flodl-launch": run_flodl,
    "torchrun": run_torchrun,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--smoke", action="store_true", help="one round of --nproc 2")
    parser.add_argument(
        "--compare-tree",
        metavar="DIR",
        help="also run the flodl_async of another checkout (e.g. the main branch), alternated",
    )
    args = parser.parse_args()
    launchers = dict(LAUNCHERS)
    if args.compare_tree:
        tree = str(Path(args.compare_tree).resolve())
        launchers["flodl @other"] = lambda s, o, n: run_flodl(s, o, n, tree)
    if args.smoke:
        args.rounds, args.nproc = 1, [2]
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "rank.py"
        script.write_text(RANK_SCRIPT)
        for nproc in args.nproc:
            trials: dict[str, list[Trial]] = {name: [] for name in launchers}
            for round_ in range(args.rounds):
                for name, launcher in launchers.items():
                    out_dir = Path(tmp) / f"{name.replace(' ', '_')}-{nproc}-{round_}"
                    out_dir.mkdir()
                    trials[name].append(launcher(script, out_dir, nproc))
            for stage in (1, 2):
                _table(nproc, args.rounds, STAGES[stage], trials, stage)
            for name, runs in trials.items():
                spawned = statistics.median(t[0] for t in runs)
                print(f"{name}: first rank started {spawned * 1000:.0f} ms after the command")
    print("\ntarget: flodl-launch <= 1.05 x floor, to the all_reduce and to the exit")


def _table(nproc: int, rounds: int, what: str, trials: dict[str, list[Trial]], stage: int) -> None:
    """One table: seconds from the command's start to ``what`` (``stage`` of each trial)."""
    print(f"\nN = {nproc}: seconds from command start to {what} ({rounds} rounds, alternated)")
    print(
        f"{'launcher':<14} {'median s':>9} {'min s':>7} {'max s':>7} "
        f"{'ratio to floor (median of per-round)':>38}"
    )
    floor = [t[stage] for t in trials["floor"]]
    for name, runs in trials.items():
        values = [t[stage] for t in runs]
        ratios = [v / f for v, f in zip(values, floor, strict=True)]
        print(
            f"{name:<14} {statistics.median(values):>9.2f} {min(values):>7.2f} "
            f"{max(values):>7.2f} {statistics.median(ratios):>38.2f}"
        )


if __name__ == "__main__":
    main()
