"""When the coordinator writes a checkpoint bundle, and where a resumed run starts: pure, on a fake
clock (the scripted ranks of ``coordkit`` train their plans at once)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from flodl_async.control.vocab import Announce, Level, Tick
from flodl_async.errors import ConfigError
from flodl_async.training import partition as part
from flodl_async.training.coordination import (
    CheckpointRequested,
    CoordinatorConfig,
    Fail,
    Finish,
    SaveCheckpoint,
    StopRequested,
)
from flodl_async.training.coordinator import Coordinator
from flodl_async.training.policy import Backend, Policy
from flodl_async.training.saves import ResumePoint, SaveClock
from flodl_async.training.spec import Checkpointing, ElCheConfig, TrainerSpec
from flodl_async.verdict import ExitCode

from .coordkit import Driver, plans

N, B = 64, 4  # 16 batches per epoch
SAVE = "ckpt/run"


def spec(policy: Policy = Policy.SYNC, **checkpoint: object) -> TrainerSpec:
    # frozen counts: 2 batches a rank per window, 4 windows an epoch, however the clock goes
    elche = (
        ElCheConfig(max_batch_diff=0)
        if policy is Policy.SYNC
        else ElCheConfig(anchor=2, adapt=False)
    )
    return TrainerSpec(
        policy=policy,
        epochs=3,
        batch_size=B,
        dataset_len=N,
        heartbeat_timeout=1000.0,
        elche=elche,
        checkpoint=Checkpointing(save_path=SAVE, **checkpoint),  # type: ignore[arg-type]
        max_failure=1,
    )


def saves(d: Driver) -> list[SaveCheckpoint]:
    return [a for a in d.actions if isinstance(a, SaveCheckpoint)]


def marked(d: Driver) -> dict[int, str]:
    return {r.round: r.checkpoint for r in d.rounds if r.checkpoint}


def covered_when_saved(d: Driver) -> Callable[[], None]:
    """Each bundle's coverage is what the consensus held as the coordinator took it."""
    checked: list[SaveCheckpoint] = []
    feed = d.feed

    def checking(event: object) -> list[object]:
        out = feed(event)  # type: ignore[arg-type]
        for action in out:
            if isinstance(action, SaveCheckpoint) and not action.last:
                held = sorted(d.consensus[action.epoch]) if action.epoch < d.spec.epochs else []
                assert part.coalesce((b, 1) for b in held) == action.coverage, action
                checked.append(action)
        return out  # type: ignore[return-value]

    d.feed = checking  # type: ignore[method-assign]
    return lambda: None


# ----- the clock ----------------------------------------------------------------------------


def test_the_save_clock_marks_requests_epochs_rounds_and_time_in_that_order() -> None:
    clock = SaveClock(Checkpointing(save_path=SAVE, every_epochs=2, every_rounds=3))
    clock.started(0.0)
    assert [clock.due(closes_epoch=None, now=t) for t in (1.0, 2.0, 3.0)] == [None, None, "round"]
    assert clock.due(closes_epoch=0, now=4.0) is None  # the 1st epoch: not the 2nd
    assert clock.due(closes_epoch=1, now=5.0) == "epoch"  # the 2nd, and the round count restarts
    assert clock.request()
    assert clock.due(closes_epoch=3, now=6.0) == "request"  # a request says why first
    timed = SaveClock(Checkpointing(save_path=SAVE, every_seconds=10.0))
    timed.started(100.0)
    assert [timed.due(closes_epoch=None, now=t) for t in (105.0, 110.0, 115.0, 120.5)] == [
        None,
        "time",
        None,
        "time",
    ]
    nowhere = SaveClock(Checkpointing())
    assert not nowhere.request()
    assert nowhere.due(closes_epoch=0, now=1.0) is None


# ----- when a run marks its rounds ------------------------------------------------------------------


