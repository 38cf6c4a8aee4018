"""One host's session in one run: join, serve the controller's commands, leave nothing behind.

Theory of operation. :meth:`HostSession.run` dials the controller's join
channel and asks to join with its host name and devices (:mod:`flodl_async.agent.join`). Once
admitted it takes its entry in the runtime directory (:mod:`flodl_async.host.runtime`), waits
for ``WorldFormed`` (its global ranks and the command), starts the relay, and
then follows the controller's commands on the join link, which stays open for
the whole run. Commands are dispatched through one table (message class →
handler); handlers never block the reading loop — long work runs as owned,
named tasks in the session's TaskGroup, so an ``Abort`` is read and acted on
while a ``StopRanks`` with a long grace is still waiting:

- ``OpenRound`` (store host only): a fresh store, its address reported up;
- ``StartRanks``: this host's ranks with the torchrun environment, each exit
  reported up as ``RankExited``;
- ``StopRanks``: stop one round's ranks (TERM first: a restart) and answer
  ``RanksStopped``; the session stays for the next round;
- ``RestartRank``: start one Trainer rank again, alone, as a new incarnation (``--max-restarts``);
- ``Abort`` / ``Finish``: stop everything and leave.

Round commands run one after another, in arrival order. An ending (``Abort``,
``Finish``, a lost join link, or :meth:`HostSession.request_stop` from a
signal) stops every rank following the signal table; a later ending while
one is under way only brings the KILL deadline closer (the shorter deadline
wins), and :meth:`HostSession.force_stop` means KILL now. The first ending
decides the outcome. Those rules are a pure core (:mod:`flodl_async.agent.endings`):
this shell feeds it each ending with the clock and runs the stops it returns.

Liveness: from admission on, any frame from the controller counts as a sign of
life, and the agent beats up the link (:mod:`flodl_async.control.liveness`): while the
world forms it echoes the controller's heartbeats; once serving, a ticker sends
its own and ends the session with :class:`ControllerLost` (TERM, KILL at the
stop grace) when the controller was silent past ``heartbeat_silence`` — a frozen
launcher or a pulled cable leaves the TCP link open, so the reader alone would
never notice. On every way out the ranks are gone, the relay, store
and links are closed, and the runtime entry is removed.

An observer (:mod:`flodl_async.agent.lifecycle`) hears each step as it
happens — dialing, connected, admitted, ranks running, stopping — which is
how ``flodl-agent`` keeps systemd told (:mod:`flodl_async.agent.systemd`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

from ..config.devices import DeviceKind
from ..control.liveness import Liveness, Wake
from ..errors import AgentError, ConfigError, ConnectionClosed, FlodlError, WireError
from ..host.early import early_ranks_of
from ..host.gpus import host_visible_gpus, select
from ..host.ifnames import interface_holding
from ..host.runtime import RuntimeEntry, create_entry, reap_stale_ranks, sweep_stale
from ..net.framed import FramedProtocol
from ..net.signals import FORWARDED_SIGNALS
from ..verdict import StopStep, stop_schedule
from ..wire import messages as m
from ..wire import storeowner as so
from ..wire.keys import Credential
from ..wire.restarts import RestartRank
from ..wire.schema import Message
from .endings import (
    Aborted,
    ControllerGone,
    EndingEvent,
    Endings,
    Finished,
    RelayFailed,
    RoundFailed,
    SessionOutcome,
    Signalled,
    stopped_by,
)
from .join import Joiner, SessionConfig, StoppedBeforeServing, device_labels, with_session_secret
from .lifecycle import Phase, SessionEvent, SessionObserver, ignore
from .output import LinkOutput, OutputSink, TeeOutput

# imported where the world has formed: an agent's start (the fan-out's per-host path) skips them
if TYPE_CHECKING:
    from ..relay.control import Relay
    from .ranks import RankProcesses

log = logging.getLogger("flodl_async.agent")


class HostSession:
    """One host's session in one run (the controller's own hosts run it in-process; ``flodl-agent``
    stand-alone)."""

    def __init__(
        self,
        config: SessionConfig,
        *,
        output: OutputSink | None = None,
        console: OutputSink | None = None,
        observer: SessionObserver = ignore,
    ) -> None:
        """``output``: where the ranks' output goes; None (a stand-alone agent) sends it up the join
        link. ``console``: with ``output`` None, this host's own console gets each chunk too (an
        every-node run's node prints its own ranks' lines)."""
        self.config = config
        self._output = output
        self._console = console
        self._observer = observer
        self._force = asyncio.Event()
        self._stop_signal: int | None = None
        self._link: FramedProtocol | None = None
        self._serving: _Serving | None = None
        self._stop_waiting = asyncio.Event()

    # ----- control from outside (signal handlers, the controller) ----------------------------

    def request_stop(self, sig: int) -> None:
        """First SIGTERM/SIGINT: stop the ranks by the signal table (``sig`` first), close the link,
        leave.

        :meth:`run` then returns ``Ending.STOPPED`` with ``sig``. Idempotent; a second
        signal is :meth:`force_stop`.
        """
        if self._stop_signal is not None:
            return
        self._stop_signal = sig
        self._stop_waiting.set()  # a wait for the controller ends at once
        if self._serving is not None:
            self._serving.stop_for_signal(sig)
        elif self._link is not None:
            log.info(
                "agent %s: %s before the world formed; leaving the window",
                self.config.host,
                signal.Signals(sig).name,
            )
            self.observe(
                Phase.STOPPING, reason=f"{signal.Signals(sig).name} before the world formed"
            )
            self._link.abort()  # the controller sees the host leave; our pending receive ends

    def force_stop(self) -> None:
        """Kill ranks now instead of waiting out a grace period (second signal)."""
        self._force.set()

    def signal_ranks(self, sig: int) -> tuple[int, ...]:
        """Forward ``sig`` (SIGUSR1/SIGUSR2) to this host's running ranks; the ranks reached (none
        before the world formed)."""
        return self._serving.signal_ranks(sig) if self._serving is not None else ()

    # ----- the session ---------------------------------------------------------------------

    async def run(self) -> SessionOutcome:
        """Join, serve the run, and return how it ended; raises :class:`AgentError` (or
        :class:`ConfigError`) on failure."""
        cfg = self.config
        devices = device_labels(cfg.devices)
        if not devices:
            raise ConfigError(
                f"host {cfg.host!r} has no devices to offer (devices: {cfg.devices.kind.value}, 0 "
                "GPUs visible); "
                "for CPU ranks use --devices cpu:N (devices: cpu:N in a cluster file)"
            )
        if cfg.devices.kind is DeviceKind.GPU_LIST:
            # an id past the visible set is refused before joining
            select(cfg.devices.gpu_ids, host_visible_gpus())
        # what ranks of SIGKILLed sessions forked, before the sweep forgets them
        for cleaned in reap_stale_ranks(cfg.runtime_root):
            log.warning("agent %s: %s", cfg.host, cleaned.describe())
        sweep_stale(cfg.runtime_root)  # leftovers of sessions that were SIGKILLed
        self.observe(Phase.DIALING)
        joiner = Joiner(cfg, stopping=self._stop_waiting)
        try:
            entered = await joiner.enter(devices, connected=self._connected)
        except StoppedBeforeServing:
            return stopped_by(self._stop_signal or signal.SIGTERM, when="before the world formed")
        if entered is None:
            return stopped_by(
                self._stop_signal or signal.SIGTERM, when="while waiting for the controller"
            )
        link, accept = entered
        entry: RuntimeEntry | None = None
        try:
            if cfg.token is not None or cfg.open_admission:
                self.config = cfg = with_session_secret(cfg, accept)
            self.observe(Phase.ADMITTED, run_id=accept.run_id, ranks=accept.ranks)
            entry = create_entry(
                run_id=accept.run_id,
                host=cfg.host,
                controller=cfg.controller_addr,
                root=cfg.runtime_root,
            )
            formed = await joiner.await_formation(link, accept)
            ifname = (
                cfg.default_ifname
                if cfg.default_ifname is not None
                else interface_holding(link.local_host)
            )
            serving = _Serving(
                self,
                link=link,
                run_id=accept.run_id,
                formed=formed,
                entry=entry,
                default_ifname=ifname or None,
            )
            self._serving = serving
            return await serving.run()
        except StoppedBeforeServing:
            return stopped_by(self._stop_signal or signal.SIGTERM, when="before the world formed")
        finally:
            await link.aclose(grace=cfg.deadlines.link_close)
            if entry is not None:
                entry.remove()

    def _connected(self, link: FramedProtocol) -> None:
        """A join link is up (each try of :meth:`Joiner.enter`): a signal from now on closes it."""
        self._link = link
        self.observe(Phase.CONNECTED)
        if self._stop_signal is not None:
            raise StoppedBeforeServing

    def observe(
        self,
        phase: Phase,
        *,
        run_id: str | None = None,
        ranks: tuple[int, ...] = (),
        round_: int | None = None,
        reason: str = "",
    ) -> None:
        """Tell the observer this session reached ``phase``, with what is known of the run by
        then."""
        cfg = self.config
        self._observer(
            SessionEvent(
                phase=phase,
                host=cfg.host,
                controller=cfg.controller_addr,
                run_id=run_id,
                ranks=ranks,
                round=round_,
                reason=reason,
            )
        )


_Handler = Callable[["_Serving", Any], None]


class _Serving:
    """The serving phase of a session: the command table, the round work, the ending."""

    #: Message class → handler; filled in below the class. Commands not in it are logged and
    #: ignored.
    commands: ClassVar[Mapping[type[Message], _Handler]]

    def __init__(
        self,
        session: HostSession,
        *,
        link: FramedProtocol,
        run_id: str,
        formed: m.WorldFormed,
        entry: RuntimeEntry,
        default_ifname: str | None = None,
    ) -> None:
        # Only a formed world needs ranks, a relay and a store.
        from ..net.storegate import StoreGate  # deferred: off the ssh agent's start path
        from .ranks import RankWorld  # deferred: off the ssh agent's start path
        from .storehost import StoreHost  # deferred: off the ssh agent's start path

        cfg = session.config
        self._session = session
        self._cfg = cfg
        self._link = link
        self._run_id = run_id
        self._formed = formed
        self._entry = entry
        self._world = RankWorld(
            formed=formed,
            run_id=run_id,
            host=cfg.host,
            relay_socket=entry.socket_path,
            data_socket=entry.data_socket_path,
            # Ranks get a credential for their own rank and round, derived here: never the secret.
            credential=lambda round_, rank: Credential.for_rank(
                cfg.secret, run_id=run_id, round=round_, rank=rank
            ),
            devices=cfg.devices,
            host_env=cfg.env,
            workdir=cfg.workdir,
            default_ifname=default_ifname,
        )
        self._store = StoreHost(
            controller_host=cfg.controller_host,
            controller_port=cfg.controller_port,
            credential=Credential.session(cfg.secret),
            run_id=run_id,
            advertise_addr=cfg.advertise_addr,
            deadlines=cfg.deadlines,
        )
        #: Judges the controller's questions about store connections from this host: this agent's
        #: user, and this process's tree (every rank it starts descends from it).
        self._store_gate = StoreGate.of_this_process()
        self._relay: Relay | None = None
        self._round_work = asyncio.Lock()  # FIFO: round commands run in arrival order
        self._tg: asyncio.TaskGroup | None = None
        self._ranks: RankProcesses | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._serial = 0
        self._ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        d = cfg.deadlines
        self._endings = Endings(host=cfg.host, stop_grace=d.stop_grace)
        self._liveness = Liveness.start(
            asyncio.get_running_loop().time(),
            interval=d.heartbeat_interval,
            silence=d.heartbeat_silence,
        )

    # ----- lifecycle -------------------------------------------------------------------------

    async def run(self) -> SessionOutcome:
        cfg = self._cfg
        log.debug(
            "agent %s: world formed, ranks %s of %d",
            cfg.host,
            list(self._formed.ranks),
            self._formed.world_size,
        )
        from ..relay.control import Relay  # deferred: off the ssh agent's start path
        from .ranks import RankProcesses  # deferred: off the ssh agent's start path

        relay: Relay | None = None
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            self._ranks = RankProcesses(
                host=cfg.host,
                world=self._world,
                output=self._output_sink(),
                scratch=self._entry.path,
                report=self._send,
                task_group=tg,
                force=self._session._force,
                output_drain=cfg.deadlines.output_drain,
                output_idle=cfg.deadlines.output_idle,
                dead_grace=cfg.deadlines.dead_rank_grace,
            )
            try:
                relay = Relay(
                    socket_path=self._entry.socket_path,
                    data_socket_path=self._entry.data_socket_path,
                    secret=cfg.secret,
                    run_id=self._run_id,
                    ranks=frozenset(self._formed.ranks),
                    controller_host=cfg.controller_host,
                    controller_port=cfg.controller_port,
                    task_group=tg,
                    deadlines=cfg.deadlines,
                    host=cfg.host,
                    on_upstream_lost=self._relay_lost,
                    on_rank_dead=self._ranks.kill_dead,
                    local_reducer=cfg.local_reducer,
                )
                self._relay = relay
                try:
                    await relay.start()
                except (OSError, FlodlError) as exc:
                    self.end_by(RelayFailed(controller=cfg.controller_addr, detail=str(exc)))
                else:
                    if early_ranks_of(self._run_id, cfg.host):
                        # they run already, and may dial the relay before the first StartRanks
                        relay.open_round(0)
                    self._spawn(self._read_commands(), name=f"{cfg.host}-commands")
                    self._spawn(self._keep_alive(), name=f"{cfg.host}-heartbeat")
                    self._spawn(self._report_activity(), name=f"{cfg.host}-activity")
                # a signal came while the world formed (the core drops it if already taken)
                if self._session._stop_signal is not None:
                    self.stop_for_signal(self._session._stop_signal)
                await self._ended
            finally:
                await self._wind_down(relay)
        result = self._endings.result
        if isinstance(result, AgentError):
            raise result
        assert result is not None
        return result

    def _output_sink(self) -> OutputSink:
        """The session's output, else up the join link (and to this host's console, if it has
        one)."""
        session = self._session
        if session._output is not None:
            return session._output
        if session._console is not None:
            return TeeOutput(session._console, LinkOutput(self._link))
        return LinkOutput(self._link)

    def signal_ranks(self, sig: int) -> tuple[int, ...]:
        """:meth:`HostSession.signal_ranks` while serving."""
        if self._ranks is None or self.ending:
            return ()
        # Trainer ranks are not given it: theirs is the preemption path, and a signal they have no
        # handler for would end them (SIGUSR1's default action).
        skip = frozenset(self._relay.trainer_ranks) if self._relay is not None else frozenset()
        return self._ranks.signal_running(sig, skip=skip)

    async def _wind_down(self, relay: Relay | None) -> None:
        """Whatever ended the session: no task, rank, store or socket outlives it."""
        for task in list(self._tasks):
            task.cancel()
        if self._ranks is not None:
            # normally none left: the ending stopped them
            await self._ranks.stop(stop_schedule(signal.SIGKILL, 0.0))
            # output still waiting on a link nobody reads (a frozen launcher) is given up
            self._ranks.cancel_readers()
        await self._store.aclose()
        if relay is not None:
            await relay.aclose()

    def _spawn(self, coro: Coroutine[Any, Any, None], *, name: str) -> None:
        """An owned task in the session's TaskGroup, tracked so the wind-down can cancel it."""
        assert self._tg is not None
        self._serial += 1
        task = self._tg.create_task(coro, name=f"{name}#{self._serial}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _send(self, msg: Message) -> None:
        """Up the join link; a link that just died is the reader's to report."""
        with contextlib.suppress(ConnectionClosed):
            self._link.send(msg)

    # ----- endings ---------------------------------------------------------------------------

    def end_by(self, event: EndingEvent) -> None:
        """Hand ``event`` to the endings core (:mod:`.endings`) and run the stop it returns:
        stop every rank by its schedule, then end (the first stop to return ends the session)."""
        self._endings, stop = self._endings.end(event, asyncio.get_running_loop().time())
        if stop is None:
            return
        if stop.stands:
            log.debug("agent %s: ending (%s)", self._cfg.host, stop.reason)
            self._session.observe(
                Phase.STOPPING, run_id=self._run_id, ranks=self._formed.ranks, reason=stop.reason
            )
        elif stop.sooner:
            log.debug("agent %s: %s brings the KILL deadline closer", self._cfg.host, stop.reason)
        self._spawn(self._end(stop.schedule), name="stop-all")

    def stop_for_signal(self, sig: int) -> None:
        """A signal to this process: stop the ranks by the signal table, ``sig`` first."""
        self.end_by(Signalled(sig=sig))

    async def _end(self, schedule: Sequence[StopStep]) -> None:
        assert self._ranks is not None
        await self._ranks.stop(schedule)
        self._endings, over = self._endings.stopped()
        if over:
            self._ended.set_result(None)

    @property
    def ending(self) -> bool:
        return self._endings.ending

    # ----- the command loop --------------------------------------------------------------------

    async def _read_commands(self) -> None:
        """Read and dispatch until the link ends; never blocks on a command's work."""
        while True:
            try:
                msg = await self._link.recv_message()
            except (ConnectionClosed, WireError) as exc:
                self.end_by(ControllerGone.link_lost(str(exc)))
                return
            # any frame is a sign of life
            self._liveness = self._liveness.heard(asyncio.get_running_loop().time())
            handler = self.commands.get(type(msg))
            if handler is None:
                log.warning(
                    "agent %s: ignoring %s from the controller (not a command of a running "
                    "session)",
                    self._cfg.host,
                    type(msg).__name__,
                )
                continue
            handler(self, msg)

    def _relay_lost(self, reason: str) -> None:
        """The relay's upstream control link went silent: the controller is as lost as on the join
        link."""
        self.end_by(ControllerGone.relay_silent(reason))

    async def _keep_alive(self) -> None:
        """Beat up the join link; a controller silent past the deadline is lost (it may be frozen:
        the link stays open)."""
        loop = asyncio.get_running_loop()
        wake = loop.time()
        while not self.ending:
            now = loop.time()
            # read afresh each wake: the command reader marks the controller heard in between
            live, due = self._liveness.woke(now, meant=wake)
            self._liveness = live
            if due is Wake.LOST:
                silence = self._cfg.deadlines.heartbeat_silence
                self.end_by(ControllerGone.silent(self._cfg.controller_addr, silence))
                return
            if due is Wake.BEAT:
                self._send(m.Heartbeat(sent_at=now))
            wake = live.next_deadline()
            await asyncio.sleep(max(wake - loop.time(), 0.0))

    async def _report_activity(self) -> None:
        """Every heartbeat interval, each running rank's pid, process state, CPU, last output and
        store connection, up the link (:mod:`.activity`)."""
        assert self._ranks is not None
        loop = asyncio.get_running_loop()
        while not self.ending:
            await asyncio.sleep(self._cfg.deadlines.heartbeat_interval)
            round_, ranks = self._ranks.activity(loop.time())
            if ranks and not self.ending:
                self._send(m.RankStats(round=round_, ranks=ranks))

    def _round_command(self, work: Coroutine[Any, Any, None], *, name: str) -> None:
        if self.ending:
            work.close()  # never started: nothing to undo
            log.debug("agent %s: %s ignored, the session is ending", self._cfg.host, name)
            return
        self._spawn(self._in_order(work, name), name=name)

    async def _in_order(self, work: Coroutine[Any, Any, None], name: str) -> None:
        async with self._round_work:
            try:
                await work
            except (OSError, FlodlError) as exc:
                self.end_by(RoundFailed(name=name, detail=str(exc)))

    def _on_open_round(self, msg: m.OpenRound) -> None:
        self._round_command(self._store.open_round(msg.round), name=f"open-round-{msg.round}")

    def _on_start_ranks(self, msg: m.StartRanks) -> None:
        self._round_command(self._start_round(msg), name=f"start-ranks-{msg.round}")

    async def _start_round(self, msg: m.StartRanks) -> None:
        assert self._ranks is not None
        if self._relay is not None and self._relay.round != msg.round:
            # from now on the relay takes this round's credentials only (ranks started early had
            # it opened at once)
            self._relay.open_round(msg.round)
        if not msg.master_addr:
            # The store rides the controller's port: the ranks reach it the way this agent does.
            msg = replace(
                msg, master_addr=self._cfg.controller_host, master_port=self._cfg.controller_port
            )
        await self._ranks.start(msg)
        self._session.observe(
            Phase.RUNNING, run_id=self._run_id, ranks=self._formed.ranks, round_=msg.round
        )

    def _on_restart_rank(self, msg: RestartRank) -> None:
        assert self._ranks is not None
        self._round_command(self._ranks.restart(msg), name=f"restart-rank-{msg.rank}")

    def _on_stop_ranks(self, msg: m.StopRanks) -> None:
        self._round_command(self._stop_round(msg), name=f"stop-ranks-{msg.round}")

    async def _stop_round(self, msg: m.StopRanks) -> None:
        assert self._ranks is not None
        await self._ranks.stop(stop_schedule(signal.SIGTERM, msg.grace_s), round_=msg.round)
        self._send(m.RanksStopped(round=msg.round))

    def _on_abort(self, msg: m.Abort) -> None:
        log.debug("agent %s: abort: %s", self._cfg.host, msg.reason)
        self.end_by(Aborted(command=msg))

    def _on_heartbeat(self, msg: m.Heartbeat) -> None:
        """The controller's beat: reading it already counted as a sign of life; nothing else to
        do."""

    def _on_finish(self, msg: m.Finish) -> None:
        self.end_by(Finished(command=msg))

    def _on_signal_ranks(self, msg: m.SignalRanks) -> None:
        # the launcher forwards only SIGUSR1/SIGUSR2; anything else down the link is not obeyed
        if msg.signal not in FORWARDED_SIGNALS:
            log.warning(
                "agent %s: ignoring a request to send signal %d", self._cfg.host, msg.signal
            )
            return
        reached = self.signal_ranks(msg.signal)
        log.debug(
            "agent %s: %s to ranks %s", self._cfg.host, signal.Signals(msg.signal).name, reached
        )
    def _on_store_owner_query(self, msg: so.StoreOwnerQuery) -> None:
        """Who made a store connection from this host: only this host's kernel can say, and only
        this agent's own processes (its ranks and their children, its user) are the run's here."""
        peer, ours = (msg.peer_host, msg.peer_port), (msg.our_host, msg.our_port)
        check = self._store_gate.check(peer, ours)
        detail = self._store_gate.named(check) if check.refused else ""
        answer = so.StoreOwnerAnswer(query=msg.query, standing=check.standing.value, detail=detail)
        self._send(answer)


_Serving.commands = {
    m.OpenRound: _Serving._on_open_round,
    m.StartRanks: _Serving._on_start_ranks,
    m.StopRanks: _Serving._on_stop_ranks,
    RestartRank: _Serving._on_restart_rank,
    m.Abort: _Serving._on_abort,
    m.Finish: _Serving._on_finish,
    m.Heartbeat: _Serving._on_heartbeat,
    m.SignalRanks: _Serving._on_signal_ranks,
    so.StoreOwnerQuery: _Serving._on_store_owner_query,
}
