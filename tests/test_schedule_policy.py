"""The schedule policies alone: what a rank (or an inline process) does at each step boundary, given
what the coordinator said; no link, no torch, no threads."""

from __future__ import annotations

import pytest

from flodl_async.training.metrics import EpochMetrics
from flodl_async.training.policy import Policy
from flodl_async.training.regroup import Regroup
from flodl_async.training.schedule import (
    Asked,
    CloseEpoch,
    Contribute,
    End,
    Finishing,
    Hold,
    InlinePolicy,
    NoteLost,
    Publish,
    RankAction,
    RankPolicy,
    Report,
    Settle,
    Settled,
    Stepped,
    Stop,
    StopSeen,
    Train,
    Via,
    flatten,
)
from flodl_async.wire import messages as m

ASKED = Asked()


def rank_policy(
    *,
    rank: int = 0,
    world_size: int = 2,
    averaging: Policy = Policy.CADENCE,
    collective: bool = False,
    gamma: float = 1.0,
    n_batches: int = 16,
) -> RankPolicy:
    return RankPolicy(
        rank=rank,
        world_size=world_size,
        averaging=averaging,
        collective=collective,
        gamma=gamma,
        n_batches=n_batches,
    )


def plan(
    round_: int,
    first: int,
    n: int,
    *,
    quota: int | None = None,
    hold_after: int = -1,
    epoch: int = 0,
    progress: float = 0.0,
) -> m.Plan:
    return m.Plan(
        rank=0,
        round=round_,
        epoch=epoch,
        ranges=((first, n),),
        quota=n if quota is None else quota,
        hold_after=hold_after,
        progress=progress,
    )


def started(p: RankPolicy, *plans: m.Plan) -> RankPolicy:
    """INIT contributed, then ``plans`` arrived."""
    p.handle(m.Reduce(round=0, kind="init"))
    (init,) = p.handle(ASKED)
    assert isinstance(init, Contribute)
    assert init.kind == "init"
    for each in plans:
        p.handle(each)
    return p


def train(p: RankPolicy, n: int) -> list[int]:
    """Ask and train ``n`` times; the batches trained."""
    out = []
    for _ in range(n):
        actions = p.handle(ASKED)
        assert len(actions) == 1, actions
        (work,) = actions
        assert isinstance(work, Train), work
        out.append(work.batch)
        p.handle(Stepped())
    return out


def last(actions: tuple[RankAction, ...]) -> RankAction:
    return actions[-1]


def metrics(epoch: int, batches: int) -> EpochMetrics:
    return EpochMetrics(
        epoch=epoch,
        avg_loss=1.0,
        epoch_ms=1.0,
        batches=batches,
        samples=batches,
        reduces=0,
        avg_reduce_ms=0.0,
        anchor=0,
        counts=(batches,),
        per_rank=(),
    )


# ----- before and after training -----------------------------------------------------------------


def test_nothing_trains_before_init_even_with_a_plan() -> None:
    p = rank_policy()
    assert p.handle(ASKED) == (Hold(),)
    p.handle(plan(1, 0, 4))
    assert p.handle(ASKED) == (Hold(),)


def test_the_root_seeds_init_and_the_others_send_an_empty_contribution() -> None:
    root, other = rank_policy(rank=0), rank_policy(rank=1)
    for p in (root, other):
        p.handle(m.Reduce(round=0, kind="init", reset_inner=True))
    assert root.handle(ASKED) == (
        Contribute(
            round=0, kind="init", via=Via.LINK, steps=0, weight=1.0, tensors=True, reset_inner=True
        ),
    )
    assert other.handle(ASKED) == (
        Contribute(
            round=0, kind="init", via=Via.LINK, steps=0, weight=0.0, tensors=False, reset_inner=True
        ),
    )


