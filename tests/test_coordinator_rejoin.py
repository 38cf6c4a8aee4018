"""A restarted rank rejoins, pure, on a fake clock: admitted at a round boundary, warm-started by
the first round it is in, planned from the next window on, every batch in the consensus once."""

from __future__ import annotations

import pytest

from flodl_async.control.vocab import Announce
from flodl_async.training.coordination import Finish, Readmit, StartRound, TrainerJoined
from flodl_async.training.policy import Policy
from flodl_async.wire import messages as m

from .coordkit import Driver, hello, plans, replace_spec, sent
from .test_elastic_coordinator import assert_exact_coverage, spec


def _kill_mid_epoch(d: Driver, rank: int, *, after: int = 15) -> None:
    d.join_all()
    for _ in range(after):
        d.feed(d.pending.popleft())
    d.kill(rank)


def _texts(d: Driver) -> list[str]:
    return [a.text for a in d.actions if isinstance(a, Announce)]


@pytest.mark.parametrize("policy", [Policy.SYNC, Policy.CADENCE, Policy.ASYNC])
@pytest.mark.parametrize("after", [3, 9, 15])
def test_a_restarted_rank_rejoins_trains_again_and_the_coverage_stays_exact(
    policy: Policy, after: int
) -> None:
    d = Driver(spec(policy), world=3, max_restarts=2)
    _kill_mid_epoch(d, 1, after=after)
    out = d.rejoin(1)
    assert sent(out, m.TrainerWelcome), out
    d.drain()
    assert isinstance(d.ended, Finish), d.ended
    assert_exact_coverage(d, 3)
    readmits = [a for a in d.actions if isinstance(a, Readmit)]
    assert [(r.rank, r.incarnation) for r in readmits] == [(1, 1)]
    at = readmits[0].round
    assert f"rank 1 restarted (1 of 2) and rejoined at round {at}" in _texts(d)
    # its warm start is the first round opened after its admission, and it is in every one after
    later = [r for r in d.rounds if r.round >= at]
    assert later
    assert all(1 in r.expected for r in later)
    assert d.ended.lost == ()  # alive again: not lost, but the end says it was restarted
    assert d.ended.restarted == (1,)
    assert "1 restart (rank 1 (incarnation 1) at round" in d.ended.reason
    assert "DEGRADED" not in d.ended.reason
    assert d.coord.alive == {0, 1, 2}


def test_the_joiner_gets_no_work_before_its_warm_start_round_and_work_after_it() -> None:
    d = Driver(spec(Policy.CADENCE), world=2, max_restarts=1)
    _kill_mid_epoch(d, 1, after=6)
    first_after = len(d.actions)
    d.rejoin(1)
    d.drain()
    after = d.actions[first_after:]
    readmit = next(i for i, a in enumerate(after) if isinstance(a, Readmit))
    warm = next(
        i
        for i, a in enumerate(after)
        if isinstance(a, StartRound) and 1 in a.expected and i > readmit
    )
    assert not [p for p in plans(after[:warm]) if p.rank == 1]
    assert [p for p in plans(after[warm:]) if p.rank == 1 and p.quota > 0]
    # it trained batches again after it rejoined
    trained = [b for (epoch, rank), batches in d.trained.items() if rank == 1 for b in batches]
    assert trained


def test_an_old_incarnation_saying_hello_again_is_refused_and_changes_nothing() -> None:
    d = Driver(spec(Policy.CADENCE), world=2, max_restarts=2)
    _kill_mid_epoch(d, 1, after=6)
    out = d.feed(TrainerJoined(hello=hello(1, d.spec, incarnation=0)))
    assert sent(out, m.TrainerReject) == []  # incarnation 0 twice: the old warning, no reject
    d.rejoin(1, incarnation=1)
    stale = d.feed(TrainerJoined(hello=hello(1, d.spec, incarnation=1)))
    (reject,) = sent(stale, m.TrainerReject)
    assert "not newer than incarnation 1" in reject.reason
    d.drain()
    assert isinstance(d.ended, Finish)
    assert d.ended.restarted == (1,)
    assert_exact_coverage(d, 3)


def test_without_max_restarts_a_restarted_rank_is_refused_and_the_run_ends_degraded() -> None:
    d = Driver(spec(Policy.CADENCE), world=2)
    _kill_mid_epoch(d, 1)
    out = d.rejoin(1)
    (reject,) = sent(out, m.TrainerReject)
    assert "--max-restarts 0" in reject.reason
    d.dead.add(1)  # the refused process trains nothing
    d.drain()
    assert isinstance(d.ended, Finish)
    assert "DEGRADED" in d.ended.reason
    assert d.ended.restarted == ()
    assert_exact_coverage(d, 3)


def test_restarts_are_counted_over_the_whole_run() -> None:
    d = Driver(spec(Policy.CADENCE), world=3, max_restarts=1)
    _kill_mid_epoch(d, 1, after=3)
    d.rejoin(1)
    for _ in range(6):
        d.feed(d.pending.popleft())
    assert d.coord.restarted == (1,)
    d.kill(1)
    out = d.rejoin(1, incarnation=2)
    (reject,) = sent(out, m.TrainerReject)
    assert "1 restart(s) are used up" in reject.reason
    d.dead.add(1)
    d.drain()
    assert isinstance(d.ended, Finish)
    assert d.ended.restarted == (1,)
    assert_exact_coverage(d, 3)


def test_a_joiner_that_built_a_different_trainer_is_refused_and_the_run_goes_on() -> None:
    d = Driver(spec(Policy.CADENCE), world=2, max_restarts=1)
    _kill_mid_epoch(d, 1)
    other = replace_spec(d.spec, batch_size=8)
    out = d.feed(TrainerJoined(hello=hello(1, other, incarnation=1)))
    (reject,) = sent(out, m.TrainerReject)
    assert "different Trainer" in reject.reason
    d.drain()
    assert isinstance(d.ended, Finish)
    assert_exact_coverage(d, 3)


def test_a_rank_that_is_alive_cannot_be_replaced_by_a_newer_hello() -> None:
    d = Driver(spec(Policy.CADENCE), world=2, max_restarts=1)
    d.join_all()
    out = d.feed(TrainerJoined(hello=hello(1, d.spec, incarnation=1)))
    (reject,) = sent(out, m.TrainerReject)
    assert "is not lost" in reject.reason
