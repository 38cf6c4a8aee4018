"""The store on the controller's port, end to end: real flodl-launch, real ranks, real gloo."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from .launchkit import PY, Launcher, free_port, new_run_id, run_launch, script

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        sys.platform != "linux", reason="needs Linux: listening sockets are read from /proc"
    ),
]


def listening_ports(pid: int) -> set[int]:
    """TCP ports ``pid`` listens on: its socket inodes matched against /proc/<pid>/net/tcp{,6}."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed while we looked
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_during_a_run_the_controller_listens_on_its_one_port_and_ranks_rendezvous_through_it(
    tmp_path: Path,
) -> None:
    run_id, port = new_run_id(), free_port()
    release = tmp_path / "release"
    args = (
        "-v",
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        str(port),
    )  # -v: the round's line says where the store is
    launcher = Launcher(*args, "--", PY, script("store_round.py"), str(release), run_id=run_id)
    try:
        launcher.wait_for_stdout(
            " sum 2", count=2
        )  # both ranks met through the store and all-reduced
        assert listening_ports(launcher.proc.pid) == {port}
        release.touch()
        done = launcher.finish(timeout=60)
    finally:
        launcher.kill()
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"attempt 0 rank {rank} store 127.0.0.1:{port} leftover False" in done.stdout, (
            done.stdout
        )
    assert "store at the controller port" in done.stderr


def test_a_restart_starts_from_an_empty_store() -> None:
    run_id = new_run_id()
    done = run_launch(
        "--nproc", "2", "--devices", "cpu", "--port", "0", "--max-restarts", "1", "--stop-grace", "5", "--",
        PY, script("store_round.py"), "--fail-once",
        run_id=run_id,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "restarting the world (restart 1 of 1)" in done.stderr
    for rank in (0, 1):
        assert re.search(
            rf"r{rank}\] attempt 1 rank {rank} store 127\.0\.0\.1:\d+ leftover False$",
            done.stdout,
            re.M,
        ), done.stdout
        assert re.search(rf"r{rank}\] attempt 1 rank {rank} sum 2$", done.stdout, re.M), done.stdout
