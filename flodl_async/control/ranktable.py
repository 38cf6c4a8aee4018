"""The supervisor's table of ranks, as the status page shows them: started, connected, their
activity, how they exited; and which one hung.

Pure. The supervisor fills it from the events of the running round and asks it, under
``--hang-timeout``, whether a host's report names a rank quiet past the limit
(:meth:`RankTable.hang`), and how that verdict reads (:func:`hang_verdict`).
"""

from __future__ import annotations

from dataclasses import replace

from ..status.model import PROCESS_STATES, RankState, RankStatus
from ..wire import messages as m
from .exits import failed
from .supervision import with_activity


class RankTable:
    """Every rank the run started, by rank."""

    __slots__ = ("_ranks",)

    def __init__(self) -> None:
        self._ranks: dict[int, RankStatus] = {}

    def statuses(self) -> tuple[RankStatus, ...]:
        """Each rank's status, by rank."""
        return tuple(self._ranks[r] for r in sorted(self._ranks))

    def started(self, rank: int, *, host: str, local_rank: int) -> None:
        """``rank`` was started on ``host`` (a new round starts it afresh)."""
        self._ranks[rank] = RankStatus(
            rank=rank, host=host, local_rank=local_rank, state=RankState.RUNNING
        )

    def exited(self, report: m.RankExited) -> None:
        """A rank's exit, as its host reported it."""
        known = self._ranks.get(report.rank)
        self._ranks[report.rank] = RankStatus(
            rank=report.rank,
            host=report.host,
            local_rank=report.local_rank,
            state=RankState.FAILED if failed(report) else RankState.EXITED,
            pid=known.pid if known is not None else None,
            exit_code=report.exit_code,
            signal=report.signal,
        )

    def connected(self, rank: int, pid: int) -> None:
        """A running rank said hello through its relay."""
        known = self._ranks.get(rank)
        if known is not None and known.state is RankState.RUNNING:
            self._ranks[rank] = replace(known, state=RankState.CONNECTED, pid=pid)

    def reported(
        self, host: str, report: m.RankStats, *, hang_timeout: float | None
    ) -> m.RankActivity | None:
        """Fold ``host``'s activity report in (only its own running ranks); the quietest rank at
        or past ``hang_timeout`` (None: no limit, or none), the first of equals."""
        hung: m.RankActivity | None = None
        for activity in report.ranks:
            known = self._ranks.get(activity.rank)
            if (
                known is None
                or known.host != host
                or known.state not in (RankState.RUNNING, RankState.CONNECTED)
            ):
                continue
            self._ranks[activity.rank] = with_activity(known, activity)
            if (
                hang_timeout is not None
                and activity.quiet_s >= hang_timeout
                and (hung is None or activity.quiet_s > hung.quiet_s)
            ):
                hung = activity
        return hung

    def hang(
        self, host: str, report: m.RankStats, *, hang_timeout: float | None
    ) -> tuple[str, str] | None:
        """:meth:`reported`, and the reason and details of the verdict on the rank that hung, if
        one did."""
        hung = self.reported(host, report, hang_timeout=hang_timeout)
        if hung is None or hang_timeout is None:
            return None
        local_rank = self._ranks[hung.rank].local_rank
        return hang_verdict(hung, host=host, local_rank=local_rank, hang_timeout=hang_timeout)


def hang_verdict(
    hung: m.RankActivity, *, host: str, local_rank: int, hang_timeout: float
) -> tuple[str, str]:
    """The reason and details of the verdict on a rank that hung."""
    process = PROCESS_STATES.get(hung.state, hung.state)
    reason = (
        f"rank {hung.rank} (local rank {local_rank}) on host {host!r} hung: no output and no CPU "
        f"progress for {hung.quiet_s:g} s (--hang-timeout {hang_timeout:g}); its process "
        f"{hung.pid} is {process}"
    )
    store = (
        "it is connected to the rendezvous store"
        if hung.store_connected
        else "it never connected to the rendezvous store"
    )
    last = f"its last output line: {hung.last_line}" if hung.last_line else "it printed nothing"
    return reason, f"{store}; {last}"
