"""A Trainer run's failures that its coordinator may absorb: how each is held, and what the
coordinator is told of it.

In a Trainer run a rank's failed exit, or the loss of its host, is first the coordinator's to
judge: it drops the rank and trains on (an elastic run), or ends the run with its own cause. The
supervisor holds each such failure (:class:`~flodl_async.control.supervision.HeldFailure`) while it
tells the coordinator (:class:`~flodl_async.control.supervision.TellCoordinator`); a failure nobody
absorbs in time is the verdict.

Pure.
"""

from __future__ import annotations

from ..wire import messages as m
from ..wire.restarts import RestartRank
from .exits import describe_exit, exit_cause, failure_details
from .membership import JoinedMember
from .supervision import HeldFailure, TellCoordinator
from .vocab import Announce, Level, Tell


def held_exit(report: m.RankExited, *, after: str = "") -> HeldFailure:
    """A rank's failed exit; ``after``: the restarts it came after (`` after 2 restarts``)."""
    return HeldFailure(
        rank=report.rank,
        reason=describe_exit(report) + after,
        details=failure_details(report),
        details_if_shown=failure_details(report, shown_live=True),
    )


def tell_exit(report: m.RankExited) -> TellCoordinator:
    """The coordinator's word of a rank's failed exit (its agent's own KILL of a rank declared
    dead refines nothing)."""
    return TellCoordinator(
        rank=report.rank,
        reason=f"its process {exit_cause(report)}",
        details=failure_details(report),
        refines=not report.killed_because,
    )


def held_host(
    member: JoinedMember, reason: str, *, gone: frozenset[int]
) -> tuple[tuple[HeldFailure, ...], tuple[TellCoordinator, ...]]:
    """Each rank of a lost host that had not exited yet (``gone``: those that had): held, and
    told."""
    ranks = [r for r in member.ranks if r not in gone]
    verdict = f"agent on host {member.host!r} was lost mid-run: {reason}"
    held = tuple(HeldFailure(rank=r, reason=verdict) for r in ranks)
    told = tuple(
        TellCoordinator(rank=r, reason=f"its host {member.host!r} was lost: {reason}")
        for r in ranks
    )
    return held, told


def restarts_said(max_restarts: int, *, collective: bool) -> tuple[Announce, ...]:
    """What a Trainer run says of ``--max-restarts``, once, as its training starts: a CPU-backend
    run restarts a rank lost to a crash alone, up to ``max_restarts`` times over the run; a
    COLLECTIVE one restarts none (a joiner in a re-formed process group is not built), said loudly,
    since an option silently ignored would look honoured."""
    if max_restarts <= 0:
        return ()
    if collective:
        text = (
            f"--max-restarts {max_restarts} restarts no rank of a COLLECTIVE Trainer run (a "
            "restarted rank cannot rejoin a re-formed process group yet): a lost rank is dropped "
            "and the survivors train on; use backend CPU to restart lost ranks"
        )
        return (Announce(text=text, level=Level.WARNING),)
    text = (
        f"--max-restarts {max_restarts}: a rank lost to a crash is restarted alone and rejoins at "
        f"a round boundary, up to {max_restarts} restart(s) over the run (a rank the coordinator "
        "declared dead for breaking its plan, a liar, is not; a frozen one is)"
    )
    return (Announce(text=text),)


#: How the coordinator words a death by silence (``training.deathchain.silent``), which a frozen
#: rank's agent repeats in ``killed_because`` when it KILLs it (pinned by a test).
FROZEN = "(heartbeat timeout:"


def restartable(report: m.RankExited) -> bool:
    """Whether a Trainer rank's failed exit may be restarted alone: it died by itself (an
    exception, an exit code, a signal not from its agent), or its agent KILLed it once the
    coordinator declared it dead for its silence (frozen: torchelastic's watchdog kills a hung
    worker and restarts it too). One declared dead for breaking its plan (a liar) is not: it would
    lie again, and a restart would let an attacker back in."""
    return not report.killed_because or FROZEN in report.killed_because


class RankRestarts:
    """A Trainer run's ranks restarted alone (``--max-restarts``, counted over the run): each
    rank's latest incarnation, and whether this run restarts any (not a COLLECTIVE one)."""

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self.count = 0
        self.enabled = False  # until the coordinator starts a CPU-backend run
        self._incarnations: dict[int, int] = {}

    def start(self, *, collective: bool) -> tuple[Announce, ...]:
        """The Trainer's coordinator started: what is said of ``--max-restarts``, once."""
        self.enabled = not collective
        return restarts_said(self.max_restarts, collective=collective)

    def restart(
        self, report: m.RankExited, *, host: str | None
    ) -> tuple[Announce, TellCoordinator, Tell[str]] | tuple[()]:
        """``report``'s rank (a failed exit while training runs) restarted alone on ``host`` as its
        next incarnation: said, told to the coordinator (its death chain drops the dead
        incarnation) and asked of its agent; or nothing (no restart left, or not a crash)."""
        if not (self.enabled and restartable(report) and self.count < self.max_restarts):
            return ()
        rank = report.rank
        self.count += 1
        incarnation = self._incarnations[rank] = self._incarnations.get(rank, 0) + 1
        said = Announce(
            text=f"{describe_exit(report)}; restarting rank {rank} alone (restart {self.count} of "
            f"{self.max_restarts}, incarnation {incarnation}); it rejoins at a round boundary",
            level=Level.WARNING,
        )
        ask = RestartRank(round=report.round, rank=rank, incarnation=incarnation)
        return said, tell_exit(report), Tell(to=host or report.host, message=ask)
