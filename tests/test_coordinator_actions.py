"""The coordinator's action lists whole: what the shell carries out, field by field, at each stage
(the verdicts users read, who is told, the deadlines), on a fake clock."""

from __future__ import annotations

import pytest

from flodl_async.control.vocab import Announce, Level, Tell, Tick
from flodl_async.training.coordination import (
    EVERY_RANK,
    CollectiveDone,
    CoordinatorConfig,
    CoordinatorView,
    CoordPhase,
    DeclareDead,
    Fail,
    Finish,
    FrameSeen,
    RankExiting,
    RankLost,
    RankView,
    RoundCompleted,
    StartRound,
    StopRequested,
    TrainerJoined,
    WindowReported,
    sender,
)
from flodl_async.training.coordinator import Coordinator
from flodl_async.training.policy import Backend, Policy
from flodl_async.training.regroup import Regroup
from flodl_async.training.spec import ElCheConfig, TrainerSpec
from flodl_async.verdict import ExitCode
from flodl_async.wire import messages as m

from .coordkit import Driver, hello, plans
from .test_coordinator import coordinator, spec, started


def warning(text: str) -> Announce:
    return Announce(text=text, level=Level.WARNING)


def shutdown(reason: str, save_reason: str) -> Tell[int]:
    return Tell(to=EVERY_RANK, message=m.Shutdown(reason=reason, save_reason=save_reason))


def lost_mid_run(rank: int, host: str, why: str, *, before: bool = False) -> list[object]:
    when = "before training started" if before else "mid-training"
    reason = f"rank {rank} on host {host} was lost {when}: {why}"
    return [
        warning(f"rank {rank} on host {host} lost: {why}"),
        DeclareDead(rank=rank, reason=why),
        shutdown(reason, "rank_lost"),
        Fail(code=ExitCode.RANK_FAILURE, reason=reason, rank=rank, save_reason="rank_lost"),
    ]


# ----- stopping -----------------------------------------------------------------------------


def test_a_stop_before_the_first_hello_ends_the_run_at_once_and_for_good() -> None:
    c = coordinator(2)
    reason = "training stopped (SIGINT) before it started"
    assert c.handle(StopRequested(reason="SIGINT"), 2.0) == [
        shutdown(reason, "graceful_shutdown"),
        Finish(reason=reason, save_reason="graceful_shutdown", interrupted=True),
    ]
    assert (c.phase, c.stop_requested, c.next_deadline(2.0)) == (CoordPhase.DONE, True, None)
    # over: nothing more is decided, a late hello is turned away
    assert c.handle(Tick(), 500.0) == []
    assert c.handle(StopRequested(reason="again"), 3.0) == []
    assert c.handle(TrainerJoined(hello=hello(0, spec())), 4.0) == [
        Tell(
            to=0,
            message=m.TrainerReject(rank=0, reason="this run's Trainer already started without it"),
        )
    ]


def test_a_stop_while_joining_cancels_the_hello_deadline() -> None:
    c = coordinator(2)
    c.handle(TrainerJoined(hello=hello(0, spec())), 1.0)
    assert c.next_deadline(1.0) is not None
    c.handle(StopRequested(reason="SIGINT"), 2.0)
    assert c.next_deadline(2.0) is None
    assert c.handle(Tick(), 1000.0) == []


