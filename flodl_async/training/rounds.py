"""How the coordinator opens a round and words a run's orderly end: pure builders.

:func:`open_round` makes the round in flight and the :class:`~.coordination.StartRound` that
broadcasts its ``Reduce`` (with the plan each rank may claim in it, and, for a checkpoint round,
the bundle's round number); :func:`finish` the ``Shutdown`` and :class:`~.coordination.Finish`
of an orderly end. The coordinator keeps the state; these take what they need of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..control.vocab import Tell
from ..wire import messages as m
from . import plancheck
from .coordination import EVERY_RANK, Action, CoordinatorConfig, Finish, StartRound
from .elche import ElChe
from .losses import LostRanks
from .policy import Backend, Policy
from .regroup import InFlight
from .rejoin import Rejoins
from .spec import TrainerSpec


def open_round(
    spec: TrainerSpec,
    *,
    round_: int,
    kind: str,
    now: float,
    config: CoordinatorConfig,
    alive: frozenset[int],
    claimable: Mapping[int, int],
    from_controller: bool,
    closes_epoch: int | None,
    checkpoint: str | None,
    bundle_round: int,
) -> tuple[InFlight, StartRound]:
    """Round ``round_`` of ``kind`` opens now, expecting every alive rank."""
    # ``upload`` (COLLECTIVE's end) brings the primary's state to the controller. Like ``init``,
    # every alive rank takes part — the primary with its tensors, the others with empty
    # contributions — since each host's relay folds a barrier over all of its live ranks.
    collective = spec.backend is Backend.COLLECTIVE and kind != "upload"
    flying = InFlight(
        round=round_,
        kind=kind,
        started_at=now,
        collective=collective,
        waiting=set(alive),
        closes_epoch=closes_epoch,
    )
    plan = plancheck.round_plan(
        world_size=config.world_size,
        expected=alive,
        claimable=claimable,
        gamma=spec.settings.gamma,
        equal=kind == "final" and spec.policy is Policy.ASYNC,
    )
    if kind == "init" and config.resume is not None:
        # no rank's state seeds a resumed run: every rank sends nothing and takes the bundle's
        plan = dataclasses.replace(plan, root=-1)
    start = StartRound(
        round=round_,
        kind=kind,
        expected=alive,
        from_controller=from_controller,
        reducer=not collective,
        message=m.Reduce(
            round=round_,
            kind=kind,
            from_controller=from_controller,
            reset_inner=kind == "model" and spec.outer.resets_inner,
            plan=plan,
            checkpoint=bundle_round,
        ),
        checkpoint=checkpoint or "",
        bundle_round=bundle_round,
    )
    return flying, start


def finish(
    spec: TrainerSpec,
    *,
    stop_reason: str | None,
    completed_epochs: int,
    alive: int,
    world_size: int,
    lost: LostRanks,
    rejoins: Rejoins,
) -> list[Action]:
    """An orderly end (every epoch trained, or a stop): ``Shutdown`` to every rank, and the
    run's reason."""
    if stop_reason is not None:
        reason = (
            f"training stopped ({stop_reason}) after {completed_epochs} of {spec.epochs} epoch(s)"
        )
        save_reason, interrupted = "graceful_shutdown", True
    else:
        reason = f"training complete: {spec.epochs} epoch(s) on {alive} rank(s)"
        save_reason, interrupted = "completed", False
    reason = lost.degraded(reason, world_size=world_size)
    restarts = rejoins.summary()
    if restarts:
        reason = f"{reason}; {restarts}"
    return [
        Tell(to=EVERY_RANK, message=m.Shutdown(reason=reason, save_reason=save_reason)),
        Finish(
            reason=reason,
            save_reason=save_reason,
            interrupted=interrupted,
            lost=lost.why(),
            restarted=tuple(r.rank for r in rejoins.restarts),
        ),
    ]


def report_window(
    elche: ElChe,
    reports: Mapping[int, m.WindowDone],
    *,
    world_size: int,
    delivered: bool,
    sync_ms: float,
) -> None:
    """A model round fires: ElChe takes each rank's window cost (compute, plus the data wait when
    the policy counts delivered time), its batches and the largest divergence reported."""
    ms = [0.0] * world_size
    batches = [0] * world_size
    for rank, report in reports.items():
        ms[rank] = report.compute_ms + (report.data_ms if delivered else 0.0)
        batches[rank] = report.batches
    divergences = [r.divergence for r in reports.values() if r.divergence >= 0]
    elche.report(ms, batches, sync_ms=sync_ms, divergence=max(divergences) if divergences else None)


def stopped_before_start(why: str) -> list[Action]:
    """A stop while the world is still joining: nothing to save, every rank ends."""
    reason = f"training stopped ({why}) before it started"
    return [
        Tell(to=EVERY_RANK, message=m.Shutdown(reason=reason, save_reason="graceful_shutdown")),
        Finish(reason=reason, save_reason="graceful_shutdown", interrupted=True),
    ]


def welcome(rank: int, config: CoordinatorConfig) -> Tell[int]:
    """``rank``'s hello is accepted: the world, the run, the primary, and the bundle a resumed run
    starts from."""
    resume = config.resume
    return Tell(
        to=rank,
        message=m.TrainerWelcome(
            rank=rank,
            world_size=config.world_size,
            run_id=config.run_id,
            primary_rank=config.primary_rank,
            start_epoch=0 if resume is None else resume.epoch,
            global_step=0 if resume is None else resume.global_step,
            sync_round=0 if resume is None else resume.round,
            resumed=resume is not None,
            restore_rank_state=resume is not None and resume.rank_state,
            resume="" if resume is None else resume.bundle,
        ),
    )
