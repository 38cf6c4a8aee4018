"""Pure tests of the Trainer's spec: validation messages, the wire round trip, the digest, spec_diff."""

from __future__ import annotations

import dataclasses

import pytest

from flodl_async.errors import ConfigError
from flodl_async.training.modelschema import ModelSchema
from flodl_async.training.outer import DiLoCo, SlowMo
from flodl_async.training.policy import (
    Backend,
    Policy,
    failure_limit,
    hold_after,
    unrecoverable_reason,
)
from flodl_async.training.spec import (
    Checkpointing,
    ElCheConfig,
    MaxFailure,
    TrainerSpec,
    TrendGuard,
    digest,
    digest_of,
    resolve_elche,
    spec_diff,
)

from .trainerwire import schema_wire


def spec(**overrides: object) -> TrainerSpec:
    fields: dict[str, object] = {"epochs": 2, "batch_size": 8, "dataset_len": 64}
    fields.update(overrides)
    return TrainerSpec(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"epochs": 0}, "epochs must be an integer >= 1"),
        ({"batch_size": 0}, "batch_size must be an integer >= 1"),
        ({"dataset_len": 4}, "must fill at least one batch of 8"),
        (
            {"policy": Policy.ASYNC, "backend": Backend.COLLECTIVE},
            r"\(ASYNC, COLLECTIVE\) is not a supported combination .*use CADENCE with COLLECTIVE",
        ),
        (
            {"elche": ElCheConfig(partition_ratios=(0.5, 0.5))},
            "partition_ratios is honored on SYNC only",
        ),
        (
            {"policy": Policy.CADENCE, "elche": ElCheConfig(easgd_alpha=0.3)},
            "easgd_alpha applies to ASYNC only",
        ),
        (
            {"policy": Policy.SYNC, "elche": ElCheConfig(max_overshoot=2)},
            "max_overshoot applies to ASYNC only",
        ),
        ({"heartbeat_timeout": 0.0}, "heartbeat_timeout must be > 0"),
    ],
)
def test_bad_specs_name_the_field(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        spec(**overrides)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ElCheConfig(anchor=0), "ElCheConfig.anchor must be an integer >= 1, got 0"),
        (
            lambda: ElCheConfig(partition_ratios=(0.5, 0.2)),
            "partition_ratios must be positive and sum to 1",
        ),
        (lambda: ElCheConfig(easgd_alpha=1.5), r"easgd_alpha must be in \(0, 1\]"),
        (lambda: ElCheConfig(speed_hint=(1, 0.5)), "speed_hint must be"),
        (lambda: ElCheConfig(gamma=-1.0), "gamma must be >= 0"),
        (lambda: TrendGuard(nudge_factor=0.0), "nudge_factor"),
        (MaxFailure, "exactly one of absolute= or percent="),
        (lambda: MaxFailure(absolute=1, percent=0.5), "exactly one"),
        (lambda: Checkpointing(every_epochs=1), "needs a save_path"),
    ],
)
def test_config_objects_validate(build: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build()  # type: ignore[operator]


def test_max_failure_shorthands() -> None:
    assert MaxFailure.coerce(1) == MaxFailure(absolute=1)
    assert MaxFailure.coerce(0.25) == MaxFailure(percent=0.25)
    assert MaxFailure.coerce(None) is None
    with pytest.raises(ConfigError, match="max_failure must be"):
        MaxFailure.coerce("two")  # type: ignore[arg-type]


def test_elche_defaults_resolve_per_policy() -> None:
    sync = resolve_elche(ElCheConfig(), Policy.SYNC)
    assert (sync.anchor, sync.min_anchor, sync.guard) == (1, 1, None)
    cadence = resolve_elche(ElCheConfig(), Policy.CADENCE)
    assert (cadence.anchor, cadence.min_anchor, cadence.max_anchor, cadence.guard) == (
        10,
        10,
        1000,
        (0.05, 0.5),
    )
    asynchronous = resolve_elche(ElCheConfig(), Policy.ASYNC)
    assert (asynchronous.guard, asynchronous.max_overshoot, asynchronous.easgd_alpha) == (
        (0.3, 0.5),
        3,
        0.5,
    )
    assert (
        resolve_elche(ElCheConfig(overhead_target=0.9), Policy.CADENCE).overhead_target == 0.5
    )  # clamped to [0.01, 0.5]
    assert resolve_elche(ElCheConfig(guard=None), Policy.CADENCE).guard is None


def test_the_wire_round_trip_keeps_the_spec() -> None:
    original = spec(
        policy=Policy.ASYNC,
        seed=2**63,
        elche=ElCheConfig(
            anchor=4,
            max_overshoot=2,
            easgd_alpha=0.25,
            speed_hint=(1, 2.0),
            guard=TrendGuard(threshold=0.2),
        ),
        outer=DiLoCo(lr=0.5),
        checkpoint=Checkpointing(save_path="runs/x", every_epochs=2),
        max_failure=MaxFailure(percent=0.5),
        lr_schedule=True,
        max_grad_norm=1.0,
        name="mlp",
    )
    again = TrainerSpec.from_wire(original.to_wire())
    assert again.to_wire() == original.to_wire()
    assert again.outer == DiLoCo(lr=0.5)
    assert again.max_failure == MaxFailure(percent=0.5)


def test_digest_depends_on_spec_and_schema() -> None:
    schema = ModelSchema.from_wire(schema_wire())
    base = digest(spec(), schema)
    assert base == digest(spec(), schema)  # canonical: the same inputs, the same digest
    assert len(base) == 64
    assert digest(spec(epochs=3), schema) != base
    assert digest(spec(outer=SlowMo()), schema) != base
    other = dataclasses.replace(schema_wire(), shapes=((4, 3), (4,), ()))
    assert digest_of(spec().to_wire(), other) != base


def test_spec_diff_names_the_first_differing_field() -> None:
    ref = spec(epochs=5).to_wire()
    assert spec_diff(ref, ref) is None
    assert spec_diff(ref, spec(epochs=10).to_wire()) == "epochs 10 != 5"
    assert (
        spec_diff(ref, spec(epochs=5, elche=ElCheConfig(anchor=3)).to_wire())
        == "elche.anchor 3 != 10"
    )
    assert (
        spec_diff(ref, spec(epochs=5, outer=SlowMo()).to_wire()) == "outer.kind 'slowmo' != 'avg'"
    )


def test_hold_after_per_policy() -> None:
    assert hold_after(Policy.SYNC, quota=1, max_batch_diff=None, max_overshoot=3) == -1
    assert (
        hold_after(Policy.SYNC, quota=1, max_batch_diff=0, max_overshoot=3) == 1
    )  # strict lockstep
    assert hold_after(Policy.CADENCE, quota=7, max_batch_diff=None, max_overshoot=3) == 7
    assert hold_after(Policy.ASYNC, quota=7, max_batch_diff=None, max_overshoot=3) == 10


def test_failure_limits_and_unrecoverable_reasons() -> None:
    assert failure_limit(world_size=4, absolute=1, percent=None) == 1
    assert failure_limit(world_size=4, absolute=None, percent=0.3) == 2  # ceil(1.2)
    assert failure_limit(world_size=4, absolute=None, percent=None) is None

    def cpu(dead: int, limit: int | None = None) -> str | None:
        return unrecoverable_reason(world_size=3, limit=limit, dead=dead)

    assert cpu(0) is None
    assert cpu(1) is None  # the survivors train on
    assert cpu(2) is None
    assert cpu(3) == "all_ranks_lost"
    assert cpu(1, limit=2) is None  # reaching the limit breaches it, not passing it
    assert cpu(2, limit=2) == "max_failure_exceeded"
