"""Outer optimizers: the spec's golden vectors (flodl's unit tests), params-only, no torch for the specs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from flodl_async.errors import ConfigError
from flodl_async.training.outer import DiLoCo, OuterAvg, OuterStepper, SlowMo, from_wire
from flodl_async.wire import messages as m
from flodl_async.wire.schema import pack_message, unpack_message


def _run(spec: SlowMo | DiLoCo | OuterAvg, windows: list[list[float]]) -> list[torch.Tensor]:
    stepper = OuterStepper(spec)
    return [stepper.step({"w": torch.tensor(c, dtype=torch.float32)})["w"] for c in windows]


def test_slowmo_golden_vectors() -> None:
    out = _run(SlowMo(lr=0.5, momentum=0.9), [[1, 2], [0.5, 1], [0.7, 1.4]])
    torch.testing.assert_close(out[0], torch.tensor([1.0, 2.0]), rtol=0, atol=1e-6)
    torch.testing.assert_close(out[1], torch.tensor([0.75, 1.5]), rtol=0, atol=1e-6)
    torch.testing.assert_close(out[2], torch.tensor([0.5, 1.0]), rtol=0, atol=1e-6)


def test_diloco_golden_vectors() -> None:
    out = _run(DiLoCo(lr=0.5, momentum=0.9), [[1, 2], [0.5, 1], [0.5, 1]])
    torch.testing.assert_close(out[0], torch.tensor([1.0, 2.0]), rtol=0, atol=1e-5)
    torch.testing.assert_close(out[1], torch.tensor([0.525, 1.05]), rtol=0, atol=1e-5)
    torch.testing.assert_close(out[2], torch.tensor([0.29875, 0.5975]), rtol=0, atol=1e-5)


def test_outer_avg_is_the_identity_and_keeps_no_state() -> None:
    stepper = OuterStepper(OuterAvg())
    c = {"w": torch.randn(5, dtype=torch.float64)}
    out = stepper.step(c)
    assert out["w"] is c["w"]
    assert stepper.checkpoint_state() is None


def test_checkpoint_state_only_after_a_real_step_and_velocity_round_trips() -> None:
    a = OuterStepper(SlowMo(lr=0.5, momentum=0.9))
    a.step({"w": torch.tensor([1.0, 2.0])})
    assert a.checkpoint_state() is None  # the first window is a no-op
    a.step({"w": torch.tensor([0.5, 1.0])})
    state = a.checkpoint_state()
    assert state is not None
    assert state["kind"] == "slowmo"
    velocity = state["velocity"]
    assert isinstance(velocity, dict)
    # resume: prev_global from the checkpointed consensus + the velocity gives the same next step
    b = OuterStepper(SlowMo(lr=0.5, momentum=0.9))
    b.set_prev_global({"w": torch.tensor([0.75, 1.5])})
    b.load_velocity(velocity)
    nxt = {"w": torch.tensor([0.7, 1.4])}
    assert torch.equal(a.step(dict(nxt))["w"], b.step(dict(nxt))["w"])


def test_output_dtypes_and_bf16_prev_global_is_what_ranks_adopt() -> None:
    stepper = OuterStepper(SlowMo(lr=1.0, momentum=0.5))
    stepper.step({"w": torch.ones(3)}, {"w": torch.bfloat16})
    out = stepper.step({"w": torch.full((3,), 0.3)}, {"w": torch.bfloat16})
    assert out["w"].dtype == torch.bfloat16
    # reference: p = 1 (bf16-exact), g = 0.7, v = 0.7, new = 1 - 0.7 = 0.3 in f32, cast to bf16
    assert torch.equal(
        out["w"], (torch.ones(3) - (torch.ones(3) - torch.full((3,), 0.3))).to(torch.bfloat16)
    )


def test_resets_inner_and_defaults() -> None:
    assert DiLoCo().resets_inner
    assert not SlowMo().resets_inner
    assert not OuterAvg().resets_inner
    assert (SlowMo().lr, SlowMo().momentum) == (1.0, 0.9)
    assert (DiLoCo().lr, DiLoCo().momentum) == (0.7, 0.9)


@pytest.mark.parametrize("spec", [OuterAvg(), SlowMo(lr=0.25, momentum=0.5), DiLoCo()])
def test_wire_round_trip(spec: OuterAvg | SlowMo | DiLoCo) -> None:
    decoded = unpack_message(m.OuterSpecWire.KIND, pack_message(spec.to_wire()))
    assert isinstance(decoded, m.OuterSpecWire)
    assert from_wire(decoded) == spec


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: SlowMo(lr=0.0), r"SlowMo\.lr must be a finite number > 0"),
        (lambda: DiLoCo(lr=float("nan")), r"DiLoCo\.lr"),
        (lambda: SlowMo(momentum=1.0), r"SlowMo\.momentum must be in \[0, 1\)"),
        (lambda: from_wire(m.OuterSpecWire(kind="adam")), "unknown outer optimizer 'adam'"),
    ],
)
def test_bad_specs_are_config_errors(make: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make()  # type: ignore[operator]


def test_specs_import_without_torch() -> None:
    code = "import sys, flodl_async.training.outer as o; o.DiLoCo().to_wire(); assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
