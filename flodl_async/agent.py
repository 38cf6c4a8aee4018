"""The agent: one per host. Joins the run, hosts the relay (and the store), runs and reports its ranks.

Theory of operation. The agent dials the controller's join channel and asks
to join with its host name and devices. Once admitted it waits for
``WorldFormed`` (its global ranks and the command), starts the relay, and
then follows the controller's orders on the join link, which stays open for
the whole run:

- ``OpenRound`` (store host only): bind a listening socket, start the store
  process on it, and report the address on the rendezvous channel;
- ``StartRanks``: start this host's ranks with the torchrun environment; each
  rank's exit (code or signal, its error file, its last stderr lines) goes up
  as ``RankExited``;
- ``StopRanks``: stop the ranks of a round (TERM, KILL at one deadline) and
  answer ``RanksStopped``; the agent stays for the next round;
- ``Abort`` / ``Finish``: stop everything and leave.

Losing the join link means the controller is gone: the agent stops its ranks
at once and exits. The controller's own host runs this same code in-process,
over loopback; ``flodl-agent`` is the stand-alone form.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from . import __version__
from .cluster import DeviceKind, DeviceSpec, parse_gpu_ids
from .errors import ConfigError, ConnectionClosed, FlodlError, LaunchError, WireError
from .net.framed import FramedProtocol, open_framed
from .net.tcpstore import StoreServer
from .net.timeouts import scaled
from .procs import signal_group, spawn, stop_processes
from .rankenv import RankPlacement, RankSpec, rank_environment
from .relay import Relay
from .store import BACKEND_VARIABLE as STORE_BACKEND_VARIABLE
from .store import TorchStoreProcess
from .wire import messages as m
from .wire.channels import Channel
from .wire.keys import SessionKeys, secret_from_hex
from .wire.schema import Message

log = logging.getLogger("flodl_async.agent")

JOIN_REPLY_TIMEOUT = 30.0
FORMATION_WAIT_MARGIN = 30.0
STDERR_TAIL_LINES = 20
ERROR_FILE_LIMIT = 32 * 1024
#: Lines longer than this are forwarded in pieces rather than buffered without bound.
LINE_LIMIT = 64 * 1024


class RankOutput:
    """Forwards rank output line by line with ``[host:rN]`` prefixes, and to per-rank log files."""

    def __init__(self, *, stdout: BinaryIO, stderr: BinaryIO, log_dir: Path | None = None) -> None:
        self._stdout = stdout
        self._stderr = stderr
        self._log_dir = log_dir
        self._files: dict[int, BinaryIO] = {}

    def rank_started(self, rank: int) -> None:
        """Open the rank's log file now, so every rank has one even if it never prints."""
        self._log_file(rank)

    def _log_file(self, rank: int) -> BinaryIO | None:
        if self._log_dir is None:
            return None
        file = self._files.get(rank)
        if file is None:
            self._log_dir.mkdir(parents=True, exist_ok=True)
            file = open(self._log_dir / f"rank{rank}.log", "ab")  # noqa: SIM115 — kept open for the run, closed in close()
            self._files[rank] = file
        return file

    def line(self, host: str, rank: int, *, err: bool, data: bytes) -> None:
        """One whole line (one write, so lines from different ranks never interleave)."""
        if not data.endswith(b"\n"):
            data += b"\n"
        target = self._stderr if err else self._stdout
        target.write(f"[{host}:r{rank}] ".encode() + data)
        target.flush()
        file = self._log_file(rank)
        if file is not None:
            file.write(data)
            file.flush()

    def close(self) -> None:
        """Close the per-rank log files."""
        for file in self._files.values():
            file.close()
        self._files.clear()


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentConfig:
    """Everything an agent needs to join a run."""

    controller_host: str
    controller_port: int
    secret: bytes
    host: str
    devices: DeviceSpec
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str | None = None
    advertise_addr: str | None = None


@dataclass(slots=True)
class _Rank:
    rank: int
    local_rank: int
    round: int
    proc: asyncio.subprocess.Process
    error_file: Path
    stderr_tail: collections.deque[str]
    readers: list[asyncio.Task[None]]


def detect_gpu_count() -> int:
    """GPUs on this host, without importing torch: the /dev/nvidiaN device nodes (none means 0)."""
    with contextlib.suppress(OSError):
        return sum(1 for name in os.listdir("/dev") if name.startswith("nvidia") and name[6:].isdigit())
    return 0


