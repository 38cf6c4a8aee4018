"""What Trainer.run() does here is a pure function of the environment, tested whole."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from flodl_async.config.roles import AGENT_VAR, CONTROLLER_VAR, LOCAL_RANK_VAR, RANK_VAR
from flodl_async.errors import ConfigError, RoleError
from flodl_async.host.gpus import DEV_DIR_VARIABLE, host_visible_gpus
from flodl_async.trainer.entry import Entry, decide_entry, resolve_rank_command

ROLE_ENVS = {
    "single": {},
    "controller": {CONTROLLER_VAR: "/c.yml"},
    "agent": {AGENT_VAR: "{}"},
    "rank": {RANK_VAR: "{}", LOCAL_RANK_VAR: "0"},
}


def _expected(role: str, cluster: bool, gpus: int, promote: bool) -> Entry:
    if role == "rank":
        return Entry.RANK
    if role == "agent":
        return Entry.AGENT
    if role == "controller" or cluster or (promote and gpus >= 2):
        return Entry.LAUNCHER
    return Entry.INLINE


@pytest.mark.parametrize(
    ("role", "cluster", "gpus", "promote"),
    list(itertools.product(ROLE_ENVS, (False, True), (0, 1, 2, 8), (False, True))),
)
def test_the_whole_table(role: str, cluster: bool, gpus: int, promote: bool) -> None:
    env = {"PATH": "/bin", **ROLE_ENVS[role]}
    assert decide_entry(
        env, cluster_given=cluster, auto_promote=promote, visible_gpus=gpus
    ) is _expected(role, cluster, gpus, promote)


def test_a_rank_never_re_promotes_even_with_gpus_and_a_cluster() -> None:
    env = dict(ROLE_ENVS["rank"])
    assert decide_entry(env, cluster_given=True, auto_promote=True, visible_gpus=8) is Entry.RANK


def test_an_inconsistent_environment_names_every_variable() -> None:
    with pytest.raises(RoleError) as info:
        decide_entry(
            {CONTROLLER_VAR: "x", RANK_VAR: "y"},
            cluster_given=False,
            auto_promote=True,
            visible_gpus=0,
        )
    for name in (CONTROLLER_VAR, AGENT_VAR, RANK_VAR, LOCAL_RANK_VAR):
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("value", "count"),
    [
        ("", 0),
        ("-1", 0),
        ("0", 1),
        ("0,2", 2),
        ("0, 1, 3", 3),
        ("1,-1,2", 1),
        ("GPU-abc,GPU-def", 2),
        ("0,,1", 1),
    ],
)
def test_cuda_visible_devices_wins_over_device_nodes(
    value: str, count: int, tmp_path: Path
) -> None:
    env = {"CUDA_VISIBLE_DEVICES": value, DEV_DIR_VARIABLE: str(_nodes(tmp_path, 8))}
    assert len(host_visible_gpus(env)) == count  # what Trainer.entry counts


def test_without_cuda_visible_devices_the_device_nodes_count(tmp_path: Path) -> None:
    assert len(host_visible_gpus({DEV_DIR_VARIABLE: str(_nodes(tmp_path, 3))})) == 3
    assert len(host_visible_gpus({})) >= 0  # this machine's /dev, whatever it holds


def _nodes(where: Path, n: int) -> Path:
    """A directory holding ``n`` GPU device nodes (empty files named as the driver names them)."""
    for i in range(n):
        (where / f"nvidia{i}").touch()
    (where / "nvidiactl").touch()  # not a GPU
    return where


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["python", "train.py", "--epochs", "3"], ("/py", "train.py", "--epochs", "3")),
        (["python", "-m", "pkg.train", "-x"], ("/py", "-m", "pkg.train", "-x")),
        (["python", "-X", "dev", "-u", "train.py"], ("/py", "-X", "dev", "-u", "train.py")),
        (["python", "-W", "error", "train.py"], ("/py", "-W", "error", "train.py")),
        (["python", "-mpkg"], ("/py", "-mpkg")),
    ],
)
def test_the_rank_command_re_runs_the_program(argv: list[str], command: tuple[str, ...]) -> None:
    assert resolve_rank_command(argv, "/py") == command


@pytest.mark.parametrize(
    ("argv", "what"),
    [
        (["python", "-c", "x"], "python -c"),
        (["python"], "interactive"),
        (["python", "-"], "standard input"),
    ],
)
def test_a_program_that_cannot_be_re_executed_is_refused_with_what_to_do(
    argv: list[str], what: str
) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_rank_command(argv, "/py")
    text = str(info.value)
    assert what in text
    assert "rank_command" in text
    assert "auto_promote=False" in text


def test_a_given_rank_command_wins_and_is_checked() -> None:
    assert resolve_rank_command(["python", "-c", "x"], "/py", given=["/py", "-m", "app.rank"]) == (
        "/py",
        "-m",
        "app.rank",
    )
    with pytest.raises(ConfigError, match="rank_command"):
        resolve_rank_command(["python", "t.py"], "/py", given=[])