@pytest.mark.parametrize("policy", [Policy.SYNC, Policy.CADENCE])
def test_every_epochs_marks_the_round_that_closes_each_epoch_and_no_duplicate_end(
    policy: Policy,
) -> None:
    d = Driver(spec(policy, every_epochs=1))
    covered_when_saved(d)
    d.run()
    assert isinstance(d.ended, Finish)
    bundles = saves(d)
    assert [(s.reason, s.epoch, s.coverage) for s in bundles] == [
        ("epoch", 1, ()),
        ("epoch", 2, ()),
        ("epoch", 3, ()),
    ]
    assert all(s.ranks == {0, 1} and s.world_size == 2 for s in bundles)
    for s in bundles:  # the round's Reduce asked each rank for its state, by the bundle's round
        (start,) = (r for r in d.rounds if r.round == s.round)
        assert (start.checkpoint, start.message.checkpoint) == ("epoch", s.bundle_round)
    # the final round's consensus is the last epoch's: its bundle is already being written
    assert [r.checkpoint for r in d.rounds if r.kind == "final"] == [""]
    assert bundles[-1].global_step == 3 * 16 // 2


def test_every_rounds_marks_mid_epoch_rounds_with_the_batches_their_consensus_holds() -> None:
    d = Driver(spec(Policy.CADENCE, every_rounds=3))
    covered_when_saved(d)
    d.run()
    model = [r.round for r in d.rounds if r.kind == "model"]
    assert [r for r in model if r in marked(d)] == model[2::3]
    # the 12th and last model round is marked: the final consensus is its bundle's, no "end"
    assert {s.reason for s in saves(d)} == {"round"}
    assert any(s.coverage for s in saves(d))  # mid-epoch bundles say what they hold


def test_a_request_marks_the_next_model_round() -> None:
    d = Driver(spec(Policy.SYNC))
    d.join_all()
    while len([r for r in d.rounds if r.kind == "model"]) < 3:
        d.feed(d.pending.popleft())
    out = d.feed(CheckpointRequested(reason="rank 1 asked for one"))
    assert out == [Announce(text="checkpoint requested (rank 1 asked for one): at the next reduce")]
    d.drain()
    reasons = [s.reason for s in saves(d)]
    assert reasons == ["request", "end"]
    assert saves(d)[0].coverage  # mid-epoch: the lockstep windows of 4 rounds


def test_every_seconds_counts_on_the_fake_clock() -> None:
    d = Driver(spec(Policy.SYNC, every_seconds=0.01))  # the driver's clock moves 1 ms per event
    d.run()
    times = [s for s in saves(d) if s.reason == "time"]
    assert len(times) >= 2


def test_the_end_marks_the_final_round_and_its_bundle_comes_before_the_shutdown() -> None:
    d = Driver(spec(Policy.SYNC))
    d.run()
    assert marked(d) == {max(r.round for r in d.rounds): "end"}
    kinds = [type(a) for a in d.actions if isinstance(a, SaveCheckpoint | Finish)]
    assert kinds == [SaveCheckpoint, Finish]
    assert saves(d)[0].epoch == 3


@pytest.mark.parametrize(("on_shutdown", "reasons"), [(True, ["shutdown"]), (False, [])])
def test_an_orderly_stop_saves_when_on_shutdown(on_shutdown: bool, reasons: list[str]) -> None:
    d = Driver(spec(Policy.SYNC, on_shutdown=on_shutdown))
    d.join_all()
    while len(d.rounds) < 5:
        d.feed(d.pending.popleft())
    d.feed(StopRequested(reason="SIGTERM"))
    d.drain()
    assert isinstance(d.ended, Finish)
    assert [s.reason for s in saves(d)] == reasons


