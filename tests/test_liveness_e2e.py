"""Liveness on the join link, end to end: a frozen agent or a frozen launcher is noticed by the other side.

SIGSTOP is a frozen host (or a pulled cable): the TCP link stays open and silent, so only the
heartbeat deadline can tell. The deadlines are scaled down (FLODL_NET_TIMEOUT_SCALE) so each test
takes seconds; nothing below asserts a duration, only outcomes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from flodl_async.deadlines import Deadlines

from .launchkit import (
    PY,
    Launcher,
    assert_nothing_left,
    free_port,
    new_run_id,
    run_launch,
    script,
    wait_status,
)

pytestmark = pytest.mark.e2e

#: Silence deadline 5 s (interval 1 s) at the machine's own scale 1; a loaded machine's scale multiplies it.
SCALE = 0.5 * float(os.environ.get("FLODL_NET_TIMEOUT_SCALE", "1") or "1")
SILENCE = Deadlines.resolve(env={"FLODL_NET_TIMEOUT_SCALE": str(SCALE)}).heartbeat_silence


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _walk_in_run(
    tmp_path: Path, xdg: Path, run_id: str
) -> tuple[Launcher, subprocess.Popen[str], int]:
    """A launcher (one local rank) and a stand-alone agent ``walk-in`` (one rank) completing its world; both ranks run until stopped."""
    port = free_port()
    secret_file = tmp_path / "secret"
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"controller:\n  port: {port}\n  join: {{min_rank_start: 2, target_ranks: 2, join_timeout: 60}}\nworkers:\n  - host: localhost\n    devices: cpu:1\n"
    )
    env = {"XDG_RUNTIME_DIR": str(xdg), "FLODL_NET_TIMEOUT_SCALE": str(SCALE)}
    rank = (PY, script("record_signals.py"), str(tmp_path / "record"))
    launcher = Launcher(
        str(cluster),
        "--secret-file",
        str(secret_file),
        "--stop-grace",
        "2",
        "--",
        *rank,
        run_id=run_id,
        env=env,
    )
    wait_status(port, lambda doc: doc["joined_ranks"] == 1)
    secret = ("--secret-file", str(secret_file))
    agent = subprocess.Popen(
        [
            PY,
            "-m",
            "flodl_async.agent",
            "--controller",
            f"127.0.0.1:{port}",
            "--host",
            "walk-in",
            "--devices",
            "cpu:1",
            "--stop-grace",
            "2",
            *secret,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    launcher.wait_for_stdout("ready pid", count=2)  # the walk-in's line crossed its join link
    ready = next(
        line for line in launcher.stdout_lines if line.startswith("[walk-in:r1] ready pid")
    )
    return launcher, agent, int(ready.rsplit(" ", 1)[1])


def _reap(launcher: Launcher | None, agent: subprocess.Popen[str] | None) -> None:
    for proc in (launcher.proc if launcher is not None else None, agent):
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a stopped process cannot die of KILL until it runs
            proc.kill()
            proc.communicate()


def test_a_frozen_agent_is_lost_by_name_and_after_sigcont_it_stops_its_ranks(
    tmp_path: Path, xdg: Path
) -> None:
    run_id = new_run_id()
    launcher = agent = None
    try:
        launcher, agent, rank_pid = _walk_in_run(tmp_path, xdg, run_id)
        os.kill(agent.pid, signal.SIGSTOP)  # a frozen host: its link stays open and says nothing
        frozen_at = time.monotonic()
        _out, err = launcher.proc.communicate(timeout=60 + 4 * SILENCE)
        took = time.monotonic() - frozen_at
        # Within the deadline (the silence, a 2 s stop grace, a loaded machine's slack): an open, silent link never times out by itself.
        assert took < SILENCE + 2 + 20, (
            f"the verdict came {took:.1f}s after the freeze (silence {SILENCE:g}s)"
        )
        assert launcher.proc.returncode == 4, err
        assert f"agent on host 'walk-in' was lost mid-run: no heartbeat for {SILENCE:g}s" in err, (
            err
        )
        assert _pid_alive(rank_pid)  # the frozen host's rank cannot know yet
        os.kill(agent.pid, signal.SIGCONT)
        agent_out, agent_err = agent.communicate(timeout=60)
    finally:
        _reap(launcher, agent)
        assert_nothing_left(run_id)
    assert not _pid_alive(rank_pid)
    assert agent.returncode == 4, agent_err
    assert "Traceback" not in agent_err
    lines = agent_err.strip().splitlines()
    assert len(lines) == 1, agent_err
    assert "agent walk-in" in lines[0], lines[0]
    assert "stopping this host's ranks" in lines[0], lines[0]
    assert (
        "1 SIGTERM" in (tmp_path / "record").read_text().splitlines()
    )  # its last line went up a link nobody read
    assert (
        "[walk-in:" not in agent_out
    )  # rank output goes to the launcher, never the agent's stdout


def test_a_frozen_launcher_makes_the_agent_stop_its_ranks_by_itself(
    tmp_path: Path, xdg: Path
) -> None:
    run_id = new_run_id()
    launcher = agent = None
    try:
        launcher, agent, rank_pid = _walk_in_run(tmp_path, xdg, run_id)
        os.kill(launcher.proc.pid, signal.SIGSTOP)  # the controller's host freezes
        frozen_at = time.monotonic()
        agent_out, agent_err = agent.communicate(timeout=60 + 4 * SILENCE)
        took = time.monotonic() - frozen_at
        assert took < SILENCE + 2 + 20, (
            f"the agent stopped {took:.1f}s after the freeze (silence {SILENCE:g}s)"
        )
        assert not _pid_alive(rank_pid)  # stopped by its agent while the launcher is still frozen
        os.kill(launcher.proc.pid, signal.SIGCONT)
        _out, err = launcher.proc.communicate(timeout=60)
    finally:
        _reap(launcher, agent)
        assert_nothing_left(run_id)
    assert agent.returncode == 4, (
        agent_err
    )  # the exit table: the run failed (its controller was lost)
    assert "Traceback" not in agent_err
    lines = agent_err.strip().splitlines()
    assert len(lines) == 1, agent_err
    # the join link and the relay's upstream link watch the same silence with the same deadline:
    # whichever notices first names it
    assert (
        f"sent nothing for {SILENCE:g}s" in lines[0]
        or f"upstream control link to the controller was silent for {SILENCE:g}s" in lines[0]
    ), lines[0]
    assert "agent walk-in" in lines[0], lines[0]
    assert (
        "1 SIGTERM" in (tmp_path / "record").read_text().splitlines()
    )  # its last line went up a link nobody read
    assert (
        "[walk-in:" not in agent_out
    )  # rank output goes to the launcher, never the agent's stdout
    assert launcher.proc.returncode == 4, err
    # Resumed, the launcher reads what the agent left in its socket (the rank's exit, then the close): the verdict names the host.
    assert "on host 'walk-in'" in err, err
    assert "on host 'localhost'" not in err, (
        err
    )  # its own agent was frozen with it, not silent: excused


def test_a_run_longer_than_the_silence_deadline_is_unaffected_by_heartbeats(xdg: Path) -> None:
    """Two in-process ranks sleep past several silence deadlines: the run succeeds and no heartbeat is mentioned."""
    env = {"XDG_RUNTIME_DIR": str(xdg), "FLODL_NET_TIMEOUT_SCALE": str(SCALE / 2)}
    done = run_launch(
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--",
        PY,
        "-c",
        f"import time; time.sleep({SILENCE:g})",
        run_id=new_run_id(),
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "heartbeat" not in done.stderr
