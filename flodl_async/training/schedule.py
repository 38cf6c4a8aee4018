"""What a Trainer process trains next and what it does between steps, decided without I/O or torch.

Theory of operation. The compute side's runner (:mod:`flodl_async.trainer.schedule`) blocks on
the link, touches the tensors and carries out what a policy here decides; the policy only keeps
count.

- :class:`RankPolicy` follows the coordinator. Its events are the control messages the link thread
  delivers (plans, reduces, aggregated epochs, deaths, the end), :class:`Asked` (the compute side
  is at a step boundary and wants its next batch), :class:`Stepped` and :class:`Settled` (an ASYNC
  consensus was blended). Asked at a boundary it says, in this order of precedence: contribute to a
  pending reduce, end, hold (before INIT, after the final round, with no plan left, or at the
  plan's ``hold_after``), report the window (at its quota, or with the planned data trained out),
  or train the plan's next batch.
- :class:`InlinePolicy` walks every epoch's batches in order in one process: train, close an
  epoch, end.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass

from ..control.dispatch import TypeTable
from ..wire import messages as m
from ..wire.restarts import Readmitted
from ..wire.schema import Message
from .metrics import EpochMetrics
from .partition import coalesce
from .policy import Policy
from .regroup import Regroup

#: ``Shutdown.save_reason`` values that end a run normally; any other is a failure.
NORMAL_ENDS = frozenset({"", "completed", "graceful_shutdown"})


# ----- events ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Asked:
    """The compute side is at a step boundary and asks what to do next."""


@dataclass(frozen=True, slots=True)
class Stepped:
    """The batch last handed out is trained."""


@dataclass(frozen=True, slots=True)
class Settled:
    """The outstanding ASYNC contribution's consensus arrived and was blended."""


#: The control messages a rank acts on; anything else from the coordinator is not its business.
Inbound = (
    m.Plan
    | m.Reduce
    | m.EpochAggregated
    | m.DeclareDead
    | Readmitted
    | m.Shutdown
    | m.TrainerReject
)

#: What a :class:`RankPolicy` has a handler for.
RankEvent = Inbound | Asked | Stepped | Settled


# ----- actions -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Train:
    """Train batch ``batch`` of epoch ``epoch``'s pool; ``plan`` numbers the plan it belongs to,
    ``progress`` is the epoch progress for LR schedules."""

    epoch: int
    batch: int
    plan: int
    progress: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """Send ``WindowDone`` for window ``round`` of epoch ``epoch``: everything trained since the
    last report."""

    round: int
    epoch: int


class Via(enum.Enum):
    """How a contribution reaches the round's consensus."""

    #: the controller holds the consensus (natural end, resume): only wait for it
    RECEIVE = "receive"
    #: over the data link, waiting for the consensus and overwriting with it
    LINK = "link"
    #: over the data link without waiting (ASYNC model rounds): training goes on, so the tensors
    #: sent are a copy, and the consensus is blended in when it arrives
    SUBMIT = "submit"
    #: torch.distributed in place on every rank, the outer step replicated; ``ReduceDone`` up
    COLLECTIVE = "collective"


@dataclass(frozen=True, slots=True, kw_only=True)
class Contribute:
    """Contribute to round ``round`` of kind ``kind`` with ``steps`` steps weighing ``weight``;
    ``tensors`` says whether this rank's state goes with it (an empty contribution otherwise);
    ``reset_inner`` clears the inner optimizer afterwards (DiLoCo)."""

    round: int
    kind: str
    via: Via
    steps: int
    weight: float
    tensors: bool
    reset_inner: bool
    #: A checkpoint round (its bundle's round number, 0: none): after the consensus is applied,
    #: the rank writes its state into bundle ``checkpoint_name``.
    checkpoint: int = 0
    checkpoint_name: str = ""


@dataclass(frozen=True, slots=True)
class Settle:
    """Wait for the outstanding ASYNC contribution's consensus and blend it in (at most one is
    outstanding, and none outlives the run)."""


@dataclass(frozen=True, slots=True)
class Hold:
    """Nothing to train until the coordinator says more: block on the link."""


@dataclass(frozen=True, slots=True)
class End:
    """The run is over on this side."""


@dataclass(frozen=True, slots=True)
class Publish:
    """An aggregated epoch, for ``TrainingRun.metrics()``."""

    metrics: EpochMetrics


@dataclass(frozen=True, slots=True)
class NoteLost:
    """The coordinator declared ``rank`` lost (a warning in this rank's log)."""

    rank: int
    reason: str


