"""A scripted driver for the pure coordinator: fake ranks that train their plans instantly on a fake clock."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from flodl_async.control.vocab import Tell
from flodl_async.training.coordination import (
    EVERY_RANK,
    Action,
    CollectiveDone,
    CoordinatorConfig,
    DeclareDead,
    Event,
    Fail,
    Finish,
    PublishEpoch,
    RankLost,
    RoundCompleted,
    StartRound,
    TrainerJoined,
    WindowReported,
)
from flodl_async.training.coordinator import Coordinator
from flodl_async.training.metrics import EpochMetrics
from flodl_async.training.modelschema import ModelSchema
from flodl_async.training.policy import Policy
from flodl_async.training.spec import ElCheConfig, TrainerSpec, digest
from flodl_async.wire import messages as m

from .trainerwire import schema_wire


def hello(rank: int, spec: TrainerSpec, *, incarnation: int = 0) -> m.TrainerHello:
    """A rank's TrainerHello for ``spec`` (with its true digest); ``incarnation``: its restart."""
    wire = schema_wire()
    return m.TrainerHello(
        rank=rank,
        spec=spec.to_wire(),
        digest=digest(spec, ModelSchema.from_wire(wire)),
        model=wire,
        model_bytes=36,
        device="cpu",
        incarnation=incarnation,
    )


