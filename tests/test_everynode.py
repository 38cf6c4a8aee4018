"""Every-node mode's pure part (flodl_async.config.everynode): torchrun's options and Kubeflow's
PET_* variables resolved into one node's place, and every mistake a message that says what to add."""

from __future__ import annotations

import pytest

from flodl_async.agent.endings import Ending, SessionOutcome
from flodl_async.cli.launchargs import parse_args
from flodl_async.cli.nodes import node_devices, node_exit_code
from flodl_async.config.everynode import (
    MASTER_DEFAULT_PORT,
    RDZV_DEFAULT_PORT,
    NodeFlags,
    launch_digest,
    node_join,
    node_name,
    parse_nnodes,
    resolve_nodes,
)
from flodl_async.errors import ConfigError

TOKEN = "/shared/token"


def test_torchrun_spellings_resolve_to_one_node() -> None:
    nodes = resolve_nodes(
        NodeFlags(nnodes="1:4", node_rank="2", rdzv_endpoint="n0:29555", rdzv_id="job-7"),
        {},
        token_file=TOKEN,
        run_id=None,
    )
    assert nodes is not None
    assert (nodes.nnodes_min, nodes.nnodes_max, nodes.node_rank) == (1, 4, 2)
    assert (nodes.host, nodes.port, nodes.run_id) == ("n0", 29555, "job-7")
    assert nodes.describe() == "node 2 of 1..4"


def test_master_addr_and_port_are_the_endpoint_and_ports_default_as_torchrun() -> None:
    by_master = resolve_nodes(
        NodeFlags(nnodes="2", node_rank="0", master_addr="10.0.0.1"),
        {},
        token_file=TOKEN,
        run_id=None,
    )
    assert by_master is not None
    assert (by_master.host, by_master.port) == ("10.0.0.1", MASTER_DEFAULT_PORT)
    bare = resolve_nodes(
        NodeFlags(nnodes="2", node_rank="1", rdzv_endpoint="n0"), {}, token_file=TOKEN, run_id=None
    )
    assert bare is not None
    assert bare.port == RDZV_DEFAULT_PORT


def test_kubeflow_variables_and_the_job_index_fill_what_the_options_leave_out() -> None:
    env = {
        "PET_NNODES": "3",
        "PET_MASTER_ADDR": "train-0.train",
        "PET_MASTER_PORT": "29400",
        "PET_NPROC_PER_NODE": "2",
        "JOB_COMPLETION_INDEX": "1",
    }
    nodes = resolve_nodes(NodeFlags(), env, token_file=TOKEN, run_id=None)
    assert nodes is not None
    assert (nodes.nnodes_max, nodes.node_rank, nodes.host, nodes.port, nodes.nproc) == (
        3,
        1,
        "train-0.train",
        29400,
        "2",
    )
    # PET_NODE_RANK wins over the index, an option over both
    assert (
        resolve_nodes(
            NodeFlags(), {**env, "PET_NODE_RANK": "2"}, token_file=TOKEN, run_id=None
        ).node_rank
        == 2
    )  # type: ignore[union-attr]
    assert (
        resolve_nodes(NodeFlags(node_rank="0"), env, token_file=TOKEN, run_id=None).node_rank == 0
    )  # type: ignore[union-attr]


def test_rdzv_backend_is_accepted_with_a_note() -> None:
    nodes = resolve_nodes(
        NodeFlags(nnodes="2", node_rank="0", rdzv_endpoint="n0:1", rdzv_backend="c10d"),
        {},
        token_file=TOKEN,
        run_id=None,
    )
    assert nodes is not None
    assert nodes.notes == (
        "--rdzv-backend c10d: ignored; nodes meet at the controller on node 0 (authenticated by "
        "the cluster token)",
    )


