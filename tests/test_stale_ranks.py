"""Stale runs: what the ranks of a SIGKILLed agent forked is killed by the next agent on the host, by process group, nothing else."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flodl_async.host.runtime import (
    RANKS_DIR,
    RankMarker,
    create_entry,
    group_members,
    reap_stale_ranks,
    remove_rank_marker,
    write_rank_marker,
)

from .launchkit import (
    PY,
    Launcher,
    assert_nothing_left,
    free_port,
    new_run_id,
    reap,
    script,
    wait_status,
)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="process groups are read from /proc"
)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(path: Path, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return path.read_text()


def test_a_rank_marker_names_its_group_while_it_lives_and_is_gone_when_removed(
    tmp_path: Path,
) -> None:
    entry = create_entry(run_id="r1", host="h", controller="10.0.0.1:1337", root=tmp_path / "root")
    proc = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        write_rank_marker(entry.path, pid=proc.pid, rank=3)
        marker = RankMarker.read(entry.path / RANKS_DIR / f"{proc.pid}.json")
        assert marker is not None
        assert (marker.pgid, marker.rank, marker.run_id, marker.controller) == (
            proc.pid,
            3,
            "r1",
            "10.0.0.1:1337",
        )
        assert group_members(marker) == (proc.pid,)
        assert (
            reap_stale_ranks(tmp_path / "root") == ()
        )  # its owner (this process) is alive: not stale
        remove_rank_marker(entry.path, proc.pid)
        assert list((entry.path / RANKS_DIR).iterdir()) == []
    finally:
        proc.kill()
        proc.wait()
        entry.remove()


@pytest.mark.e2e
def test_the_next_agent_kills_what_a_sigkilled_agents_rank_forked_and_nothing_else(
    tmp_path: Path, xdg: Path
) -> None:
    port = free_port()
    run_id = new_run_id()
    secret_file = tmp_path / "secret"
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"controller:\n  port: {port}\n  join: {{min_rank_start: 2, target_ranks: 2, join_timeout: 60}}\nworkers:\n  - host: localhost\n    devices: cpu:1\n"
    )
    env = {"XDG_RUNTIME_DIR": str(xdg)}
    # The launcher's own rank just waits; the walk-in's rank forks the survivor.
    rank = (PY, script("fork_survivor.py"), str(tmp_path / "child-{rank}"))
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
    agent = decoy = None
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
        launcher.wait_for_stdout(
            "[walk-in:r1] ready pid"
        )  # the walk-in's rank output crosses its join link
        ready = next(
            line for line in launcher.stdout_lines if line.startswith("[walk-in:r1] ready pid")
        )
        rank_pid = int(ready.rsplit(" ", 1)[1])
        walk_in_child = int(_wait_for(tmp_path / "child-1"))
        # A decoy: the same command line, not of the run (no marker names its group).
        decoy = subprocess.Popen(
            [PY, script("fork_survivor.py"), str(tmp_path / "decoy-pid")],
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        decoy_child = int(_wait_for(tmp_path / "decoy-pid"))
        agent.kill()  # SIGKILL: no cleanup; the rank dies of its parent-death signal, its child does not
        agent.communicate(timeout=30)
        _out, err = launcher.proc.communicate(timeout=90)
        assert launcher.proc.returncode == 4, err  # the walk-in was lost mid-run
        deadline = time.monotonic() + 30
        while _alive(rank_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(rank_pid)
        assert _alive(walk_in_child), (
            "nothing survived the SIGKILLed agent: the test proves nothing"
        )
        secret = (
            "--secret-file",
            str(secret_file),
            "--connect-timeout",
            "0",
        )  # one dial: nobody will ever answer there
        nobody = (
            free_port()
        )  # the new agent has no controller to reach: it cleans up, then says it cannot join
        again = subprocess.run(
            [
                PY,
                "-m",
                "flodl_async.agent",
                "--controller",
                f"127.0.0.1:{nobody}",
                "--host",
                "walk-in",
                "--devices",
                "cpu:1",
                *secret,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **env},
            check=False,
        )
        deadline = time.monotonic() + 10
        while _alive(walk_in_child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(walk_in_child), "the stale child survived the next agent"
        assert _alive(decoy.pid)
        assert _alive(decoy_child)
    finally:
        launcher.kill()
        reap(agent)
        if decoy is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(decoy.pid, signal.SIGKILL)
            decoy.wait()
        assert_nothing_left(run_id)
    cleaned = [line for line in again.stderr.splitlines() if "cleaned up" in line]
    assert len(cleaned) == 1, again.stderr
    assert f"cleaned up 1 process of run {run_id} on host 'walk-in'" in cleaned[0]
    assert f"pids [{walk_in_child}]" in cleaned[0]
    assert f"controller 127.0.0.1:{port}" in cleaned[0]
    assert "Traceback" not in again.stderr


def test_reaping_kills_the_groups_of_a_dead_owner_only_and_no_process_outside_them(
    tmp_path: Path,
) -> None:
    """A dead owner's marker: its rank's group (leader and forked child) is killed; a decoy of the same command line is not."""
    root = tmp_path / "root"
    entry = create_entry(run_id="r1", host="h", controller="10.0.0.1:1337", root=root)
    rank = subprocess.Popen(
        [PY, script("fork_survivor.py"), str(tmp_path / "rank-child")],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    decoy = subprocess.Popen(
        [PY, script("fork_survivor.py"), str(tmp_path / "decoy-child")],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    gone = subprocess.run(
        [PY, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    try:
        rank_child, decoy_child = (
            int(_wait_for(tmp_path / "rank-child")),
            int(_wait_for(tmp_path / "decoy-child")),
        )
        write_rank_marker(entry.path, pid=rank.pid, rank=0)
        # The owner is now a process that has exited: the entry is a dead session's.
        owner = (
            (entry.path / "owner.json")
            .read_text()
            .replace(f'"pid": {os.getpid()}', f'"pid": {int(gone.stdout)}')
        )
        (entry.path / "owner.json").write_text(owner)
        cleaned = reap_stale_ranks(root)
        assert len(cleaned) == 1
        assert cleaned[0].pids == tuple(sorted((rank.pid, rank_child)))
        assert (
            cleaned[0]
            .describe()
            .startswith(
                "cleaned up 2 processes of run r1 on host 'h' (their agent is gone; controller 10.0.0.1:1337)"
            )
        )
        rank.wait(10)
        deadline = time.monotonic() + 10
        while _alive(rank_child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(rank_child)
        assert _alive(decoy.pid)
        assert _alive(decoy_child)
        assert reap_stale_ranks(root) == ()  # nothing left to kill: a second look changes nothing
    finally:
        for proc in (rank, decoy):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        entry.remove()