def test_after_the_final_round_the_rank_only_holds_until_the_shutdown_then_ends() -> None:
    p = started(rank_policy(), plan(1, 0, 2, hold_after=2))
    train(p, 2)
    assert p.handle(ASKED) == (Report(round=1, epoch=0),)
    p.handle(m.Reduce(round=1, kind="final"))
    assert isinstance(last(p.handle(ASKED)), Contribute)
    p.handle(plan(2, 2, 2))  # a plan after the final round is never trained
    assert p.handle(ASKED) == (Hold(),)
    assert p.handle(m.Shutdown(reason="done", save_reason="completed")) == ()
    assert p.handle(ASKED) == (End(),)


def test_an_upload_round_also_ends_training() -> None:
    p = started(rank_policy(collective=True), plan(1, 0, 4))
    p.handle(m.Reduce(round=1, kind="upload"))
    assert isinstance(last(p.handle(ASKED)), Contribute)
    assert p.handle(ASKED) == (Hold(),)


def test_a_pending_reduce_is_contributed_before_the_end() -> None:
    p = started(rank_policy(), plan(1, 0, 4))
    p.handle(m.Reduce(round=1, kind="final", from_controller=True))
    p.handle(m.Shutdown(reason="done"))
    assert isinstance(last(p.handle(ASKED)), Contribute)
    assert p.handle(ASKED) == (End(),)


# ----- plans and windows -------------------------------------------------------------------------


def test_a_plan_trains_its_ranges_in_order_with_the_lr_progress_inside_the_plan() -> None:
    p = started(rank_policy(n_batches=8))
    p.handle(
        m.Plan(
            rank=0,
            round=1,
            epoch=3,
            ranges=((4, 2), (0, 1)),
            quota=3,
            hold_after=-1,
            progress=0.5,
        )
    )
    seen = []
    for _ in range(3):
        (work,) = p.handle(ASKED)
        assert isinstance(work, Train)
        seen.append(work)
        p.handle(Stepped())
    assert seen == [
        Train(epoch=3, batch=4, plan=1, progress=0.5),
        Train(epoch=3, batch=5, plan=1, progress=0.625),
        Train(epoch=3, batch=0, plan=1, progress=0.75),
    ]


def test_an_empty_pool_keeps_the_plans_progress() -> None:
    p = started(rank_policy(n_batches=0), plan(1, 0, 2, progress=0.25))
    (work,) = p.handle(ASKED)
    assert isinstance(work, Train)
    assert work.progress == 0.25


def test_flatten_spells_out_the_ranges() -> None:
    assert flatten(((3, 2), (0, 0), (7, 1))) == [3, 4, 7]


def test_the_window_is_reported_at_the_quota_and_the_sync_rank_trains_on_past_it() -> None:
    p = started(rank_policy(averaging=Policy.SYNC), plan(1, 0, 4, quota=2))
    assert train(p, 2) == [0, 1]
    assert p.handle(ASKED) == (Report(round=1, epoch=0),)
    # reported once; training goes on past the quota until the reduce comes
    assert train(p, 2) == [2, 3]
    assert p.handle(ASKED) == (Hold(),)  # the slice is trained out, everything else reported


def test_a_window_planned_empty_is_reported_at_once() -> None:
    p = started(rank_policy(), plan(1, 0, 0, quota=0, epoch=2))
    assert p.handle(ASKED) == (Report(round=1, epoch=2),)
    assert p.handle(ASKED) == (Hold(),)


def test_a_zero_quota_plan_that_is_not_the_open_window_is_not_reported() -> None:
    p = started(rank_policy(), plan(3, 0, 2, quota=2))
    train(p, 2)
    assert p.handle(ASKED) == (Report(round=3, epoch=0),)
    p.handle(m.Reduce(round=3, kind="model"))
    p.handle(ASKED)  # contributes, opening window 4
    p.handle(plan(2, 0, 1, quota=0))  # a stale round: never the open window, so never reported
    p.handle(plan(5, 2, 1, quota=0))
    assert train(p, 1) == [0]
    assert p.handle(ASKED) == (Report(round=5, epoch=0),)  # a newer one opens its window


