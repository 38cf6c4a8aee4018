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
import ipaddress
import logging
import signal
import socket
import sys

from ..agent.endings import Ending, SessionOutcome
from ..agent.failures import exit_code_for_error, failure_line, session_failure
from ..agent.join import SessionConfig
from ..agent.output import RankOutput
from ..agent.session import HostSession
from ..config.cluster import WorkerSpec
from ..config.devices import DeviceSpec
from ..config.everynode import EveryNode, launch_digest, node_join, node_name
from ..config.plan import LaunchPlan, PlacedWorker, Placement
from ..deadlines import Deadlines
from ..host.console import ConsoleWriter
from ..host.gpus import host_visible_gpus
from ..host.hostaddrs import host_addresses
from ..host.hostnames import HostAliases
from ..host.ifnames import interface_holding, stand_alone_default_ifname
from ..host.secretfile import read_token_file
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
    assert args.token_file is not None  # resolve_nodes requires it
    return LaunchPlan(
        run_id=run_id,
        secret=secret,
        bind_host=bind_host,
        port=nodes.port,
        join=node_join(nodes, ranks, args.command, deadlines.scale),
        workers=(PlacedWorker(spec=worker, placement=Placement.LOCAL),),
        command=args.command,
        cluster_env=cluster_env,
        max_restarts=args.max_restarts,
        log_dir=args.log_dir,
        deadlines=deadlines,
        host_aliases=aliases,
        token=read_token_file(args.token_file),
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


def agent_config(args: LaunchArgs, nodes: EveryNode) -> SessionConfig:
    """A non-controller node's agent: it dials node 0 with the cluster token."""
    assert args.token_file is not None  # resolve_nodes requires it
    deadlines = Deadlines.resolve(stop_grace=args.stop_grace)
    return SessionConfig(
        controller_host=nodes.host,
        controller_port=nodes.port,
        secret=b"",
        token=read_token_file(args.token_file),
        host=node_name(socket.gethostname(), nodes.node_rank),
        devices=node_devices(nodes.nproc, len(host_visible_gpus())),
        deadlines=deadlines,
        connect_timeout=NODE_CONNECT_TIMEOUT * deadlines.scale,
        default_ifname=stand_alone_default_ifname(nodes.host),
        launch=launch_digest(args.command),
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


def run_agent_node(args: LaunchArgs, nodes: EveryNode) -> int:
    """Serve the run as a node that dials node 0; returns the exit code to leave with."""
    config = agent_config(args, nodes)
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
    session = HostSession(config, console=console)

    async def serve() -> SessionOutcome:
        def graceful(sig: signal.Signals) -> None:
            log.info("%s: stopping this node's ranks (a second signal kills them)", sig.name)
            session.request_stop(sig)

        def forward(sig: signal.Signals) -> None:
            reached = session.signal_ranks(sig)
            log.info("%s: passed on to this node's ranks %s", sig.name, list(reached))

        try:
            with StopSignals(graceful, lambda sig: session.force_stop()), ForwardedSignals(forward):
                return await session.run()
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
