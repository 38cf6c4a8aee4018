"""The coordinator's vocabulary: what it is built with, its phases, the events it takes, the
actions it returns and the view it shows.

The machine that relates them is :class:`~flodl_async.training.coordinator.Coordinator`. Its
:class:`~flodl_async.control.vocab.Tick`, :class:`~flodl_async.control.vocab.Announce` and
:class:`~flodl_async.control.vocab.Tell` are the words it shares with the run's supervisor: it
tells ranks, ``Tell(to=rank, ...)``, or every relay at once, ``Tell(to=EVERY_RANK, ...)``. Pure.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..control.dispatch import TypeTable
from ..control.vocab import Announce, Tell, Tick
from ..verdict import ExitCode
from ..wire import messages as m
from .elche import ElChe, ElCheState
from .metrics import EpochMetrics
from .partition import Range
from .regroup import Regroup
from .saves import ResumePoint
from .spec import TrainerSpec

#: The ``to`` of a :class:`~flodl_async.control.vocab.Tell` for every relay: a down-message
#: that names no rank (``Shutdown``) goes to all of them.
EVERY_RANK = -1


# ----- configuration -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorConfig:
    """What the shell knows when the first hello arrives (deadlines already scaled)."""

    run_id: str
    world_size: int
    #: Which host runs each rank (for the verdicts' wording).
    hosts: Mapping[int, str] = field(default_factory=dict)
    hello_timeout: float = 120.0
    reduce_stall: float = 120.0
    #: Multiplies the spec's ``heartbeat_timeout`` (``FLODL_NET_TIMEOUT_SCALE``).
    timeout_scale: float = 1.0
    primary_rank: int = 0
    #: The launcher's own spec when the user's script is the launcher: every rank must match it.
    reference: TrainerSpec | None = None
    #: ``--max-restarts``: how many restarted ranks may rejoin over the whole run (CPU backend).
    max_restarts: int = 0
    #: The checkpoint bundle this run resumes from (verified by the shell before any rank trains).
    resume: ResumePoint | None = None


class CoordPhase(enum.Enum):
    """Where the run is."""

    JOINING = "joining"
    INIT = "init"
    TRAINING = "training"
    STOPPING = "stopping"
    FINAL = "final"
    DONE = "done"
    FAILED = "failed"


# ----- what each stage holds ----------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class BeforeHello:
    """No valid hello yet: no spec, no deadline."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Joining:
    """The first valid hello fixed the run's spec; the others have ``hello_timeout`` from
    ``first_hello_at``."""

    reference: m.TrainerHello
    spec: TrainerSpec
    first_hello_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Running:
    """Every rank said hello: ElChe sizes the windows (from INIT to the end of the run)."""

    reference: m.TrainerHello
    spec: TrainerSpec
    elche: ElChe


#: The coordinator's data by stage; :class:`CoordPhase` says where within it the run is.
Stage = BeforeHello | Joining | Running

# ----- events --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerJoined:
    """A rank's ``TrainerHello`` arrived."""

    hello: m.TrainerHello


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowReported:
    """A rank's ``WindowDone`` arrived."""

    report: m.WindowDone


@dataclass(frozen=True, slots=True, kw_only=True)
class FrameSeen:
    """Some frame (a heartbeat included) arrived from ``rank``: a sign of life."""

    rank: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RankLost:
    """``rank`` is gone: its relay link closed, it exited non-zero, or its agent lost it."""

    rank: int
    reason: str
    details: str = ""
    #: The reason is the process's own exit (its code or signal): for a rank already lost to a
    #: link's close, it replaces the reason the verdict gives.
    exit: bool = False
    #: The reason says only that a link closed: the process's own exit, when it comes, says more
    #: (a lie, a death record or a frozen rank's silence are causes, and keep their reason).
    vague: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RankExiting:
    """A rank's ``Exiting``: a clean exit, or a death record with its traceback."""

    message: m.Exiting


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundCompleted:
    """The reducer finished ``round`` (``duration_ms``: Reduce sent → last consensus frame
    written)."""

    round: int
    kind: str
    mass: float
    duration_ms: float
    #: The ranks whose contributions the consensus holds, with the steps each brought; None: the
    #: round runner does not say, and a rank that died while the round ran is taken as not in it.
    folded: Mapping[int, int] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveDone:
    """A rank's ``ReduceDone`` (COLLECTIVE backend)."""

    message: m.ReduceDone


