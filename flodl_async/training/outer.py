"""Outer optimizers: what the reducer does to the averaged parameters of a round.

The specs are a closed set of frozen values (a spec crosses process boundaries, in
``TrainerHello``; a closure cannot) and import no torch; :class:`OuterStepper` does the
math, importing torch when it first steps. Notation per parameter tensor: ``c`` is
this round's consensus, ``p`` the global adopted after the previous round
(``prev_global``; on the first round ``p = c``, so the step is a no-op) and ``v``
the momentum (zero until the first real step):

======================  ==============================================================
``OuterAvg()``          ``new = c``
``SlowMo(lr, mu)``      ``g = p - c; v = mu*v + g; new = p - lr*v``
``DiLoCo(lr, mu)``      ``g = p - c; v = mu*v + g; new = p - lr*(mu*v + g)`` (Nesterov)
======================  ==============================================================

Only a ``model`` round with ``mass > 0`` steps (the caller decides); buffers never
reach the stepper. The math runs in float32 (float64 for float64 parameters) and
the results are cast to the parameters' own dtypes; ``prev_global`` is what ranks
adopt, so it is taken after that cast.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..wire.messages import OuterSpecWire

if TYPE_CHECKING:
    import torch


def _check(owner: str, lr: float, momentum: float) -> None:
    if not (isinstance(lr, int | float) and math.isfinite(lr) and lr > 0):
        raise ConfigError(f"{owner}.lr must be a finite number > 0, got {lr!r}")
    if not (isinstance(momentum, int | float) and 0 <= momentum < 1):
        raise ConfigError(f"{owner}.momentum must be in [0, 1), got {momentum!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class OuterAvg:
    """The plain weighted average: the consensus is adopted as it is (the default)."""

    @property
    def resets_inner(self) -> bool:
        return False

    def to_wire(self) -> OuterSpecWire:
        return OuterSpecWire(kind="avg")


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowMo:
    """SlowMo: heavy-ball momentum on the round's pseudo-gradient ``prev_global - consensus``."""

    lr: float = 1.0
    momentum: float = 0.9

    def __post_init__(self) -> None:
        _check("SlowMo", self.lr, self.momentum)

    @property
    def resets_inner(self) -> bool:
        return False

    def to_wire(self) -> OuterSpecWire:
        return OuterSpecWire(kind="slowmo", lr=float(self.lr), momentum=float(self.momentum))


@dataclass(frozen=True, slots=True, kw_only=True)
class DiLoCo:
    """DiLoCo: Nesterov momentum on the pseudo-gradient; ranks reset their inner optimizer every
    round."""

    lr: float = 0.7
    momentum: float = 0.9

    def __post_init__(self) -> None:
        _check("DiLoCo", self.lr, self.momentum)

    @property
    def resets_inner(self) -> bool:
        return True

    def to_wire(self) -> OuterSpecWire:
        return OuterSpecWire(kind="diloco", lr=float(self.lr), momentum=float(self.momentum))


OuterSpec = OuterAvg | SlowMo | DiLoCo


def from_wire(wire: OuterSpecWire) -> OuterSpec:
    """The spec a peer sent; an unknown kind is a :class:`ConfigError`."""
    if wire.kind == "avg":
        return OuterAvg()
    if wire.kind == "slowmo":
        return SlowMo(lr=wire.lr, momentum=wire.momentum)
    if wire.kind == "diloco":
        return DiLoCo(lr=wire.lr, momentum=wire.momentum)
    raise ConfigError(
        f"unknown outer optimizer {wire.kind!r} (known: avg, slowmo, diloco); are all processes "
        "running the same flodl_async?"
    )


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32


class OuterStepper:
    """The outer optimizer's state and step; not thread-safe (the reducer steps one round at a
    time)."""

    def __init__(self, spec: OuterSpec) -> None:
        self.spec = spec
        self._prev: dict[str, torch.Tensor] | None = None
        self._velocity: dict[str, torch.Tensor] | None = None

    def set_prev_global(self, params: Mapping[str, torch.Tensor]) -> None:
        """Adopt ``params`` as the previous global (resume from a checkpointed consensus; the
        init round)."""
        if isinstance(self.spec, OuterAvg):
            return
        self._prev = {
            name: t.detach().to(_work_dtype(t.dtype), copy=True) for name, t in params.items()
        }

    def load_velocity(self, velocity: Mapping[str, torch.Tensor]) -> None:
        """Restore the momentum of a checkpoint (``checkpoint_state()["velocity"]``)."""
        self._velocity = {
            name: t.detach().to(_work_dtype(t.dtype), copy=True) for name, t in velocity.items()
        }

    def checkpoint_state(self) -> dict[str, object] | None:
        """``{"kind", "lr", "momentum", "velocity"}``; None for OuterAvg and before the first real
        step."""
        if isinstance(self.spec, OuterAvg) or self._velocity is None:
            return None
        wire = self.spec.to_wire()
        return {
            "kind": wire.kind,
            "lr": wire.lr,
            "momentum": wire.momentum,
            "velocity": dict(self._velocity),
        }

    def step(
        self,
        consensus_params: dict[str, torch.Tensor],
        dtypes: Mapping[str, torch.dtype] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The parameters to adopt after this round, in ``dtypes`` (default: each input's own
        dtype).

        OuterAvg returns its input unchanged (the same tensors, cast only where ``dtypes`` asks).
        """
        spec = self.spec
        out_dtype = {
            name: (dtypes[name] if dtypes is not None else c.dtype)
            for name, c in consensus_params.items()
        }
        if isinstance(spec, OuterAvg):
            return {
                name: c if c.dtype == out_dtype[name] else c.to(out_dtype[name])
                for name, c in consensus_params.items()
            }
        prev = self._prev
        if prev is None or set(prev) != set(consensus_params):
            # First round (or a new parameter set): p = c, so g = 0 and nothing moves.
            new = {
                name: c if c.dtype == out_dtype[name] else c.to(out_dtype[name])
                for name, c in consensus_params.items()
            }
            self.set_prev_global(new)
            return new
        velocity = self._velocity if self._velocity is not None else {}
        lr, mu = spec.lr, spec.momentum
        new = {}
        for name, c in consensus_params.items():
            p = prev[name]
            g = p - c.to(p.dtype)
            v = velocity.get(name)
            v = g.clone() if v is None else v.mul_(mu).add_(g)
            velocity[name] = v
            # Nesterov look-ahead, as written: mu*v + g (no fused add)
            step = v if isinstance(spec, SlowMo) else v * mu + g
            new[name] = (p - lr * step).to(out_dtype[name])
        self._velocity = velocity
        self.set_prev_global(new)
        return new
