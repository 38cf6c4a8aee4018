"""Pure tests of the coordinator on a fake clock: scripted scenarios asserting the action trace."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_async.control.vocab import Announce, Tick
from flodl_async.training.coordination import (
    CoordinatorConfig,
    CoordPhase,
    DeclareDead,
    Fail,
    Finish,
    FrameSeen,
    RankExiting,
    RankLost,
    RoundCompleted,
    StartRound,
    StopRequested,
    TrainerJoined,
    WindowReported,
)
from flodl_async.training.coordinator import Coordinator
from flodl_async.training.outer import DiLoCo
from flodl_async.training.plancheck import REPORTS_AHEAD_LIMIT
from flodl_async.training.policy import Backend, GateRank, Policy, should_reduce
from flodl_async.training.spec import ElCheConfig, TrainerSpec
from flodl_async.verdict import ExitCode
from flodl_async.wire import messages as m

from .coordkit import Driver, hello, plans, sent

N = 64  # samples
B = 4  # batch size -> 16 batches per epoch


def spec(policy: Policy = Policy.CADENCE, **overrides: object) -> TrainerSpec:
    fields: dict[str, object] = {"policy": policy, "epochs": 2, "batch_size": B, "dataset_len": N}
    if policy is not Policy.SYNC:
        fields["elche"] = ElCheConfig(anchor=2)
    fields.update(overrides)
    return TrainerSpec(**fields)  # type: ignore[arg-type]


def assert_each_batch_once_per_epoch(d: Driver, epochs: int, n_batches: int) -> None:
    for epoch in range(epochs):
        seen = sorted(b for rank in range(d.world) for b in d.trained.get((epoch, rank), []))
        assert seen == list(range(n_batches)), epoch


# ----- the gate -----------------------------------------------------------------------------


def test_the_gate_table() -> None:
    done = GateRank(reported=True, steps=2, need=2, quiesced=False)
    short = GateRank(reported=True, steps=1, need=2, quiesced=False)
    silent = GateRank(reported=False, steps=0, need=2, quiesced=False)
    idle_tail = GateRank(reported=False, steps=0, need=0, quiesced=True)
    assert should_reduce(in_flight=False, ranks={0: done, 1: done})
    assert not should_reduce(in_flight=True, ranks={0: done, 1: done})  # one round at a time
    assert not should_reduce(in_flight=False, ranks={0: done, 1: silent})
    assert not should_reduce(
        in_flight=False, ranks={0: done, 1: short}
    )  # count-based: the quota, not the clock
    assert should_reduce(
        in_flight=False, ranks={0: done, 1: idle_tail}
    )  # a quiesced tail rank is exempt
    assert not should_reduce(
        in_flight=False, ranks={0: idle_tail, 1: idle_tail}
    )  # nobody moved: no degenerate reduce
    assert not should_reduce(in_flight=False, ranks={})  # no alive rank


# ----- happy paths ---------------------------------------------------------------------------


def test_cadence_happy_path() -> None:
    d = Driver(spec())
    d.run()
    first = d.rounds[0]
    assert (first.round, first.kind, first.expected, first.reducer) == (
        0,
        "init",
        frozenset({0, 1}),
        True,
    )
    welcomes = sent(d.actions, m.TrainerWelcome)
    assert [w.rank for w in welcomes] == [0, 1]
    assert all(w.world_size == 2 and w.run_id == "r" for w in welcomes)  # type: ignore[attr-defined]
    assert_each_batch_once_per_epoch(d, 2, 16)
    assert [e.epoch for e in d.epochs] == [1, 2]
    assert d.epochs[0].batches == 16
    final = d.rounds[-1]
    assert (final.kind, final.from_controller) == (
        "final",
        True,
    )  # natural end: the held consensus stands
    assert isinstance(d.ended, Finish)
    assert d.ended.reason == "training complete: 2 epoch(s) on 2 rank(s)"
    [shutdown] = sent(d.actions, m.Shutdown)
    assert shutdown.save_reason == "completed"  # type: ignore[attr-defined]
    assert d.coord.phase is CoordPhase.DONE
    assert d.coord.next_deadline(d.now) is None


def test_cadence_plans_follow_the_counts_and_hold_at_the_quota() -> None:
    d = Driver(spec())
    d.run()
    for plan in plans(d.actions):
        assert plan.hold_after == plan.quota
        assert plan.quota == sum(n for _f, n in plan.ranges)
    model_rounds = [r.round for r in d.rounds if r.kind == "model"]
    assert model_rounds == list(range(1, len(model_rounds) + 1))  # windows numbered 1, 2, ...


def test_a_slow_rank_anchors_and_the_fast_rank_takes_its_share() -> None:
    s = spec(epochs=3, dataset_len=400, elche=ElCheConfig(anchor=2))  # 100 batches per epoch
    d = Driver(s, ms_per_batch=(4.0, 12.0))  # rank 1 is 3x slower
    d.run()
    assert_each_batch_once_per_epoch(d, 3, 100)
    shares = [r.batch_share for r in d.epochs[-1].per_rank]
    assert 0.65 <= shares[0] <= 0.85  # ideal 0.75


def test_sync_lockstep_splits_the_epoch_and_reduces_every_step() -> None:
    d = Driver(spec(Policy.SYNC, elche=ElCheConfig(max_batch_diff=0)))
    d.run()
    assert_each_batch_once_per_epoch(d, 2, 16)
    sync_plans = plans(d.actions)
    assert [(p.rank, p.epoch, p.ranges, p.quota, p.hold_after) for p in sync_plans] == [
        (0, 0, ((0, 8),), 1, 1),
        (1, 0, ((8, 8),), 1, 1),
        (0, 1, ((0, 8),), 1, 1),
        (1, 1, ((8, 8),), 1, 1),
    ]  # one plan per epoch; strict lockstep holds after one step
    assert [e.reduces for e in d.epochs] == [8, 8]
    assert isinstance(d.ended, Finish)


def test_sync_partition_ratios_and_a_quiesced_rank() -> None:
    d = Driver(
        spec(
            Policy.SYNC,
            epochs=1,
            elche=ElCheConfig(max_batch_diff=0, partition_ratios=(0.75, 0.25)),
        )
    )
    d.run()
    assert [p.ranges for p in plans(d.actions)] == [((0, 12),), ((12, 4),)]
    assert_each_batch_once_per_epoch(d, 1, 16)
    assert d.epochs[0].reduces == 12  # rank 1 is quiesced after 4 windows; rank 0 keeps moving
    assert [r.batches for r in d.epochs[0].per_rank] == [12, 4]


def test_async_dispatches_the_next_plan_on_the_report() -> None:
    d = Driver(spec(Policy.ASYNC))
    d.join_all()
    d.feed(d.pending.popleft())  # init done
    report = d.pending.popleft()
    assert isinstance(report, WindowReported)
    out = d.feed(report)
    [early] = plans(out)  # before any reduce: the rank keeps going
    assert (early.rank, early.round) == (report.report.rank, report.report.round + 1)
    assert early.hold_after == early.quota + 3  # max_overshoot 3
    d.run()
    assert_each_batch_once_per_epoch(d, 2, 16)
    final = d.rounds[-1]
    assert (final.kind, final.from_controller) == (
        "final",
        False,
    )  # ASYNC locals differ: they contribute
    assert isinstance(d.ended, Finish)


def test_collective_rounds_run_in_the_ranks_and_upload_at_the_end() -> None:
    d = Driver(spec(Policy.CADENCE, backend=Backend.COLLECTIVE))
    d.run()
    assert all(not r.reducer for r in d.rounds[:-1])
    upload = d.rounds[-1]
    # The primary's state to the controller; the others send empty contributions (the relay's fold waits for every local rank).
    assert (upload.kind, upload.expected, upload.reducer) == ("upload", frozenset({0, 1}), True)
    assert isinstance(d.ended, Finish)


@pytest.mark.parametrize("backend", [Backend.CPU, Backend.COLLECTIVE])
def test_the_anchor_grows_when_the_reduce_overhead_exceeds_the_target(backend: Backend) -> None:
    """Auto-tune through the coordinator: the reducer's round duration (CPU) or the ranks' slowest
    ``ReduceDone.ms`` (COLLECTIVE) is ElChe's sync_ms; overhead = sync / (anchor·slow + sync) against the 5 % target."""
    s = spec(
        Policy.CADENCE,
        backend=backend,
        epochs=3,
        dataset_len=1600,
        elche=ElCheConfig(anchor=2, max_anchor=16),
    )  # 400 batches per epoch

    def anchors(reduce_ms: float) -> tuple[list[int], list[int]]:
        d = Driver(s, ms_per_batch=(10.0, 10.0), reduce_ms=reduce_ms)
        d.run()
        assert isinstance(d.ended, Finish)
        assert_each_batch_once_per_epoch(d, 3, 400)
        quotas = [p.quota for p in plans(d.actions) if p.rank == 0]
        return [e.anchor for e in d.epochs], quotas

    cheap, cheap_quotas = anchors(0.1)  # 0.1 / (2·10 + 0.1) = 0.5 %: under the target
    assert cheap == [2, 2, 2]
    assert set(cheap_quotas) == {2}
    costly, costly_quotas = anchors(20.0)  # 20 / (2·10 + 20) = 50 %: far over it
    assert costly[0] > 2, (
        costly
    )  # grown within the first epoch (x2 at most per round, the growth cap)
    assert costly[-1] == 16, (
        costly
    )  # ... until max_anchor, where 20 / (16·10 + 20) = 11 % stays over the target
    assert max(costly_quotas) == 16


