"""The per-user runtime directory: its mode, refusing unsafe ones, liveness by start time, the sweep."""

from __future__ import annotations

import json
import logging
import os
import pwd
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
    choose_root,
    create_entry,
    ensure_root,
    entry_path,
    preferred_root,
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
    assert preferred_root({"XDG_RUNTIME_DIR": "/run/user/1000"}) == Path("/run/user/1000/flodl")
    assert runtime_root({"XDG_RUNTIME_DIR": "/run/user/1000"}) == Path("/run/user/1000/flodl")
    fallback = preferred_root({})
    assert fallback == Path(tempfile.gettempdir()) / f"flodl-{os.getuid()}"
    assert preferred_root({"XDG_RUNTIME_DIR": "relative/not/allowed"}) == fallback


# ----- a root too deep for unix socket paths gives way to a short one ----------------------------

#: 117 bytes of relay socket path under it with the shortest entry names: past the 107-byte limit.
DEEP = Path("/scratch/" + "d" * 58 + "/flodl-0")
SHORT = (Path("/run/user/7/flodl"), Path("/tmp/flodl-7"))


def test_a_root_that_fits_is_kept_without_looking_at_the_fallbacks() -> None:
    def never(path: Path) -> str | None:
        raise AssertionError(f"looked at {path}")

    fits = Path("/tmp/" + "d" * 40 + "/flodl-0")
    assert runtime.shortest_socket_path(fits) <= runtime.UNIX_PATH_MAX
    assert choose_root(fits, SHORT, problem=never) == fits


def test_a_root_too_deep_gives_way_to_the_first_usable_short_one() -> None:
    assert runtime.shortest_socket_path(DEEP) == 117
    assert choose_root(DEEP, SHORT, problem=lambda p: None) == SHORT[0]
    no_login_dir = {SHORT[0]: "cannot create it: No such file or directory"}
    assert choose_root(DEEP, SHORT, problem=no_login_dir.get) == SHORT[1]
    # a fallback too deep itself is never asked about
    asked: list[Path] = []
    deeper = DEEP / "more"
    assert choose_root(DEEP, (deeper, SHORT[1]), problem=asked.append) == SHORT[1]
    assert asked == [SHORT[1]]


def test_a_root_too_deep_with_no_usable_short_one_is_a_clear_error() -> None:
    problems = {
        SHORT[0]: "cannot create it: No such file or directory",
        SHORT[1]: "is owned by uid 54321, not by you (uid 7)",
    }
    with pytest.raises(RuntimeDirError) as caught:
        choose_root(DEEP, SHORT, problem=problems.get)
    assert caught.value.path == str(DEEP)
    text = str(caught.value)
    assert (
        "is too deep for unix socket paths (117 bytes with the shortest entry names, the limit is 107)"
        in text
    )
    assert "/run/user/7/flodl: cannot create it: No such file or directory;" in text
    assert "/tmp/flodl-7: is owned by uid 54321" in text
    assert "XDG_RUNTIME_DIR" in text  # what to do


def test_the_short_roots_are_per_user_and_short() -> None:
    roots = runtime.short_roots(4294967294)
    assert roots == (Path("/run/user/4294967294/flodl"), Path("/tmp/flodl-4294967294"))
    assert all(runtime.shortest_socket_path(r) <= runtime.UNIX_PATH_MAX for r in roots)


def test_whether_a_short_root_can_be_used_is_checked_like_a_root(short_tmp: Path) -> None:
    problem = runtime.root_problem
    assert problem(short_tmp / "new") is None
    assert oct((short_tmp / "new").stat().st_mode & 0o777) == "0o700"  # made, private
    assert problem(short_tmp / "no" / "new") == "cannot create it: No such file or directory"
    ensure_root(short_tmp / "ours")
    assert problem(short_tmp / "ours") is None
    (short_tmp / "loose").mkdir(mode=0o755)
    (short_tmp / "loose").chmod(0o755)
    assert (
        problem(short_tmp / "loose")
        == "has mode 0755; it must be 0700 (others could read or plant files)"
    )
    (short_tmp / "link").symlink_to(short_tmp / "ours")
    assert problem(short_tmp / "link") == "is a symlink; refusing to follow it"


def test_the_environments_root_falls_back_when_tmpdir_and_xdg_are_deep(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = short_tmp / ("d" * 100)
    env = {"XDG_RUNTIME_DIR": str(deep)}
    usable = [r for r in runtime.short_roots(os.getuid()) if runtime.root_problem(r) is None]
    if not usable:
        pytest.skip("neither short root can be used on this machine")
    assert runtime_root(env) == usable[0]
    # every process of the run asks again, and gets the same answer
    assert runtime_root(env) == runtime_root(dict(env)) == usable[0]
    monkeypatch.setattr(runtime, "short_roots", lambda uid: (short_tmp / f"fb-{uid}",))
    assert runtime_root(env) == short_tmp / f"fb-{os.getuid()}"
    root = ensure_root(runtime_root(env))
    entry = create_entry(run_id="run-1", host="h", controller="c", root=root)
    assert len(os.fsencode(entry.socket_path)) <= runtime.UNIX_PATH_MAX
    entry.remove()


def test_flodl_ps_lists_nothing_when_no_root_can_be_used(monkeypatch: pytest.MonkeyPatch) -> None:
    from flodl_async.host import runs

    def refuse(env: object = None) -> Path:
        raise RuntimeDirError(str(DEEP), "is too deep")

    monkeypatch.setattr(runs, "runtime_root", refuse)
    assert runs.local_runs() == ()


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


def test_the_sweep_s_line_says_whose_entries_it_removed(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Which run, host and dead pid left each entry; the owning user only when it is not us."""
    gone = ProcessIdentity(pid=2**22 + 17, start_time=1)
    _plant(root, "run-ours", "a", gone)
    theirs = _plant(root, "run-theirs", "b", gone)
    if os.getuid() == 0:  # only root can hand an entry to another user
        os.chown(theirs, 4242, 4242)
    with caplog.at_level(logging.INFO, logger="flodl_async.host.runtime"):
        assert len(sweep_stale(root)) == 2
    [line] = [r.getMessage() for r in caplog.records if "stale runtime" in r.getMessage()]
    assert line.startswith(f"removed 2 stale runtime entries under {root / 'runs'}: "), line
    assert f"run run-ours (host a, pid {gone.pid}, gone); run run-theirs (host b, pid " in line
    ours = line.split("; ")[0]
    assert "user" not in ours, line
    if os.getuid() == 0:
        who = (
            pwd.getpwuid(4242).pw_name if 4242 in {u.pw_uid for u in pwd.getpwall()} else "uid 4242"
        )
        assert line.endswith(f", gone) of user {who}"), line


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
