"""What makes a hang visible: each rank's process as ``/proc`` shows it, its output, and whether it
reached the store.

Theory of operation. The agent spawned every rank, so it knows each pid. Every
report interval (the heartbeat interval: a couple of seconds) it reads, per
rank, one ``/proc/<pid>/stat`` (the state letter, CPU ticks, start time) and,
until the rank is seen connected, its ``/proc/<pid>/fd`` links — and the host's
``/proc/net/tcp{,6}`` only when those hold a socket not seen before: a socket of the rank whose
established TCP connection
goes to the store's port means the rank reached the rendezvous store (the
store is ours, and its port is the controller's). Output comes for free: the
agent forwards every chunk, and :class:`RankActivityTracker` keeps the last
line and when it came. A rank is *quiet* while it prints nothing and its CPU
ticks do not move; that is what ``--hang-timeout`` measures.

A rank is read as its process tree, not its pid alone: ``flodl-launch -- bash
run.sh`` makes the rank a shell that sleeps in ``wait`` while the python it
started does the work. The tree is the pid and its live descendants, found
through ``/proc/<pid>/task/<tid>/children``; its CPU is each member's own ticks
plus those of the children it reaped (so a step's helper process that ends
hands its ticks to its parent instead of taking them away); its sockets are
all the members' sockets; its state is the most telling of theirs (a stopped
or blocked python under a sleeping shell shows as stopped or blocked).

Reading a torch rank's tree (40 threads, each with its children file) costs
about 0.5 ms per report. The parsing is pure (text in, values out);
:meth:`RankActivityTracker.sample` and :mod:`flodl_async.host.proctree` read ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..host.proctree import process_tree, read_proc, socket_inodes
from ..wire import messages as m

#: The last line is cut to this many characters (a report stays small whatever a rank prints).
LAST_LINE_LIMIT = 200
#: A rank not yet seen at the store has its sockets matched against the TCP tables at least this
#: often.
RECHECK_S = 30.0
_TCP_ESTABLISHED = "01"
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: Which member's state a tree shows, most telling first: stopped (T, t), blocked in the kernel
#: (D), running (R), then the idle ones; a zombie (Z) or dead (X) member shows only when nothing
#: else does.
_STATE_PRIORITY = "TtDRSIWPKZX"


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` a report uses."""

    state: str
    cpu_ticks: int  # utime + stime
    start_ticks: int  # after boot
    reaped_ticks: int = 0  # cutime + cstime: the children it waited for


def parse_stat(text: str) -> ProcStat | None:
    """``/proc/<pid>/stat`` → its state, CPU ticks and start time; None when it does not parse."""
    fields = text.rsplit(")", 1)[-1].split()  # the command (field 2) may hold spaces and ')'
    if len(fields) < 20:
        return None
    try:
        return ProcStat(
            state=fields[0],
            cpu_ticks=int(fields[11]) + int(fields[12]),
            start_ticks=int(fields[19]),
            reaped_ticks=int(fields[13]) + int(fields[14]),
        )
    except ValueError:
        return None


def tree_state(states: list[str]) -> str:
    """The state a rank's tree shows: its most telling member's (see :data:`_STATE_PRIORITY`;
    unknown letters last)."""

    def telling(state: str) -> int:
        place = _STATE_PRIORITY.find(state)
        return place if place >= 0 else len(_STATE_PRIORITY)

    return min(states, key=telling, default="X")


def tree_ticks(stats: list[ProcStat]) -> int:
    """CPU ticks of a tree: each live member's own and those of the children it reaped."""
    return sum(stat.cpu_ticks + stat.reaped_ticks for stat in stats)


def parse_net_tcp(text: str, remote_port: int) -> frozenset[int]:
    """Socket inodes of established connections to ``remote_port`` in a ``/proc/net/tcp`` or
    ``tcp6`` table."""
    inodes: set[int] = set()
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10 or cols[3] != _TCP_ESTABLISHED:
            continue
        _addr, _, port_hex = cols[2].rpartition(":")
        with contextlib.suppress(ValueError):
            if int(port_hex, 16) == remote_port:
                inodes.add(int(cols[9]))
    return frozenset(inodes)


