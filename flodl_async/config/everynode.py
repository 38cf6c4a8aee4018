"""Every-node mode: the same ``flodl-launch`` command on every node, as with torchrun.

    flodl-launch --nnodes 2 --node-rank R --rdzv-endpoint HOST:PORT --token-file F -- python t.py

Theory of operation. Node rank 0 (or, without ``--node-rank``, the node that holds the
endpoint's address) runs the controller, bound to the endpoint, and its own ranks; every other
node becomes a dial-in agent that joins it with the cluster token and brings its ranks
(:mod:`flodl_async.cli.nodes`). The join window waits for ``MIN``×K ranks and forms at once at
``MAX``×K (K ranks per node). A node started with another command or rank count is refused by
name (the join carries a digest of the command, :func:`launch_digest`), one of another
flodl_async version as always.

This module is the pure part: torchrun's options (and Kubeflow Trainer's ``PET_*`` variables,
the indexed Job's ``JOB_COMPLETION_INDEX``, for what the options leave unsaid) resolved into one
:class:`EveryNode`, with every mistake a :class:`ConfigError` that says what to add.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..control.backoff import BackoffPolicy
from ..control.membership import JoinConfig, NodeTerms
from ..errors import ConfigError
from .addr import parse_addr
from .cluster import JoinKnobs

#: torchrun's default port of a c10d ``--rdzv-endpoint`` given without one.
RDZV_DEFAULT_PORT = 29400
#: torchrun's default ``--master-port``.
MASTER_DEFAULT_PORT = 29500

#: How a node dials node 0 while it is not up yet: the nodes of one job start within a second or
#: so of each other, and a refused dial costs nothing, so the pauses stay short.
NODE_DIALS = BackoffPolicy(initial=0.05, cap=0.5)

#: torchrun reads every option from ``PET_<OPTION>`` (Kubeflow Trainer v2 sets these).
PET_VARIABLES = (
    "PET_NNODES",
    "PET_NODE_RANK",
    "PET_NPROC_PER_NODE",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
    "PET_RDZV_ENDPOINT",
    "PET_RDZV_ID",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeFlags:
    """torchrun's multi-node options as given on the command line (None: not given)."""

    nnodes: str | None = None
    node_rank: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_backend: str | None = None
    master_addr: str | None = None
    master_port: str | None = None
    nproc: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class EveryNode:
    """One node of an every-node run, resolved."""

    nnodes_min: int
    nnodes_max: int
    #: None: torchrun's elastic habit of no ``--node-rank``; the endpoint's owner is the controller.
    node_rank: int | None
    host: str
    port: int
    #: ``--nproc-per-node`` as given (a count or auto/gpu/cpu), None: one per GPU, else one.
    nproc: str | None
    run_id: str | None
    #: What the launcher says once at start (an option accepted and not used, and why).
    notes: tuple[str, ...] = ()
    #: Ports from ``port`` on that node 0 may hold (SLURM's derived P .. P+7; 1: ``port`` only).
    ports: int = 1
    #: A per-job token file node 0 makes and the others wait for (SLURM without --token-file).
    job_token: str | None = None
    #: The scheduler signals every process of the step, the ranks included (SLURM's ``scancel
    #: --signal``, ``--signal=USR1@60``): SIGUSR1/SIGUSR2 are then not passed on a second time.
    signals_reach_ranks: bool = False

    @property
    def endpoint(self) -> str:
        """``host:port`` of the controller node, for messages."""
        return f"{self.host}:{self.port}"

    def describe(self) -> str:
        """``node 1 of 2`` (``of 1..4`` for an elastic window)."""
        count = (
            str(self.nnodes_max)
            if self.nnodes_min == self.nnodes_max
            else f"{self.nnodes_min}..{self.nnodes_max}"
        )
        rank = "a node" if self.node_rank is None else f"node {self.node_rank}"
        return f"{rank} of {count}"


def parse_nnodes(raw: str) -> tuple[int, int]:
    """``N`` or torchrun's elastic ``MIN:MAX`` → (min, max)."""
    low, sep, high = raw.strip().partition(":")
    try:
        nmin = int(low)
        nmax = int(high) if sep else nmin
    except ValueError:
        raise ConfigError(
            f"--nnodes takes a node count or MIN:MAX, like 2 or 1:4 (got {raw!r})"
        ) from None
    if nmin < 1 or nmax < nmin:
        raise ConfigError(
            f"--nnodes {raw}: needs 1 <= MIN <= MAX (the nodes the run waits for, then the most "
            "it takes)"
        )
    return nmin, nmax


def _flag_or_env(flag: str | None, env: Mapping[str, str], name: str) -> str | None:
    if flag is not None:
        return flag
    value = env.get(name, "").strip()
    return value or None


