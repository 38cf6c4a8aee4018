"""The controller: one event loop that binds the port, forms the world, supervises it, and tears down.

Theory of operation. ``run()`` walks the lifecycle: bind the mux → publish
status (``waiting``) → open the join window and start the local agents →
form the world (``forming``) → rendezvous round → ranks run (``training``) →
verdict (``done``/``failed``, published before cleanup) → teardown. Channel
handlers turn what arrives on the port into events on one queue; the
lifecycle consumes that queue, so every decision happens in one place and in
arrival order. Nothing here imports torch.

Supervision: before formation, the first failure ends the run. After it, the
first non-zero rank exit of the current round ends the round; with restarts
left, every agent stops that round's ranks and a new rendezvous round starts
(``TORCHELASTIC_RESTART_COUNT`` + 1); otherwise the verdict names the first
failing rank, its host, its exit code or signal, its traceback and its last
stderr lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .agent import HostSession, RankOutput, SessionConfig
from .cluster import WorkerSpec
from .errors import ConnectionClosed, FlodlError, WireError
from .membership import Admitted, Failed, Formed, JoinConfig, JoinedMember, JoinWindow, WindowState
from .net.framed import FramedProtocol
from .net.http import StatusHttpProtocol
from .net.mux import PortMux
from .net.service import FramedService
from .net.timeouts import scaled
from .status import MemberStatus, Phase, RankStatus, StatusBoard, StatusSnapshot
from .wire import messages as m
from .wire.channels import Channel
from .wire.frame import PROTOCOL_VERSION
from .wire.keys import SessionKeys
from .wire.schema import Message

log = logging.getLogger("flodl_async.launch")

JOIN_HANDSHAKE_TIMEOUT = 10.0
STORE_READY_TIMEOUT = 120.0
STOP_ACK_MARGIN = 10.0


class ExitCode(enum.IntEnum):
    """``flodl-launch`` exit codes (documented in the README)."""

    OK = 0
    INTERNAL = 1
    USAGE = 2
    FORMATION = 3
    RANK_FAILURE = 4
    INTERRUPTED = 130


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """The run's verdict: an exit code, a one-line reason, and details for the operator."""

    exit_code: ExitCode
    reason: str
    details: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchPlan:
    """Everything the controller needs, resolved from the command line and the cluster file."""

    run_id: str
    secret: bytes
    bind_host: str
    port: int
    join: JoinConfig
    local_workers: tuple[WorkerSpec, ...]
    command: tuple[str, ...]
    cluster_env: Mapping[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    log_dir: Path | None = None
    stop_grace: float = 10.0


# ----- events on the lifecycle queue -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Joined:
    member: JoinedMember


@dataclass(frozen=True, slots=True)
class _HostMessage:
    host: str
    msg: Message


@dataclass(frozen=True, slots=True)
class _HostLost:
    host: str
    reason: str


@dataclass(frozen=True, slots=True)
class _StoreReady:
    round: int
    addr: str
    port: int


@dataclass(frozen=True, slots=True)
class _Interrupt:
    signal_name: str


_Event = _Joined | _HostMessage | _HostLost | _StoreReady | _Interrupt


@dataclass(frozen=True, slots=True)
class _RoundSucceeded:
    pass


@dataclass(frozen=True, slots=True)
class _RankFailed:
    exit: m.RankExited


class Controller:
    """Runs one launch from bind to teardown."""

    def __init__(self, plan: LaunchPlan, *, output: RankOutput) -> None:
        self.plan = plan
        self._output = output
        self._keys = SessionKeys.derive(plan.secret, plan.run_id)
        self._join_keys = SessionKeys.derive(plan.secret, "")
        self._events: asyncio.Queue[_Event] = asyncio.Queue()
        self._links: dict[str, FramedProtocol] = {}
        self._board = StatusBoard()
        self._mux = PortMux(host=plan.bind_host, port=plan.port)
        self._window: JoinWindow | None = None
        self._phase = Phase.WAITING
        self._started_at = time.time()
        self._world: Formed | None = None
        self._rank_states: dict[int, RankStatus] = {}
        self._restart_count = 0
        self._interrupts = 0
        self._local_agents: list[HostSession] = []
        self._verdict = ""
        self._exit_code: int | None = None

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
        self._mux.register(Channel.STATUS, lambda: StatusHttpProtocol(self._board, refresh=self._publish))
        await self._mux.start()
        self._publish()

    def interrupt(self, signal_name: str) -> None:
        """SIGINT/SIGTERM: the first stops gracefully, the second forces."""
        self._interrupts += 1
        if self._interrupts >= 2:
            log.warning("second %s: forcing the stop (KILL now)", signal_name)
            for agent in self._local_agents:
                agent.force_stop()
            for link in self._links.values():
                with contextlib.suppress(ConnectionClosed):
                    link.send(m.Abort(reason=f"forced stop ({signal_name})", grace_s=0.0))
        self._events.put_nowait(_Interrupt(signal_name))

    async def run(self) -> RunResult:
        """The whole lifecycle; call :meth:`bind` first."""
        plan = self.plan
        now = time.monotonic()
        self._window = JoinWindow(plan.join, opened_at=now, protocol_version=PROTOCOL_VERSION)
        result: RunResult
        async with asyncio.TaskGroup() as tg:
            for channel, handler, keys in (
                (Channel.JOIN, self._handle_join, self._join_keys),
                (Channel.RENDEZVOUS, self._handle_rendezvous, self._keys),
                (Channel.CONTROL, self._handle_control, self._keys),
            ):
                service = FramedService(channel=channel, keys=keys, handler=handler, task_group=tg)
                self._mux.register(channel, service.protocol_factory)
            j = plan.join
            log.info(
                "window open (quorum %d ranks, target %s, window %gs, cap %gs, admission: %s) — status at http://%s:%d/",
                j.min_rank_start,
                j.target_ranks if j.target_ranks is not None else "none",
                j.join_timeout,
                j.max_join_timeout,
                "open" if j.open_admission else "pre-shared secret",
                "127.0.0.1" if plan.bind_host in ("0.0.0.0", "127.0.0.1") else plan.bind_host,
                self.port,
            )
            agent_tasks = [tg.create_task(self._run_local_agent(worker), name=f"agent-{worker.host}") for worker in plan.local_workers]
            try:
                result = await self._lifecycle()
            except Exception as exc:  # a bug: still tear down and leave nothing behind
                log.exception("controller failed")
                result = RunResult(exit_code=ExitCode.INTERNAL, reason=f"internal error: {exc!r}")
            await self._teardown(result, agent_tasks)
        return result

    async def aclose(self) -> None:
        """Close the port (idempotent)."""
        await self._mux.aclose()

    # ----- lifecycle ------------------------------------------------------------------------

    async def _lifecycle(self) -> RunResult:
        formed = await self._form_world()
        if isinstance(formed, RunResult):
            return formed
        self._world = formed
        self._set_phase(Phase.FORMING)
        log.info(
            "world formed — %d ranks across %d host(s) after %.1fs (%s)",
            formed.world_size,
            len(formed.members),
            formed.elapsed,
            formed.reason,
        )
        store_host = self._store_host(formed)
        for index, member in enumerate(formed.members):
            self._tell(
                member.host,
                m.WorldFormed(
                    world_size=formed.world_size,
                    ranks=member.ranks,
                    group_rank=index,
                    group_world_size=len(formed.members),
                    store_host=member.host == store_host,
                    command=self.plan.command,
                    env=dict(self.plan.cluster_env),  # the host's own env is applied by its agent
                    max_restarts=self.plan.max_restarts,
                ),
            )
        round_ = 0
        while True:
            outcome = await self._run_round(round_, store_host)
            if isinstance(outcome, RunResult):
                return outcome
            if isinstance(outcome, _RoundSucceeded):
                return RunResult(exit_code=ExitCode.OK, reason=f"all {formed.world_size} ranks exited 0")
            failure = outcome.exit
            if self._restart_count >= self.plan.max_restarts:
                return self._rank_failure_result(failure)
            log.warning("%s; restarting the world (restart %d of %d)", _describe_exit(failure), self._restart_count + 1, self.plan.max_restarts)
            stopped = await self._stop_round(round_)
            if stopped is not None:
                return stopped
            self._restart_count += 1
            round_ += 1

    async def _form_world(self) -> Formed | RunResult:
        window = self._require_window()
        while True:
            now = time.monotonic()
            verdict = window.poll(now)
            if isinstance(verdict, Formed):
                return verdict
            if isinstance(verdict, Failed):
                return RunResult(exit_code=ExitCode.FORMATION, reason=f"the world did not form: {verdict.reason}")
            deadline = window.next_deadline(now)
            timeout = None if deadline is None else max(deadline - now, 0.0)
            try:
                async with asyncio.timeout(timeout):
                    event = await self._events.get()
            except TimeoutError:
                continue
            if isinstance(event, _Joined):
                member = event.member
                log.info(
                    'host "%s" joined with ranks %s (%s) — %d rank(s) in, target %s',
                    member.host,
                    list(member.ranks),
                    ", ".join(member.devices),
                    window.joined_ranks,
                    window.config.target_ranks,
                )
                self._publish()
            elif isinstance(event, _HostLost):
                window.member_lost(event.host, now=time.monotonic())
                if window.state is WindowState.OPEN:  # not a member: a failed local agent that never joined
                    window.abort(f"agent on host {event.host!r} failed before joining: {event.reason}")
            elif isinstance(event, _Interrupt):
                return RunResult(exit_code=ExitCode.INTERRUPTED, reason=f"interrupted by {event.signal_name} while the join window was open")

    def _store_host(self, formed: Formed) -> str:
        """The controller's own host when it runs ranks, else the host of global rank 0."""
        local = {w.host for w in self.plan.local_workers}
        for member in formed.members:
            if member.host in local:
                return member.host
        return formed.members[0].host

    async def _run_round(self, round_: int, store_host: str) -> _RoundSucceeded | _RankFailed | RunResult:
        world = self._require_world()
        self._tell(store_host, m.OpenRound(round=round_))
        ready: _StoreReady | None = None
        try:
            async with asyncio.timeout(scaled(STORE_READY_TIMEOUT)):
                while ready is None:
                    event = await self._events.get()
                    if isinstance(event, _StoreReady) and event.round == round_:
                        ready = event
                    elif isinstance(event, _HostLost):
                        return RunResult(exit_code=ExitCode.RANK_FAILURE, reason=f"agent on host {event.host!r} was lost during rendezvous: {event.reason}")
                    elif isinstance(event, _Interrupt):
                        return RunResult(exit_code=ExitCode.INTERRUPTED, reason=f"interrupted by {event.signal_name} during rendezvous")
        except TimeoutError:
            return RunResult(
                exit_code=ExitCode.FORMATION, reason=f"the store host {store_host!r} did not report its store within {scaled(STORE_READY_TIMEOUT):g}s"
            )
        for member in world.members:
            self._tell(member.host, m.StartRanks(round=round_, restart_count=self._restart_count, master_addr=ready.addr, master_port=ready.port))
            for local_rank, rank in enumerate(member.ranks):
                self._rank_states[rank] = RankStatus(rank=rank, host=member.host, local_rank=local_rank, state="running")
        self._set_phase(Phase.TRAINING)
        log.info("ranks started: round %d, restart %d, store at %s:%d", round_, self._restart_count, ready.addr, ready.port)
        succeeded: set[int] = set()
        while True:
            event = await self._events.get()
            if isinstance(event, _HostMessage) and isinstance(event.msg, m.RankExited) and event.msg.round == round_:
                exit_ = event.msg
                failed = exit_.exit_code != 0 or exit_.signal is not None
                self._rank_states[exit_.rank] = RankStatus(
                    rank=exit_.rank,
                    host=exit_.host,
                    local_rank=exit_.local_rank,
                    state="failed" if failed else "exited",
                    exit_code=exit_.exit_code,
                    signal=exit_.signal,
                )
                self._publish()
                if failed:
                    log.info("%s", _describe_exit(exit_))
                    return _RankFailed(exit=exit_)
                log.info("rank %d on %s exited with code 0", exit_.rank, exit_.host)
                succeeded.add(exit_.rank)
                if len(succeeded) == world.world_size:
                    return _RoundSucceeded()
            elif isinstance(event, _HostLost):
                return RunResult(exit_code=ExitCode.RANK_FAILURE, reason=f"agent on host {event.host!r} was lost mid-run: {event.reason}")
            elif isinstance(event, _Interrupt):
                return RunResult(exit_code=ExitCode.INTERRUPTED, reason=f"interrupted by {event.signal_name}")

    async def _stop_round(self, round_: int) -> RunResult | None:
        world = self._require_world()
        for member in world.members:
            self._tell(member.host, m.StopRanks(round=round_, reason="restarting the world", grace_s=self.plan.stop_grace))
        waiting = {member.host for member in world.members}
        try:
            async with asyncio.timeout(self.plan.stop_grace + scaled(STOP_ACK_MARGIN)):
                while waiting:
                    event = await self._events.get()
                    if isinstance(event, _HostMessage) and isinstance(event.msg, m.RanksStopped) and event.msg.round == round_:
                        waiting.discard(event.host)
                    elif isinstance(event, _HostLost):
                        return RunResult(exit_code=ExitCode.RANK_FAILURE, reason=f"agent on host {event.host!r} was lost while restarting: {event.reason}")
                    elif isinstance(event, _Interrupt):
                        return RunResult(exit_code=ExitCode.INTERRUPTED, reason=f"interrupted by {event.signal_name} while restarting")
        except TimeoutError:
            return RunResult(exit_code=ExitCode.RANK_FAILURE, reason=f"host(s) {sorted(waiting)} did not stop their ranks for the restart")
        return None

    def _rank_failure_result(self, exit_: m.RankExited) -> RunResult:
        details: list[str] = []
        if exit_.error_file:
            details.append("traceback (from the rank's error file):")
            details.extend(f"  {line}" for line in exit_.error_file.rstrip().splitlines())
        if exit_.stderr_tail:
            details.append(f"last {len(exit_.stderr_tail)} stderr line(s) of rank {exit_.rank}:")
            details.extend(f"  {line}" for line in exit_.stderr_tail)
        restarts = f" after {self._restart_count} restart(s)" if self.plan.max_restarts else ""
        return RunResult(exit_code=ExitCode.RANK_FAILURE, reason=_describe_exit(exit_) + restarts, details="\n".join(details))

    async def _teardown(self, result: RunResult, agent_tasks: list[asyncio.Task[None]]) -> None:
        self._verdict = result.reason
        self._exit_code = int(result.exit_code)
        self._set_phase(Phase.DONE if result.exit_code is ExitCode.OK else Phase.FAILED)  # published before cleanup
        grace = 0.0 if self._interrupts >= 2 else self.plan.stop_grace
        for link in list(self._links.values()):
            with contextlib.suppress(ConnectionClosed):
                if result.exit_code is ExitCode.OK:
                    link.send(m.Finish())
                else:
                    link.send(m.Abort(reason=result.reason, grace_s=grace))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace + scaled(5.0)):
                await asyncio.gather(*(link.wait_closed() for link in self._links.values()))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(scaled(5.0)):
                await asyncio.gather(*agent_tasks, return_exceptions=True)
        for task in agent_tasks:
            task.cancel()  # a stuck local agent: cancellation runs its finally, which kills its ranks
        await self._mux.aclose()

    async def _run_local_agent(self, worker: WorkerSpec) -> None:
        agent = HostSession(
            SessionConfig(
                controller_host="127.0.0.1",
                controller_port=self.port,
                secret=self.plan.secret,
                host=worker.host,
                devices=worker.devices,
                env=worker.env,
                workdir=worker.workdir,
            ),
            output=self._output,
        )
        self._local_agents.append(agent)
        try:
            await agent.run()
        except FlodlError as exc:
            self._events.put_nowait(_HostLost(worker.host, str(exc)))
        except Exception as exc:
            log.exception("local agent on %s failed", worker.host)
            self._events.put_nowait(_HostLost(worker.host, repr(exc)))

    def _tell(self, host: str, msg: Message) -> None:
        """Send to a host's agent; a link that just died is reported by its handler as _HostLost."""
        with contextlib.suppress(ConnectionClosed):
            self._links[host].send(msg)

    # ----- channel handlers -------------------------------------------------------------------

    async def _handle_join(self, link: FramedProtocol) -> None:
        window = self._require_window()
        async with asyncio.timeout(scaled(JOIN_HANDSHAKE_TIMEOUT)):
            hello = await link.recv_message()
        if not isinstance(hello, m.JoinHello):
            log.warning("join channel: %s opened with %s, not JoinHello; closing", link.peer_label, type(hello).__name__)
            return
        outcome = window.request_join(host=hello.host, devices=hello.devices, now=time.monotonic())
        if not isinstance(outcome, Admitted):
            log.warning('join channel: rejected host "%s" from %s: %s', hello.host, link.peer_label, outcome.reason)
            link.send(m.JoinReject(reason=outcome.reason))
            await link.drain()
            return
        try:
            link.send(m.JoinAccept(ranks=outcome.member.ranks, run_id=self.plan.run_id, formation_wait_s=window.config.max_join_timeout))
        except ConnectionClosed:
            window.retract(hello.host)
            return
        self._links[hello.host] = link
        self._events.put_nowait(_Joined(outcome.member))
        try:
            while True:
                self._events.put_nowait(_HostMessage(hello.host, await link.recv_message()))
        except (ConnectionClosed, WireError) as exc:
            self._events.put_nowait(_HostLost(hello.host, str(exc)))

    async def _handle_rendezvous(self, link: FramedProtocol) -> None:
        while True:
            msg = await link.recv_message()
            if isinstance(msg, m.StoreAddress):
                self._events.put_nowait(_StoreReady(msg.round, msg.host or link.peer_host, msg.port))

    async def _handle_control(self, link: FramedProtocol) -> None:
        while True:
            msg = await link.recv_message()
            if isinstance(msg, m.RankHello):
                state = self._rank_states.get(msg.rank)
                if state is not None:
                    self._rank_states[msg.rank] = RankStatus(rank=msg.rank, host=state.host, local_rank=state.local_rank, state="connected", pid=msg.pid)
                    self._publish()
                link.send(m.RankWelcome(rank=msg.rank, run_id=self.plan.run_id))
            elif isinstance(msg, m.Heartbeat):
                link.send(m.Heartbeat(sent_at=msg.sent_at, rank=msg.rank))

    # ----- status ------------------------------------------------------------------------------

    def _set_phase(self, phase: Phase) -> None:
        self._phase = phase
        self._publish()

    def _publish(self) -> None:
        window = self._window
        members = window.members if window is not None else ()
        stats = self._mux.statistics()
        self._board.publish(
            StatusSnapshot(
                run_id=self.plan.run_id,
                phase=self._phase,
                started_at=self._started_at,
                updated_at=time.time(),
                world_size=self._world.world_size if self._world is not None else 0,
                joined_ranks=window.joined_ranks if window is not None else 0,
                min_rank_start=self.plan.join.min_rank_start,
                target_ranks=self.plan.join.target_ranks or 0,
                restart_count=self._restart_count,
                members=tuple(
                    MemberStatus(
                        host=mb.host, ranks=mb.ranks, devices=mb.devices, joined_at=self._started_at + (mb.joined_at - (window.opened_at if window else 0))
                    )
                    for mb in members
                ),
                ranks=tuple(self._rank_states[r] for r in sorted(self._rank_states)),
                verdict=self._verdict,
                exit_code=self._exit_code,
                connections={"routed": stats.routed, "dropped": stats.dropped},
            )
        )

    def _require_window(self) -> JoinWindow:
        if self._window is None:
            raise RuntimeError("join window not open")
        return self._window

    def _require_world(self) -> Formed:
        if self._world is None:
            raise RuntimeError("world not formed")
        return self._world


def _describe_exit(exit_: m.RankExited) -> str:
    if exit_.signal is not None:
        try:
            name = signal.Signals(exit_.signal).name
        except ValueError:
            name = f"signal {exit_.signal}"
        how = f"was killed by {name}"
    else:
        how = f"exited with code {exit_.exit_code}"
    return f"rank {exit_.rank} (local rank {exit_.local_rank}) on host {exit_.host!r} {how}"
