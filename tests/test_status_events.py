"""The run's event stream, pure: what the chronicle derives from consecutive snapshots, recoveries and their
durations, the board's history and event subscriptions (a slow one is dropped, never the publisher slowed), and
/metrics' fixed set rendered by prometheus_client."""

from __future__ import annotations

import dataclasses
import json
import math

from prometheus_client.parser import text_string_to_metric_families

from flodl_async.status import (
    MemberStatus,
    Phase,
    RankState,
    RankStatus,
    StatusBoard,
    StatusSnapshot,
)
from flodl_async.status.events import (
    EVENT_KINDS,
    CheckpointSaved,
    Chronicle,
    EpochDone,
    HostJoined,
    PhaseChanged,
    RankDied,
    RankRecovered,
    RankShare,
    Restarted,
    RoundDone,
    RunEvent,
    ScalarsReported,
    Stamped,
    VerdictGiven,
    WorldFormed,
)
from flodl_async.status.metrics import MAX_SCALAR_SERIES, METRICS, NOT_FED

MEMBER = MemberStatus(host="node-a", ranks=(0, 1), devices=("cpu:0", "cpu:1"), joined_at=1.0)


def _snap(at: float, phase: Phase = Phase.WAITING, **changes: object) -> StatusSnapshot:
    base = StatusSnapshot(run_id="run-e", phase=phase, started_at=0.0, updated_at=at)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def _ranks(*states: RankState) -> tuple[RankStatus, ...]:
    return tuple(
        RankStatus(
            rank=i,
            host="node-a",
            local_rank=i,
            state=s,
            exit_code=1 if s is RankState.FAILED else None,
        )
        for i, s in enumerate(states)
    )


def test_the_chronicle_tells_a_run_from_its_snapshots() -> None:
    c = Chronicle()
    assert c.after_snapshot(_snap(1.0)) == [PhaseChanged(phase=Phase.WAITING)]
    assert c.after_snapshot(_snap(2.0, members=(MEMBER,), joined_ranks=2)) == [
        HostJoined(host="node-a", ranks=(0, 1), devices=("cpu:0", "cpu:1"))
    ]
    running = _ranks(RankState.RUNNING, RankState.RUNNING)
    training = _snap(3.0, Phase.TRAINING, members=(MEMBER,), world_size=2, ranks=running)
    assert c.after_snapshot(training) == [
        PhaseChanged(phase=Phase.TRAINING),
        WorldFormed(world_size=2, hosts=1, restart=0),
    ]
    assert c.after_snapshot(dataclasses.replace(training, updated_at=3.5)) == []  # nothing changed
    done = dataclasses.replace(
        training, updated_at=9.0, phase=Phase.DONE, verdict="all ranks done", exit_code=0
    )
    assert c.after_snapshot(done) == [
        PhaseChanged(phase=Phase.DONE),
        VerdictGiven(exit_code=0, reason="all ranks done"),
    ]


def test_a_death_is_told_once_and_recovered_by_the_next_round_with_its_duration() -> None:
    c = Chronicle()
    c.after_snapshot(_snap(1.0, Phase.TRAINING, members=(MEMBER,), world_size=2))
    lost = {"lost": [{"rank": 1, "host": "node-a", "reason": "killed by SIGKILL at epoch 2"}]}
    dead = _snap(10.0, Phase.TRAINING, members=(MEMBER,), world_size=2, training=lost)
    assert c.after_snapshot(dead) == [
        RankDied(rank=1, host="node-a", reason="killed by SIGKILL at epoch 2")
    ]
    # the process's own end, reported later, is the same death
    later = dataclasses.replace(
        dead, updated_at=11.0, ranks=_ranks(RankState.RUNNING, RankState.FAILED)
    )
    assert c.after_snapshot(later) == []
    round_ = RoundDone(round=7, round_kind="average", reduce_s=0.01, batches=4, loss=0.5)
    assert c.after_event(round_, 12.5) == [
        RankRecovered(rank=1, host="node-a", by="regroup", seconds=2.5)
    ]
    assert c.after_event(round_, 13.0) == []  # recovered once


