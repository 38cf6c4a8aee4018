"""``flodl-launch --nnodes``: one node of an every-node run (:mod:`flodl_async.config.everynode`).

The controller's node gets a launch plan here (its own ranks, placed in-process, and a join
window that waits for the other nodes' agents with the cluster token); ``flodl-launch`` runs it
like any other plan, printing only its own ranks' lines. Every other node runs
:func:`run_agent_node`: the dial-in agent of ``flodl-agent --token-file`` (the same
:class:`~flodl_async.agent.session.HostSession`), which prints its own ranks' lines, sends them
on to the controller's node too (``--log-dir``, status), and exits with the run's verdict as the
controller's ``Abort`` carries it (the launcher's exit table).

Nothing here imports more than ``flodl-launch`` already does at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from ..agent.endings import Ending, SessionOutcome, stopped_by
from ..agent.failures import exit_code_for_error, failure_line, session_failure
from ..agent.join import SessionConfig
from ..agent.lifecycle import Phase, SessionEvent
from ..agent.output import RankOutput
from ..agent.session import HostSession
from ..config.cluster import WorkerSpec
from ..config.devices import DeviceSpec
from ..config.everynode import NODE_DIALS, EveryNode, launch_digest, node_join, node_name
from ..config.plan import LaunchPlan, PlacedWorker, Placement
from ..deadlines import Deadlines
from ..errors import AgentError, ConfigError, JoinRejected, SecretFileError
from ..host.console import ConsoleWriter
from ..host.gpus import host_visible_gpus
from ..host.hostaddrs import host_addresses
from ..host.hostnames import HostAliases
from ..host.ifnames import interface_holding, stand_alone_default_ifname
from ..host.secretfile import create_token_file, read_token_file
from ..net.loop import run
from ..net.signals import ForwardedSignals, StopSignals
from ..verdict import ExitCode, exit_code_for_signal
from .launchargs import NPROC_WORDS, LaunchArgs, resolve_nproc

log = logging.getLogger("flodl_async.cli.launch")

#: How long a node waits for node 0's controller to listen (pods and srun tasks start in any
#: order; the window on node 0 is as long).
NODE_CONNECT_TIMEOUT = 300.0


def node_devices(nproc: str | None, visible_gpus: int) -> DeviceSpec:
    """A node's ranks: ``--nproc-per-node`` (a count, or auto/gpu/cpu), else one per visible GPU,
    else one (torchrun's default). A count runs on GPUs 0..K-1 when the node shows that many."""
    if nproc is None:
        return DeviceSpec.gpus(tuple(range(visible_gpus))) if visible_gpus else DeviceSpec.cpu(1)
    word = nproc.strip()
    count = resolve_nproc(word if word in NPROC_WORDS else int(word), visible_gpus)
    if word != "cpu" and 0 < count <= visible_gpus:
        return DeviceSpec.gpus(tuple(range(count)))
    return DeviceSpec.cpu(count)


def is_controller_node(nodes: EveryNode) -> bool:
    """Node rank 0 runs the controller; without a node rank, the node that holds the endpoint's
    address does."""
    if nodes.node_rank is not None:
        return nodes.node_rank == 0
    address = _resolved(nodes.host)
    return address is not None and (
        ipaddress.ip_address(address).is_loopback or address in host_addresses()
    )


def _resolved(host: str) -> str | None:
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError):
        return None


def controller_bind_host(nodes: EveryNode) -> tuple[str, str | None]:
    """Where node 0's controller listens, and its ranks' interface: loopback for a loopback
    endpoint; else every interface (admission is by token), its ranks on the interface that holds
    the endpoint's address, which the other nodes reach (None: not found here, gloo's own
    choice)."""
    address = _resolved(nodes.host)
    if address is not None and ipaddress.ip_address(address).is_loopback:
        return "127.0.0.1", None
    return "0.0.0.0", interface_holding(address) if address is not None else None


def controller_plan(
    args: LaunchArgs,
    nodes: EveryNode,
    *,
    aliases: HostAliases,
    deadlines: Deadlines,
    secret: bytes,
    run_id: str,
    cluster_env: dict[str, str],
) -> LaunchPlan:
    """The plan of the controller's node: its own ranks in-process, the other nodes dialing in."""
    devices = node_devices(nodes.nproc, len(host_visible_gpus()))
    ranks = devices.known_count
    assert ranks is not None  # node_devices counts them
    bind_host, ifname = controller_bind_host(nodes)
    worker = WorkerSpec(
        host=node_name(socket.gethostname(), nodes.node_rank),
        devices=devices,
        nccl_socket_ifname=ifname or None,
    )
    return LaunchPlan(
        run_id=run_id,
        secret=secret,
        bind_host=bind_host,
        port=first_free_port(bind_host, nodes),
        join=node_join(nodes, ranks, args.command, deadlines.scale),
        workers=(PlacedWorker(spec=worker, placement=Placement.LOCAL),),
        command=args.command,
        cluster_env=cluster_env,
        max_restarts=args.max_restarts,
        log_dir=args.log_dir,
        deadlines=deadlines,
        host_aliases=aliases,
        token=node_token(args, nodes, controller=True),
        hang_timeout=args.hang_timeout,
    )


