"""The Trainer's coordinator: a pure state machine on the control channel.

Theory of operation. h11-shaped: the controller's training shell feeds
:meth:`Coordinator.handle` every event that matters (a rank's ``TrainerHello``, a window
report, any frame seen from a rank, a rank lost, a round completed, a stop request, a
deadline passed) with ``now`` (monotonic seconds) and carries out the returned actions in
order; it calls again with :class:`~flodl_async.control.vocab.Tick` at
:meth:`Coordinator.next_deadline`. Nothing here reads a clock, touches a socket or imports
torch. Its configuration, phases, events, actions and status view are declared in
:mod:`flodl_async.training.coordination`.

Phases::

    JOINING ──all hellos──▶ INIT ──round 0 done──▶ TRAINING ──last epoch closed──▶ FINAL ──▶ DONE
       │                     │                      │   └──stop──▶ STOPPING ──in-flight done──┘
       └── mismatch, hello timeout, a rank lost, a stall ─────────────────────────────▶ FAILED

* JOINING: the first ``TrainerHello`` fixes the reference spec and digest; every other
  must match (``TrainerReject`` and a verdict naming the rank and the first differing
  field otherwise), and every rank of the world must say hello within ``hello_timeout``
  of the first. Each valid hello is welcomed at once.
* INIT: ``Reduce(0, init)`` (the root's state becomes everyone's) and the kickoff plans of
  epoch 0 go out together.
* TRAINING, one window at a time: plans → ``WindowDone`` reports → the count-based gate
  (:func:`~flodl_async.training.policy.should_reduce`) → ElChe's report → ``Reduce(k)`` with the
  plans of window ``k+1`` (ASYNC: a rank's next plan as soon as its report arrives, while
  its epoch's pool lasts). The reduce of the window that drained an epoch's pool closes
  the epoch: its metrics are published when that round completes. Windows never span
  epochs.
* FINAL: ``Reduce(final)`` — from the controller's held consensus when nobody stepped
  since the last reduce (SYNC/CADENCE natural end), else contributed by every alive rank;
  COLLECTIVE then uploads its lowest alive rank's state (``upload``). Then ``Shutdown``.
* A rank lost (relay ``RankGone``, a death record, a non-zero exit, heartbeat staleness)
  runs the death chain, once per rank (the first source decides, the others find it dead): mark
  it dead with its reason; return its batches not yet in a consensus to the pool (the window of a
  round being reduced as it died waits for that round's result: the consensus may hold it);
  :func:`~flodl_async.training.policy.unrecoverable_reason` — ``max_failure`` reached (exit 5,
  naming every dead rank), every rank lost (exit 4) — or else the survivors train on:
  ``DeclareDead`` (the reducer, the relays and the survivors stop waiting on it; a COLLECTIVE
  world's survivors re-form their process group, :mod:`~flodl_async.training.regroup`), the gate,
  ElChe and the epoch's ledger drop it, the next windows take its batches, and the end says
  ``DEGRADED`` with the ranks lost.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..control.dispatch import TypeTable
from ..control.vocab import Announce, Tell, Tick
from ..verdict import ExitCode
from ..wire import messages as m
from . import deathchain as dc
from . import partition as part
from . import plancheck, rounds
from .coordination import (
    EVERY_RANK,
    Action,
    BeforeHello,
    CheckpointRequested,
    CollectiveDone,
    CoordinatorConfig,
    CoordinatorView,
    CoordPhase,
    DeclareDead,
    Event,
    Fail,
    FrameSeen,
    Joining,
    PublishEpoch,
    RankExiting,
    RankLost,
    Readmit,
    RoundCompleted,
    Running,
    Stage,
    StartRound,
    StopRequested,
    TrainerJoined,
    WindowReported,
    coordinator_view,
    sender,
)
from .elche import ElChe, ElCheState
from .hellocheck import check_hello
from .losses import LostRanks
from .metrics import EpochLedger
from .policy import RULES, Backend, GateRank, Policy, should_reduce
from .regroup import InFlight
from .rejoin import Rejoins
from .savedesk import SaveDesk
from .slices import SyncSlices, epoch_slices, plan_hold_after, sync_plan
from .spec import TrainerSpec

# ----- the machine ---------------------------------------------------------------------------

_OVER = (CoordPhase.DONE, CoordPhase.FAILED)


class Coordinator:
    """One training run's decisions; pure, ``now`` passed in."""

    def __init__(self, config: CoordinatorConfig, *, now: float) -> None:
        if config.world_size < 1:
            raise ValueError(f"a training world needs at least one rank, got {config.world_size}")
        # Every deadline starts at a hello, so the machine reads no time before the first one;
        # ``now`` keeps the constructor shaped like the supervisor's.
        del now
        self.config = config
        self.phase = CoordPhase.JOINING
        self._stage: Stage = BeforeHello()
        self._joined: set[int] = set()
        self._alive: set[int] = set()
        # why each dead rank was lost, and in which epoch (for the verdict)
        self._lost = LostRanks(self._host)
        self._exiting: set[int] = set()
        self._last_seen: dict[int, float] = {}
        self._round = 1  # the window being gathered; round 0 is INIT
        self._reports: dict[int, dict[int, m.WindowDone]] = {}
        self._plans: dict[tuple[int, int], m.Plan] = {}
        self._planned_round: dict[int, int] = {}
        self._slices = SyncSlices()
        self._in_flight: InFlight | None = None
        self._epoch = 0
        self._pool = part.ChunkPool(0)
        self._epoch_last_round = 0
        self._ledgers: dict[int, EpochLedger] = {}
        self._round_epoch: dict[int, int] = {}
        self._completed_epochs = 0
        self._last_sync_ms = 0.0
        self._batches: dict[int, int] = {}
        self._stop_reason: str | None = None
        self._generation = 0  # a COLLECTIVE world's process group re-forms
        self._rejoins = Rejoins(config.max_restarts)
        # admitted joiners whose first round is not open yet: the gate does not wait for them
        self._warming: set[int] = set()
        self._desk = SaveDesk(config.resume, world_size=config.world_size)
        #: The last round committed: its number, kind and duration (ms).
        self.committed: tuple[int, str, float] | None = None
        self._handlers: TypeTable[Event, [float], list[Action]] = TypeTable(
            "the coordinator's events"
        )
        self._handlers.add(TrainerJoined, self._on_joined)
        self._handlers.add(WindowReported, self._on_window)
        self._handlers.add(FrameSeen, self._on_frame)
        self._handlers.add(RankLost, self._on_lost)
        self._handlers.add(RankExiting, self._on_exiting)
        self._handlers.add(RoundCompleted, self._on_round_completed)
        self._handlers.add(CollectiveDone, self._on_collective_done)
        self._handlers.add(StopRequested, self._on_stop)
        self._handlers.add(
            CheckpointRequested,
            lambda e, now: self._desk.request(e.reason, phase=self.phase, spec=self.spec),
        )
        self._handlers.add(Tick, self._on_tick)
        self._handlers.require(Event)

    # ----- queries ----------------------------------------------------------------------------

    @property
    def spec(self) -> TrainerSpec | None:
        """The reference spec (after the first valid hello)."""
        return None if isinstance(self._stage, BeforeHello) else self._stage.spec

    @property
    def reference(self) -> m.TrainerHello | None:
        """The hello that fixed the run's spec, schema and digest."""
        return None if isinstance(self._stage, BeforeHello) else self._stage.reference

    @property
    def alive(self) -> frozenset[int]:
        """Ranks that joined and are not lost."""
        return frozenset(self._alive)

    @property
    def completed_epochs(self) -> int:
        """Epochs closed so far."""
        return self._completed_epochs

    @property
    def stop_requested(self) -> bool:
        """An orderly stop was asked for (a second request changes nothing)."""
        return self._stop_reason is not None

    @property
    def restarted(self) -> tuple[int, ...]:
        """The ranks restarted and rejoined, once per restart, in order."""
        return tuple(r.rank for r in self._rejoins.restarts)

    @property
    def dead(self) -> frozenset[int]:
        """Ranks lost so far."""
        return self._lost.ranks

    @property
    def global_step(self) -> int:
        """Cohort batches trained, divided by the world size: what an average rank trained."""
        return self._desk.book.step_base + sum(self._batches.values()) // self.config.world_size

    def _heartbeat_timeout(self) -> float | None:
        spec = self.spec
        return None if spec is None else spec.heartbeat_timeout * self.config.timeout_scale

    def next_deadline(self, now: float) -> float | None:
        """When to call again with :class:`Tick` if nothing else happens (None: no deadline)."""
        del now  # deadlines are absolute; kept for the h11 shape
        if self.phase in _OVER:
            return None
        stage, flying = self._stage, self._in_flight
        return dc.next_deadline(
            hello=stage.first_hello_at + self.config.hello_timeout
            if isinstance(stage, Joining)
            else None,
            heartbeat=self._heartbeat_timeout(),
            last_seen={r: self._last_seen[r] for r in self._alive - self._exiting},
            stall=None if flying is None else flying.started_at + self.config.reduce_stall,
        )

    def view(self, now: float) -> CoordinatorView:
        """What the status page shows of training."""
        return coordinator_view(
            self.config,
            phase=self.phase,
            epoch=self._completed_epochs,
            spec=self.spec,
            elche=self._stage.elche if isinstance(self._stage, Running) else None,
            last_reduce_ms=self._last_sync_ms,
            lost=self._lost.why(),
            exiting=frozenset(self._exiting),
            alive=frozenset(self._alive),
            last_seen=self._last_seen,
            batches=self._batches,
            now=now,
        )

    # ----- the one entry point ------------------------------------------------------------------

    def handle(self, event: Event, now: float) -> list[Action]:
        """Take one event; return what the shell must do, in order."""
        rank = sender(event)
        if rank is not None and rank in self._joined:
            self._last_seen[rank] = max(self._last_seen.get(rank, now), now)
        if self.phase in _OVER and not isinstance(event, TrainerJoined):
            return []
        return self._handlers(event, now)

    # ----- joining ------------------------------------------------------------------------------

    def _host(self, rank: int) -> str:
        host = self.config.hosts.get(rank)
        return f"host {host}" if host else "its host"

    def _on_joined(self, event: TrainerJoined, now: float) -> list[Action]:
        hello = event.hello
        rank = hello.rank
        if rank in self._joined:
            if hello.incarnation == 0:
                return [dc.warning(f"rank {rank} said TrainerHello twice; ignoring the second")]
            return self._on_rejoin(hello, now)
        if self.phase is not CoordPhase.JOINING:
            return [dc.reject(rank, "this run's Trainer already started without it")]
        if not 0 <= rank < self.config.world_size:
            return [
                dc.reject(rank, f"rank {rank} is not in this world of {self.config.world_size}")
            ]
        stage = self._stage
        checked = check_hello(
            hello,
            host=self._host(rank),
            launcher=self.config.reference,
            reference=None if isinstance(stage, BeforeHello) else (stage.reference, stage.spec),
        )
        if isinstance(checked, str):
            return self._fail_before_init(rank, checked)
        if isinstance(self._stage, BeforeHello):
            self._stage = Joining(reference=hello, spec=checked, first_hello_at=now)
        self._joined.add(rank)
        self._alive.add(rank)
        self._last_seen[rank] = now
        self._rejoins.joined(hello)
        actions: list[Action] = [rounds.welcome(rank, self.config)]
        if len(self._joined) == self.config.world_size:
            actions.extend(self._start(now))
        return actions

    # ----- rejoining (:mod:`.rejoin`) ------------------------------------------------------------

    def _on_rejoin(self, hello: m.TrainerHello, now: float) -> list[Action]:
        """A restarted rank's hello: refused, or welcomed and admitted at the next round
        boundary."""
        rank = hello.rank
        stage = self._stage
        open_ = self.phase in (CoordPhase.INIT, CoordPhase.TRAINING) and self._stop_reason is None
        why = self._rejoins.refusal(hello, dead=rank in self._lost, open_=open_)
        if why is None and isinstance(stage, Running):
            checked = check_hello(
                hello,
                host=self._host(rank),
                launcher=self.config.reference,
                reference=(stage.reference, stage.spec),
            )
            why = checked if isinstance(checked, str) else None
        if why is not None:
            return [dc.warning(f"restarted rank {rank} cannot rejoin: {why}"), dc.reject(rank, why)]
        self._rejoins.wait(hello)
        self._last_seen[rank] = now
        actions: list[Action] = [
            rounds.welcome(rank, self.config),
            Announce(
                text=f"rank {rank} restarted (incarnation {hello.incarnation}) said hello; it "
                "rejoins at the next round boundary"
            ),
        ]
        if self.phase is CoordPhase.TRAINING and self._in_flight is None:
            actions.extend(self._admit())
        return actions

    def _admit(self) -> list[Action]:
        """At a round boundary (no round in flight): every waiting joiner is alive again. Its
        first round is the next one opened (its warm start); until then the gate does not wait
        for it and no plan names it, so its first window is the one planned with that round."""
        actions: list[Action] = []
        for rank in self._rejoins.pending:
            restart = self._rejoins.admit(rank, round_=self._round, reason=self._lost.revive(rank))
            self._alive.add(rank)
            self._exiting.discard(rank)
            self._warming.add(rank)
            self._planned_round.pop(rank, None)
            for reports in self._reports.values():
                reports.pop(rank, None)  # the dead incarnation's, never reduced
            n = len(self._rejoins.restarts)
            actions.append(Readmit(rank=rank, incarnation=restart.incarnation, round=self._round))
            actions.append(
                Announce(
                    text=f"rank {rank} restarted ({n} of {self._rejoins.max_restarts}) and "
                    f"rejoined at round {self._round}"
                )
            )
        return actions

    def _fail_before_init(self, rank: int, reason: str) -> list[Action]:
        return [dc.reject(rank, reason), *self._fail(ExitCode.FORMATION, reason, rank=rank)]

    def _fail(
        self, code: ExitCode, reason: str, *, rank: int = -1, save_reason: str = ""
    ) -> list[Action]:
        """The coordinator's own finding ends the run: say it, shut every rank down, name it."""
        self.phase = CoordPhase.FAILED
        return [
            dc.warning(reason),
            Tell(to=EVERY_RANK, message=m.Shutdown(reason=reason, save_reason=save_reason)),
            Fail(code=code, reason=reason, rank=rank, save_reason=save_reason),
        ]

    def _running(self) -> Running:
        if not isinstance(self._stage, Running):
            raise RuntimeError(f"the coordinator is {self.phase.value}, not training")
        return self._stage

    def _require_spec(self) -> TrainerSpec:
        return self._running().spec

    def _start(self, now: float) -> list[Action]:
        joining = self._stage
        assert isinstance(joining, Joining)  # every rank said hello
        spec = joining.spec
        self.phase = CoordPhase.INIT
        self._stage = Running(
            reference=joining.reference,
            spec=spec,
            elche=ElChe(
                self.config.world_size,
                spec.settings,
                batches_per_epoch=spec.n_batches,
                growth=spec.policy is not Policy.SYNC,
                dispatch=RULES[spec.policy].elche_dispatch,
            ),
        )
        self._desk.start(spec, now)
        resume = self.config.resume
        named = f" {spec.name!r}" if spec.name else ""
        said = f"training{named}: {self.config.world_size} rank(s), {spec.policy.name} on "
        said += f"{spec.backend.name}, {spec.epochs} x {spec.n_batches} batches"
        if resume is not None:  # every rank starts from the bundle's consensus, which we hold
            said += f"; resuming from {resume.bundle} (round {resume.round}, {resume.epoch} done)"
            self._completed_epochs = resume.epoch
            if resume.elche is not None:
                self._stage.elche.restore(resume.elche)
        actions: list[Action] = [
            Announce(text=said),
            self._start_round(0, "init", now),
        ]
        epoch, covered = (0, ()) if resume is None else (resume.epoch, resume.coverage)
        if epoch < spec.epochs:
            actions.extend(self._open_epoch(epoch, now, covered=covered))
        return actions

    # ----- rounds -------------------------------------------------------------------------------

    def _start_round(
        self,
        round_: int,
        kind: str,
        now: float,
        *,
        from_controller: bool = False,
        closes_epoch: int | None = None,
        checkpoint: str | None = None,
    ) -> StartRound:
        spec = self._require_spec()
        self._warming.clear()  # this round is their warm start
        claimable = (
            self._slices.claimable()
            if RULES[spec.policy].static_slices
            else plancheck.in_flight_batches(self._pool.in_flight())
        )
        self._slices.round_opened()
        self._in_flight, start = rounds.open_round(
            spec,
            round_=round_,
            kind=kind,
            now=now,
            config=self.config,
            alive=frozenset(self._alive),
            claimable=claimable,
            from_controller=from_controller,
            closes_epoch=closes_epoch,
            checkpoint=checkpoint,
            bundle_round=0 if checkpoint is None else self._desk.mark(round_, checkpoint),
        )
        return start

    def _on_round_completed(self, event: RoundCompleted, now: float) -> list[Action]:
        flying = self._in_flight
        if flying is None or flying.round != event.round or flying.collective:
            return [
                dc.warning(
                    f"round {event.round} ({event.kind}) completed, but it is not the round in "
                    "flight; ignoring"
                )
            ]
        return self._round_done(flying, event.duration_ms, now, event.folded)

    def _on_collective_done(self, event: CollectiveDone, now: float) -> list[Action]:
        msg = event.message
        flying = self._in_flight
        if (
            flying is None
            or not flying.collective
            or flying.round != msg.round
            or msg.generation != self._generation  # the old group's, before a redo
            or msg.rank not in flying.waiting
        ):
            return []
        flying.waiting.discard(msg.rank)
        flying.ms = max(flying.ms, msg.ms)
        if flying.waiting:
            return []
        return self._round_done(flying, flying.ms, now)

    def _round_done(
        self,
        flying: InFlight,
        duration_ms: float,
        now: float,
        folded: Mapping[int, int] | None = None,
    ) -> list[Action]:
        # A consensus' mass matters to the ranks (0: keep local state), not to the schedule.
        self._in_flight = None
        self.committed = (flying.round, flying.kind, duration_ms)
        self._last_sync_ms = duration_ms
        actions: list[Action] = []
        if flying.kind == "init":
            if self.phase is CoordPhase.INIT:
                self.phase = CoordPhase.TRAINING
            if self._stop_reason is not None:
                return self._final(now, natural=False)
            if self._completed_epochs >= self._require_spec().epochs:
                return self._final(now, natural=True)  # resumed from a bundle of the last epoch
            return [*self._admit(), *self._maybe_reduce(now)]
        if flying.kind == "model":
            self._desk.book.last_model_round = flying.round
            actions.extend(self._settle_coverage(flying.round, folded, flying.dead_in))
            ledger = self._ledgers.get(self._round_epoch.pop(flying.round, self._epoch))
            if ledger is not None:
                ledger.add_reduce(duration_ms)
            spec = self._require_spec()
            closing = flying.closes_epoch
            if closing is not None and not self._epoch_covered():
                # a rank died before its last windows reached this consensus: the survivors
                # train them, and a later round closes the epoch (SYNC's shares are planned above;
                # the pool's batches go to the ranks the closing round left without a window)
                closing = None
                if not RULES[spec.policy].static_slices:
                    actions.extend(self._plan_waiting(self._round))
            if closing is not None:
                actions.extend(self._close_epoch(closing, now))
            actions.extend(self._desk.committed(flying.round, self._facts))
            if self._completed_epochs >= spec.epochs:
                actions.extend(self._final(now, natural=True))
            elif self._stop_reason is not None:
                actions.extend(self._final(now, natural=False))
            elif closing is not None:
                actions.extend(self._admit())
                actions.extend(self._open_epoch(closing + 1, now))
            else:
                actions.extend(self._admit())
                actions.extend(self._maybe_reduce(now))
            return actions
        spec = self._require_spec()
        if flying.kind == "final" and spec.backend is Backend.COLLECTIVE:
            return [self._start_round(self._next_round(), "upload", now)]
        return [*self._desk.committed(flying.round, self._facts), *self._finish()]

    def _settle_coverage(
        self, round_: int, folded: Mapping[int, int] | None, dead_in: set[int]
    ) -> list[Action]:
        """Round ``round_``'s consensus holds ``folded``'s contributions: those windows are covered;
        a dead rank's window it lacks goes back to the survivors (CADENCE/ASYNC: to the pool; SYNC:
        the rest of the dead rank's slice, shared out now). ``folded`` None (an all_reduce, or a
        round runner that does not say): what every alive rank reported is in, and ``dead_in``'s
        (lost after every survivor finished the all_reduce), no other dead rank's."""
        spec = self._require_spec()
        if RULES[spec.policy].static_slices:
            if folded is None:
                self._slices.settle_reported(self._alive | dead_in)
            else:
                self._slices.settle(folded)
            return self._share_dead_slices()
        for rank in sorted(self._lost.ranks - dead_in):
            if folded is None or rank not in folded:
                self._pool.forfeit_window(rank, round_)
        self._pool.complete_round(round_)
        return []

    def _epoch_covered(self) -> bool:
        """Every batch of the epoch is in a consensus."""
        spec = self._require_spec()
        if RULES[spec.policy].static_slices:
            return self._slices.covered
        return self._pool.complete

    def _share_dead_slices(self) -> list[Action]:
        """SYNC: what of each dead rank's slice no consensus holds goes, in order, to the survivors
        (a plan each, queued after what they hold)."""
        spec = self._require_spec()
        actions: list[Action] = []
        for rank, share in self._slices.share_dead(self._lost.ranks, sorted(self._alive)):
            plan = sync_plan(spec, rank=rank, round_=self._round, epoch=self._epoch, ranges=share)
            actions.append(Tell(to=rank, message=plan))
        return actions

    def _next_round(self) -> int:
        round_ = self._round
        self._round += 1
        return round_

    def _close_epoch(self, epoch: int, now: float) -> list[Action]:
        ledger = self._ledgers.pop(epoch, None)
        if ledger is None:
            return []
        elche = self._running().elche
        metrics = ledger.close(
            now=now, anchor=elche.anchor, counts=elche.counts, alive=frozenset(self._alive)
        )
        self._completed_epochs += 1
        return [PublishEpoch(metrics=metrics)]

    def _final(self, now: float, *, natural: bool) -> list[Action]:
        spec = self._require_spec()
        self.phase = CoordPhase.FINAL
        # Natural end under SYNC/CADENCE: every rank is held at its last reduce, so the consensus
        # the controller holds is final as it is. ASYNC locals deliberately differ: they contribute.
        from_controller = natural and spec.policy is not Policy.ASYNC
        if spec.backend is Backend.COLLECTIVE and from_controller:
            return [self._start_round(self._next_round(), "upload", now)]
        reason = self._desk.final_reason(
            natural=natural,
            from_controller=from_controller,
            on_shutdown=spec.checkpoint.on_shutdown,
        )
        return [
            self._start_round(
                self._next_round(), "final", now, from_controller=from_controller, checkpoint=reason
            )
        ]

    def _finish(self) -> list[Action]:
        self.phase = CoordPhase.DONE
        return rounds.finish(
            self._require_spec(),
            stop_reason=self._stop_reason,
            completed_epochs=self._completed_epochs,
            alive=len(self._alive),
            world_size=self.config.world_size,
            lost=self._lost,
            rejoins=self._rejoins,
        )

    # ----- epochs and plans ------------------------------------------------------------------

    def _open_epoch(
        self, epoch: int, now: float, *, covered: tuple[part.Range, ...] = ()
    ) -> list[Action]:
        """Plans of the first window of ``epoch`` (round ``self._round``); ``covered``: batches a
        resumed consensus already holds, which are not trained again."""
        spec = self._require_spec()
        self._epoch = epoch
        self._ledgers[epoch] = EpochLedger(epoch, ranks=sorted(self._alive), started_at=now)
        # a joiner's first window comes after its first round (its warm start)
        planned = sorted(self._alive - self._warming)
        if RULES[spec.policy].static_slices:
            self._pool = part.ChunkPool(0)
            slices = epoch_slices(spec, planned)
            shares: dict[int, tuple[part.Range, ...]] = {
                rank: ((first, size),) if size else () for rank, (first, size) in slices.items()
            }
            if covered:
                # each rank keeps what is left of its own slice: the split the bundle's run had
                shares = {rank: part.subtract(ranges, covered) for rank, ranges in shares.items()}
            self._slices.open_ranges(shares)
            plans: list[Action] = []
            for rank, ranges in shares.items():
                plan = sync_plan(spec, rank=rank, round_=self._round, epoch=epoch, ranges=ranges)
                self._plans[(self._round, rank)] = plan
                plans.append(Tell(to=rank, message=plan))
            return plans
        if covered:
            total = spec.n_batches
            self._pool = part.ChunkPool.from_coverage(total, part.subtract(((0, total),), covered))
        else:
            self._pool = part.ChunkPool(spec.n_batches)
        return self._window_plans(self._round, planned)

    def _window_plans(self, round_: int, ranks: list[int]) -> list[Action]:
        """CADENCE/ASYNC: each of ``ranks`` takes its next window of the current pool (tail by
        largest remainder)."""
        elche = self._running().elche
        alloc = part.tail_allocation(self._pool.remaining, [elche.counts[r] for r in ranks])
        return [self._plan(rank, round_, k) for rank, k in zip(ranks, alloc, strict=True)]

    def _plan_waiting(self, round_: int) -> list[Action]:
        """CADENCE/ASYNC: a window of ``round_`` for each alive rank with none planned that far
        (empty ones when the epoch's tail is in other ranks' windows)."""
        waiting = [
            r for r in sorted(self._alive - self._warming) if self._planned_round.get(r, 0) < round_
        ]
        return self._window_plans(round_, waiting)

    def _plan(self, rank: int, round_: int, k: int) -> Tell[int]:
        spec = self._require_spec()
        covered = part.range_size(self._pool.covered_ranges())
        ranges = self._pool.take(rank, round_, k)
        quota = part.range_size(ranges)
        if quota:
            self._epoch_last_round = max(self._epoch_last_round, round_)
        plan = m.Plan(
            rank=rank,
            round=round_,
            epoch=self._epoch,
            ranges=ranges,
            quota=quota,
            hold_after=plan_hold_after(spec, quota=quota),
            progress=self._epoch + covered / max(1, spec.n_batches),
        )
        self._plans[(round_, rank)] = plan
        self._planned_round[rank] = round_
        return Tell(to=rank, message=plan)

    # ----- windows and the gate ----------------------------------------------------------------

    def _on_frame(self, event: FrameSeen, now: float) -> list[Action]:
        del event, now  # handle() already refreshed the rank's last-seen time
        return []

    def _on_window(self, event: WindowReported, now: float) -> list[Action]:
        report = event.report
        rank = report.rank
        if rank not in self._alive or self.phase not in (
            CoordPhase.INIT,
            CoordPhase.TRAINING,
            CoordPhase.STOPPING,
        ):
            return []  # a dead rank's late frames, or no window open
        spec = self._require_spec()
        static = RULES[spec.policy].static_slices
        plan = None if static else self._plans.get((report.round, rank))
        out_of_place = plancheck.window_out_of_place(
            report,
            current=self._round,
            again=rank in self._reports.get(report.round, {}),
            planned=static or plan is not None,
        )
        if out_of_place is not None:
            return [dc.warning(out_of_place)]
        lie = plancheck.check_window(
            report,
            # SYNC: everything trained since the last report, all of it from the rank's slice
            planned=self._slices.left(rank) if plan is None else plan.quota,
            epoch=self._epoch if plan is None else plan.epoch,
            batch_size=spec.batch_size,
        )
        if lie is not None:
            return self._on_lost(RankLost(rank=rank, reason=lie), now)
        self._reports.setdefault(report.round, {})[rank] = report
        self._batches[rank] = self._batches.get(rank, 0) + report.batches
        ledger = self._ledgers.get(report.epoch)
        if ledger is not None:
            ledger.add_window(report)
        self._slices.reported(rank, report.batches)
        actions: list[Action] = []
        if (
            RULES[spec.policy].early_dispatch
            and self.phase is CoordPhase.TRAINING
            and report.round == self._round
            and self._planned_round.get(rank) == report.round
            and self._pool.remaining > 0
        ):
            elche = self._running().elche
            actions.append(
                self._plan(rank, report.round + 1, min(elche.counts[rank], self._pool.remaining))
            )
        actions.extend(self._maybe_reduce(now))
        return actions

    def _gate_view(self, round_: int) -> dict[int, GateRank]:
        spec = self._require_spec()
        reports = self._reports.get(round_, {})
        static = RULES[spec.policy].static_slices
        out = {}
        for rank in self._alive - self._warming:
            report = reports.get(rank)
            if static:
                need, quiesced = 1, self._slices.left(rank) <= 0
            else:
                plan = self._plans.get((round_, rank))
                need = plan.quota if plan is not None else 1
                quiesced = plan is not None and plan.quota == 0
            out[rank] = GateRank(
                reported=report is not None,
                steps=0 if report is None else report.batches,
                need=need,
                quiesced=quiesced,
            )
        return out

    def _maybe_reduce(self, now: float) -> list[Action]:
        if self.phase is not CoordPhase.TRAINING or self._in_flight is not None:
            return []
        k = self._round
        ranks = self._gate_view(k)
        if should_reduce(in_flight=False, ranks=ranks):
            return self._fire(k, now)
        if ranks and all(r.quiesced for r in ranks.values()) and self._pool.remaining > 0:
            # A death gave batches back to a pool whose tail the survivors had already been
            # told is elsewhere: an empty round plans them.
            return self._fire(k, now)
        return []

    def _closes_epoch(self, k: int) -> bool:
        spec = self._require_spec()
        if RULES[spec.policy].static_slices:
            return all(self._slices.left(r) <= 0 for r in self._alive)
        return self._pool.drained and self._epoch_last_round <= k

    def _fire(self, k: int, now: float) -> list[Action]:
        spec = self._require_spec()
        elche = self._running().elche
        rounds.report_window(
            elche,
            self._reports.pop(k, {}),
            world_size=self.config.world_size,
            delivered=RULES[spec.policy].delivered_timing,
            sync_ms=self._last_sync_ms,
        )
        closes = self._closes_epoch(k)
        epoch = self._epoch
        self._round_epoch[k] = epoch
        for key in [key for key in self._plans if key[0] <= k]:
            del self._plans[key]
        reason = self._desk.due(closes_epoch=epoch if closes else None, now=now)
        actions: list[Action] = [
            self._start_round(
                k, "model", now, closes_epoch=epoch if closes else None, checkpoint=reason
            )
        ]
        self._round = k + 1
        if self._stop_reason is not None:
            return actions
        if closes:
            # The next epoch opens once this consensus is known to hold every batch of this one
            # (a rank may die before its last contribution reaches it; windows never span epochs).
            return actions
        if not RULES[spec.policy].static_slices:
            actions.extend(self._plan_waiting(k + 1))
            if RULES[spec.policy].early_dispatch:
                # ASYNC ranks that already finished window k+1 were held back (two ahead of the
                # gate): now one ahead.
                reported = self._reports.get(k + 1, {})
                for rank in sorted(self._alive):
                    if (
                        rank in reported
                        and self._planned_round.get(rank) == k + 1
                        and self._pool.remaining > 0
                    ):
                        actions.append(
                            self._plan(rank, k + 2, min(elche.counts[rank], self._pool.remaining))
                        )
        return actions

    def _facts(self) -> tuple[int, tuple[part.Range, ...], ElCheState, frozenset[int], int]:
        """What a checkpoint bundle records (:data:`~.savedesk.Facts`)."""
        spec, epoch = self._require_spec(), self._completed_epochs
        held: tuple[part.Range, ...] = ()
        if epoch <= self._epoch < spec.epochs and not RULES[spec.policy].static_slices:
            held = self._pool.covered_ranges()
        elif epoch <= self._epoch < spec.epochs:
            held = self._slices.covered_ranges()
            if self._epoch == self._desk.book.resume_epoch:  # what the resumed slices left out
                held = part.coalesce([*held, *self._desk.book.resumed_coverage])
        elche = self._running().elche.snapshot()
        return epoch, held, elche, frozenset(self._alive), self.global_step

    def _last_bundle(self, save_reason: str) -> list[Action]:
        running = isinstance(self._stage, Running) and self.committed is not None
        return self._desk.failed(save_reason, self.committed if running else None, self._facts)

    # ----- stop, loss, deadlines -------------------------------------------------------------

    def _on_stop(self, event: StopRequested, now: float) -> list[Action]:
        if self._stop_reason is not None or self.phase is CoordPhase.FINAL:
            return []
        self._stop_reason, self._desk.preempting = event.reason, event.preempt
        if self.phase is CoordPhase.JOINING:
            self.phase = CoordPhase.DONE
            return rounds.stopped_before_start(event.reason)
        actions: list[Action] = [
            Announce(text=f"stopping training ({event.reason}): a final round, then shutdown")
        ]
        if self.phase is CoordPhase.TRAINING:
            self.phase = CoordPhase.STOPPING
            if self._in_flight is None:
                actions.extend(self._final(now, natural=False))
        return actions

    def _on_exiting(self, event: RankExiting, now: float) -> list[Action]:
        msg = event.message
        if msg.error:
            return self._on_lost(
                RankLost(rank=msg.rank, reason=f"it raised ({msg.reason})", details=msg.error), now
            )
        self._exiting.add(msg.rank)
        if self.phase not in _OVER:
            return self._on_lost(
                RankLost(rank=msg.rank, reason=f"it left before training ended ({msg.reason})"), now
            )
        return []

    def _after_loss(self, now: float) -> list[Action]:
        """The survivors train on: a round that waited only on the dead rank goes on; under SYNC
        the dead rank's slice is shared out (once the model round in flight says what it holds)."""
        flying = self._in_flight
        spec = self._require_spec()
        shared: list[Action] = []
        if RULES[spec.policy].static_slices and (flying is None or flying.kind != "model"):
            shared = self._share_dead_slices()
        if flying is not None:
            if flying.collective and not flying.waiting:
                return [*shared, *self._round_done(flying, flying.ms, now)]
            return shared  # the reducer stops waiting on it and completes the round
        if self.phase is CoordPhase.STOPPING:
            return [*shared, *self._final(now, natural=False)]
        return [*shared, *self._maybe_reduce(now)]

    def _on_lost(self, event: RankLost, now: float) -> list[Action]:
        rank = event.rank
        if rank in self._lost and event.exit:
            self._lost.refine(rank, event.reason)  # its own end says more than its link's close
            return []
        if rank in self._lost or rank not in self._joined:
            return []  # not a Trainer rank yet (the supervisor names its exit), or already counted
        self._alive.discard(rank)
        self._warming.discard(rank)
        self._lost.record(
            rank, event.reason, epoch=self._epoch, details=event.details, vague=event.vague
        )
        stage = self._stage
        assert not isinstance(stage, BeforeHello)  # the rank joined
        spec = stage.spec
        actions: list[Action] = [
            dc.warning(f"rank {rank} on {self._host(rank)} lost: {event.reason}")
        ]
        flying = self._in_flight
        reducing = flying.round if flying is not None and flying.kind == "model" else None
        self._pool.forfeit(rank, keep=reducing)
        if isinstance(stage, Running):
            stage.elche.forget(rank)
        if flying is not None:
            flying.waiting.discard(rank)
        world = self.config.world_size
        joining = self.phase is CoordPhase.JOINING
        end = dc.unrecoverable_end(
            self._lost, spec, world_size=world, rank=rank, reason=event.reason, joining=joining
        )
        if end is None:
            regroup = None
            if spec.backend is Backend.COLLECTIVE:
                self._generation += 1
                regroup, said = dc.regroup(
                    flying, dead=rank, alive=self._alive, generation=self._generation, now=now
                )
                actions.append(said)
            actions.append(DeclareDead(rank=rank, reason=event.reason, regroup=regroup))
            return [*actions, *self._after_loss(now)]
        self.phase = CoordPhase.FAILED
        ending = end[-1]
        assert isinstance(ending, Fail)
        return [
            *actions,
            DeclareDead(rank=rank, reason=event.reason),
            *self._last_bundle(ending.save_reason),
            *end,
        ]

    def _on_tick(self, event: Tick, now: float) -> list[Action]:
        del event
        stage = self._stage
        if isinstance(stage, Joining) and now >= stage.first_hello_at + self.config.hello_timeout:
            missing = [r for r in range(self.config.world_size) if r not in self._joined]
            late = missing[0]
            reason = dc.late_hello(
                late=late,
                where=self._host(late),
                first=stage.reference.rank,
                hello_timeout=self.config.hello_timeout,
            )
            return self._fail(ExitCode.FORMATION, reason, rank=late)
        timeout = self._heartbeat_timeout()
        seen = {r: self._last_seen[r] for r in self._alive - self._exiting}
        silent = dc.first_silent(seen, timeout, now)
        if silent is not None and timeout is not None:
            return self._on_lost(RankLost(rank=silent, reason=dc.silent(timeout)), now)
        flying = self._in_flight
        if flying is not None and now >= flying.started_at + self.config.reduce_stall:
            reason = dc.stalled(flying, self.config.reduce_stall)
            return [
                *self._last_bundle("reduce_stall"),
                *self._fail(ExitCode.STALLED, reason, save_reason="reduce_stall"),
            ]
        return []