def test_out_of_data_with_steps_unreported_reports_them() -> None:
    p = started(rank_policy(), plan(1, 0, 3, quota=10))
    train(p, 3)
    assert p.handle(ASKED) == (Report(round=1, epoch=0),)
    assert p.handle(ASKED) == (Hold(),)


def test_out_of_data_with_nothing_trained_reports_nothing() -> None:
    p = started(rank_policy(), plan(1, 0, 0, quota=5))
    assert p.handle(ASKED) == (Hold(),)


def test_a_finished_plan_gives_way_to_the_next_its_window_reported_first() -> None:
    p = started(rank_policy(), plan(1, 0, 2, quota=5))
    train(p, 2)
    p.handle(plan(2, 2, 2, quota=5, epoch=1, progress=0.125))
    actions = p.handle(ASKED)
    assert actions == (Report(round=1, epoch=0), Train(epoch=1, batch=2, plan=2, progress=0.125))
    p.handle(Stepped())
    assert train(p, 1) == [3]
    assert p.handle(ASKED) == (Report(round=2, epoch=1),)  # the new window counts from zero


def test_a_reported_window_is_not_reported_again_when_its_plan_gives_way() -> None:
    p = started(rank_policy(), plan(1, 0, 2))
    train(p, 2)
    assert p.handle(ASKED) == (Report(round=1, epoch=0),)
    p.handle(plan(2, 2, 2))
    assert p.handle(ASKED) == (Train(epoch=0, batch=2, plan=2, progress=0.0),)


def test_several_finished_plans_give_way_at_once() -> None:
    p = started(rank_policy(), plan(1, 0, 1, quota=5))
    train(p, 1)
    p.handle(plan(2, 0, 0, quota=5, epoch=1))  # planned empty: its window is reported empty
    p.handle(plan(3, 1, 1, quota=5, epoch=2))
    assert p.handle(ASKED) == (
        Report(round=1, epoch=0),
        Report(round=2, epoch=1),
        Train(epoch=2, batch=1, plan=3, progress=0.0),
    )


def test_a_model_reduce_opens_the_next_window_a_plan_of_an_older_round_does_not_reopen() -> None:
    p = started(rank_policy(), plan(1, 0, 2, quota=1))
    train(p, 1)
    assert p.handle(ASKED) == (Report(round=1, epoch=0),)
    p.handle(m.Reduce(round=1, kind="model"))
    assert isinstance(last(p.handle(ASKED)), Contribute)
    assert p.window_round == 2
    assert train(p, 1) == [1]
    # the contribution opened window 2: its one step reaches plan 1's quota again
    assert p.handle(ASKED) == (Report(round=2, epoch=0),)


def test_the_window_steps_count_the_open_window() -> None:
    p = started(rank_policy(), plan(1, 0, 4, quota=3))
    train(p, 2)
    assert (p.window_round, p.window_steps) == (1, 2)


def test_the_hold_comes_at_hold_after_steps_since_the_last_contribution() -> None:
    p = started(rank_policy(), plan(1, 0, 8, quota=2, hold_after=3))
    train(p, 2)
    assert p.handle(ASKED) == (Report(round=1, epoch=0),)
    train(p, 1)
    assert p.handle(ASKED) == (Hold(),)
    p.handle(m.Reduce(round=1, kind="model"))
    assert isinstance(last(p.handle(ASKED)), Contribute)
    assert train(p, 1) == [3]  # the contribution restarts the count


def test_hold_after_zero_holds_at_once_and_minus_one_never() -> None:
    p = started(rank_policy(), plan(1, 0, 4, quota=4, hold_after=0))
    assert p.handle(ASKED) == (Hold(),)
    q = started(rank_policy(), plan(1, 0, 4, quota=9, hold_after=-1))
    assert train(q, 4) == [0, 1, 2, 3]


def test_no_plan_holds() -> None:
    p = started(rank_policy())
    assert p.handle(ASKED) == (Hold(),)


