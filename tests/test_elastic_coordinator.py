"""The elastic death chain, pure, on a fake clock: whatever dies when, every batch of every epoch is
in the consensus exactly once, and the run ends in the verdict the exit table gives."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flodl_async.control.vocab import Announce
from flodl_async.training.coordination import (
    CollectiveDone,
    CoordPhase,
    DeclareDead,
    Fail,
    Finish,
    LostRankView,
    RankLost,
)
from flodl_async.training.policy import Backend, Policy
from flodl_async.training.regroup import Regroup
from flodl_async.training.spec import ElCheConfig, MaxFailure, TrainerSpec
from flodl_async.verdict import ExitCode
from flodl_async.wire import messages as m

from .coordkit import Driver
from .test_coordinator import assert_each_batch_once_per_epoch

N_BATCHES = 16


def spec(policy: Policy, **overrides: object) -> TrainerSpec:
    fields: dict[str, object] = {
        "policy": policy,
        "epochs": 3,
        "batch_size": 4,
        "dataset_len": 4 * N_BATCHES,
        "heartbeat_timeout": 1000.0,
    }
    if policy is not Policy.SYNC:
        fields["elche"] = ElCheConfig(anchor=2)
    fields.update(overrides)
    return TrainerSpec(**fields)  # type: ignore[arg-type]


def assert_exact_coverage(d: Driver, epochs: int) -> None:
    for epoch in range(epochs):
        assert sorted(d.consensus[epoch]) == list(range(N_BATCHES)), epoch


@pytest.mark.parametrize("policy", [Policy.SYNC, Policy.CADENCE, Policy.ASYNC])
def test_with_nobody_lost_the_consensus_holds_every_batch_once(policy: Policy) -> None:
    d = Driver(spec(policy), world=3)
    d.run()
    assert isinstance(d.ended, Finish)
    assert d.ended.lost == ()
    assert_exact_coverage(d, 3)


@given(
    policy=st.sampled_from([Policy.SYNC, Policy.CADENCE, Policy.ASYNC]),
    world=st.integers(2, 4),
    victim=st.integers(0, 3),
    at=st.integers(0, 400),
    frames_lost=st.booleans(),
    ms=st.lists(st.sampled_from([1.0, 2.0, 5.0]), min_size=4, max_size=4),
)
def test_a_death_at_any_moment_keeps_the_coverage_exact_and_ends_degraded(
    policy: Policy, world: int, victim: int, at: int, frames_lost: bool, ms: list[float]
) -> None:
    victim %= world
    d = Driver(spec(policy), world=world, ms_per_batch=tuple(ms[:world]))
    d.join_all()
    d.drain(limit=at)
    if d.ended is not None:
        return  # the run ended before the death: nothing to lose
    lost = d.kill(victim, frames_lost=frames_lost)
    assert [a for a in lost if isinstance(a, DeclareDead)] == [
        DeclareDead(rank=victim, reason="killed")
    ]
    d.drain()
    assert isinstance(d.ended, Finish), d.ended
    assert [rank for rank, _ in d.ended.lost] == [victim]
    assert "DEGRADED — 1 of" in d.ended.reason
    assert d.coord.phase is CoordPhase.DONE
    assert_exact_coverage(d, 3)


@pytest.mark.parametrize("policy", [Policy.SYNC, Policy.CADENCE, Policy.ASYNC])
def test_a_death_whose_frame_never_arrives_at_every_moment_of_a_run_keeps_the_coverage_exact(
    policy: Policy,
) -> None:
    """Every moment, not a sample: the death while an epoch's closing round is reduced, its
    contribution cut off (a lie the fold refused, a rank killed mid-send), left the survivor with
    no window and the run stalled."""
    moments = 0
    while True:
        d = Driver(spec(policy, epochs=2), world=2)
        d.join_all()
        d.drain(limit=moments)
        if d.ended is not None:
            break
        d.kill(1, frames_lost=True)
        d.drain()
        assert isinstance(d.ended, Finish), (moments, d.ended)
        assert [rank for rank, _ in d.ended.lost] == [1]
        assert_exact_coverage(d, 2)
        moments += 1
    assert moments > 10  # the sweep went through a whole run


@given(
    policy=st.sampled_from([Policy.SYNC, Policy.CADENCE, Policy.ASYNC]),
    first=st.integers(0, 300),
    second=st.integers(0, 300),
)
def test_two_deaths_of_four_keep_the_coverage_exact(
    policy: Policy, first: int, second: int
) -> None:
    d = Driver(spec(policy), world=4, ms_per_batch=(1.0, 2.0, 1.0, 3.0))
    d.join_all()
    for victim, at in ((1, first), (3, second)):
        d.drain(limit=at)
        if d.ended is not None:
            return
        d.kill(victim)
    d.drain()
    assert isinstance(d.ended, Finish), d.ended
    assert [rank for rank, _ in d.ended.lost] == [1, 3]
    assert_exact_coverage(d, 3)


def test_reaching_max_failure_ends_the_run_with_exit_5_naming_every_dead_rank() -> None:
    d = Driver(spec(Policy.CADENCE, max_failure=MaxFailure(absolute=2)), world=4)
    d.join_all()
    d.drain(limit=3)
    first = d.kill(1)
    assert not [a for a in first if isinstance(a, Fail)]  # one death is under the limit of 2
    d.drain(limit=3)
    assert d.ended is None
    d.kill(2)
    assert isinstance(d.ended, Fail)
    assert (d.ended.code, d.ended.save_reason) == (ExitCode.MAX_FAILURE, "max_failure_exceeded")
    assert d.ended.reason.startswith("max_failure reached: 2 of 4 ranks lost (the limit is 2) — ")
    assert "rank 1 on host h1: killed at epoch" in d.ended.reason
    assert "rank 2 on host h0: killed at epoch" in d.ended.reason


def test_a_death_reported_by_its_exit_after_its_link_refines_the_reason() -> None:
    d = Driver(spec(Policy.CADENCE), world=2)
    d.join_all()
    d.drain(limit=10)
    epoch = d.coord.completed_epochs + 1  # the one being trained
    d.dead.add(1)
    d.feed(RankLost(rank=1, reason="its link to the relay closed", vague=True))
    assert d.feed(RankLost(rank=1, reason="its process was killed by SIGKILL", exit=True)) == []
    d.drain()
    assert isinstance(d.ended, Finish)
    assert d.ended.lost == ((1, f"its process was killed by SIGKILL at epoch {epoch}"),)


@pytest.mark.parametrize("policy", [Policy.SYNC, Policy.CADENCE])  # ASYNC needs the CPU backend
def test_an_all_reduce_world_closes_every_epoch_on_what_its_ranks_reported(policy: Policy) -> None:
    # an all_reduce says nothing of what it folded: every alive rank's reported work is in it
    d = Driver(spec(policy, backend=Backend.COLLECTIVE), world=2)
    d.run()
    assert isinstance(d.ended, Finish), d.ended
    assert len(d.epochs) == 3
    assert_each_batch_once_per_epoch(d, 3, N_BATCHES)


def test_a_rank_that_said_why_it_died_keeps_its_words_over_its_exit() -> None:
    d = Driver(spec(Policy.CADENCE), world=2)
    d.join_all()
    d.drain(limit=10)
    d.dead.add(1)
    d.feed(RankLost(rank=1, reason="it raised (error)", details="Traceback: boom"))
    d.feed(RankLost(rank=1, reason="its process exited with code 1", exit=True))
    d.drain()
    assert isinstance(d.ended, Finish)
    assert next(why for _rank, why in d.ended.lost).startswith("it raised (error) at epoch ")


def test_the_status_view_shows_the_world_left_and_why_each_rank_was_lost() -> None:
    d = Driver(spec(Policy.CADENCE), world=3)
    d.join_all()
    d.drain(limit=10)
    before = d.coord.view(d.now)
    assert (before.world_size, before.alive, before.lost) == (3, 3, ())
    epoch = d.coord.completed_epochs + 1  # the one being trained
    d.kill(2)
    view = d.coord.view(d.now)
    assert (view.world_size, view.alive) == (3, 2)
    assert view.lost == (LostRankView(rank=2, host="h0", reason=f"killed at epoch {epoch}"),)
    assert [r.state for r in view.ranks] == ["training", "training", "dead"]
    d.drain()
    assert isinstance(d.ended, Finish)
    assert d.coord.view(d.now).lost == view.lost  # the end of the run keeps them


# ----- a COLLECTIVE world re-forms in place --------------------------------------------------


@given(
    policy=st.sampled_from([Policy.SYNC, Policy.CADENCE]),
    world=st.integers(2, 4),
    victim=st.integers(0, 3),
    at=st.integers(0, 400),
)
def test_a_collective_death_at_any_moment_re_forms_the_survivors_and_keeps_the_coverage_exact(
    policy: Policy, world: int, victim: int, at: int
) -> None:
    """The fake ranks answer each round in the generation they were told; one killed at any moment
    (its reports and its ReduceDone of the round in flight lost with it): the survivors are told
    their new group, an all_reduce it cut is redone by them, and every batch of every epoch is in
    exactly one consensus."""
    victim %= world
    d = Driver(spec(policy, backend=Backend.COLLECTIVE), world=world)
    d.join_all()
    d.drain(limit=at)
    if d.ended is not None:
        return
    d.pending = collections.deque(
        e for e in d.pending if not (isinstance(e, CollectiveDone) and e.message.rank == victim)
    )
    [dead] = [a for a in d.kill(victim) if isinstance(a, DeclareDead)]
    survivors = tuple(r for r in range(world) if r != victim)
    assert dead.regroup is not None
    assert (dead.regroup.ranks, dead.regroup.generation) == (survivors, 1)
    d.drain()
    assert isinstance(d.ended, Finish), d.ended
    assert [rank for rank, _ in d.ended.lost] == [victim]
    assert_exact_coverage(d, 3)


def collective_in_flight(world: int = 3) -> tuple[Driver, int]:
    """A COLLECTIVE CADENCE run stopped as its first model round's ReduceDones are pending."""
    d = Driver(spec(Policy.CADENCE, backend=Backend.COLLECTIVE), world=world)
    d.join_all()
    while not [r for r in d.rounds if r.kind == "model"]:
        d.feed(d.pending.popleft())
    [flying] = [r for r in d.rounds if r.kind == "model"]
    return d, flying.round