def test_a_stop_during_init_waits_for_round_0_then_runs_a_contributed_final() -> None:
    d = started()
    out = d.coord.handle(StopRequested(reason="SIGTERM"), d.now)
    assert out == [Announce(text="stopping training (SIGTERM): a final round, then shutdown")]
    assert d.coord.phase is CoordPhase.INIT
    assert d.coord.stop_requested
    done = d.coord.handle(RoundCompleted(round=0, kind="init", mass=1.0, duration_ms=1.0), d.now)
    assert done == [
        StartRound(
            round=1,
            kind="final",
            expected=frozenset({0, 1}),
            from_controller=False,
            reducer=True,
            # each rank may have trained its first window (2 batches) before the stop
            message=m.Reduce(
                round=1,
                kind="final",
                from_controller=False,
                plan=m.RoundPlan(steps=(2, 2), gamma=1.0),
            ),
        )
    ]
    assert d.coord.phase is CoordPhase.FINAL
    assert d.coord.handle(StopRequested(reason="again"), d.now) == []
    end = d.coord.handle(RoundCompleted(round=1, kind="final", mass=1.0, duration_ms=1.0), d.now)
    reason = "training stopped (SIGTERM) after 0 of 2 epoch(s)"
    assert end == [
        shutdown(reason, "graceful_shutdown"),
        Finish(reason=reason, save_reason="graceful_shutdown", interrupted=True),
    ]
    assert d.coord.phase is CoordPhase.DONE


def test_a_stop_with_no_round_in_flight_starts_the_final_round_at_once() -> None:
    d = started()
    d.feed(RoundCompleted(round=0, kind="init", mass=1.0, duration_ms=1.0))
    assert d.coord.phase is CoordPhase.TRAINING
    out = d.coord.handle(StopRequested(reason="SIGTERM"), d.now)
    assert out[0] == Announce(text="stopping training (SIGTERM): a final round, then shutdown")
    [final] = [a for a in out if isinstance(a, StartRound)]
    assert (final.kind, final.from_controller, final.expected) == ("final", False, {0, 1})
    assert d.coord.phase is CoordPhase.FINAL


def test_a_stop_while_a_model_round_is_in_flight_waits_for_it() -> None:
    d = started()
    while not any(r.kind == "model" for r in d.rounds):
        event = d.pending.popleft()
        if isinstance(event, RoundCompleted) and event.kind == "model":
            break
        d.feed(event)
    out = d.coord.handle(StopRequested(reason="SIGTERM"), d.now)
    assert out == [Announce(text="stopping training (SIGTERM): a final round, then shutdown")]
    assert d.coord.phase is CoordPhase.STOPPING


# ----- losses -------------------------------------------------------------------------------


def test_a_clean_exit_mid_run_is_a_loss_and_the_survivor_trains_on() -> None:
    d = started()
    out = d.coord.handle(RankExiting(message=m.Exiting(rank=1, reason="done")), d.now)
    why = "it left before training ended (done)"
    assert out[:2] == [warning(f"rank 1 on host h1 lost: {why}"), DeclareDead(rank=1, reason=why)]
    assert not [a for a in out if isinstance(a, Fail)]
    assert d.coord.phase is CoordPhase.INIT  # round 0 still in flight: it goes on without rank 1
    assert (d.coord.dead, d.coord.alive) == ({1}, {0})
    d.drain()
    assert isinstance(d.ended, Finish)
    assert d.ended.lost == ((1, "it left before training ended (done) at epoch 1"),)
    assert d.ended.reason == (
        "training complete, DEGRADED — 1 of 2 ranks lost (rank 1 on host h1: it left before "
        "training ended (done) at epoch 1); 2 epoch(s) on 1 rank(s)"
    )


def test_a_clean_exit_while_joining_is_lost_before_training_started() -> None:
    c = coordinator(2)
    c.handle(TrainerJoined(hello=hello(0, spec())), 1.0)
    out = c.handle(RankExiting(message=m.Exiting(rank=0, reason="done")), 2.0)
    assert out == lost_mid_run(0, "a", "it left before training ended (done)", before=True)


