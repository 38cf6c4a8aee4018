"""Pure tests of ElChe and the TrendGuard."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flodl_async.training.elche import (
    COHORT_BAND,
    DOMINANCE_MARGIN,
    ElChe,
    ElChePhase,
    NudgeDown,
    Stable,
    SuppressGrowth,
    TrendGuard,
    WorldSizeMismatch,
)
from flodl_async.training.policy import Policy
from flodl_async.training.spec import ElCheConfig, ElCheSettings, resolve_elche
from flodl_async.training.spec import TrendGuard as GuardConfig


def cfg(policy: Policy = Policy.CADENCE, **overrides: object) -> ElCheSettings:
    return resolve_elche(ElCheConfig(**overrides), policy)  # type: ignore[arg-type]


def elche(
    world: int = 2, *, epoch: int = 10_000, growth: bool = True, **overrides: object
) -> ElChe:
    overrides.setdefault("guard", None)
    return ElChe(world, cfg(**overrides), batches_per_epoch=epoch, growth=growth)


def test_the_first_window_is_equal_counts() -> None:
    assert elche(3).counts == (10, 10, 10)


def test_the_slow_rank_anchors_and_the_fast_one_does_proportionally_more() -> None:
    e = elche()
    e.report([100.0, 200.0], [10, 10], sync_ms=5.0)
    assert e.anchor_rank == 1
    assert e.counts == (20, 10)  # rank 0 is twice as fast: twice the batches


def test_speed_hint_sets_initial_counts_and_the_anchor() -> None:
    e = elche(3, speed_hint=(2, 3.0))
    assert e.counts == (30, 30, 10)
    assert e.anchor_rank == 2


def test_max_speed_ratio_clamps_a_degenerate_reading() -> None:
    e = elche()
    e.report([0.01, 200.0], [10, 10], sync_ms=0.0)
    assert e.counts == (640, 10)  # 64 x the anchor, not 2e5 batches


def test_the_dead_zone_ignores_small_changes() -> None:
    e = elche()
    e.report([100.0, 200.0], [10, 10], sync_ms=0.0)
    assert e.counts == (20, 10)
    for _ in range(4):  # rank 0 slightly slower: target 19, inside 5 % of 20
        e.report([105.0, 200.0], [10, 10], sync_ms=0.0)
    assert e.counts == (20, 10)
    e2 = elche()
    e2.report([100.0, 200.0], [10, 10], sync_ms=0.0)
    e2.report(
        [200.0, 200.0], [10, 10], sync_ms=0.0
    )  # smoothed 150 vs 200: target 13, far outside the zone
    assert e2.counts == (13, 10)


def test_max_batch_diff_clamps_each_update() -> None:
    e = elche(max_batch_diff=2)
    e.report([100.0, 200.0], [10, 10], sync_ms=0.0)  # the first calibration is not clamped
    assert e.counts == (20, 10)
    e.report([10.0, 200.0], [10, 10], sync_ms=0.0)  # wants much more: +2 at most
    assert e.counts == (22, 10)


def test_the_window_is_capped_at_one_epoch() -> None:
    e = elche(3, epoch=20)
    e.report([50.0, 100.0, 200.0], [10, 10, 10], sync_ms=0.0)  # wants (40, 20, 10) = 70 > 20
    assert sum(e.counts) == 20
    assert e.counts == (13, 5, 2)  # floor(c*20/70) = (11, 5, 2), the remainder to the largest
    tiny = elche(3, epoch=2)
    assert tiny.counts == (1, 1, 1)  # more ranks than batches: the per-rank floor of 1 wins


def test_the_floors_excess_comes_back_from_the_ranks_holding_the_most() -> None:
    e = elche(10, epoch=12)
    # Two ranks far faster than eight (clamped at 64x): (640, 640, 10 x 8) scales to floors of
    # (5, 5, 0 x 8); the eight raised to 1 put the window 6 over the epoch. Taken all from one
    # rank it could not fit (that rank keeps 1 too); taken a batch at a time from the rank
    # holding the most, the two fast ranks share what is left and stay ahead of the slow ones.
    e.report([0.01, 0.01, *[100.0] * 8], [10] * 10, sync_ms=0.0)
    assert e.counts == (2, 2, 1, 1, 1, 1, 1, 1, 1, 1)


def test_growth_formula_cap_and_warmup_margin() -> None:
    e = elche(anchor=10, overhead_target=0.05)
    # slow = 20 ms/batch; anchor·slow = 200 ms. sync 15 ms -> overhead 0.0698: above the target, under 2x (WARMUP).
    e.report([200.0, 200.0], [10, 10], sync_ms=15.0)
    assert e.anchor == 10  # the first report never proposes
    e.report([200.0, 200.0], [10, 10], sync_ms=15.0)
    assert e.phase is ElChePhase.WARMUP
    assert e.anchor == 10  # WARMUP needs 2x the target
    e.report([200.0, 200.0], [10, 10], sync_ms=100.0)  # overhead 0.333 -> ratio 6.7, capped at 2x
    assert e.anchor == 20
    assert e.counts == (20, 20)


def test_growth_in_stable_uses_the_plain_target_and_respects_max_anchor() -> None:
    e = elche(anchor=10, max_anchor=14, overhead_target=0.05)
    for _ in range(4):
        e.report([200.0, 200.0], [10, 10], sync_ms=0.0)
    e.report(
        [200.0, 200.0], [10, 10], sync_ms=15.0
    )  # 5th calibration: STABLE, overhead 0.0698 > 0.05
    assert e.phase is ElChePhase.STABLE
    assert e.anchor == 14  # ceil(10 * 1.395) = 14, within max_anchor


def test_sync_never_grows() -> None:
    e = ElChe(2, cfg(Policy.SYNC), batches_per_epoch=1000, growth=False)
    for _ in range(6):
        e.report([200.0, 200.0], [10, 10], sync_ms=500.0)
    assert e.anchor == 1


def test_phases_advance_at_1_5_20_calibrations() -> None:
    e = elche()
    seen = []
    for _ in range(21):
        e.report([100.0, 100.0], [1, 1], sync_ms=0.0)
        seen.append(e.phase)
    assert seen[0] is ElChePhase.WARMUP
    assert seen[3] is ElChePhase.WARMUP
    assert seen[4] is ElChePhase.STABLE
    assert seen[18] is ElChePhase.STABLE
    assert seen[19] is ElChePhase.MATURE
    empty = elche()
    empty.report([0.0, 0.0], [0, 0], sync_ms=0.0)
    assert empty.phase is ElChePhase.PROBE  # an empty report is no calibration


def test_anchor_reelection_needs_dominance() -> None:
    e = elche(3)
    e.report([100.0, 200.0, 190.0], [10, 10, 10], sync_ms=0.0)
    assert e.anchor_rank == 1
    for _ in range(
        6
    ):  # rank 2 becomes 8 % slower than rank 1: within the margin, the incumbent stays
        e.report([100.0, 200.0, 216.0], [10, 10, 10], sync_ms=0.0)
    assert e.anchor_rank == 1
    for _ in range(6):  # now 25 % slower: it takes the anchor
        e.report([100.0, 200.0, 300.0], [10, 10, 10], sync_ms=0.0)
    assert e.anchor_rank == 2


def test_adapt_false_freezes_counts() -> None:
    e = elche(adapt=False, speed_hint=(1, 2.0))
    for _ in range(6):
        e.report([10.0, 200.0], [10, 10], sync_ms=100.0)
    assert e.counts == (20, 10)
    assert e.anchor == 10


def test_guard_verdicts() -> None:
    g = TrendGuard(threshold=0.05, nudge_factor=0.5)
    assert isinstance(g.observe(0.01), Stable)
    assert isinstance(g.observe(0.02), Stable)  # fewer than 3 values
    assert isinstance(g.observe(0.03), SuppressGrowth)  # rising, under the threshold
    assert g.observe(0.06) == NudgeDown(factor=0.5)  # rising past it
    assert isinstance(g.observe(0.06), Stable)  # not strictly rising
    assert len(g.history) == 5


def test_nudge_shrinks_the_anchor_with_ceil_and_clamp_and_latches_growth() -> None:
    e = ElChe(
        2,
        cfg(anchor=9, guard=GuardConfig(threshold=0.05, nudge_factor=0.5)),
        batches_per_epoch=10_000,
        growth=True,
    )
    for d in (0.01, 0.02, 0.06):
        e.report([100.0, 100.0], [10, 10], sync_ms=0.0, divergence=d)
    assert e.anchor == 5  # ceil(9 * 0.5), below min_anchor: the guard's shrink ignores it
    assert not e.growth_enabled
    for _ in range(5):
        e.report([100.0, 100.0], [10, 10], sync_ms=0.0, divergence=0.0)
    assert e.growth_enabled  # re-armed after 5 Stable
    hard = ElChe(
        2,
        cfg(anchor=100, guard=GuardConfig(threshold=0.05, nudge_factor=0.01)),
        batches_per_epoch=10_000,
        growth=True,
    )
    for d in (0.1, 0.2, 0.3):
        hard.report([100.0, 100.0], [10, 10], sync_ms=0.0, divergence=d)
    assert hard.anchor == 10  # the factor is clamped to 0.1


def test_a_growth_proposal_waits_for_the_guards_stable() -> None:
    e = ElChe(
        2,
        cfg(anchor=10, guard=GuardConfig(threshold=0.5, nudge_factor=0.5)),
        batches_per_epoch=10_000,
        growth=True,
    )
    e.report([200.0, 200.0], [10, 10], sync_ms=0.0, divergence=0.01)
    e.report([200.0, 200.0], [10, 10], sync_ms=0.0, divergence=0.02)
    e.report(
        [200.0, 200.0], [10, 10], sync_ms=100.0, divergence=0.03
    )  # proposes 20, but the trend suppresses it
    assert e.anchor == 10
    assert not e.growth_enabled


def test_restore_round_trips_and_refuses_another_world_size() -> None:
    e = elche(speed_hint=(1, 2.0))
    e.report([100.0, 200.0], [10, 10], sync_ms=0.0)
    state = e.snapshot()
    again = elche()
    again.restore(state)
    assert again.snapshot() == state
    with pytest.raises(
        WorldSizeMismatch,
        match="ElChe state was saved with world size 2 but this run has 3; resume must use the same world size",
    ):
        elche(3).restore(state)
    assert dataclasses.replace(state, anchor=3) != state


@settings(max_examples=150, deadline=None)
@given(
    world=st.integers(1, 6),
    # Half the draws in epochs of a few batches, and repeated costs and empty reports: the epoch
    # cap and its floor of 1 a rank only bind where the window is many times the epoch.
    epoch=st.integers(1, 12) | st.integers(1, 400),
    reports=st.lists(
        st.lists(
            st.tuples(
                st.sampled_from([0.0, 1.0, 8.0, 500.0]) | st.floats(0.0, 5000.0),
                st.sampled_from([0, 1]) | st.integers(0, 50),
            ),
            min_size=6,
            max_size=6,
        ),
        min_size=1,
        max_size=12,
    ),
)
# Found by Hypothesis: a 5-batch epoch over 6 ranks, three of them without a reading. The cap's
# floor of 1 per rank used to hand out 7 batches where the bound is 6.
@example(
    world=6,
    epoch=5,
    reports=[[(0.0, 0), (0.0, 0), (0.0, 0), (1.0, 1), (1.0, 1), (8.0, 1)]],
)
def test_counts_stay_positive_and_within_one_epoch(
    world: int, epoch: int, reports: list[list[tuple[float, int]]]
) -> None:
    e = elche(world, epoch=epoch)
    for rows in reports:
        e.report([ms for ms, _ in rows[:world]], [n for _, n in rows[:world]], sync_ms=rows[0][0])
        assert all(c >= 1 for c in e.counts)
        assert sum(e.counts) <= max(epoch, world)
        assert e.settings.min_anchor <= e.anchor <= e.settings.max_anchor


def guarded(
    world: int = 2, *, threshold: float = 0.5, nudge: float = 0.5, **overrides: object
) -> ElChe:
    guard = GuardConfig(threshold=threshold, nudge_factor=nudge)
    return ElChe(world, cfg(guard=guard, **overrides), batches_per_epoch=10_000, growth=True)


def test_a_world_without_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^ElChe needs at least one rank, got 0$"):
        elche(0)


def test_a_report_of_the_wrong_shape_is_refused_with_both_lengths() -> None:
    e = elche()
    with pytest.raises(
        ValueError, match=r"^a report of 2 costs and 1 batch counts for a world of 2$"
    ):
        e.report([100.0, 100.0], [10], sync_ms=0.0)
    with pytest.raises(
        ValueError, match=r"^a report of 1 costs and 2 batch counts for a world of 2$"
    ):
        e.report([100.0], [10, 10], sync_ms=0.0)


def test_a_speed_hint_for_a_rank_outside_the_world_is_ignored() -> None:
    e = elche(2, speed_hint=(2, 3.0))
    assert e.counts == (10, 10)
    assert e.anchor_rank is None


def test_a_speed_hint_rounds_the_fast_ranks_count() -> None:
    e = elche(3, anchor=1, speed_hint=(0, 1.4))
    assert e.counts == (1, 1, 1)  # round(1.4) = 1: no rank is handed a batch it was not hinted


def test_the_trust_window_is_the_last_five_readings() -> None:
    e = elche()
    for _ in range(5):
        e.report([100.0, 100.0], [10, 10], sync_ms=0.0)
    for _ in range(5):
        e.report([200.0, 100.0], [10, 10], sync_ms=0.0)
    assert e.smoothed(0) == 20.0  # the five 10 ms readings have left the window
    assert e.smoothed(1) == 10.0


def test_five_empty_reports_in_a_row_clear_a_rank_and_a_reading_resets_the_count() -> None:
    e = elche()
    e.report([100.0, 100.0], [10, 10], sync_ms=0.0)
    for _ in range(4):
        e.report([0.0, 100.0], [0, 10], sync_ms=0.0)
    assert e.smoothed(0) == 10.0  # four misses: the reading still steers
    e.report([100.0, 100.0], [10, 10], sync_ms=0.0)  # a reading starts the count again
    for _ in range(4):
        e.report([0.0, 100.0], [0, 10], sync_ms=0.0)
    assert e.smoothed(0) == 10.0
    e.report([0.0, 100.0], [0, 10], sync_ms=0.0)
    assert e.smoothed(0) is None  # the fifth miss in a row clears it


def test_a_restored_reading_also_lasts_five_empty_reports() -> None:
    saved = elche()
    saved.report([100.0, 200.0], [10, 10], sync_ms=0.0)
    e = elche()
    e.restore(saved.snapshot())
    for _ in range(4):
        e.report([0.0, 200.0], [0, 10], sync_ms=0.0)
    assert e.smoothed(0) == 10.0
    e.report([0.0, 200.0], [0, 10], sync_ms=0.0)
    assert e.smoothed(0) is None


def test_a_rank_whose_readings_were_cleared_falls_back_to_the_anchors_count() -> None:
    e = elche(anchor=20)
    e.report([200.0, 190.0], [10, 10], sync_ms=0.0)
    assert (e.anchor_rank, e.counts) == (0, (20, 21))
    for _ in range(5):
        e.report([200.0, 0.0], [10, 0], sync_ms=0.0)
    assert e.smoothed(1) is None
    assert e.counts == (20, 20)  # within the dead zone of 21, but not a reading any more


def test_a_report_without_a_guard_returns_no_verdict_even_with_a_divergence() -> None:
    e = elche()
    assert e.report([100.0, 200.0], [10, 10], sync_ms=0.0) is None
    assert e.report([100.0, 200.0], [10, 10], sync_ms=0.0, divergence=0.3) is None
    assert e.counts == (20, 10)


def test_the_guard_judges_only_reported_non_negative_divergences() -> None:
    e = guarded()
    assert e.report([100.0, 100.0], [10, 10], sync_ms=0.0) is None
    assert e.report([100.0, 100.0], [10, 10], sync_ms=0.0, divergence=-1.0) is None
    assert e.snapshot().trend_history == ()
    assert e.report([100.0, 100.0], [10, 10], sync_ms=0.0, divergence=0.0) == Stable()
    assert e.snapshot().trend_history == (0.0,)


def test_forget_clears_the_rank_and_releases_the_anchor_only_if_it_held_it() -> None:
    e = elche(3)
    e.report([100.0, 200.0, 150.0], [10, 10, 10], sync_ms=0.0)
    assert e.anchor_rank == 1
    e.forget(2)
    assert e.smoothed(2) is None
    assert e.anchor_rank == 1
    e.forget(1)
    assert e.smoothed(1) is None
    assert e.snapshot().anchor_rank is None
    e.report([100.0, 0.0, 0.0], [10, 0, 0], sync_ms=0.0)
    assert e.anchor_rank == 0  # the only rank left with a reading


def test_below_stable_the_incumbent_anchor_stays_even_when_outrun() -> None:
    e = elche()
    e.report([100.0, 200.0], [10, 10], sync_ms=0.0)
    assert e.anchor_rank == 1
    e.report([300.0, 200.0], [10, 10], sync_ms=0.0)
    e.report([300.0, 200.0], [10, 10], sync_ms=0.0)
    assert e.phase is ElChePhase.WARMUP
    assert e.smoothed(0) == pytest.approx(70 / 3)  # 17 % slower than the anchor's 20 ms
    assert e.smoothed(1) == 20.0
    assert e.anchor_rank == 1


def test_an_anchor_without_readings_is_replaced_before_stable() -> None:
    e = elche()
    e.report([100.0, 200.0], [10, 10], sync_ms=0.0)
    for _ in range(5):  # nobody calibrates: every window clears, the anchor rank is kept
        e.report([0.0, 0.0], [0, 0], sync_ms=0.0)
    assert e.anchor_rank == 1
    e.report([100.0, 0.0], [10, 0], sync_ms=0.0)
    assert e.phase is ElChePhase.WARMUP
    assert e.anchor_rank == 0


def test_the_cohort_reaches_down_to_fifteen_percent_under_the_slowest() -> None:
    e = elche()
    slowest = 200.0
    e.report([slowest * (1 - COHORT_BAND), slowest], [1, 1], sync_ms=0.0)
    assert e.anchor_rank == 0  # in the cohort by a hair: the lowest rank of it anchors
    out = elche()
    out.report([slowest * (1 - COHORT_BAND) - 0.5, slowest], [1, 1], sync_ms=0.0)
    assert out.anchor_rank == 1


def test_a_cohort_member_inside_the_margin_does_not_unseat_the_incumbent() -> None:
    e = elche(3)
    e.report([100.0, 150.0, 200.0], [10, 10, 10], sync_ms=0.0)
    assert e.anchor_rank == 2
    for _ in range(6):  # rank 1 becomes 5 % slower than the anchor: inside the 10 % margin
        e.report([100.0, 210.0, 200.0], [10, 10, 10], sync_ms=0.0)
    assert e.phase >= ElChePhase.STABLE
    assert e.anchor_rank == 2


def test_dominance_is_strictly_more_than_the_margin() -> None:
    e = elche()
    for _ in range(5):
        e.report([200.0, 250.0], [1, 1], sync_ms=0.0)
    assert (e.phase, e.anchor_rank) == (ElChePhase.STABLE, 1)
    for _ in range(5):  # rank 0 ends exactly 10 % slower than the anchor: not more
        e.report([250.0 * (1 + DOMINANCE_MARGIN), 250.0], [1, 1], sync_ms=0.0)
    assert e.smoothed(0) == 250.0 * (1 + DOMINANCE_MARGIN)
    assert e.anchor_rank == 1


def test_the_anchor_hands_over_in_the_report_that_sees_the_challenger() -> None:
    e = elche()
    for _ in range(5):
        e.report([100.0, 200.0], [1, 1], sync_ms=0.0)
    e.report([1100.0, 200.0], [1, 1], sync_ms=0.0)  # smoothed 300 vs 200: dominant at once
    assert e.anchor_rank == 0
    assert e.counts[0] == e.anchor


def test_no_growth_when_the_window_is_already_one_epoch() -> None:
    e = elche(epoch=20)  # (10, 10): the epoch cap binds
    assert e.cap_binding
    for _ in range(3):
        e.report([200.0, 200.0], [10, 10], sync_ms=1000.0)
    assert e.anchor == 10


def test_a_sync_ms_that_is_not_positive_is_no_overhead() -> None:
    e = elche()
    for _ in range(3):
        e.report([200.0, 200.0], [10, 10], sync_ms=-300.0)  # a clock that stepped back
    assert e.anchor == 10


def test_a_sub_millisecond_sync_still_counts_against_a_short_window() -> None:
    e = elche()
    for _ in range(2):  # 0.05 ms a batch: the anchor's window is 0.5 ms; the sync 0.5 ms
        e.report([0.5, 0.5], [10, 10], sync_ms=0.5)
    assert e.anchor == 20


def test_growth_in_stable_is_the_overhead_over_the_target() -> None:
    e = elche(anchor=10, overhead_target=0.05)
    for _ in range(4):
        e.report([200.0, 200.0], [10, 10], sync_ms=0.0)
    e.report([200.0, 200.0], [10, 10], sync_ms=15.0)  # 15 / 215 = 0.0698 -> x 1.395
    assert e.anchor == 14
    e2 = elche(anchor=10, overhead_target=0.05)
    for _ in range(4):
        e2.report([200.0, 200.0], [10, 10], sync_ms=0.0)
    e2.report([200.0, 200.0], [10, 10], sync_ms=9.9)  # 9.9 / 209.9 = 0.047: under the target
    assert e2.anchor == 10


def test_warmup_grows_past_twice_the_target_not_at_it() -> None:
    e = elche(overhead_target=0.125)
    e.report([150.0, 150.0], [10, 10], sync_ms=0.0)
    e.report([150.0, 150.0], [10, 10], sync_ms=50.0)  # 50 / 200 = 0.25: exactly 2x the target
    assert e.anchor == 10
    w = elche(overhead_target=0.05)
    w.report([200.0, 200.0], [10, 10], sync_ms=0.0)
    w.report([200.0, 200.0], [10, 10], sync_ms=30.0)  # 30 / 230 = 0.13: past 2x (0.10)
    assert w.anchor == 20


def test_the_anchor_rank_always_trains_the_anchor_even_for_a_small_change() -> None:
    e = elche(anchor=20, overhead_target=0.05)
    for _ in range(5):
        e.report([100.0, 100.0], [10, 10], sync_ms=0.0)
    e.report([100.0, 100.0], [10, 10], sync_ms=11.0)  # 11 / 211 -> x 1.043: 20 -> 21
    assert e.anchor == 21
    assert e.counts[e.anchor_rank or 0] == 21  # the 5 % dead zone is for the others' noise
    assert e.counts == (21, 20)


def test_a_rank_inside_the_dead_zone_does_not_hold_back_the_ranks_after_it() -> None:
    e = elche(3)
    e.report([100.0, 100.0, 200.0], [10, 10, 10], sync_ms=0.0)
    assert e.counts == (20, 20, 10)
    e.report([105.0, 200.0, 200.0], [10, 10, 10], sync_ms=0.0)
    assert e.counts == (20, 13, 10)


def test_an_anchor_of_one_gives_an_equally_fast_rank_one_batch() -> None:
    e = elche(anchor=1, min_anchor=1)
    e.report([100.0, 105.0], [10, 10], sync_ms=0.0)
    assert e.counts == (1, 1)


def test_the_capped_window_gives_the_rounding_left_over_to_the_largest_count() -> None:
    e = elche(3, epoch=10)
    e.report([50.0, 100.0, 200.0], [10, 10, 10], sync_ms=0.0)  # wants (40, 20, 10)
    assert e.counts == (7, 2, 1)  # floors (5, 2, 1), the 2 left over to the fastest
    tie = elche(3, epoch=12)
    tie.report([100.0, 100.0, 200.0], [10, 10, 10], sync_ms=0.0)  # wants (20, 20, 10)
    assert tie.counts == (6, 4, 2)  # floors (4, 4, 2); among the largest, the lowest rank


def test_a_nudge_can_take_the_anchor_down_to_one_and_never_grows_it() -> None:
    e = guarded(threshold=0.05, nudge=0.1, anchor=3)
    for d in (0.1, 0.2, 0.3):
        e.report([100.0, 100.0], [10, 10], sync_ms=0.0, divergence=d)
    assert e.anchor == 1  # ceil(3 x 0.1)
    # A factor above one (settings built past the config's check) is clamped to no change.
    loose = ElChe(
        2,
        dataclasses.replace(cfg(anchor=10, guard=None), guard=(0.05, 1.5)),
        batches_per_epoch=10_000,
        growth=True,
    )
    for d in (0.1, 0.2, 0.3):
        loose.report([100.0, 100.0], [10, 10], sync_ms=0.0, divergence=d)
    assert loose.anchor == 10


def test_a_stable_verdict_commits_the_growth_proposal() -> None:
    e = guarded(anchor=10)
    e.report([200.0, 200.0], [10, 10], sync_ms=0.0, divergence=0.0)
    assert e.report([200.0, 200.0], [10, 10], sync_ms=100.0, divergence=0.0) == Stable()
    assert e.anchor == 20


def test_suppressed_growth_stays_off_until_five_stable_verdicts_in_a_row() -> None:
    e = guarded(anchor=10)
    for d in (0.01, 0.02, 0.03):  # rising under the threshold: SuppressGrowth
        e.report([200.0, 200.0], [10, 10], sync_ms=0.0, divergence=d)
    assert not e.growth_enabled
    for _ in range(4):  # heavy sync overhead, Stable verdicts: growth stays latched off
        assert e.report([200.0, 200.0], [10, 10], sync_ms=100.0, divergence=0.0) == Stable()
        assert e.anchor == 10
    assert not e.growth_enabled
    e.report([200.0, 200.0], [10, 10], sync_ms=100.0, divergence=0.0)  # the fifth re-arms it
    assert e.anchor == 10
    e.report([200.0, 200.0], [10, 10], sync_ms=100.0, divergence=0.0)
    assert e.anchor == 20


def test_a_guard_restores_its_history_and_its_settings() -> None:
    e = guarded(threshold=0.05, nudge=0.5, anchor=10)
    e.report([100.0, 100.0], [10, 10], sync_ms=0.0, divergence=0.01)
    e.report([100.0, 100.0], [10, 10], sync_ms=0.0, divergence=0.02)
    state = e.snapshot()
    assert state.trend_history == (0.01, 0.02)
    again = guarded(threshold=0.05, nudge=0.5, anchor=10)
    again.restore(state)
    # The third rising value past the threshold: judged by the restored history.
    assert again.report([100.0, 100.0], [10, 10], sync_ms=0.0, divergence=0.06) == NudgeDown(
        factor=0.5
    )
    assert again.anchor == 5


def test_a_snapshot_records_the_live_cadence() -> None:
    e = guarded(3, anchor=10)
    e.report([100.0, 200.0, 50.0], [10, 10, 10], sync_ms=0.0, divergence=0.01)
    e.report([100.0, 200.0, 50.0], [10, 10, 10], sync_ms=0.0, divergence=0.02)
    state = e.snapshot()
    assert state.anchor == e.anchor == 10
    assert state.anchor_rank == 1
    assert state.phase is ElChePhase.WARMUP
    assert state.calibration_count == 2
    assert state.trend_history == (0.01, 0.02)
    assert state.counts == e.counts == (20, 10, 40)
    assert state.smoothed_ms_per_batch == (10.0, 20.0, 5.0)


def test_a_guard_judges_a_restored_history_and_keeps_only_the_last_five() -> None:
    g = TrendGuard(threshold=0.5, nudge_factor=0.5, history=(0.1, 0.2))
    assert g.observe(0.3) == SuppressGrowth()
    g = TrendGuard(threshold=0.5, nudge_factor=0.5, history=(0.0,) * 7)
    assert g.history == (0.0,) * 5
    for d in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6):
        g.observe(d)
    assert g.history == (0.2, 0.3, 0.4, 0.5, 0.6)


def test_a_trend_is_strictly_rising_and_nudges_only_past_the_threshold() -> None:
    g = TrendGuard(threshold=0.5, nudge_factor=0.5)
    for d in (0.1, 0.1):
        g.observe(d)
    assert g.observe(0.2) == Stable()  # 0.1, 0.1, 0.2: not strictly rising
    g = TrendGuard(threshold=0.5, nudge_factor=0.5)
    for d in (0.125, 0.25):
        g.observe(d)
    assert g.observe(0.5) == SuppressGrowth()  # at the threshold, not past it


@settings(max_examples=150, deadline=None)
@given(
    world=st.integers(1, 5),
    reports=st.lists(
        st.lists(
            st.tuples(
                st.sampled_from([0.0, 50.0, 100.0]) | st.floats(1.0, 500.0), st.integers(0, 3)
            ),
            min_size=5,
            max_size=5,
        ),
        min_size=1,
        max_size=10,
    ),
)
def test_the_anchor_rank_has_a_reading_and_trains_the_anchor(
    world: int, reports: list[list[tuple[float, int]]]
) -> None:
    e = elche(world, epoch=10**9)
    for rows in reports:
        e.report([ms for ms, _ in rows[:world]], [n for _, n in rows[:world]], sync_ms=rows[0][0])
        if e.calibration_count == 0:
            continue
        assert e.anchor_rank is not None
        slow = e.smoothed(e.anchor_rank)
        if e.phase >= ElChePhase.STABLE and slow is not None:
            readings = [s for r in range(world) if (s := e.smoothed(r)) is not None]
            assert slow >= max(readings) * (1 - COHORT_BAND)
        if slow is not None:
            assert e.counts[e.anchor_rank] == e.anchor


@settings(max_examples=150, deadline=None)
@given(
    world=st.integers(2, 8),
    epoch=st.integers(1, 40),
    costs=st.lists(
        st.sampled_from([0.01, 1.0, 10.0, 50.0, 100.0]) | st.floats(0.01, 500.0),
        min_size=8,
        max_size=8,
    ),
)
# Six ranks over seven batches, two of them far faster: every floor of 1 but the fastest's 2 is over
# the epoch by one, taken back from a rank of scaled 2: the one that wanted fewer batches.
@example(world=6, epoch=7, costs=[10.0, 100.0, 5.0, 100.0, 100.0, 50.0, 1.0, 1.0])
def test_the_epoch_cap_keeps_the_order_of_the_counts(
    world: int, epoch: int, costs: list[float]
) -> None:
    """A rank given more batches than another before the cap never ends with fewer after it."""
    wide = elche(world, epoch=10**9)
    wide.report(costs[:world], [1] * world, sync_ms=0.0)
    capped = elche(world, epoch=epoch)
    capped.report(costs[:world], [1] * world, sync_ms=0.0)
    assert sum(capped.counts) == min(sum(wide.counts), max(epoch, world))
    for a in range(world):
        for b in range(world):
            if wide.counts[a] > wide.counts[b]:
                assert capped.counts[a] >= capped.counts[b], (a, b)