# ----- contributions -----------------------------------------------------------------------------


def contribution(p: RankPolicy, reduce: m.Reduce) -> Contribute:
    p.handle(reduce)
    action = last(p.handle(ASKED))
    assert isinstance(action, Contribute)
    return action


def test_a_model_round_weighs_steps_to_the_gamma_and_waits_on_the_link() -> None:
    p = started(rank_policy(gamma=0.5), plan(1, 0, 9, quota=9))
    train(p, 4)
    assert contribution(p, m.Reduce(round=1, kind="model")) == Contribute(
        round=1, kind="model", via=Via.LINK, steps=4, weight=2.0, tensors=True, reset_inner=False
    )
    # nothing trained since: weight 0
    again = contribution(p, m.Reduce(round=2, kind="model"))
    assert (again.steps, again.weight) == (0, 0.0)


@pytest.mark.parametrize(
    ("steps", "gamma", "weight"), [(9, 0.5, 3.0), (1, 1.0, 1.0), (0, 0.0, 0.0), (3, 0.0, 1.0)]
)
def test_a_contributions_weight_is_its_steps_to_the_gamma_and_nothing_trained_weighs_nothing(
    steps: int, gamma: float, weight: float
) -> None:
    p = started(rank_policy(gamma=gamma), plan(1, 0, 9, quota=10))
    train(p, steps)
    assert contribution(p, m.Reduce(round=1, kind="model")).weight == weight


def test_steps_trained_after_a_contribution_count_in_the_new_window_across_a_plan_change() -> None:
    p = started(rank_policy(), plan(1, 0, 3, quota=2), plan(2, 3, 2, quota=2))
    assert train(p, 2) == [0, 1]
    assert p.handle(ASKED) == (Report(round=1, epoch=0),)
    contribution(p, m.Reduce(round=1, kind="model"))  # window 2 opens
    assert train(p, 2) == [2, 3]  # one step on plan 1, one on plan 2: both window 2's
    assert p.handle(ASKED) == (Report(round=2, epoch=0),)


def test_a_final_round_from_the_controller_only_receives_and_keeps_the_step_count() -> None:
    p = started(rank_policy(), plan(1, 0, 4, quota=9, hold_after=2))
    train(p, 2)
    got = contribution(p, m.Reduce(round=1, kind="final", from_controller=True))
    assert got == Contribute(
        round=1,
        kind="final",
        via=Via.RECEIVE,
        steps=2,
        weight=0.0,
        tensors=False,
        reset_inner=False,
    )
    assert p.window_round == 1  # the controller's round opens no window


def test_a_final_round_contributed_by_the_ranks_resets_the_step_count() -> None:
    p = started(rank_policy(), plan(1, 0, 4, quota=9))
    train(p, 3)
    got = contribution(p, m.Reduce(round=1, kind="final"))
    assert (got.via, got.steps, got.weight, got.tensors) == (Via.LINK, 3, 3.0, True)
    assert p.window_round == 2


def test_async_final_round_is_a_plain_mean() -> None:
    p = started(rank_policy(averaging=Policy.ASYNC), plan(1, 0, 4, quota=9))
    train(p, 3)
    got = contribution(p, m.Reduce(round=1, kind="final"))
    assert (got.via, got.steps, got.weight, got.tensors) == (Via.LINK, 3, 1.0, True)


def test_an_upload_round_on_the_cpu_path_sends_only_the_roots_state() -> None:
    for rank, weight in ((0, 1.0), (1, 0.0)):
        p = started(rank_policy(rank=rank, collective=True))
        got = contribution(p, m.Reduce(round=1, kind="upload"))
        assert (got.via, got.weight, got.tensors) == (Via.LINK, weight, rank == 0)