def test_a_restart_recovers_a_death_when_the_world_forms_again() -> None:
    c = Chronicle()
    c.after_snapshot(_snap(1.0, Phase.TRAINING, members=(MEMBER,), world_size=2))
    failed = _ranks(RankState.RUNNING, RankState.FAILED)
    world = {"members": (MEMBER,), "world_size": 2}
    assert c.after_snapshot(_snap(5.0, Phase.TRAINING, ranks=failed, **world)) == [
        RankDied(rank=1, host="node-a", reason="exit code 1")
    ]
    # the plain script's world stops: rank 0, ended by its agent, is not another death
    stopped = _ranks(RankState.FAILED, RankState.FAILED)
    assert c.after_snapshot(_snap(5.5, Phase.TRAINING, ranks=stopped, **world)) == []
    # restarted, not formed until its ranks run
    assert c.after_snapshot(_snap(6.0, Phase.FORMING, restart_count=1, **world)) == [
        PhaseChanged(phase=Phase.FORMING),
        Restarted(restart=1),
    ]
    running = _ranks(RankState.RUNNING, RankState.RUNNING)
    reformed = _snap(8.0, Phase.TRAINING, restart_count=1, ranks=running, **world)
    assert c.after_snapshot(reformed) == [
        PhaseChanged(phase=Phase.TRAINING),
        WorldFormed(world_size=2, hosts=1, restart=1),
        RankRecovered(rank=1, host="node-a", by="restart", seconds=3.0),
    ]
    # the same rank dying in the new world is a new death
    again = dataclasses.replace(reformed, updated_at=9.0, ranks=failed)
    assert c.after_snapshot(again) == [RankDied(rank=1, host="node-a", reason="exit code 1")]


def test_every_event_kind_has_a_name_and_its_fields_do_not_shadow_the_envelope() -> None:
    assert set(EVENT_KINDS) == set(RunEvent.__args__)  # type: ignore[attr-defined]
    for kind in EVENT_KINDS:
        assert not {"id", "at", "kind"} & {f.name for f in dataclasses.fields(kind)}, kind
    stamped = Stamped(
        id=3, at=5.0, event=RankRecovered(rank=1, host="h", by="regroup", seconds=2.0)
    )
    assert json.loads(stamped.to_json()) == {
        "id": 3, "at": 5.0, "kind": "rank_recovered", "rank": 1, "host": "h", "by": "regroup", "seconds": 2.0,
    }  # fmt: skip


def _epoch(n: int, loss: float) -> EpochDone:
    share = RankShare(
        rank=0, batches=8, batch_share=1.0, throughput=10.0, avg_loss=loss, alive=True
    )
    return EpochDone(
        epoch=n, epochs=3, avg_loss=loss, epoch_s=1.0, batches=8, reduces=2, avg_reduce_s=0.01, anchor=4,
        per_rank=(share,), scalars={"acc": 0.5},
    )  # fmt: skip


def test_the_board_records_stamps_and_keeps_a_bounded_history() -> None:
    board = StatusBoard(history=3)
    board.publish(_snap(1.0))
    board.emit(_epoch(1, 2.0), at=2.0)
    board.emit(_epoch(2, 1.0), at=3.0)
    board.emit(_epoch(3, 0.5), at=4.0)
    assert board.last_event_id == 4  # the phase, then three epochs
    assert [s.id for s in board.events_after(0)] == [2, 3, 4]  # the oldest left the history
    assert [s.id for s in board.events_after(3)] == [4]
    assert board.events_after(4) == ()
    assert board.statistics().events == 4


def test_a_slow_event_subscriber_is_dropped_and_the_others_go_on() -> None:
    board = StatusBoard()
    slow = board.subscribe_events(maxsize=2)
    keen = board.subscribe_events(maxsize=100)
    for i in range(5):
        board.emit(_epoch(i + 1, 1.0))
        assert keen.get_nowait() is not None  # the keen one keeps up
    stats = slow.statistics()
    assert stats.closed
    assert stats.overflowed
    assert board.statistics().event_subscribers == 1
    assert not keen.statistics().closed


def test_a_snapshot_subscription_still_drops_its_oldest() -> None:
    board = StatusBoard()
    with board.subscribe(maxsize=1) as sub:
        board.publish(_snap(1.0))
        board.publish(_snap(2.0))
        got = sub.get_nowait()
        assert got is not None
        assert got.updated_at == 2.0
        assert not sub.statistics().overflowed


