"""The rank environment is a pure function: contract, precedence, GPU placement."""

from __future__ import annotations

from flodl_async.config.rankenv import TORCHRUN_CONTRACT, RankPlacement, RankSpec, rank_environment
from flodl_async.config.roles import Role, detect_role

PLACEMENT = RankPlacement(
    rank=5, local_rank=1, world_size=8, local_world_size=4, group_rank=1, group_world_size=2,
    master_addr="10.0.0.1", master_port=29400, run_id="r1", restart_count=2, max_restarts=3,
)  # fmt: skip
SPEC = RankSpec(
    run_id="r1",
    host="b",
    relay_socket="/tmp/x.sock",
    data_socket="/tmp/d.sock",
    round=0,
    credential_hex="00" * 32,
)


def _env(**kw: object) -> dict[str, str]:
    args: dict[str, object] = {
        "error_file": "/tmp/e.json",
        "rank_spec": SPEC,
        "cluster_env": {},
        "host_env": {},
        "cuda_visible_devices": None,
    }
    args.update(kw)
    return rank_environment({"PATH": "/bin", "HOME": "/root"}, PLACEMENT, **args)  # type: ignore[arg-type]


def test_the_whole_contract_with_the_placement_values() -> None:
    env = _env()
    assert all(k in env for k in TORCHRUN_CONTRACT)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
        "5",
        "1",
        "8",
        "4",
    )
    assert (
        env["GROUP_RANK"],
        env["GROUP_WORLD_SIZE"],
        env["ROLE_RANK"],
        env["ROLE_WORLD_SIZE"],
    ) == ("1", "2", "5", "8")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29400")
    assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("2", "3")
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert env["PATH"] == "/bin"
    assert detect_role(env) is Role.RANK
    assert RankSpec.from_json(env["FLODL_INTERNAL_RANK_SPEC"]) == SPEC


def test_gpu_hosts_expose_their_devices_and_local_rank_indexes_them() -> None:
    env = _env(cuda_visible_devices=("2", "3", "6", "7"))
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3,6,7"
    assert env["CUDA_VISIBLE_DEVICES"].split(",")[int(env["LOCAL_RANK"])] == "3"


def test_omp_threads_default_and_user_override() -> None:
    assert _env()["OMP_NUM_THREADS"] == "1"
    assert _env(cluster_env={"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"
    assert _env(host_env={"OMP_NUM_THREADS": "2"})["OMP_NUM_THREADS"] == "2"


def test_a_hosts_only_rank_keeps_every_core() -> None:
    """torchrun's rule: OMP_NUM_THREADS=1 only when a host runs several ranks."""
    import dataclasses

    alone = dataclasses.replace(PLACEMENT, local_rank=0, local_world_size=1)
    env = rank_environment(
        {"PATH": "/bin"},
        alone,
        error_file="/tmp/e.json",
        rank_spec=SPEC,
        cluster_env={},
        host_env={},
        cuda_visible_devices=None,
    )
    assert "OMP_NUM_THREADS" not in env
    inherited = rank_environment(
        {"OMP_NUM_THREADS": "3"},
        PLACEMENT,
        error_file="/tmp/e.json",
        rank_spec=SPEC,
        cluster_env={},
        host_env={},
        cuda_visible_devices=None,
    )
    assert inherited["OMP_NUM_THREADS"] == "3"


def test_host_env_overrides_cluster_env_and_neither_overrides_the_contract() -> None:
    env = _env(cluster_env={"A": "cluster", "B": "cluster"}, host_env={"B": "host"})
    assert (env["A"], env["B"]) == ("cluster", "host")


def test_a_launchers_or_agents_role_variables_never_reach_a_rank() -> None:
    """A CONTROLLER-role launcher's ranks would otherwise see CONTROLLER+RANK and die at dispatch."""
    base = {
        "PATH": "/bin",
        "FLODL_INTERNAL_CLUSTER_SPEC": "/x.yml",
        "FLODL_INTERNAL_AGENT_SPEC": "{}",
    }
    args: dict[str, object] = {
        "error_file": "/tmp/e.json",
        "rank_spec": SPEC,
        "cluster_env": {},
        "host_env": {},
        "cuda_visible_devices": None,
    }
    env = rank_environment(base, PLACEMENT, **args)  # type: ignore[arg-type]
    assert "FLODL_INTERNAL_CLUSTER_SPEC" not in env
    assert "FLODL_INTERNAL_AGENT_SPEC" not in env
    assert detect_role(env) is Role.RANK