def test_max_failure_breached_saves_the_last_consensus_before_the_verdict() -> None:
    d = Driver(spec(Policy.SYNC))
    d.join_all()
    while len(d.rounds) < 6:
        d.feed(d.pending.popleft())
    out = d.kill(1)
    (save,) = (a for a in out if isinstance(a, SaveCheckpoint))
    (fail,) = (a for a in out if isinstance(a, Fail))
    assert out.index(save) < out.index(fail)
    assert (fail.code, save.reason, save.last, save.ranks) == (
        ExitCode.MAX_FAILURE,
        "max_failure_exceeded",
        True,
        frozenset(),
    )
    assert save.round == d.coord.committed[0]  # type: ignore[index]


def test_a_stalled_round_saves_the_last_consensus_before_its_verdict() -> None:
    d = Driver(spec(Policy.SYNC))
    d.join_all()
    while len([r for r in d.rounds if r.kind == "model"]) < 3:
        d.feed(d.pending.popleft())
    d.pending.clear()  # the third model round never completes
    out = d.coord.handle(Tick(), d.now + 121.0)
    (save,) = (a for a in out if isinstance(a, SaveCheckpoint))
    (fail,) = (a for a in out if isinstance(a, Fail))
    assert out.index(save) < out.index(fail)
    assert (fail.code, save.reason, save.last) == (ExitCode.STALLED, "stall", True)
    assert save.round == d.coord.committed[0]  # type: ignore[index]  # the second model round


def test_without_a_save_path_nothing_is_marked_and_a_request_says_so() -> None:
    plain = TrainerSpec(
        policy=Policy.SYNC, epochs=1, batch_size=B, dataset_len=N, heartbeat_timeout=1000.0
    )
    d = Driver(plain)
    d.join_all()
    out = d.feed(CheckpointRequested(reason="the launcher's TrainingRun.checkpoint()"))
    assert len(out) == 1
    assert out[0].level is Level.WARNING  # type: ignore[union-attr]
    d.drain()
    assert saves(d) == []
    assert marked(d) == {}


# ----- resume ---------------------------------------------------------------------------------------


def resumed(policy: Policy, point: ResumePoint) -> Driver:
    d = Driver(spec(policy))
    d.coord = Coordinator(
        CoordinatorConfig(run_id="r", world_size=2, hosts={0: "h0", 1: "h1"}, resume=point),
        now=d.now,
    )
    return d


@pytest.mark.parametrize("policy", [Policy.SYNC, Policy.CADENCE])
def test_a_resumed_run_continues_the_bundle_round_epoch_step_and_coverage(policy: Policy) -> None:
    point = ResumePoint(bundle=f"{SAVE}/r00000020-request", round=20, epoch=1, global_step=12,
                        coverage=((0, 4), (8, 4)))  # fmt: skip
    d = resumed(policy, point)
    d.join_all()
    (init,) = (r for r in d.rounds if r.kind == "init")
    # no rank's state seeds it: every rank takes the bundle's consensus the reducer holds
    assert init.message.plan is not None
    assert init.message.plan.root == -1
    first = plans(d.actions)
    assert {p.epoch for p in first} == {1}
    d.drain()
    assert isinstance(d.ended, Finish)
    # epoch 1's covered batches are not trained again; the others once, epoch 2 whole
    assert sorted(b for r in (0, 1) for b in d.trained[(1, r)]) == [*range(4, 8), *range(12, 16)]
    assert sorted(b for r in (0, 1) for b in d.trained[(2, r)]) == list(range(16))
    assert d.coord.completed_epochs == 3
    assert d.coord.global_step == 12 + (8 + 16) // 2
    (end,) = saves(d)
    assert end.bundle_round > 20  # the bundle's rounds continue


def test_a_run_resumed_at_its_last_epoch_ends_after_the_init_round() -> None:
    d = resumed(Policy.SYNC, ResumePoint(bundle="b", round=48, epoch=3, global_step=24))
    d.run()
    assert isinstance(d.ended, Finish)
    assert [r.kind for r in d.rounds] == ["init", "final"]


