"""The run's supervisor: a pure state machine from the open window to the verdict.

Theory of operation. The controller's shell feeds :meth:`Supervisor.handle` every event that matters
to the run (a host asks to join, a host is lost, the store is ready, a rank exited, a host stopped
its ranks, a signal, a deadline passed) together with ``now`` (monotonic seconds), and carries out
the actions it returns, in order (answer a join, tell a host, announce a line, end the run). It
wakes it with :class:`~flodl_async.control.watch.Woke` at :meth:`Supervisor.next_deadline`, which
covers the hosts' links too: their liveness is the supervisor's
:class:`~flodl_async.control.watch.HostWatch`. Nothing here performs I/O or reads a clock, so every
decision of a run is tested with fake time. Which method takes an event is looked up in one table
keyed by (phase type, event type), every pair filed, the ones that change nothing included
(:meth:`Supervisor._build_transitions`). Its configuration, events, actions, phases and status view
are declared in :mod:`flodl_async.control.supervision`.

Phases, one type each (no field that starts as ``None``)::

    Forming ──formed──▶ Rendezvous(round) ──store ready──▶ Running(round)
       │                    │   ▲                              │  │
       │                    │   └──── all stopped ── Restarting ◀┘  │ (rank failed, restarts left)
       ▼                    ▼                          │            ▼
     Ended ◀─────────── any failure, interrupt, deadline ─┴───── every rank exited 0
       ▲                                                          │ (rank failed, none left,
       └──── the coordinator's cause, or its wait over ── Concluding ◀┘  a coordinator runs)

Rules. Before formation the first failure ends the run (exit 3). After it, the first non-zero rank
exit of the current round ends the round: a plain script's world restarts while restarts are left
(every host stops the round's ranks, a new rendezvous round: ``TORCHELASTIC_RESTART_COUNT`` + 1),
otherwise the verdict names the rank, its host, its code or signal, its traceback and its last
stderr lines (exit 4). A Trainer run's world never restarts: a rank lost to a crash is restarted
alone while restarts are left (:class:`~flodl_async.control.elastic.RankRestarts`), and a failure
first waits ``training_outcome_wait`` (:class:`Concluding`) for the coordinator's cause, since a
rank that raised reports why up its relay link and its agent the exit down its join link. A member
host lost ends the run (exit 4 after formation; a Trainer's ranks on it are the coordinator's);
a closed join link of a launched agent waits ``agent_reason_wait`` for the launcher's report, so
a failed agent is the verdict in its own words. The first signal ends the run with 130/143 and
stops every host's ranks following the signal table; a signal after the verdict forces (KILL now).
A verdict, once given, is final.
"""

from __future__ import annotations

import signal
from dataclasses import replace

from ..verdict import (
    ExitCode,
    RunResult,
    exit_code_for_signal,
    rank_signal_for,
    restarts_text,
)
from ..wire import messages as m
from .elastic import RankRestarts, held_exit, held_host, tell_exit
from .exits import describe_exit, failed, signal_name
from .formation import join_answer, stop_for_restart, store_host, world_formed
from .membership import Failed, Formed, JoinedMember, JoinWindow
from .ranktable import RankTable
from .supervision import (
    Action,
    Concluding,
    Ended,
    EndRun,
    Event,
    ForceStop,
    Forming,
    HeldFailure,
    HostLost,
    Interrupted,
    JoinRequested,
    JoinUndelivered,
    OrderlyStop,
    Phase,
    RankConnected,
    RankDropped,
    RankExited,
    RanksReported,
    RanksStopped,
    RejectJoin,
    Rendezvous,
    ResetStore,
    Restarting,
    Running,
    StoreReady,
    SupervisorConfig,
    SupervisorView,
    TrainingEnded,
    TrainingStarted,
    Transitions,
    phase_name,
)
from .vocab import Announce, Level, Tell, Tick
from .watch import HostWatch, LinkEvent, Lost, Woke

# ----- the (phase, event) table ----------------------------------------------------------------