def device_labels(devices: DeviceSpec) -> tuple[str, ...]:
    """The device labels this host offers."""
    return devices.labels(detect_gpu_count() if devices.kind is DeviceKind.ALL_GPUS else 0)


class Agent:
    """One host's agent."""

    def __init__(self, config: AgentConfig, *, output: RankOutput) -> None:
        self.config = config
        self._output = output
        self._ranks: dict[int, _Rank] = {}
        self._store: StoreServer | TorchStoreProcess | None = None
        self._force = asyncio.Event()
        self._workdir = Path(tempfile.mkdtemp(prefix="flodl-agent-"))
        self._rendezvous: FramedProtocol | None = None

    async def run(self) -> None:
        """Join, serve the run, and return when it ends; raises :class:`FlodlError` on failure."""
        cfg = self.config
        join_keys = SessionKeys.derive(cfg.secret, "")
        devices = device_labels(cfg.devices)
        if not devices:
            raise ConfigError(f"host {cfg.host!r} has no devices to offer (devices: {cfg.devices.kind.value}, 0 GPUs found)")
        try:
            link = await open_framed(cfg.controller_host, cfg.controller_port, channel=Channel.JOIN, keys=join_keys)
        except OSError as exc:
            raise LaunchError(f"agent {cfg.host}: cannot reach the controller at {cfg.controller_host}:{cfg.controller_port}: {exc.strerror or exc}") from exc
        try:
            link.send(m.JoinHello(host=cfg.host, devices=devices, pid=os.getpid(), agent_version=__version__))
            async with asyncio.timeout(scaled(JOIN_REPLY_TIMEOUT)):
                reply = await self._recv(link, "waiting for the join reply")
            if isinstance(reply, m.JoinReject):
                raise LaunchError(f"agent {cfg.host}: join rejected by the controller: {reply.reason}")
            if not isinstance(reply, m.JoinAccept):
                raise LaunchError(f"agent {cfg.host}: unexpected {type(reply).__name__} instead of a join reply")
            keys = SessionKeys.derive(cfg.secret, reply.run_id)
            async with asyncio.timeout(reply.formation_wait_s + scaled(FORMATION_WAIT_MARGIN)):
                formed = await self._recv(link, "waiting for the world to form")
            if isinstance(formed, m.Abort):
                raise LaunchError(f"agent {cfg.host}: the controller aborted before formation: {formed.reason}")
            if not isinstance(formed, m.WorldFormed):
                raise LaunchError(f"agent {cfg.host}: unexpected {type(formed).__name__} instead of WorldFormed")
            await self._serve(link, keys, reply.run_id, formed)
        finally:
            await self._stop_everything(grace=0.0 if self._force.is_set() else 5.0)
            await link.aclose(grace=1.0)
            shutil.rmtree(self._workdir, ignore_errors=True)

    def force_stop(self) -> None:
        """Kill ranks now instead of waiting out a grace period (second signal)."""
        self._force.set()

    async def _recv(self, link: FramedProtocol, doing: str) -> Message:
        try:
            return await link.recv_message()
        except ConnectionClosed as exc:
            raise LaunchError(
                f"agent {self.config.host}: the controller closed the join link while {doing} — a session-secret mismatch, or the controller stopped"
            ) from exc
        except WireError as exc:
            raise LaunchError(f"agent {self.config.host}: bad frame from the controller while {doing}: {exc}") from exc

    async def _serve(self, link: FramedProtocol, keys: SessionKeys, run_id: str, formed: m.WorldFormed) -> None:
        cfg = self.config
        log.debug("agent %s: world formed, ranks %s of %d", cfg.host, list(formed.ranks), formed.world_size)
        async with asyncio.TaskGroup() as tg:
            relay = Relay(
                socket_path=str(self._workdir / "relay.sock"),
                keys=keys,
                controller_host=cfg.controller_host,
                controller_port=cfg.controller_port,
                task_group=tg,
            )
            await relay.start()
            rank_spec = RankSpec(run_id=run_id, host=cfg.host, relay_socket=relay.socket_path, secret_hex=cfg.secret.hex())
            try:
                while True:
                    try:
                        msg = await link.recv_message()
                    except (ConnectionClosed, WireError) as exc:
                        raise LaunchError(f"agent {cfg.host}: lost the join link to the controller ({exc}); stopping this host's ranks") from exc
                    if isinstance(msg, m.OpenRound):
                        await self._open_round(msg.round, keys)
                    elif isinstance(msg, m.StartRanks):
                        await self._start_ranks(msg, formed, rank_spec, link, tg)
                    elif isinstance(msg, m.StopRanks):
                        await self._stop_round(msg.round, grace=msg.grace_s)
                        link.send(m.RanksStopped(round=msg.round))
                    elif isinstance(msg, m.Abort):
                        log.debug("agent %s: abort: %s", cfg.host, msg.reason)
                        await self._stop_everything(grace=msg.grace_s)
                        return
                    elif isinstance(msg, m.Finish):
                        await self._stop_everything(grace=5.0)
                        return
            finally:
                await self._stop_everything(grace=0.0)
                await relay.aclose()
                if self._rendezvous is not None:
                    self._rendezvous.close()

    async def _open_round(self, round_: int, keys: SessionKeys) -> None:
        """Serve a fresh TCPStore for this round from our own loop and report its address.

        The store speaks torch's protocol from Python (:mod:`flodl_async.storeproto`), so the
        store host imports no torch and starts no process: the ranks' own ``import torch`` is
        the only one on the critical path. Torch makes a new store for every restart round
        (no key prefix per attempt), hence a new socket and state per round.
        """
        await self._stop_store()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", 0))
        listener.listen(1024)
        port = listener.getsockname()[1]
        if os.environ.get(STORE_BACKEND_VARIABLE, "python") == "torch":
            self._store = await TorchStoreProcess.start(listener, run_id=keys.run_id)
        else:
            self._store = StoreServer()
            await self._store.start(listener)
        if self._rendezvous is None:
            self._rendezvous = await open_framed(self.config.controller_host, self.config.controller_port, channel=Channel.RENDEZVOUS, keys=keys)
        self._rendezvous.send(m.StoreAddress(round=round_, host=self.config.advertise_addr or "", port=port))
        await self._rendezvous.drain()

    async def _start_ranks(self, start: m.StartRanks, formed: m.WorldFormed, spec: RankSpec, link: FramedProtocol, tg: asyncio.TaskGroup) -> None:
        cfg = self.config
        gpu_ids: tuple[int, ...] | None = None
        if cfg.devices.is_gpu:
            gpu_ids = cfg.devices.gpu_ids if cfg.devices.kind is DeviceKind.GPU_LIST else tuple(range(len(formed.ranks)))
        for local_rank, rank in enumerate(formed.ranks):
            placement = RankPlacement(
                rank=rank,
                local_rank=local_rank,
                world_size=formed.world_size,
                local_world_size=len(formed.ranks),
                group_rank=formed.group_rank,
                group_world_size=formed.group_world_size,
                master_addr=start.master_addr,
                master_port=start.master_port,
                run_id=spec.run_id,
                restart_count=start.restart_count,
                max_restarts=formed.max_restarts,
            )
            error_file = self._workdir / f"error-r{rank}-round{start.round}.json"
            env = rank_environment(
                os.environ,
                placement,
                error_file=str(error_file),
                rank_spec=spec,
                cluster_env=formed.env,
                host_env=cfg.env,
                cuda_visible_devices=gpu_ids,
            )
            try:
                proc = await spawn(formed.command, env=env, cwd=cfg.workdir, line_limit=LINE_LIMIT)
            except OSError as exc:
                link.send(
                    m.RankExited(
                        round=start.round,
                        rank=rank,
                        local_rank=local_rank,
                        host=cfg.host,
                        exit_code=127,
                        stderr_tail=(f"cannot start {formed.command[0]!r}: {exc.strerror or exc}",),
                    )
                )
                continue
            self._output.rank_started(rank)
            tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
            entry = _Rank(rank=rank, local_rank=local_rank, round=start.round, proc=proc, error_file=error_file, stderr_tail=tail, readers=[])
            assert proc.stdout is not None
            assert proc.stderr is not None
            entry.readers = [
                tg.create_task(self._forward(proc.stdout, rank, err=False, tail=None), name=f"r{rank}-stdout"),
                tg.create_task(self._forward(proc.stderr, rank, err=True, tail=tail), name=f"r{rank}-stderr"),
            ]
            self._ranks[rank] = entry
            tg.create_task(self._watch(entry, link), name=f"r{rank}-watch")

    async def _forward(self, stream: asyncio.StreamReader, rank: int, *, err: bool, tail: collections.deque[str] | None) -> None:
        host = self.config.host
        while True:
            try:
                data = await stream.readuntil(b"\n")
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    self._output.line(host, rank, err=err, data=exc.partial)
                    if tail is not None:
                        tail.append(exc.partial.decode(errors="replace").rstrip("\n"))
                return
            except asyncio.LimitOverrunError as exc:
                data = await stream.readexactly(max(exc.consumed, 1))
            self._output.line(host, rank, err=err, data=data)
            if tail is not None:
                tail.append(data.decode(errors="replace").rstrip("\n"))

    async def _watch(self, entry: _Rank, link: FramedProtocol) -> None:
        code = await entry.proc.wait()
        signal_group(entry.proc.pid, signal.SIGKILL)  # no stragglers from the rank's group
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await asyncio.gather(*entry.readers, return_exceptions=True)
        report = m.RankExited(
            round=entry.round,
            rank=entry.rank,
            local_rank=entry.local_rank,
            host=self.config.host,
            exit_code=code if code >= 0 else None,
            signal=-code if code < 0 else None,
            error_file=_read_error_file(entry.error_file) if code != 0 else "",
            stderr_tail=tuple(entry.stderr_tail) if code != 0 else (),
        )
        with contextlib.suppress(ConnectionClosed):
            link.send(report)

    async def _stop_round(self, round_: int, *, grace: float) -> None:
        entries = [e for e in self._ranks.values() if e.round == round_]
        await stop_processes([e.proc for e in entries], grace=grace, force=self._force)
        for entry in entries:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2.0):
                    await asyncio.gather(*entry.readers, return_exceptions=True)
            self._ranks.pop(entry.rank, None)

    async def _stop_store(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            await store.aclose()

    async def _stop_everything(self, *, grace: float) -> None:
        procs = [e.proc for e in self._ranks.values()]
        await stop_processes(procs, grace=grace, force=self._force)
        await self._stop_store()


def _read_error_file(path: Path) -> str:
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


# ----- flodl-agent ----------------------------------------------------------------------------


def _parse_devices(text: str) -> DeviceSpec:
    text = text.strip()
    if text == "all":
        return DeviceSpec(kind=DeviceKind.ALL_GPUS)
    if text.startswith("cpu:") and text[4:].isdigit() and int(text[4:]) >= 1:
        return DeviceSpec.cpu(int(text[4:]))
    try:
        return DeviceSpec(kind=DeviceKind.GPU_LIST, gpu_ids=parse_gpu_ids(text))
    except ConfigError as exc:
        raise ConfigError(f"--devices: expected `all`, GPU ids like 0,1, or cpu:N ({exc})") from None


def _read_secret(args: argparse.Namespace) -> bytes:
    if args.secret_file:
        try:
            return secret_from_hex(Path(args.secret_file).read_text())
        except OSError as exc:
            raise ConfigError(f"--secret-file {args.secret_file}: {exc.strerror or exc}") from exc
    if sys.stdin.isatty():
        raise ConfigError("no session secret: pipe it on stdin (never on the command line) or pass --secret-file")
    return secret_from_hex(sys.stdin.readline())


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``flodl-agent``: join a controller and run this host's ranks."""
    from .cli import parse_addr
    from .net.loop import run

    parser = argparse.ArgumentParser(
        prog="flodl-agent",
        description="Join a flodl controller's run and run this host's ranks. The session secret "
        "comes on stdin (32 hex characters) or from --secret-file, never on the command line.",
        epilog="example:\n  flodl-agent --controller 10.0.0.1:1337 --devices cpu:4 --secret-file /run/flodl/secret",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--controller", required=True, help="controller HOST:PORT")
    parser.add_argument("--devices", default="all", help="`all` GPUs, ids like 0,1, or cpu:N (default %(default)s)")
    parser.add_argument("--host", default=socket.gethostname(), help="this host's name in the run (default: hostname)")
    parser.add_argument("--secret-file", help="file holding the session secret in hex")
    parser.add_argument("--workdir", help="working directory of the ranks")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="flodl-agent: %(message)s")
    try:
        host, port = parse_addr(args.controller)
        config = AgentConfig(
            controller_host=host, controller_port=port, secret=_read_secret(args), host=args.host, devices=_parse_devices(args.devices), workdir=args.workdir
        )
    except ConfigError as exc:
        print(f"flodl-agent: {exc}", file=sys.stderr)
        return 2
    output = RankOutput(stdout=sys.stdout.buffer, stderr=sys.stderr.buffer)
    try:
        run(Agent(config, output=output).run())
    except FlodlError as exc:
        print(f"flodl-agent: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        output.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
