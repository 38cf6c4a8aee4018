"""This host's rank processes: spawned with the torchrun environment, watched, reported, stopped.

Theory of operation. :meth:`RankProcesses.start` spawns one process per local
rank of a round (own process group, parent-death signal: :mod:`flodl_async.host.procs`),
forwards its output, and watches it: every exit goes up as ``RankExited`` with
its code or signal, its ``@record`` error file and its last stderr lines.

:meth:`RankProcesses.stop` follows the signal table
(:func:`flodl_async.verdict.stop_schedule`). Stops may overlap — a restart's
``StopRanks`` with a long grace, then an ``Abort`` with a short one — and the
shorter deadline wins: ranks already stopping are not signalled again from the
start of the table, they only get the new stop's KILL deadline, so whichever
KILL comes first ends them. A stop of every rank also closes the set: no rank
starts after it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..config.devices import DeviceSpec
from ..config.rankenv import INCARNATION_VAR, RankPlacement, RankSpec
from ..host.early import adopt, claim
from ..host.procs import ChildProcess, signal_group, spawn, stop_processes
from ..host.runtime import remove_rank_marker, write_rank_marker
from ..verdict import StopStep
from ..wire import messages as m
from ..wire.keys import Credential
from ..wire.restarts import RestartRank
from .activity import RankActivityTracker, store_connections
from .output import LINE_LIMIT, OutputSink, forward_output
from .rankargv import rank_gpu_ids, rank_launch

log = logging.getLogger("flodl_async.agent")

STDERR_TAIL_LINES = 20
#: Each tail line is cut to this many bytes, so a RankExited stays far below the join channel's
#: frame ceiling.
STDERR_TAIL_LINE_BYTES = 2 * 1024
ERROR_FILE_LIMIT = 32 * 1024


@dataclass(slots=True, kw_only=True)
class _Rank:
    rank: int
    local_rank: int
    round: int
    attempt: int
    proc: ChildProcess
    error_file: Path
    stderr_tail: collections.deque[str]
    activity: RankActivityTracker
    readers: list[asyncio.Task[None]] = field(default_factory=list)
    stopping: bool = False
    #: why this agent SIGKILLed it outside a stop (:meth:`RankProcesses.kill_dead`)
    killed_because: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankWorld:
    """What every round of this host's ranks shares: the formed world, as this host sees it."""

    formed: m.WorldFormed
    run_id: str
    host: str
    relay_socket: str
    data_socket: str
    #: (round, rank) → that rank's credential for that round (derived by the session; never the
    #: secret).
    credential: Callable[[int, int], Credential]
    devices: DeviceSpec
    host_env: Mapping[str, str]
    workdir: str | None
    #: GLOO/NCCL_SOCKET_IFNAME for the variables nothing else sets
    #: (:mod:`flodl_async.host.ifnames`); None: none.
    default_ifname: str | None = None