def _families(text: bytes) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_metrics_expose_the_fixed_set_fed_by_events_and_the_snapshot() -> None:
    board = StatusBoard()
    snapshot = _snap(
        1.0,
        Phase.TRAINING,
        members=(MEMBER,),
        world_size=2,
        restart_count=1,
        ranks=_ranks(RankState.CONNECTED, RankState.FAILED),
        connections={"dropped": {"auth_failed": 3}},
        training={
            "epoch": 1,
            "ranks": [{"rank": 0, "host": "node-a", "heartbeat_age": 0.25}],
            "uplinks": [{"payload_bytes": 1000}, {"payload_bytes": 24}],
        },
    )
    board.publish(snapshot)
    board.emit(
        RoundDone(round=1, round_kind="average", reduce_s=0.02, batches=6, loss=0.75, step_s=0.004)
    )
    board.emit(
        RoundDone(round=2, round_kind="average", reduce_s=0.2, batches=4, loss=0.5, step_s=0.006)
    )
    # rank 1's failure above was recovered by the first round after it (derived, not emitted)
    board.emit(ScalarsReported(rank=0, scalars={"lr": 0.01}))
    board.emit(CheckpointSaved(epoch=1, path="/ck", seconds=1.5))
    text = board.metrics.exposition(board.snapshot)
    got = _families(text)
    for name, (kind, _) in METRICS.items():
        sample = name + ("_count" if kind == "histogram" else "")
        assert sample in got, name
    assert got["flodl_ranks"] == {
        (("state", "running"),): 0.0, (("state", "connected"),): 1.0,
        (("state", "exited"),): 0.0, (("state", "failed"),): 1.0,
    }  # fmt: skip
    assert got["flodl_rank_up"] == {
        (("host", "node-a"), ("rank", "0")): 1.0,
        (("host", "node-a"), ("rank", "1")): 0.0,
    }
    assert got["flodl_heartbeat_age_seconds"] == {(("host", "node-a"), ("rank", "0")): 0.25}
    assert got["flodl_steps_total"] == {(): 10.0}
    assert got["flodl_rounds_total"] == {(): 2.0}
    assert got["flodl_loss"] == {(): 0.5}  # the last round's
    assert got["flodl_epoch"] == {(): 1.0}
    assert got["flodl_wire_bytes_total"] == {(("channel", "data"), ("direction", "in")): 1024.0}
    assert got["flodl_connections_refused_total"] == {(("reason", "auth_failed"),): 3.0}
    assert got["flodl_restarts_total"] == {(): 1.0}
    assert got["flodl_recoveries_total"][(("kind", "regroup"),)] == 1.0
    assert got["flodl_reduce_seconds_count"] == {(): 2.0}
    assert math.isclose(got["flodl_reduce_seconds_sum"][()], 0.22)
    assert got["flodl_reduce_seconds_bucket"][(("le", "0.025"),)] == 1.0
    assert got["flodl_reduce_seconds_bucket"][(("le", "+Inf"),)] == 2.0
    assert got["flodl_step_seconds_count"] == {(): 2.0}
    assert got["flodl_recovery_seconds_count"] == {(): 1.0}
    assert got["flodl_checkpoint_seconds_count"] == {(): 1.0}
    assert got["flodl_scalar"] == {(("name", "lr"), ("rank", "0")): 0.01}
    # an epoch moves the epoch and the loss
    board.emit(_epoch(2, 0.25))
    again = _families(board.metrics.exposition(board.snapshot))
    assert again["flodl_epoch"] == {(): 2.0}
    assert again["flodl_loss"] == {(): 0.25}
    assert again["flodl_scalar"][(("name", "acc"), ("rank", "all"))] == 0.5  # the epoch's scalars
    assert set(NOT_FED) <= set(METRICS)


def test_metrics_before_anything_happened_are_still_the_whole_set() -> None:
    board = StatusBoard()
    got = _families(board.metrics.exposition(None))
    assert got["flodl_steps_total"] == {(): 0.0}
    assert "flodl_loss" not in got  # no loss is not a loss of 0


def test_flodl_status_says_n_a_for_the_store_of_a_cpu_trainers_ranks() -> None:
    from flodl_async.cli.statusclient import format_status

    snapshot = _snap(1.0, Phase.TRAINING, ranks=_ranks(RankState.CONNECTED))
    rank = dataclasses.replace(snapshot.ranks[0], store_connected=False)
    plain = json.loads(dataclasses.replace(snapshot, ranks=(rank,)).to_json())
    assert (
        " no " in format_status(plain).splitlines()[-1]
    )  # a plain script's rank: really not there
    trainer = {
        **plain,
        "training": {"epoch": 0, "epochs": 2, "policy": "cadence", "backend": "cpu"},
    }
    assert " n/a " in format_status(trainer).splitlines()[-1]


def test_reported_scalars_are_bounded_in_series_and_checked_at_the_controller() -> None:
    from flodl_async.controller.report import MAX_NAME_LENGTH, scalars_event
    from flodl_async.wire.scalars import Report

    board = StatusBoard()
    for i in range(MAX_SCALAR_SERIES + 5):
        board.emit(ScalarsReported(rank=0, scalars={f"s{i}": 1.0}))
    board.emit(ScalarsReported(rank=0, scalars={"s0": 2.0}))  # a kept series still moves
    assert len(board.metrics.scalars) == MAX_SCALAR_SERIES
    assert board.metrics.scalars_dropped == 5
    assert board.metrics.scalars[("s0", "0")] == 2.0
    event = scalars_event(
        Report(rank=3, scalars={"ok": 1.0, "": 2.0, "x" * (MAX_NAME_LENGTH + 1): 3.0, "bad\n": 4.0,
                                "nan": float("nan")})
    )  # fmt: skip
    assert event == ScalarsReported(rank=3, scalars={"ok": 1.0})
    assert scalars_event(Report(rank=3, scalars={"inf": float("inf")})) is None