def test_every_rank_lost_names_them_all_with_the_first_ones_traceback() -> None:
    d = started()
    first = d.coord.handle(
        RankExiting(message=m.Exiting(rank=0, reason="error", error="Traceback: boom")), d.now
    )
    assert not [a for a in first if isinstance(a, Fail)]
    out = d.coord.handle(RankLost(rank=1, reason="killed"), d.now)
    reason = (
        "every rank was lost — rank 0 on host h0: it raised (error) at epoch 1; rank 1 on host h1: "
        "killed at epoch 1"
    )
    assert out[-2:] == [
        shutdown(reason, "all_ranks_lost"),
        Fail(
            code=ExitCode.RANK_FAILURE,
            reason=reason,
            rank=0,
            details="Traceback: boom",
            save_reason="all_ranks_lost",
        ),
    ]


def test_a_clean_exit_before_its_hello_is_the_supervisors_but_shows_on_the_page() -> None:
    c = coordinator(2)
    c.handle(TrainerJoined(hello=hello(0, spec())), 1.0)
    assert c.handle(RankExiting(message=m.Exiting(rank=1, reason="done")), 2.0) == []
    assert [r.state for r in c.view(2.0).ranks] == ["training", "exiting"]
    assert c.phase is CoordPhase.JOINING


def test_a_collective_rank_lost_during_init_has_the_survivor_redo_the_broadcast_alone() -> None:
    s = spec(backend=Backend.COLLECTIVE)
    c = Coordinator(CoordinatorConfig(run_id="r", world_size=2), now=0.0)
    for rank in (0, 1):
        c.handle(TrainerJoined(hello=hello(rank, s)), 1.0)
    out = c.handle(RankLost(rank=1, reason="killed"), 1.0)
    assert [a for a in out if isinstance(a, Fail)] == []
    assert (
        DeclareDead(rank=1, reason="killed", regroup=Regroup(ranks=(0,), generation=1, redo=0))
        in out
    )
    done = CollectiveDone(message=m.ReduceDone(rank=0, round=0, mass=1.0, ms=1.0, generation=1))
    c.handle(done, 1.1)
    assert c.phase is CoordPhase.TRAINING


# ----- the coordinator's own findings -----------------------------------------------------------


def test_a_hello_timeout_says_it_shuts_everyone_down_and_names_the_rank() -> None:
    c = coordinator(3)
    c.handle(TrainerJoined(hello=hello(1, spec(heartbeat_timeout=1000.0))), 10.0)
    reason = (
        "rank 0 on host a did not start its Trainer within 120 s of rank 1 — is it running the "
        "same script, and does it reach trainer.run()?"
    )
    assert c.handle(Tick(), 130.0) == [
        warning(reason),
        shutdown(reason, ""),
        Fail(code=ExitCode.FORMATION, reason=reason, rank=0),
    ]


def test_a_stall_names_the_round_and_the_save_reason() -> None:
    c = Coordinator(CoordinatorConfig(run_id="r", world_size=1, reduce_stall=50.0), now=0.0)
    c.handle(TrainerJoined(hello=hello(0, spec(heartbeat_timeout=1000.0))), 1.0)
    assert c.next_deadline(1.0) == pytest.approx(51.0)
    assert c.handle(Tick(), 50.9) == []
    reason = "round 0 (init) stalled: no consensus within 50 s"
    assert c.handle(Tick(), 51.0) == [
        warning(reason),
        shutdown(reason, "reduce_stall"),
        Fail(code=ExitCode.STALLED, reason=reason, save_reason="reduce_stall"),
    ]


def test_a_completion_of_another_round_is_a_warning() -> None:
    d = started()
    out = d.coord.handle(RoundCompleted(round=3, kind="model", mass=1.0, duration_ms=1.0), d.now)
    assert out == [
        warning("round 3 (model) completed, but it is not the round in flight; ignoring")
    ]


def test_a_second_hello_from_a_rank_is_a_warning() -> None:
    c = coordinator(2)
    c.handle(TrainerJoined(hello=hello(0, spec())), 1.0)
    assert c.handle(TrainerJoined(hello=hello(0, spec())), 2.0) == [
        warning("rank 0 said TrainerHello twice; ignoring the second")
    ]


