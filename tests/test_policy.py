"""Pure tests of the policy rules: the count-based reduce gate, the hold point, the failure limit."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_async.training.policy import (
    GateRank,
    Policy,
    failure_limit,
    hold_after,
    should_reduce,
)

SETTINGS = settings(max_examples=200, deadline=None)


def done(steps: int = 1, need: int = 1) -> GateRank:
    return GateRank(reported=True, steps=steps, need=need, quiesced=False)


def waiting(steps: int = 0, need: int = 1) -> GateRank:
    return GateRank(reported=False, steps=steps, need=need, quiesced=False)


def quiet(*, reported: bool = False, steps: int = 0) -> GateRank:
    return GateRank(reported=reported, steps=steps, need=1, quiesced=True)


def test_the_gate_opens_once_every_alive_rank_met_its_need() -> None:
    assert should_reduce(in_flight=False, ranks={0: done(), 1: done(steps=7, need=7)}) is True
    # One step under SYNC's need of one is a mover: the gate counts it.
    assert should_reduce(in_flight=False, ranks={0: done(steps=1, need=1)}) is True


def test_a_round_in_flight_keeps_the_gate_shut() -> None:
    assert should_reduce(in_flight=True, ranks={0: done(), 1: done()}) is False


def test_no_alive_rank_is_no_reduce() -> None:
    assert should_reduce(in_flight=False, ranks={}) is False


def test_one_rank_short_of_its_quota_or_not_reported_keeps_the_gate_shut() -> None:
    assert should_reduce(in_flight=False, ranks={0: done(), 1: done(steps=6, need=7)}) is False
    assert should_reduce(in_flight=False, ranks={0: done(), 1: waiting()}) is False
    # Steps counted before its report arrived are not a report: the rank is still awaited.
    assert should_reduce(in_flight=False, ranks={0: done(), 1: waiting(steps=3, need=3)}) is False


def test_a_quiesced_rank_is_not_waited_for_but_is_no_mover() -> None:
    assert should_reduce(in_flight=False, ranks={0: done(), 1: quiet()}) is True
    # Every rank out of data and nobody stepped: a Reduce would average nothing new.
    assert should_reduce(in_flight=False, ranks={0: quiet(), 1: quiet()}) is False
    assert (
        should_reduce(
            in_flight=False,
            ranks={0: quiet(reported=True, steps=0), 1: quiet(reported=True, steps=0)},
        )
        is False
    )
    # A tail rank that stepped part of its last quota and then ran dry is a mover.
    assert should_reduce(in_flight=False, ranks={0: quiet(reported=True, steps=2)}) is True


gate_ranks = st.builds(
    GateRank,
    reported=st.booleans(),
    steps=st.integers(0, 5),
    need=st.integers(0, 5),
    quiesced=st.booleans(),
)


@SETTINGS
@given(ranks=st.dictionaries(st.integers(0, 7), gate_ranks, max_size=6))
def test_the_gate_is_monotone_in_what_the_ranks_did(ranks: dict[int, GateRank]) -> None:
    verdict = should_reduce(in_flight=False, ranks=ranks)
    assert isinstance(verdict, bool)
    assert should_reduce(in_flight=True, ranks=ranks) is False
    # A rank that has not reported and still has data always holds the gate shut.
    held = {**ranks, 99: waiting()}
    assert should_reduce(in_flight=False, ranks=held) is False
    # A quiesced rank that never reported changes nothing.
    assert should_reduce(in_flight=False, ranks={**ranks, 99: quiet()}) is verdict
    # A rank that reported at least its need, and stepped, opens the gate when the rest allow it.
    everyone_else_ready = all(
        (v.reported and v.steps >= v.need) or v.quiesced for v in ranks.values()
    )
    assert should_reduce(in_flight=False, ranks={**ranks, 99: done()}) is everyone_else_ready


def test_hold_after_per_policy() -> None:
    # SYNC with max_batch_diff d: a rank may run d steps ahead of the one it waits for.
    assert hold_after(Policy.SYNC, quota=1, max_batch_diff=2, max_overshoot=3) == 3
    assert hold_after(Policy.SYNC, quota=1, max_batch_diff=0, max_overshoot=3) == 1
    assert hold_after(Policy.SYNC, quota=1, max_batch_diff=None, max_overshoot=3) == -1
    assert hold_after(Policy.CADENCE, quota=7, max_batch_diff=2, max_overshoot=3) == 7
    assert hold_after(Policy.ASYNC, quota=7, max_batch_diff=2, max_overshoot=3) == 10


def test_a_failure_percent_is_clamped_to_the_world() -> None:
    assert failure_limit(world_size=4, absolute=None, percent=1.5) == 4
    assert failure_limit(world_size=4, absolute=None, percent=1.0) == 4
    assert failure_limit(world_size=4, absolute=None, percent=-0.5) == 0
    assert failure_limit(world_size=4, absolute=2, percent=0.9) == 2  # the absolute count wins