def test_diloco_resets_the_inner_optimizer_on_model_rounds() -> None:
    d = Driver(spec(outer=DiLoCo()))
    d.run()
    assert {r.message.reset_inner for r in d.rounds if r.kind == "model"} == {True}
    assert {r.message.reset_inner for r in d.rounds if r.kind != "model"} == {False}


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(list(Policy)),
    world=st.integers(1, 4),
    n_batches=st.integers(1, 40),
    epochs=st.integers(1, 3),
    anchor=st.integers(1, 6),
    speeds=st.lists(st.floats(0.5, 20.0), min_size=4, max_size=4),
)
def test_every_policy_covers_each_batch_exactly_once_per_epoch(
    policy: Policy, world: int, n_batches: int, epochs: int, anchor: int, speeds: list[float]
) -> None:
    elche = ElCheConfig(max_batch_diff=0) if policy is Policy.SYNC else ElCheConfig(anchor=anchor)
    s = TrainerSpec(policy=policy, epochs=epochs, batch_size=1, dataset_len=n_batches, elche=elche)
    d = Driver(s, world=world, ms_per_batch=tuple(speeds[:world]))
    d.run()
    assert isinstance(d.ended, Finish), d.ended
    assert_each_batch_once_per_epoch(d, epochs, n_batches)
    assert [e.epoch for e in d.epochs] == list(range(1, epochs + 1))
    assert all(e.batches == n_batches for e in d.epochs)