def reduce_done(d: Driver, rank: int, round_: int) -> None:
    [done] = [
        e
        for e in d.pending
        if isinstance(e, CollectiveDone) and (e.message.rank, e.message.round) == (rank, round_)
    ]
    d.pending.remove(done)
    d.feed(done)


def test_a_death_before_every_survivor_finished_the_all_reduce_has_them_all_redo_it() -> None:
    d, round_ = collective_in_flight()
    reduce_done(d, 0, round_)  # rank 0 finished; rank 2 had not when rank 1 died
    d.pending = collections.deque(e for e in d.pending if not isinstance(e, CollectiveDone))
    actions = d.kill(1)
    [dead] = [a for a in actions if isinstance(a, DeclareDead)]
    assert dead.regroup == Regroup(ranks=(0, 2), generation=1, redo=round_)
    assert "round " + str(round_) + " is redone" in " ".join(
        a.text for a in actions if isinstance(a, Announce)
    )
    # what the old group says of the round now counts for nothing: only the redo completes it
    stale = CollectiveDone(message=m.ReduceDone(rank=2, round=round_, mass=2.0, ms=1.0))
    assert d.coord.handle(stale, d.now) == []
    d.drain()
    assert isinstance(d.ended, Finish), d.ended
    assert_exact_coverage(d, 3)
    # the dead rank's window of the redone round was not in it: a survivor trained it again
    epoch, batches = d._sent[(round_, 1)]
    again = d.trained[(epoch, 0)] + d.trained[(epoch, 2)]
    assert set(batches) <= set(again)


def test_a_death_after_every_survivor_finished_the_all_reduce_keeps_the_round() -> None:
    d, round_ = collective_in_flight()
    reduce_done(d, 0, round_)
    reduce_done(d, 2, round_)  # every survivor finished: the dead rank's data is in their state
    d.pending = collections.deque(e for e in d.pending if not isinstance(e, CollectiveDone))
    [dead] = [a for a in d.kill(1) if isinstance(a, DeclareDead)]
    assert dead.regroup == Regroup(ranks=(0, 2), generation=1, redo=-1)
    d.drain()
    assert isinstance(d.ended, Finish), d.ended
    assert_exact_coverage(d, 3)
    epoch, batches = d._sent[(round_, 1)]
    again = d.trained[(epoch, 0)] + d.trained[(epoch, 2)]
    assert not set(batches) & set(again)  # nobody retrains what the consensus holds


def test_a_cpu_worlds_loss_re_forms_nothing() -> None:
    d = Driver(spec(Policy.CADENCE), world=3)
    d.join_all()
    d.drain(limit=5)
    assert d.ended is None
    [dead] = [a for a in d.kill(1) if isinstance(a, DeclareDead)]
    assert dead.regroup is None