def test_collective_rounds_run_in_place_with_the_weighted_steps() -> None:
    p = RankPolicy(
        rank=1,
        world_size=2,
        averaging=Policy.ASYNC,
        collective=True,
        gamma=1.0,
        n_batches=16,
    )
    p.handle(m.Reduce(round=0, kind="init"))
    (init,) = p.handle(ASKED)
    assert isinstance(init, Contribute)
    assert init.via is Via.COLLECTIVE
    p.handle(plan(1, 0, 4, quota=9))
    train(p, 2)
    got = contribution(p, m.Reduce(round=1, kind="model", from_controller=True))
    assert (got.via, got.steps, got.weight, got.tensors) == (Via.COLLECTIVE, 2, 2.0, True)
    assert train(p, 1) == [2]  # no ASYNC submission outstanding: no hold


def dead(
    rank: int, *, regroup: tuple[int, ...] = (), generation: int = 0, redo: int = -1
) -> m.DeclareDead:
    return m.DeclareDead(
        dead_rank=rank, reason="killed", regroup=regroup, generation=generation, redo=redo
    )


def test_a_collective_re_form_comes_before_a_contribution_queued_with_it() -> None:
    p = started(rank_policy(rank=0, world_size=3, collective=True), plan(1, 0, 4, quota=9))
    train(p, 2)
    assert p.handle(m.Reduce(round=1, kind="model")) == ()
    assert p.handle(dead(1, regroup=(0, 2), generation=1, redo=1)) == (NoteLost(1, "killed"),)
    assert p.handle(ASKED) == (Regroup(ranks=(0, 2), generation=1, redo=1),)
    got = contribution(p, m.Reduce(round=2, kind="model"))  # the queued round 1 first
    assert (got.round, got.via, got.steps) == (1, Via.COLLECTIVE, 2)


def test_a_later_re_form_replaces_one_not_carried_out_and_none_comes_after_the_end() -> None:
    p = started(rank_policy(rank=0, world_size=4, collective=True), plan(1, 0, 4, quota=9))
    p.handle(dead(1, regroup=(0, 2, 3), generation=1))
    p.handle(dead(3, regroup=(0, 2), generation=2, redo=1))
    assert p.handle(ASKED) == (Regroup(ranks=(0, 2), generation=2, redo=1),)
    assert isinstance(last(p.handle(ASKED)), Train)
    p.handle(m.Shutdown(reason="done", save_reason=""))
    p.handle(dead(2, regroup=(0,), generation=3))
    assert p.handle(ASKED) == (End(),)


def test_a_cpu_worlds_loss_re_forms_nothing_on_the_rank() -> None:
    p = started(rank_policy(rank=0, world_size=3), plan(1, 0, 4, quota=9))
    p.handle(dead(1))
    assert isinstance(last(p.handle(ASKED)), Train)


def test_a_world_that_lost_rank_0_uploads_its_lowest_survivors_state() -> None:
    for rank, root in ((1, True), (2, False)):
        p = started(rank_policy(rank=rank, world_size=3, collective=True))
        p.handle(dead(0, regroup=(1, 2), generation=1))
        assert isinstance(p.handle(ASKED)[0], Regroup)
        got = contribution(p, m.Reduce(round=1, kind="upload"))
        assert (got.via, got.weight, got.tensors) == (Via.LINK, 1.0 if root else 0.0, root)


def test_async_model_rounds_are_submitted_and_settled_before_the_next_contribution() -> None:
    p = started(rank_policy(averaging=Policy.ASYNC), plan(1, 0, 8, quota=2))
    train(p, 2)
    p.handle(ASKED)  # report
    sub = contribution(p, m.Reduce(round=1, kind="model"))
    assert (sub.via, sub.steps, sub.weight, sub.tensors) == (Via.SUBMIT, 2, 2.0, True)
    train(p, 2)  # training goes on while the consensus is out
    p.handle(ASKED)  # report
    p.handle(m.Reduce(round=2, kind="model"))
    settle, nxt = p.handle(ASKED)
    assert settle == Settle()
    assert isinstance(nxt, Contribute)
    assert nxt.via is Via.SUBMIT
    assert p.handle(Settled()) == ()
    p.handle(m.Reduce(round=3, kind="model"))
    (only,) = p.handle(ASKED)  # settled already: nothing to wait for
    assert isinstance(only, Contribute)


