"""Pure tests of the plan checks: what a rank may claim about a round, and what it may not.

The last tests drive the real coordinator and the real rank schedule policies against each other
(no sockets, a fake clock, a random interleaving): honest ranks are never taken for liars, under
every policy, and a lying report is the liar's death with its name in the verdict.
"""

from __future__ import annotations

import collections
import math
import random
from collections.abc import Generator
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_async.control.vocab import Tell
from flodl_async.errors import ProtocolError
from flodl_async.training import plancheck
from flodl_async.training.coordination import (
    EVERY_RANK,
    Action,
    CoordinatorConfig,
    DeclareDead,
    Fail,
    Finish,
    RoundCompleted,
    StartRound,
    TrainerJoined,
    WindowReported,
)
from flodl_async.training.coordinator import Coordinator
from flodl_async.training.foldmath import packed_specs
from flodl_async.training.policy import Policy
from flodl_async.training.schedule import (
    Asked,
    Contribute,
    End,
    Hold,
    RankPolicy,
    Report,
    Settle,
    Settled,
    Stepped,
    Stop,
    Train,
    Via,
)
from flodl_async.training.spec import ElCheConfig, TrainerSpec
from flodl_async.wire import messages as m

from .coordkit import Driver, hello

SPECS = packed_specs([("w", "float32", (2,))])[0]


def plan(*steps: int, gamma: float = 1.0, equal: bool = False) -> m.RoundPlan:
    return m.RoundPlan(steps=steps, gamma=gamma, equal=equal)


def contribution(
    rank: int, steps: int, weight: float, *, kind: str = "model", tensors: bool = True
) -> m.Contribution:
    return m.Contribution(
        round=12,
        kind=kind,
        rank=rank,
        weight=weight,
        steps=steps,
        tensors=SPECS if tensors else (),
    )


def test_counts_read_as_the_log_says_them() -> None:
    assert [plancheck.count(n) for n in (0, 10, -5, 999_999)] == ["0", "10", "-5", "999999"]
    assert plancheck.count(10**15) == "10^15"
    assert plancheck.count(-(10**9)) == "-10^9"
    assert plancheck.count(2**62) == "4.61e+18"


# ----- a rank's contribution (the relay's check) ----------------------------------------------


def test_an_honest_contribution_passes() -> None:
    p = plan(0, 10, gamma=0.5)
    assert plancheck.check_contribution(contribution(1, 9, 3.0), p, kind="model") is None
    assert plancheck.check_contribution(contribution(1, 10, math.sqrt(10)), p, kind="model") is None
    assert plancheck.check_contribution(contribution(1, 0, 0.0), p, kind="model") is None
    # ASYNC's final round is a plain mean; init and upload take the root's state alone
    assert plancheck.check_contribution(contribution(1, 4, 1.0, kind="final"), plan(0, 10, equal=True), kind="final") is None  # fmt: skip
    assert plancheck.check_contribution(contribution(0, 0, 1.0, kind="init"), p, kind="init") is None  # fmt: skip
    assert plancheck.check_contribution(contribution(1, 0, 0.0, kind="init", tensors=False), p, kind="init") is None  # fmt: skip


@pytest.mark.parametrize(
    ("msg", "why"),
    [
        (contribution(1, 10**15, 1e15), "rank 1 claimed 10^15 steps in a round planned for 10 (round 12)"),
        (contribution(1, 11, 11.0), "rank 1 claimed 11 steps in a round planned for 10 (round 12)"),
        (contribution(1, -5, 0.0), "rank 1 claimed -5 steps in round 12 (steps are never negative)"),
        (contribution(1, 5, 1e300), "rank 1 weighted its contribution to round 12 1e+300, but its 5 steps give 5.0"),
        (contribution(1, 5, 0.0), "rank 1 weighted its contribution to round 12 0.0, but its 5 steps give 5.0"),
        (contribution(1, 5, 5.0, kind="init"), "rank 1 contributed to round 12 as 'init'; the round is 'model'"),
        (contribution(1, 5, 0.0, tensors=False), "rank 1 sent no tensors to model round 12"),
        (contribution(2, 1, 1.0), "rank 2 claimed 1 steps in a round planned for 0 (round 12)"),
    ],
)  # fmt: skip
def test_a_contribution_that_breaks_the_plan_names_its_rank(msg: m.Contribution, why: str) -> None:
    assert plancheck.check_contribution(msg, plan(0, 10), kind="model") == why


