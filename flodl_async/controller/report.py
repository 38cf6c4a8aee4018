"""What the controller says about its run: the status snapshot it publishes, the port's connection
counters, the join window's banner, the levels of the supervisor's announcements in the log, and
the Trainer's rounds and epochs as events of the run's stream (:class:`RoundTally`,
:func:`epoch_event`).

Plain functions of what the controller knows at the moment it reports (its plan, the supervisor's
view, its own verdict); the shell calls them and publishes or logs the result. No I/O here but the
banner's log lines.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping

from ..config.plan import LaunchPlan
from ..control.membership import describe_threshold
from ..control.supervision import SupervisorView
from ..net.mux import MuxStatistics
from ..status import Counters, MemberStatus, Phase, RankStatus, StatusSnapshot
from ..status.events import EpochDone, RankShare, RoundDone, ScalarsReported
from ..training.metrics import EpochMetrics
from ..verdict import RunResult
from ..wire import messages as m
from ..wire.scalars import Report

# the launcher's own logger: the banner is one of its lines
log = logging.getLogger("flodl_async.cli.launch")

#: The supervisor's ``Announce`` levels as the log's.


def announce_window(plan: LaunchPlan, port: int) -> None:
    """Log the join window's terms (and, under open admission, the warning that goes with it)."""
    j = plan.join
    if j.open_admission:
        log.warning(
            "WARNING: OPEN ADMISSION — any host that reaches port %d joins this run without a "
            "secret or token, and is sent "
            "the session secret over a link anyone on the network can decrypt; use it on a "
            "trusted network only "
            "(set join.open_admission: false and give agents a cluster token: flodl token new)",
            port,
        )
    log.log(
        logging.DEBUG if plan.one_host else logging.INFO,
        "window open (quorum %s ranks, target %s, window %gs, cap %gs, admission: %s) — status "
        "at http://%s:%d/",
        describe_threshold(j.min_rank_start, j.quorum_reported),
        describe_threshold(j.target_ranks, j.target_reported)
        if j.target_ranks is not None
        else "none",
        j.join_timeout,
        j.max_join_timeout,
        "open"
        if j.open_admission
        else "cluster token or pre-shared secret"
        if plan.token is not None
        else "pre-shared secret",
        "127.0.0.1" if plan.bind_host in ("0.0.0.0", "127.0.0.1") else plan.bind_host,
        port,
    )


def connection_counters(stats: MuxStatistics) -> Counters:
    """The status page's ``connections`` block, from the port's statistics."""
    return {
        "routed": stats.routed,
        # by reason: evicted, handshake_timeout, auth_failed, unknown_magic...
        "dropped": stats.dropped,
        "accept_errors": stats.accept_errors,
        # failed proofs, answers the proof throttle delayed, addresses it slows now
        "throttle": stats.throttle,
        # connections the accept-rate breaker closed at once (also dropped["churning"])
        "breaker": stats.breaker,
        "open": {
            "total": stats.open_now,
            "unsniffed": stats.unsniffed_now,
            "handshaking": stats.handshaking_now,
            "status": stats.status_now,
            "streams": stats.streams_now,
            "store": stats.store_now,
        },
    }


