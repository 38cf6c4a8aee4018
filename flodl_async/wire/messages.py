"""Every message that crosses the controller port, by channel.

Messages whose bodies can carry secrets are ``sealed=True``: ``WorldFormed`` (the command and the
environment, which often hold tokens), ``RankExited`` (a user's traceback and stderr lines),
``RankOutput`` (whatever a rank prints) and ``RankStats`` (each rank's last output line); their
bodies are encrypted, not only authenticated. Tensor payloads are always encrypted.

Kinds are grouped by channel in the high byte (0x01xx join, 0x02xx rendezvous, 0x03xx data, 0x04xx
control, 0x05xx relay-local); a new message takes the next free kind of its group. The grouping is
only a numbering: which kinds may travel on which channel, in which direction, is the table in
:mod:`.legality`, which a new message must join before it can be sent. Schema evolution rules are in
:mod:`.schema`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The join channel's messages live in .joinlink (for length); these are their names everywhere.
from .joinlink import (
    Abort,
    Finish,
    JoinAccept,
    JoinHello,
    JoinReject,
    OpenRound,
    RankActivity,
    RankExited,
    RankOutput,
    RanksStopped,
    RankStats,
    SignalRanks,
    StartRanks,
    StopRanks,
    WorldFormed,
)
from .schema import Message, message

#: The join channel's messages, re-exported from :mod:`.joinlink`.
__all__ = [
    "Abort",
    "Finish",
    "JoinAccept",
    "JoinHello",
    "JoinReject",
    "OpenRound",
    "RankActivity",
    "RankExited",
    "RankOutput",
    "RankStats",
    "RanksStopped",
    "SignalRanks",
    "StartRanks",
    "StopRanks",
    "WorldFormed",
]

# ----- rendezvous channel ---------------------------------------------------------------


@message(kind=0x0201)
@dataclass(frozen=True, slots=True, kw_only=True)
class StoreAddress(Message):
    """The store host's agent reports where its TCPStore listens for ``round``."""

    round: int
    host: str
    port: int


@message(kind=0x0202)
@dataclass(frozen=True, slots=True, kw_only=True)
class RendezvousHello(Message):
    """An agent opens its rendezvous link."""

    host: str


# ----- control channel (Heartbeat also travels the join channel) -----------------------------


@message(kind=0x0401)
@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Message):
    """Liveness: ``sent_at`` is the sender's monotonic clock, echoed back by the receiver."""

    sent_at: float
    rank: int = -1
    #: A relay's own beat on its upstream control link (``rank``: one of its host's ranks, which
    #: binds the link to the host).
    relay: bool = False


@message(kind=0x0402)
@dataclass(frozen=True, slots=True, kw_only=True)
class RankHello(Message):
    """A flodl-aware rank introduces itself to its relay (forwarded up, rank-tagged)."""

    rank: int
    local_rank: int
    world_size: int
    pid: int


@message(kind=0x0403)
@dataclass(frozen=True, slots=True, kw_only=True)
class RankWelcome(Message):
    """The controller acknowledges a rank's hello (relayed back down)."""

    rank: int
    run_id: str


# ----- data channel ------------------------------------------------------------------------


@message(kind=0x0301)
@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec(Message):
    """Where one tensor lies in a frame's raw payload."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


# 0x0302 (the retired TensorBundle) is never reused: an older peer would misread it.


# ----- data channel: the Trainer's averaging ------------------------------------------------


@message(kind=0x0303)
@dataclass(frozen=True, slots=True, kw_only=True)
class DataHello(Message):
    """A rank opens its data link to its relay: the model it averages (size and run digest)."""

    rank: int
    model_bytes: int
    digest: str


@message(kind=0x0304)
@dataclass(frozen=True, slots=True, kw_only=True)
class HostDataHello(Message):
    """A relay opens the host's one data connection: its ranks, and the model they average."""

    host: str
    ranks: tuple[int, ...]
    model_bytes: int
    digest: str


@message(kind=0x0305)
@dataclass(frozen=True, slots=True, kw_only=True)
class DataWelcome(Message):
    """The hello matched: tensor frames up to ``max_payload`` bytes are accepted from now on."""

    max_payload: int


