"""The Trainer's serializable configuration, its canonical digest, and what differs between two.

Theory of operation. Every rank's ``TrainerHello`` carries a :class:`TrainerSpec` (as
:class:`~flodl_async.wire.messages.TrainerSpecWire`, whose docstring says why it is a separate
type) and its model's schema, with ``digest = sha256(canonical msgpack of (spec, schema))``.
The controller configures the coordinator and reducer from the first hello and holds every
other rank to the same digest: ``flodl-launch cluster.yml -- python train.py`` runs the
controller in a process that never sees the user's Trainer, so the spec is all it knows.
Callables (model, optimizer, train_step, collate, lr_schedule) cannot be compared; only whether
an LR schedule is present is. Pure: no torch, no I/O.

The config dataclasses validate in ``__post_init__`` with a :class:`ConfigError` that
names the field and the accepted range; cross-field rules (which policy honours which
knob) are checked by :meth:`TrainerSpec.__post_init__`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import Literal

import msgpack

from ..errors import ConfigError
from ..wire import messages as m
from ..wire.schema import Message, to_body
from .modelschema import ModelSchema
from .outer import OuterAvg, OuterSpec
from .outer import from_wire as outer_from_wire
from .policy import UNSUPPORTED, Backend, Policy

#: ElChe's default anchor (slow-rank batches per window) by policy.
DEFAULT_ANCHOR = {Policy.SYNC: 1, Policy.CADENCE: 10, Policy.ASYNC: 10}
DEFAULT_MAX_OVERSHOOT = 3
DEFAULT_EASGD_ALPHA = 0.5
#: TrendGuard thresholds: plain, and with EASGD blending (ASYNC), whose replicas drift more by
#: design.
GUARD_THRESHOLD = 0.05
GUARD_THRESHOLD_EASGD = 0.3
OVERHEAD_TARGET_RANGE = (0.01, 0.50)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrendGuard:
    """The divergence guard: replicas drifting apart nudge the anchor down."""

    threshold: float | None = None  # None -> 0.05, or 0.3 when EASGD blending is active
    nudge_factor: float = 0.5

    def __post_init__(self) -> None:
        _require(
            self.threshold is None or (_finite(self.threshold) and self.threshold > 0),
            f"TrendGuard.threshold must be > 0, got {self.threshold!r}",
        )
        _require(
            _finite(self.nudge_factor) and 0 < self.nudge_factor <= 1,
            f"TrendGuard.nudge_factor must be in (0, 1], got {self.nudge_factor!r}",
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ElCheConfig:
    """ElChe, flodl's heterogeneous cadence: how many batches each rank runs per window;
    ``None`` fields resolve per policy (:func:`resolve_elche`)."""

    anchor: int | None = None
    min_anchor: int | None = None
    max_anchor: int = 1000
    overhead_target: float = 0.05
    max_batch_diff: int | None = None
    adapt: bool = True
    speed_hint: tuple[int, float] | None = None
    partition_ratios: tuple[float, ...] | None = None
    max_overshoot: int | None = None
    easgd_alpha: float | None = None
    gamma: float = 1.0
    guard: TrendGuard | Literal["default"] | None = "default"

    def __post_init__(self) -> None:
        _require(
            self.anchor is None or (_int(self.anchor) and self.anchor >= 1),
            f"ElCheConfig.anchor must be an integer >= 1, got {self.anchor!r}",
        )
        _require(
            self.min_anchor is None or (_int(self.min_anchor) and self.min_anchor >= 1),
            f"ElCheConfig.min_anchor must be an integer >= 1, got {self.min_anchor!r}",
        )
        _require(
            _int(self.max_anchor) and self.max_anchor >= 1,
            f"ElCheConfig.max_anchor must be an integer >= 1, got {self.max_anchor!r}",
        )
        _require(
            _finite(self.overhead_target) and self.overhead_target > 0,
            f"ElCheConfig.overhead_target must be > 0, got {self.overhead_target!r}",
        )
        _require(
            self.max_batch_diff is None or (_int(self.max_batch_diff) and self.max_batch_diff >= 0),
            "ElCheConfig.max_batch_diff must be an integer >= 0 (0 = lockstep), got "
            f"{self.max_batch_diff!r}",
        )
        if self.speed_hint is not None:
            slow, ratio = self.speed_hint
            _require(
                _int(slow) and slow >= 0 and _finite(ratio) and ratio >= 1,
                "ElCheConfig.speed_hint must be (slow_rank >= 0, ratio >= 1), got "
                f"{self.speed_hint!r}",
            )
        if self.partition_ratios is not None:
            ratios = self.partition_ratios
            _require(
                len(ratios) > 0
                and all(_finite(r) and r > 0 for r in ratios)
                and abs(sum(ratios) - 1.0) <= 0.05,
                "ElCheConfig.partition_ratios must be positive and sum to 1 (± 0.05), got "
                f"{ratios!r}",
            )
        _require(
            self.max_overshoot is None or (_int(self.max_overshoot) and self.max_overshoot >= 0),
            f"ElCheConfig.max_overshoot must be an integer >= 0, got {self.max_overshoot!r}",
        )
        _require(
            self.easgd_alpha is None or (_finite(self.easgd_alpha) and 0 < self.easgd_alpha <= 1),
            f"ElCheConfig.easgd_alpha must be in (0, 1], got {self.easgd_alpha!r}",
        )
        _require(
            _finite(self.gamma) and self.gamma >= 0,
            f"ElCheConfig.gamma must be >= 0 (0 = unweighted mean), got {self.gamma!r}",
        )
        _require(
            self.guard == "default" or self.guard is None or isinstance(self.guard, TrendGuard),
            f"ElCheConfig.guard must be a TrendGuard, None or 'default', got {self.guard!r}",
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ElCheSettings:
    """An :class:`ElCheConfig` with every default resolved for its policy (what ElChe and the wire
    use)."""

    anchor: int
    min_anchor: int
    max_anchor: int
    overhead_target: float
    max_batch_diff: int | None
    adapt: bool
    speed_hint: tuple[int, float] | None
    partition_ratios: tuple[float, ...] | None
    max_overshoot: int
    easgd_alpha: float
    gamma: float
    #: The guard's threshold and nudge; None: no guard.
    guard: tuple[float, float] | None


def resolve_elche(config: ElCheConfig, policy: Policy) -> ElCheSettings:
    """Fill ``config``'s policy-dependent defaults (:data:`DEFAULT_ANCHOR` and the constants
    above)."""
    anchor = config.anchor if config.anchor is not None else DEFAULT_ANCHOR[policy]
    min_anchor = config.min_anchor if config.min_anchor is not None else anchor
    max_anchor = max(config.max_anchor, anchor)
    lo, hi = OVERHEAD_TARGET_RANGE
    easgd = policy is Policy.ASYNC
    guard: tuple[float, float] | None
    if config.guard == "default":
        guard = (
            None
            if policy is Policy.SYNC
            else (GUARD_THRESHOLD_EASGD if easgd else GUARD_THRESHOLD, 0.5)
        )
    elif config.guard is None:
        guard = None
    else:
        threshold = (
            config.guard.threshold
            if config.guard.threshold is not None
            else (GUARD_THRESHOLD_EASGD if easgd else GUARD_THRESHOLD)
        )
        guard = (threshold, config.guard.nudge_factor)
    return ElCheSettings(
        anchor=anchor,
        min_anchor=min(min_anchor, max_anchor),
        max_anchor=max_anchor,
        overhead_target=min(max(config.overhead_target, lo), hi),
        max_batch_diff=config.max_batch_diff,
        adapt=config.adapt,
        speed_hint=config.speed_hint,
        partition_ratios=config.partition_ratios,
        max_overshoot=config.max_overshoot
        if config.max_overshoot is not None
        else DEFAULT_MAX_OVERSHOOT,
        easgd_alpha=config.easgd_alpha if config.easgd_alpha is not None else DEFAULT_EASGD_ALPHA,
        gamma=float(config.gamma),
        guard=guard,
    )


#: ``Checkpointing(resume_from=LATEST)``: the newest valid bundle under ``save_path`` (the requeue
#: case: the same command run again), or a fresh start when there is none yet.
LATEST = "latest"


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpointing:
    """Where consensus checkpoints go, when they are written, and which one a run resumes from.

    ``save_path`` is a directory holding one subdirectory per bundle. A bundle is written at a
    reduce boundary every ``every_epochs`` closed epochs, every ``every_rounds`` model rounds or
    once ``every_seconds`` passed since the last one (whichever comes first), at the natural end,
    on an orderly stop (``on_shutdown``), on request, and from the last consensus when the run ends
    on a failure it cannot survive. ``keep_last`` keeps that many bundles (None: all).
    ``rank_state``: each rank saves its optimizer and RNG state beside the consensus.
    ``resume_from``: a bundle directory, or :data:`LATEST` (the newest valid one under
    ``save_path``).
    """

    save_path: str | None = None
    resume_from: str | None = None
    every_epochs: int | None = None
    on_shutdown: bool = True
    rank_state: bool = True
    every_rounds: int | None = None
    every_seconds: float | None = None
    keep_last: int | None = None

    def __post_init__(self) -> None:
        _require(
            self.save_path is None or (isinstance(self.save_path, str) and self.save_path != ""),
            f"Checkpointing.save_path must be a directory path (a string), got {self.save_path!r}",
        )
        _require(
            self.resume_from is None
            or (isinstance(self.resume_from, str) and self.resume_from != ""),
            "Checkpointing.resume_from must be a bundle directory or 'latest', got "
            f"{self.resume_from!r}",
        )
        for knob in ("every_epochs", "every_rounds", "keep_last"):
            value = getattr(self, knob)
            _require(
                value is None or (_int(value) and value >= 1),
                f"Checkpointing.{knob} must be an integer >= 1, got {value!r}",
            )
        _require(
            self.every_seconds is None or (_finite(self.every_seconds) and self.every_seconds > 0),
            f"Checkpointing.every_seconds must be a number of seconds > 0, got "
            f"{self.every_seconds!r}",
        )
        for knob in ("on_shutdown", "rank_state"):
            _require(
                isinstance(getattr(self, knob), bool),
                f"Checkpointing.{knob} must be True or False, got {getattr(self, knob)!r}",
            )
        for knob in ("every_epochs", "every_rounds", "every_seconds", "keep_last"):
            _require(
                getattr(self, knob) is None or self.save_path is not None,
                f"Checkpointing.{knob} needs a save_path (where would the checkpoints go?)",
            )
        _require(
            self.resume_from != LATEST or self.save_path is not None,
            "Checkpointing(resume_from='latest') needs a save_path (the directory to look in)",
        )

    @property
    def enabled(self) -> bool:
        """Bundles are written (a ``save_path`` is set)."""
        return self.save_path is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class MaxFailure:
    """How many dead ranks end an elastic run: ``absolute`` count or ``percent`` of the world
    (exactly one).

    The run ends when the number of dead ranks *reaches* the limit (exit 5), as flodl counts it:
    ``MaxFailure(absolute=1)`` ends the run at the first death, ``absolute=2`` tolerates one. This
    is one less than torchft's or Horovod's "N failures tolerated". ``percent=p`` is
    ``ceil(p * world size)`` deaths. Without it a run goes on while one rank lives (CPU backend).
    """

    absolute: int | None = None
    percent: float | None = None

    def __post_init__(self) -> None:
        _require(
            (self.absolute is None) != (self.percent is None),
            "MaxFailure needs exactly one of absolute= or percent=",
        )
        _require(
            self.absolute is None or (_int(self.absolute) and self.absolute >= 1),
            f"MaxFailure.absolute must be an integer >= 1, got {self.absolute!r}",
        )
        _require(
            self.percent is None or (_finite(self.percent) and 0 < self.percent <= 1),
            f"MaxFailure.percent must be in (0, 1], got {self.percent!r}",
        )

    @classmethod
    def coerce(cls, value: MaxFailure | int | float | None) -> MaxFailure | None:
        """``max_failure=1`` and ``max_failure=0.25`` are shorthands."""
        if value is None or isinstance(value, MaxFailure):
            return value
        if _int(value):
            return cls(absolute=int(value))
        if _finite(value):
            return cls(percent=float(value))
        raise ConfigError(
            f"max_failure must be a MaxFailure, an int, a float or None, got {value!r}"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerSpec:
    """Everything the coordinator and reducer need, as plain values; the same on every rank."""

    policy: Policy = Policy.CADENCE
    backend: Backend = Backend.CPU
    epochs: int
    batch_size: int
    dataset_len: int
    drop_last: bool = True
    seed: int = 0
    elche: ElCheConfig = field(default_factory=ElCheConfig)
    outer: OuterSpec = field(default_factory=OuterAvg)
    checkpoint: Checkpointing = field(default_factory=Checkpointing)
    max_failure: MaxFailure | None = None
    heartbeat_timeout: float = 10.0
    lr_schedule: bool = False
    max_grad_norm: float | None = None
    name: str = ""

    def __post_init__(self) -> None:
        # ``max_failure=1`` / ``0.25`` are shorthands; frozen, so the normal form is set through
        # object.
        object.__setattr__(self, "max_failure", MaxFailure.coerce(self.max_failure))
        _require(
            isinstance(self.policy, Policy),
            f"Trainer: policy must be a Policy (SYNC, CADENCE or ASYNC), got {self.policy!r}",
        )
        _require(
            isinstance(self.backend, Backend),
            f"Trainer: backend must be a Backend (CPU or COLLECTIVE), got {self.backend!r}",
        )
        _require(
            _int(self.epochs) and self.epochs >= 1,
            f"Trainer: epochs must be an integer >= 1, got {self.epochs!r}",
        )
        _require(
            _int(self.batch_size) and self.batch_size >= 1,
            f"Trainer: batch_size must be an integer >= 1, got {self.batch_size!r}",
        )
        _require(
            _int(self.dataset_len) and self.dataset_len >= 1,
            f"Trainer: the dataset must hold at least one sample, it has {self.dataset_len!r}",
        )
        _require(
            not self.drop_last or self.dataset_len // self.batch_size >= 1,
            f"Trainer: with drop_last the dataset ({self.dataset_len} samples) must fill at least "
            f"one batch of {self.batch_size}; "
            "lower batch_size or pass drop_last=False",
        )
        _require(
            _int(self.seed) and 0 <= self.seed < 2**64,
            f"Trainer: seed must be an integer in [0, 2**64), got {self.seed!r}",
        )
        _require(
            _finite(self.heartbeat_timeout) and self.heartbeat_timeout > 0,
            f"Trainer: heartbeat_timeout must be > 0 seconds, got {self.heartbeat_timeout!r}",
        )
        _require(
            self.max_grad_norm is None or (_finite(self.max_grad_norm) and self.max_grad_norm > 0),
            f"Trainer: max_grad_norm must be > 0, got {self.max_grad_norm!r}",
        )
        refused = UNSUPPORTED.get((self.policy, self.backend))
        _require(refused is None, f"Trainer: {refused}")
        ckpt = self.checkpoint
        _require(
            self.backend is not Backend.COLLECTIVE
            or (ckpt.save_path is None and ckpt.resume_from is None),
            "Trainer: checkpoint=Checkpointing(save_path/resume_from) is not built for the "
            "COLLECTIVE backend yet (its consensus lives in the ranks); use backend=Backend.CPU to "
            "checkpoint, or drop checkpoint=",
        )
        _require(
            self.elche.partition_ratios is None or self.policy is Policy.SYNC,
            "Trainer: elche.partition_ratios is honored on SYNC only; CADENCE/ASYNC size "
            "partitions from measured throughput (drop partition_ratios)",
        )
        for knob in ("easgd_alpha", "max_overshoot"):
            _require(
                getattr(self.elche, knob) is None or self.policy is Policy.ASYNC,
                f"Trainer: elche.{knob} applies to ASYNC only (this Trainer uses "
                f"{self.policy.name}); drop it or use policy=Policy.ASYNC",
            )

    @property
    def settings(self) -> ElCheSettings:
        """The ElChe config with its defaults resolved for this policy."""
        return resolve_elche(self.elche, self.policy)

    @property
    def n_batches(self) -> int:
        """Batches per epoch: the pool is cut at batch boundaries, the last one partial unless
        ``drop_last``."""
        full, rest = divmod(self.dataset_len, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    # ----- wire ---------------------------------------------------------------------------

    def to_wire(self) -> m.TrainerSpecWire:
        """The spec as it travels in ``TrainerHello`` (ElChe resolved)."""
        s = self.settings
        elche = m.ElCheConfigWire(
            anchor=s.anchor,
            min_anchor=s.min_anchor,
            max_anchor=s.max_anchor,
            overhead_target=float(s.overhead_target),
            max_batch_diff=s.max_batch_diff,
            adapt=s.adapt,
            speed_hint_rank=None if s.speed_hint is None else int(s.speed_hint[0]),
            speed_hint_ratio=None if s.speed_hint is None else float(s.speed_hint[1]),
            partition_ratios=None
            if s.partition_ratios is None
            else tuple(float(r) for r in s.partition_ratios),
            max_overshoot=s.max_overshoot,
            easgd_alpha=float(s.easgd_alpha),
            gamma=s.gamma,
            guard=s.guard is not None,
            guard_threshold=0.0 if s.guard is None else float(s.guard[0]),
            guard_nudge=0.0 if s.guard is None else float(s.guard[1]),
        )
        mf = self.max_failure
        return m.TrainerSpecWire(
            policy=self.policy.value,
            backend=self.backend.value,
            epochs=self.epochs,
            batch_size=self.batch_size,
            dataset_len=self.dataset_len,
            drop_last=self.drop_last,
            seed=self.seed,
            elche=elche,
            outer=self.outer.to_wire(),
            save_path=self.checkpoint.save_path,
            resume_from=self.checkpoint.resume_from,
            every_epochs=self.checkpoint.every_epochs,
            on_shutdown=self.checkpoint.on_shutdown,
            rank_state=self.checkpoint.rank_state,
            max_failure_absolute=None if mf is None else mf.absolute,
            max_failure_percent=None if mf is None or mf.percent is None else float(mf.percent),
            heartbeat_timeout=float(self.heartbeat_timeout),
            lr_schedule=self.lr_schedule,
            max_grad_norm=None if self.max_grad_norm is None else float(self.max_grad_norm),
            name=self.name,
            every_rounds=self.checkpoint.every_rounds,
            every_seconds=None
            if self.checkpoint.every_seconds is None
            else float(self.checkpoint.every_seconds),
            keep_last=self.checkpoint.keep_last,
        )

    @classmethod
    def from_wire(cls, wire: m.TrainerSpecWire) -> TrainerSpec:
        """The spec a rank sent; anything invalid is a :class:`ConfigError` naming the field."""
        try:
            policy, backend = Policy(wire.policy), Backend(wire.backend)
        except ValueError as exc:
            raise ConfigError(
                f"the rank's Trainer spec names an unknown policy or backend ({exc}); are all "
                "processes running the same flodl_async?"
            ) from None
        e = wire.elche
        hint = (
            None
            if e.speed_hint_rank is None or e.speed_hint_ratio is None
            else (e.speed_hint_rank, e.speed_hint_ratio)
        )
        guard: TrendGuard | None = (
            TrendGuard(threshold=e.guard_threshold, nudge_factor=e.guard_nudge) if e.guard else None
        )
        elche = ElCheConfig(
            anchor=e.anchor,
            min_anchor=e.min_anchor,
            max_anchor=e.max_anchor,
            overhead_target=e.overhead_target,
            max_batch_diff=e.max_batch_diff,
            adapt=e.adapt,
            speed_hint=hint,
            partition_ratios=e.partition_ratios,
            max_overshoot=e.max_overshoot if policy is Policy.ASYNC else None,
            easgd_alpha=e.easgd_alpha if policy is Policy.ASYNC else None,
            gamma=e.gamma,
            guard=guard,
        )
        mf = None
        if wire.max_failure_absolute is not None or wire.max_failure_percent is not None:
            mf = MaxFailure(absolute=wire.max_failure_absolute, percent=wire.max_failure_percent)
        return cls(
            policy=policy,
            backend=backend,
            epochs=wire.epochs,
            batch_size=wire.batch_size,
            dataset_len=wire.dataset_len,
            drop_last=wire.drop_last,
            seed=wire.seed,
            elche=elche,
            outer=outer_from_wire(wire.outer),
            checkpoint=Checkpointing(
                save_path=wire.save_path,
                resume_from=wire.resume_from,
                every_epochs=wire.every_epochs,
                on_shutdown=wire.on_shutdown,
                rank_state=wire.rank_state,
                every_rounds=wire.every_rounds,
                every_seconds=wire.every_seconds,
                keep_last=wire.keep_last,
            ),
            max_failure=mf,
            heartbeat_timeout=wire.heartbeat_timeout,
            lr_schedule=wire.lr_schedule,
            max_grad_norm=wire.max_grad_norm,
            name=wire.name,
        )


def digest_of(spec: m.TrainerSpecWire, schema: m.ModelSchemaWire) -> str:
    """``sha256`` (hex) of the canonical msgpack of (spec, schema): what every rank must agree
    on."""
    canonical = [to_body(spec), ModelSchema.from_wire(schema).digest_input()]
    return hashlib.sha256(msgpack.packb(canonical, use_bin_type=True)).hexdigest()


def digest(spec: TrainerSpec, schema: ModelSchema) -> str:
    """The run digest of a Trainer's spec and its model's schema."""
    return digest_of(spec.to_wire(), schema.to_wire())


def spec_diff(reference: m.TrainerSpecWire, other: m.TrainerSpecWire) -> str | None:
    """The first differing field as ``name other != reference`` (nested: ``elche.anchor``), or
    None."""
    for f in dataclasses.fields(reference):
        mine, theirs = getattr(reference, f.name), getattr(other, f.name)
        if mine == theirs:
            continue
        if isinstance(mine, Message) and isinstance(theirs, Message) and type(mine) is type(theirs):
            inner = spec_diff_nested(mine, theirs)
            if inner is not None:
                return f"{f.name}.{inner}"
        return f"{f.name} {theirs!r} != {mine!r}"
    return None


def spec_diff_nested(reference: Message, other: Message) -> str | None:
    """:func:`spec_diff` for a nested wire message."""
    for f in dataclasses.fields(reference):  # type: ignore[arg-type]  # every Message is a dataclass
        mine, theirs = getattr(reference, f.name), getattr(other, f.name)
        if mine != theirs:
            return f"{f.name} {theirs!r} != {mine!r}"
    return None
