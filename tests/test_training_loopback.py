"""The controller's Trainer shell on real sockets: the in-process controller, its local agent and relay, rank processes
speaking the coordinator protocol at the framing level (tests/scripts/trainer_rank.py, no torch).

Rounds go through the shell's reducer seam (:class:`LoopbackRounds`): it completes each round once opened, as
the real reducer does once every expected rank contributed (one test runs the real reducer and relay fold;
tests/test_averaging.py tests the data plane itself). Everything else is real: the relay's rank checks and broadcasts, the controller's routing, heartbeats, the verdict.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from flodl_async.agent import RankOutput
from flodl_async.config.cluster import DeviceSpec, WorkerSpec
from flodl_async.control.membership import JoinConfig
from flodl_async.controller import Controller, ExitCode, LaunchPlan, PlacedWorker, Placement
from flodl_async.controller.roundstate import ReducerStatistics
from flodl_async.deadlines import Deadlines
from flodl_async.trainer.launcher import TrainerAttachment, attach
from flodl_async.training.metrics import EpochMetrics
from flodl_async.training.spec import ElCheConfig, TrainerSpec
from flodl_async.verdict import RunResult
from flodl_async.wire import messages as m
from flodl_async.wire import new_session_secret

from .launchkit import PY, assert_nothing_left, new_run_id, script
from .test_controller_inprocess import LineSink

pytestmark = pytest.mark.e2e

#: What tests/scripts/trainer_data_rank.py builds (the launcher's reference in the launcher-role test).
LAUNCHER_SPEC = TrainerSpec(
    epochs=1,
    batch_size=4,
    dataset_len=32,
    elche=ElCheConfig(anchor=2, adapt=False),
    heartbeat_timeout=10.0,
)
epochs_seen: list[EpochMetrics] = []


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    round: int
    kind: str
    mass: float
    duration_ms: float
    folded: dict[int, int] | None = None


@dataclass
class LoopbackRounds:
    """The reducer seam: records what the shell asked, completes each round at once (mass = expected ranks)."""

    opened: list[tuple[int, str, frozenset[int], bool]] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    closed: bool = False
    _results: dict[int, Result] = field(default_factory=dict)

    def open_round(
        self,
        round: int,
        kind: str,
        expected_ranks: frozenset[int],
        from_controller: bool = False,
        plan: m.RoundPlan | None = None,
        *,
        snapshot: bool = False,
    ) -> None:
        assert not snapshot  # no checkpoint in these runs
        assert plan is not None  # the coordinator opens every round with its plan
        self.opened.append((round, kind, expected_ranks, from_controller))
        self._results[round] = Result(
            round=round,
            kind=kind,
            mass=0.0 if from_controller else float(len(expected_ranks)),
            duration_ms=1.0,
        )

    async def wait_round(self, round: int) -> Result:
        await asyncio.sleep(0)  # a real reducer completes later, never inside open_round
        return self._results[round]

    def declare_dead(self, rank: int) -> None:
        self.dead.append(rank)

    @property
    def last_consensus(self) -> None:
        return None  # no data plane behind this seam

    def statistics(self) -> ReducerStatistics:
        return ReducerStatistics(
            hosts=0, in_process_hosts=0, rounds_completed=len(self._results)
        )  # no uplinks behind this seam

    async def aclose(self) -> None:
        self.closed = True


def run_controller(
    tmp_path: Path,
    mode: str,
    mode_rank: int,
    *,
    scale: float = 1.0,
    heartbeat_timeout: float = 2.0,
    command: tuple[str, ...] | None = None,
    attach_to: list[TrainerAttachment] | None = None,
) -> tuple[RunResult, bytes, LoopbackRounds, Controller]:
    run_id = new_run_id()
    plan = LaunchPlan(
        run_id=run_id,
        secret=new_session_secret(),
        bind_host="127.0.0.1",
        port=0,
        join=JoinConfig(min_rank_start=2, join_timeout=30, target_ranks=2, max_join_timeout=60),
        workers=(
            PlacedWorker(
                spec=WorkerSpec(host="localhost", devices=DeviceSpec.cpu(2)),
                placement=Placement.LOCAL,
            ),
        ),
        command=command
        or (PY, script("trainer_rank.py"), mode, str(mode_rank), str(heartbeat_timeout)),
        deadlines=Deadlines.resolve(stop_grace=1.0, env={"FLODL_NET_TIMEOUT_SCALE": str(scale)}),
    )
    rounds = LoopbackRounds()

    async def main() -> tuple[RunResult, bytes, Controller]:
        sink = LineSink()
        seam = (
            None if command is not None else (lambda _spec, _schema, _digest, _misbehaved: rounds)
        )
        controller = Controller(
            plan, output=RankOutput(stdout=sink, stderr=sink), training_rounds=seam
        )  # type: ignore[arg-type]
        if (
            attach_to is not None
        ):  # the launcher role: its own spec is the reference, epochs come to it
            attach_to.append(
                attach(controller, reference=LAUNCHER_SPEC, on_epoch=epochs_seen.append)
            )
        await controller.bind()
        async with asyncio.timeout(90):
            result = await controller.run()
        return result, bytes(sink.data), controller

    result, output, controller = asyncio.run(main())
    assert_nothing_left(run_id)
    return result, output, rounds, controller


def test_a_trainer_run_completes_with_every_batch_trained_once(tmp_path: Path) -> None:
    result, output, rounds, controller = run_controller(tmp_path, "ok", -1)
    assert result.exit_code is ExitCode.OK, (result, output.decode())
    assert result.reason == "training complete: 2 epoch(s) on 2 rank(s)"
    text = output.decode()
    for rank in (
        0,
        1,
    ):  # every rank heard Shutdown and both EpochAggregated broadcasts, through its relay
        assert (
            f"rank {rank} shutdown: training complete: 2 epoch(s) on 2 rank(s) (completed); 2 epochs aggregated"
            in text
        )
        assert f"rank {rank} welcomed into a world of 2" in text
    spec = TrainerSpec(epochs=2, batch_size=4, dataset_len=64)
    for epoch in range(2):
        batches = [
            int(b)
            for line in re.findall(rf"rank \d epoch {epoch} batches ([\d,]+)", text)
            for b in line.split(",")
        ]
        assert sorted(batches) == list(range(spec.n_batches)), (
            epoch
        )  # each batch of the epoch exactly once
    kinds = [kind for _r, kind, _e, _f in rounds.opened]
    assert kinds[0] == "init"
    assert kinds[-1] == "final"
    assert set(kinds[1:-1]) == {"model"}
    assert rounds.opened[0][2] == frozenset({0, 1})
    assert rounds.opened[-1][3] is True  # natural CADENCE end: the held consensus is final
    assert rounds.dead == []
    assert rounds.closed  # the shell closed its reducer at teardown
    training = controller._training  # what the shell published
    assert training is not None
    assert [e.epoch for e in training.epochs] == [1, 2]
    assert all(e.batches == spec.n_batches for e in training.epochs)
    snapshot = controller.status_board.snapshot
    assert snapshot is not None
    doc = json.loads(snapshot.to_json())["training"]  # what /state.json serves
    assert (doc["phase"], doc["epoch"], doc["epochs"], doc["policy"], doc["backend"]) == (
        "done",
        2,
        2,
        "cadence",
        "cpu",
    )
    assert [r["batches"] for r in doc["ranks"]] == [16, 16]
    assert doc["last_epoch"]["epoch"] == doc["epoch"] == 2  # both count from 1


def test_a_rank_with_a_different_trainer_is_the_runs_verdict(tmp_path: Path) -> None:
    result, output, _rounds, _c = run_controller(tmp_path, "mismatch", 1)
    assert result.exit_code is ExitCode.FORMATION, (result, output.decode())
    # Whichever rank said hello second is the one named; the other is the reference.
    pattern = (
        r"rank (\d) \(host localhost\) built a different Trainer than rank (\d): epochs (\d) != (\d)\. Every rank must build the Trainer "
        r"from the same arguments — are the ranks running different code or command lines\?"
    )
    found = re.fullmatch(pattern, result.reason)
    assert found is not None, result.reason
    assert {found[1], found[2]} == {"0", "1"}
    assert {found[3], found[4]} == {"2", "3"}
    # (Whether the rejected rank prints its TrainerReject before the verdict's stop reaches it is a race: not asserted.)


def test_a_frozen_rank_is_dropped_by_the_heartbeat_deadline_killed_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    result, output, rounds, _c = run_controller(tmp_path, "freeze", 1)
    assert result.exit_code is ExitCode.OK, (result, output.decode())
    assert re.fullmatch(
        r"training complete, DEGRADED — 1 of 2 ranks lost \(rank 1 on host localhost: no frame "
        r"for 2 s \(heartbeat timeout: the rank is frozen, stopped or cut off\) at epoch 1\); "
        r"2 epoch\(s\) on 1 rank\(s\)",
        result.reason,
    ), result.reason
    assert rounds.dead == [1]
    # its agent killed the stopped process (else the run would wait on it for ever)


def test_a_rank_that_raises_is_dropped_and_named_in_the_degraded_verdict(tmp_path: Path) -> None:
    result, output, _rounds, _c = run_controller(tmp_path, "raise", 0)
    assert result.exit_code is ExitCode.OK, (result, output.decode())
    assert result.reason.startswith(
        "training complete, DEGRADED — 1 of 2 ranks lost (rank 0 on host localhost: it raised "
        "(error) at epoch 1)"
    ), result.reason


def test_a_rank_that_never_starts_its_trainer_times_out_by_name(tmp_path: Path) -> None:
    result, output, _rounds, _c = run_controller(
        tmp_path, "silent", 1, scale=0.1, heartbeat_timeout=30.0
    )  # 3 s, the 120 s hello 12 s
    assert result.exit_code is ExitCode.FORMATION, (result, output.decode())
    assert result.reason == (
        "rank 1 on host localhost did not start its Trainer within 12 s of rank 0 — is it running the same script, and does it reach trainer.run()?"
    )


def test_rounds_average_through_the_real_reducer_and_relay(tmp_path: Path) -> None:
    """The real Reducer and relay fold under the coordinator: init is rank 0's state, model rounds the steps-weighted mean."""
    attached: list[TrainerAttachment] = []
    epochs_seen.clear()
    result, output, _rounds, controller = run_controller(
        tmp_path, "", -1, command=(PY, script("trainer_data_rank.py")), attach_to=attached
    )
    text = output.decode()
    assert result.exit_code is ExitCode.OK, (result, text)
    assert result.reason == "training complete: 1 epoch(s) on 2 rank(s)"
    for rank in (0, 1):
        assert (
            f"rank {rank} round 0 init mass 1 w [1.0, 1.0, 1.0, 1.0]" in text
        )  # the root's state, everywhere
        assert (
            f"rank {rank} round 1 model mass 4 w [1.5, 1.5, 1.5, 1.5]" in text
        )  # (2·1 + 2·2) / (2 + 2)
        assert f"rank {rank} round 2 model mass 4 w [1.5, 1.5, 1.5, 1.5]" in text
        assert re.search(
            rf"rank {rank} round 3 final mass [\d.]+ w \[1.5, 1.5, 1.5, 1.5\]", text
        ), text  # the held consensus
        assert (
            f"rank {rank} shutdown: training complete: 1 epoch(s) on 2 rank(s) (completed)" in text
        )
    training = controller._training
    assert training is not None
    assert [e.batches for e in training.epochs] == [8]
    # The controller handed its reducer to its own host's agent: that relay's frames went in memory.
    assert [(u.host, u.in_process) for u in training.uplinks()] == [("localhost", True)]
    # The launcher's side: the final consensus and counters, and the epochs it was handed.
    [handle] = attached
    final = handle.outcome()
    assert final is not None
    assert final.state_dict is not None
    assert final.state_dict["w"].tolist() == [1.5, 1.5, 1.5, 1.5]
    assert (
        final.param_names,
        final.epochs_completed,
        final.global_step,
        final.world_size,
        final.lost_ranks,
        final.interrupted,
    ) == (("w",), 1, 4, 2, (), False)
    assert [e.epoch for e in epochs_seen] == [1]


