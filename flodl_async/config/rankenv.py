"""The rank environment: the torchrun contract plus ours, as a pure function.

Unmodified ``init_process_group()`` scripts, Lightning and Accelerate detect a
launch from exactly these variables (torchrun 2.x exports the same set).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from .roles import AGENT_VAR, CONTROLLER_VAR, LOCAL_RANK_VAR, RANK_VAR

#: The variables every rank gets from the launcher.
TORCHRUN_CONTRACT = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)
RUN_ID_VAR = "FLODL_RUN_ID"
#: A Trainer rank restarted alone under ``--max-restarts``: which process of its rank this is (1, 2,
#: …; unset for the first). Its ``TrainerHello`` says it, so an old process is never taken for it.
INCARNATION_VAR = "FLODL_INCARNATION"
#: Role variables of the launcher and agent processes, stripped from what ranks inherit.
_NOT_INHERITED = frozenset({CONTROLLER_VAR, AGENT_VAR})


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPlacement:
    """Where one rank sits in the world of one rendezvous round."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    run_id: str
    restart_count: int
    max_restarts: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSpec:
    """What a flodl-aware rank needs to reach its relay (JSON in ``FLODL_INTERNAL_RANK_SPEC``).

    It holds the rank's own credential for this round, never the session secret: whatever
    the rank (or a child of it, or a tool that logs its environment) does with it, it can
    only speak to this host's relay, as this rank, in this round.
    """

    run_id: str
    host: str
    relay_socket: str
    data_socket: str
    round: int
    credential_hex: str = field(repr=False)

    def to_json(self) -> str:
        """Serialised for the environment."""
        where = {
            "run_id": self.run_id,
            "host": self.host,
            "relay_socket": self.relay_socket,
            "data_socket": self.data_socket,
        }
        return json.dumps(where | {"round": self.round, "credential": self.credential_hex})

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        """Parse what :meth:`to_json` wrote."""
        doc = json.loads(text)
        return cls(
            run_id=str(doc["run_id"]),
            host=str(doc["host"]),
            relay_socket=str(doc["relay_socket"]),
            data_socket=str(doc["data_socket"]),
            round=int(doc["round"]),
            credential_hex=str(doc["credential"]),
        )


def rank_environment(
    base: Mapping[str, str],
    placement: RankPlacement,
    *,
    error_file: str,
    rank_spec: RankSpec,
    cluster_env: Mapping[str, str],
    host_env: Mapping[str, str],
    cuda_visible_devices: tuple[str, ...] | None,
) -> dict[str, str]:
    """The complete environment of one rank process.

    Precedence, lowest first: the agent's own environment, the cluster file's ``env``,
    the host's ``env``, then the launcher's contract (which a cluster file cannot set).
    A launcher's or agent's role variables are never inherited: a rank that saw them too would name
    two roles and fail at dispatch (the script re-entering as a rank must not re-promote).
    """
    env = {name: value for name, value in base.items() if name not in _NOT_INHERITED}
    env.update(cluster_env)
    env.update(host_env)
    p = placement
    env.update(
        {
            "RANK": str(p.rank),
            "LOCAL_RANK": str(p.local_rank),
            "WORLD_SIZE": str(p.world_size),
            "LOCAL_WORLD_SIZE": str(p.local_world_size),
            "GROUP_RANK": str(p.group_rank),
            "GROUP_WORLD_SIZE": str(p.group_world_size),
            "ROLE_RANK": str(p.rank),
            "ROLE_WORLD_SIZE": str(p.world_size),
            "ROLE_NAME": "default",
            "MASTER_ADDR": p.master_addr,
            "MASTER_PORT": str(p.master_port),
            "TORCHELASTIC_RUN_ID": p.run_id,
            "TORCHELASTIC_RESTART_COUNT": str(p.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(p.max_restarts),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_ERROR_FILE": error_file,
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            RUN_ID_VAR: p.run_id,
            RANK_VAR: rank_spec.to_json(),
            LOCAL_RANK_VAR: str(p.local_rank),
            # Lines reach the agent as they are written, not when a block buffer fills.
            "PYTHONUNBUFFERED": env.get("PYTHONUNBUFFERED", "1"),
        }
    )
    # Several ranks on one host each spinning a full OpenMP pool oversubscribe the cores (torchrun's
    # rule: only then); a host's only rank keeps every core.
    user_set = (
        "OMP_NUM_THREADS" in cluster_env
        or "OMP_NUM_THREADS" in host_env
        or "OMP_NUM_THREADS" in base
    )
    if p.local_world_size > 1 and not user_set:
        env["OMP_NUM_THREADS"] = "1"
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(cuda_visible_devices)
    return env