@dataclass(frozen=True, slots=True)
class Stop:
    """The coordinator stopped the run or refused this rank: raise ``TrainingStopped(reason)``."""

    reason: str


@dataclass(frozen=True, slots=True)
class CloseEpoch:
    """Inline: epoch ``epoch`` is trained out; publish its metrics."""

    epoch: int


#: What a :class:`RankPolicy` asks of its runner.
RankAction = Train | Report | Contribute | Settle | Hold | End | Publish | NoteLost | Stop | Regroup

#: What an :class:`InlinePolicy` asks of its runner.
InlineAction = Train | CloseEpoch | End


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """A finished run's counters, as this process saw them (``TrainedState`` fields)."""

    epochs_completed: int
    global_step: int
    world_size: int
    lost_ranks: tuple[int, ...]
    interrupted: bool


# ----- the rank ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _PlanState:
    """A plan being worked through: its batches in order and how far the rank got."""

    plan: m.Plan
    batches: list[int]
    done: int = 0

    @property
    def exhausted(self) -> bool:
        return self.done >= len(self.batches)


def flatten(ranges: tuple[tuple[int, ...], ...]) -> list[int]:
    """A plan's batch ranges ``(first, count)`` as the batch indices, in order."""
    out: list[int] = []
    for first, count in ranges:
        out.extend(range(first, first + count))
    return out