_FormedPhase = Rendezvous | Running | Concluding | Restarting
_FORMED: tuple[type[_FormedPhase], ...] = (Rendezvous, Running, Concluding, Restarting)
_BEFORE_VERDICT: tuple[type[Forming | _FormedPhase], ...] = (Forming, *_FORMED)
_ALL_PHASES: tuple[type[Phase], ...] = (*_BEFORE_VERDICT, Ended)
# where a rank's exit fills the rank table and decides nothing: no round runs, or its outcome is
# already decided (held for the coordinator's cause, or given)
_EXIT_RECORDED: tuple[type[Rendezvous | Restarting | Ended], ...] = (Rendezvous, Restarting, Ended)
# what the join window takes as a cue to decide, and nothing more
_WINDOW_CUES: tuple[type[StoreReady | RankExited | RanksStopped | Tick], ...] = (
    StoreReady,
    RankExited,
    RanksStopped,
    Tick,
)


# ----- the machine ----------------------------------------------------------------------------


class Supervisor:
    """One run's decisions; pure, ``now`` passed in."""

    def __init__(self, config: SupervisorConfig, *, now: float) -> None:
        self.config = config
        window = JoinWindow(
            config.join,
            opened_at=now,
            protocol_version=config.protocol_version,
            controller_version=config.version,
            host_aliases=config.host_aliases,
        )
        self._phase: Phase = Forming(window=window)
        self._window = window
        self._restart_count = 0
        self._ranks = RankTable()
        # the coordinator's orderly end, for the verdict
        self._training_done: tuple[str, ExitCode] | None = None
        # the launcher signal that asked the Trainer for an orderly stop
        self._orderly_signal: int | None = None
        # the Trainer's coordinator runs: a rank's failure may be the effect of its cause
        self._coordinated = False
        #: a Trainer run's ranks restarted alone (``--max-restarts``, CPU backend)
        self.rank_restarts = RankRestarts(config.max_restarts)
        self.watch = HostWatch(
            interval=config.heartbeat_interval,
            silence=config.heartbeat_silence,
            launched_hosts=config.launched_hosts,
            agent_reason_wait=config.agent_reason_wait,
        )
        self._transitions = self._build_transitions()

    # ----- queries ----------------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        """The current phase."""
        return self._phase

    @property
    def result(self) -> RunResult | None:
        """The verdict, once given."""
        return self._phase.result if isinstance(self._phase, Ended) else None

    @property
    def restart_count(self) -> int:
        """Completed whole-world restarts."""
        return self._restart_count

    def next_deadline(self, now: float) -> float | None:
        """When to call again with :class:`Woke` if nothing else happens (None: no deadline)."""
        due = (self._own_deadline(now), self.watch.next_deadline())
        return min((t for t in due if t is not None), default=None)

    def _own_deadline(self, now: float) -> float | None:
        phase = self._phase
        if isinstance(phase, Forming):
            return phase.window.next_deadline(now)
        return phase.deadline if isinstance(phase, Rendezvous | Concluding | Restarting) else None

    def view(self) -> SupervisorView:
        """What the status endpoint shows."""
        phase = self._phase
        formed = None if isinstance(phase, Forming) else phase.world
        return SupervisorView(
            phase=phase_name(phase),
            members=self._window.members,
            joined_ranks=self._window.joined_ranks,
            world_size=formed.world_size if formed is not None else 0,
            restart_count=self._restart_count,
            ranks=self._ranks.statuses(),
            result=self.result,
            rejected_joins=self._window.rejected_joins,
        )

    # ----- the one entry point ------------------------------------------------------------------

    def handle(self, event: Event | LinkEvent, now: float) -> tuple[Action, ...]:
        """Take one event; return what the shell must do, in order."""
        if isinstance(event, LinkEvent):
            # a link bound, heard or closed: the watch's alone, nothing to do at once
            self.watch.handle(event, now, self._host_of)
            return ()
        actions: list[Action] = []
        if isinstance(event, HostLost):
            actions.extend(self.watch.drop(event.host))
            ended = isinstance(self._phase, Ended)
            if self.watch.held(event.host, event.reason, event.link_closed, now, ended=ended):
                return tuple(actions)
        for due in self.watch.due_losses(now):
            lost = HostLost(host=due.host, reason=due.reason)
            actions.extend(self._transitions(self._phase, lost, now))
        return (*actions, *self._transitions(self._phase, event, now))

    def _host_of(self, rank: int) -> str | None:
        return next((mb.host for mb in self._window.members if rank in mb.ranks), None)

    def _woke(self, phase: Phase, event: Woke, now: float) -> tuple[Action, ...]:
        """The pump woke: the watch's beats and losses (:meth:`HostWatch.woke`), then a
        :class:`Tick`, each phase judging its own deadline by ``now``."""
        actions: list[Action] = []
        for item in self.watch.woke(now, late=event.late):
            if isinstance(item, Lost):
                actions.extend(self.handle(HostLost(host=item.host, reason=item.reason), now))
            else:
                actions.append(item)
        if not isinstance(self._phase, Ended):
            # not only when _own_deadline(now) passed: once the join window's end passed, it names
            # the cap, and the quorum would wait for that
            actions.extend(self.handle(Tick(), now))
        return tuple(actions)

    def _build_transitions(self) -> Transitions:
        """Which method takes each event in each phase; every (phase, event) pair has one entry,
        the ones that change nothing included, so a missing pair is an error, not a silent drop."""
        t = Transitions()
        # A signal, a rank's hello and a host's activity report do not wait on the window: a
        # signal ends the run (forces the stop after the verdict), a hello and a report fill the
        # rank table.
        t.add(_BEFORE_VERDICT, (Interrupted,), self._interrupted)
        t.add((Ended,), (Interrupted,), self._forced)
        t.add(_ALL_PHASES, (RankConnected,), self._rank_connected)
        t.add(_ALL_PHASES, (Woke,), self._woke)
        t.add(_ALL_PHASES, (OrderlyStop,), self._orderly_stop)
        t.add(_ALL_PHASES, (TrainingStarted,), self._training_started)
        # only the running round's ranks report activity that matters
        t.add((Running,), (RanksReported,), self._ranks_reported)
        t.ignore((Forming, Rendezvous, Concluding, Restarting, Ended), (RanksReported,))
        # The coordinator's conclusion counts until the verdict, the window open or not.
        t.add(_BEFORE_VERDICT, (TrainingEnded,), self._training_ended)

        # The join window: every event but those above may let it decide.
        t.add((Forming,), (JoinRequested,), self._forming_join)
        t.add((Forming,), (JoinUndelivered,), self._forming_undelivered)
        t.add((Forming,), (HostLost,), self._forming_lost)
        t.add((Forming,), _WINDOW_CUES, self._forming_poll)

        # The formed world: late joins are refused, a member lost ends the run, exits are recorded.
        t.add(_FORMED, (JoinRequested,), self._join_too_late)
        t.add(_FORMED, (JoinUndelivered,), self._accept_undelivered)
        t.add(_FORMED, (HostLost,), self._host_lost)
        t.add(_EXIT_RECORDED, (RankExited,), self._exit_recorded)
        t.add((Running,), (RankExited,), self._running_exit)
        t.add((Concluding,), (RankExited,), self._concluding_exit)
        t.add((Running,), (RankDropped,), self._running_dropped)
        t.add((Concluding,), (RankDropped,), self._concluding_dropped)
        t.ignore((Forming, Rendezvous, Restarting, Ended), (RankDropped,))
        t.add((Rendezvous,), (StoreReady,), self._store_ready)
        t.ignore((Running, Concluding, Restarting), (StoreReady,))
        t.add((Rendezvous,), (Tick,), self._rendezvous_tick)
        t.add((Concluding,), (Tick,), self._concluding_tick)
        t.add((Restarting,), (Tick,), self._restarting_tick)
        t.ignore((Running,), (Tick,))
        t.add((Restarting,), (RanksStopped,), self._ranks_stopped)
        t.ignore((Rendezvous, Running, Concluding), (RanksStopped,))

        # After the verdict: joins are refused (exits still fill the rank table, above).
        t.add((Ended,), (JoinRequested,), self._join_after_verdict)
        t.ignore(
            (Ended,), (JoinUndelivered, HostLost, StoreReady, RanksStopped, TrainingEnded, Tick)
        )
        t.require_every_pair()
        return t

    # ----- forming -------------------------------------------------------------------------------

    def _forming_join(self, phase: Forming, event: JoinRequested, now: float) -> tuple[Action, ...]:
        window = phase.window
        outcome = window.request_join(
            host=event.host,
            devices=event.devices,
            now=now,
            agent_version=event.agent_version,
            protocol_version=event.protocol_version,
            launch=event.launch,
        )
        actions = join_answer(outcome, host=event.host, window=window, run_id=self.config.run_id)
        return (*actions, *self._forming_poll(phase, event, now))

    def _forming_undelivered(
        self, phase: Forming, event: JoinUndelivered, now: float
    ) -> tuple[Action, ...]:
        phase.window.retract(event.host)
        return self._forming_poll(phase, event, now)

    def _forming_lost(self, phase: Forming, event: HostLost, now: float) -> tuple[Action, ...]:
        window = phase.window
        if window.member_lost(event.host, now=now, reason=event.reason) is None:
            # Not a member yet: a planned agent that failed before it could join.
            window.abort(f"agent on host {event.host!r} failed before joining: {event.reason}")
        return self._forming_poll(phase, event, now)

    def _forming_poll(self, phase: Forming, event: Event, now: float) -> tuple[Action, ...]:
        """Whether the window, after ``event``, formed the world or failed it."""
        verdict = phase.window.poll(now)
        if isinstance(verdict, Failed):
            return (self._end(ExitCode.FORMATION, f"the world did not form: {verdict.reason}"),)
        if isinstance(verdict, Formed):
            return tuple(self._formed(verdict, now))
        return ()

    def _formed(self, world: Formed, now: float) -> list[Action]:
        return [*world_formed(world, self.config), *self._open_round(world, 0, now)]

    def _store_host(self, world: Formed) -> str:
        return store_host(world, self.config.local_hosts)

    def _open_round(self, world: Formed, round_: int, now: float) -> list[Action]:
        if self.config.controller_store:
            # The store is the controller's own: ready once emptied, no exchange to wait for.
            # An empty address tells each agent to hand its ranks its own controller address.
            return [ResetStore(round=round_), *self._start_ranks(world, round_, addr="", port=0)]
        self._phase = Rendezvous(
            world=world, round=round_, deadline=now + self.config.store_ready_timeout
        )
        return [Tell(to=self._store_host(world), message=m.OpenRound(round=round_))]

    def _start_ranks(self, world: Formed, round_: int, *, addr: str, port: int) -> list[Action]:
        start = m.StartRanks(
            round=round_, restart_count=self._restart_count, master_addr=addr, master_port=port
        )
        actions: list[Action] = [Tell(to=member.host, message=start) for member in world.members]
        for member in world.members:
            for local_rank, rank in enumerate(member.ranks):
                self._ranks.started(rank, host=member.host, local_rank=local_rank)
        self._phase = Running(world=world, round=round_)
        where = f"{addr}:{port}" if addr else "the controller port"
        text = f"ranks started: round {round_}, restart {self._restart_count}, store at {where}"
        return [*actions, Announce(text=text)]

    # ----- after formation -------------------------------------------------------------------

    def _join_too_late(
        self, phase: _FormedPhase, event: JoinRequested, now: float
    ) -> tuple[Action, ...]:
        reason = f"the join window is {self._window.state.value}; this run takes no more hosts"
        return (RejectJoin(host=event.host, reason=reason),)

    def _accept_undelivered(
        self, phase: _FormedPhase, event: JoinUndelivered, now: float
    ) -> tuple[Action, ...]:
        # The world formed on that very join, too late to retract it: the host never learnt it is
        # in the world and its link reports nothing more, so it is lost.
        lost = HostLost(host=event.host, reason="its join accept could not be delivered")
        return self._host_lost(phase, lost, now)

    def _exit_recorded(
        self, phase: Rendezvous | Restarting | Ended, event: RankExited, now: float
    ) -> tuple[Action, ...]:
        self._ranks.exited(event.report)
        return ()

    def _store_ready(self, phase: Rendezvous, event: StoreReady, now: float) -> tuple[Action, ...]:
        if event.round != phase.round:
            return ()
        return tuple(self._start_ranks(phase.world, phase.round, addr=event.addr, port=event.port))

    def _rendezvous_tick(self, phase: Rendezvous, event: Tick, now: float) -> tuple[Action, ...]:
        if now < phase.deadline:
            return ()
        late = (
            f"the store host {self._store_host(phase.world)!r} did not report its store "
            f"within {self.config.store_ready_timeout:g}s"
        )
        return (self._end(ExitCode.FORMATION, late),)

    def _running_exit(self, phase: Running, event: RankExited, now: float) -> tuple[Action, ...]:
        self._ranks.exited(event.report)
        report = event.report
        if report.round != phase.round:
            return ()
        if failed(report) and self._training_done is None:
            restart = self.rank_restarts.restart(report, host=self._host_of(report.rank))
            if restart:  # held as dropped: the new incarnation is the coordinator's
                self._phase = replace(phase, dropped=phase.dropped | {report.rank})
                return restart
        if failed(report) and report.rank not in phase.dropped:
            if self._coordinated and self._training_done is None:
                # the coordinator drops the rank or gives the cause (the shell hands it the exit)
                self._phase = Concluding(
                    running=_exited(phase, report),
                    failures=(held_exit(report),),
                    deadline=now + self.config.training_outcome_wait,
                )
                return (
                    Announce(text=describe_exit(report), level=Level.WARNING),
                    tell_exit(report),
                )
            # a Trainer run's world is never restarted (its ranks are, alone, while it trains)
            if self._coordinated or self._restart_count >= self.config.max_restarts:
                failure = held_exit(report, after=self._after_restarts())
                return (Announce(text=describe_exit(report)), self._rank_failure(failure))
            return self._restart(phase, report, now)
        if failed(report):
            said = Announce(text=f"{describe_exit(report)} (dropped from training)")
            # its own end says more than the link that reported it first
            told = (tell_exit(report),) if self._training_done is None else ()
            return (said, *told, *self._round_over(_exited(phase, report)))
        said = Announce(text=f"rank {report.rank} on {report.host} exited with code 0")
        return (said, *self._round_over(_exited(phase, report)))

    def _round_over(self, phase: Running) -> tuple[Action, ...]:
        """``phase`` becomes the round as it stands; once every rank exited, the verdict."""
        self._phase = phase
        world = phase.world.world_size
        if len(phase.exited) < world:
            return ()
        if self._training_done is not None:
            reason, code = self._training_done
        elif phase.dropped:
            # every rank is gone and the coordinator never concluded
            reason = f"every rank exited before training ended ({len(phase.dropped)} dropped)"
            return (self._end(ExitCode.RANK_FAILURE, reason),)
        else:
            after = f" after {restarts_text(self._restart_count)}" if self._restart_count else ""
            everyone = f"all {world} ranks" if world > 1 else "the rank"
            reason, code = f"{everyone} exited 0{after}", ExitCode.OK
        return (self._end(code, reason),)

    def _restart(self, phase: Running, report: m.RankExited, now: float) -> tuple[Action, ...]:
        hosts = frozenset(member.host for member in phase.world.members)
        self._phase = Restarting(
            world=phase.world,
            round=phase.round,
            waiting=hosts,
            deadline=now + self.config.stop_grace + self.config.stop_ack_margin,
        )
        said = Announce(
            text=f"{describe_exit(report)}; restarting the world (restart "
            f"{self._restart_count + 1} of {self.config.max_restarts})",
            level=Level.WARNING,
        )
        return (said, *stop_for_restart(phase.world, phase.round, self.config.stop_grace))

    def _running_dropped(
        self, phase: Running, event: RankDropped, now: float
    ) -> tuple[Action, ...]:
        # its exit may still come (a frozen rank its agent now kills): then it ends nothing
        if self._coordinated:
            self._phase = replace(phase, dropped=phase.dropped | {event.rank})
        return ()

    def _concluding_exit(
        self, phase: Concluding, event: RankExited, now: float
    ) -> tuple[Action, ...]:
        self._ranks.exited(event.report)
        report = event.report
        if report.round != phase.round:
            return ()
        running = _exited(phase.running, report)
        failures = phase.failures
        said: tuple[Action, ...] = ()
        if failed(report) and report.rank not in running.dropped:
            failures = (*failures, held_exit(report))
            said = (tell_exit(report),)
        self._phase = replace(phase, running=running, failures=failures)
        return said

    def _concluding_dropped(
        self, phase: Concluding, event: RankDropped, now: float
    ) -> tuple[Action, ...]:
        running = replace(phase.running, dropped=phase.running.dropped | {event.rank})
        failures = tuple(f for f in phase.failures if f.rank != event.rank)
        if failures:
            self._phase = replace(phase, running=running, failures=failures)
            return ()
        return self._round_over(running)

    def _after_restarts(self) -> str:
        return f" after {restarts_text(self._restart_count)}" if self.config.max_restarts else ""

    def _rank_failure(self, failure: HeldFailure) -> EndRun:
        """The verdict of a rank's failure nothing absorbed."""
        return self._end(
            ExitCode.RANK_FAILURE,
            failure.reason,
            details=failure.details,
            rank=failure.rank,
            details_if_shown=failure.details_if_shown,
        )

    def _concluding_tick(self, phase: Concluding, event: Tick, now: float) -> tuple[Action, ...]:
        # the coordinator neither dropped the rank nor gave a cause in time (it never knew the
        # rank, or it is gone): the exit is the verdict
        return () if now < phase.deadline else (self._rank_failure(phase.failures[0]),)

    def _training_started(
        self, phase: Phase, event: TrainingStarted, now: float
    ) -> tuple[Action, ...]:
        self._coordinated = True
        return self.rank_restarts.start(collective=event.collective)

    def _training_ended(
        self, phase: Forming | _FormedPhase, event: TrainingEnded, now: float
    ) -> tuple[Action, ...]:
        if event.ok and isinstance(phase, Concluding):
            # an orderly end cannot outweigh the rank failure already seen
            return (Announce(text=event.reason), self._rank_failure(phase.failures[0]))
        if event.ok:
            # The ranks now leave; their clean exits give the verdict (130/143 after an orderly stop
            # on a signal).
            stop = self._orderly_signal
            code = ExitCode.OK if stop is None else exit_code_for_signal(stop)
            self._training_done = (event.reason, code)
            return (Announce(text=event.reason),)
        return (
            Announce(text=event.reason, level=Level.WARNING),
            self._end(event.code, event.reason, details=event.details),
        )

    def _ranks_stopped(
        self, phase: Restarting, event: RanksStopped, now: float
    ) -> tuple[Action, ...]:
        if event.round != phase.round:
            return ()
        waiting = phase.waiting - {event.host}
        if waiting:
            self._phase = replace(phase, waiting=waiting)
            return ()
        self._restart_count += 1
        return tuple(self._open_round(phase.world, phase.round + 1, now))

    def _restarting_tick(self, phase: Restarting, event: Tick, now: float) -> tuple[Action, ...]:
        if now < phase.deadline:
            return ()
        return (
            self._end(
                ExitCode.RANK_FAILURE,
                f"host(s) {sorted(phase.waiting)} did not stop their ranks for the restart",
            ),
        )

    def _host_lost(self, phase: _FormedPhase, event: HostLost, now: float) -> tuple[Action, ...]:
        member = next((mb for mb in phase.world.members if mb.host == event.host), None)
        if isinstance(phase, Running | Concluding) and member is not None and self._coordinated:
            running = phase.running if isinstance(phase, Concluding) else phase
            # after the coordinator's end only a host whose every rank it dropped costs nothing (its
            # rank heartbeats and its host link fall silent together, in either order)
            if self._training_done is None or set(member.ranks) <= running.exited | running.dropped:
                return self._hold_host(phase, member, event, now)
        if isinstance(phase, Concluding):
            # the first failure decides: the rank's, held only for its cause
            return (self._rank_failure(phase.failures[0]),)
        if member is None:
            text = f"agent on host {event.host!r} (not in the world) went away: {event.reason}"
            return (Announce(text=text, level=Level.DEBUG),)
        during = {
            Rendezvous: "during rendezvous",
            Running: "mid-run",
            Restarting: "while restarting",
        }[type(phase)]
        return (
            self._end(
                ExitCode.RANK_FAILURE,
                f"agent on host {event.host!r} was lost {during}: {event.reason}",
            ),
        )

    def _hold_host(
        self, phase: Running | Concluding, member: JoinedMember, event: HostLost, now: float
    ) -> tuple[Action, ...]:
        """A Trainer run's host is lost, and its ranks with it: each the coordinator's to drop
        (their exits never come)."""
        running = phase.running if isinstance(phase, Concluding) else phase
        held, told = held_host(member, event.reason, gone=running.exited | running.dropped)
        running = replace(running, exited=running.exited | set(member.ranks))
        if isinstance(phase, Concluding):
            self._phase = replace(phase, running=running, failures=(*phase.failures, *held))
        elif held:
            deadline = now + self.config.training_outcome_wait
            self._phase = Concluding(running=running, failures=held, deadline=deadline)
        said = Announce(
            text=f"agent on host {member.host!r} was lost: {event.reason}", level=Level.WARNING
        )
        if not held and not isinstance(phase, Concluding):
            return (said, *self._round_over(running))
        return (said, *told)

    # ----- signals and the end -------------------------------------------------------------------

    def _forced(self, phase: Ended, event: Interrupted, now: float) -> tuple[Action, ...]:
        # The first signal (or any verdict) already ended the run: this one forces the stop.
        name = signal_name(event.signal)
        return (
            Announce(text=f"second {name}: forcing the stop (KILL now)", level=Level.WARNING),
            ForceStop(),
        )

    def _interrupted(
        self, phase: Forming | _FormedPhase, event: Interrupted, now: float
    ) -> tuple[Action, ...]:
        name = signal_name(event.signal)
        where = {
            Forming: " while the join window was open",
            Rendezvous: " during rendezvous",
            Restarting: " while restarting",
        }.get(type(phase), "")
        first = rank_signal_for(event.signal)
        grace = self.config.stop_grace
        # what the user at the terminal does
        again = "Ctrl-C" if event.signal == signal.SIGINT else name
        return (
            Announce(
                text=f"stopping: ranks got {first.name}; KILL in {grace:g} s ({again} again to "
                "force)",
                level=Level.WARNING,
            ),
            self._end(
                exit_code_for_signal(event.signal),
                f"interrupted by {name}{where}",
                first_signal=first,
            ),
        )

    def _orderly_stop(self, phase: Phase, event: OrderlyStop, now: float) -> tuple[Action, ...]:
        self._orderly_signal = event.signal
        name = signal_name(event.signal)
        text = (
            f"stopping training in order on {name}: a final round, then shutdown ({name} again to "
            "stop the ranks)"
        )
        return (Announce(text=text, level=Level.WARNING),)

    def _join_after_verdict(
        self, phase: Ended, event: JoinRequested, now: float
    ) -> tuple[Action, ...]:
        return (RejectJoin(host=event.host, reason="this run has ended"),)

    def _end(
        self,
        code: ExitCode,
        reason: str,
        *,
        details: str = "",
        first_signal: signal.Signals = signal.SIGTERM,
        rank: int | None = None,
        details_if_shown: str = "",
    ) -> EndRun:
        # the world the verdict ends, if it formed
        world = None if isinstance(self._phase, Forming) else self._phase.world
        result = RunResult(
            exit_code=code,
            reason=reason,
            details=details,
            rank=rank,
            details_if_shown=details_if_shown,
        )
        self._phase = Ended(result=result, world=world)
        grace, first = self.config.stop_grace, int(first_signal)  # exit_code: every node's too
        abort = m.Abort(reason=reason, grace_s=grace, first_signal=first, exit_code=int(code))
        farewell: m.Finish | m.Abort = m.Finish() if code is ExitCode.OK else abort
        return EndRun(result=result, farewell=farewell)

    # ----- the rank table (status) ------------------------------------------------------------

    def _ranks_reported(
        self, phase: Running, event: RanksReported, now: float
    ) -> tuple[Action, ...]:
        """Fold a host's activity report into the rank table; under ``hang_timeout``, a rank quiet
        that long ends the run."""
        if event.report.round != phase.round:
            # a report of another round: the table already says how that one ended
            return ()
        hang = self._ranks.hang(event.host, event.report, hang_timeout=self.config.hang_timeout)
        if hang is None:
            return ()
        reason, details = hang
        return (
            Announce(text=reason, level=Level.WARNING),
            self._end(ExitCode.STALLED, reason, details=details),
        )

    def _rank_connected(self, phase: Phase, event: RankConnected, now: float) -> tuple[Action, ...]:
        self._ranks.connected(event.rank, event.pid)
        return ()


def _exited(phase: Running, report: m.RankExited) -> Running:
    """``phase`` with ``report``'s rank exited."""
    return replace(phase, exited=phase.exited | {report.rank})