@pytest.mark.parametrize(
    ("flags", "token", "says"),
    [
        (NodeFlags(nnodes="2"), TOKEN, "add --rdzv-endpoint HOST:PORT"),
        (NodeFlags(nnodes="2", rdzv_endpoint="n0:1"), None, "add --token-file F"),
        (
            NodeFlags(node_rank="1"),
            TOKEN,
            "--node-rank belongs to a multi-node run: add --nnodes N",
        ),
        (NodeFlags(nnodes="2", node_rank="2", rdzv_endpoint="n0:1"), TOKEN, "from 0 to 1"),
        (NodeFlags(nnodes="4:2", rdzv_endpoint="n0:1"), TOKEN, "1 <= MIN <= MAX"),
        (NodeFlags(nnodes="two", rdzv_endpoint="n0:1"), TOKEN, "a node count or MIN:MAX"),
        (NodeFlags(nnodes="2", rdzv_endpoint="n0:1", rdzv_id="a"), TOKEN, "name the run twice"),
        (NodeFlags(nnodes="2", rdzv_endpoint="n0:1", nproc="two"), TOKEN, "got 'two'"),
    ],
)
def test_mistakes_say_what_to_add(flags: NodeFlags, token: str | None, says: str) -> None:
    with pytest.raises(ConfigError, match=None) as caught:
        resolve_nodes(flags, {}, token_file=token, run_id="b")
    assert says in str(caught.value)


def test_one_node_without_an_endpoint_is_a_one_host_run() -> None:
    assert resolve_nodes(NodeFlags(nnodes="1"), {}, token_file=None, run_id=None) is None
    args = parse_args(["--nnodes", "1", "--", "python", "t.py"])
    assert args.nodes is None
    assert args.nproc == 1  # torchrun's default: one rank


def test_parse_nnodes() -> None:
    assert parse_nnodes("3") == (3, 3)
    assert parse_nnodes("2:5") == (2, 5)


def test_same_hostname_nodes_are_told_apart_by_node_rank() -> None:
    assert node_name("box", 0) != node_name("box", 1)
    assert node_name("box", None) == "box"


def test_the_digest_tells_commands_apart_without_carrying_them() -> None:
    digest = launch_digest(("python", "train.py", "--key", "s3cret"))
    assert digest == launch_digest(("python", "train.py", "--key", "s3cret"))
    assert digest != launch_digest(("python", "train.py"))
    assert "s3cret" not in digest


def test_the_window_waits_for_min_nodes_and_forms_at_max() -> None:
    nodes = resolve_nodes(
        NodeFlags(nnodes="2:3", node_rank="0", rdzv_endpoint="n0:1"),
        {},
        token_file=TOKEN,
        run_id=None,
    )
    assert nodes is not None
    join = node_join(nodes, 2, ("python", "t.py"), 1.0)
    assert (join.min_rank_start, join.target_ranks) == (4, 6)
    assert join.node_terms is not None
    assert join.node_terms.ranks_per_node == 2


def test_a_node_without_gpus_runs_one_rank_unless_told() -> None:
    assert node_devices(None, 0).known_count == 1
    assert node_devices(None, 2).is_gpu
    assert node_devices("3", 0).known_count == 3
    assert not node_devices("cpu", 2).is_gpu


def test_a_node_exits_with_the_verdict_its_controller_sent() -> None:
    assert node_exit_code(SessionOutcome(ending=Ending.ABORTED, reason="x", exit_code=4)) == 4
    assert node_exit_code(SessionOutcome(ending=Ending.FINISHED, reason="ok")) == 0
    assert node_exit_code(SessionOutcome(ending=Ending.STOPPED, reason="s", signal=15)) == 143


def test_a_cluster_file_and_nnodes_exclude_each_other() -> None:
    with pytest.raises(ConfigError, match="give one of them"):
        parse_args(
            [
                "c.yml",
                "--nnodes",
                "2",
                "--rdzv-endpoint",
                "n0:1",
                "--token-file",
                TOKEN,
                "--",
                "python",
            ]
        )
