"""A process and its live descendants, and the sockets they hold, as ``/proc`` shows them.

A child is listed in the ``/proc/<pid>/task/<tid>/children`` file of the thread that forked it,
so a tree is read thread by thread; a process's sockets are its descriptors that link to
``socket:[N]`` (N the socket's inode, the same number ``sock_diag`` and ``/proc/net/tcp`` name).
The agent reads its ranks' trees to make a hang visible; the store reads the run's trees to tell
a rank's connection from any other process's. The parsing is pure; the rest are thin readers.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

#: A tree is read up to this many processes (a fork bomb must not make every read costly).
TREE_LIMIT = 64


def parse_children(text: str) -> list[int]:
    """A ``/proc/<pid>/task/<tid>/children`` file → the pids in it (space-separated)."""
    return [int(word) for word in text.split() if word.isdigit()]


def read_proc(path: str) -> str:
    """A small ``/proc`` file in one read (cheaper than ``Path.read_text``: torch ranks have dozens
    of threads)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 65536).decode(errors="replace")
    finally:
        os.close(fd)


def children(pid: int) -> list[int]:
    """``pid``'s live children, from each of its threads' children file ([] when it is gone)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for tid in tids:
        with contextlib.suppress(OSError):
            found += parse_children(read_proc(f"/proc/{pid}/task/{tid}/children"))
    return found


def _descendants(pid: int, limit: int) -> Iterator[int]:
    """``pid``'s live descendants, breadth first, at most ``limit`` - 1 of them, as they are
    found (a caller looking for one stops reading the tree there)."""
    seen, queue = {pid}, [pid]
    while queue and len(seen) < limit:
        for child in children(queue.pop(0)):
            if child not in seen and len(seen) < limit:
                seen.add(child)
                queue.append(child)
                yield child


def process_tree(pid: int, limit: int = TREE_LIMIT) -> list[int]:
    """``pid`` and its live descendants, ``pid`` first (breadth first, at most ``limit``).

    Without the children files (a kernel built without them) the tree is ``pid`` alone.
    """
    return [pid, *_descendants(pid, limit)]


def socket_inodes(pid: int) -> frozenset[int]:
    """The socket inodes among ``pid``'s open descriptors (links ``socket:[N]``)."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    found.add(int(link[8:-1]))
    return frozenset(found)


def holds_socket(pid: int, inode: int) -> bool:
    """Whether one of ``pid``'s descriptors is the socket ``inode`` (stops at the first match)."""
    wanted = f"socket:[{inode}]"
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == wanted:
                    return True
    return False


def holder_in_trees(inode: int, roots: Iterable[int], limit: int) -> int | None:
    """The process of the roots' trees that holds the socket ``inode``, or None.

    Each root's descendants are searched as they are found, before the root itself: a root (the
    controller, an agent) holds many sockets of its own, while a store client is nearly always a
    rank, one of its children, found before the rest of the tree is read.
    """
    roots = list(roots)
    for root in roots:
        for pid in _descendants(root, limit):
            if holds_socket(pid, inode):
                return pid
    return holder_among(inode, roots)


def holder_among(inode: int, pids: Iterable[int]) -> int | None:
    """The first of ``pids`` that holds the socket ``inode``, or None."""
    for pid in pids:
        if holds_socket(pid, inode):
            return pid
    return None


def all_pids(uid: int | None = None) -> list[int]:
    """Every pid ``/proc`` lists (of this pid namespace); with ``uid``, only that user's."""
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []
    if uid is None:
        return pids
    mine = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{pid}").st_uid == uid:
                mine.append(pid)
    return mine


def command_name(pid: int) -> str:
    """``/proc/<pid>/comm`` (the command's short name), '' when it is gone."""
    try:
        return read_proc(f"/proc/{pid}/comm").strip()
    except OSError:
        return ""


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot, field 22 of ``/proc/<pid>/stat``): with the
    pid, it names one process, never a later one that reused the number. None when it is gone."""
    try:
        fields = read_proc(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
    except OSError:
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None
