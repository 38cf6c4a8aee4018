"""A one-host ``flodl-launch --nproc`` run starts its ranks before its control plane.

Why: a rank spends its first second importing torch, while the launcher spends a few hundred
milliseconds importing and building its controller and in-process agent. Started one after the
other, the run pays both; started at once, only the longer. The world of such a run is known from
its arguments (every rank on this host, the store on the controller's port), so the launcher
reserves its port, starts every rank of the first round as its agent would (the same
:func:`~flodl_async.agent.rankargv.rank_launch`), and the agent adopts them at its first
``StartRanks`` only when it would have started exactly the same
(:mod:`flodl_async.host.early`). Anything that does not fit (other hosts, a store on a store host,
a port already held) starts nothing early: the run goes the usual way.

Imports only what starting a rank needs: the controller, the agent's session and the wire's
messages load while the ranks import torch.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import replace

from ..agent.rankargv import rank_gpu_ids, rank_launch
from ..config.command import PYTHON_VAR
from ..config.plan import LaunchPlan, Placement, direct_ssh_targets
from ..config.rankenv import RankPlacement, RankSpec
from ..host.early import start_early
from ..host.ifnames import controller_host_ifname, controller_host_peer, ranks_env
from ..host.runtime import DATA_SOCKET_NAME, SOCKET_NAME, ensure_root, entry_path
from ..wire.keys import Credential

log = logging.getLogger("flodl_async.cli.launch")

#: The store backend variable (:data:`flodl_async.net.torchstore.BACKEND_VARIABLE`): a store on a
#: store host is another address, known only once the world formed.
_BACKEND_VARIABLE = "FLODL_STORE_BACKEND"
#: Where the in-process agent reaches the controller, and so where its ranks reach the store.
_CONTROLLER_HOST = "127.0.0.1"

#: The port reserved for the controller while it builds (bound, never listening: a rank that
#: dials early is refused and retries, and the controller binds the same port beside it).
_reserved: list[socket.socket] = []


def start_local_ranks(plan: LaunchPlan, *, fallback: bool) -> LaunchPlan:
    """Start the first round's ranks of a one-host run now; the plan to run, on the port they were
    told (``fallback``: a default port that is taken gives way to a free one, as the controller's
    own rule says). Returns ``plan`` unchanged when nothing could be started early."""
    if not plan.one_host or os.environ.get(_BACKEND_VARIABLE, "python") == "torch":
        return plan
    [worker] = plan.workers
    count = worker.spec.devices.known_count
    if worker.placement is not Placement.LOCAL or not count:
        return plan
    port = _reserve(plan.bind_host, plan.port, fallback=fallback)
    if port is None:
        return plan
    if port != plan.port and plan.port:
        port_gave_way(plan.port, port)
    plan = replace(plan, port=port)
    spec = worker.spec
    peer = controller_host_peer(plan.bind_host, port, direct_ssh_targets(plan.workers))
    ifname = controller_host_ifname(peer) if not spec.nccl_socket_ifname else None
    host_env = {
        **ranks_env(spec.env, configured_ifname=spec.nccl_socket_ifname),
        PYTHON_VAR: spec.python or "",
    }
    entry = entry_path(ensure_root(), plan.run_id, spec.host)
    for rank in range(count):
        argv, env = rank_launch(
            command=plan.command,
            run_env=plan.cluster_env,
            host_env=host_env,
            placement=RankPlacement(
                rank=rank,
                local_rank=rank,
                world_size=count,
                local_world_size=count,
                group_rank=0,
                group_world_size=1,
                master_addr=_CONTROLLER_HOST,
                master_port=port,
                run_id=plan.run_id,
                restart_count=0,
                max_restarts=plan.max_restarts,
            ),
            error_file=str(entry / f"error-r{rank}-round0.json"),
            rank_spec=RankSpec(
                run_id=plan.run_id,
                host=spec.host,
                relay_socket=str(entry / SOCKET_NAME),
                data_socket=str(entry / DATA_SOCKET_NAME),
                round=0,
                credential_hex=Credential.for_rank(
                    plan.secret, run_id=plan.run_id, round=0, rank=rank
                ).key.hex(),
            ),
            cuda_visible_devices=rank_gpu_ids(spec.devices, count),
            default_ifname=ifname or None,
        )
        try:
            start_early((plan.run_id, spec.host, rank), argv, env=env, cwd=spec.workdir)
        except OSError:
            break  # its agent starts it, and says why it cannot
    return plan


def _reserve(host: str, port: int, *, fallback: bool) -> int | None:
    """Bind ``host:port`` (or, with ``fallback``, a free port when it is held) with SO_REUSEADDR,
    not listening; the port bound, or None."""
    for candidate in (port, 0) if fallback and port else (port,):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, candidate))
        except OSError:
            sock.close()
            continue
        _reserved.append(sock)
        return int(sock.getsockname()[1])
    return None


def port_gave_way(taken: int, free: int) -> None:
    """Say that the default port ``taken`` gave way to ``free`` (the one port rule)."""
    log.warning(
        "port %d is taken (another run? see `flodl ps`); using free port %d instead", taken, free
    )


def release() -> None:
    """Give the reserved port up (the controller holds it now, or the run is over)."""
    while _reserved:
        _reserved.pop().close()
