"""A host given more CPU ranks than its cores is warned about on the launcher's console, whichever host it is.

The controller's own host is checked by ``flodl-launch`` before anything starts; every other host is
checked at its join, from the core count its agent reports (:mod:`flodl_async.host.cores`). Here a walk-in
agent on this machine brings one CPU rank more than this machine's cores.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from .launchkit import PY, Launcher, assert_nothing_left, free_port, new_run_id, reap, wait_status

pytestmark = pytest.mark.e2e


def _cluster(tmp_path: Path, port: int, ranks: int) -> Path:
    """One local CPU rank (fits any machine); the join waits for the walk-in's ``ranks``."""
    cluster = tmp_path / "cluster.yml"
    knobs = f"min_rank_start: {1 + ranks}, target_ranks: {1 + ranks}, join_timeout: 60"
    cluster.write_text(
        f"controller:\n  port: {port}\n  join: {{{knobs}}}\nworkers:\n  - host: localhost\n    devices: cpu:1\n"
    )
    return cluster


def _walk_in(port: int, secret_file: Path, devices: str) -> subprocess.Popen[str]:
    cmd = [
        PY,
        "-m",
        "flodl_async.agent",
        "--controller",
        f"127.0.0.1:{port}",
        "--secret-file",
        str(secret_file),
        "--host",
        "walk-in",
        "--devices",
        devices,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_walk_in_with_more_cpu_ranks_than_its_cores_is_warned_about_on_the_launchers_console(
    tmp_path: Path,
) -> None:
    cores = len(os.sched_getaffinity(0))  # the walk-in runs here: its cores are this process's
    port, run_id = free_port(), new_run_id()
    secret_file = tmp_path / "secret"
    launcher = Launcher(
        str(_cluster(tmp_path, port, cores + 1)),
        "--secret-file",
        str(secret_file),
        "--",
        PY,
        "-c",
        "pass",
        run_id=run_id,
    )
    agent = None
    try:
        wait_status(
            port, lambda d: d["joined_ranks"] == 1
        )  # the local host is in, and the secret file written
        agent = _walk_in(port, secret_file, f"cpu:{cores + 1}")
        done = launcher.finish(timeout=120)
        _out, agent_err = agent.communicate(timeout=60)
    finally:
        launcher.kill()
        reap(agent)
        assert_nothing_left(run_id)
    assert done.returncode == 0, done.stderr
    assert agent.returncode == 0, agent_err
    warning = f"warning: {cores + 1} CPU ranks on host 'walk-in', which has {cores} core(s) for them: they will compete for the cores"
    assert done.stderr.count(warning) == 1, done.stderr  # on the launcher's console, once
    assert "CPU ranks on host 'localhost'" not in done.stderr  # its one rank fits


def test_a_walk_in_whose_ranks_fit_its_cores_gets_no_warning(tmp_path: Path) -> None:
    port, run_id = free_port(), new_run_id()
    secret_file = tmp_path / "secret"
    launcher = Launcher(
        str(_cluster(tmp_path, port, 1)),
        "--secret-file",
        str(secret_file),
        "--",
        PY,
        "-c",
        "pass",
        run_id=run_id,
    )
    agent = None
    try:
        wait_status(port, lambda d: d["joined_ranks"] == 1)
        agent = _walk_in(port, secret_file, "cpu:1")
        done = launcher.finish(timeout=120)
        agent.communicate(timeout=60)
    finally:
        launcher.kill()
        reap(agent)
        assert_nothing_left(run_id)
    assert done.returncode == 0, done.stderr
    assert 'host "walk-in" joined with ranks 1' in done.stderr  # it did join, and was judged
    assert "compete for the cores" not in done.stderr
