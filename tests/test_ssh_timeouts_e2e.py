"""ssh fan-out paths that end in a deadline, on namespace hosts: connect and hello timeouts, the stop deadline, a forced stop.

Timeouts here are the real deadlines scaled down with ``FLODL_NET_TIMEOUT_SCALE`` (``ssh_connect``
15 s x 0.2 = 3 s), and each failure must name the host and the cause and fail the window
(exit 3) before the world forms. The stop paths run ranks that ignore SIGTERM on a remote host:
they must be KILLed (at the stop grace, or at once on a second signal), and nothing of ours may
be left on any host (the ``hostkit`` fixture checks every host after each test).
"""

from __future__ import annotations

import json
import signal
import socket
import stat
import sys
from pathlib import Path

import pytest

from .hostkit import HostKit
from .launchkit import PY, Launcher, free_port, new_run_id, run_launch, script

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
SCALE = {"FLODL_NET_TIMEOUT_SCALE": "0.2"}


def _wrapper(tmp_path: Path, body: str, name: str = "python3") -> Path:
    wrapper = tmp_path / name
    wrapper.write_text(f"#!/bin/sh\n{body}\n")
    wrapper.chmod(stat.S_IRWXU)
    return wrapper


def _cluster(tmp_path: Path, kit: HostKit, workers: list[tuple[str, str, int, Path]]) -> Path:
    lines = [
        f"controller: {{host: 0.0.0.0, port: {free_port()}, join: {{join_timeout: 60}}}}",
        "workers:",
    ]
    for name, target, port, python in workers:
        ssh = {
            "target": target,
            "port": port,
            "user": "root",
            "identity_file": str(kit.user_key),
            "known_hosts": str(kit.known_hosts),
        }
        lines += [
            f"  - host: {name}",
            "    devices: cpu:1",
            f"    python: {python}",
            f"    ssh: {json.dumps(ssh)}",
        ]
    cluster = tmp_path / "cluster.yml"
    cluster.write_text("\n".join(lines) + "\n")
    return cluster


def _agent_python(tmp_path: Path) -> Path:
    return _wrapper(
        tmp_path, f'export PYTHONPATH={REPO}\nexec {sys.executable} "$@"', name="agent-python"
    )


def test_an_ssh_server_that_never_sends_its_banner_times_out_naming_the_host(
    hostkit: HostKit, tmp_path: Path
) -> None:
    with socket.socket() as silent:  # accepts at the TCP level (backlog), never says a word of ssh
        silent.bind((hostkit.controller_addr, 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        h1 = hostkit.hosts[0]
        python = _agent_python(tmp_path)
        cluster = _cluster(
            tmp_path,
            hostkit,
            [(h1.name, h1.addr, 22, python), ("mute", hostkit.controller_addr, port, python)],
        )
        done = run_launch(
            str(cluster), "--", PY, "-c", "pass", run_id=new_run_id(), env=SCALE, timeout=120
        )
    assert done.returncode == 3, done.stderr
    assert f"ssh to {hostkit.controller_addr}:{port} did not connect within 3s" in done.stderr, (
        done.stderr
    )
    assert "mute" in done.stderr.splitlines()[-1], done.stderr  # the verdict names the host
    assert "world formed" not in done.stderr
    assert "Traceback" not in done.stderr


def test_an_agent_that_never_says_hello_times_out_and_is_not_left_running(
    hostkit: HostKit, tmp_path: Path
) -> None:
    h1 = hostkit.hosts[0]
    stuck = _wrapper(tmp_path, "exec sleep 600")  # `python` that starts and never prints the hello
    cluster = _cluster(tmp_path, hostkit, [(h1.name, h1.addr, 22, stuck)])
    done = run_launch(
        str(cluster), "--", PY, "-c", "pass", run_id=new_run_id(), env=SCALE, timeout=120
    )
    assert done.returncode == 3, done.stderr
    assert f"the agent on {h1.addr}:22 said nothing within 3s" in done.stderr, done.stderr
    assert h1.name in done.stderr.splitlines()[-1], done.stderr
    assert "world formed" not in done.stderr
    assert hostkit.leftovers() == {}  # the stuck `python` went with its session


def _running_ignoring_term(tmp_path: Path, kit: HostKit, grace: str) -> tuple[Launcher, Path]:
    h1, h2 = kit.hosts[:2]
    python = _agent_python(tmp_path)
    cluster = _cluster(
        tmp_path, kit, [(h1.name, h1.addr, 22, python), (h2.name, h2.addr, 22, python)]
    )
    record = tmp_path / "signals"
    launcher = Launcher(
        str(cluster),
        "--stop-grace",
        grace,
        "--",
        PY,
        script("record_signals.py"),
        str(record),
        "ignore",
        run_id=new_run_id(),
    )
    try:
        launcher.wait_for_stdout("ready pid", count=2, timeout=120)
    except BaseException:
        launcher.kill()
        raise
    return launcher, record


def test_remote_ranks_that_ignore_term_are_killed_at_the_stop_grace(
    hostkit: HostKit, tmp_path: Path
) -> None:
    launcher, record = _running_ignoring_term(tmp_path, hostkit, grace="2")
    try:
        launcher.proc.send_signal(signal.SIGTERM)
        launcher.wait_for_stdout(
            "got SIGTERM", count=2
        )  # both remote ranks got TERM first, and ignored it
        done = launcher.finish(timeout=120)
    finally:
        launcher.kill()
    assert done.returncode == 143, done.stderr
    assert sorted(record.read_text().split()) == sorted(["0", "1", "SIGTERM", "SIGTERM"])
    assert hostkit.leftovers() == {}  # KILLed at the grace: nothing left on either host


def test_a_second_signal_force_stops_remote_ranks_that_ignore_term(
    hostkit: HostKit, tmp_path: Path
) -> None:
    launcher, _ = _running_ignoring_term(
        tmp_path, hostkit, grace="600"
    )  # only the forced stop can end them in time
    try:
        launcher.proc.send_signal(signal.SIGTERM)
        launcher.wait_for_stdout("got SIGTERM", count=2)
        launcher.proc.send_signal(
            signal.SIGTERM
        )  # the second signal: force_stop, KILL now, on every host
        done = launcher.finish(timeout=120)
    finally:
        launcher.kill()
    assert done.returncode != 0, done.stderr
    assert "Traceback" not in done.stderr
    assert hostkit.leftovers() == {}
