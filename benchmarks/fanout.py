"""ssh fan-out: command → world formed for K namespace hosts, against ``ssh host true`` to the same
K hosts.

Needs root and openssh-server (it builds the namespace hosts of tests/hostkit.py: one bridge, K
network + UTS namespaces, a real sshd each). For each K, the baseline runs the OpenSSH client's
``ssh host true`` to all K hosts in parallel (connect, key exchange, login, run, exit), and a
second floor ``ssh host python -c 'import asyncio'`` (the least an asyncio agent starts with); the
measured time is from starting ``flodl-launch cluster.yml`` (one cpu rank per host) to its
"world formed" line: every ssh connection, every agent's start-up and hello, every join; the
launcher's own CPU time at that line is reported beside it (the part of the work all K hosts
share: on a real cluster each host's part runs on its own machine).
A second launch per cell runs a gloo script instead of ``python -c pass`` and measures command →
every rank past its first all_reduce (its marker line seen on the launcher's stdout): that adds
each rank's ``import torch`` and the rendezvous, all on the same cores (no goal, just reported).
Each cell is the median of ``--repeats`` runs. Run: ``sudo python benchmarks/fanout.py``
(``--smoke``: K = 1 and 2, one run each, for the test suite; every namespace, sshd and process it
made is gone when it returns).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.hostkit import HostKit, NsHost, missing_requirements  # noqa: E402
from tests.launchkit import free_port  # noqa: E402

#: The least any asyncio agent must do on each host: an interpreter that imports asyncio.
ASYNCIO_PYTHON = f"{sys.executable} -c 'import asyncio'"


def ssh_run(kit: HostKit, hosts: list[NsHost], command: str = "true") -> float:
    """Seconds for OpenSSH's ``ssh host COMMAND`` to all ``hosts`` in parallel."""
    start = time.perf_counter()
    procs = [subprocess.Popen(kit.ssh_argv(h, command), stdin=subprocess.DEVNULL) for h in hosts]
    codes = [p.wait(timeout=120) for p in procs]
    elapsed = time.perf_counter() - start
    assert codes == [0] * len(hosts), codes
    return elapsed


