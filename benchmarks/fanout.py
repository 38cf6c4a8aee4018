"""ssh fan-out: command → world formed for K namespace hosts, against ``ssh host true`` to the same K hosts.

Needs root and openssh-server (it builds the namespace hosts of tests/hostkit.py: one bridge, K
network + UTS namespaces, a real sshd each). For each K, the baseline runs the OpenSSH client's
``ssh host true`` to all K hosts in parallel (connect, key exchange, login, run, exit); the
measured time is from starting ``flodl-launch cluster.yml`` (one cpu rank per host) to its
"world formed" line: every ssh connection, every agent's start-up and hello, every join.
Each cell is the median of ``--repeats`` runs. Run: ``sudo python benchmarks/fanout.py``.
"""

from __future__ import annotations

import argparse
import json
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


def ssh_true(kit: HostKit, hosts: list[NsHost]) -> float:
    start = time.perf_counter()
    procs = [subprocess.Popen(kit.ssh_argv(h, "true"), stdin=subprocess.DEVNULL) for h in hosts]
    codes = [p.wait(timeout=120) for p in procs]
    elapsed = time.perf_counter() - start
    assert codes == [0] * len(hosts), codes
    return elapsed


def to_world_formed(kit: HostKit, hosts: list[NsHost], work: Path) -> float:
    wrapper = work / "python3"
    wrapper.write_text(f'#!/bin/sh\nexport PYTHONPATH={ROOT}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o700)
    lines = [f"controller: {{host: 0.0.0.0, port: {free_port()}}}", "workers:"]
    for h in hosts:
        ssh = {"target": h.addr, "user": "root", "identity_file": str(kit.user_key), "known_hosts": str(kit.known_hosts)}
        lines += [f"  - host: {h.name}", "    devices: cpu:1", f"    python: {wrapper}", f"    ssh: {json.dumps(ssh)}"]
    cluster = work / "cluster.yml"
    cluster.write_text("\n".join(lines) + "\n")
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flodl_async.launch", str(cluster), "--", sys.executable, "-c", "pass"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stderr is not None
    formed: float | None = None
    for line in proc.stderr:
        if formed is None and "world formed" in line:
            formed = time.perf_counter() - start
    code = proc.wait(timeout=120)
    assert code == 0 and formed is not None, f"flodl-launch exited {code} (world formed: {formed})"
    return formed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="1,2,4,8", help="comma-separated K values (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    why = missing_requirements()
    if why is not None:
        print(f"fanout benchmark: {why}", file=sys.stderr)
        return 2
    ks = [int(k) for k in args.hosts.split(",")]
    kit = HostKit.create(max(ks))
    try:
        print(f"{'K':>3} {'ssh host true (s)':>18} {'flodl world formed (s)':>23} {'ratio':>6}")
        for k in ks:
            hosts = kit.hosts[:k]
            base = statistics.median(ssh_true(kit, hosts) for _ in range(args.repeats))
            with tempfile.TemporaryDirectory() as work:
                ours = statistics.median(to_world_formed(kit, hosts, Path(work)) for _ in range(args.repeats))
            print(f"{k:>3} {base:>18.3f} {ours:>23.3f} {ours / base:>6.1f}", flush=True)
    finally:
        kit.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