class RankProcesses:
    """The rank processes of one host session; their tasks live in the session's TaskGroup."""

    def __init__(
        self,
        *,
        host: str,
        world: RankWorld,
        output: OutputSink,
        scratch: Path,
        report: Callable[[m.RankExited], None],
        task_group: asyncio.TaskGroup,
        force: asyncio.Event,
        output_drain: float,
        output_idle: float,
        dead_grace: float,
    ) -> None:
        self._host = host
        self._world = world
        self._output = output
        self._scratch = scratch
        self._report = report
        self._tg = task_group
        self._force = force
        self._output_drain = output_drain
        self._output_idle = output_idle
        self._dead_grace = dead_grace
        self._ranks: dict[int, _Rank] = {}
        self._readers: set[asyncio.Task[None]] = set()
        self._closed = False
        # the round's StartRanks, for a rank restarted alone (:meth:`restart`)
        self._started: m.StartRanks | None = None
        # Held across one spawn and its registration, so a stop of everything sees every rank.
        self._spawning = asyncio.Lock()

    async def start(self, start: m.StartRanks) -> None:
        """Spawn this host's ranks of ``start.round`` (a rank that cannot start is reported as exit
        127); the first round's ranks the launcher started early are adopted instead when they are
        exactly these (:mod:`flodl_async.host.early`)."""
        self._started = start
        for local_rank, rank in enumerate(self._world.formed.ranks):
            if not await self._spawn_rank(start, local_rank, rank):
                return

    async def restart(self, msg: RestartRank) -> None:
        """Start ``msg.rank`` again, alone, as its incarnation ``msg.incarnation`` (a Trainer rank
        lost to a crash, under ``--max-restarts``): the same rank of the same round, so the same
        credential, with the incarnation in its environment for its ``TrainerHello``."""
        start = self._started
        ranks = self._world.formed.ranks
        if start is None or start.round != msg.round or msg.rank not in ranks:
            log.warning(
                "agent %s: not restarting rank %d of round %d: this host runs no such rank",
                self._host,
                msg.rank,
                msg.round,
            )
            return
        running = self._ranks.get(msg.rank)
        if running is not None and not self._exited(running):
            log.warning("agent %s: not restarting rank %d: it still runs", self._host, msg.rank)
            return
        log.info(
            "agent %s: restarting rank %d alone (incarnation %d)",
            self._host,
            msg.rank,
            msg.incarnation,
        )
        await self._spawn_rank(start, ranks.index(msg.rank), msg.rank, msg.incarnation)

    async def _spawn_rank(
        self, start: m.StartRanks, local_rank: int, rank: int, incarnation: int = 0
    ) -> bool:
        """Spawn one rank of ``start.round`` (one that cannot start is reported as exit 127);
        False once the session is stopping."""
        formed = self._world.formed
        placement = RankPlacement(
            rank=rank,
            local_rank=local_rank,
            world_size=formed.world_size,
            local_world_size=len(formed.ranks),
            group_rank=formed.group_rank,
            group_world_size=formed.group_world_size,
            master_addr=start.master_addr,
            master_port=start.master_port,
            run_id=self._world.run_id,
            restart_count=start.restart_count,
            max_restarts=formed.max_restarts,
        )
        again = f"-i{incarnation}" if incarnation else ""
        error_file = self._scratch / f"error-r{rank}-round{start.round}{again}.json"
        command, env = rank_launch(
            command=formed.command,
            run_env=formed.env,
            host_env=self._world.host_env,
            placement=placement,
            error_file=str(error_file),
            rank_spec=RankSpec(
                run_id=self._world.run_id,
                host=self._world.host,
                relay_socket=self._world.relay_socket,
                data_socket=self._world.data_socket,
                round=start.round,
                credential_hex=self._world.credential(start.round, rank).key.hex(),
            ),
            cuda_visible_devices=rank_gpu_ids(self._world.devices, len(formed.ranks)),
            default_ifname=self._world.default_ifname,
        )
        if incarnation:
            env[INCARNATION_VAR] = str(incarnation)
        async with self._spawning:
            if self._closed:
                log.debug(
                    "agent %s: not starting rank %d, the session is stopping", self._host, rank
                )
                return False
            key = (self._world.run_id, self._world.host, rank)
            early = (
                claim(key, command, env=env, cwd=self._world.workdir)
                if start.round == 0 and start.restart_count == 0 and not incarnation
                else None
            )
            if early is not None:
                log.debug("agent %s: rank %d was started early: adopted", self._host, rank)
            proc: ChildProcess
            try:
                proc = (
                    await adopt(early, line_limit=LINE_LIMIT)
                    if early is not None
                    else await spawn(
                        command, env=env, cwd=self._world.workdir, line_limit=LINE_LIMIT
                    )
                )
            except OSError as exc:
                self._report(
                    m.RankExited(
                        round=start.round,
                        rank=rank,
                        local_rank=local_rank,
                        host=self._host,
                        exit_code=127,
                        stderr_tail=(f"cannot start {command[0]!r}: {exc.strerror or exc}",),
                    )
                )
                return True
            # so that a next session can clean up what this rank forks, should this agent be
            # SIGKILLed
            try:
                write_rank_marker(self._scratch, pid=proc.pid, rank=rank)
            except OSError as exc:
                log.warning(
                    "agent %s: cannot record rank %d (pid %d) in %s: %s",
                    self._host,
                    rank,
                    proc.pid,
                    self._scratch,
                    exc,
                )
            activity = RankActivityTracker(
                rank=rank,
                pid=proc.pid,
                store_port=start.master_port,
                now=asyncio.get_running_loop().time(),
            )
            entry = _Rank(
                rank=rank,
                local_rank=local_rank,
                round=start.round,
                attempt=start.restart_count,
                proc=proc,
                error_file=error_file,
                stderr_tail=_tail(),
                activity=activity,
            )
            self._register(entry)
        return True

    def _register(self, entry: _Rank) -> None:
        proc = entry.proc
        assert proc.stdout is not None
        assert proc.stderr is not None
        self._output.rank_started(self._host, entry.attempt, entry.rank)
        tail = _TailLines(entry.stderr_tail)
        clock = asyncio.get_running_loop().time

        async def out(data: bytes) -> None:
            entry.activity.output(data, clock())
            await self._output.send(self._host, entry.attempt, entry.rank, "out", data)

        async def err(data: bytes) -> None:
            tail.feed(data)
            entry.activity.output(data, clock())
            await self._output.send(self._host, entry.attempt, entry.rank, "err", data)

        idle = self._output_idle
        entry.readers = [
            self._tg.create_task(
                forward_output(proc.stdout, idle=idle, emit=out), name=f"r{entry.rank}-stdout"
            ),
            self._tg.create_task(
                forward_output(proc.stderr, idle=idle, emit=err), name=f"r{entry.rank}-stderr"
            ),
        ]
        entry.readers[1].add_done_callback(lambda _task: tail.end())
        for reader in entry.readers:  # tracked past the rank's own entry, for cancel_readers()
            self._readers.add(reader)
            reader.add_done_callback(self._readers.discard)
        self._ranks[entry.rank] = entry
        self._tg.create_task(self._watch(entry), name=f"r{entry.rank}-watch")

    async def _drain(self, entries: Sequence[_Rank]) -> None:
        """Let the readers take the last lines of exited ranks (bounded: a grandchild may hold the
        pipe)."""
        readers = [r for e in entries for r in e.readers]
        if readers:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._output_drain):
                    await asyncio.gather(*readers, return_exceptions=True)

    async def _watch(self, entry: _Rank) -> None:
        code = await entry.proc.wait()
        signal_group(entry.proc.pid, signal.SIGKILL)  # no stragglers from the rank's group
        remove_rank_marker(self._scratch, entry.proc.pid)
        await self._drain([entry])
        failed = code != 0
        self._report(
            m.RankExited(
                round=entry.round,
                rank=entry.rank,
                local_rank=entry.local_rank,
                host=self._host,
                exit_code=code if code >= 0 else None,
                signal=-code if code < 0 else None,
                error_file=read_error_file(entry.error_file) if failed else "",
                stderr_tail=tuple(entry.stderr_tail) if failed else (),
                killed_because=entry.killed_because,
            )
        )

    def kill_dead(self, rank: int, reason: str) -> None:
        """The Trainer's coordinator declared ``rank`` dead (frozen, lying, cut off, or it raised):
        that process is gone for good (a restart is a new one), so KILL it if it still runs once its
        grace is over (KILL reaches a stopped process too).

        The grace is for a rank on its way out: one that raised sends its death record first and
        writes its traceback and its last line after, and a KILL at once cut that line off."""
        entry = self._ranks.get(rank)
        if entry is None or entry.stopping or self._exited(entry):
            return  # it died by itself (often the cause of the declaration): its exit says how
        self._tg.create_task(self._kill_after_grace(entry, reason), name=f"r{rank}-kill-dead")

    async def _kill_after_grace(self, entry: _Rank, reason: str) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._dead_grace):
                await entry.proc.wait()
        if entry.stopping or self._exited(entry):
            return  # it left in its grace, or a stop owns it now
        entry.killed_because = f"declared dead: {reason}"
        log.warning("agent %s: killing rank %d, declared dead: %s", self._host, entry.rank, reason)
        signal_group(entry.proc.pid, signal.SIGKILL)

    def signal_running(self, sig: int, *, skip: frozenset[int] = frozenset()) -> tuple[int, ...]:
        """Deliver ``sig`` (a forwarded SIGUSR1/SIGUSR2) to each running rank; the ranks it reached.

        The rank's own process only, as torchrun delivers it: its process group holds its DataLoader
        workers too, which would die of a signal they have no handler for."""
        reached = []
        for entry in self._ranks.values():
            if entry.rank in skip or entry.stopping or self._exited(entry):
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(entry.proc.pid, sig)
                reached.append(entry.rank)
        return tuple(sorted(reached))

    @staticmethod
    def _exited(entry: _Rank) -> bool:
        return entry.proc.returncode is not None or _has_exited(entry.proc.pid)

    def activity(self, now: float) -> tuple[int, tuple[m.RankActivity, ...]]:
        """The round and activity of every running rank (a few ``/proc`` reads each; the TCP tables
        only when a rank not yet at the store opened a socket)."""
        running = [e for e in self._ranks.values() if not e.stopping and e.proc.returncode is None]
        if not running:
            return -1, ()
        # read at most once per port per report, and only when a rank asks
        tables: dict[int, frozenset[int]] = {}

        def connections(port: int) -> frozenset[int]:
            if port not in tables:
                tables[port] = store_connections(port)
            return tables[port]

        reports = tuple(
            e.activity.sample(now, connections) for e in sorted(running, key=lambda e: e.rank)
        )
        return max(e.round for e in running), reports

    def cancel_readers(self) -> None:
        """Give up the output every reader still holds (the session is over; its link may never
        drain)."""
        for task in self._readers:
            task.cancel()
        self._readers.clear()

    async def stop(self, schedule: Sequence[StopStep], *, round_: int | None = None) -> None:
        """Stop the ranks of ``round_`` (every rank, and no more starts, when None) following
        ``schedule``.

        Returns when they are all gone and their output is drained.
        """
        async with self._spawning:
            if round_ is None:
                self._closed = True
            targets = [e for e in self._ranks.values() if round_ is None or e.round == round_]
        fresh = [e for e in targets if not e.stopping]
        already = [e for e in targets if e.stopping]
        for entry in fresh:
            entry.stopping = True
        # Ranks that are stopping already only take this stop's KILL deadline (the shorter one
        # wins).
        kill_only = (StopStep(after=schedule[-1].after, signal=signal.SIGKILL),) if schedule else ()
        async with asyncio.TaskGroup() as tg:
            if fresh:
                tg.create_task(
                    stop_processes([e.proc for e in fresh], schedule=schedule, force=self._force),
                    name="stop-ranks",
                )
            if already:
                tg.create_task(
                    stop_processes(
                        [e.proc for e in already], schedule=kill_only, force=self._force
                    ),
                    name="stop-ranks-sooner",
                )
        await self._drain(targets)
        for entry in targets:
            if self._ranks.get(entry.rank) is entry:
                del self._ranks[entry.rank]


