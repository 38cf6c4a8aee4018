"""The controller's Trainer shell: rank control messages into the coordinator, its actions out to
relays and the reducer.

Theory of operation. Nothing here decides anything:
:class:`~flodl_async.training.coordinator.Coordinator`
does. The controller's control-channel handler hands every relay link's frames to
:meth:`TrainingShell.receive` (plus :meth:`bind_rank` on each ``RankHello`` and
:meth:`seen` on each heartbeat). The first ``TrainerHello`` creates the coordinator for
the formed world and the reducer (the DATA channel is served from then on, never in a
run without Trainer ranks); every later frame becomes an event, and the actions come
back and are carried out at once, in order:

* ``Tell`` — a down-message to its rank's relay link, or (``rank = -1``) once to every relay;
* ``StartRound`` — open the round in the reducer, then broadcast its ``Reduce``; a task
  owned by the controller's TaskGroup awaits the round and feeds ``RoundCompleted`` back
  (COLLECTIVE rounds are answered by the ranks' ``ReduceDone`` instead);
* ``DeclareDead`` — the reducer stops waiting on the rank, the relays and ranks learn it;
* ``PublishEpoch`` — the log line, the status page's ``training`` block, the launcher's
  metrics sink, and ``EpochAggregated`` to every relay;
* ``Finish`` / ``Fail`` — handed to the run's supervisor as an event, so the verdict names
  the coordinator's cause (and rank) rather than the exits that follow it.

Deadlines (hello timeout, heartbeat staleness, reduce stall) are the coordinator's
:meth:`~flodl_async.training.coordinator.Coordinator.next_deadline`: the controller's pump sleeps
until the earliest of its own and this one and calls :meth:`tick`. Tensor math never runs
here (the reducer runs it in executor threads); torch is not imported by this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..control.dispatch import TypeTable
from ..control.vocab import LOGGING_LEVELS, Announce, Tell, Tick
from ..errors import ConnectionClosed, FlodlError
from ..net.framed import FramedProtocol
from ..status.events import RunEvent
from ..training import saves
from ..training.coordination import (
    Action,
    CheckpointRequested,
    CollectiveDone,
    CoordinatorConfig,
    CoordinatorView,
    CoordPhase,
    DeclareDead,
    Event,
    Fail,
    Finish,
    FrameSeen,
    PublishEpoch,
    RankExiting,
    RankLost,
    Readmit,
    RoundCompleted,
    SaveCheckpoint,
    StartRound,
    StopRequested,
    TrainerJoined,
    WindowReported,
)
from ..training.coordinator import Coordinator
from ..training.metrics import EpochMetrics
from ..training.modelschema import ModelSchema
from ..training.policy import Backend
from ..training.spec import TrainerSpec
from ..wire import messages as m
from ..wire.restarts import Readmitted
from ..wire.schema import Message
from .bundles import BundleKeeper
from .reducer import Reducer
from .report import RoundTally, epoch_event
from .resumes import Resume, resolve_resume

if TYPE_CHECKING:
    import torch

    from .roundstate import HostUplinkStatistics, ReducerStatistics, Snapshot

log = logging.getLogger("flodl_async.cli.launch")


class RoundResultLike(Protocol):
    """What the reducer reports for a finished round
    (:class:`~flodl_async.controller.roundstate.RoundResult`)."""

    @property
    def round(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def mass(self) -> float: ...
    @property
    def duration_ms(self) -> float: ...
    @property
    def folded(self) -> Mapping[int, int] | None: ...
    @property
    def snapshot(self) -> Snapshot | None: ...


class RoundRunner(Protocol):
    """The controller-side reducer as this shell uses it
    (:class:`~flodl_async.controller.reducer.Reducer`)."""

    def open_round(
        self,
        round: int,
        kind: str,
        expected_ranks: frozenset[int],
        from_controller: bool = False,
        plan: m.RoundPlan | None = None,
        *,
        snapshot: bool = False,
    ) -> None: ...
    async def wait_round(self, round: int) -> RoundResultLike: ...
    def declare_dead(self, rank: int) -> None: ...
    async def snapshot(self) -> Snapshot | None: ...
    def set_initial(
        self, state: Mapping[str, torch.Tensor], outer: Mapping[str, object] | None = None
    ) -> None: ...
    @property
    def last_consensus(self) -> Mapping[str, torch.Tensor] | None: ...
    def statistics(self) -> ReducerStatistics: ...
    async def aclose(self) -> None: ...


#: Builds the reducer once the reference spec, model schema and run digest are known; the last
#: argument is told ``(rank, reason)`` of a rank whose contribution broke its round's plan.
RoundRunnerFactory = Callable[
    [TrainerSpec, ModelSchema, str, Callable[[int, str], None]], RoundRunner
]
#: Serves one DATA-channel link with the reducer (the controller registers it on the mux).
DataServer = Callable[[RoundRunner], None]


def default_round_runner(
    spec: TrainerSpec, schema: ModelSchema, digest: str, on_misbehaved: Callable[[int, str], None]
) -> RoundRunner:
    """The data channel's reducer for this run's spec and model schema."""
    reducer = Reducer(
        schema, spec.outer, spec.settings.gamma, digest=digest, on_misbehaved=on_misbehaved
    )
    return typing.cast(RoundRunner, reducer)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingResult:
    """What the launcher's ``TrainedState`` is built from, after the run: the final
    consensus, the one state every rank ended with."""

    state_dict: Mapping[str, torch.Tensor] | None
    param_names: tuple[str, ...]
    epochs_completed: int
    global_step: int
    world_size: int
    lost_ranks: tuple[int, ...]
    interrupted: bool
    ok: bool
    reason: str
    #: The last checkpoint bundle committed (None: none).
    checkpoint: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingOutcome:
    """What the coordinator concluded, for the supervisor."""

    ok: bool
    reason: str
    rank: int = -1
    details: str = ""
    save_reason: str = ""
    code: int = 0


#: Rank control messages up → the coordinator's events (the wire's table says what is legal).
_UP_EVENTS: Mapping[type[Message], Callable[[Message], Event]] = {
    m.TrainerHello: lambda msg: TrainerJoined(hello=typing.cast(m.TrainerHello, msg)),
    m.WindowDone: lambda msg: WindowReported(report=typing.cast(m.WindowDone, msg)),
    m.ReduceDone: lambda msg: CollectiveDone(message=typing.cast(m.ReduceDone, msg)),
    m.RankGone: lambda msg: RankLost(
        rank=typing.cast(m.RankGone, msg).rank,
        reason=typing.cast(m.RankGone, msg).reason,
        vague=not typing.cast(m.RankGone, msg).refused,
    ),
    m.Exiting: lambda msg: RankExiting(message=typing.cast(m.Exiting, msg)),
    # A stop intent is taken by :meth:`TrainingShell.receive`, a rank-state report by the bundle
    # keeper (and both are signs of life).
    m.Intent: lambda msg: CheckpointRequested(
        reason=f"rank {typing.cast(m.Intent, msg).rank} asked for one"
    ),
    m.RankStateSaved: lambda msg: FrameSeen(rank=typing.cast(m.RankStateSaved, msg).rank),
}


def training_result(
    coordinator: Coordinator | None,
    outcome: TrainingOutcome | None,
    final_state: Mapping[str, torch.Tensor] | None,
    checkpoint: Path | None,
) -> TrainingResult | None:
    """What a run's coordinator, outcome, final consensus and last bundle tell the launcher (None
    when no Trainer ran)."""
    if coordinator is None:
        return None
    hello = coordinator.reference
    return TrainingResult(
        state_dict=final_state,
        param_names=tuple(hello.model.param_names) if hello is not None else (),
        epochs_completed=coordinator.completed_epochs,
        global_step=coordinator.global_step,
        world_size=len(coordinator.alive),
        lost_ranks=tuple(sorted(coordinator.dead)),
        interrupted=outcome is not None and outcome.save_reason == "graceful_shutdown",
        ok=outcome is not None and outcome.ok,
        reason="" if outcome is None else outcome.reason,
        checkpoint=None if checkpoint is None else str(checkpoint),
    )


class TrainingShell:
    """One run's Trainer side of the controller: created with it, idle until a TrainerHello."""

    def __init__(
        self,
        *,
        run_id: str,
        world: Callable[[], tuple[int, Mapping[int, str]]],
        task_group: asyncio.TaskGroup,
        on_outcome: Callable[[TrainingOutcome], None],
        on_change: Callable[[], None] = lambda: None,
        on_start: Callable[[bool], None] = lambda collective: None,
        on_drop: Callable[[int, str], None] = lambda rank, reason: None,
        serve_data: DataServer | None = None,
        round_runner: RoundRunnerFactory = default_round_runner,
        hello_timeout: float = 120.0,
        reduce_stall: float = 120.0,
        timeout_scale: float = 1.0,
        metrics_sink: Callable[[EpochMetrics], None] | None = None,
        reference: TrainerSpec | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_event: Callable[[RunEvent], None] = lambda event: None,
        max_restarts: int = 0,
    ) -> None:
        self._run_id = run_id
        self._world = world
        self._tg = task_group
        self._on_outcome = on_outcome
        self._on_change = on_change
        self._on_start = on_start
        self._on_drop = on_drop
        self._serve_data = serve_data
        self._round_runner = round_runner
        self._hello_timeout = hello_timeout
        self._reduce_stall = reduce_stall
        self._scale = timeout_scale
        self._metrics_sink = metrics_sink
        self._reference = reference
        self._clock = clock
        self._on_event = on_event  # the run's event stream: rounds and epochs
        self._tally = RoundTally()
        self._max_restarts = max_restarts
        self._final_state: Mapping[str, torch.Tensor] | None = None
        self.coordinator: Coordinator | None = None
        self.reducer: RoundRunner | None = None
        self.epochs: list[EpochMetrics] = []
        self._rank_links: dict[int, FramedProtocol] = {}
        self._relay_links: list[FramedProtocol] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._outcome: TrainingOutcome | None = None
        self._carry_out = self._carry_out_table()
        self.bundles: BundleKeeper | None = None
        self._resume: Resume | None = None
        #: checkpoint rounds' consensus copies, by local round, until their bundle is started
        self._snapshots: dict[int, Snapshot | None] = {}

    # ----- what the controller calls --------------------------------------------------------

    @property
    def outcome(self) -> TrainingOutcome | None:
        """The coordinator's conclusion, once given."""
        return self._outcome

    def bind_rank(self, rank: int, link: FramedProtocol) -> None:
        """``rank`` said hello on ``link`` (its host's relay connection): down-messages for it go
        there."""
        self._rank_links[rank] = link
        if link not in self._relay_links:
            self._relay_links.append(link)

    def link_closed(self, link: FramedProtocol) -> None:
        """A relay's connection ended: its ranks are lost to the coordinator (their exits follow
        from the agent)."""
        if link in self._relay_links:
            self._relay_links.remove(link)
        for rank in [r for r, lk in self._rank_links.items() if lk is link]:
            del self._rank_links[rank]
            if self.coordinator is not None:
                self._handle(
                    RankLost(
                        rank=rank,
                        reason="its host's relay connection to the controller closed",
                        vague=True,
                    )
                )

    def rank_lost(self, rank: int, reason: str, *, details: str = "", refines: bool) -> None:
        """The supervisor learnt ``rank`` is lost (its process failed, its host was lost): one
        source of the coordinator's death chain (the first source of a death decides; the others
        find it dead, and ``refines`` says a process's own end may reword its reason)."""
        if self.coordinator is not None:
            self._handle(RankLost(rank=rank, reason=reason, details=details, exit=refines))

    def seen(self, rank: int) -> None:
        """A heartbeat (or any frame) from ``rank``."""
        if self.coordinator is not None:
            self._handle(FrameSeen(rank=rank))

    def receive(self, msg: Message, link: FramedProtocol) -> None:
        """A Trainer control message up from a relay."""
        to_event = _UP_EVENTS.get(type(msg))
        if to_event is None:
            return
        if isinstance(msg, m.TrainerHello):
            self.bind_rank(msg.rank, link)
            if self.coordinator is None and not self._create(msg):
                return
        if self.coordinator is None:
            return  # no Trainer in this run (yet): nothing to coordinate
        if isinstance(msg, m.WindowDone):
            self._tally.window(msg)
        if isinstance(msg, m.Intent) and msg.kind == m.Intent.STOP:
            # one rank's TrainingRun.shutdown() stops the whole run in order, as the launcher's does
            self.stop(f"rank {msg.rank} called TrainingRun.shutdown()")
            return
        if isinstance(msg, m.Intent) and msg.kind != saves.INTENT:
            self._handle(FrameSeen(rank=msg.rank))
            return
        if isinstance(msg, m.RankStateSaved) and self.bundles is not None:
            self.bundles.rank_saved(msg)
        self._handle(to_event(msg))

    def checkpoint(self, reason: str) -> bool:
        """A checkpoint at the next reduce boundary (``run.checkpoint()`` in the launcher); False
        when no training runs."""
        if self.coordinator is None or self._outcome is not None:
            return False
        self._handle(CheckpointRequested(reason=reason))
        return True

    def stop(self, reason: str, *, preempt: bool = False) -> bool:
        """An orderly stop (a launcher signal, ``TrainingRun.shutdown`` in any process): the final
        round, then ``Shutdown``.

        False when there is no training to stop in order (no coordinator, it already concluded, or a
        stop is already under way): the caller's next step is then the supervisor's signal table.
        """
        if self.coordinator is None or self._outcome is not None or self.coordinator.stop_requested:
            return False
        self._handle(StopRequested(reason=reason, preempt=preempt))
        return True

    def next_deadline(self) -> float | None:
        """When :meth:`tick` is due (None: nothing pending)."""
        return None if self.coordinator is None else self.coordinator.next_deadline(self._clock())

    def tick(self) -> None:
        """The coordinator's deadline passed."""
        if self.coordinator is not None:
            self._handle(Tick())

    def view(self) -> CoordinatorView | None:
        """The coordinator's frozen snapshot."""
        return None if self.coordinator is None else self.coordinator.view(self._clock())

    def status(self) -> dict[str, object] | None:
        """The ``training`` block of ``/state.json`` (None until a Trainer said hello)."""
        view = self.view()
        if view is None:
            return None
        block = dataclasses.asdict(view)
        block["last_epoch"] = dataclasses.asdict(self.epochs[-1]) if self.epochs else None
        block["uplinks"] = [dataclasses.asdict(u) for u in self.uplinks()]
        return block

    def uplinks(self) -> tuple[HostUplinkStatistics, ...]:
        """What each host's relay sent the reducer so far, and by which path (a test's round seam
        keeps none)."""
        return () if self.reducer is None else self.reducer.statistics().uplinks

    async def aclose(self) -> None:
        """Let the checkpoint bundles under way finish, cancel the round waiters, then close the
        reducer (its driver task and hosts' data links)."""
        if self.bundles is not None:
            await self.bundles.drain(self._reduce_stall)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        try:
            if tasks:
                # asyncio.wait, not ``suppress(CancelledError)`` around each await: that would also
                # swallow a
                # cancellation of aclose itself. The task group still sees each task's own outcome.
                await asyncio.wait(tasks)
        finally:
            await self._close_reducer()

    async def _close_reducer(self) -> None:
        reducer = self.reducer
        # which host's contributions came over the port and which in memory, for the log
        for uplink in self.uplinks():
            log.debug("training data: %s", uplink.summary())
        if reducer is not None:
            # The launcher's final state (the last consensus): copied off the loop (clones),
            # before the reducer lets its buffers go.
            self._final_state = await asyncio.get_running_loop().run_in_executor(
                None, lambda: reducer.last_consensus
            )
            await reducer.aclose()

    def result(self) -> TrainingResult | None:
        """The run's result for the launcher (None when no Trainer ran)."""
        last = None if self.bundles is None else self.bundles.last
        return training_result(self.coordinator, self._outcome, self._final_state, last)

    # ----- internals ---------------------------------------------------------------------

    def _create(self, hello: m.TrainerHello) -> bool:
        world_size, hosts = self._world()
        if world_size < 1:
            log.warning(
                "a TrainerHello from rank %d arrived before the world formed; ignoring it",
                hello.rank,
            )
            return False
        try:
            # before any rank trains: a bundle that cannot be resumed ends the run here (exit 2)
            spread = () if self._reference is not None else hosts.values()  # launcher: said it
            self._resume = resolve_resume(hello, world_size=world_size, hosts=spread)
        except FlodlError as exc:  # the verdict says it, once
            self._conclude(TrainingOutcome(ok=False, reason=str(exc), code=2))
            return False
        # a COLLECTIVE joiner would need the re-formed group to take it in: not built, so none
        # rejoins (the supervisor restarts none either, and says so)
        collective = hello.spec.backend == Backend.COLLECTIVE.value
        self.coordinator = Coordinator(
            CoordinatorConfig(
                run_id=self._run_id,
                world_size=world_size,
                hosts=dict(hosts),
                hello_timeout=self._hello_timeout,
                reduce_stall=self._reduce_stall,
                timeout_scale=self._scale,
                reference=self._reference,
                resume=None if self._resume is None else self._resume.point,
                max_restarts=0 if collective else self._max_restarts,
            ),
            now=self._clock(),
        )
        self._on_start(collective)
        return True

    def _handle(self, event: Event) -> None:
        coordinator = self.coordinator
        assert coordinator is not None
        committed = coordinator.committed
        actions = coordinator.handle(event, self._clock())
        if coordinator.committed is not committed and coordinator.committed is not None:
            done = coordinator.committed
            if isinstance(event, CollectiveDone):
                # an all_reduce's consensus, as the reducer's rounds are logged
                log.debug("round %d (%s) committed in %.1f ms", *done)
            self._on_event(self._tally.committed(*done))
        needs_reducer = (
            coordinator.spec is not None
            and self.reducer is None
            and coordinator.phase is not CoordPhase.FAILED
        )
        if needs_reducer and not self._start_reducer(coordinator):
            return
        for action in actions:
            self._carry_out(action)
        self._on_change()

    def _start_reducer(self, coordinator: Coordinator) -> bool:
        spec, hello = coordinator.spec, coordinator.reference
        assert spec is not None
        assert hello is not None
        try:
            self.reducer = self._round_runner(
                spec, ModelSchema.from_wire(hello.model), hello.digest, self._misbehaved
            )
        except FlodlError as exc:
            self._conclude(TrainingOutcome(ok=False, reason=str(exc), code=1))
            return False
        resume = self._resume
        if resume is not None:
            # the consensus every rank starts from, and the outer optimizer's momentum
            self.reducer.set_initial(resume.state_dict, resume.outer)
        if spec.checkpoint.save_path is not None:
            self.bundles = BundleKeeper(
                run_id=self._run_id,
                spec=spec,
                hello=hello,
                task_group=self._tg,
                rank_wait=self._reduce_stall,
            )
        if self._serve_data is not None:
            self._serve_data(self.reducer)
        return True

    def _misbehaved(self, rank: int, reason: str) -> None:
        """The reducer caught ``rank`` breaking its round's plan: a rank that lies is a rank that
        failed. Taken on the loop's next turn, outside the reducer's own call (the death chain
        calls back into the reducer)."""
        asyncio.get_running_loop().call_soon(self._handle, RankLost(rank=rank, reason=reason))

    def _carry_out_table(self) -> TypeTable[Action, [], None]:
        """Which method carries out each coordinator action."""
        table: TypeTable[Action, [], None] = TypeTable("the Trainer shell's coordinator actions")
        table.add(Tell, self._tell)
        table.add(StartRound, self._start_round)
        table.add(DeclareDead, self._declare_dead)
        table.add(Readmit, self._readmit)
        table.add(PublishEpoch, self._publish_epoch)
        table.add(Announce, self._announce)
        table.add(Finish, self._finish)
        table.add(Fail, self._fail)
        table.add(SaveCheckpoint, self._save_checkpoint)
        table.require(Action)
        return table

    def _tell(self, action: Tell[int]) -> None:
        msg = action.message
        self._send(msg)

    def _start_round(self, action: StartRound) -> None:
        message = action.message
        if action.checkpoint and self.bundles is not None:
            name = self.bundles.mark(action.bundle_round, action.checkpoint)
            message = dataclasses.replace(message, checkpoint_name=name)
        if action.reducer:
            reducer = self.reducer
            assert reducer is not None
            reducer.open_round(
                action.round,
                action.kind,
                action.expected,
                action.from_controller,
                plan=message.plan,
                snapshot=bool(action.checkpoint),
            )
            task = self._tg.create_task(
                self._await_round(reducer, action.round), name=f"training-round-{action.round}"
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._send(message)

    def _save_checkpoint(self, action: SaveCheckpoint) -> None:
        if self.bundles is not None and self.reducer is not None:
            snapshot = None if action.last else self._snapshots.pop(action.round, None)
            self.bundles.save(action, snapshot, self.reducer.snapshot if action.last else None)

    def _declare_dead(self, action: DeclareDead) -> None:
        if self.bundles is not None:
            self.bundles.rank_lost(action.rank)
        if self.reducer is not None:
            self.reducer.declare_dead(action.rank)
        regroup = action.regroup
        if regroup is None:
            self._send(m.DeclareDead(dead_rank=action.rank, reason=action.reason))
        else:
            said = m.DeclareDead(
                dead_rank=action.rank,
                reason=action.reason,
                regroup=regroup.ranks,
                generation=regroup.generation,
                redo=regroup.redo,
            )
            self._send(said)
        self._on_drop(action.rank, action.reason)

    def _readmit(self, action: Readmit) -> None:
        # A restarted rank is back at a round boundary: the relays (their host fold) and the ranks
        # learn it before the round that counts it opens (the reducer, from that round's expected).
        self._send(
            Readmitted(readmitted=action.rank, incarnation=action.incarnation, round=action.round)
        )

    def _publish_epoch(self, action: PublishEpoch) -> None:
        self._publish(action.metrics)

    def _announce(self, action: Announce) -> None:
        log.log(LOGGING_LEVELS[action.level], "%s", action.text)

    def _finish(self, action: Finish) -> None:
        self._conclude(
            TrainingOutcome(ok=True, reason=action.reason, save_reason=action.save_reason)
        )

    def _fail(self, action: Fail) -> None:
        self._conclude(
            TrainingOutcome(
                ok=False,
                reason=action.reason,
                rank=action.rank,
                details=action.details,
                save_reason=action.save_reason,
                code=int(action.code),
            )
        )

    def _conclude(self, outcome: TrainingOutcome) -> None:
        if self._outcome is None:
            self._outcome = outcome
            self._on_outcome(outcome)

    def _publish(self, metrics: EpochMetrics) -> None:
        spec = self.coordinator.spec if self.coordinator is not None else None
        self.epochs.append(metrics)
        log.info(
            "%s", metrics.summary(spec.epochs if spec is not None else 0, len(metrics.per_rank))
        )
        if self._metrics_sink is not None:
            self._metrics_sink(metrics)
        self._on_event(epoch_event(metrics, spec.epochs if spec is not None else 0))
        self._send(m.EpochAggregated(metrics=metrics))

    def _send(self, msg: Message) -> None:
        rank = getattr(msg, "rank", -1)
        links = (
            list(self._relay_links)
            if rank == -1
            else [lk for lk in (self._rank_links.get(rank),) if lk is not None]
        )
        for link in links:
            # a link that just died: its handler reports it
            with contextlib.suppress(ConnectionClosed):
                link.send(msg)

    async def _await_round(self, reducer: RoundRunner, round_: int) -> None:
        result = await reducer.wait_round(round_)
        # The moment a consensus exists, as a timed record (benchmarks/recovery.py reads it).
        log.debug(
            "round %d (%s) committed in %.1f ms", result.round, result.kind, result.duration_ms
        )
        snapshot = getattr(result, "snapshot", None)  # a test's round runner may not have it
        if snapshot is not None:
            self._snapshots[result.round] = snapshot
        if self.coordinator is not None:
            self._handle(
                RoundCompleted(
                    round=result.round,
                    kind=result.kind,
                    mass=result.mass,
                    duration_ms=result.duration_ms,
                    folded=result.folded,
                )
            )