def node_banner(plan: LaunchPlan, nodes: EveryNode, port: int) -> str:
    """The controller node's first line."""
    ranks = plan.workers[0].spec.devices.known_count
    return (
        f"run {plan.run_id}: {' '.join(plan.command)} — {nodes.describe()} (the controller, at "
        f"{nodes.host}:{port}), {ranks} rank(s) per node — status: flodl status --addr "
        f"127.0.0.1:{port}"
    )


def agent_config(args: LaunchArgs, nodes: EveryNode, token: bytes) -> SessionConfig:
    """A non-controller node's agent: it dials node 0 with the cluster token."""
    deadlines = Deadlines.resolve(stop_grace=args.stop_grace)
    return SessionConfig(
        controller_host=nodes.host,
        controller_port=nodes.port,
        secret=b"",
        token=token,
        host=node_name(socket.gethostname(), nodes.node_rank),
        devices=node_devices(nodes.nproc, len(host_visible_gpus())),
        deadlines=deadlines,
        # with one port, the joiner waits for node 0 itself; with several, join_some_port does
        connect_timeout=NODE_CONNECT_TIMEOUT * deadlines.scale if nodes.ports == 1 else 0.0,
        connect_backoff=NODE_DIALS,
        default_ifname=stand_alone_default_ifname(nodes.host),
        launch=launch_digest(args.command),
    )


def node_token(args: LaunchArgs, nodes: EveryNode, *, controller: bool) -> bytes:
    """The run's cluster token: ``--token-file``'s, else the job's own secret file (SLURM), which
    node 0 makes (0600; a requeued job's is used again) and the other nodes wait for."""
    if args.token_file is not None:
        return read_token_file(args.token_file)
    assert nodes.job_token is not None  # resolve_nodes requires --token-file otherwise
    path = Path(nodes.job_token)
    if controller:
        with contextlib.suppress(SecretFileError):  # already there: this job's, made before
            create_token_file(path)
        return read_token_file(path)
    # Shared storage has no event to wait on (inotify does not see another node's write): look
    # again, more slowly each time.
    deadline = time.monotonic() + NODE_CONNECT_TIMEOUT
    pause = 0.05
    while not path.exists():
        if time.monotonic() > deadline:
            raise ConfigError(
                f"node 0 did not write the job's token {path} within {NODE_CONNECT_TIMEOUT:g}s "
                "(is $SLURM_SUBMIT_DIR on storage every node sees? else give --token-file)"
            )
        time.sleep(pause)
        pause = min(pause * 2, 1.0)
    return read_token_file(path)


def forget_job_token(nodes: EveryNode) -> None:
    """Node 0, once the run is over: the job's secret file goes (the nodes joined with it)."""
    if nodes.job_token is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(nodes.job_token)


def first_free_port(bind_host: str, nodes: EveryNode) -> int:
    """The first of the run's ports that no listener holds here (SLURM: P .. P+7, another job's
    run may hold P); with one port, that port (taken: the launcher's strict port error)."""
    if nodes.ports == 1:
        return nodes.port
    for port in range(nodes.port, nodes.port + nodes.ports):
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((bind_host, port))
            except OSError:
                continue
            return port
    raise ConfigError(
        f"ports {nodes.port}-{nodes.port + nodes.ports - 1}, derived from the job id, are all "
        "taken on this node: give --rdzv-endpoint HOST:PORT and --token-file on every node"
    )


def already_delivered(sig: signal.Signals) -> str:
    """What a node under SLURM says of a SIGUSR1/SIGUSR2 it does not pass on."""
    return (
        f"{sig.name}: SLURM delivers it to every process of the step, this node's ranks "
        "included; not passed on a second time"
    )


def node_exit_code(outcome: SessionOutcome) -> ExitCode | int:
    """The run's verdict as this node exits with it: the controller's (its ``Abort`` carries it),
    else this node's own ending."""
    if outcome.ending is Ending.FINISHED:
        return ExitCode.OK
    if outcome.ending is Ending.STOPPED and outcome.signal is not None:
        return exit_code_for_signal(outcome.signal)
    if outcome.exit_code is not None:
        return outcome.exit_code
    return ExitCode.RANK_FAILURE