@dataclass(frozen=True, slots=True, kw_only=True)
class StopRequested:
    """An orderly stop: a final round, then ``Shutdown`` (``TrainingRun.shutdown``, a signal)."""

    reason: str
    #: the launcher got the preemption signal: the final round is a checkpoint round (``preempt``)
    #: whatever ``on_shutdown`` says, since the job's requeue resumes from it
    preempt: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointRequested:
    """A checkpoint was asked for (``run.checkpoint()`` in any process,
    ``Worker.request_checkpoint()``): the next reduce boundary writes one."""

    reason: str


Event = (
    TrainerJoined
    | WindowReported
    | FrameSeen
    | RankLost
    | RankExiting
    | RoundCompleted
    | CollectiveDone
    | StopRequested
    | CheckpointRequested
    | Tick
)


def _no_sender(
    event: TrainerJoined | RankLost | RoundCompleted | StopRequested | CheckpointRequested | Tick,
    /,
) -> None:
    # a hello is recorded by its own handler; the others are not frames from a rank
    del event


def _reporter(event: WindowReported, /) -> int:
    return event.report.rank


def _frame_sender(event: FrameSeen, /) -> int:
    return event.rank


def _message_sender(event: RankExiting | CollectiveDone, /) -> int:
    return event.message.rank


sender: TypeTable[Event, [], int | None] = TypeTable("the coordinator's events' senders")
"""``sender(event)``: the rank whose frame ``event`` is (a sign of life), or None."""
sender.add(TrainerJoined, _no_sender)
sender.add(RankLost, _no_sender)
sender.add(RoundCompleted, _no_sender)
sender.add(StopRequested, _no_sender)
sender.add(CheckpointRequested, _no_sender)
sender.add(Tick, _no_sender)
sender.add(WindowReported, _reporter)
sender.add(FrameSeen, _frame_sender)
sender.add(RankExiting, _message_sender)
sender.add(CollectiveDone, _message_sender)
sender.require(Event)

# ----- actions -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StartRound:
    """Open round ``round`` and broadcast its ``Reduce``.

    ``reducer``: the controller's reducer runs it (open it with ``expected`` before the
    broadcast, report :class:`RoundCompleted`); otherwise the ranks all_reduce among
    themselves and answer ``ReduceDone`` (COLLECTIVE).
    """

    round: int
    kind: str
    expected: frozenset[int]
    from_controller: bool
    reducer: bool
    message: m.Reduce
    #: A checkpoint round: the bundle's reason (the reducer keeps a copy of its consensus, and every
    #: rank writes its state after applying it); "" for none.
    checkpoint: str = ""
    #: The bundle's round number (the run's rounds continue a resumed run's: ``round`` + base).
    bundle_round: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class DeclareDead:
    """``rank`` is dead: release it from the reducer's rounds and broadcast ``DeclareDead`` (with
    ``regroup``, a COLLECTIVE world's survivors' re-form)."""

    rank: int
    reason: str
    regroup: Regroup | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Readmit:
    """``rank``'s restarted incarnation rejoins at round ``round``: the reducer and the relays take
    its contributions again from that round on (its ``TrainerWelcome`` went out with its hello)."""

    rank: int
    incarnation: int
    round: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishEpoch:
    """An epoch closed: the log line, the status page, the launcher's handle,
    ``EpochAggregated``."""

    metrics: EpochMetrics


