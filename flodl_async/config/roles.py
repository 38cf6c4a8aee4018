"""Role dispatch: which part this process plays, decided from the environment alone.

A pure function of the environment. The launcher and agents set these
variables on the processes they start; a user's process has none of them and
is the single-process role. Any other mix is a misconfiguration, reported
with every variable named — silently preferring one role over another costs
hours on a misconfigured cluster.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from ..errors import RoleError

CONTROLLER_VAR = "FLODL_INTERNAL_CLUSTER_SPEC"
AGENT_VAR = "FLODL_INTERNAL_AGENT_SPEC"
RANK_VAR = "FLODL_INTERNAL_RANK_SPEC"
LOCAL_RANK_VAR = "FLODL_INTERNAL_LOCAL_RANK"
ROLE_VARS = (CONTROLLER_VAR, AGENT_VAR, RANK_VAR, LOCAL_RANK_VAR)


class Role(enum.Enum):
    """The part a process plays."""

    SINGLE_PROCESS = "single-process"
    CONTROLLER = "controller"
    AGENT = "agent"
    RANK = "rank"


_TRUTH_TABLE: dict[tuple[bool, bool, bool, bool], Role] = {
    (False, False, False, False): Role.SINGLE_PROCESS,
    (True, False, False, False): Role.CONTROLLER,
    (False, True, False, False): Role.AGENT,
    (False, False, True, True): Role.RANK,
}


def detect_role(env: Mapping[str, str]) -> Role:
    """The role ``env`` describes, or :class:`RoleError` naming every role variable."""
    key = tuple(name in env for name in ROLE_VARS)
    role = _TRUTH_TABLE.get(key)  # type: ignore[arg-type]
    if role is not None:
        return role
    state = ", ".join(
        f"{name}={'set' if present else 'unset'}"
        for name, present in zip(ROLE_VARS, key, strict=True)
    )
    raise RoleError(
        f"inconsistent flodl role environment ({state}). Expected: none set (single process), "
        f"{CONTROLLER_VAR} only (controller), {AGENT_VAR} only (agent), or {RANK_VAR} with "
        f"{LOCAL_RANK_VAR} (rank). Unset the stray variables, e.g. ones inherited from an outer "
        "launch."
    )