class RankPolicy:
    """What one rank does at each step boundary, given what the coordinator said.

    ``averaging`` is the run's policy, ``collective`` whether the backend is COLLECTIVE, ``gamma``
    the exponent of a contribution's weight (steps ** gamma), ``n_batches`` the batches in an
    epoch's pool (for the LR progress inside a plan). ``joining``: this process is a restarted
    rank rejoining a run under way (:mod:`flodl_async.training.rejoin`): nothing trains before its
    first round, which it joins at weight 0 and whose consensus it takes as its warm start.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        averaging: Policy,
        collective: bool,
        gamma: float,
        n_batches: int,
        start_epoch: int = 0,
        start_step: int = 0,
        resumed: bool = False,
        joining: bool = False,
    ) -> None:
        """``start_epoch`` and ``start_step``: a resumed run's epochs completed and global step;
        ``resumed``: its init round takes the bundle's consensus (every rank contributes
        nothing)."""
        self.rank = rank
        self._joining = joining
        # a joiner's Readmitted came: the rounds from here on count it (before, a round's Reduce
        # that reached its fresh link was opened without it)
        self._readmitted = not joining
        self._world_size = world_size
        self._averaging = averaging
        self._collective = collective
        self._gamma = gamma
        self._n_batches = n_batches
        self._plans: collections.deque[_PlanState] = collections.deque()
        self._reduces: collections.deque[m.Reduce] = collections.deque()
        self._initialized = False
        self._final_round = False  # the final (or upload) round is done: only Shutdown is left
        self._ended: m.Shutdown | None = None
        self.window_round = -1
        self.window_steps = 0
        self._window_sent = False
        self._unreported = False  # a step was trained since the last report
        self._since_contribution = 0
        self._outstanding = False
        self._lost: set[int] = set()
        self._regroup: Regroup | None = None  # the latest re-form not carried out yet
        self._resumed = resumed
        self._epochs_seen = start_epoch
        self._cohort_batches = start_step * world_size
        self._handlers: TypeTable[
            Message | Asked | Stepped | Settled, [], tuple[RankAction, ...]
        ] = TypeTable("the rank schedule's events")
        self._handlers.add(m.Plan, self._on_plan)
        self._handlers.add(m.Reduce, self._on_reduce)
        self._handlers.add(m.EpochAggregated, self._on_epoch)
        self._handlers.add(m.DeclareDead, self._on_dead)
        self._handlers.add(Readmitted, self._on_readmitted)
        self._handlers.add(m.Shutdown, self._on_shutdown)
        self._handlers.add(m.TrainerReject, self._on_reject)
        self._handlers.add(Asked, self._on_asked)
        self._handlers.add(Stepped, self._on_stepped)
        self._handlers.add(Settled, self._on_settled)
        self._handlers.require(RankEvent)
        self._kinds = self._handlers.kinds

    def handle(self, event: Message | Asked | Stepped | Settled) -> tuple[RankAction, ...]:
        """Take ``event``; what to do, in order (nothing for a message outside :data:`Inbound`).

        Asked, the last action is the boundary's one decision (:class:`Contribute`, :class:`End`,
        :class:`Hold`, :class:`Report` or :class:`Train`), after the reports and the settling it
        takes first.
        """
        if type(event) not in self._kinds:
            return ()
        return self._handlers(event)

    @property
    def regroup_pending(self) -> bool:
        """A COLLECTIVE re-form is waiting to be carried out (a later loss's, during one)."""
        return self._regroup is not None

    @property
    def outcome(self) -> Outcome:
        """The run's counters (once it ended)."""
        if self._ended is None:
            raise RuntimeError(f"rank {self.rank}: the run has not ended")
        return Outcome(
            epochs_completed=self._epochs_seen,
            global_step=self._cohort_batches // max(self._world_size, 1),
            world_size=self._world_size - len(self._lost),
            lost_ranks=tuple(sorted(self._lost)),
            interrupted=self._ended.save_reason == "graceful_shutdown",
        )

    # ----- the boundary --------------------------------------------------------------------------

    def _on_asked(self, _event: Asked) -> tuple[RankAction, ...]:
        if self._regroup is not None:
            # before any contribution: the rounds after a loss are the re-formed group's
            regroup, self._regroup = self._regroup, None
            return (regroup,)
        if self._reduces:  # every boundary is a step boundary: contribute now
            return self._contribute(self._reduces.popleft())
        if self._ended is not None:
            return self._settle_then(End())
        if not self._initialized or self._final_round:
            # before INIT nothing may train; after the final round nothing must
            return (Hold(),)
        reports = self._advance()
        current = self._plans[0] if self._plans else None
        if current is not None and self._window_due(current):
            # what the report brings (a Reduce, a next plan) is handled before the next batch
            return (*reports, self._report(current.plan))
        if current is None or current.exhausted or self._holding(current):
            return (*reports, Hold())
        plan = current.plan
        n = self._n_batches
        progress = plan.progress + current.done / n if n else plan.progress
        work = Train(
            epoch=plan.epoch,
            batch=current.batches[current.done],
            plan=plan.round,
            progress=progress,
        )
        return (*reports, work)

    def _on_stepped(self, _event: Stepped) -> tuple[RankAction, ...]:
        # Only a Train precedes a step, and nothing is handled between them: the plan trained is
        # still the first one, with a batch left.
        self._plans[0].done += 1
        self.window_steps += 1
        self._since_contribution += 1
        self._unreported = True
        return ()

    def _on_settled(self, _event: Settled) -> tuple[RankAction, ...]:
        self._outstanding = False
        return ()

    def _settle_then(self, action: RankAction) -> tuple[RankAction, ...]:
        if not self._outstanding:
            return (action,)
        self._outstanding = False
        return (Settle(), action)

    # ----- plans, windows, holds -----------------------------------------------------------------

    def _advance(self) -> tuple[RankAction, ...]:
        """A finished plan gives way to the next one, its window reported first if it is not."""
        reports: list[RankAction] = []
        while self._plans and self._plans[0].exhausted and len(self._plans) > 1:
            if not self._window_sent and self._plans[0].plan.round == self.window_round:
                reports.append(self._report(self._plans[0].plan))
            self._plans.popleft()
            self._open_window(self._plans[0].plan.round)
        return tuple(reports)

    def _window_due(self, current: _PlanState) -> bool:
        """Report now: the quota is reached, or the planned data ran out with steps unreported; a
        window planned empty at once.

        Nothing else is reported: a SYNC rank past its slice with everything reported is exempt from
        the gate, and under CADENCE the next plan may simply not have arrived yet (it rides the
        control link, the consensus the data link).
        """
        if self._window_sent:
            return False
        if current.plan.quota == 0:
            return current.plan.round == self.window_round
        if current.exhausted and len(self._plans) == 1:
            return self._unreported
        return self.window_steps > 0 and self.window_steps >= current.plan.quota

    def _open_window(self, round_: int) -> None:
        if round_ > self.window_round:
            self.window_round = round_
            self.window_steps = 0
            self._window_sent = False

    def _holding(self, current: _PlanState) -> bool:
        hold_after = current.plan.hold_after
        held = hold_after >= 0 and self._since_contribution >= hold_after
        return held or (self._outstanding and current.exhausted)

    def _report(self, plan: m.Plan) -> Report:
        # Everything trained since the last report (under SYNC that includes the steps past the
        # quota).
        self._window_sent = True
        self._unreported = False
        return Report(round=self.window_round, epoch=plan.epoch)

    # ----- reduces -------------------------------------------------------------------------------

    def _contribute(self, reduce: m.Reduce) -> tuple[RankAction, ...]:
        if self._joining and reduce.kind == "model":
            return (self._warm_start(reduce),)
        steps = self._since_contribution
        kind = reduce.kind
        if kind == "model" or (kind == "final" and not reduce.from_controller):
            self._since_contribution = 0
            self._open_window(reduce.round + 1)
        weighted = float(steps) ** self._gamma if steps > 0 else 0.0
        if self._collective and kind != "upload":
            via, weight, tensors = Via.COLLECTIVE, weighted, True
        elif reduce.from_controller:
            via, weight, tensors = Via.RECEIVE, 0.0, False
        elif kind in ("init", "upload"):
            # init: the root's state seeds every rank; upload (COLLECTIVE): the ranks agree, rank
            # 0's copy goes to the controller. Either way the others send an empty contribution.
            root = self.rank == min(set(range(self._world_size)) - self._lost)
            root = root and not (kind == "init" and self._resumed)
            via, weight, tensors = Via.LINK, 1.0 if root else 0.0, root
        elif kind == "final" and self._averaging is Policy.ASYNC:
            # ASYNC locals differ on purpose: the final round is a plain mean
            via, weight, tensors = Via.LINK, 1.0, True
        elif kind == "model" and self._averaging is Policy.ASYNC:
            via, weight, tensors = Via.SUBMIT, weighted, True
        else:
            via, weight, tensors = Via.LINK, weighted, True
        if kind == "init":
            self._initialized = True
        elif kind in ("final", "upload"):
            self._final_round = True
        action = Contribute(
            round=reduce.round,
            kind=kind,
            via=via,
            steps=steps,
            weight=weight,
            tensors=tensors,
            reset_inner=reduce.reset_inner,
            checkpoint=reduce.checkpoint,
            checkpoint_name=reduce.checkpoint_name,
        )
        out = self._settle_then(action)  # at most one contribution outstanding
        self._outstanding = via is Via.SUBMIT
        return out

    def _warm_start(self, reduce: m.Reduce) -> Contribute:
        """A rejoining rank's first round: its state goes in at weight 0 (it trained nothing the
        consensus lacks) and the consensus overwrites it, never blended, whatever the policy."""
        self._joining = False
        self._initialized = True
        self._open_window(reduce.round + 1)
        return Contribute(
            round=reduce.round,
            kind=reduce.kind,
            via=Via.LINK,
            steps=0,
            weight=0.0,
            tensors=True,
            reset_inner=reduce.reset_inner,
        )

    # ----- the coordinator's messages ------------------------------------------------------------

    def _on_plan(self, plan: m.Plan) -> tuple[RankAction, ...]:
        self._plans.append(_PlanState(plan=plan, batches=flatten(plan.ranges)))
        if len(self._plans) == 1:
            self._open_window(plan.round)
        return ()

    def _on_reduce(self, reduce: m.Reduce) -> tuple[RankAction, ...]:
        if self._readmitted:
            self._reduces.append(reduce)
        return ()

    def _on_epoch(self, msg: m.EpochAggregated) -> tuple[RankAction, ...]:
        metrics = msg.metrics
        self._epochs_seen = max(self._epochs_seen, metrics.epoch)
        self._cohort_batches += metrics.batches
        return (Publish(metrics),)

    def _on_dead(self, msg: m.DeclareDead) -> tuple[RankAction, ...]:
        if msg.dead_rank == self.rank:
            # it got control back (a frozen rank resumed before its KILL): a dead rank is gone for
            # good, and never returns a state the others' consensus moved on from
            return (Stop(f"rank {self.rank} was declared dead: {msg.reason}"),)
        self._lost.add(msg.dead_rank)
        if msg.regroup and self._ended is None:
            # a later loss's re-form replaces one not carried out yet (it names the dead rank too)
            self._regroup = Regroup(ranks=msg.regroup, generation=msg.generation, redo=msg.redo)
        return (NoteLost(msg.dead_rank, msg.reason),)

    def _on_readmitted(self, msg: Readmitted) -> tuple[RankAction, ...]:
        # a peer's restarted process is back (or this one): the world it ends with counts it again
        self._lost.discard(msg.readmitted)
        if msg.readmitted == self.rank:
            self._readmitted = True
        return ()

    def _on_shutdown(self, msg: m.Shutdown) -> tuple[RankAction, ...]:
        if msg.save_reason not in NORMAL_ENDS:
            return (Stop(f"the coordinator stopped the run: {msg.reason}"),)
        self._ended = msg
        return ()

    def _on_reject(self, msg: m.TrainerReject) -> tuple[RankAction, ...]:
        return (Stop(f"the coordinator refused rank {self.rank}: {msg.reason}"),)


# ----- inline ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StopSeen:
    """Inline: the user (or a signal) asked the run to stop after the current batch."""


@dataclass(frozen=True, slots=True)
class Finishing:
    """Inline: the compute side is done and wants the outcome."""


#: What an :class:`InlinePolicy` takes.
InlineEvent = Asked | Stepped | StopSeen | Finishing


class InlinePolicy:
    """Every epoch's batches in order in one process (``n_batches`` a pool): no coordinator."""

    def __init__(
        self,
        *,
        epochs: int,
        n_batches: int,
        start_epoch: int = 0,
        covered: frozenset[int] = frozenset(),
        start_step: int = 0,
    ) -> None:
        """A resumed run starts at ``start_epoch`` (epochs completed), skips that epoch's
        ``covered`` batches (already in the checkpoint) and counts steps from ``start_step``."""
        self._epochs = epochs
        self._n_batches = n_batches
        self._epoch = start_epoch
        self._batch = 0
        self._start_epoch = start_epoch
        self._covered = covered
        self.epochs_completed = start_epoch
        self.global_step = start_step
        self.interrupted = False
        self._handlers: TypeTable[InlineEvent, [], tuple[InlineAction, ...]] = TypeTable(
            "the inline schedule's events"
        )
        self._handlers.add(Asked, self._on_asked)
        self._handlers.add(Stepped, self._on_stepped)
        self._handlers.add(StopSeen, self._on_stop)
        self._handlers.add(Finishing, self._on_finishing)
        self._handlers.require(InlineEvent)

    def handle(self, event: InlineEvent) -> tuple[InlineAction, ...]:
        """Take ``event``; what to do, in order (Asked: ends with :class:`Train` or
        :class:`End`)."""
        return self._handlers(event)

    @property
    def outcome(self) -> Outcome:
        """The run's counters; a stop after the last epoch closed is no interruption."""
        return Outcome(
            epochs_completed=self.epochs_completed,
            global_step=self.global_step,
            world_size=1,
            lost_ranks=(),
            interrupted=self.interrupted and self.epochs_completed < self._epochs,
        )

    def position(self) -> tuple[int, tuple[tuple[int, int], ...]]:
        """What the model holds now, as a checkpoint records it: the epochs completed and the
        batches of the epoch in progress already trained (``(first, count)`` ranges)."""
        if self._batch >= self._n_batches:
            return self._epoch + 1, ()
        done = set(range(self._batch))
        if self._epoch == self._start_epoch:
            done |= self._covered
        return self._epoch, coalesce((b, 1) for b in done)

    @property
    def epoch_closing(self) -> int | None:
        """The epoch the last step trained out, if it did."""
        return self._epoch if self._batch >= self._n_batches else None

    def _on_asked(self, _event: Asked) -> tuple[InlineAction, ...]:
        if self.interrupted:
            return (End(),)
        if self._epoch == self._start_epoch:
            while self._batch < self._n_batches and self._batch in self._covered:
                self._batch += 1  # in the checkpoint this run resumed from
        closed: tuple[InlineAction, ...] = ()
        if self._batch >= self._n_batches:
            closed = (self._close(),)
            self._epoch += 1
            self._batch = 0
        if self._epoch >= self._epochs:
            return (*closed, End())
        progress = self._epoch + self._batch / self._n_batches
        work = Train(epoch=self._epoch, batch=self._batch, plan=self._epoch, progress=progress)
        return (*closed, work)

    def _on_stepped(self, _event: Stepped) -> tuple[InlineAction, ...]:
        self._batch += 1
        self.global_step += 1
        return ()

    def _on_stop(self, _event: StopSeen) -> tuple[InlineAction, ...]:
        self.interrupted = True
        return ()

    def _on_finishing(self, _event: Finishing) -> tuple[InlineAction, ...]:
        trained_out = self._batch >= self._n_batches and self._epoch < self._epochs
        if trained_out and not self.interrupted:
            # the stop came on the epoch's last batch: the epoch is complete
            return (self._close(),)
        return ()

    def _close(self) -> CloseEpoch:
        self.epochs_completed += 1
        return CloseEpoch(self._epoch)