# ----- what is accepted, and what is refused loudly ----------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"save_path": SAVE, "every_rounds": 0}, "every_rounds"),
        ({"save_path": SAVE, "every_seconds": -1.0}, "every_seconds"),
        ({"save_path": SAVE, "every_seconds": float("nan")}, "every_seconds"),
        ({"save_path": SAVE, "keep_last": 0}, "keep_last"),
        ({"every_rounds": 2}, "every_rounds needs a save_path"),
        ({"every_seconds": 60.0}, "every_seconds needs a save_path"),
        ({"keep_last": 2}, "keep_last needs a save_path"),
        ({"resume_from": "latest"}, "needs a save_path"),
        ({"save_path": ""}, "save_path"),
        ({"save_path": SAVE, "rank_state": 1}, "rank_state"),
    ],
)
def test_checkpointing_refuses_each_bad_setting_by_name(
    kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(ConfigError, match=field):
        Checkpointing(**kwargs)  # type: ignore[arg-type]


def test_checkpointing_on_the_collective_backend_is_refused_until_it_is_built() -> None:
    with pytest.raises(ConfigError, match="COLLECTIVE"):
        TrainerSpec(
            policy=Policy.CADENCE,
            backend=Backend.COLLECTIVE,
            epochs=1,
            batch_size=B,
            dataset_len=N,
            checkpoint=Checkpointing(save_path=SAVE),
        )


def test_the_new_fields_travel_in_the_spec_and_its_digest() -> None:
    a = spec(every_rounds=5, every_seconds=30.0, keep_last=2)
    assert TrainerSpec.from_wire(a.to_wire()).checkpoint == a.checkpoint
    assert spec(keep_last=2).to_wire() != spec(keep_last=3).to_wire()


class _Driver:
    primary = True

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.done: asyncio.Future[object] = asyncio.get_running_loop().create_future()

    async def run(self, publish: object) -> object:
        return await self.done

    def request_stop(self) -> None:
        self.asked.append("stop")
        if not self.done.done():
            self.done.set_result("state")

    def force_stop(self) -> None:
        self.asked.append("force")

    def request_checkpoint(self) -> None:
        self.asked.append("checkpoint")


@pytest.mark.parametrize(
    ("checkpoint", "save", "refused"),
    [
        (Checkpointing(), True, "has no Checkpointing"),
        (Checkpointing(save_path=SAVE), False, "on_shutdown=False"),
        (Checkpointing(save_path=SAVE, on_shutdown=False), True, "has no Checkpointing"),
        (Checkpointing(save_path=SAVE), True, None),
        (Checkpointing(), False, None),
        (Checkpointing(), None, None),
    ],
)
def test_shutdown_save_must_agree_with_the_run_and_checkpoint_needs_a_save_path(
    checkpoint: Checkpointing, save: bool | None, refused: str | None
) -> None:
    from flodl_async.trainer.api import TrainingRun
    from flodl_async.trainer.entry import Entry

    async def go() -> None:
        driver = _Driver()
        run = TrainingRun(driver, entry=Entry.INLINE, run_id="t", checkpoint=checkpoint)  # type: ignore[arg-type]
        if checkpoint.save_path is None:
            with pytest.raises(ConfigError, match="save_path"):
                await run.checkpoint()
        else:
            await run.checkpoint()
            assert driver.asked == ["checkpoint"]
        if refused is not None:
            with pytest.raises(ConfigError, match=refused):
                await run.shutdown(save=save)
            driver.request_stop()
        else:
            assert await run.shutdown(save=save) == "state"
        await run.join()

    asyncio.run(go())


def test_a_save_path_on_several_hosts_is_said_to_need_shared_storage_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from flodl_async.controller.resumes import warn_if_spread

    with caplog.at_level("WARNING"):
        warn_if_spread(Checkpointing(save_path=SAVE), ["a", "a"])
        warn_if_spread(Checkpointing(), ["a", "b"])
        assert caplog.records == []
        warn_if_spread(Checkpointing(save_path=SAVE), ["b", "a", "b"])
    (record,) = caplog.records
    assert SAVE in record.getMessage()
    assert "shared storage visible to every host" in record.getMessage()