@dataclass(frozen=True, slots=True, kw_only=True)
class Finish:
    """Training ended in order (``Shutdown`` already in the actions before this): the run's success
    reason."""

    reason: str
    save_reason: str
    interrupted: bool = False
    #: The ranks lost on the way (the run went on without them), with why.
    lost: tuple[tuple[int, str], ...] = ()
    #: The ranks restarted and rejoined, one entry per restart.
    restarted: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Fail:
    """The coordinator cannot go on: the run's root cause (``rank`` is who, or -1)."""

    code: ExitCode
    reason: str
    rank: int = -1
    details: str = ""
    save_reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveCheckpoint:
    """Commit a checkpoint bundle of round ``round``'s consensus (the reducer's copy): written in
    the background, its manifest last once every rank in ``ranks`` reported its state file.

    ``last``: the run is ending on a failure, the bundle holds the last consensus the reducer has
    (round ``round`` or an earlier one), and no rank writes a state file."""

    round: int
    #: The bundle's round number (``round`` plus a resumed run's base).
    bundle_round: int
    reason: str
    #: Epochs completed in the consensus; the bundle's epoch in progress is this one.
    epoch: int
    global_step: int
    #: Batch ranges of epoch ``epoch`` the consensus already holds.
    coverage: tuple[Range, ...]
    elche: ElCheState | None
    ranks: frozenset[int]
    world_size: int
    last: bool = False


Action = (
    Tell[int]
    | StartRound
    | DeclareDead
    | Readmit
    | PublishEpoch
    | Announce
    | Finish
    | Fail
    | SaveCheckpoint
)

# ----- the status view -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RankView:
    """One rank on the status page."""

    rank: int
    host: str
    state: str
    batches: int
    heartbeat_age: float


def rank_views(
    hosts: Mapping[int, str],
    ranks: Iterable[int],
    *,
    dead: frozenset[int],
    exiting: frozenset[int],
    alive: frozenset[int],
    last_seen: Mapping[int, float],
    batches: Mapping[int, int],
    now: float,
) -> tuple[RankView, ...]:
    """Each of ``ranks`` as the status page shows it: dead, exiting, training or joining."""
    views = []
    for rank in ranks:
        state = (
            "dead"
            if rank in dead
            else "exiting"
            if rank in exiting
            else "training"
            if rank in alive
            else "joining"
        )
        seen = last_seen.get(rank)
        views.append(
            RankView(
                rank=rank,
                host=hosts.get(rank, ""),
                state=state,
                batches=batches.get(rank, 0),
                heartbeat_age=0.0 if seen is None else max(0.0, now - seen),
            )
        )
    return tuple(views)


@dataclass(frozen=True, slots=True, kw_only=True)
class LostRankView:
    """A rank the run lost, on the status page."""

    rank: int
    host: str
    #: Why, and when: ``its process was killed by SIGKILL at epoch 2``.
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorView:
    """A frozen snapshot for the status endpoint's ``training`` block."""

    phase: str
    #: Epochs closed so far (the epoch line's count: ``epoch 2/4`` once the second closed).
    epoch: int
    epochs: int
    policy: str
    backend: str
    anchor: int
    counts: tuple[int, ...]
    last_reduce_ms: float
    #: The world the run started with.
    world_size: int
    #: Ranks that joined and are not lost: the world training goes on with.
    alive: int
    #: The ranks lost so far, by rank.
    lost: tuple[LostRankView, ...]
    ranks: tuple[RankView, ...]


def coordinator_view(
    config: CoordinatorConfig,
    *,
    phase: CoordPhase,
    epoch: int,
    spec: TrainerSpec | None,
    elche: ElChe | None,
    last_reduce_ms: float,
    lost: Iterable[tuple[int, str]],
    exiting: frozenset[int],
    alive: frozenset[int],
    last_seen: Mapping[int, float],
    batches: Mapping[int, int],
    now: float,
) -> CoordinatorView:
    """The coordinator's state as the status page shows it; ``lost``: (rank, why) of each lost
    rank (``LostRanks.why``)."""
    lost_views = tuple(
        LostRankView(rank=rank, host=config.hosts.get(rank, ""), reason=why) for rank, why in lost
    )
    return CoordinatorView(
        phase=phase.value,
        epoch=epoch,
        epochs=0 if spec is None else spec.epochs,
        policy="" if spec is None else spec.policy.value,
        backend="" if spec is None else spec.backend.value,
        anchor=0 if elche is None else elche.anchor,
        counts=() if elche is None else elche.counts,
        last_reduce_ms=last_reduce_ms,
        world_size=config.world_size,
        alive=len(alive),
        lost=lost_views,
        ranks=rank_views(
            config.hosts,
            range(config.world_size),
            dead=frozenset(v.rank for v in lost_views),
            exiting=exiting,
            alive=alive,
            last_seen=last_seen,
            batches=batches,
            now=now,
        ),
    )