@message(kind=0x0306)
@dataclass(frozen=True, slots=True, kw_only=True)
class Contribution(Message):
    """One rank's tensors for round ``round`` (raw, in the model's dtypes), weighted ``steps **
    gamma``; ``tensors == ()`` is an empty one: nothing to add, the rank awaits the consensus."""

    round: int
    kind: str
    rank: int
    weight: float
    steps: int
    tensors: tuple[TensorSpec, ...] = ()


@message(kind=0x0307)
@dataclass(frozen=True, slots=True, kw_only=True)
class HostContribution(Message):
    """One host's part of round ``round``: ranks ``ranks`` (each exactly once), total ``weight``.

    ``prescaled``: the relay folded several ranks (``Σ w_r·t_r``, in the accumulator dtype);
    otherwise the one rank's raw tensors, to be scaled by ``weight`` at the controller.
    ``steps`` (appended to the spec's fields): each listed rank's realized steps, in ``ranks``
    order, so the controller can check a model round's weight against ``steps ** gamma``.
    """

    round: int
    kind: str
    host: str
    ranks: tuple[int, ...]
    weight: float
    prescaled: bool
    tensors: tuple[TensorSpec, ...] = ()
    steps: tuple[int, ...] = ()


@message(kind=0x0308)
@dataclass(frozen=True, slots=True, kw_only=True)
class Consensus(Message):
    """The result of round ``round``; ``mass == 0`` carries no tensors (ranks keep their local
    state)."""

    round: int
    kind: str
    mass: float
    tensors: tuple[TensorSpec, ...] = ()


@message(kind=0x0309)
@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSchemaWire(Message):
    """A model's tensor layout (nested in ``TrainerHello``; :class:`flodl_async.training.modelschema
    .ModelSchema`). ``dtypes``/``shapes`` are in wire order: parameters, then persistent buffers.

    A twin of ``ModelSchema``, kept because the shapes differ (parallel arrays here, one
    ``TensorMeta`` per tensor there), and ``ModelSchema.from_wire`` validates what a rank sent
    (unique names, wire dtypes, aliases of listed tensors) as a decoded message cannot.
    """

    param_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    aliases: dict[str, str] = field(default_factory=dict)


@message(kind=0x030A)
@dataclass(frozen=True, slots=True, kw_only=True)
class OuterSpecWire(Message):
    """An outer optimizer spec (:mod:`flodl_async.training.outer`): ``kind`` is ``avg``, ``slowmo``
    or ``diloco``.

    A twin of ``OuterAvg | SlowMo | DiLoCo``, kept because a union of three classes travels as
    one tagged record: a nested value is encoded by position, without its class, so ``kind`` is
    what tells them apart. The domain classes also validate ``lr`` and ``momentum``."""

    kind: str
    lr: float = 0.0
    momentum: float = 0.0


# ----- control channel: the Trainer's coordinator protocol -----------------------------------
# Down-messages carry ``rank`` (the relay routes on it); ``rank = -1`` means every local rank
# of the receiving relay, one frame per host. The nested classes (``...Wire``, ``EpochMetrics``,
# ``RankEpochStats``, ``RoundPlan``) are registered kinds so the schema can nest them, but are
# legal on no route by themselves.


@message(kind=0x0412)
@dataclass(frozen=True, slots=True, kw_only=True)
class ElCheConfigWire(Message):
    """:class:`flodl_async.training.spec.ElCheConfig` with every default resolved for its policy.

    A twin of ``ElCheSettings``, kept because the wire shape differs: its ``speed_hint`` pair
    ``(rank, ratio)`` travels as two nullable fields, and its ``guard`` pair ``(threshold, nudge)``
    or None as ``guard``/``guard_threshold``/``guard_nudge`` (the schema has no mixed-type tuples).
    """

    anchor: int
    min_anchor: int
    max_anchor: int
    overhead_target: float
    max_batch_diff: int | None
    adapt: bool
    speed_hint_rank: int | None
    speed_hint_ratio: float | None
    partition_ratios: tuple[float, ...] | None
    max_overshoot: int | None
    easgd_alpha: float | None
    gamma: float
    guard: bool
    guard_threshold: float
    guard_nudge: float


