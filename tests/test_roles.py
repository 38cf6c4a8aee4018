"""Role dispatch is a pure function of the environment."""

from __future__ import annotations

import itertools

import pytest

from flodl_async.config.roles import (
    AGENT_VAR,
    CONTROLLER_VAR,
    LOCAL_RANK_VAR,
    RANK_VAR,
    ROLE_VARS,
    Role,
    detect_role,
)
from flodl_async.errors import RoleError


@pytest.mark.parametrize(
    ("names", "role"),
    [
        ((), Role.SINGLE_PROCESS),
        ((CONTROLLER_VAR,), Role.CONTROLLER),
        ((AGENT_VAR,), Role.AGENT),
        ((RANK_VAR, LOCAL_RANK_VAR), Role.RANK),
    ],
)
def test_valid_roles(names: tuple[str, ...], role: Role) -> None:
    assert detect_role(dict.fromkeys(names, "x") | {"PATH": "/bin"}) is role


def test_every_other_mix_is_a_loud_error_naming_every_variable() -> None:
    valid = {(), (CONTROLLER_VAR,), (AGENT_VAR,), (RANK_VAR, LOCAL_RANK_VAR)}
    bad = 0
    for size in range(1, len(ROLE_VARS) + 1):
        for names in itertools.combinations(ROLE_VARS, size):
            if names in valid:
                continue
            bad += 1
            with pytest.raises(RoleError) as info:
                detect_role(dict.fromkeys(names, "1"))
            for name in ROLE_VARS:
                state = "set" if name in names else "unset"
                assert f"{name}={state}" in str(info.value)
    assert bad == 12