def test_in_a_root_round_only_the_root_sends_its_state() -> None:
    lie = plancheck.check_contribution(
        contribution(1, 0, 1.0, kind="init"), plan(0, 0), kind="init"
    )
    assert lie == "rank 1 sent tensors to init round 12, which takes rank 0's"
    weighty = contribution(1, 0, 1.0, kind="upload", tensors=False)
    assert plancheck.check_contribution(weighty, plan(0, 0), kind="upload") == (
        "rank 1 weighted its contribution to round 12 1.0, but its 0 steps give 0.0"
    )


# ----- a host frame (the reducer's check) -----------------------------------------------------


def host_frame(
    ranks: tuple[int, ...], steps: tuple[int, ...], weight: float, *, prescaled: bool = True
) -> m.HostContribution:
    return m.HostContribution(
        round=12,
        kind="model",
        host="a",
        ranks=ranks,
        weight=weight,
        prescaled=prescaled,
        tensors=SPECS,
        steps=steps,
    )


def test_a_host_frame_is_judged_rank_by_rank() -> None:
    p = plan(4, 10, 3)
    assert plancheck.check_host_claims(host_frame((0, 1, 2), (4, 10, 3), 17.0), p) is None
    assert plancheck.check_host_claims(host_frame((0, 1), (4, 10**15), 4 + 1e15), p) == (
        plancheck.Violation(
            rank=1, reason="rank 1 claimed 10^15 steps in a round planned for 10 (round 12)"
        )
    )
    # the misattribution the attack found: a negative step count is its rank's, not the host's
    lie = plancheck.check_host_claims(host_frame((0, 1), (4, -3), 4.0), p)
    assert lie is not None
    assert lie.rank == 1


def test_a_weight_no_single_rank_explains_is_the_hosts_fault() -> None:
    p = plan(4, 10)
    with pytest.raises(
        ProtocolError, match=r"weighs 99.0, but its ranks' steps \[4, 10\] give 14.0"
    ):
        plancheck.check_host_claims(host_frame((0, 1), (4, 10), 99.0), p)
    with pytest.raises(ProtocolError, match="lists 2 ranks but 1 step counts"):
        plancheck.check_host_claims(host_frame((0, 1), (4,), 4.0), p)
    # one rank's own bytes: its weight is its own
    lie = plancheck.check_host_claims(host_frame((1,), (10,), 99.0, prescaled=False), p)
    assert lie == plancheck.Violation(
        rank=1,
        reason="rank 1 weighted its contribution to round 12 99.0, but its 10 steps give 10.0",
    )


def test_whose_bytes_a_raw_frame_carries() -> None:
    raw = host_frame((1,), (3,), 3.0, prescaled=False)
    assert plancheck.tensor_owner(raw, root=0) == 1
    assert plancheck.tensor_owner(host_frame((0, 1), (3, 3), 6.0), root=0) is None  # folded
    init = m.HostContribution(
        round=0, kind="init", host="a", ranks=(0, 1, 2), weight=1.0, prescaled=False,
        tensors=SPECS, steps=(0, 0, 0),
    )  # fmt: skip
    assert plancheck.tensor_owner(init, root=0) == 0
    # a COLLECTIVE world that lost its rank 0 uploads from its lowest survivor
    assert plancheck.tensor_owner(init, root=1) == 1
    assert plancheck.tensor_owner(init, root=3) is None


def test_a_root_round_takes_the_lowest_expected_ranks_state() -> None:
    plan = plancheck.round_plan(world_size=3, expected=(1, 2), claimable={}, gamma=1.0, equal=False)
    assert plan.root == 1
    assert plancheck.planned_weight(plan, kind="upload", rank=1, steps=0) == 1.0
    assert plancheck.planned_weight(plan, kind="upload", rank=2, steps=0) == 0.0
    assert plancheck.carries_tensors("upload", 1, root=plan.root)
    assert not plancheck.carries_tensors("upload", 2, root=plan.root)
    assert plancheck.carries_tensors("model", 2, root=plan.root)


# ----- tensors --------------------------------------------------------------------------------


