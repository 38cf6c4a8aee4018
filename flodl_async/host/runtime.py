"""One place for state on disk: the per-user runtime directory and the entries in it.

Theory of operation. Everything flodl keeps on disk while it runs (an agent's
relay socket, its ranks' error files) lives under one private directory per
user: ``$RUNTIME_DIRECTORY`` when systemd made one for the service
(``RuntimeDirectory=flodl``, removed when the service stops), else
``$XDG_RUNTIME_DIR/flodl`` when the session manager provides one (a
tmpfs that dies with the login), else ``<tempdir>/flodl-<uid>``. It is
created mode 0700, and refused when it is a symlink, owned by someone else or
readable by others — a shared ``/tmp`` is exactly where another user would
plant one.

Inside it, one entry per host session: ``runs/<run_id>/<host>/``, holding a
marker (``owner.json``: pid, the process start time from ``/proc/<pid>/stat``,
run id, host, controller address). An entry is made whole under a temporary
name and renamed into place, so a reader never sees it without its marker.
The session removes its entry on every way out; an entry whose owner died
without that chance (SIGKILL) is removed by :func:`sweep_stale`, which every
session calls when it starts. A process is judged alive by pid *and* start
time: pids are reused, and a stranger that got the old pid is not the owner.

Ranks may outlive their session: the parent-death signal kills a rank when its
agent is SIGKILLed, but not the processes the rank forked. So each running rank
has a marker in its entry (``ranks/<pid>.json``: pid = process group, start
time, rank, run id, controller), and :func:`reap_stale_ranks`, called before the
sweep, KILLs the live members of those groups for entries whose owner is gone.

Unix socket paths are limited to 107 bytes: an entry whose socket path would
be longer falls back to short hashed names. A root too deep even for those (a
cluster's scratch ``TMPDIR``, pytest's temp directories) gives way to a short
one of this user's: ``/run/user/<uid>/flodl`` (the login's own runtime
directory, when there is one), else ``/tmp/flodl-<uid>``, checked like any
root. The choice depends only on the environment and on which of those can be
used, so every process of a run on the host (its agents, its controller,
``flodl ps``) makes the same one; ranks and relays are handed their socket
paths whole. When neither can be used the error says so, and what to do.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import pwd
import re
import secrets
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ..errors import RuntimeDirError

log = logging.getLogger("flodl_async.host.runtime")

#: The marker every entry holds.
MARKER = "owner.json"
#: The relay's sockets inside an entry (control, data): the paths here bound by the unix-socket
#: limit.
SOCKET_NAME = "relay.sock"
DATA_SOCKET_NAME = "data.sock"  # never longer than SOCKET_NAME, so the limit check covers it
#: ``sun_path`` is 108 bytes including the terminating NUL.
UNIX_PATH_MAX = 107
#: An entry without a readable marker is a creator that died mid-creation once it is this old.
UNMARKED_GRACE_S = 60.0

_M = TypeVar("_M")

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_NEW_PREFIX = ".new-"


def runtime_root(env: Mapping[str, str] | None = None) -> Path:
    """Where this user's runtime directory is: :func:`preferred_root` (not created), unless that
    is too deep for unix socket paths, then the first of :func:`short_roots` that is, or can be
    made, a private directory of ours (made then).

    Raises :class:`RuntimeDirError` when the preferred root is too deep and no short one can be
    used.
    """
    preferred = preferred_root(env)
    chosen = choose_root(preferred, short_roots(os.getuid()), problem=root_problem)
    if chosen != preferred:
        _note_fallback(preferred, chosen)
    return chosen


def preferred_root(env: Mapping[str, str] | None = None) -> Path:
    """Where the environment puts this user's runtime directory: pure."""
    env = os.environ if env is None else env
    # systemd's RuntimeDirectory=flodl: the unit made this very directory for the service (first of
    # a list).
    service = env.get("RUNTIME_DIRECTORY", "").split(":")[0].strip()
    if service and os.path.isabs(service):
        return Path(service)
    xdg = env.get("XDG_RUNTIME_DIR", "").strip()
    if xdg and os.path.isabs(xdg):  # the XDG spec: a relative value is invalid and ignored
        return Path(xdg) / "flodl"
    return Path(tempfile.gettempdir()) / f"flodl-{os.getuid()}"