def test_an_outstanding_submission_holds_a_rank_with_its_plan_trained_out() -> None:
    p = started(rank_policy(averaging=Policy.ASYNC), plan(1, 0, 2, quota=1))
    train(p, 1)
    p.handle(ASKED)  # report
    contribution(p, m.Reduce(round=1, kind="model"))
    assert train(p, 1) == [1]  # outstanding, but data left: trains
    assert p.handle(ASKED) == (Report(round=2, epoch=0),)
    assert p.handle(ASKED) == (Hold(),)
    p.handle(Settled())
    p.handle(plan(2, 2, 1))
    assert train(p, 1) == [2]


def test_the_end_settles_an_outstanding_submission_first() -> None:
    p = started(rank_policy(averaging=Policy.ASYNC), plan(1, 0, 2, quota=1))
    train(p, 1)
    contribution(p, m.Reduce(round=1, kind="model"))
    p.handle(m.Shutdown(reason="stop", save_reason="graceful_shutdown"))
    assert p.handle(ASKED) == (Settle(), End())
    assert p.handle(ASKED) == (End(),)


# ----- the coordinator's other messages, and the outcome -----------------------------------------


def test_aggregated_epochs_are_published_and_counted() -> None:
    p = rank_policy(world_size=3)
    first, second = metrics(2, 10), metrics(1, 5)
    assert p.handle(m.EpochAggregated(metrics=first)) == (Publish(first),)
    assert p.handle(m.EpochAggregated(metrics=second)) == (Publish(second),)
    p.handle(m.Shutdown(reason="done", save_reason="completed"))
    outcome = p.outcome
    assert outcome.epochs_completed == 2  # the highest epoch seen (counted from 1)
    assert outcome.global_step == 5  # 15 cohort batches over 3 ranks
    assert outcome.interrupted is False


def test_deaths_are_noted_and_counted_out_of_the_world() -> None:
    p = rank_policy(world_size=4)
    assert p.handle(m.DeclareDead(dead_rank=3, reason="killed")) == (NoteLost(3, "killed"),)
    p.handle(m.DeclareDead(dead_rank=1, reason="gone"))
    p.handle(m.DeclareDead(dead_rank=3, reason="again"))
    p.handle(m.Shutdown(reason="stopped", save_reason="graceful_shutdown"))
    outcome = p.outcome
    assert (outcome.world_size, outcome.lost_ranks) == (2, (1, 3))
    assert outcome.interrupted is True
    assert (outcome.epochs_completed, outcome.global_step) == (0, 0)


def test_a_rank_told_it_is_dead_stops_and_never_returns_a_state() -> None:
    # a frozen rank resumed before its agent's KILL learns it was dropped: it stops at once
    p = rank_policy(rank=1, world_size=3)
    why = "no frame for 10 s (heartbeat timeout)"
    assert p.handle(m.DeclareDead(dead_rank=1, reason=why)) == (
        Stop(f"rank 1 was declared dead: {why}"),
    )


def test_a_world_of_zero_counts_no_steps_without_dividing_by_zero() -> None:
    p = rank_policy(world_size=0)
    p.handle(m.EpochAggregated(metrics=metrics(0, 7)))
    p.handle(m.Shutdown(reason="done"))
    assert p.outcome.global_step == 7


@pytest.mark.parametrize("save_reason", ["", "completed", "graceful_shutdown"])
def test_a_normal_shutdown_ends(save_reason: str) -> None:
    p = rank_policy()
    assert p.handle(m.Shutdown(reason="x", save_reason=save_reason)) == ()
    assert p.handle(ASKED) == (End(),)