def _tail() -> collections.deque[str]:
    return collections.deque(maxlen=STDERR_TAIL_LINES)


class _TailLines:
    """Cuts stderr chunks into the tail's lines (a partial line is held, bounded, until its newline
    or the end)."""

    def __init__(self, tail: collections.deque[str]) -> None:
        self._tail = tail
        self._partial = bytearray()

    def feed(self, data: bytes) -> None:
        self._partial += data
        *lines, rest = self._partial.split(b"\n")
        for line in lines:
            self._tail.append(_tail_line(bytes(line)))
        # enough to say "more bytes" follow
        self._partial = bytearray(rest[: STDERR_TAIL_LINE_BYTES + 1])

    def end(self) -> None:
        if self._partial.strip():
            self._tail.append(_tail_line(bytes(self._partial)))
        self._partial.clear()


def _tail_line(data: bytes) -> str:
    """One stderr line for the tail, cut to :data:`STDERR_TAIL_LINE_BYTES` (the whole line went to
    the output)."""
    line = data.rstrip(b"\n")
    if len(line) <= STDERR_TAIL_LINE_BYTES:
        return line.decode(errors="replace")
    return (
        line[:STDERR_TAIL_LINE_BYTES].decode(errors="ignore")
        + f" … ({len(line) - STDERR_TAIL_LINE_BYTES} more bytes)"
    )


def read_error_file(path: Path) -> str:
    """The root-cause traceback torch's ``@record`` wrote, or its message, or ''."""
    try:
        raw = path.read_text(errors="replace")[:ERROR_FILE_LIMIT]
    except OSError:
        return ""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        doc = json.loads(raw)
        message = doc.get("message", {})
        if isinstance(message, dict):
            extra = message.get("extraInfo", {})
            stack = extra.get("py_callstack") if isinstance(extra, dict) else None
            return str(stack or message.get("message", ""))
        return str(message)
    return raw


def _has_exited(pid: int) -> bool:
    """The child ``pid`` has exited, reaped or not (asyncio's watcher may not have reaped it yet);
    it is left for the watcher to reap."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True  # reaped already
    return info is not None