@message(kind=0x0413)
@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerSpecWire(Message):
    """Everything the coordinator and reducer need from a rank's Trainer, as plain values: a twin
    of ``TrainerSpec``, since they differ in more than names (enums travel as values,
    ``Checkpointing`` and ``MaxFailure`` are flattened, ElChe travels resolved so the run digest
    compares the settings ranks use, not how they were written; ``TrainerSpec.from_wire`` checks
    the cross-field rules, which belong above the wire)."""

    policy: str
    backend: str
    epochs: int
    batch_size: int
    dataset_len: int
    drop_last: bool
    seed: int
    elche: ElCheConfigWire
    outer: OuterSpecWire
    save_path: str | None
    resume_from: str | None
    every_epochs: int | None
    on_shutdown: bool
    rank_state: bool
    max_failure_absolute: int | None
    max_failure_percent: float | None
    heartbeat_timeout: float
    lr_schedule: bool
    max_grad_norm: float | None
    name: str
    every_rounds: int | None = None
    every_seconds: float | None = None
    keep_last: int | None = None


@message(kind=0x0415)
@dataclass(frozen=True, slots=True, kw_only=True)
class RankEpochStats(Message):
    """One rank's part of an aggregated epoch (nested in :class:`EpochMetrics`); defined here, not
    in :mod:`flodl_async.training.metrics`: the same declaration is the domain value and its wire
    form."""

    rank: int
    batches: int
    samples: int
    avg_loss: float
    throughput: float  # batches / s of busy (compute + data) time
    batch_share: float  # batches / cohort batches this epoch
    compute_ms: float
    data_ms: float
    alive: bool


@message(kind=0x0416)
@dataclass(frozen=True, slots=True, kw_only=True)
class EpochMetrics(Message):
    """One aggregated epoch: what the log line, the status page and ``TrainingRun.metrics()`` show.
    ``epoch`` counts from 1 (a run's last is its epoch count). Built by the ``EpochLedger``, sent to
    the ranks in :class:`EpochAggregated` as it is (the domain value is its own wire form)."""

    epoch: int
    avg_loss: float
    epoch_ms: float
    batches: int
    samples: int
    reduces: int
    avg_reduce_ms: float
    anchor: int
    counts: tuple[int, ...]
    per_rank: tuple[RankEpochStats, ...]
    scalars: dict[str, float] = field(default_factory=dict)

    def summary(self, epochs: int, world: int) -> str:
        """The controller's one line per epoch."""
        shares = "/".join(f"{r.batch_share:.2f}" for r in self.per_rank)
        return (
            f"epoch {self.epoch}/{epochs}: loss {self.avg_loss:.4g} in "
            f"{self.epoch_ms / 1000:.1f} s, {world} ranks, shares {shares}, "
            f"{self.reduces} reduces (avg {self.avg_reduce_ms:.0f} ms), anchor {self.anchor}"
        )


@message(kind=0x0404)
@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerHello(Message):
    """A rank's Trainer joins the session: its spec, model schema and their digest."""

    rank: int
    spec: TrainerSpecWire
    digest: str
    model: ModelSchemaWire
    model_bytes: int
    device: str
    #: 0 for the process its agent first started; a rank its agent restarted says its attempt
    #: (1, 2, …), so that a frozen earlier process is never taken for the new one.
    incarnation: int = 0


@message(kind=0x0405)
@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerWelcome(Message):
    """The spec is accepted: the world's size, the run, the primary; a resumed run's epoch, step and
    round, and the bundle each rank restores its own state from (``restore_rank_state``)."""

    rank: int
    world_size: int
    run_id: str
    start_epoch: int = 0
    global_step: int = 0
    sync_round: int = 0
    resumed: bool = False
    restore_rank_state: bool = False
    primary_rank: int = 0
    resume: str = ""


@message(kind=0x0406)
@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerReject(Message):
    """The rank's spec does not match, or it came too late: it exits non-zero with ``reason``."""

    rank: int
    reason: str


@message(kind=0x0407)
@dataclass(frozen=True, slots=True, kw_only=True)
class Plan(Message):
    """Work for one window: batch ranges ``(first_batch, n)`` of epoch ``epoch``'s pool. Send
    ``WindowDone`` after ``quota`` steps (0: at once); hold once the steps since the last
    contribution reach ``hold_after`` (-1: never); ``progress``: the epoch's at the window start."""

    rank: int
    round: int
    epoch: int
    ranges: tuple[tuple[int, ...], ...]
    quota: int
    hold_after: int
    progress: float


