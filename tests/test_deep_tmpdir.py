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

from .hostkit import HostKit
from .launchkit import PY, Launcher, new_run_id, run_launch, script
from .test_fanout_e2e import _cluster, _python_wrapper

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


# No short directory can be made: the launcher, its agent patched to look only where none can be.
NO_SHORT_ROOT = """
import sys
from pathlib import Path
from flodl_async.host import runtime
runtime.short_roots = lambda uid: (Path("/nonexistent/flodl"),)
from flodl_async.cli.launch import main
sys.exit(main())
"""


def test_with_no_short_root_the_verdict_is_the_too_deep_error(deep: Path) -> None:
    run_id = new_run_id()
    done = subprocess.run(
        [PY, "-c", NO_SHORT_ROOT, "--run-id", run_id, "--nproc", "1", "--devices", "cpu",
         "--port", "0", "--", PY, "-c", "pass"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **deep_env(deep)},
        check=False,
    )  # fmt: skip
    verdict = done.stderr.strip().splitlines()[-1]
    # A one-host run registers its early ranks in the runtime directory before it starts them, so
    # the launcher meets the error first: a setup error, and nothing was started.
    assert done.returncode == 2, done.stderr
    assert f"runtime directory {deep / 'flodl'}: is too deep for unix socket paths" in verdict
    assert "/nonexistent/flodl: cannot create it" in verdict
    assert "XDG_RUNTIME_DIR" in verdict
    assert list(deep.iterdir()) == []


# An agent that fails after it joined closes its join link, then says why (its launcher raises it):
# what the user must read is that error, not that the link closed. Here its runtime entry cannot be
# made: the runs directory under a private root is open to others.
@pytest.fixture
def loose_runs() -> Iterator[Path]:
    """An XDG_RUNTIME_DIR whose ``flodl/runs`` has mode 0755: the root passes, the entry fails."""
    base = Path(tempfile.mkdtemp(prefix="fl-loose-", dir="/tmp"))
    (base / "flodl").mkdir(mode=0o700)
    (base / "flodl" / "runs").mkdir()
    (base / "flodl" / "runs").chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def loose_runs_error(xdg: Path) -> str:
    return f"runtime directory {xdg / 'flodl' / 'runs'}: has mode 0755; it must be 0700"


def test_an_in_process_agents_own_error_is_the_verdict(loose_runs: Path) -> None:
    done = run_launch(
        "--nproc", "1", "--devices", "cpu", "--port", "0", "--", PY, "-c", "pass",
        run_id=new_run_id(),
        env={"XDG_RUNTIME_DIR": str(loose_runs)},
    )  # fmt: skip
    verdict = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 4, done.stderr
    assert "FAILED — agent on host" in verdict, done.stderr
    assert loose_runs_error(loose_runs) in verdict, done.stderr
    assert "XDG_RUNTIME_DIR" in verdict  # what to do
    assert "peer closed the connection" not in done.stderr, done.stderr


def test_a_remote_agents_own_error_is_the_verdict(
    hostkit: HostKit, tmp_path: Path, loose_runs: Path
) -> None:
    """Over ssh the agent prints its error and exits 2: its launcher raises that line, the verdict."""
    h1 = hostkit.hosts[0]
    wrapper = _python_wrapper(tmp_path)
    text = wrapper.read_text().replace(
        "\nexec ", f"\nexport XDG_RUNTIME_DIR={loose_runs}\nexec ", 1
    )
    wrapper.write_text(text)
    cluster = _cluster(tmp_path, hostkit, [(h1, "cpu:1")], python=str(wrapper))
    done = run_launch(str(cluster), "--", PY, "-c", "pass", run_id=new_run_id())
    verdict = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 4, done.stderr
    assert f"agent on host {h1.name!r}" in verdict, done.stderr
    assert loose_runs_error(loose_runs) in verdict, done.stderr
    assert "peer closed the connection" not in done.stderr, done.stderr


def test_the_deep_fixture_would_have_failed_before_the_fallback(deep: Path) -> None:
    """The directory under test is one the old rule refused: its runtime root cannot hold a run."""
    with pytest.raises(RuntimeDirError, match="too deep for unix socket paths"):
        runtime.entry_path(runtime.preferred_root(deep_env(deep)), "r", "h")
    assert runtime.runtime_root(deep_env(deep)) in runtime.short_roots(os.getuid())