def test_a_non_finite_or_overflowing_tensor_is_found_in_one_pass() -> None:
    specs = packed_specs(
        [("a", "float32", (4,)), ("b", "bfloat16", (3,)), ("n", "int64", (1,)), ("e", "float32", (0,))]
    )[0]  # fmt: skip
    good = [
        torch.zeros(4),
        torch.ones(3, dtype=torch.bfloat16),
        torch.tensor([2**62]),
        torch.zeros(0),
    ]
    assert plancheck.first_bad_tensor(specs, good, 10.0) is None
    for bad in (math.nan, math.inf, -math.inf):
        poisoned = [good[0], torch.tensor([0.0, bad, 0.0], dtype=torch.bfloat16), *good[2:]]
        assert plancheck.first_bad_tensor(specs, poisoned, 1.0) == ("non-finite parameters", "b")
    huge = [torch.full((4,), 1e30), *good[1:]]
    found = plancheck.first_bad_tensor(specs, huge, 1.0)
    assert found == ("parameters of magnitude 1e+30, which would overflow the average", "a")
    assert plancheck.first_bad_tensor(specs, [torch.full((4,), 1e20), *good[1:]], 1.0) is None
    assert plancheck.tensor_lie(1, 12, ("non-finite parameters", "b")) == (
        "rank 1 sent non-finite parameters in round 12 (tensor 'b')"
    )


# ----- window reports (the coordinator's check) -----------------------------------------------


def window(**changes: object) -> m.WindowDone:
    fields: dict[str, object] = {
        "rank": 1, "round": 3, "epoch": 0, "batches": 4, "samples": 30, "compute_ms": 12.0,
        "data_ms": 1.0, "loss_sum": 2.0, "scalar_sums": {"acc": 3.5}, "scalar_counts": {"acc": 4},
    }  # fmt: skip
    fields.update(changes)
    return m.WindowDone(**fields)  # type: ignore[arg-type]


def test_an_honest_report_passes() -> None:
    assert plancheck.check_window(window(), planned=4, epoch=0, batch_size=8) is None
    empty = window(batches=0, samples=0, compute_ms=0.0, scalar_sums={}, scalar_counts={})
    assert plancheck.check_window(empty, planned=0, epoch=0, batch_size=8) is None


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"batches": -(10**9)}, "rank 1 reported -10^9 batches for window 3 (counts are never negative)"),
        ({"batches": 5}, "rank 1 reported 5 batches for window 3, planned for 4"),
        ({"samples": 2**62}, "rank 1 reported 4.61e+18 samples for window 3: its 4 batches of at most 8 hold 32"),
        ({"samples": -1}, "rank 1 reported -1 samples for window 3: its 4 batches of at most 8 hold 32"),
        ({"compute_ms": 1e300}, "rank 1 reported compute_ms=1e+300 for window 3 of 4 batches"),
        ({"data_ms": math.nan}, "rank 1 reported data_ms=nan for window 3 of 4 batches"),
        ({"compute_ms": -1.0}, "rank 1 reported compute_ms=-1.0 for window 3 of 4 batches"),
        ({"loss_sum": math.inf}, "rank 1 reported a loss sum of inf for window 3"),
        ({"divergence": -2.0}, "rank 1 reported a divergence of -2.0 for window 3"),
        ({"scalar_counts": {"acc": 2**62}}, "rank 1 reported 4.61e+18 records of scalar 'acc' for window 3 of 4 batches"),
        ({"scalar_sums": {"acc": math.nan}}, "rank 1 reported scalar 'acc' summing to nan for window 3"),
        ({"epoch": 7}, "rank 1 reported window 3 as epoch 7; it was planned in epoch 0"),
    ],
)  # fmt: skip
def test_a_report_that_breaks_the_plan_names_its_rank(changes: dict[str, object], why: str) -> None:
    assert plancheck.check_window(window(**changes), planned=4, epoch=0, batch_size=8) == why


# ----- the plan the coordinator sends ---------------------------------------------------------