def short_roots(uid: int) -> tuple[Path, ...]:
    """Where a runtime directory too deep for socket paths gives way to, in order: the login's own
    runtime directory (systemd-logind makes it, private, for each user), then ``/tmp``'s."""
    # /tmp on purpose: it is short on every machine, and its entry is checked private before use
    return (Path(f"/run/user/{uid}/flodl"), Path(f"/tmp/flodl-{uid}"))  # noqa: S108


def shortest_socket_path(root: Path) -> int:
    """The length in bytes of the relay socket path of an entry under ``root`` with the shortest
    (hashed) names: above :data:`UNIX_PATH_MAX`, ``root`` cannot hold a run."""
    return len(os.fsencode(root / "runs" / _hashed("") / _hashed("") / SOCKET_NAME))


def choose_root(
    preferred: Path, fallbacks: Sequence[Path], *, problem: Callable[[Path], str | None]
) -> Path:
    """``preferred`` when its socket paths fit, else the first of ``fallbacks`` whose paths fit and
    where ``problem`` finds none (it says why a directory cannot be used, or None).

    Pure but for ``problem``: the same environment and the same directories give every process of
    a run the same root. Raises :class:`RuntimeDirError` about ``preferred`` when none will do.
    """
    length = shortest_socket_path(preferred)
    if length <= UNIX_PATH_MAX:
        return preferred
    why: list[str] = []
    for candidate in fallbacks:
        found = (
            "too deep as well"
            if shortest_socket_path(candidate) > UNIX_PATH_MAX
            else problem(candidate)
        )
        if found is None:
            return candidate
        why.append(f"{candidate}: {found}")
    raise RuntimeDirError(
        str(preferred),
        f"{_too_deep(length)}, and no short directory can take its place ({'; '.join(why)})",
    )


def _too_deep(length: int) -> str:
    return (
        f"is too deep for unix socket paths ({length} bytes with the shortest entry names, the "
        f"limit is {UNIX_PATH_MAX})"
    )


def root_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a runtime root, or None once it is one: made mode 0700 unless it
    exists, and checked (the probe :func:`runtime_root` hands :func:`choose_root`; trying is the
    only sure test of whether a directory can be made)."""
    try:
        _mkdir_private(path)
    except RuntimeDirError as exc:
        return exc.problem
    return None


#: Fallbacks this process has reported: the root is asked for at every step of a session, and a
#: cluster whose TMPDIR is always deep wants no line on every run (so -v only).
_noted: set[tuple[Path, Path]] = set()


def _note_fallback(preferred: Path, chosen: Path) -> None:
    if (preferred, chosen) not in _noted:
        _noted.add((preferred, chosen))
        too_deep = _too_deep(shortest_socket_path(preferred))
        log.debug("runtime directory %s %s: using %s instead", preferred, too_deep, chosen)


def _check_private(path: Path) -> None:
    """``path`` must be a real directory, ours, and closed to group and others."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise RuntimeDirError(str(path), f"cannot inspect it: {exc.strerror or exc}") from exc
    if stat.S_ISLNK(st.st_mode):
        raise RuntimeDirError(str(path), "is a symlink; refusing to follow it")
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(str(path), "exists but is not a directory")
    if st.st_uid != os.getuid():
        raise RuntimeDirError(
            str(path), f"is owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
        )
    if st.st_mode & 0o077:
        raise RuntimeDirError(
            str(path),
            f"has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700 (others could read or plant "
            "files)",
        )


def _mkdir_private(path: Path) -> None:
    """Create ``path`` mode 0700 unless it exists, then check it (never loosen, never follow a
    link).

    A run's directory is shared by the sessions of all the run's hosts on this machine, and
    each session's sweep removes it once empty: it can vanish between our ``mkdir`` (which
    found it) and our look at it. Then it is made again.
    """
    for _attempt in range(5):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise RuntimeDirError(str(path), f"cannot create it: {exc.strerror or exc}") from exc
        try:
            _check_private(path)
            return
        except RuntimeDirError as exc:
            if not isinstance(exc.__cause__, FileNotFoundError):
                raise
    raise RuntimeDirError(str(path), "could not be created (it kept disappearing underneath us)")


def private_subdir(root: Path, name: str) -> Path:
    """``root/name``, created mode 0700 unless it exists, and checked like the root itself."""
    path = root / name
    _mkdir_private(path)
    return path


def ensure_root(root: Path | None = None) -> Path:
    """The runtime directory, created if missing and checked; raises :class:`RuntimeDirError`."""
    root = runtime_root() if root is None else root
    _mkdir_private(root)
    return root


# ----- process identity ----------------------------------------------------------------------


