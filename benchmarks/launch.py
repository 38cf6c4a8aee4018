"""Launch benchmark: time from command start until every rank has passed its first all_reduce.

Run: ``python benchmarks/launch.py [--rounds 5] [--nproc 2 4]`` (``--smoke``: one round of
``--nproc 2``, for the test suite)

Three launchers run the same rank script (gloo init + one 1-element all_reduce),
alternated round by round so they share the machine's state:

- ``floor``: the ranks started by hand with ``subprocess.Popen`` and the env:// variables set
  (rank 0 hosts the store), the least any launcher can do;
- ``flodl-launch --nproc N``;
- ``torchrun --standalone --nproc-per-node N``.

Each rank writes the wall-clock time right after its first all_reduce; a trial's
value is the latest of them minus the moment the command started. The table gives
medians and the median of the per-round ratios (target: flodl-launch <= 1.15x the floor).
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
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
with open(os.path.join(sys.argv[1], f"t-{dist.get_rank()}"), "w") as out:
    out.write(repr(time.time()))
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _first_allreduce(out_dir: Path, nproc: int, started: float) -> float:
    stamps = [float((out_dir / f"t-{rank}").read_text()) for rank in range(nproc)]
    return max(stamps) - started


def run_floor(script: Path, out_dir: Path, nproc: int) -> float:
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
    return _first_allreduce(out_dir, nproc, started)


def run_flodl(script: Path, out_dir: Path, nproc: int) -> float:
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
    )
    return _first_allreduce(out_dir, nproc, started)


def run_torchrun(script: Path, out_dir: Path, nproc: int) -> float:
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
    return _first_allreduce(out_dir, nproc, started)


LAUNCHERS: dict[str, Callable[[Path, Path, int], float]] = {
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
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.nproc = 1, [2]
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "rank.py"
        script.write_text(RANK_SCRIPT)
        for nproc in args.nproc:
            times: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
            for round_ in range(args.rounds):
                for name, launcher in LAUNCHERS.items():
                    out_dir = Path(tmp) / f"{name}-{nproc}-{round_}"
                    out_dir.mkdir()
                    times[name].append(launcher(script, out_dir, nproc))
            print(
                f"\nN = {nproc}: seconds from command start to every rank past its first "
                f"all_reduce ({args.rounds} rounds, alternated)"
            )
            print(
                f"{'launcher':<14} {'median s':>9} {'min s':>7} {'max s':>7} "
                f"{'ratio to floor (median of per-round)':>38}"
            )
            for name, values in times.items():
                ratios = [v / f for v, f in zip(values, times["floor"], strict=True)]
                print(
                    f"{name:<14} {statistics.median(values):>9.2f} {min(values):>7.2f} "
                    f"{max(values):>7.2f} {statistics.median(ratios):>38.2f}"
                )
    print("\ntarget: flodl-launch <= 1.15 x floor")


if __name__ == "__main__":
    main()