def test_the_round_plan_covers_every_rank_of_the_world() -> None:
    p = plancheck.round_plan(
        world_size=4, expected={0, 2, 3}, claimable={0: 5, 1: 9, 3: -1}, gamma=0.5, equal=False
    )
    assert p == m.RoundPlan(steps=(5, 0, 0, 0), gamma=0.5)  # rank 1 is not expected
    in_flight = {(0, 3): ((0, 4),), (0, 4): ((8, 2), (12, 1)), (1, 3): ()}
    assert plancheck.in_flight_batches(in_flight) == {0: 7, 1: 0}
    assert plancheck.sync_claimable({0: 3, 1: 0}, {1: 2, 2: 1}) == {0: 3, 1: 2, 2: 1}


def test_a_lying_window_report_is_the_liars_death_named_in_the_verdict() -> None:
    s = TrainerSpec(policy=Policy.CADENCE, epochs=2, batch_size=4, dataset_len=64, elche=ElCheConfig(anchor=2))  # fmt: skip
    d = Driver(s)
    d.join_all()
    d.feed(d.pending.popleft())  # round 0 (init) completes
    report = next(e for e in d.pending if isinstance(e, WindowReported) and e.report.rank == 1)
    lie = WindowReported(report=m.WindowDone(**{**_fields(report.report), "batches": -(10**9)}))
    out = d.feed(lie)
    why = "rank 1 reported -10^9 batches for window 1 (counts are never negative)"
    assert DeclareDead(rank=1, reason=why) in out
    assert not [a for a in out if isinstance(a, Fail)]  # a liar is a lost rank: the others go on
    # the fake rank 1 stops answering, as its agent's KILL makes sure
    d.dead.add(1)
    d.pending = collections.deque(
        e for e in d.pending if not (isinstance(e, WindowReported) and e.report.rank == 1)
    )
    d.drain()
    assert isinstance(d.ended, Finish), d.ended
    assert [(rank, why in reason) for rank, reason in d.ended.lost] == [(1, True)]


def _fields(report: m.WindowDone) -> dict[str, object]:
    return {f: getattr(report, f) for f in report.__dataclass_fields__}


# ----- honest ranks are never taken for liars --------------------------------------------------


