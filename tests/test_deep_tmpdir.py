"""A TMPDIR or XDG_RUNTIME_DIR too deep for unix socket paths (a cluster's scratch path, pytest's
own temp directories once its counter is long): runs still work, in a short private directory every
process of the run agrees on, and an agent that fails says why in the launcher's verdict."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from flodl_async.errors import RuntimeDirError
from flodl_async.host import runtime
from tests.launchkit import PY, Launcher, new_run_id, run_launch, script

pytestmark = pytest.mark.e2e


@pytest.fixture
def deep() -> Iterator[Path]:
    """A private directory deeper than the socket path limit allows a runtime root to be."""
    base = Path(tempfile.mkdtemp(prefix="fl-deep-", dir="/tmp"))
    path = base / ("d" * 50) / ("e" * 50)
    path.mkdir(mode=0o700, parents=True)
    assert runtime.shortest_socket_path(path / "flodl") > runtime.UNIX_PATH_MAX
    yield path
    shutil.rmtree(base, ignore_errors=True)


def deep_env(deep: Path) -> dict[str, str]:
    return {"TMPDIR": str(deep), "XDG_RUNTIME_DIR": str(deep)}


def left_of_run(run_id: str) -> list[str]:
    """What the run left in any root it could have used: its entries, its controller's record."""
    left: list[str] = []
    for root in runtime.short_roots(os.getuid()):
        if (root / "runs" / run_id).exists():
            left.append(str(root / "runs" / run_id))
        for record in (
            (root / "controllers").glob("*.json") if (root / "controllers").is_dir() else ()
        ):
            if run_id in record.read_text(errors="replace"):
                left.append(str(record))
    return left


DUMP_ERROR_FILE = (
    "import os; print('error file', os.environ['TORCHELASTIC_ERROR_FILE'], flush=True)"
)


def test_a_launch_under_a_deep_tmpdir_succeeds_in_a_short_root_and_leaves_nothing(
    deep: Path,
) -> None:
    run_id = new_run_id()
    done = run_launch(
        "--nproc", "1", "--devices", "cpu", "--port", "0", "--", PY, "-c", DUMP_ERROR_FILE,
        run_id=run_id,
        env=deep_env(deep),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "too deep" not in done.stderr
    # the rank's entry (its agent's choice, handed to it whole) is under one of the short roots
    line = next(ln for ln in done.stdout.splitlines() if "error file " in ln)
    error_file = Path(line.split("error file ", 1)[1].strip())
    assert any(error_file.is_relative_to(r) for r in runtime.short_roots(os.getuid())), error_file
    assert len(os.fsencode(error_file.parent / runtime.SOCKET_NAME)) <= runtime.UNIX_PATH_MAX
    assert list(deep.iterdir()) == []  # nothing was made in the deep directory
    assert left_of_run(run_id) == []


def test_flodl_ps_finds_a_run_whose_tmpdir_is_deep(deep: Path, tmp_path: Path) -> None:
    """The controller registers, and ``flodl ps`` with the same environment reads, in the same
    short root."""
    run_id = new_run_id()
    release = tmp_path / "release"
    env = deep_env(deep)
    launcher = Launcher(
        "--nproc", "1", "--devices", "cpu", "--port", "0", "--", PY, script("wait_for_file.py"),
        str(release),
        run_id=run_id,
        env=env,
    )  # fmt: skip
    try:
        launcher.wait_for_stdout("ready pid")
        ps = subprocess.run(
            [PY, "-m", "flodl_async.cli.flodl", "ps", "--timeout", "5"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **env},
            check=False,
        )
        assert ps.returncode == 0, ps.stderr
        assert run_id in ps.stdout, ps.stdout
        release.touch()
        done = launcher.finish(timeout=60)
    finally:
        launcher.kill()
    assert done.returncode == 0, done.stderr
    assert list(deep.iterdir()) == []
    assert left_of_run(run_id) == []


# The in-process agent fails after it joined (its runtime entry cannot be made): what the user must
# read is that error, not that the agent's join link closed.
FAILING_ENTRY = """
import sys
from flodl_async.agent import session
from flodl_async.errors import RuntimeDirError

def refuse(**kwargs):
    raise RuntimeDirError("/deep/flodl", "is too deep for unix socket paths (test)")

session.create_entry = refuse
from flodl_async.cli.launch import main
sys.exit(main())
"""


def test_an_in_process_agents_own_error_is_the_verdict(deep: Path) -> None:
    run_id = new_run_id()
    done = subprocess.run(
        [PY, "-c", FAILING_ENTRY, "--run-id", run_id, "--nproc", "1", "--devices", "cpu",
         "--port", "0", "--", PY, "-c", "pass"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **deep_env(deep)},
        check=False,
    )  # fmt: skip
    verdict = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 4, done.stderr
    assert "FAILED — agent on host" in verdict, done.stderr
    assert "runtime directory /deep/flodl: is too deep for unix socket paths (test)" in verdict
    assert "XDG_RUNTIME_DIR" in verdict  # what to do
    assert "peer closed the connection" not in done.stderr, done.stderr
    assert left_of_run(run_id) == []


def test_the_deep_fixture_would_have_failed_before_the_fallback(deep: Path) -> None:
    """The directory under test is one the old rule refused: its runtime root cannot hold a run."""
    with pytest.raises(RuntimeDirError, match="too deep for unix socket paths"):
        runtime.entry_path(runtime.preferred_root(deep_env(deep)), "r", "h")
    assert runtime.runtime_root(deep_env(deep)) in runtime.short_roots(os.getuid())
