"""flodl-agent end to end: signals by the table, exit codes, and nothing left on disk after a run."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from flodl_async.host.runtime import MARKER

from .launchkit import (
    PY,
    Launcher,
    assert_nothing_left,
    free_port,
    new_run_id,
    reap,
    run_launch,
    script,
    wait_status,
)

pytestmark = pytest.mark.e2e


def _run_dir(xdg: Path, run_id: str) -> Path:
    return xdg / "flodl" / "runs" / run_id


def test_sigterm_to_flodl_agent_stops_its_ranks_with_sigterm_and_exits_143(
    tmp_path: Path, xdg: Path
) -> None:
    port = free_port()
    run_id = new_run_id()
    secret_file = tmp_path / "secret"
    record = tmp_path / "signals"
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"controller:\n  port: {port}\n  join: {{min_rank_start: 2, target_ranks: 2, join_timeout: 60}}\nworkers:\n  - host: localhost\n    devices: cpu:1\n"
    )
    env = {"XDG_RUNTIME_DIR": str(xdg)}
    launcher = Launcher(
        str(cluster),
        "--secret-file",
        str(secret_file),
        "--stop-grace",
        "5",
        "--",
        PY,
        script("record_signals.py"),
        str(record),
        "exit",
        run_id=run_id,
        env=env,
    )
    agent = None
    try:
        wait_status(
            port, lambda doc: doc["joined_ranks"] == 1
        )  # the window is open, the local host is in
        agent_cmd = [
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
            "5",
        ]
        agent = subprocess.Popen(
            [*agent_cmd, "--secret-file", str(secret_file)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        launcher.wait_for_stdout(
            "ready pid", count=2
        )  # the walk-in's rank's line crossed its join link
        assert any(line.startswith("[walk-in:r1] ready pid") for line in launcher.stdout_lines)
        assert (_run_dir(xdg, run_id) / "walk-in" / MARKER).exists()
        agent.send_signal(signal.SIGTERM)
        agent_out, agent_err = agent.communicate(timeout=30)
        done = launcher.finish(timeout=60)
    finally:
        launcher.kill()
        reap(agent)
        assert_nothing_left(run_id)
    assert agent.returncode == 143, agent_err
    assert "[walk-in:r1] got SIGTERM" in done.stdout
    assert "[walk-in:" not in agent_out  # rank output goes to the launcher, not the agent's stdout
    assert (
        "1 SIGTERM" in record.read_text().splitlines()
    )  # the rank got the agent's own signal first
    assert "stopped: stopped by SIGTERM" in agent_err
    assert "Traceback" not in agent_err
    assert done.returncode == 4, done.stderr  # the run lost a rank (143) on walk-in
    assert "on host 'walk-in'" in done.stderr
    assert not _run_dir(xdg, run_id).exists()


def test_no_runtime_directory_of_a_run_remains(tmp_path: Path, xdg: Path) -> None:
    env = {"XDG_RUNTIME_DIR": str(xdg)}
    ok_id, failed_id, killed_id = new_run_id(), new_run_id(), new_run_id()

    done = run_launch(
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--",
        PY,
        script("dump_env.py"),
        str(tmp_path),
        run_id=ok_id,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    error_file = Path(
        (tmp_path / "env-0.json").read_text().split('"TORCHELASTIC_ERROR_FILE": "')[1].split('"')[0]
    )
    assert error_file.is_relative_to(
        _run_dir(xdg, ok_id)
    )  # the scratch lived in the runtime directory
    assert not _run_dir(xdg, ok_id).exists()

    done = run_launch(
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--stop-grace",
        "3",
        "--",
        PY,
        script("fail.py"),
        run_id=failed_id,
        env=env,
    )
    assert done.returncode == 4, done.stderr
    assert not _run_dir(xdg, failed_id).exists()

    never = str(tmp_path / "never")
    launcher = Launcher(
        "--nproc",
        "1",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--",
        PY,
        script("wait_for_file.py"),
        never,
        run_id=killed_id,
        env=env,
    )
    try:
        launcher.wait_for_stdout("ready pid", count=1)
        launcher.proc.kill()  # SIGKILL: no cleanup possible
        launcher.proc.wait(10)
        assert_nothing_left(killed_id)
    finally:
        launcher.kill()
    assert (
        _run_dir(xdg, killed_id) / os.uname().nodename / MARKER
    ).exists()  # left behind by a dead owner
    done = run_launch(
        "--nproc",
        "1",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--",
        PY,
        "-c",
        "pass",
        run_id=new_run_id(),
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert not _run_dir(xdg, killed_id).exists()  # the next session swept it
    assert list((xdg / "flodl" / "runs").iterdir()) == []


def test_flodl_agent_help_documents_its_exit_codes() -> None:
    done = subprocess.run(
        [PY, "-m", "flodl_async.agent", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    for line in (
        "--stop-grace",
        "3    could not join",
        "4    the run failed",
        "143  stopped by SIGTERM",
        "130  stopped by SIGINT",
    ):
        assert line in done.stdout


# ----- the controller is killed under a stand-alone agent ---------------------------------------------


def _kill_target_cluster(tmp_path: Path, port: int, ranks: int) -> Path:
    """One local rank in the launcher; the window waits for ``ranks`` in all, so a walk-in either completes it or waits."""
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"controller:\n  port: {port}\n  join: {{min_rank_start: {ranks}, target_ranks: {ranks}, join_timeout: 60}}\n"
        "workers:\n  - host: localhost\n    devices: cpu:1\n"
    )
    return cluster


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("stdout_reader", ["stays", "dies with the controller"])
def test_a_controller_killed_mid_run_is_one_line_from_flodl_agent_and_its_ranks_are_gone(
    tmp_path: Path, xdg: Path, stdout_reader: str
) -> None:
    """SIGKILL of flodl-launch while a walk-in serves: exit 4, one line naming host, controller and cause.

    "dies with the controller": whoever read the agent's output went away with the controller
    (an ssh session of a fan-out, a supervisor piping it); the ranks' output goes up the join
    link, so their last lines (``got SIGTERM``) meet no broken pipe of the agent's own.
    """
    port = free_port()
    run_id = new_run_id()
    secret_file = tmp_path / "secret"
    env = {"XDG_RUNTIME_DIR": str(xdg)}
    cluster = _kill_target_cluster(tmp_path, port, 2)
    launcher = Launcher(
        str(cluster),
        "--secret-file",
        str(secret_file),
        "--",
        PY,
        script("record_signals.py"),
        str(tmp_path / "record"),
        "exit",
        run_id=run_id,
        env=env,
    )
    agent = None
    try:
        wait_status(port, lambda doc: doc["joined_ranks"] == 1)
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
                "--secret-file",
                str(secret_file),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        assert agent.stdout is not None
        assert agent.stderr is not None
        launcher.wait_for_stdout(
            "[walk-in:r1] ready pid"
        )  # rank output crosses the join link to the launcher
        ready = next(
            line for line in launcher.stdout_lines if line.startswith("[walk-in:r1] ready pid")
        )
        rank_pid = int(ready.rsplit(" ", 1)[1])
        if stdout_reader != "stays":
            agent.stdout.close()
        launcher.proc.kill()  # SIGKILL: no Abort, no goodbye; the join link just ends
        launcher.proc.wait(10)
        agent_err = agent.stderr.read()
        agent.wait(30)
    finally:
        launcher.kill()
        if agent is not None:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
            for stream in (agent.stdout, agent.stderr):
                if stream is not None:
                    stream.close()
        assert_nothing_left(run_id)
    assert not _pid_alive(rank_pid), "the walk-in's rank outlived its agent"
    assert agent.returncode == 4, agent_err  # the run failed: the controller was lost
    assert "Traceback" not in agent_err
    assert "ExceptionGroup" not in agent_err
    lost = [
        line for line in agent_err.splitlines() if "walk-in" in line and f"127.0.0.1:{port}" in line
    ]
    assert len(lost) == 1, agent_err
    assert "lost the join link to the controller" in lost[0]
    assert "the peer closed the connection" in lost[0]
    assert agent_err.splitlines()[-1] == lost[0]
    # That one line, nothing else: rank output goes up the link, so a dead stdout reader has nothing to break.
    assert agent_err.strip() == lost[0], agent_err
    assert not (
        _run_dir(xdg, run_id) / "walk-in"
    ).exists()  # its own entry (the killed launcher's stays, for the next sweep)


def test_a_controller_killed_while_flodl_agent_waits_in_the_join_window_is_one_line(
    tmp_path: Path, xdg: Path
) -> None:
    port = free_port()
    run_id = new_run_id()
    secret_file = tmp_path / "secret"
    env = {"XDG_RUNTIME_DIR": str(xdg)}
    cluster = _kill_target_cluster(
        tmp_path, port, 3
    )  # the walk-in's rank is the 2nd of 3: the window stays open
    launcher = Launcher(
        str(cluster),
        "--secret-file",
        str(secret_file),
        "--",
        PY,
        script("wait_for_file.py"),
        str(tmp_path / "never"),
        run_id=run_id,
        env=env,
    )
    agent = None
    try:
        wait_status(port, lambda doc: doc["joined_ranks"] == 1)
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
                "--secret-file",
                str(secret_file),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        wait_status(port, lambda doc: doc["joined_ranks"] == 2)
        launcher.proc.kill()
        launcher.proc.wait(10)
        agent_out, agent_err = agent.communicate(timeout=30)
    finally:
        launcher.kill()
        reap(agent)
        assert_nothing_left(run_id)
    assert agent.returncode == 3, agent_err  # could not join: the world did not form
    assert agent_out == ""
    assert "Traceback" not in agent_err
    line = agent_err.strip()
    assert len(line.splitlines()) == 1, agent_err
    assert "walk-in" in line
    assert f"127.0.0.1:{port}" in line
    assert "the controller closed the join link while waiting for the world to form" in line
    assert not (
        _run_dir(xdg, run_id) / "walk-in"
    ).exists()  # its own entry (the killed launcher's stays, for the next sweep)
