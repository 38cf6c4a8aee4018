"""Every script in benchmarks/ runs in its smoke mode: each stage, tiny sizes, one round, and its table
printed against its same-run baseline.

A benchmark that a later change breaks fails here, not the next time someone measures with it. Each script
runs as its own process, as a person runs it, in a session of its own: when it has returned, no process of
that session may be left (nor, for fanout.py, any namespace host it made).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from .hostkit import require_namespace_hosts

ROOT = Path(__file__).resolve().parent.parent

#: Per script: what its table must show (regular expressions, each matched against a whole line): the
#: header, then a row per variant and its baseline.
TABLES: dict[str, tuple[str, ...]] = {
    "averaging": (
        r"\s*size \| rounds \|\s+flodl ms \|\s+gloo ms \|\s+check ms \| ratio.*",
        r"\s*1 MiB \|\s+1 \| .* \| .* \|\s+[\d.]+ \| [\d.]+× .*",
        r"resnet20 \|\s+1 \| .* \| .* \|\s+[\d.]+ \| [\d.]+× .*",
    ),
    "cadence": (
        r"policy\s+epoch ms median \(min-max\)\s+rank 0 share\s+reduces/epoch\s+reduce ms",
        r"sync\s+\d+ \(.*",
        r"cadence\s+\d+ \(.*",
        r"CADENCE speedup over SYNC: [\d.]+x .*",
    ),
    "checkpoint": (
        r"\s*size \| rounds \|\s+torch.save MB/s \|\s+\+fsync MB/s \|\s+bundle MB/s \| ratio .*",
        r"\s*1 MiB \|\s+1 \|\s+\d+ \(.*\) \|\s+\d+ \(.*\) \|\s+\d+ \(.*\) \| [\d.]+× .*, [\d.]+×",
        r"sha256 alone: \d+ MB/s .*; two threads hashing finish [\d.]+x as fast as one .*",
        r"verify_bundle \(read back, .*\): 1 MiB \d+ MB/s",
        r"goal \(bundle >= 0.8x torch.save\): 1 MiB (met|NOT met)",
        r"rank blocked by a checkpoint \(CPU backend\), 1 MiB model, SGD momentum: \d+ \(.*\) ms .*",
        r"step inflation while the writes run: .*",
    ),
    "fanout": (
        r"\s+K\s+ssh host true \(s\)\s+ssh host python\+asyncio \(s\)\s+flodl world formed \(s\).*",
        r"\s+1(\s+[\d.]+){6}",
        r"\s+2(\s+[\d.]+){6}",
        r"world formed on 2 hosts / on 1 host: [\d.]+x .*",
    ),
    "launch": (
        r"launcher\s+median s\s+min s\s+max s\s+ratio to floor.*",
        r"floor(\s+[\d.]+){4}",
        r"flodl-launch(\s+[\d.]+){4}",
        r"torchrun(\s+[\d.]+){4}",
    ),
    "recovery": (
        r"stage\s+p50 s\s+p99 s\s+min s\s+max s",
        r"elastic: kill -> declared dead(\s+[\d.]+){4}",
        r"elastic: kill -> survivors' round committed(\s+[\d.]+){4}",
        r"restart: kill -> restarted world's all_reduce(\s+[\d.]+){4}",
        r"goal \(kill -> next committed round .*\): (met|NOT met); .*",
    ),
    # the same, where the survivors re-form their gloo group in place
    "recovery --backend collective": (
        r"elastic: kill -> survivors' round committed(\s+[\d.]+){4}",
        r"goal \(kill -> next committed round <= 3 s p50\): (met|NOT met); .*",
    ),
    # a frozen rank, noticed by its silence
    "recovery --fault stop": (
        r"elastic: stop -> declared dead(\s+[\d.]+){4}",
        r"goal \(a frozen rank declared dead within 10 s, p50\): (met|NOT met); .*",
    ),
    # a rank restarted alone under max_restarts=1 rejoins
    "recovery --fault rejoin": (
        r"rejoin: hello -> its first committed round(\s+[\d.]+){4}",
        r"rejoin \(hello\) -> first committed round: [\d.]+ s p50, [\d.]+ s p99 .*",
    ),
    "chaos": (
        r"chaos: .*; scaled down from the 32-rank published runs",
        r"fault-free\s+\d+\s+0\s+[\d.]+\s+[\d.]+",
        r"chaos\s+\d+\s+\d+\s+[\d.]+\s+[\d.]+",
        r"goal \(samples committed per second >= 80% .*\): (met|NOT met); \d+%",
    ),
    "store": (
        r"op\s+ours \(controller port\)\s+torch TCPStore server\s+ratio",
        *(rf"{op}\s+[\d,]+\s+[\d,]+\s+[\d.]+x" for op in ("set", "get", "add", "wait")),
        r"connect\s+[\d.]+ ms\s+[\d.]+ ms\s+[\d.]+x .*",
    ),
    "tcpleg": (
        r"\s*size \| rounds \|\s+median \|\s+p25 \|\s+min",
        r"\s*1 MiB \|\s+1 \|\s+[\d.]+ \|\s+[\d.]+ \|\s+[\d.]+",
    ),
    "wire": (
        r"loop\s+raw socket MB/s\s+handshaken\+AES-GCM MB/s\s+framed / raw.*",
        r"asyncio(\s+[\d.]+){5}",
        r"uvloop(\s+[\d.]+){5}",
        r"physical bounds, same run: .*",
        r"\s+bare uvloop forwarder \d+ MB/s; flodl relay .* \d+ MB/s; ratio [\d.]+",
        r"\s+uvloop\s+bare TCP connect [\d.]+ ms; connect \+ handshake [\d.]+ ms .*",
        r"\s+16MiB tensor decode ms\s+[\d.]+",
    ),
}


def _kits_of(pid: int) -> list[Path]:
    """Namespace-host kits (tests/hostkit.py) that process ``pid`` made and did not take down."""
    kits = []
    for owner in Path(tempfile.gettempdir()).glob("flodl-hosts-*/owner"):
        try:
            if owner.read_text().split()[0] == str(pid):
                kits.append(owner.parent)
        except (OSError, IndexError):
            continue
    return kits


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.e2e
@pytest.mark.parametrize("script", sorted(TABLES))
def test_the_smoke_mode_prints_its_table(script: str) -> None:
    name, *extra = script.split()  # a script, and the options of one of its variants
    shown = " ".join([f"{name}.py", *extra, "--smoke"])
    if name == "fanout":
        require_namespace_hosts()  # a skip on a developer's machine without sshd; a failure under CI
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
    }
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *extra, "--smoke"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=env,
        start_new_session=True,  # its own process group: what it leaves behind is findable
    )
    try:
        output, _ = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, f"{shown} exited {proc.returncode} after {elapsed:.1f}s:\n{output}"
    lines = output.splitlines()
    for pattern in TABLES[script]:
        assert any(re.fullmatch(pattern, line) for line in lines), (
            f"{shown} printed no line matching {pattern!r}:\n{output}"
        )
    # Nothing of the run is left: no process of its session (children it forgot to reap would be
    # members), and no namespace host it made.
    deadline = time.monotonic() + 10
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _group_alive(proc.pid)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    assert not left, f"{shown} left processes of its session running"
    assert _kits_of(proc.pid) == [], f"{shown} left namespace hosts behind"