@message(kind=0x0408)
@dataclass(frozen=True, slots=True, kw_only=True)
class WindowDone(Message):
    """A rank finished its window's quota (Async: it keeps training). ``divergence`` is
    ``‖pre−post‖/‖post‖`` of the last consensus applied, -1 if none. Scalars travel as two maps
    (sum, count) because the schema has no mixed-type tuples."""

    rank: int
    round: int
    epoch: int
    batches: int
    samples: int
    compute_ms: float
    data_ms: float
    loss_sum: float
    divergence: float = -1.0
    scalar_sums: dict[str, float] = field(default_factory=dict)
    scalar_counts: dict[str, int] = field(default_factory=dict)


@message(kind=0x0417)
@dataclass(frozen=True, slots=True, kw_only=True)
class RoundPlan(Message):
    """What each rank may claim in one round (nested in ``Reduce``, for the relays and the reducer:
    :mod:`flodl_async.training.plancheck`): ``steps[r]`` steps at most, each contribution weighing
    ``steps ** gamma`` (0 steps: 0), or 1 if ``equal``; ``init``/``upload`` take ``root``'s only."""

    steps: tuple[int, ...]
    gamma: float
    equal: bool = False
    root: int = 0


@message(kind=0x0409)
@dataclass(frozen=True, slots=True, kw_only=True)
class Reduce(Message):
    """Contribute to round ``round`` on the data channel (``from_controller``: only await its
    consensus). ``kind``: ``init``, ``model``, ``final`` or ``upload``; ``checkpoint`` N > 0: after
    applying, write the rank state into bundle ``checkpoint_name`` and say ``RankStateSaved(N)``;
    ``reset_inner`` clears the inner optimizer (DiLoCo); ``plan`` is the relays' and reducer's."""

    round: int
    kind: str
    from_controller: bool = False
    checkpoint: int = 0
    reset_inner: bool = False
    rank: int = -1
    plan: RoundPlan | None = None
    checkpoint_name: str = ""


@message(kind=0x040A)
@dataclass(frozen=True, slots=True, kw_only=True)
class ReduceDone(Message):
    """COLLECTIVE: the rank's all_reduce of round ``round`` finished in group ``generation``."""

    rank: int
    round: int
    mass: float
    ms: float
    generation: int = 0


@message(kind=0x040B)
@dataclass(frozen=True, slots=True, kw_only=True)
class EpochAggregated(Message):
    """An aggregated epoch, for the ranks' ``TrainingRun.metrics()``."""

    metrics: EpochMetrics
    rank: int = -1


@message(kind=0x040C)
@dataclass(frozen=True, slots=True, kw_only=True)
class DeclareDead(Message):
    """``dead_rank`` is lost: relays drop it from their fold barrier, ranks log it; COLLECTIVE
    survivors re-form as ``regroup`` (in order) under ``generation``, then redo round ``redo``."""

    dead_rank: int
    reason: str
    rank: int = -1
    regroup: tuple[int, ...] = ()
    generation: int = 0
    redo: int = -1


@message(kind=0x040D)
@dataclass(frozen=True, slots=True, kw_only=True)
class RankGone(Message):
    """A relay lost ``rank``: its local control link closed, or (``refused``) the relay refused what
    the rank sent (``reason`` says what). Sent by the relay, never by a rank."""

    rank: int
    reason: str
    refused: bool = False


@message(kind=0x040E, sealed=True)
@dataclass(frozen=True, slots=True, kw_only=True)
class Exiting(Message):
    """The rank is leaving: a clean exit (``error`` empty) or a death record (its traceback)."""

    rank: int
    reason: str
    error: str = ""


@message(kind=0x040F)
@dataclass(frozen=True, slots=True, kw_only=True)
class Intent(Message):
    """A rank's request: ``kind`` ``checkpoint``, or :attr:`STOP` (``TrainingRun.shutdown()``)."""

    STOP = "stop"  # the orderly stop of the whole run: a final round, every process's state
    rank: int
    kind: str


@message(kind=0x0410)
@dataclass(frozen=True, slots=True, kw_only=True)
class RankStateSaved(Message):
    """The rank wrote (or failed to write: ``error``) its state file for checkpoint ``version``."""

    rank: int
    version: int
    path: str
    sha256: str
    error: str = ""


@message(kind=0x0411)
@dataclass(frozen=True, slots=True, kw_only=True)
class Shutdown(Message):
    """The end: ranks finish ``run()`` (normal end, orderly stop) or raise (``save_reason``)."""

    reason: str
    save_reason: str = ""
    rank: int = -1
