"""A restarted rank's schedule (RankPolicy ``joining``): nothing trains before its first round, a
Reduce that reached its fresh link before the coordinator readmitted it is not its own, its first
round goes in at weight 0 with its tensors and takes the consensus as it is (never blended, ASYNC
included), and then it trains what is planned for it. Its peers count it lost until its
``Readmitted``. Pure: no link, no torch."""

from __future__ import annotations

import pytest

from flodl_async.training.policy import Policy
from flodl_async.training.schedule import Contribute, Hold, NoteLost, RankPolicy, Via
from flodl_async.wire import messages as m
from flodl_async.wire.restarts import Readmitted

from .test_schedule_policy import ASKED, plan, started, train


def joiner(averaging: Policy = Policy.CADENCE) -> RankPolicy:
    return RankPolicy(
        rank=0,
        world_size=3,
        averaging=averaging,
        collective=False,
        gamma=1.0,
        n_batches=16,
        joining=True,
    )


@pytest.mark.parametrize("averaging", [Policy.CADENCE, Policy.SYNC, Policy.ASYNC])
def test_a_joiner_waits_for_its_readmission_then_warm_starts_at_weight_0(
    averaging: Policy,
) -> None:
    p = joiner(averaging)
    assert p.handle(ASKED) == (Hold(),)
    p.handle(m.Reduce(round=6, kind="model"))  # opened before it was readmitted: not its own
    assert p.handle(ASKED) == (Hold(),)
    p.handle(Readmitted(readmitted=0, incarnation=1, round=7))
    p.handle(m.Reduce(round=7, kind="model"))
    p.handle(plan(7, 4, 3))  # its first window comes with its first round
    (warm,) = p.handle(ASKED)
    assert warm == Contribute(
        round=7, kind="model", via=Via.LINK, steps=0, weight=0.0, tensors=True, reset_inner=False
    )
    assert train(p, 3) == [4, 5, 6]


def test_its_later_rounds_are_ordinary_contributions() -> None:
    p = joiner(Policy.ASYNC)
    p.handle(Readmitted(readmitted=0, incarnation=1, round=7))
    p.handle(m.Reduce(round=7, kind="model"))
    p.handle(plan(7, 0, 2))
    p.handle(ASKED)
    train(p, 2)
    p.handle(ASKED)  # its window's report
    p.handle(m.Reduce(round=8, kind="model"))
    (second,) = p.handle(ASKED)
    assert isinstance(second, Contribute)
    assert (second.via, second.steps, second.weight) == (Via.SUBMIT, 2, 2.0)


def test_a_peer_counts_a_readmitted_rank_alive_again() -> None:
    p = started(RankPolicy(
        rank=1, world_size=3, averaging=Policy.CADENCE, collective=False, gamma=1.0, n_batches=16
    ))  # fmt: skip
    (lost,) = p.handle(m.DeclareDead(dead_rank=2, reason="killed"))
    assert isinstance(lost, NoteLost)
    p.handle(Readmitted(readmitted=2, incarnation=1, round=5))
    p.handle(m.Shutdown(reason="done", save_reason="completed"))
    p.handle(ASKED)
    assert p.outcome.lost_ranks == ()
    assert p.outcome.world_size == 3