def test_a_failure_shutdown_stops_with_the_coordinators_reason() -> None:
    p = rank_policy()
    got = p.handle(m.Shutdown(reason="rank 1 lost: killed", save_reason="all_ranks_lost"))
    assert got == (Stop("the coordinator stopped the run: rank 1 lost: killed"),)
    with pytest.raises(RuntimeError, match="rank 0: the run has not ended"):
        _ = p.outcome


def test_a_reject_stops_the_rank() -> None:
    p = rank_policy(rank=2)
    assert p.handle(m.TrainerReject(rank=2, reason="spec mismatch")) == (
        Stop("the coordinator refused rank 2: spec mismatch"),
    )


def test_messages_a_rank_does_not_act_on_change_nothing() -> None:
    p = started(rank_policy(), plan(1, 0, 2))
    assert p.handle(m.Heartbeat(sent_at=0.0, rank=0)) == ()
    assert train(p, 2) == [0, 1]


# ----- inline ------------------------------------------------------------------------------------


def inline_walk(p: InlinePolicy, asks: int) -> list[object]:
    out: list[object] = []
    for _ in range(asks):
        actions = p.handle(ASKED)
        out.extend(actions)
        if isinstance(actions[-1], Train):
            p.handle(Stepped())
    return out


def test_inline_walks_every_epoch_closing_each_then_ends() -> None:
    p = InlinePolicy(epochs=2, n_batches=2)
    assert inline_walk(p, 5) == [
        Train(epoch=0, batch=0, plan=0, progress=0.0),
        Train(epoch=0, batch=1, plan=0, progress=0.5),
        CloseEpoch(0),
        Train(epoch=1, batch=0, plan=1, progress=1.0),
        Train(epoch=1, batch=1, plan=1, progress=1.5),
        CloseEpoch(1),
        End(),
    ]
    assert p.handle(Finishing()) == ()
    outcome = p.outcome
    assert (outcome.epochs_completed, outcome.global_step, outcome.interrupted) == (2, 4, False)
    assert (outcome.world_size, outcome.lost_ranks) == (1, ())


def test_inline_stop_mid_epoch_is_an_interruption_and_leaves_the_epoch_open() -> None:
    p = InlinePolicy(epochs=2, n_batches=3)
    inline_walk(p, 1)
    p.handle(StopSeen())
    assert p.interrupted
    assert p.handle(ASKED) == (End(),)
    assert p.handle(Finishing()) == ()
    outcome = p.outcome
    assert (outcome.epochs_completed, outcome.global_step, outcome.interrupted) == (0, 1, True)


def test_inline_stop_on_an_epochs_last_batch_closes_that_epoch_at_the_finish() -> None:
    p = InlinePolicy(epochs=2, n_batches=2)
    inline_walk(p, 2)
    p.handle(StopSeen())
    assert p.handle(Finishing()) == ()  # interrupted: the epoch stays open
    q = InlinePolicy(epochs=2, n_batches=2)
    inline_walk(q, 2)
    assert q.handle(Finishing()) == (CloseEpoch(0),)  # the managed loop broke off on its own
    assert q.outcome.epochs_completed == 1


def test_inline_stop_after_the_last_epoch_is_no_interruption() -> None:
    p = InlinePolicy(epochs=1, n_batches=1)
    inline_walk(p, 1)
    assert p.handle(Finishing()) == (CloseEpoch(0),)
    p.handle(StopSeen())
    assert p.outcome.interrupted is False


def test_inline_zero_epochs_ends_at_once() -> None:
    p = InlinePolicy(epochs=0, n_batches=2)
    assert p.handle(ASKED) == (End(),)
    assert p.handle(Finishing()) == ()


def test_a_window_opened_with_nothing_trained_since_the_report_is_not_reported() -> None:
    p = started(rank_policy(), plan(1, 0, 2, quota=2))
    train(p, 2)
    assert p.handle(ASKED) == (Report(round=1, epoch=0),)
    contribution(p, m.Reduce(round=1, kind="model"))  # window 2 opens, the data is trained out
    assert p.handle(ASKED) == (Hold(),)