class NodeAgent:
    """A non-controller node's sessions: one, or (several ports) one per port tried, in order,
    until one is admitted; signals reach the current one."""

    def __init__(self, config: SessionConfig, nodes: EveryNode, console: RankOutput) -> None:
        self._config = config
        self._nodes = nodes
        self._console = console
        self._session: HostSession | None = None
        self._stop: signal.Signals | None = None
        self._stopped = asyncio.Event()
        self._admitted = False

    def request_stop(self, sig: signal.Signals) -> None:
        self._stop = self._stop or sig
        self._stopped.set()
        if self._session is not None:
            self._session.request_stop(sig)

    def force_stop(self) -> None:
        if self._session is not None:
            self._session.force_stop()

    def signal_ranks(self, sig: int) -> tuple[int, ...]:
        return self._session.signal_ranks(sig) if self._session is not None else ()

    def _observe(self, event: SessionEvent) -> None:
        self._admitted = self._admitted or event.phase is Phase.ADMITTED

    async def run(self) -> SessionOutcome:
        nodes = self._nodes
        if nodes.ports == 1:
            return await self._session_on(nodes.port)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + NODE_CONNECT_TIMEOUT * self._config.deadlines.scale
        pause = NODE_DIALS.initial
        while True:
            for port in range(nodes.port, nodes.port + nodes.ports):
                try:
                    return await self._session_on(port)
                except AgentError as exc:
                    # admitted, or refused by our own controller: that is the answer
                    if self._admitted or isinstance(exc, JoinRejected) or loop.time() > deadline:
                        raise
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):
                    await self._stopped.wait()
            pause = min(pause * NODE_DIALS.factor, NODE_DIALS.cap)

    async def _session_on(self, port: int) -> SessionOutcome:
        if self._stop is not None:
            return stopped_by(self._stop, when="while waiting for the controller")
        config = dataclasses.replace(self._config, controller_port=port)
        self._session = HostSession(config, console=self._console, observer=self._observe)
        return await self._session.run()


def run_agent_node(args: LaunchArgs, nodes: EveryNode) -> int:
    """Serve the run as a node that dials node 0; returns the exit code to leave with."""
    config = agent_config(args, nodes, node_token(args, nodes, controller=False))
    log.info(
        "%s: %s joins %s's run at %s",
        config.host,
        nodes.describe(),
        "node 0" if nodes.node_rank is not None else "the controller",
        nodes.endpoint,
    )
    consoles = (
        ConsoleWriter(sys.stdout.buffer, name="stdout"),
        ConsoleWriter(sys.stderr.buffer, name="stderr"),
    )
    console = RankOutput(
        stdout=consoles[0],
        stderr=consoles[1],
        show_ranks=args.ranks_filter,
        routing=args.routing,
    )
    agent = NodeAgent(config, nodes, console)

    async def serve() -> SessionOutcome:
        def graceful(sig: signal.Signals) -> None:
            log.info("%s: stopping this node's ranks (a second signal kills them)", sig.name)
            agent.request_stop(sig)

        def forward(sig: signal.Signals) -> None:
            if nodes.signals_reach_ranks:
                log.info("%s", already_delivered(sig))
                return
            reached = agent.signal_ranks(sig)
            log.info("%s: passed on to this node's ranks %s", sig.name, list(reached))

        try:
            with StopSignals(graceful, lambda sig: agent.force_stop()), ForwardedSignals(forward):
                return await agent.run()
        finally:
            # every byte still queued is written out (off the loop) before the exit code
            for writer in consoles:
                await asyncio.to_thread(writer.close)

    try:
        outcome = run(serve())
    except KeyboardInterrupt:
        return int(ExitCode.INTERRUPTED)
    except (Exception, BaseExceptionGroup) as exc:
        failure = session_failure(exc, config)
        if failure is None:
            log.exception("internal error")
            return int(ExitCode.INTERNAL)
        line = failure_line(failure, config.controller_addr).removeprefix("flodl-agent: ")
        print(f"flodl-launch: {line}", file=sys.stderr)
        return int(exit_code_for_error(failure))
    code = node_exit_code(outcome)
    if outcome.ending is not Ending.FINISHED:
        log.info(
            "%s: the run ended (%s); exit %d — the verdict is on the controller's node",
            config.host,
            outcome.reason,
            int(code),
        )
    return int(code)