def test_a_hello_from_outside_the_world_is_rejected() -> None:
    c = coordinator(2)
    assert c.handle(TrainerJoined(hello=hello(2, spec())), 1.0) == [
        Tell(to=2, message=m.TrainerReject(rank=2, reason="rank 2 is not in this world of 2"))
    ]
    assert c.phase is CoordPhase.JOINING


# ----- the view and the queries -----------------------------------------------------------------


def test_the_view_follows_the_stages() -> None:
    c = coordinator(2)
    joining = [
        RankView(rank=r, host="a", state="joining", batches=0, heartbeat_age=0.0) for r in (0, 1)
    ]
    assert c.view(0.0) == CoordinatorView(
        phase="joining",
        epoch=0,
        epochs=0,
        policy="",
        backend="",
        anchor=0,
        counts=(),
        last_reduce_ms=0.0,
        world_size=2,
        alive=0,
        lost=(),
        ranks=tuple(joining),
    )
    assert (c.spec, c.reference) == (None, None)
    first = hello(0, spec())
    c.handle(TrainerJoined(hello=first), 1.0)
    assert c.reference == first
    assert c.spec == TrainerSpec.from_wire(first.spec)
    view = c.view(3.0)
    assert (view.epochs, view.policy, view.backend, view.anchor, view.counts) == (
        2,
        "cadence",
        "cpu",
        0,
        (),
    )
    assert view.ranks[0] == RankView(
        rank=0, host="a", state="training", batches=0, heartbeat_age=2.0
    )
    c.handle(TrainerJoined(hello=hello(1, spec())), 4.0)
    view = c.view(4.0)
    assert (view.phase, view.anchor, view.counts) == ("init", 2, (2, 2))
    assert c.view(0.0).ranks[1].heartbeat_age == 0.0  # never negative


def test_frames_refresh_a_joined_ranks_heartbeat_only() -> None:
    c = Coordinator(CoordinatorConfig(run_id="r", world_size=1, reduce_stall=1000.0), now=0.0)
    c.handle(TrainerJoined(hello=hello(0, spec(heartbeat_timeout=30.0))), 1.0)
    c.handle(FrameSeen(rank=0), 10.0)
    assert c.next_deadline(10.0) == pytest.approx(40.0)
    c.handle(FrameSeen(rank=0), 5.0)  # an older clock reading does not move it back
    assert c.next_deadline(10.0) == pytest.approx(40.0)
    c.handle(CollectiveDone(message=m.ReduceDone(rank=0, round=9, mass=1.0, ms=1.0)), 20.0)
    assert c.next_deadline(20.0) == pytest.approx(50.0)
    assert c.handle(FrameSeen(rank=5), 20.0) == []  # not in the world: nothing to refresh


def test_the_global_step_is_the_cohorts_batches_over_the_world() -> None:
    d = Driver(spec(epochs=1), world=2)
    d.run()
    assert d.coord.global_step == 16 // 2
    assert d.coord.completed_epochs == 1


def test_every_event_names_its_sender_or_none() -> None:
    report = m.WindowDone(
        rank=3, round=1, epoch=0, batches=1, samples=4, compute_ms=1.0, data_ms=0.0, loss_sum=0.0
    )
    assert sender(WindowReported(report=report)) == 3
    assert sender(FrameSeen(rank=2)) == 2
    assert sender(RankExiting(message=m.Exiting(rank=1, reason="done"))) == 1
    assert sender(CollectiveDone(message=m.ReduceDone(rank=4, round=0, mass=1.0, ms=1.0))) == 4
    assert sender(TrainerJoined(hello=hello(0, spec()))) is None
    assert sender(RankLost(rank=1, reason="x")) is None
    assert sender(Tick()) is None