# ----- joining --------------------------------------------------------------------------------


def coordinator(world: int = 3) -> Coordinator:
    return Coordinator(
        CoordinatorConfig(
            run_id="r", world_size=world, hosts={0: "a", 1: "a", 2: "b"}, hello_timeout=120.0
        ),
        now=0.0,
    )


def test_a_different_trainer_is_rejected_naming_rank_host_and_field() -> None:
    c = coordinator()
    c.handle(TrainerJoined(hello=hello(0, spec(epochs=5))), 1.0)
    out = c.handle(TrainerJoined(hello=hello(2, spec(epochs=10))), 2.0)
    text = (
        "rank 2 (host b) built a different Trainer than rank 0: epochs 10 != 5. Every rank must build the Trainer from the same arguments "
        "— are the ranks running different code or command lines?"
    )
    assert sent(out, m.TrainerReject) == [m.TrainerReject(rank=2, reason=text)]
    [fail] = [a for a in out if isinstance(a, Fail)]
    assert (fail.code, fail.reason, fail.rank) == (ExitCode.FORMATION, text, 2)
    assert c.phase is CoordPhase.FAILED


def test_a_different_model_is_named_too() -> None:
    c = coordinator()
    c.handle(TrainerJoined(hello=hello(0, spec())), 1.0)
    other = hello(1, spec())
    model = dataclasses.replace(other.model, shapes=((4, 3), (4,), ()))
    from flodl_async.training.modelschema import ModelSchema
    from flodl_async.training.spec import digest

    forged = dataclasses.replace(
        other, model=model, digest=digest(spec(), ModelSchema.from_wire(model))
    )
    [fail] = [a for a in c.handle(TrainerJoined(hello=forged), 2.0) if isinstance(a, Fail)]
    assert fail.reason.startswith(
        "rank 1 (host a) built a different model than rank 0: parameter '0.weight'"
    )


