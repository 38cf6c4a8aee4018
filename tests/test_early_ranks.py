"""Ranks started before their agent (flodl_async.host.early): adopted only when they are exactly
what the agent would start, killed otherwise, and never left behind. Real processes."""

from __future__ import annotations

import os
import re
import select
import sys

import pytest

from flodl_async.host import early

ENV = {"PATH": os.environ.get("PATH", ""), "FLODL_TEST_EARLY": "1"}
SAY_AND_WAIT = "import sys; print('up', flush=True); sys.stdin.read(); print('bye')"
KEY = ("run-early", "host-a", 0)


@pytest.fixture(autouse=True)
def _nothing_waits() -> object:
    yield
    early.discard_all()


async def test_a_rank_started_early_is_adopted_with_its_output_and_its_exit() -> None:
    argv = (sys.executable, "-c", "print('early line', flush=True); raise SystemExit(3)")
    early.start_early(KEY, argv, env=ENV, cwd=None)
    assert early.early_ranks_of("run-early", "host-a")
    popen = early.claim(KEY, argv, env=dict(ENV), cwd=None)
    assert popen is not None
    assert not early.early_ranks_of("run-early", "host-a")
    proc = await early.adopt(popen, line_limit=1 << 16)
    assert proc.stdout is not None
    assert await proc.stdout.readline() == b"early line\n"  # written before the adoption too
    assert await proc.wait() == 3
    assert proc.returncode == 3
    assert await proc.wait() == 3  # every waiter gets it


@pytest.mark.parametrize(
    ("argv", "env", "cwd"),
    [
        ((sys.executable, "-c", "pass"), ENV, None),
        ((sys.executable, "-c", SAY_AND_WAIT), {**ENV, "MASTER_PORT": "1"}, None),
        ((sys.executable, "-c", SAY_AND_WAIT), ENV, "/"),
    ],
    ids=["command line", "environment", "directory"],
)
def test_a_rank_started_early_that_differs_is_killed_and_not_claimed(
    argv: tuple[str, ...], env: dict[str, str], cwd: str | None
) -> None:
    started = (sys.executable, "-c", SAY_AND_WAIT)
    early.start_early(KEY, started, env=ENV, cwd=None)
    [waiting] = early._waiting.values()
    assert early.claim(KEY, argv, env=env, cwd=cwd) is None
    assert waiting.popen.returncode is not None  # killed and reaped: its agent starts it anew
    assert _dead(waiting.popen.pid)
    assert early.claim(KEY, started, env=ENV, cwd=None) is None  # claimed once at most


def _dead(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (an orphan waits for init)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_ranks_nobody_claimed_are_killed_with_their_group() -> None:
    forks = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    early.start_early(KEY, (sys.executable, "-c", forks), env=ENV, cwd=None)
    [waiting] = early._waiting.values()
    assert waiting.popen.stdout is not None
    child = os.pidfd_open(int(waiting.popen.stdout.readline()))  # readable once it has exited
    try:
        early.discard_all()
        assert waiting.popen.returncode is not None
        assert _dead(waiting.popen.pid)
        ready, _, _ = select.select([child], [], [], 30)
        assert ready == [child]  # what it forked went with it (the group's KILL)
    finally:
        os.close(child)


@pytest.mark.e2e
def test_a_one_host_run_adopts_the_ranks_it_started_early() -> None:
    """`flodl-launch --nproc 2`: both ranks started before the controller was built are adopted
    by its agent (none started twice), on the port the controller serves, their output intact."""
    from .launchkit import PY, new_run_id, run_launch

    done = run_launch(
        "-v", "--nproc", "2", "--devices", "cpu", "--port", "0", "--",
        PY, "-c", "import os; print('rank', os.environ['RANK'], 'port', os.environ['MASTER_PORT'])",
        run_id=new_run_id(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    adopted = re.findall(r"rank (\d) was started early: adopted", done.stderr)
    assert sorted(adopted) == ["0", "1"], done.stderr
    assert "started again" not in done.stderr, done.stderr
    served = re.search(r"status: flodl status --addr 127\.0\.0\.1:(\d+)", done.stderr)
    assert served is not None, done.stderr
    for rank in (0, 1):
        assert f"rank {rank} port {served[1]}" in done.stdout, done.stdout
