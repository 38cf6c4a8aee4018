"""The controller's shell: one event loop that binds the port, pumps events into the supervisor, and
tears down.

Theory of operation. ``bind()`` opens the one port and serves status (``waiting``) before anything
else. ``run()`` builds the pure :class:`~flodl_async.control.supervisor.Supervisor`, registers the
channel handlers, asks each worker's agent launcher to bring its agent up, and then only pumps:
every handler turns what arrives on the port into a supervisor event, handed over by
:meth:`Controller._dispatch`, which carries out the returned actions at once and in order (answer a
join, tell a host, log a line, end the run). The pump itself sleeps until the supervisor's next
deadline (its hosts' links' included) or the coordinator's, reads the clock once when it wakes,
and hands the supervisor a ``Woke``. All decisions are the supervisor's; this module only does
I/O. The channels' handlers and what goes down a host's links are :mod:`.hostlinks`; what it
publishes and logs about the run is built in :mod:`.report`, the join link's events in
:mod:`.joinlink`, and each placement's agent launcher in :mod:`.agents`.

Teardown runs on every exit path — a verdict, an internal error, or the task being cancelled (an
embedding application, Ctrl-C through ``asyncio.run``): the terminal phase is published, every host
is told ``Finish`` or ``Abort``, the links are given the stop grace to close, stuck agents are
cancelled (their own ``finally`` kills their ranks), and the port closes. Nothing here imports
torch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import os
import signal
import time
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..agent import RankOutput
from ..config.plan import LaunchPlan, PlacedWorker, Placement
from ..control.dispatch import TypeTable
from ..control.exits import signal_name
from ..control.supervision import (
    AcceptJoin,
    Action,
    EndRun,
    Event,
    ForceStop,
    HostLost,
    Interrupted,
    OrderlyStop,
    RankDropped,
    RejectJoin,
    ResetStore,
    TellCoordinator,
    TrainingEnded,
    TrainingStarted,
)
from ..control.supervisor import Supervisor
from ..control.vocab import LOGGING_LEVELS, Announce, Tell
from ..control.watch import (
    AbortLinks,
    CutJoinLink,
    LinkEvent,
    SendHeartbeat,
    Woke,
)
from ..errors import FlodlError
from ..net.fdlimit import raise_descriptor_limit
from ..net.framed import FramedProtocol
from ..net.http import StatusHttpProtocol
from ..net.mux import PortMux
from ..net.portstore import PortStore
from ..net.service import FramedService
from ..net.torchstore import BACKEND_VARIABLE
from ..status import Counters, StatusBoard
from ..training.metrics import EpochMetrics
from ..training.spec import TrainerSpec
from ..verdict import ExitCode, RunResult
from ..wire import messages as m
from ..wire.channels import Channel
from ..wire.handshake import join_resolver, session_resolver
from .agents import agent_launchers, supervisor_config
from .eventlog import open_event_log
from .hostlinks import HostLinks
from .launchers import AgentLauncher, ControllerContact
from .report import announce_window, connection_counters, emit_scalars, status_snapshot
from .training import (
    RoundRunner,
    RoundRunnerFactory,
    TrainingOutcome,
    TrainingShell,
    default_round_runner,
)

if TYPE_CHECKING:
    from .reducer import Reducer

log = logging.getLogger("flodl_async.cli.launch")


class Controller:
    """Runs one launch from bind to teardown."""

    def __init__(
        self,
        plan: LaunchPlan,
        *,
        output: RankOutput,
        training_rounds: RoundRunnerFactory | None = None,
    ) -> None:
        self.plan = plan
        self._training_rounds = training_rounds  # None: the Trainer's reducer (tests pass a seam)
        self._deadlines = plan.deadlines
        self._output = output
        self._resolve = session_resolver(plan.secret)
        self._mux = PortMux(
            host=plan.bind_host,
            port=plan.port,
            sniff_timeout=self._deadlines.sniff,
            handshake_timeout=self._deadlines.handshake,
        )
        self._board = StatusBoard(counters=self._connection_counters)
        # --log-dir: every event of the run in DIR/<run id>/events.jsonl, closed on every way out
        self._event_log = open_event_log(plan.log_dir, plan.run_id, self._board)
        self._started_at = time.time()
        self._opened_at = time.monotonic()
        self._supervisor: Supervisor | None = None
        self._early_signals: list[int] = []
        self._launchers: dict[Placement, AgentLauncher] = {}
        self._changed = asyncio.Event()
        self._end: EndRun | None = None
        self._forced = False
        # a verdict the supervisor did not give (internal error, cancelled)
        self._final: RunResult | None = None
        # the store rides the port unless torch's own was asked for (a store host serves that)
        self._store = None if os.environ.get(BACKEND_VARIABLE, "python") == "torch" else PortStore()
        # the Trainer's coordinator shell, idle until a TrainerHello
        self._training: TrainingShell | None = None
        # the launcher's own spec (the user's script is the launcher)
        self._training_reference: TrainerSpec | None = None
        self._training_metrics: Callable[[EpochMetrics], None] | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._reducer: Reducer | None = None
        self._hosts = HostLinks(
            plan=plan,
            output=output,
            store=self._store,
            dispatch=self._dispatch,
            note=self._note,
            training=lambda: self._training,
            report=functools.partial(emit_scalars, self._board.emit),
        )
        self._carry_out = self._carry_out_table()

    @property
    def status_board(self) -> StatusBoard:
        """Where the controller publishes its snapshots."""
        return self._board

    @property
    def serving(self) -> bool:
        """True while the port is open."""
        return self._mux.serving

    @property
    def port(self) -> int:
        """The bound port (after :meth:`bind`)."""
        return self._mux.port

    async def bind(self) -> None:
        """Bind the one port and serve status (``waiting``) before anything else happens."""
        self._mux.register(
            Channel.STATUS,
            lambda: StatusHttpProtocol(self._board, request_timeout=self._deadlines.http_request),
        )
        # every connection is a descriptor: take what the hard limit allows
        raise_descriptor_limit()
        await self._mux.start()
        self._publish()

    def interrupt(self, signum: int) -> None:
        """SIGINT/SIGTERM: the first stops gracefully (the signal table), the second forces.

        With Trainer ranks training, the first asks the coordinator for an orderly stop (a final
        round, ``Shutdown``, the ranks return their state) before any signal reaches them; the
        next one goes to the supervisor's table.
        """
        if self._supervisor is None:
            self._early_signals.append(signum)
            return
        if self._training is not None and self._training.stop(signal_name(signum)):
            self._dispatch(OrderlyStop(signal=signum))
            return
        self._dispatch(Interrupted(signal=signum))

    def forward_signal(self, signum: int, *, local_only: bool = False) -> str:
        """SIGUSR1/SIGUSR2 to the launcher, passed on (:meth:`HostLinks.pass_on_signal`)."""
        training = self._training is not None and self._training.coordinator is not None
        only = self.plan.local_hosts if local_only else None
        return self._hosts.pass_on_signal(signum, only=only, trainer=training)

    @property
    def training(self) -> TrainingShell | None:
        """The Trainer's coordinator shell (after :meth:`run` started)."""
        return self._training

    def configure_training(
        self, *, reference: TrainerSpec | None, metrics_sink: Callable[[EpochMetrics], None] | None
    ) -> None:
        """Before :meth:`run`: the launcher's spec every rank must match, and where aggregated
        epochs go."""
        self._training_reference = reference
        self._training_metrics = metrics_sink

    def checkpoint_training(self, reason: str) -> bool:
        """A checkpoint of the Trainer at the next reduce boundary; False when nothing trains."""
        return self._training is not None and self._training.checkpoint(reason)

    def stop_training(self, reason: str) -> bool:
        """An orderly stop of the Trainer (``TrainingRun.shutdown``); False when nothing trains."""
        return self._training is not None and self._training.stop(reason)

    async def run(self) -> RunResult:
        """The whole lifecycle; call :meth:`bind` first. Teardown runs on every exit path."""
        plan = self.plan
        self._opened_at = time.monotonic()
        self._supervisor = Supervisor(
            supervisor_config(plan, self._deadlines, controller_store=self._store is not None),
            now=self._opened_at,
        )
        launch = plan.join.node_terms.launch if plan.join.node_terms is not None else ""
        contact = ControllerContact(
            host="127.0.0.1", port=self.port, secret=plan.secret, deadlines=self._deadlines
        )
        contact = dataclasses.replace(contact, launch=launch)
        self._launchers = agent_launchers(
            plan, contact, output=self._output, local_reducer=self._in_process_reducer
        )
        result: RunResult | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                self._training = self._training_shell(tg)
                for channel, handler in (
                    (Channel.JOIN, self._hosts.handle_join),
                    (Channel.RENDEZVOUS, self._hosts.handle_rendezvous),
                    (Channel.CONTROL, self._hosts.handle_control),
                ):
                    if channel is Channel.RENDEZVOUS and self._store is not None:
                        # the StoreAddress exchange is the torch backend's only
                        continue
                    resolve = (
                        join_resolver(
                            plan.secret, plan.token, open_admission=plan.join.open_admission
                        )
                        if channel is Channel.JOIN
                        else self._resolve
                    )
                    service = FramedService(
                        channel=channel,
                        resolve=resolve,
                        run_id=plan.run_id,
                        handler=handler,
                        task_group=tg,
                    )
                    self._mux.register(channel, service.protocol_factory)
                if self._store is not None:
                    self._mux.register(Channel.STORE, self._store.protocol_factory)
                announce_window(plan, self.port)
                agent_tasks = [
                    tg.create_task(self._run_agent(worker), name=f"agent-{worker.host}")
                    for worker in plan.workers
                ]
                try:
                    for signum in self._early_signals:
                        self._dispatch(Interrupted(signal=signum))
                    result = await self._pump()
                except Exception as exc:  # a bug: still tear down and leave nothing behind
                    log.exception("controller failed")
                    result = RunResult(
                        exit_code=ExitCode.INTERNAL, reason=f"internal error: {exc!r}"
                    )
                    self._final = result
                finally:
                    if result is None:
                        self._final = RunResult(
                            exit_code=ExitCode.INTERRUPTED, reason="the controller was cancelled"
                        )
                    try:
                        await self._training.aclose()
                    # a training shell that fails to close must not leave the agents running
                    finally:
                        await self._teardown(agent_tasks)
                        # What is still connected after the grace is stuck (a frozen host's relay
                        # link never closes): closing the port ends those handlers and the group.
                        await self._mux.aclose()
                        if self._reducer is not None:
                            await self._reducer.aclose()  # its round driver is a task of this group
        finally:
            if self._store is not None:
                self._store.close()
            await self.aclose()
        assert result is not None  # None only when cancelled, and then CancelledError propagates
        return result

    def install_reducer(self, reducer: Reducer) -> None:
        """Serve the data channel with ``reducer`` (the training shell calls this when its
        coordinator starts).

        Until then the port serves no data channel: a relay that dials it is closed before any
        handshake (counted as ``no_handler``), so runs without Trainer ranks never load torch.
        """
        if self._tg is None:
            raise RuntimeError(
                "install_reducer() needs a running controller (call it from inside run())"
            )
        service = reducer.attach(
            task_group=self._tg, resolve=self._resolve, run_id=self.plan.run_id
        )
        self._reducer = reducer
        self._mux.register(Channel.DATA, service.protocol_factory)

    def _in_process_reducer(self) -> Reducer | None:
        """The reducer that this process's agents' relays hand their frames to in memory (None
        before the Trainer's coordinator started one: then there is nothing to hand to)."""
        return self._reducer

    async def aclose(self) -> None:
        """Close the port and the event log (idempotent)."""
        await self._mux.aclose()
        if self._event_log is not None:
            self._event_log.close(self._board.snapshot)

    # ----- the pump ------------------------------------------------------------------------------

    async def _pump(self) -> RunResult:
        """Sleep until the supervisor's next deadline (its hosts' links included) or the
        coordinator's, whichever is first, or until an event moved them; read the clock once per
        wake and hand the supervisor the wake."""
        supervisor = self._require_supervisor()
        now = time.monotonic()
        while self._end is None:
            self._changed.clear()
            training = self._training.next_deadline() if self._training is not None else None
            due = (supervisor.next_deadline(now), training)
            wake = min((t for t in due if t is not None), default=None)
            timed_out = False
            try:
                async with asyncio.timeout(None if wake is None else max(wake - now, 0.0)):
                    await self._changed.wait()
            except TimeoutError:
                timed_out = True
            now = time.monotonic()
            if timed_out:
                assert wake is not None
                self._dispatch(Woke(late=now - wake), now=now)
                if training is not None and now >= training and self._training is not None:
                    self._training.tick()
        return self._end.result

    def _dispatch(
        self,
        event: Event | LinkEvent,
        *,
        reply_link: FramedProtocol | None = None,
        now: float | None = None,
    ) -> None:
        """Hand one event to the supervisor and carry out its actions now, in order."""
        self._carry_out_all(event, reply_link, time.monotonic() if now is None else now)
        self._publish()
        self._changed.set()

    def _note(self, event: LinkEvent) -> None:
        """A link bound, heard or closed: the supervisor's watch takes it; it changes nothing the
        status page shows, and the pump looks again at its next wake."""
        self._carry_out_all(event, None, time.monotonic())

    def _carry_out_all(
        self, event: Event | LinkEvent, reply_link: FramedProtocol | None, now: float
    ) -> None:
        supervisor = self._require_supervisor()
        pending: collections.deque[tuple[Event | LinkEvent, FramedProtocol | None]] = (
            collections.deque([(event, reply_link)])
        )
        while pending:
            current, link = pending.popleft()
            for action in supervisor.handle(current, now):
                follow_up = self._carry_out(action, link)
                if follow_up is not None:
                    pending.append((follow_up, None))

    def _carry_out_table(
        self,
    ) -> TypeTable[Action, [FramedProtocol | None], Event | LinkEvent | None]:
        """Which method carries out each supervisor action: ``(action, reply_link)`` in, a
        follow-up event (an accept that could not be delivered) or None out."""
        table: TypeTable[Action, [FramedProtocol | None], Event | LinkEvent | None] = TypeTable(
            "the controller's supervisor actions"
        )
        table.add(Tell, self._hosts.tell)
        table.add(Announce, self._announce)
        table.add(TellCoordinator, self._tell_coordinator)
        table.add(AcceptJoin, self._hosts.accept_join)
        table.add(RejectJoin, self._hosts.reject_join)
        table.add(ForceStop, self._force_stop)
        table.add(ResetStore, self._reset_store)
        table.add(EndRun, self._end_run)
        table.add(SendHeartbeat, self._hosts.send_heartbeat)
        table.add(CutJoinLink, self._hosts.cut_join_link)
        table.add(AbortLinks, self._hosts.abort_links)
        table.require(Action)
        return table

    def _announce(self, action: Announce, reply_link: FramedProtocol | None) -> None:
        level = LOGGING_LEVELS[action.level]
        if self.plan.one_host and level == logging.INFO:
            # a --nproc run said it all in its banner: the progress is for -v
            level = logging.DEBUG
        log.log(level, "%s", action.text)

    def _tell_coordinator(self, action: TellCoordinator, reply_link: FramedProtocol | None) -> None:
        if self._training is not None:
            self._training.rank_lost(
                action.rank, action.reason, details=action.details, refines=action.refines
            )

    def _force_stop(self, action: ForceStop, reply_link: FramedProtocol | None) -> None:
        self._forced = True
        for launcher in self._launchers.values():
            launcher.force_stop()
        self._hosts.send_all(
            m.Abort(reason="forced stop", grace_s=0.0, first_signal=int(signal.SIGKILL))
        )

    def _reset_store(self, action: ResetStore, reply_link: FramedProtocol | None) -> None:
        assert self._store is not None  # only asked for when the store is ours
        self._store.reset(action.round)

    def _end_run(self, action: EndRun, reply_link: FramedProtocol | None) -> None:
        self._end = action

    # ----- agents and teardown -------------------------------------------------------------------

    async def _run_agent(self, worker: PlacedWorker) -> None:
        launcher = self._launchers.get(worker.placement)
        try:
            if launcher is None:
                raise FlodlError(
                    f"no agent launcher for {worker.placement.value} workers in this version"
                )
            await launcher.run_agent(worker)
        except FlodlError as exc:
            self._dispatch(HostLost(host=worker.host, reason=str(exc)))
        except Exception as exc:
            log.exception("agent on %s failed", worker.host)
            self._dispatch(HostLost(host=worker.host, reason=repr(exc)))

    async def _teardown(self, agent_tasks: list[asyncio.Task[None]]) -> None:
        self._publish()  # the terminal phase, before any cleanup
        farewell: m.Finish | m.Abort
        if self._end is not None and self._final is None:
            farewell = self._end.farewell
        else:
            reason = self._final.reason if self._final is not None else "the controller stopped"
            farewell = m.Abort(reason=reason, grace_s=self._deadlines.stop_grace)
        if self._forced and isinstance(farewell, m.Abort):
            farewell = m.Abort(
                reason=farewell.reason, grace_s=0.0, first_signal=int(signal.SIGKILL)
            )
        self._hosts.send_all(farewell)
        grace = farewell.grace_s if isinstance(farewell, m.Abort) else self._deadlines.stop_grace
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace + self._deadlines.teardown_margin):
                await asyncio.gather(*(link.wait_closed() for link in self._hosts.links.values()))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._deadlines.teardown_margin):
                await asyncio.gather(*agent_tasks, return_exceptions=True)
        for task in agent_tasks:
            # a stuck local agent: cancellation runs its finally, which kills its ranks
            task.cancel()

    # ----- channel handlers ----------------------------------------------------------------------

    # ----- the Trainer (controller/training.py does the work) -------------------------------------

    def _training_shell(self, tg: asyncio.TaskGroup) -> TrainingShell:
        scale = self._deadlines.scale
        return TrainingShell(
            run_id=self.plan.run_id,
            world=self._training_world,
            task_group=tg,
            on_outcome=self._training_outcome,
            on_change=self._training_changed,
            on_start=lambda collective: self._dispatch(TrainingStarted(collective=collective)),
            on_drop=lambda rank, reason: self._dispatch(RankDropped(rank=rank, reason=reason)),
            serve_data=self._serve_training_data,
            hello_timeout=self._deadlines.trainer_hello,
            reduce_stall=self._deadlines.reduce_stall,
            # the spec's heartbeat_timeout is the user's; the run's scale applies to it
            timeout_scale=scale,
            round_runner=self._training_rounds or default_round_runner,
            reference=self._training_reference,
            metrics_sink=self._training_metrics,
            on_event=self._board.emit,
            max_restarts=self.plan.max_restarts,
        )

    def _training_changed(self) -> None:
        self._publish()  # the status page's training block
        self._changed.set()  # the pump recomputes its wake-up (the coordinator's deadline moved)

    def _training_world(self) -> tuple[int, dict[int, str]]:
        view = self._require_supervisor().view()
        return view.world_size, {r.rank: r.host for r in view.ranks}

    def _training_outcome(self, outcome: TrainingOutcome) -> None:
        # an orderly end's code is the supervisor's (it knows the signal that asked for it)
        code = ExitCode.OK if outcome.ok else ExitCode(outcome.code)
        self._dispatch(
            TrainingEnded(ok=outcome.ok, reason=outcome.reason, code=code, details=outcome.details)
        )

    def _serve_training_data(self, reducer: RoundRunner) -> None:
        """The coordinator started: its reducer serves the DATA channel (a test's round seam has no
        data plane)."""
        if getattr(reducer, "attach", None) is not None:
            self.install_reducer(typing.cast("Reducer", reducer))

    # ----- status --------------------------------------------------------------------------------

    def _connection_counters(self) -> Counters:
        return connection_counters(self._mux.statistics())

    def _publish(self) -> None:
        self._board.publish(
            status_snapshot(
                self.plan,
                self._supervisor.view() if self._supervisor is not None else None,
                final=self._final,
                started_at=self._started_at,
                opened_at=self._opened_at,
                training=self._training.status() if self._training is not None else None,
            )
        )

    def _require_supervisor(self) -> Supervisor:
        if self._supervisor is None:
            raise RuntimeError("run() has not started")
        return self._supervisor
