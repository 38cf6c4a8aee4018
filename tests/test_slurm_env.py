"""The SLURM environment read as one node's place in an every-node run (flodl_async.config.slurm),
and the launcher importing no SLURM code off SLURM."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flodl_async.config.everynode import NodeFlags
from flodl_async.config.slurm import PORT_SPAN, job_port, job_token_path, slurm_nodes
from flodl_async.errors import ConfigError

#: What srun -N3 --ntasks-per-node=1 gave the task on the second node (the real harness's).
STEP = {
    "SLURM_JOB_ID": "17",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NODELIST": "sln[1-3]",
    "SLURM_STEP_NODELIST": "sln[1-3]",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_STEP_NUM_NODES": "3",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_NODEID": "1",
    "SLURM_SUBMIT_DIR": "/shared/work",
}


def test_a_task_of_the_step_is_a_node_with_no_options() -> None:
    node = slurm_nodes(NodeFlags(), STEP, run_id=None, token_file=None)
    assert (node.nnodes_max, node.node_rank, node.host) == (3, 1, "sln1")
    assert (node.port, node.ports) == (job_port(17), PORT_SPAN)
    assert node.run_id == "slurm-17.0"
    assert node.job_token == str(job_token_path(STEP)) == "/shared/work/.flodl-job-17.token"
    assert node.signals_reach_ranks
    assert slurm_nodes(NodeFlags(), STEP, run_id=None, token_file="/t").job_token is None


def test_every_node_derives_the_same_eight_ports_from_the_job() -> None:
    ports = {job_port(job) for job in range(100_000)}
    assert min(ports) >= 1024
    assert max(ports) + PORT_SPAN - 1 < 65536
    assert job_port(17) != job_port(18)
    assert abs(job_port(17) - job_port(18)) >= PORT_SPAN  # neighbours' windows never overlap


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"SLURM_STEP_ID": None}, "batch script, not an srun task: run `srun flodl-launch"),
        ({"SLURM_STEP_NUM_TASKS": "6"}, "one task per node (srun --ntasks-per-node=1)"),
        (
            {"SLURM_STEP_NODELIST": "sln2", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NODEID": "0"},
            "runs on 1 of the job's 3 nodes",
        ),
        ({"SLURM_NODEID": "5"}, "is not a node of"),
        ({"SLURM_JOB_NODELIST": "sln[1-", "SLURM_STEP_NODELIST": None}, "is not a host list"),
    ],
)
def test_a_step_that_is_not_one_task_per_node_says_so(
    change: dict[str, str | None], says: str
) -> None:
    env = {k: v for k, v in {**STEP, **change}.items() if v is not None}
    with pytest.raises(ConfigError) as caught:
        slurm_nodes(NodeFlags(), env, run_id=None, token_file=None)
    assert says in str(caught.value)


def _imports(env: dict[str, str]) -> str:
    code = (
        "import sys\nfrom flodl_async.cli.launch import parse_args\n"
        "try:\n parse_args(['--', 'python', 'x.py'])\nexcept Exception as e:\n print(type(e).__name__)\n"
        "print('hostlist' in sys.modules, 'flodl_async.config.slurm' in sys.modules)"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={**clean, **env},
    ).stdout


def test_the_launcher_imports_no_slurm_code_off_slurm() -> None:
    assert _imports({}).splitlines() == ["ConfigError", "False False"]
    assert _imports(STEP).splitlines() == ["True True"]