def process_start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks after boot), or None when the process is gone
    or a zombie."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces or ')'.
    fields = raw.rsplit(")", 1)[-1].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    try:
        return int(fields[19])  # fields[0] is field 3, so field 22 is fields[19]
    except ValueError:
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessIdentity:
    """A process as pid plus start time: a reused pid has another start time."""

    pid: int
    start_time: int | None

    @classmethod
    def current(cls) -> ProcessIdentity:
        """This process."""
        return cls(pid=os.getpid(), start_time=process_start_time(os.getpid()))

    def is_alive(self) -> bool:
        """True while this very process runs (a stranger on a reused pid does not count)."""
        now = process_start_time(self.pid)
        if now is None:
            return False
        return self.start_time is None or now == self.start_time


def _marker_json(process: ProcessIdentity, **fields: object) -> str:
    """A marker file's text: the process it names (``pid``, ``start_time``), then ``fields``."""
    return json.dumps({"pid": process.pid, "start_time": process.start_time, **fields})


def _read_marker(
    path: Path, build: Callable[[ProcessIdentity, Mapping[str, Any]], _M]
) -> _M | None:
    """The marker at ``path``, built from its process and its other fields, or None when it is
    missing or unreadable (not JSON, a field missing or of the wrong type)."""
    try:
        doc = json.loads(path.read_text())
        start = doc["start_time"]
        process = ProcessIdentity(
            pid=int(doc["pid"]), start_time=None if start is None else int(start)
        )
        return build(process, doc)
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Marker:
    """What ``owner.json`` says about an entry."""

    owner: ProcessIdentity
    run_id: str
    host: str
    controller: str
    created_at: float

    def to_json(self) -> str:
        """Serialised for the marker file."""
        return _marker_json(
            self.owner,
            run_id=self.run_id,
            host=self.host,
            controller=self.controller,
            created_at=self.created_at,
        )

    @classmethod
    def read(cls, entry: Path) -> Marker | None:
        """The entry's marker, or None when it is missing or unreadable."""

        def build(owner: ProcessIdentity, doc: Mapping[str, Any]) -> Marker:
            return cls(
                owner=owner,
                run_id=str(doc["run_id"]),
                host=str(doc["host"]),
                controller=str(doc["controller"]),
                created_at=float(doc["created_at"]),
            )

        return _read_marker(entry / MARKER, build)


# ----- entries --------------------------------------------------------------------------------


def _component(name: str) -> str:
    """A directory name for a run id or host: itself when plainly safe, else a hash of it."""
    if _SAFE_NAME.fullmatch(name) and name not in (".", ".."):
        return name
    return _hashed(name)


def _hashed(name: str) -> str:
    return "h-" + hashlib.sha256(name.encode()).hexdigest()[:10]


def entry_path(root: Path, run_id: str, host: str) -> Path:
    """Where the entry of ``host`` in ``run_id`` lives, short enough for its socket path."""
    readable = root / "runs" / _component(run_id) / _component(host)
    if len(os.fsencode(readable / SOCKET_NAME)) <= UNIX_PATH_MAX:
        return readable
    short = root / "runs" / _hashed(run_id) / _hashed(host)
    length = len(os.fsencode(short / SOCKET_NAME))
    if length > UNIX_PATH_MAX:  # a root given explicitly: one from the environment never is
        raise RuntimeDirError(str(root), _too_deep(length))
    return short


class RuntimeEntry:
    """One host session's private directory; :meth:`remove` on every way out."""

    def __init__(self, path: Path, marker: Marker) -> None:
        self.path = path
        self.marker = marker

    @property
    def socket_path(self) -> str:
        """The relay's unix socket (within the 107-byte limit by construction)."""
        return str(self.path / SOCKET_NAME)

    @property
    def data_socket_path(self) -> str:
        """The relay's data-channel socket, next to :attr:`socket_path`."""
        return str(self.path / DATA_SOCKET_NAME)

    def remove(self) -> None:
        """Delete the entry, and its run directory once empty (idempotent)."""
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):  # other hosts of the run may still be in it
            self.path.parent.rmdir()


