"""Inside a SLURM allocation, ``srun flodl-launch -- python train.py`` needs no other option.

Theory of operation. Each srun task (one per node) reads its step's place from the environment
SLURM gives every task: the nodes from ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``),
expanded by python-hostlist — never by running ``scontrol``, which a container may lack (then
each node would form a world of one and wait there); its node rank from ``SLURM_NODEID``; the
controller on the first node; ranks per node from ``--nproc-per-node``, else the GPUs SLURM gave
(``CUDA_VISIBLE_DEVICES``), else one. The port is derived from the job id, so every node derives
the same one without talking: P, and P+1 … P+7 when another job's run holds P (node 0 binds the
first free one; the others dial them in order, and the token handshake tells our controller from
a stranger's). The result is an every-node run (:mod:`.everynode`).

Admission with no options: the token of a per-job secret file that node 0 makes (0600) in
``$SLURM_SUBMIT_DIR``, storage every node of a job sees as a rule, and the others wait for
(:func:`job_token_path`; ``--token-file`` overrides it).

SIGUSR1/SIGUSR2 are not passed on to the ranks here: SLURM signals every process of the step
(``scancel --signal``, ``--signal=USR1@60``), the ranks among them, which would get each twice.

The launcher imports this module only when ``SLURM_JOB_ID`` is set, and python-hostlist only
from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ..errors import ConfigError
from .everynode import EveryNode, NodeFlags

#: The first of a job's eight ports is PORT_BASE + (job id mod PORT_JOBS) * PORT_SPAN.
PORT_BASE = 29400
PORT_SPAN = 8
PORT_JOBS = 4000


def job_port(job_id: int) -> int:
    """The first port of the job's eight (P .. P+7, all below 61400)."""
    return PORT_BASE + (job_id % PORT_JOBS) * PORT_SPAN


def expand_nodelist(nodelist: str) -> list[str]:
    """``sln[1-3],gpu07`` → its host names, in SLURM's order."""
    import hostlist  # deferred: only under SLURM (off every other run's start path)

    try:
        return list(hostlist.expand_hostlist(nodelist))
    except hostlist.BadHostlist as exc:
        raise ConfigError(f"SLURM_JOB_NODELIST {nodelist!r} is not a host list: {exc}") from None


def job_token_path(env: Mapping[str, str]) -> Path:
    """The job's secret file: in ``$SLURM_SUBMIT_DIR``, which every node of the job sees."""
    return Path(env.get("SLURM_SUBMIT_DIR") or ".") / f".flodl-job-{env['SLURM_JOB_ID']}.token"


def slurm_nodes(
    flags: NodeFlags, env: Mapping[str, str], *, run_id: str | None, token_file: str | None
) -> EveryNode:
    """This srun task's node of the run; raises :class:`ConfigError` where the step is not one
    task per node."""
    job = env["SLURM_JOB_ID"]
    if not job.isdigit():
        raise ConfigError(f"SLURM_JOB_ID {job!r} is not a job number")
    if "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env:
        raise ConfigError(
            "this is a SLURM job's batch script, not an srun task: run `srun flodl-launch -- "
            "CMD` (one task per node), or give --nproc N for this node alone"
        )
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    nodes = expand_nodelist(nodelist) if nodelist else []
    if not nodes:
        raise ConfigError("SLURM_JOB_NODELIST is empty: no nodes to run on")
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or str(len(nodes))
    if tasks.isdigit() and int(tasks) != len(nodes):
        raise ConfigError(
            f"the step runs {tasks} tasks on {len(nodes)} node(s): flodl-launch is one task per "
            "node (srun --ntasks-per-node=1), and starts the ranks itself (--nproc-per-node)"
        )
    in_job = env.get("SLURM_JOB_NUM_NODES", "")
    if len(nodes) == 1 and in_job.isdigit() and int(in_job) > 1 and flags.nnodes != "1":
        raise ConfigError(
            f"this srun step runs on 1 of the job's {in_job} nodes: run it on all of them (srun "
            f"-N {in_job} --ntasks-per-node=1), or give --nnodes 1 for one node"
        )
    rank = env.get("SLURM_NODEID", "")
    if not rank.isdigit() or int(rank) >= len(nodes):
        raise ConfigError(f"SLURM_NODEID {rank!r} is not a node of {nodelist}")
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "0"
    return EveryNode(
        nnodes_min=len(nodes),
        nnodes_max=len(nodes),
        node_rank=int(rank),
        host=nodes[0],
        port=job_port(int(job)),
        nproc=flags.nproc,
        run_id=run_id or f"slurm-{job}.{step}",
        ports=PORT_SPAN,
        signals_reach_ranks=True,
        job_token=None if token_file is not None else str(job_token_path(env)),
    )