@dataclass
class Driver:
    """Feeds a coordinator; ranks train each plan at ``ms_per_batch[r]`` and answer every round at once."""

    spec: TrainerSpec
    world: int = 2
    ms_per_batch: tuple[float, ...] = ()
    reduce_ms: float = 2.0  # each round's duration as the reducer (or each rank's ReduceDone) reports it: ElChe's sync_ms
    now: float = 100.0
    max_restarts: int = 0  # the coordinator's: restarted ranks that may rejoin
    coord: Coordinator = field(init=False)
    actions: list[Action] = field(default_factory=list)
    trained: dict[tuple[int, int], list[int]] = field(
        default_factory=lambda: collections.defaultdict(list)
    )  # (epoch, rank) -> batches
    epochs: list[EpochMetrics] = field(default_factory=list)
    rounds: list[StartRound] = field(default_factory=list)
    ended: Finish | Fail | None = None
    pending: collections.deque[Event] = field(default_factory=collections.deque)
    # SYNC: rank -> (epoch, the batches it has yet to train, in order, the round it trains for)
    _sync: dict[int, tuple[int, collections.deque[int], int]] = field(default_factory=dict)
    # SYNC: rank -> the last round it reported a window of (one batch per window, lockstep)
    _sync_reported: dict[int, int] = field(default_factory=dict)
    #: killed ranks (:meth:`kill`): they train nothing more
    dead: set[int] = field(default_factory=set)
    #: epoch -> the batches of every window a consensus holds (a reducer's ``covered`` ranks')
    consensus: dict[int, list[int]] = field(default_factory=lambda: collections.defaultdict(list))
    # (round, rank) -> (epoch, batches): the windows whose contributions were sent
    _sent: dict[tuple[int, int], tuple[int, list[int]]] = field(default_factory=dict)
    #: COLLECTIVE: the process group's re-form generation the fake ranks answer in
    generation: int = 0
    # COLLECTIVE: model round -> the ranks whose windows its all_reduce holds (a redo: survivors')
    _members: dict[int, set[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.ms_per_batch:
            self.ms_per_batch = (1.0,) * self.world
        self.coord = Coordinator(
            CoordinatorConfig(
                run_id="r",
                world_size=self.world,
                hosts={r: f"h{r % 2}" for r in range(self.world)},
                max_restarts=self.max_restarts,
            ),
            now=self.now,
        )

    def feed(self, event: Event) -> list[Action]:
        out = self.coord.handle(event, self.now)
        # The fake ranks answer at once and every timeout is seconds long: whatever the
        # coordinator waits for next (a round's stall, a heartbeat) is still ahead.
        deadline = self.coord.next_deadline(self.now)
        assert deadline is None or deadline > self.now, (deadline, self.now)
        self.now += 0.001
        self.actions.extend(out)
        for action in out:
            self._react(action)
        return out

    def join_all(self) -> None:
        for rank in range(self.world):
            self.feed(TrainerJoined(hello=hello(rank, self.spec)))

    def run(self, limit: int = 100_000) -> None:
        self.join_all()
        self.drain(limit)

    def drain(self, limit: int = 100_000) -> None:
        """Feed what is pending until nothing is (or ``limit`` events)."""
        steps = 0
        while self.pending and steps < limit:
            self.feed(self.pending.popleft())
            steps += 1

    def kill(self, rank: int, *, frames_lost: bool = False, reason: str = "killed") -> list[Action]:
        """``rank`` dies now: its reports not yet delivered are gone, and with ``frames_lost`` the
        contributions it sent for rounds not completed yet too (else they reach the reducer): a
        round being reduced completes without it, as when its frame was cut off or refused."""
        self.dead.add(rank)
        self.pending = collections.deque(
            e for e in self.pending if not (isinstance(e, WindowReported) and e.report.rank == rank)
        )
        if frames_lost:
            started = {r.round for r in self.rounds}
            for key in [k for k in self._sent if k[1] == rank and k[0] not in started]:
                del self._sent[key]
            self.pending = collections.deque(self._without(e, rank) for e in self.pending)
        return self.feed(RankLost(rank=rank, reason=reason))

    def rejoin(self, rank: int, *, incarnation: int = 1) -> list[Action]:
        """``rank``'s agent restarted it: its new process (a fresh fake rank) says hello."""
        self.dead.discard(rank)
        # A rank contributes only to a round already opened: what its old incarnation trained for
        # a round not opened yet never left it.
        started = {r.round for r in self.rounds}
        for key in [k for k in self._sent if k[1] == rank and k[0] not in started]:
            del self._sent[key]
        self._sync.pop(rank, None)
        self._sync_reported.pop(rank, None)
        return self.feed(TrainerJoined(hello=hello(rank, self.spec, incarnation=incarnation)))

    def _without(self, event: Event, rank: int) -> Event:
        """``event``, a round's completion not yet delivered, with ``rank``'s contribution out of
        it (and out of the consensus the round was recorded to hold)."""
        if not isinstance(event, RoundCompleted) or not event.folded or rank not in event.folded:
            return event
        if event.kind == "model":
            epoch, batches = self._sent[(event.round, rank)]
            for batch in batches:
                self.consensus[epoch].remove(batch)
        folded = {r: n for r, n in event.folded.items() if r != rank}
        return dataclasses.replace(event, folded=folded)

    def _window(self, rank: int, round_: int, epoch: int, batches: list[int]) -> None:
        if rank in self.dead:
            return
        self._sent[(round_, rank)] = (epoch, batches)
        self.trained[(epoch, rank)].extend(batches)
        ms = self.ms_per_batch[rank] * len(batches)
        self.pending.append(
            WindowReported(
                report=m.WindowDone(
                    rank=rank,
                    round=round_,
                    epoch=epoch,
                    batches=len(batches),
                    samples=len(batches) * self.spec.batch_size,
                    compute_ms=ms,
                    data_ms=0.0,
                    loss_sum=0.5 * len(batches),
                )
            )
        )

    def _react(self, action: Action) -> None:
        if isinstance(action, Tell):
            # The controller's training shell routes a message by its own rank field (none: every
            # relay), so the coordinator's address must say the same.
            assert action.to == getattr(action.message, "rank", EVERY_RANK), action
        if isinstance(action, Tell) and isinstance(action.message, m.Plan):
            plan = action.message
            batches = [b for first, n in plan.ranges for b in range(first, first + n)]
            if self.spec.policy is Policy.SYNC:
                held = self._sync.get(plan.rank)
                if held is not None and held[0] == plan.epoch:
                    held[1].extend(batches)  # more of this epoch (a dead rank's slice): queued
                else:
                    self._sync[plan.rank] = (plan.epoch, collections.deque(batches), plan.round)
                self._sync_step(plan.rank)
            else:
                self._window(plan.rank, plan.round, plan.epoch, batches)
        elif isinstance(action, StartRound):
            self.rounds.append(action)
            if action.reducer:
                # the reducer folds what reached it from the ranks the round expects
                folded = {
                    r: len(self._sent[(action.round, r)][1])
                    for r in sorted(action.expected)
                    if (action.round, r) in self._sent
                }
                if action.kind == "model":
                    for rank in folded:
                        epoch, batches = self._sent[(action.round, rank)]
                        self.consensus[epoch].extend(batches)
                self.pending.append(
                    RoundCompleted(
                        round=action.round,
                        kind=action.kind,
                        mass=1.0,
                        duration_ms=self.reduce_ms,
                        folded=folded,
                    )
                )
            else:
                if action.kind == "model":
                    self._members[action.round] = set(action.expected)
                self._answer_collective(action.round, action.expected)
            if self.spec.policy is Policy.SYNC and action.kind == "model":
                for rank in list(self._sync):
                    epoch, queue, _round = self._sync[rank]
                    self._sync[rank] = (epoch, queue, action.round + 1)
                    self._sync_step(rank)
        elif isinstance(action, DeclareDead) and action.regroup is not None:
            regroup = action.regroup
            self.generation = regroup.generation
            if regroup.redo >= 0:
                if regroup.redo in self._members:
                    self._members[regroup.redo] = set(regroup.ranks)
                self._answer_collective(regroup.redo, regroup.ranks)
        elif isinstance(action, PublishEpoch):
            self.epochs.append(action.metrics)
        elif isinstance(action, Finish | Fail):
            self.ended = action
            for round_, members in self._members.items():
                for rank in members:
                    if (round_, rank) in self._sent:
                        epoch, batches = self._sent[(round_, rank)]
                        self.consensus[epoch].extend(batches)

    def _answer_collective(self, round_: int, ranks: Iterable[int]) -> None:
        """Each rank's ``ReduceDone`` of ``round_`` in the current generation, pending."""
        for rank in sorted(ranks):
            done = m.ReduceDone(
                rank=rank, round=round_, mass=2.0, ms=self.reduce_ms, generation=self.generation
            )
            self.pending.append(CollectiveDone(message=done))

    def _sync_step(self, rank: int) -> None:
        """Lockstep SYNC: one batch of the slice per window, reported at once."""
        epoch, queue, round_ = self._sync[rank]
        if queue and self._sync_reported.get(rank, -1) < round_ and rank not in self.dead:
            self._sync_reported[rank] = round_
            self._window(rank, round_, epoch, [queue.popleft()])


def plans(actions: list[Action]) -> list[m.Plan]:
    """The plans among ``actions``."""
    return [a.message for a in actions if isinstance(a, Tell) and isinstance(a.message, m.Plan)]


def sent(actions: list[Action], kind: type[m.Message]) -> list[m.Message]:
    """The messages of type ``kind`` among ``actions``."""
    return [a.message for a in actions if isinstance(a, Tell) and isinstance(a.message, kind)]


def replace_spec(spec: TrainerSpec, **changes: object) -> TrainerSpec:
    return dataclasses.replace(spec, **changes)  # type: ignore[arg-type]


def training_block_after_a_kill(reason: str = "killed") -> dict[str, object]:
    """The ``training`` block of ``/state.json`` (as the controller's training shell serves it) of
    a 3-rank CADENCE run on two hosts whose rank 2 (host h0) was lost for ``reason`` in epoch 2."""
    d = Driver(
        TrainerSpec(
            policy=Policy.CADENCE,
            epochs=3,
            batch_size=4,
            dataset_len=64,
            heartbeat_timeout=1000.0,
            elche=ElCheConfig(anchor=2),
        ),
        world=3,
    )
    d.join_all()
    while d.coord.completed_epochs < 1:
        d.feed(d.pending.popleft())
    d.kill(2, reason=reason)
    return {**dataclasses.asdict(d.coord.view(d.now)), "last_epoch": None, "uplinks": []}