def create_entry(
    *, run_id: str, host: str, controller: str, root: Path | None = None
) -> RuntimeEntry:
    """Make this process's entry for ``host`` in ``run_id`` (after sweeping nothing: call
    :func:`sweep_stale` first).

    An entry left by a dead owner is replaced; one whose owner still runs is an error
    (two sessions of one host in one run on one machine).
    """
    root = ensure_root(root)
    final = entry_path(root, run_id, host)
    marker = Marker(
        owner=ProcessIdentity.current(),
        run_id=run_id,
        host=host,
        controller=controller,
        created_at=time.time(),
    )
    _mkdir_private(root / "runs")
    for _attempt in range(5):
        _mkdir_private(final.parent)
        fresh = final.parent / f"{_NEW_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.mkdir(fresh, 0o700)
        except FileNotFoundError:
            continue  # a concurrent sweep removed the empty run directory: make it again
        (fresh / MARKER).write_text(marker.to_json())
        try:
            os.rename(fresh, final)  # whole, with its marker, or not at all
        except OSError as exc:
            shutil.rmtree(fresh, ignore_errors=True)
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise RuntimeDirError(
                    str(final), f"cannot create it: {exc.strerror or exc}"
                ) from exc
            existing = Marker.read(final)
            if existing is not None and existing.owner.is_alive():
                raise RuntimeDirError(
                    str(final),
                    f"is in use by pid {existing.owner.pid} (host {host!r} of run {run_id!r} is "
                    "already running on this machine)",
                ) from None
            shutil.rmtree(final, ignore_errors=True)  # a dead owner's leftovers
            continue
        return RuntimeEntry(final, marker)
    raise RuntimeDirError(str(final), "could not be created (it kept changing underneath us)")


def _stale(entry: Path, now: float) -> bool:
    marker = Marker.read(entry)
    if marker is not None:
        return not marker.owner.is_alive()
    try:  # no marker: a creator still writing it, or one that died before it could
        age = now - os.lstat(entry).st_mtime
    except OSError:
        return False
    return age > UNMARKED_GRACE_S


def sweep_stale(root: Path | None = None) -> tuple[Path, ...]:
    """Remove every entry whose owner process is gone; returns what was removed.

    Nothing to do when the runtime directory does not exist yet; an unsafe one raises
    :class:`RuntimeDirError` rather than being walked.
    """
    root = runtime_root() if root is None else root
    runs = root / "runs"
    if not os.path.lexists(root):
        return ()
    _check_private(root)
    if not runs.is_dir() or runs.is_symlink():
        return ()
    removed: list[Path] = []
    whose: list[str] = []
    now = time.time()
    for run_dir in sorted(runs.iterdir()):
        if run_dir.is_symlink() or not run_dir.is_dir():
            continue
        try:
            entries = sorted(run_dir.iterdir())
        except FileNotFoundError:
            continue  # another session of the run removed it, empty, since we listed the runs
        for entry in entries:
            if entry.is_symlink() or not entry.is_dir():
                continue
            if _stale(entry, now):
                whose.append(_whose(entry))
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
        with contextlib.suppress(OSError):  # not empty: a live session's run
            run_dir.rmdir()
    if removed:
        named = "; ".join(whose[:_NAMED_STALE])
        more = f"; and {len(whose) - _NAMED_STALE} more" if len(whose) > _NAMED_STALE else ""
        log.info(
            "removed %d stale runtime entr%s under %s: %s%s",
            len(removed),
            "y" if len(removed) == 1 else "ies",
            runs,
            named,
            more,
        )
    return tuple(removed)


#: How many removed entries the sweep's line names (a machine full of leftovers stays one line).
_NAMED_STALE = 3


def _whose(entry: Path) -> str:
    """``run flodl-1a2b (host vm, pid 812, gone)``: which run left ``entry``, and the user who
    owns it when that is not us (one runtime directory may hold a sudo'd run's leftovers)."""
    marker = Marker.read(entry)
    if marker is None:
        what = f"run {entry.parent.name} (host {entry.name}, no owner marker)"
    else:
        what = f"run {marker.run_id} (host {marker.host}, pid {marker.owner.pid}, gone)"
    try:
        uid = os.lstat(entry).st_uid
    except OSError:
        return what
    if uid == os.getuid():
        return what
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = f"uid {uid}"
    return f"{what} of user {user}"


# ----- rank markers: processes that may outlive their session -----------------------------------

