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
from flodl_async.training.policy import Backend
from flodl_async.training.spec import TrainerSpec
from flodl_async.verdict import ExitCode
from flodl_async.wire import messages as m

from .coordkit import Driver, hello
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
            message=m.Reduce(round=1, kind="final", from_controller=False),
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


def test_a_clean_exit_mid_run_is_a_loss_with_the_whole_chain() -> None:
    d = started()
    out = d.coord.handle(RankExiting(message=m.Exiting(rank=1, reason="done")), d.now)
    assert out == lost_mid_run(1, "h1", "it left before training ended (done)")
    assert d.coord.phase is CoordPhase.FAILED
    assert (d.coord.dead, d.coord.alive) == ({1}, {0})


def test_a_clean_exit_while_joining_is_lost_before_training_started() -> None:
    c = coordinator(2)
    c.handle(TrainerJoined(hello=hello(0, spec())), 1.0)
    out = c.handle(RankExiting(message=m.Exiting(rank=0, reason="done")), 2.0)
    assert out == lost_mid_run(0, "a", "it left before training ended (done)", before=True)


def test_a_death_record_is_a_loss_with_its_traceback() -> None:
    d = started()
    out = d.coord.handle(
        RankExiting(message=m.Exiting(rank=0, reason="error", error="Traceback: boom")), d.now
    )
    chain = lost_mid_run(0, "h0", "it raised (error)")
    fail = chain[-1]
    assert isinstance(fail, Fail)
    chain[-1] = Fail(
        code=fail.code,
        reason=fail.reason,
        rank=0,
        details="Traceback: boom",
        save_reason="rank_lost",
    )
    assert out == chain


def test_a_clean_exit_before_its_hello_is_the_supervisors_but_shows_on_the_page() -> None:
    c = coordinator(2)
    c.handle(TrainerJoined(hello=hello(0, spec())), 1.0)
    assert c.handle(RankExiting(message=m.Exiting(rank=1, reason="done")), 2.0) == []
    assert [r.state for r in c.view(2.0).ranks] == ["training", "exiting"]
    assert c.phase is CoordPhase.JOINING


def test_a_lost_collective_rank_ends_the_run_since_a_process_group_cannot_shrink() -> None:
    s = spec(backend=Backend.COLLECTIVE)
    c = Coordinator(CoordinatorConfig(run_id="r", world_size=2, elastic=True), now=0.0)
    for rank in (0, 1):
        c.handle(TrainerJoined(hello=hello(rank, s)), 1.0)
    out = c.handle(RankLost(rank=1, reason="killed"), 1.0)
    reason = "rank 1 on its host was lost mid-training: killed"
    assert out[-2:] == [
        shutdown(reason, "collective_lost"),
        Fail(code=ExitCode.RANK_FAILURE, reason=reason, rank=1, save_reason="collective_lost"),
    ]


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
