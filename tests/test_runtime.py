"""The per-user runtime directory: its mode, refusing unsafe ones, liveness by start time, the sweep."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from flodl_async.errors import ConfigError, RuntimeDirError
from flodl_async.host import runtime
from flodl_async.host.runtime import (
    ProcessIdentity,
    create_entry,
    ensure_root,
    entry_path,
    process_start_time,
    runtime_root,
    sweep_stale,
)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory (pytest's tmp_path can be too deep for the socket path limit)."""
    path = Path(tempfile.mkdtemp(prefix="fl-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def root(short_tmp: Path) -> Path:
    return short_tmp / "flodl"


def test_root_follows_xdg_runtime_dir_else_a_per_user_temp_dir() -> None:
    assert runtime_root({"XDG_RUNTIME_DIR": "/run/user/1000"}) == Path("/run/user/1000/flodl")
    fallback = runtime_root({})
    assert fallback.name == f"flodl-{os.getuid()}"
    assert runtime_root({"XDG_RUNTIME_DIR": "relative/not/allowed"}) == fallback


def test_root_is_created_owner_only(root: Path) -> None:
    old = os.umask(0)  # even a permissive umask must not loosen it
    try:
        ensure_root(root)
    finally:
        os.umask(old)
    assert oct(root.stat().st_mode & 0o777) == "0o700"
    entry = create_entry(run_id="run-1", host="node-a", controller="127.0.0.1:1337", root=root)
    for path in (root / "runs", entry.path.parent, entry.path):
        assert oct(path.stat().st_mode & 0o777) == "0o700"


def test_a_loose_directory_is_refused(root: Path) -> None:
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    with pytest.raises(RuntimeDirError, match=r"has mode 0755; it must be 0700") as caught:
        ensure_root(root)
    assert caught.value.path == str(root)
    assert isinstance(caught.value, ConfigError)  # flodl-agent exits 2 for it
    assert "XDG_RUNTIME_DIR" in str(caught.value)


def test_a_symlink_is_refused(short_tmp: Path, root: Path) -> None:
    target = short_tmp / "elsewhere"
    target.mkdir(mode=0o700)
    root.symlink_to(target)
    with pytest.raises(RuntimeDirError, match="is a symlink"):
        ensure_root(root)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory owned by another user")
def test_a_directory_of_another_user_is_refused(root: Path) -> None:
    root.mkdir(mode=0o700)
    os.chown(root, 54321, 54321)
    with pytest.raises(RuntimeDirError, match="is owned by uid 54321"):
        ensure_root(root)


def test_liveness_is_pid_and_start_time() -> None:
    me = ProcessIdentity.current()
    assert me.start_time is not None
    assert me.is_alive()
    reused = ProcessIdentity(pid=me.pid, start_time=me.start_time + 1)  # same pid, another process
    assert not reused.is_alive()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_start_time(child.pid) is None
    assert not ProcessIdentity(pid=child.pid, start_time=0).is_alive()


def test_entry_marker_names_its_owner(root: Path) -> None:
    entry = create_entry(run_id="run-1", host="node-a", controller="10.0.0.1:1337", root=root)
    assert entry.path == root / "runs" / "run-1" / "node-a"
    doc = json.loads((entry.path / runtime.MARKER).read_text())
    assert doc["pid"] == os.getpid()
    assert doc["start_time"] == process_start_time(os.getpid())
    assert (doc["run_id"], doc["host"], doc["controller"]) == ("run-1", "node-a", "10.0.0.1:1337")
    assert not [p for p in entry.path.parent.iterdir() if p.name.startswith(".new-")]
    entry.remove()
    assert not (root / "runs" / "run-1").exists()


def test_a_live_owner_keeps_its_entry(root: Path) -> None:
    create_entry(run_id="run-1", host="node-a", controller="c", root=root)
    with pytest.raises(RuntimeDirError, match=r"is in use by pid \d+"):
        create_entry(run_id="run-1", host="node-a", controller="c", root=root)


def _plant(root: Path, run_id: str, host: str, owner: ProcessIdentity) -> Path:
    entry = create_entry(run_id=run_id, host=host, controller="c", root=root)
    marker = json.loads((entry.path / runtime.MARKER).read_text())
    marker.update(pid=owner.pid, start_time=owner.start_time)
    (entry.path / runtime.MARKER).write_text(json.dumps(marker))
    (entry.path / "error-r0-round0.json").write_text("{}")
    return entry.path


def test_sweep_removes_entries_of_dead_owners_only(root: Path) -> None:
    me = ProcessIdentity.current()
    assert me.start_time is not None
    live = _plant(root, "run-live", "a", me)
    reused = _plant(
        root, "run-dead", "a", ProcessIdentity(pid=me.pid, start_time=me.start_time - 1)
    )
    gone = _plant(root, "run-dead", "b", ProcessIdentity(pid=2**22 + 17, start_time=1))
    unmarked_fresh = root / "runs" / "run-live" / ".new-1-abcd"
    unmarked_fresh.mkdir(mode=0o700)
    removed = sweep_stale(root)
    assert set(removed) == {reused, gone}
    assert live.exists()
    assert unmarked_fresh.exists()  # a creator may still be writing its marker
    assert not (root / "runs" / "run-dead").exists()  # emptied run directories go too
    old = 1_000_000_000
    os.utime(unmarked_fresh, (old, old))
    assert sweep_stale(root) == (unmarked_fresh,)


def test_sweep_of_a_missing_root_does_nothing(root: Path) -> None:
    assert sweep_stale(root) == ()
    assert not root.exists()


def test_a_dead_owners_entry_is_replaced(root: Path) -> None:
    me = ProcessIdentity.current()
    assert me.start_time is not None
    stale = _plant(root, "run-1", "a", ProcessIdentity(pid=me.pid, start_time=me.start_time + 5))
    entry = create_entry(run_id="run-1", host="a", controller="c", root=root)
    assert entry.path == stale
    assert not (entry.path / "error-r0-round0.json").exists()


def test_names_that_are_not_plain_are_hashed(root: Path) -> None:
    path = entry_path(root, "../escape", "host/with/slashes")
    assert path.parent.parent == root / "runs"
    assert path.name.startswith("h-")
    assert path.parent.name.startswith("h-")


def test_long_paths_fall_back_to_short_names_or_fail_clearly(short_tmp: Path) -> None:
    deep = short_tmp / ("d" * 40)
    path = entry_path(deep, "r" * 60, "h" * 60)
    assert len(os.fsencode(path / runtime.SOCKET_NAME)) <= runtime.UNIX_PATH_MAX
    assert path.name.startswith("h-")
    with pytest.raises(RuntimeDirError, match=r"too deep for unix socket paths .* XDG_RUNTIME_DIR"):
        entry_path(short_tmp / ("d" * 120), "r", "h")


# ----- controllers register while they run (flodl ps, flodl status with no address) ------------


def test_a_controller_registers_and_removes_itself(root: Path) -> None:
    from flodl_async.host import runs as controllers

    registration = controllers.register(run_id="run-a", address="127.0.0.1", port=4242, root=root)
    assert (root / "controllers").stat().st_mode & 0o777 == 0o700
    (run,) = controllers.local_runs(root)
    assert (run.run_id, run.address, run.port, run.owner.pid) == (
        "run-a",
        "127.0.0.1",
        4242,
        os.getpid(),
    )
    registration.remove()
    registration.remove()  # idempotent
    assert controllers.local_runs(root) == ()


def test_a_dead_controllers_entry_is_swept_and_a_stranger_on_its_pid_does_not_count(
    root: Path,
) -> None:
    from flodl_async.host import runs as controllers

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = controllers.register(run_id="live", address="127.0.0.1", port=1, root=root)
    directory = root / "controllers"
    gone = controllers.LocalRun(
        owner=ProcessIdentity(pid=dead.pid, start_time=1),
        run_id="gone",
        address="127.0.0.1",
        port=2,
        started_at=0.0,
    )
    (directory / "gone.json").write_text(gone.to_json())
    # Our own pid with another start time: a reused pid, so not the owner.
    reused = controllers.LocalRun(
        owner=ProcessIdentity(pid=os.getpid(), start_time=-5),
        run_id="reused",
        address="127.0.0.1",
        port=3,
        started_at=0.0,
    )
    (directory / "reused.json").write_text(reused.to_json())
    (directory / "torn.json").write_text("{not json")
    assert [r.run_id for r in controllers.local_runs(root)] == ["live"]
    assert sorted(p.name for p in directory.iterdir()) == [alive.path.name]
    alive.remove()


def test_a_run_directory_swept_between_our_mkdir_and_our_look_is_made_again(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All hosts of a run on one machine share its directory, and each one's sweep removes it once empty.

    The window the race needs (after our mkdir found the directory, before our lstat) is opened
    here on purpose: the first mkdir of the run directory sees it exist, and it is gone when looked at.
    """
    ensure_root(root)
    (root / "runs").mkdir(mode=0o700)
    run_dir = entry_path(root, "r1", "h1").parent
    real_mkdir = os.mkdir
    raced: list[str] = []

    def mkdir_then_swept(path: str | os.PathLike[str], mode: int = 0o777) -> None:
        if Path(path) == run_dir and not raced:
            real_mkdir(path, mode)
            raced.append(str(path))
            os.rmdir(path)  # another host's sweep: the run directory was empty
            raise FileExistsError(path)
        real_mkdir(path, mode)

    monkeypatch.setattr(runtime.os, "mkdir", mkdir_then_swept)
    entry = create_entry(run_id="r1", host="h1", controller="c:1", root=root)
    assert raced == [str(run_dir)]
    assert entry.path.is_dir()


def test_hosts_of_one_run_on_one_machine_create_and_sweep_concurrently(short_tmp: Path) -> None:
    """Eight sessions of one run (namespace hosts share a file system), each creating, sweeping and removing, many times."""
    root = short_tmp / "rt"
    worker = (
        "import sys\n"
        "from pathlib import Path\n"
        "from flodl_async.host.runtime import create_entry, sweep_stale\n"
        "root, host = Path(sys.argv[1]), sys.argv[2]\n"
        "for i in range(60):\n"
        "    sweep_stale(root)\n"
        "    create_entry(run_id=f'run-{i}', host=host, controller='c:1', root=root).remove()\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", worker, str(root), f"h{n}"], stderr=subprocess.PIPE, text=True
        )
        for n in range(8)
    ]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 8, "\n".join(errors)
    assert list((root / "runs").iterdir()) == []  # every run directory went with its last entry