def test_a_digest_that_does_not_match_its_spec_is_refused() -> None:
    c = coordinator()
    bad = dataclasses.replace(hello(0, spec()), digest="00" * 32)
    [fail] = [a for a in c.handle(TrainerJoined(hello=bad), 1.0) if isinstance(a, Fail)]
    assert "does not match its own Trainer spec" in fail.reason


def test_hello_timeout_names_the_missing_rank() -> None:
    c = coordinator()
    c.handle(TrainerJoined(hello=hello(0, spec(heartbeat_timeout=1000.0))), 10.0)
    c.handle(TrainerJoined(hello=hello(1, spec(heartbeat_timeout=1000.0))), 11.0)
    assert c.next_deadline(11.0) == pytest.approx(130.0)  # the first hello + 120 s
    assert c.handle(Tick(), 129.9) == []
    out = c.handle(Tick(), 130.0)
    [fail] = [a for a in out if isinstance(a, Fail)]
    assert fail.reason == (
        "rank 2 on host b did not start its Trainer within 120 s of rank 0 — is it running the same script, and does it reach trainer.run()?"
    )
    assert (fail.code, fail.rank) == (ExitCode.FORMATION, 2)
    assert sent(out, m.Shutdown)


def test_a_late_hello_is_rejected() -> None:
    d = Driver(spec())
    d.join_all()
    out = d.coord.handle(TrainerJoined(hello=hello(5, spec())), d.now)
    assert sent(out, m.TrainerReject) == [
        m.TrainerReject(rank=5, reason="this run's Trainer already started without it")
    ]


# ----- liveness and death ---------------------------------------------------------------------


def started(world: int = 2, **overrides: object) -> Driver:
    d = Driver(spec(heartbeat_timeout=30.0, **overrides), world=world)
    d.join_all()
    return d


def test_heartbeat_staleness_declares_the_rank_dead_by_name() -> None:
    d = started()
    t0 = d.now
    d.coord.handle(FrameSeen(rank=0), t0 + 20.0)
    deadline = d.coord.next_deadline(t0 + 20.0)
    assert deadline is not None
    assert (
        deadline <= t0 + 30.0
    )  # rank 1's last frame + the timeout, or the stall deadline of round 0
    d.coord.handle(
        RoundCompleted(round=0, kind="init", mass=1.0, duration_ms=1.0), t0 + 20.0
    )  # no reduce in flight now
    assert d.coord.handle(Tick(), t0 + 29.9) == []
    out = d.coord.handle(Tick(), t0 + 30.0)
    assert [a for a in out if isinstance(a, DeclareDead)] == [
        DeclareDead(
            rank=1,
            reason="no frame for 30 s (heartbeat timeout: the rank is frozen, stopped or cut off)",
        )
    ]
    # the survivor trains on
    assert [a for a in out if isinstance(a, Fail)] == []
    assert (d.coord.phase, d.coord.alive, d.coord.dead) == (CoordPhase.TRAINING, {0}, {1})


def test_the_heartbeat_timeout_scales() -> None:
    c = Coordinator(
        CoordinatorConfig(run_id="r", world_size=1, timeout_scale=0.1, reduce_stall=1000.0), now=0.0
    )
    c.handle(TrainerJoined(hello=hello(0, spec(heartbeat_timeout=30.0))), 5.0)
    c.handle(RoundCompleted(round=0, kind="init", mass=1.0, duration_ms=1.0), 5.0)
    assert c.next_deadline(5.0) == pytest.approx(8.0)


def test_a_death_record_carries_the_traceback_into_the_verdict() -> None:
    d = started(world=1)
    out = d.coord.handle(
        RankExiting(
            message=m.Exiting(rank=0, reason="error", error="Traceback ...\nValueError: boom")
        ),
        d.now,
    )
    [fail] = [a for a in out if isinstance(a, Fail)]
    assert fail.reason == "rank 0 on host h0 was lost mid-training: it raised (error)"
    assert "ValueError: boom" in fail.details


def test_a_lost_rank_is_declared_dead_once() -> None:
    d = started()
    first = d.coord.handle(RankLost(rank=1, reason="its relay link closed"), d.now)
    assert [a for a in first if isinstance(a, DeclareDead)] == [
        DeclareDead(rank=1, reason="its relay link closed")
    ]
    assert d.coord.handle(RankLost(rank=1, reason="exited with code 1"), d.now) == []