#: Inside an entry: one marker per running rank, ``<pid>.json``.
RANKS_DIR = "ranks"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankMarker:
    """A rank's process group, written when the rank starts and removed when it ends.

    Ranks lead their own session and group (:func:`flodl_async.host.procs.spawn`), so the group id
    is the leader's pid. The parent-death signal kills the leader with its agent, but not what
    the leader forked (a data-loader worker, a daemonised helper): those keep the group alive,
    and a group id is not reused while any member lives, so the group names exactly them.
    """

    leader: ProcessIdentity
    rank: int
    run_id: str
    controller: str

    @property
    def pgid(self) -> int:
        return self.leader.pid

    def to_json(self) -> str:
        return _marker_json(
            self.leader,
            pgid=self.pgid,
            rank=self.rank,
            run_id=self.run_id,
            controller=self.controller,
        )

    @classmethod
    def read(cls, path: Path) -> RankMarker | None:
        def build(leader: ProcessIdentity, doc: Mapping[str, Any]) -> RankMarker:
            return cls(
                leader=leader,
                rank=int(doc["rank"]),
                run_id=str(doc["run_id"]),
                controller=str(doc["controller"]),
            )

        return _read_marker(path, build)


def write_rank_marker(entry: Path, *, pid: int, rank: int) -> None:
    """Record a rank just started under the session entry ``entry`` (its run and controller come
    from the entry's marker)."""
    owner = Marker.read(entry)
    marker = RankMarker(
        leader=ProcessIdentity(pid=pid, start_time=process_start_time(pid)),
        rank=rank,
        run_id=owner.run_id if owner is not None else "?",
        controller=owner.controller if owner is not None else "?",
    )
    ranks = entry / RANKS_DIR
    with contextlib.suppress(FileExistsError):
        os.mkdir(ranks, 0o700)
    tmp = ranks / f"{_NEW_PREFIX}{pid}"
    tmp.write_text(marker.to_json())
    os.rename(tmp, ranks / f"{pid}.json")  # whole or not at all


def remove_rank_marker(entry: Path, pid: int) -> None:
    """The rank's group is gone (its watcher killed it): forget it (idempotent)."""
    with contextlib.suppress(OSError):
        os.unlink(entry / RANKS_DIR / f"{pid}.json")


def group_members(marker: RankMarker) -> tuple[int, ...]:
    """Our live processes in the marker's group: same group and session id, ours, started no earlier
    than the leader."""
    uid = os.getuid()
    members: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{name}/stat").read_text()
            owner = os.stat(f"/proc/{name}").st_uid
        except OSError:
            continue
        fields = raw.rsplit(")", 1)[-1].split()
        if len(fields) < 20 or fields[0] in ("Z", "X") or owner != uid:
            continue
        try:
            pgrp, session, started = int(fields[2]), int(fields[3]), int(fields[19])
        except ValueError:
            continue
        if (
            pgrp == marker.pgid
            and session == marker.pgid
            and (marker.leader.start_time is None or started >= marker.leader.start_time)
        ):
            members.append(int(name))
    return tuple(sorted(members))


@dataclass(frozen=True, slots=True, kw_only=True)
class CleanedRun:
    """What :func:`reap_stale_ranks` killed of one dead session."""

    run_id: str
    host: str
    controller: str
    pids: tuple[int, ...]

    def describe(self) -> str:
        n = len(self.pids)
        return (
            f"cleaned up {n} process{'es' if n != 1 else ''} of run {self.run_id} on host "
            f"{self.host!r} "
            f"(their agent is gone; controller {self.controller}): pids {list(self.pids)}"
        )


def reap_stale_ranks(root: Path | None = None) -> tuple[CleanedRun, ...]:
    """KILL what the ranks of dead sessions left running; call before :func:`sweep_stale` removes
    their markers.

    Only processes named by a rank marker of an entry whose owner is gone are touched,
    found by process group (never by command line), and only this user's.
    """
    root = runtime_root() if root is None else root
    runs = root / "runs"
    if not os.path.lexists(root):
        return ()
    _check_private(root)
    if not runs.is_dir() or runs.is_symlink():
        return ()
    cleaned: list[CleanedRun] = []
    for run_dir in sorted(runs.iterdir()):
        if run_dir.is_symlink() or not run_dir.is_dir():
            continue
        for entry in sorted(run_dir.iterdir()):
            ranks = entry / RANKS_DIR
            owner = Marker.read(entry)
            if owner is None or owner.owner.is_alive() or not ranks.is_dir() or ranks.is_symlink():
                continue
            killed: list[int] = []
            for path in sorted(ranks.glob("*.json")):
                marker = RankMarker.read(path)
                if marker is None:
                    continue
                for pid in group_members(marker):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
            if killed:
                cleaned.append(
                    CleanedRun(
                        run_id=owner.run_id,
                        host=owner.host,
                        controller=owner.controller,
                        pids=tuple(killed),
                    )
                )
    return tuple(cleaned)