# ----- the end of a run -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "backend", "tail"),
    [
        # SYNC/CADENCE end held at the last reduce: the controller's consensus is final as it is
        (Policy.SYNC, Backend.CPU, [("final", True, True)]),
        (Policy.CADENCE, Backend.CPU, [("final", True, True)]),
        # ASYNC locals differ: every rank contributes
        (Policy.ASYNC, Backend.CPU, [("final", False, True)]),
        # COLLECTIVE: the ranks hold the consensus, the primary uploads it
        (Policy.CADENCE, Backend.COLLECTIVE, [("upload", False, True)]),
    ],
)
def test_a_natural_end_closes_with_the_right_rounds_and_says_complete(
    policy: Policy, backend: Backend, tail: list[tuple[str, bool, bool]]
) -> None:
    d = Driver(spec(policy, backend=backend))
    d.run()
    after_model = d.rounds[[r.kind for r in d.rounds].index("init") + 1 :]
    last_model = max(i for i, r in enumerate(after_model) if r.kind == "model")
    ending = after_model[last_model + 1 :]
    assert [(r.kind, r.from_controller, r.reducer) for r in ending] == tail
    assert [r.round for r in d.rounds] == list(range(len(d.rounds)))  # one number per round
    assert all(r.message.round == r.round and r.message.kind == r.kind for r in d.rounds)
    assert all(r.message.from_controller == r.from_controller for r in d.rounds)
    reason = "training complete: 2 epoch(s) on 2 rank(s)"
    assert d.actions[-2:] == [
        shutdown(reason, "completed"),
        Finish(reason=reason, save_reason="completed", interrupted=False),
    ]
    assert d.coord.phase is CoordPhase.DONE
    assert d.coord.completed_epochs == 2
    assert d.coord.next_deadline(d.now) is None
    # an epoch's metrics count its reduces, each of the Driver's 2 ms
    assert [e.epoch for e in d.epochs] == [1, 2]
    for e in d.epochs:
        assert e.batches == 16
        assert e.reduces >= 1
        assert e.avg_reduce_ms == pytest.approx(2.0)
        assert [r.alive for r in e.per_rank] == [True, True]
    assert d.coord.view(d.now).last_reduce_ms == 2.0


def test_the_start_announces_the_run_and_opens_round_0_from_the_root() -> None:
    c = coordinator(2)
    c.handle(TrainerJoined(hello=hello(0, spec())), 1.0)
    out = c.handle(TrainerJoined(hello=hello(1, spec())), 2.0)
    assert out[:3] == [
        Tell(
            to=1,
            message=m.TrainerWelcome(rank=1, world_size=2, run_id="r", primary_rank=0),
        ),
        Announce(text="training: 2 rank(s), CADENCE on CPU, 2 x 16 batches"),
        StartRound(
            round=0,
            kind="init",
            expected=frozenset({0, 1}),
            from_controller=False,
            reducer=True,
            message=m.Reduce(
                round=0,
                kind="init",
                from_controller=False,
                plan=m.RoundPlan(steps=(0, 0), gamma=1.0),
            ),
        ),
    ]
    assert [(p.rank, p.round, p.epoch, p.progress) for p in plans(out)] == [
        (0, 1, 0, 0.0),
        (1, 1, 0, 0.0),
    ]
    assert c.phase is CoordPhase.INIT


def test_a_stopped_collective_run_contributes_its_final_round_then_uploads_it() -> None:
    d = Driver(spec(backend=Backend.COLLECTIVE))
    d.join_all()
    for _ in range(4):
        d.feed(d.pending.popleft())
    d.feed(StopRequested(reason="SIGTERM"))
    d.run()
    assert [(r.kind, r.from_controller, r.reducer) for r in d.rounds[-2:]] == [
        ("final", False, False),
        ("upload", False, True),
    ]
    assert isinstance(d.ended, Finish)
    assert d.ended.interrupted


# ----- what ElChe and the plans are told ---------------------------------------------------------