def test_a_rank_that_never_said_hello_is_the_supervisors_business() -> None:
    c = coordinator()
    c.handle(TrainerJoined(hello=hello(0, spec())), 1.0)
    assert c.handle(RankLost(rank=2, reason="exited with code 1"), 2.0) == []


def test_a_clean_exit_after_the_end_is_exempt() -> None:
    d = Driver(spec())
    d.run()
    assert d.coord.handle(RankExiting(message=m.Exiting(rank=0, reason="done")), d.now) == []


def test_max_failure_names_its_exit_code() -> None:
    d = Driver(spec(max_failure=1), world=3)
    d.join_all()
    [fail] = [
        a for a in d.coord.handle(RankLost(rank=2, reason="killed"), d.now) if isinstance(a, Fail)
    ]
    assert (fail.code, fail.save_reason) == (ExitCode.MAX_FAILURE, "max_failure_exceeded")


def test_elastic_runs_continue_after_a_loss_and_forfeit_its_batches() -> None:
    s = spec(epochs=1)
    d = Driver(s, world=3)
    d.coord = Coordinator(CoordinatorConfig(run_id="r", world_size=3), now=d.now)
    d.join_all()
    lost = d.coord.handle(RankLost(rank=2, reason="killed"), d.now)
    assert [a for a in lost if isinstance(a, Fail)] == []
    for key in [k for k in d.trained if k[1] == 2]:
        del d.trained[key]  # its window never completed: those batches go back to the pool
    d.pending = type(d.pending)(
        e for e in d.pending if not (isinstance(e, WindowReported) and e.report.rank == 2)
    )
    d.run()
    assert isinstance(d.ended, Finish)
    seen = sorted(b for r in (0, 1) for b in d.trained.get((0, r), []))
    assert seen == list(range(16))


def test_a_stalled_round_fails_with_the_stall_code() -> None:
    c = Coordinator(CoordinatorConfig(run_id="r", world_size=1, reduce_stall=120.0), now=0.0)
    c.handle(
        TrainerJoined(hello=hello(0, spec(heartbeat_timeout=1000.0))), 1.0
    )  # round 0 in flight from t=1
    out = c.handle(Tick(), 121.0)
    [fail] = [a for a in out if isinstance(a, Fail)]
    assert (fail.code, fail.save_reason, fail.reason) == (
        ExitCode.STALLED,
        "reduce_stall",
        "round 0 (init) stalled: no consensus within 120 s",
    )


# ----- stopping -------------------------------------------------------------------------------


def test_a_stop_mid_training_runs_a_contributed_final_round() -> None:
    d = started()
    for _ in range(3):
        d.feed(d.pending.popleft())
    d.feed(StopRequested(reason="SIGTERM"))
    d.run()
    final = [r for r in d.rounds if r.kind == "final"]
    assert len(final) == 1
    assert not final[0].from_controller  # ranks stepped since the last reduce
    assert isinstance(d.ended, Finish)
    assert d.ended.interrupted
    assert d.ended.save_reason == "graceful_shutdown"
    assert d.ended.reason.startswith("training stopped (SIGTERM) after")
    assert [r.kind for r in d.rounds].count("model") < 16
    model_after_final = [r for r in d.rounds[d.rounds.index(final[0]) :] if r.kind == "model"]
    assert model_after_final == []  # no new windows once stopping


def test_round_completions_for_other_rounds_are_ignored() -> None:
    d = started()
    out = d.coord.handle(RoundCompleted(round=7, kind="model", mass=1.0, duration_ms=1.0), d.now)
    assert not [a for a in out if isinstance(a, StartRound)]


def test_in_the_launcher_role_every_rank_must_match_the_launchers_spec() -> None:
    c = Coordinator(
        CoordinatorConfig(run_id="r", world_size=2, hosts={0: "a"}, reference=spec(epochs=5)),
        now=0.0,
    )
    [fail] = [
        a
        for a in c.handle(TrainerJoined(hello=hello(0, spec(epochs=10))), 1.0)
        if isinstance(a, Fail)
    ]
    assert fail.reason == (
        "rank 0 (host a) built a different Trainer than the launcher: epochs 10 != 5. Every rank must build the Trainer from the same arguments "
        "— are the ranks running different code or command lines?"
    )
    ok = Coordinator(CoordinatorConfig(run_id="r", world_size=2, reference=spec(epochs=5)), now=0.0)
    assert [
        a
        for a in ok.handle(TrainerJoined(hello=hello(0, spec(epochs=5))), 1.0)
        if isinstance(a, Fail)
    ] == []