@dataclass
class Honest:
    """The coordinator and one :class:`RankPolicy` per rank, as the shells would carry them out:
    the ranks' links deliver in order, everything else interleaves at random."""

    spec: TrainerSpec
    world: int
    rng: random.Random
    coord: Coordinator = field(init=False)
    now: float = 0.0
    inbox: list[collections.deque[m.Message]] = field(default_factory=list)
    up: collections.deque[WindowReported] = field(default_factory=collections.deque)
    rounds: dict[int, tuple[StartRound, set[int]]] = field(default_factory=dict)
    completed: set[int] = field(default_factory=set)
    unreported: list[int] = field(default_factory=list)
    checked: int = 0
    ended: Finish | Fail | None = None

    def __post_init__(self) -> None:
        self.coord = Coordinator(CoordinatorConfig(run_id="r", world_size=self.world), now=0.0)
        self.inbox = [collections.deque() for _ in range(self.world)]
        self.unreported = [0] * self.world

    def feed(self, event: TrainerJoined | WindowReported | RoundCompleted) -> None:
        self.now += 0.001
        for action in self.coord.handle(event, self.now):
            self.carry_out(action)

    def carry_out(self, action: Action) -> None:
        if isinstance(action, Tell):
            for rank in range(self.world) if action.to == EVERY_RANK else [action.to]:
                self.inbox[rank].append(action.message)
        elif isinstance(action, StartRound):
            self.rounds[action.round] = (action, set())
            for rank in range(self.world):
                self.inbox[rank].append(action.message)
        elif isinstance(action, Finish | Fail):
            self.ended = action

    def rank(self, r: int) -> Generator[tuple[str, int], None, None]:
        """One rank's runner (:class:`~flodl_async.trainer.schedule.RankSchedule`): yields what it
        waits for."""
        s = self.spec
        policy = RankPolicy(
            rank=r, world_size=self.world, averaging=s.policy, collective=False,
            gamma=s.settings.gamma, n_batches=s.n_batches,
        )  # fmt: skip
        outstanding: int | None = None
        while True:
            while self.inbox[r]:
                for side in policy.handle(self.inbox[r].popleft()):
                    assert not isinstance(side, Stop), side
            if outstanding is not None and outstanding in self.completed:
                outstanding = None
                policy.handle(Settled())
            decided: object = None
            for action in policy.handle(Asked()):
                decided = action
                if isinstance(action, Report):
                    self.report(r, action)
                elif isinstance(action, Contribute):
                    self.contribute(r, action)
                    if action.via is Via.SUBMIT:
                        outstanding = action.round
                    else:
                        yield ("round", action.round)  # until its consensus is applied
                elif isinstance(action, Settle):
                    assert outstanding is not None
                    yield ("round", outstanding)
                    outstanding = None
            if isinstance(decided, Train):
                policy.handle(Stepped())
                self.unreported[r] += 1
                yield ("step", 0)
            elif isinstance(decided, Hold):
                yield ("inbox", 0)
            elif isinstance(decided, End):
                return

    def report(self, r: int, action: Report) -> None:
        batches, self.unreported[r] = self.unreported[r], 0
        self.up.append(
            WindowReported(
                report=m.WindowDone(
                    rank=r, round=action.round, epoch=action.epoch, batches=batches,
                    samples=batches * self.spec.batch_size, compute_ms=float(batches),
                    data_ms=0.0, loss_sum=0.5 * batches,
                )
            )
        )  # fmt: skip

    def contribute(self, r: int, action: Contribute) -> None:
        start, contributed = self.rounds[action.round]
        contributed.add(r)
        if action.via is Via.RECEIVE:
            return
        msg = m.Contribution(
            round=action.round, kind=action.kind, rank=r, weight=action.weight,
            steps=action.steps, tensors=SPECS if action.tensors else (),
        )  # fmt: skip
        assert start.message.plan is not None
        assert plancheck.check_contribution(msg, start.message.plan, kind=action.kind) is None
        self.checked += 1

    def run(self) -> None:
        for r in range(self.world):
            self.feed(TrainerJoined(hello=hello(r, self.spec)))
        waits: dict[int, tuple[str, int]] = {}
        ranks = {r: self.rank(r) for r in range(self.world)}
        for r, proc in ranks.items():
            waits[r] = next(proc)
        while ranks:
            ready_rounds = [
                k
                for k, (start, done) in self.rounds.items()
                if k not in self.completed and (start.from_controller or start.expected <= done)
            ]
            runnable = [r for r in ranks if self.may_run(r, waits[r])]
            choices = [("rank", r) for r in runnable] + [("round", k) for k in ready_rounds]
            if self.up:
                choices.append(("up", 0))
            assert choices, ("deadlock", waits, self.rounds.keys(), self.completed)
            what, which = self.rng.choice(choices)
            if what == "up":
                self.feed(self.up.popleft())
            elif what == "round":
                self.completed.add(which)
                start = self.rounds[which][0]
                self.feed(RoundCompleted(round=which, kind=start.kind, mass=1.0, duration_ms=1.0))
            else:
                try:
                    waits[which] = next(ranks[which])
                except StopIteration:
                    del ranks[which]

    def may_run(self, r: int, wait: tuple[str, int]) -> bool:
        kind, arg = wait
        if kind == "round":
            return arg in self.completed
        if kind == "inbox":
            return bool(self.inbox[r])  # a holding rank wakes at its next message
        return True


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(list(Policy)),
    world=st.integers(1, 3),
    n_batches=st.integers(1, 24),
    epochs=st.integers(1, 2),
    anchor=st.integers(1, 5),
    lockstep=st.sampled_from([None, 0, 2]),
    gamma=st.sampled_from([1.0, 0.5]),
    seed=st.integers(0, 2**32),
)
def test_honest_ranks_never_break_their_plans(
    policy: Policy,
    world: int,
    n_batches: int,
    epochs: int,
    anchor: int,
    lockstep: int | None,
    gamma: float,
    seed: int,
) -> None:
    elche = (
        ElCheConfig(max_batch_diff=lockstep, gamma=gamma)
        if policy is Policy.SYNC
        else ElCheConfig(anchor=anchor, gamma=gamma)
    )
    s = TrainerSpec(policy=policy, epochs=epochs, batch_size=2, dataset_len=2 * n_batches, elche=elche)  # fmt: skip
    run = Honest(spec=s, world=world, rng=random.Random(seed))
    run.run()
    assert isinstance(run.ended, Finish), run.ended
    assert run.checked > 0