def status_snapshot(
    plan: LaunchPlan,
    view: SupervisorView | None,
    *,
    final: RunResult | None,
    started_at: float,
    opened_at: float,
    training: Mapping[str, object] | None,
) -> StatusSnapshot:
    """The run as the status page shows it now.

    ``view``: the supervisor's (None before it exists: the run is ``waiting``). ``final``: a
    verdict the supervisor did not give (an internal error, a cancel), which wins. Join times are
    monotonic (``opened_at`` is the window's opening) and shown on the wall clock of
    ``started_at``.
    """
    phase, world_size, joined, restarts = Phase.WAITING, 0, 0, 0
    members: tuple[MemberStatus, ...] = ()
    ranks: tuple[RankStatus, ...] = ()
    result = final
    if view is not None:
        result = final or view.result
        phase = Phase.FAILED if final is not None else Phase(view.phase)
        world_size, joined, restarts = view.world_size, view.joined_ranks, view.restart_count
        members = tuple(
            MemberStatus(
                host=mb.host,
                ranks=mb.ranks,
                devices=mb.devices,
                joined_at=started_at + (mb.joined_at - opened_at),
            )
            for mb in view.members
        )
        ranks = view.ranks
    return StatusSnapshot(
        run_id=plan.run_id,
        phase=phase,
        started_at=started_at,
        updated_at=time.time(),
        world_size=world_size,
        joined_ranks=joined,
        min_rank_start=plan.join.min_rank_start,
        target_ranks=plan.join.target_ranks or 0,
        restart_count=restarts,
        members=members,
        ranks=ranks,
        verdict=result.reason if result is not None else "",
        exit_code=int(result.exit_code) if result is not None else None,
        training=training,
    )


class RoundTally:
    """The ranks' window reports between two committed rounds, told as one :class:`RoundDone`.

    Windows are counted as they arrive, before the coordinator judges them: a dead rank's late
    window may weigh in a round's loss (an epoch's loss is the coordinator's ledger, which drops
    it)."""

    def __init__(self) -> None:
        self._batches = 0
        self._loss_sum = 0.0
        self._busy_ms = 0.0

    def window(self, report: m.WindowDone) -> None:
        """One rank's window report (its loss and busy time over its batches)."""
        self._batches += report.batches
        self._loss_sum += report.loss_sum
        self._busy_ms += report.compute_ms + report.data_ms

    def committed(self, round_: int, kind: str, duration_ms: float) -> RoundDone:
        """The round committed: the windows since the last one, and start counting again."""
        batches = self._batches
        done = RoundDone(
            round=round_,
            round_kind=kind,
            reduce_s=duration_ms / 1000,
            batches=batches,
            loss=self._loss_sum / batches if batches else None,
            step_s=self._busy_ms / 1000 / batches if batches else None,
        )
        self._batches, self._loss_sum, self._busy_ms = 0, 0.0, 0.0
        return done


def epoch_event(metrics: EpochMetrics, epochs: int) -> EpochDone:
    """An epoch the coordinator closed, as an event of the run."""
    return EpochDone(
        epoch=metrics.epoch,
        epochs=epochs,
        avg_loss=metrics.avg_loss,
        epoch_s=metrics.epoch_ms / 1000,
        batches=metrics.batches,
        reduces=metrics.reduces,
        avg_reduce_s=metrics.avg_reduce_ms / 1000,
        anchor=metrics.anchor,
        per_rank=tuple(
            RankShare(
                rank=r.rank,
                batches=r.batches,
                batch_share=r.batch_share,
                throughput=r.throughput,
                avg_loss=r.avg_loss,
                alive=r.alive,
            )
            for r in metrics.per_rank
        ),
        scalars=dict(metrics.scalars),
    )


#: What a rank's ``fa.report`` may name: at most this many scalars a report, each name this long.
MAX_REPORTED_NAMES = 64
MAX_NAME_LENGTH = 100


def scalars_event(report: Report) -> ScalarsReported | None:
    """A rank's report as an event: printable names of at most :data:`MAX_NAME_LENGTH` characters
    and finite values, the first :data:`MAX_REPORTED_NAMES` of them (None when none is left)."""
    kept = {
        name: float(value)
        for name, value in list(report.scalars.items())[:MAX_REPORTED_NAMES]
        if 0 < len(name) <= MAX_NAME_LENGTH and name.isprintable() and math.isfinite(value)
    }
    return ScalarsReported(rank=report.rank, scalars=kept) if kept else None


def emit_scalars(emit: Callable[[ScalarsReported], None], report: Report) -> None:
    """Put a rank's report on the run's event stream, if anything of it is kept."""
    event = scalars_event(report)
    if event is not None:
        emit(event)