def window(rank: int, round_: int, compute_ms: float, data_ms: float) -> WindowReported:
    return WindowReported(
        report=m.WindowDone(
            rank=rank,
            round=round_,
            epoch=0,
            batches=2,
            samples=8,
            compute_ms=compute_ms,
            data_ms=data_ms,
            loss_sum=1.0,
        )
    )


def test_a_ranks_data_wait_counts_in_its_speed_under_cadence() -> None:
    """CADENCE times what a rank's window cost it, data loading included: a rank that computes
    fast but waits on its data is the slow one."""
    c = coordinator(2)
    for rank in (0, 1):
        c.handle(TrainerJoined(hello=hello(rank, spec(epochs=3, dataset_len=1600))), 1.0)
    c.handle(RoundCompleted(round=0, kind="init", mass=1.0, duration_ms=1.0), 2.0)
    c.handle(window(0, 1, 20.0, 0.0), 3.0)
    out = c.handle(window(1, 1, 2.0, 30.0), 3.0)  # 32 ms against rank 0's 20 ms
    [started_round] = [a for a in out if isinstance(a, StartRound)]
    assert (started_round.round, started_round.kind) == (1, "model")
    counts = c.view(3.0).counts
    assert counts[0] > counts[1] == 2  # the slow rank anchors
    assert [(p.rank, p.round, p.quota) for p in plans(out)] == [(0, 2, counts[0]), (1, 2, 2)]
    assert c.view(3.0).ranks[1].batches == 2


def test_plan_progress_is_the_share_of_the_epoch_in_a_consensus() -> None:
    """A plan's progress (the ranks' progress bar) counts the batches already reduced: the Driver
    completes each round before the next fires, so round r's plans see the rounds up to r - 2."""
    d = Driver(spec(Policy.CADENCE, epochs=3))
    d.run()
    issued = plans(d.actions)
    for p in issued:
        reduced = sum(q.quota for q in issued if q.epoch == p.epoch and q.round <= p.round - 2)
        assert p.progress == pytest.approx(p.epoch + reduced / 16), p
    assert {p.progress for p in issued} > {0.0, 1.0, 2.0}  # within an epoch too


def test_sync_plans_are_one_slice_each_and_an_empty_slice_holds_at_once() -> None:
    d = Driver(spec(Policy.SYNC, dataset_len=4))  # one batch for two ranks
    d.join_all()
    first = plans(d.actions)
    assert [(p.rank, p.ranges, p.quota, p.progress) for p in first] == [
        (0, ((0, 1),), 1, 0.0),
        (1, (), 0, 0.0),
    ]
    d.run()
    assert isinstance(d.ended, Finish)
    assert [p.progress for p in plans(d.actions) if p.epoch == 1] == [1.0, 1.0]


def test_sync_slices_follow_the_partition_ratios_of_this_world_size_only() -> None:
    d = Driver(spec(Policy.SYNC, elche=ElCheConfig(partition_ratios=(0.75, 0.25))))
    d.join_all()
    assert [p.ranges for p in plans(d.actions)] == [((0, 12),), ((12, 4),)]
    assert all(p.quota == 1 for p in plans(d.actions))
    d = Driver(spec(Policy.SYNC, elche=ElCheConfig(partition_ratios=(0.5, 0.25, 0.25))))
    d.join_all()
    assert [p.ranges for p in plans(d.actions)] == [((0, 8),), ((8, 8),)]
    d.run()
    assert isinstance(d.ended, Finish)
    assert [e.counts for e in d.epochs] == [d.coord.view(d.now).counts] * 2


# ----- joining, looked at closely --------------------------------------------------------------