def resolve_nodes(
    flags: NodeFlags, env: Mapping[str, str], *, token_file: str | None, run_id: str | None
) -> EveryNode | None:
    """The every-node run these options (and the environment) describe; None for any other run.

    Options win over ``PET_*`` variables; the node rank comes from ``--node-rank``, else
    ``PET_NODE_RANK``, else an indexed Job's ``JOB_COMPLETION_INDEX``.
    """
    nnodes = _flag_or_env(flags.nnodes, env, "PET_NNODES")
    node_rank = _flag_or_env(flags.node_rank, env, "PET_NODE_RANK")
    if node_rank is None and nnodes is not None:
        node_rank = _flag_or_env(None, env, "JOB_COMPLETION_INDEX")
    endpoint = _flag_or_env(flags.rdzv_endpoint, env, "PET_RDZV_ENDPOINT")
    master_addr = _flag_or_env(flags.master_addr, env, "PET_MASTER_ADDR")
    master_port = _flag_or_env(flags.master_port, env, "PET_MASTER_PORT")
    given = [
        name
        for name, value in (
            ("--node-rank", flags.node_rank),
            ("--rdzv-endpoint", flags.rdzv_endpoint),
            ("--master-addr", flags.master_addr),
            ("--master-port", flags.master_port),
            ("--rdzv-id", flags.rdzv_id),
        )
        if value is not None
    ]
    if nnodes is None:
        if given:
            raise ConfigError(
                f"{given[0]} belongs to a multi-node run: add --nnodes N (the same command on "
                "every node), or use a cluster file"
            )
        return None
    nmin, nmax = parse_nnodes(nnodes)
    if endpoint is None and master_addr is None:
        if nmax == 1:
            return None  # torchrun's `--nnodes 1 --nproc-per-node K`: one host, as --nproc K
        raise ConfigError(
            f"--nnodes {nnodes} runs this same command on every node: add --rdzv-endpoint "
            "HOST:PORT (the address of node 0, which runs the controller; or --master-addr/"
            "--master-port), --node-rank R (0 on that node) and --token-file F (a cluster token "
            "every node can read: `flodl token new F`)"
        )
    if endpoint is not None:
        host, port = parse_addr(endpoint, default_port=RDZV_DEFAULT_PORT)
    else:
        assert master_addr is not None
        host = master_addr
        port = _port(master_port) if master_port is not None else MASTER_DEFAULT_PORT
    rank = _node_rank(node_rank, nmax)
    if token_file is None:
        raise ConfigError(
            "every-node runs admit nodes by a cluster token, never unauthenticated: create one "
            "with `flodl token new F` on storage every node can read, and add --token-file F"
        )
    rdzv_id = _flag_or_env(flags.rdzv_id, env, "PET_RDZV_ID")
    if rdzv_id is not None and run_id is not None and rdzv_id != run_id:
        raise ConfigError(
            f"--rdzv-id {rdzv_id} and --run-id {run_id} name the run twice: give one of them"
        )
    notes: tuple[str, ...] = ()
    if flags.rdzv_backend is not None:
        notes = (
            f"--rdzv-backend {flags.rdzv_backend}: ignored; nodes meet at the controller on node "
            "0 (authenticated by the cluster token)",
        )
    nproc = flags.nproc if flags.nproc is not None else env.get("PET_NPROC_PER_NODE") or None
    if nproc is not None and not (
        nproc.strip() in ("auto", "gpu", "cpu") or (nproc.strip().isdigit() and int(nproc) >= 1)
    ):
        raise ConfigError(
            f"--nproc-per-node (or PET_NPROC_PER_NODE) must be a number of at least 1, or auto, "
            f"gpu or cpu (got {nproc!r})"
        )
    return EveryNode(
        nnodes_min=nmin,
        nnodes_max=nmax,
        node_rank=rank,
        host=host,
        port=port,
        nproc=nproc,
        run_id=rdzv_id or run_id,
        notes=notes,
    )


def _port(raw: str) -> int:
    if not raw.strip().isdigit() or not 0 < int(raw) < 65536:
        raise ConfigError(f"--master-port must be a number from 1 to 65535 (got {raw!r})")
    return int(raw)


def _node_rank(raw: str | None, nmax: int) -> int | None:
    if raw is None:
        return None
    if not raw.strip().isdigit() or int(raw) >= nmax:
        raise ConfigError(
            f"--node-rank must be a number from 0 to {nmax - 1} (--nnodes allows {nmax} nodes; got "
            f"{raw!r})"
        )
    return int(raw)


def under_slurm(env: Mapping[str, str]) -> bool:
    """This process runs inside a SLURM job (a batch script, or an srun task)."""
    return bool(env.get("SLURM_JOB_ID"))


def launch_digest(command: Sequence[str]) -> str:
    """What a node was started with, as the join carries it: a digest of the command (which may
    hold secrets, so never the command itself)."""
    return hashlib.sha256(json.dumps(list(command)).encode()).hexdigest()[:32]


def node_name(hostname: str, node_rank: int | None) -> str:
    """A node's host name in the run: its hostname, with its node rank, so that nodes with one
    hostname (containers, cloned VMs, namespaces sharing a UTS namespace) stay apart — in the
    join window, and in their runtime entries and sockets on a shared filesystem."""
    return hostname if node_rank is None else f"{hostname}#{node_rank}"


def node_join(nodes: EveryNode, ranks: int, command: tuple[str, ...], scale: float) -> JoinConfig:
    """The window of an every-node run: MIN nodes' ranks as the quorum, MAX nodes' as the target
    (formed at once), every node held to the controller node's rank count and command."""
    join = JoinKnobs(
        min_rank_start=nodes.nnodes_min * ranks, target_ranks=nodes.nnodes_max * ranks
    ).resolve(nodes.nnodes_max * ranks, scale=scale)
    terms = NodeTerms(ranks_per_node=ranks, launch=launch_digest(command))
    return dataclasses.replace(join, node_terms=terms)