def test_a_launcher_signal_stops_training_in_order_before_any_signal_reaches_the_ranks(
    tmp_path: Path,
) -> None:
    run_id = new_run_id()
    plan = LaunchPlan(
        run_id=run_id,
        secret=new_session_secret(),
        bind_host="127.0.0.1",
        port=0,
        join=JoinConfig(min_rank_start=2, join_timeout=30, target_ranks=2, max_join_timeout=60),
        workers=(
            PlacedWorker(
                spec=WorkerSpec(host="localhost", devices=DeviceSpec.cpu(2)),
                placement=Placement.LOCAL,
            ),
        ),
        command=(PY, script("trainer_rank.py"), "slow", "-1", "10"),
        deadlines=Deadlines.resolve(stop_grace=1.0, env={}),
    )
    rounds = LoopbackRounds()

    async def main() -> tuple[RunResult, bytes]:
        sink = LineSink()
        controller = Controller(
            plan,
            output=RankOutput(stdout=sink, stderr=sink),
            training_rounds=lambda _s, _m, _d, _liar: rounds,
        )  # type: ignore[arg-type]
        await controller.bind()
        task = asyncio.get_running_loop().create_task(controller.run(), name="controller")
        async with asyncio.timeout(60):
            await sink.wait_for(b"rank 1 window 2")  # training, mid-epoch
            controller.interrupt(signal.SIGTERM)
            result = await task
        return result, bytes(sink.data)

    result, output = asyncio.run(main())
    assert_nothing_left(run_id)
    text = output.decode()
    assert result.exit_code is ExitCode.TERMINATED, (result, text)
    assert re.fullmatch(
        r"training stopped \(SIGTERM\) after [01] of 2 epoch\(s\)", result.reason
    ), result.reason
    for rank in (
        0,
        1,
    ):  # each rank heard the orderly Shutdown and exited 0: no signal reached it first
        assert f"rank {rank} shutdown: {result.reason} (graceful_shutdown)" in text
    final = [r for r in rounds.opened if r[1] == "final"]
    assert len(final) == 1
    assert final[0][3] is False  # the ranks stepped since the last reduce: they contribute


def test_collective_rounds_are_answered_by_the_ranks_and_the_primary_uploads(
    tmp_path: Path,
) -> None:
    result, output, rounds, _c = run_controller(tmp_path, "collective", -1)
    text = output.decode()
    assert result.exit_code is ExitCode.OK, (result, text)
    assert "rank 1 all_reduced round 0 (init)" in text
    assert "rank 0 all_reduced round 1 (model)" in text
    assert rounds.opened == [
        (rounds.opened[0][0], "upload", frozenset({0, 1}), False)
    ]  # only the upload goes through the reducer
