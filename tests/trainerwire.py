"""Sample Trainer control messages, shared by the codec tests and the coordinator tests."""

from __future__ import annotations

from flodl_async.wire import messages as m
from flodl_async.wire.restarts import Readmitted


def elche_wire(**overrides: object) -> m.ElCheConfigWire:
    """A resolved ElChe config (CADENCE defaults) with ``overrides``."""
    fields: dict[str, object] = {
        "anchor": 10,
        "min_anchor": 10,
        "max_anchor": 1000,
        "overhead_target": 0.05,
        "max_batch_diff": None,
        "adapt": True,
        "speed_hint_rank": None,
        "speed_hint_ratio": None,
        "partition_ratios": None,
        "max_overshoot": None,
        "easgd_alpha": None,
        "gamma": 1.0,
        "guard": True,
        "guard_threshold": 0.05,
        "guard_nudge": 0.5,
    }
    fields.update(overrides)
    return m.ElCheConfigWire(**fields)  # type: ignore[arg-type]


def spec_wire(**overrides: object) -> m.TrainerSpecWire:
    """A plausible TrainerSpecWire with ``overrides``."""
    fields: dict[str, object] = {
        "policy": "cadence",
        "backend": "cpu",
        "epochs": 2,
        "batch_size": 8,
        "dataset_len": 64,
        "drop_last": True,
        "seed": 0,
        "elche": elche_wire(),
        "outer": m.OuterSpecWire(kind="avg"),
        "save_path": None,
        "resume_from": None,
        "every_epochs": None,
        "on_shutdown": True,
        "rank_state": True,
        "max_failure_absolute": None,
        "max_failure_percent": None,
        "heartbeat_timeout": 30.0,
        "lr_schedule": False,
        "max_grad_norm": None,
        "name": "",
    }
    fields.update(overrides)
    return m.TrainerSpecWire(**fields)  # type: ignore[arg-type]


def schema_wire() -> m.ModelSchemaWire:
    """A two-layer model's schema with a tied key and an integer buffer."""
    return m.ModelSchemaWire(
        param_names=("0.weight", "0.bias"),
        buffer_names=("bn.num_batches_tracked",),
        dtypes=("float32", "float32", "int64"),
        shapes=((4, 2), (4,), ()),
        aliases={"head.weight": "0.weight"},
    )


def epoch_metrics() -> m.EpochMetrics:
    """One aggregated epoch of two ranks."""
    per_rank = tuple(
        m.RankEpochStats(
            rank=r,
            batches=4,
            samples=32,
            avg_loss=0.5,
            throughput=100.0,
            batch_share=0.5,
            compute_ms=30.0,
            data_ms=10.0,
            alive=True,
        )
        for r in (0, 1)
    )
    return m.EpochMetrics(
        epoch=0,
        avg_loss=0.5,
        epoch_ms=120.0,
        batches=8,
        samples=64,
        reduces=2,
        avg_reduce_ms=3.5,
        anchor=10,
        counts=(4, 4),
        per_rank=per_rank,
        scalars={"acc": 0.9},
    )


CONTROL_UP: list[m.Message] = [
    m.TrainerHello(
        rank=1,
        spec=spec_wire(),
        digest="ab" * 32,
        model=schema_wire(),
        model_bytes=36,
        device="cpu",
    ),
    m.WindowDone(
        rank=1,
        round=3,
        epoch=0,
        batches=4,
        samples=32,
        compute_ms=12.5,
        data_ms=1.5,
        loss_sum=2.0,
        divergence=0.01,
        scalar_sums={"acc": 3.5},
        scalar_counts={"acc": 4},
    ),
    m.ReduceDone(rank=1, round=3, mass=8.0, ms=4.5),
    m.RankGone(rank=1, reason="link closed"),
    m.Exiting(rank=1, reason="error", error="Traceback ...\nValueError: boom"),
    m.Intent(rank=1, kind="checkpoint"),
    m.RankStateSaved(rank=1, version=2, path="runs/x.ranks/rank1.pt", sha256="cd" * 32),
]

CONTROL_DOWN: list[m.Message] = [
    m.TrainerWelcome(rank=1, world_size=2, run_id="r", primary_rank=0),
    m.TrainerReject(rank=1, reason="different Trainer"),
    m.Plan(rank=1, round=3, epoch=0, ranges=((0, 4), (8, 2)), quota=6, hold_after=6, progress=0.25),
    m.Reduce(round=3, kind="model", checkpoint=1, reset_inner=True),
    m.EpochAggregated(metrics=epoch_metrics()),
    m.DeclareDead(dead_rank=1, reason="heartbeat timeout"),
    Readmitted(readmitted=1, incarnation=1, round=7),
    m.Shutdown(reason="training complete", save_reason="completed"),
]