def test_the_welcome_names_the_primary_and_round_0_starts_with_the_training_line() -> None:
    c = Coordinator(
        CoordinatorConfig(run_id="run-7", world_size=2, primary_rank=1, hosts={0: "a"}), now=0.0
    )
    first = hello(0, spec(max_failure=1, backend=Backend.COLLECTIVE))
    assert c.handle(TrainerJoined(hello=first), 1.0) == [
        Tell(to=0, message=m.TrainerWelcome(rank=0, world_size=2, run_id="run-7", primary_rank=1))
    ]
    out = c.handle(
        TrainerJoined(hello=hello(1, spec(max_failure=1, backend=Backend.COLLECTIVE))), 2.0
    )
    assert isinstance(out[1], Announce)
    assert out[1].text.startswith("training: 2 rank(s), CADENCE on COLLECTIVE")
    assert isinstance(out[2], StartRound)
    assert c.reference == first  # the stage kept it through the start
    # a rank with no host of record is "its host" in verdicts, "" on the page
    assert c.view(2.0).ranks[1].host == ""
    lost = c.handle(RankLost(rank=1, reason="killed"), 3.0)
    assert lost[0] == warning("rank 1 on its host lost: killed")
    assert c.view(3.0).ranks[1].state == "dead"


def test_a_frame_from_a_rank_that_has_not_joined_is_not_its_heartbeat() -> None:
    c = coordinator(2)
    c.handle(TrainerJoined(hello=hello(0, spec())), 1.0)
    c.handle(FrameSeen(rank=1), 5.0)
    assert c.view(7.0).ranks[1].heartbeat_age == 0.0
    assert c.view(7.0).ranks[0].heartbeat_age == 6.0


def test_a_digest_that_does_not_match_names_the_rank_its_host_and_the_likely_cause() -> None:
    import dataclasses

    c = coordinator(3)
    bad = dataclasses.replace(hello(2, spec()), digest="00" * 32)
    reason = (
        "rank 2 (host b) sent a digest that does not match its own Trainer spec; are the rank "
        "and the controller running the same flodl_async version?"
    )
    assert c.handle(TrainerJoined(hello=bad), 1.0) == [
        Tell(to=2, message=m.TrainerReject(rank=2, reason=reason)),
        warning(reason),
        shutdown(reason, ""),
        Fail(code=ExitCode.FORMATION, reason=reason, rank=2),
    ]


# ----- COLLECTIVE rounds --------------------------------------------------------------------


def test_a_collective_round_completes_on_each_ranks_reducedone_once() -> None:
    c = coordinator(2)
    for rank in (0, 1):
        c.handle(TrainerJoined(hello=hello(rank, spec(backend=Backend.COLLECTIVE))), 1.0)

    def done(rank: int, round_: int, ms: float) -> CollectiveDone:
        return CollectiveDone(message=m.ReduceDone(rank=rank, round=round_, mass=1.0, ms=ms))

    assert c.handle(done(0, 5, 1.0), 2.0) == []  # not the round in flight
    assert c.handle(done(0, 0, 4.0), 2.0) == []
    assert c.handle(done(0, 0, 9.0), 2.0) == []  # a second answer from rank 0 counts once
    assert c.handle(RoundCompleted(round=0, kind="init", mass=1.0, duration_ms=1.0), 2.0) == [
        warning("round 0 (init) completed, but it is not the round in flight; ignoring")
    ]  # the reducer does not run collective rounds
    assert c.phase is CoordPhase.INIT
    c.handle(done(1, 0, 3.0), 2.0)
    assert c.phase is CoordPhase.TRAINING
    assert c.view(2.0).last_reduce_ms == 4.0  # the slowest rank's


def test_the_reducer_ignores_reducedone_on_the_cpu_backend() -> None:
    d = started()
    assert (
        d.coord.handle(
            CollectiveDone(message=m.ReduceDone(rank=0, round=0, mass=1.0, ms=1.0)), d.now
        )
        == []
    )
    assert (
        d.coord.handle(
            CollectiveDone(message=m.ReduceDone(rank=1, round=0, mass=1.0, ms=1.0)), d.now
        )
        == []
    )
    assert d.coord.phase is CoordPhase.INIT
