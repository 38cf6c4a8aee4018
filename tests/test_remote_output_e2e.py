"""Rank output and Ctrl-C across ssh-started agents on namespace hosts (tests/hostkit.py), end to end.

One run on two hosts covers what issues 8 and 9 promise for remote ranks: ``[host:rN]`` prefixes on
the launcher's console, partial lines and ``\\r`` progress updates shown while the rank is still
writing them, ``--log-dir`` files in torchrun's layout holding the raw bytes of every rank of every
host, and the launcher's SIGINT reaching each remote rank as SIGINT (its ``except
KeyboardInterrupt`` runs) with exit code 130. The rank script holds each step behind a gate file
the test creates only after it saw the previous step on the console, so the order is proven
without any sleep.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from .hostkit import HostKit
from .launchkit import PY, Launcher, new_run_id, script
from .test_fanout_e2e import _cluster, _python_wrapper

pytestmark = pytest.mark.e2e


def test_remote_ranks_output_progress_logs_and_ctrl_c_on_every_host(
    hostkit: HostKit, tmp_path: Path
) -> None:
    h1, h2 = hostkit.hosts[:2]
    cluster = _cluster(
        tmp_path, hostkit, [(h1, "cpu:2"), (h2, "cpu:1")], python=str(_python_wrapper(tmp_path))
    )
    gates = tmp_path / "gates"
    gates.mkdir()
    logs = tmp_path / "logs"
    run_id = new_run_id()
    launcher = Launcher(
        str(cluster),
        "--stop-grace",
        "20",
        "--log-dir",
        str(logs),
        "--",
        PY,
        script("progress_until_sigint.py"),
        str(gates),
        run_id=run_id,
    )
    try:
        launcher.wait_for_stdout("] line one r", count=3, timeout=120)
        launcher.wait_for_stdout(
            "] partial r", count=3
        )  # a partial line, shown before the rank ends it
        for k in (1, 2, 3):
            (gates / f"gate-{k}").touch()
            # Each rank blocks on the next gate: its update reached the console while the line was still open.
            launcher.wait_for_stdout(f"] prog {k}/3 r", count=3)
        (gates / "gate-4").touch()  # the bar's newline, after its last update was shown
        launcher.wait_for_stdout("] waiting for SIGINT r", count=3)
        launcher.proc.send_signal(signal.SIGINT)
        done = launcher.finish(timeout=60)  # also: every process of the run is gone
    finally:
        launcher.kill()
    assert done.returncode == 130, done.stderr
    assert "stopping: ranks got SIGINT" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    # No blank line from any host's ssh session either (asyncssh ends its line iterator with b"").
    for name, text in (("stdout", done.stdout), ("stderr", done.stderr)):
        assert "" not in text.split("\n")[:-1], f"a blank line on the launcher's {name}: {text!r}"
    # Which host got which rank: each rank names its own host; the launcher's prefix must agree.
    host_of = {
        int(r): h
        for h, r, h_again in re.findall(
            r"^\[(\w+):r(\d+)\] line one r\2 on (\w+)$", done.stdout, re.M
        )
        if h == h_again
    }
    assert sorted(host_of) == [0, 1, 2], done.stdout
    assert sorted(host_of.values()) == ["h1", "h1", "h2"], done.stdout
    for rank, host in host_of.items():
        prefix = f"[{host}:r{rank}] "
        for text in (
            f"partial r{rank}",
            *(f"prog {k}/3 r{rank}" for k in (1, 2, 3)),
            f"saved on SIGINT r{rank}",
        ):
            assert f"\n{prefix}{text}\n" in done.stdout, (text, done.stdout)
        assert done.stdout.count(f"{prefix}prog 3/3 r{rank}\n") == 1, (
            done.stdout
        )  # the finished bar once, not twice
        assert f"{prefix}err line r{rank}\n" in done.stderr, done.stderr
        # torchrun's layout, for the remote hosts too: the raw bytes, \r and all, without prefixes.
        attempt = logs / run_id / "attempt_0" / str(rank)
        assert (attempt / "stdout.log").read_bytes() == (
            f"line one r{rank} on {host}\npartial r{rank}\rprog 1/3 r{rank}\rprog 2/3 r{rank}\rprog 3/3 r{rank}\n"
            f"waiting for SIGINT r{rank}\nsaved on SIGINT r{rank}\n"
        ).encode()
        assert (attempt / "stderr.log").read_bytes() == f"err line r{rank}\n".encode()
    assert sorted(p.name for p in (logs / run_id / "attempt_0").iterdir()) == ["0", "1", "2"]
    assert hostkit.leftovers() == {}