def test_the_epochs_tail_is_split_by_largest_remainder_and_an_empty_rank_gets_a_quota_0_plan() -> (
    None
):
    s = TrainerSpec(epochs=1, batch_size=1, dataset_len=5, elche=ElCheConfig(anchor=2, adapt=False))
    d = Driver(s)
    d.run()
    assert [(p.rank, p.round, p.ranges, p.quota) for p in plans(d.actions)] == [
        (0, 1, ((0, 2),), 2),
        (1, 1, ((2, 2),), 2),
        (0, 2, ((4, 1),), 1),  # 1 batch left for counts (2, 2): (1, 0)
        (1, 2, (), 0),  # nothing for rank 1: it answers at once and is exempt from the gate
    ]
    assert [r.kind for r in d.rounds] == ["init", "model", "model", "final"]
    assert d.epochs[0].batches == 5


def test_async_runs_at_most_one_window_ahead_of_the_gate() -> None:
    d = Driver(spec(Policy.ASYNC, epochs=1, dataset_len=400))
    d.join_all()
    d.coord.handle(RoundCompleted(round=0, kind="init", mass=1.0, duration_ms=1.0), d.now)

    def report(rank: int, round_: int) -> list[m.Plan]:
        done = m.WindowDone(
            rank=rank,
            round=round_,
            epoch=0,
            batches=2,
            samples=8,
            compute_ms=2.0,
            data_ms=0.0,
            loss_sum=1.0,
        )
        return plans(d.coord.handle(WindowReported(report=done), d.now))

    [ahead] = report(0, 1)  # rank 0 finished window 1: its window 2 at once
    assert ahead.round == 2
    assert (
        report(0, 2) == []
    )  # window 3 would be two ahead of the gate (still at window 1, waiting on rank 1)
    out = d.coord.handle(
        WindowReported(
            report=m.WindowDone(
                rank=1,
                round=1,
                epoch=0,
                batches=2,
                samples=8,
                compute_ms=2.0,
                data_ms=0.0,
                loss_sum=1.0,
            )
        ),
        d.now,
    )
    assert [a.round for a in out if isinstance(a, StartRound)] == [1]  # the gate fires for window 1
    # Rank 1's next window; rank 0, done with window 2 already, may now run one ahead: window 3.
    assert [(p.rank, p.round) for p in plans(out)] == [(1, 2), (0, 3)]


def test_a_second_stop_request_changes_nothing() -> None:
    d = started()
    d.coord.handle(RoundCompleted(round=0, kind="init", mass=1.0, duration_ms=1.0), d.now)
    first = d.coord.handle(StopRequested(reason="SIGTERM"), d.now)
    assert d.coord.stop_requested
    assert [r.kind for r in first if isinstance(r, StartRound)] == ["final"]
    assert (
        d.coord.handle(StopRequested(reason="SIGTERM"), d.now) == []
    )  # the shell sends the next signal to the supervisor


def test_reports_far_ahead_of_the_current_round_are_refused_not_kept() -> None:
    """A broken SYNC rank cannot grow the coordinator's report table without bound."""
    d = Driver(spec(Policy.SYNC, elche=ElCheConfig(max_batch_diff=0)))
    d.join_all()
    far = d.coord._round + REPORTS_AHEAD_LIMIT + 1
    for offset in range(100):
        out = d.feed(
            WindowReported(
                report=m.WindowDone(
                    rank=0,
                    round=far + offset,
                    epoch=0,
                    batches=1,
                    samples=4,
                    compute_ms=1.0,
                    data_ms=0.0,
                    loss_sum=0.5,
                )
            )
        )
        assert [a.text for a in out if isinstance(a, Announce)] == [
            f"rank 0 reported window {far + offset}, far ahead of round {d.coord._round}; ignoring"
        ]
    assert not any(r >= far for r in d.coord._reports)
    while d.pending:  # the run itself is unharmed
        d.feed(d.pending.popleft())
    assert isinstance(d.ended, Finish)