def store_connections(remote_port: int) -> frozenset[int]:
    """Inodes of this host's established TCP connections to ``remote_port`` (IPv4 and IPv6)."""
    inodes: frozenset[int] = frozenset()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            inodes |= parse_net_tcp(Path(table).read_text(), remote_port)
    return inodes


def last_line_of(data: bytes) -> str:
    """The last non-blank line (or ``\\r`` update) of an output chunk, cut to
    :data:`LAST_LINE_LIMIT`; '' when it has none."""
    for piece in reversed(data.replace(b"\r", b"\n").split(b"\n")):
        text = piece.decode(errors="replace").strip()
        if text:
            return text[:LAST_LINE_LIMIT]
    return ""


class RankActivityTracker:
    """One rank's activity between reports: its output as it passes, its CPU as sampled (``now`` is
    monotonic)."""

    def __init__(self, *, rank: int, pid: int, store_port: int, now: float) -> None:
        self.rank = rank
        self.pid = pid
        self.store_port = store_port
        self._started = now
        self._last_line = ""
        self._output_at: float | None = None
        self._cpu_ticks: int | None = None
        self._cpu_at = now
        self._progress_at = now  # spawning counts as progress: a new rank is not quiet
        self._cpu_percent = 0.0
        self._connected = False
        self._sockets: frozenset[int] = frozenset()
        self._checked_at = now

    def output(self, data: bytes, now: float) -> None:
        """A chunk the rank wrote (either stream)."""
        line = last_line_of(data)
        if line:
            self._last_line = line
        self._output_at = now
        self._progress_at = max(self._progress_at, now)

    def cpu(self, ticks: int, now: float) -> None:
        """A CPU sample: ticks that moved are progress."""
        if self._cpu_ticks is not None and now > self._cpu_at:
            used = ticks - self._cpu_ticks
            self._cpu_percent = max(used, 0) / _CLOCK_TICKS / (now - self._cpu_at) * 100.0
            if used > 0:
                self._progress_at = now
        self._cpu_ticks, self._cpu_at = ticks, now

    def report(self, state: str, now: float) -> m.RankActivity:
        return m.RankActivity(
            rank=self.rank,
            pid=self.pid,
            uptime_s=round(now - self._started, 1),
            state=state,
            cpu_percent=round(self._cpu_percent, 1),
            last_line=self._last_line,
            output_age_s=-1.0 if self._output_at is None else round(now - self._output_at, 1),
            quiet_s=round(max(now - self._progress_at, 0.0), 1),
            store_connected=self._connected,
        )

    def sample(self, now: float, connections: Callable[[int], frozenset[int]]) -> m.RankActivity:
        """Read the ``/proc`` entries of the rank's process tree and, until it is seen at the store,
        their sockets.

        ``connections(port)`` reads the host's TCP tables (costly: milliseconds on a busy
        host), so it is asked only when the tree holds sockets it did not hold at the last
        look, or every :data:`RECHECK_S` (a connect that was still in progress then).
        """
        tree = process_tree(self.pid)
        stats: list[ProcStat] = []
        for pid in tree:
            try:
                stat = parse_stat(read_proc(f"/proc/{pid}/stat"))
            except OSError:
                stat = None  # it ended between the listing and the read
            if stat is not None:
                stats.append(stat)
            elif pid == self.pid:
                return self.report("X", now)
        self.cpu(tree_ticks(stats), now)
        if not self._connected and self.store_port > 0:
            sockets = frozenset().union(*(socket_inodes(pid) for pid in tree))
            if sockets and (sockets != self._sockets or now - self._checked_at >= RECHECK_S):
                self._sockets, self._checked_at = sockets, now
                self._connected = bool(sockets & connections(self.store_port))
        return self.report(tree_state([stat.state for stat in stats]), now)

    @property
    def connected(self) -> bool:
        return self._connected