ALL_REDUCE_MARKER = "flodl-bench-past-all-reduce"
ALL_REDUCE_SCRIPT = f"""\
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print("{ALL_REDUCE_MARKER}", int(t.item()), flush=True)
dist.destroy_process_group()
"""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a live process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def launch(
    kit: HostKit,
    hosts: list[NsHost],
    work: Path,
    *,
    all_reduce: bool,
    launcher_cpu: list[float] | None = None,
    retries: int = 2,
) -> float:
    """Seconds from the command to "world formed" or, with ``all_reduce``, to every rank's marker
    line.

    ``launcher_cpu`` gets the launcher's own CPU seconds at "world formed": on a real cluster the
    hosts' work runs on their own machines, and this is the part that all K hosts share.
    """
    wrapper = work / "python3"
    wrapper.write_text(f'#!/bin/sh\nexport PYTHONPATH={ROOT}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o700)
    script = work / "allreduce.py"
    script.write_text(ALL_REDUCE_SCRIPT)
    lines = [f"controller: {{host: 0.0.0.0, port: {free_port()}}}", "workers:"]
    for h in hosts:
        ssh = {
            "target": h.addr,
            "user": "root",
            "identity_file": str(kit.user_key),
            "known_hosts": str(kit.known_hosts),
        }
        lines += [
            f"  - host: {h.name}",
            "    devices: cpu:1",
            f"    python: {wrapper}",
            f"    ssh: {json.dumps(ssh)}",
        ]
    cluster = work / "cluster.yml"
    cluster.write_text("\n".join(lines) + "\n")
    command = [sys.executable, str(script)] if all_reduce else [sys.executable, "-c", "pass"]
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flodl_async.cli.launch", str(cluster), "--", *command],
        stdout=subprocess.PIPE if all_reduce else subprocess.DEVNULL,
        stderr=subprocess.DEVNULL if all_reduce else subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    stream = proc.stdout if all_reduce else proc.stderr
    assert stream is not None
    reached: float | None = None
    seen = 0
    # what a failed launch said last
    last_lines: collections.deque[str] = collections.deque(maxlen=12)
    for line in stream:
        last_lines.append(line)
        if reached is not None:
            continue  # read on to the end: a launcher whose output nobody reads would stall
        if all_reduce and ALL_REDUCE_MARKER in line:
            # the all_reduce really summed every rank
            assert line.split()[-1] == str(len(hosts)), line
            seen += 1
            if seen == len(hosts):
                reached = time.perf_counter() - start
        # not "... went away before the world formed"
        elif not all_reduce and "world formed — " in line:
            reached = time.perf_counter() - start
            if launcher_cpu is not None:
                launcher_cpu.append(cpu_seconds(proc.pid))
    code = proc.wait(timeout=120)
    said = "".join(last_lines)
    if code == 2 and "already held by a live listener" in said and retries > 0:
        # free_port() only found a port free a moment ago: something else on this busy machine
        # took it since (a rank's gloo listener, another test). Another port, not a failure.
        return launch(kit, hosts, work, all_reduce=all_reduce, launcher_cpu=launcher_cpu,
                      retries=retries - 1)  # fmt: skip
    assert code == 0 and reached is not None, (
        f"flodl-launch exited {code} (reached: {reached}); it said last:\n{said}"
    )
    return reached


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--hosts", default="1,2,4,8", help="comma-separated K values (default %(default)s)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="K = 1 and 2, one run each")
    args = parser.parse_args()
    if args.smoke:
        args.hosts, args.repeats = "1,2", 1
    why = missing_requirements()
    if why is not None:
        print(f"fanout benchmark: {why}", file=sys.stderr)
        return 2
    ks = [int(k) for k in args.hosts.split(",")]
    kit = HostKit.create(max(ks))
    try:
        print(
            f"{'K':>3} {'ssh host true (s)':>18} {'ssh host python+asyncio (s)':>28} "
            f"{'flodl world formed (s)':>23}"
            f" {'ratio':>6} {'launcher CPU (s)':>17} {'past 1st all_reduce (s)':>24}"
        )
        formed_at: dict[int, float] = {}
        interpreter_at: dict[int, float] = {}
        for k in ks:
            hosts = kit.hosts[:k]
            base = statistics.median(ssh_run(kit, hosts) for _ in range(args.repeats))
            interpreter = statistics.median(
                ssh_run(kit, hosts, ASYNCIO_PYTHON) for _ in range(args.repeats)
            )
            with tempfile.TemporaryDirectory() as work:
                launcher_cpu: list[float] = []
                ours = statistics.median(
                    launch(kit, hosts, Path(work), all_reduce=False, launcher_cpu=launcher_cpu)
                    for _ in range(args.repeats)
                )
                reduced = statistics.median(
                    launch(kit, hosts, Path(work), all_reduce=True) for _ in range(args.repeats)
                )
            formed_at[k] = ours
            interpreter_at[k] = interpreter
            cpu = statistics.median(launcher_cpu)
            print(
                f"{k:>3} {base:>18.3f} {interpreter:>28.3f} {ours:>23.3f} {ours / base:>6.1f} "
                f"{cpu:>17.3f} {reduced:>24.3f}",
                flush=True,
            )
        if 1 in formed_at and len(formed_at) > 1:
            top = max(formed_at)
            ratio = formed_at[top] / formed_at[1]
            print(
                f"world formed on {top} hosts / on 1 host: {ratio:.2f}x (goal <= 1.5x: "
                f"{'met' if ratio <= 1.5 else 'NOT met'})"
            )
            # Every host here shares this machine's cores: what K hosts add is mostly K interpreters
            # starting at once. The goal allows half of the one-host time; compare that with what
            # starting a bare asyncio interpreter on each host over ssh adds on its own.
            added = formed_at[top] - formed_at[1]
            floor_added = interpreter_at[top] - interpreter_at[1]
            print(
                f"{top} hosts add {added:.3f} s to world formed (the goal allows "
                f"{0.5 * formed_at[1]:.3f} s);"
                f" `ssh host python -c 'import asyncio'` alone adds {floor_added:.3f} s on "
                f"{os.cpu_count()} core(s)"
            )
    finally:
        kit.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
