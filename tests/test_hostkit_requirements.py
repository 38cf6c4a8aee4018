"""Namespace-host tests skip on a machine that cannot make hosts, but fail under CI, where a skip would hide them all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .hostkit import missing_requirements, require_namespace_hosts, under_ci


@pytest.fixture
def no_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PATH holding none of the tools (``ip``, ``ssh``, ...), as on a minimal image without iproute2 or openssh-client."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


@pytest.mark.skipif(
    os.geteuid() != 0, reason="without root the reason is root, before any tool is looked for"
)
def test_a_missing_tool_is_named(no_tools: None) -> None:
    why = missing_requirements()
    if why is not None and why.startswith("/usr/sbin/sshd"):
        pytest.skip(why)  # no sshd here: that is found before the tools
    assert why == "ip is missing (apt-get install iproute2 util-linux openssh-client)"


@pytest.mark.parametrize("value", ["", "0", "false", "no"])
def test_without_ci_a_missing_requirement_skips(
    no_tools: None, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("CI", value)
    assert not under_ci()
    with pytest.raises(pytest.skip.Exception, match=r"is missing|need root"):
        require_namespace_hosts()


def test_without_ci_set_at_all_a_missing_requirement_skips(
    no_tools: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        require_namespace_hosts()


@pytest.mark.parametrize("value", ["true", "1", "yes", "True"])
def test_under_ci_a_missing_requirement_fails_the_test(
    no_tools: None, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("CI", value)
    with pytest.raises(
        pytest.fail.Exception,
        match=r"^CI is set, so the namespace-host tests must run, but .*(is missing|need root)",
    ):
        require_namespace_hosts()


def test_with_every_requirement_present_nothing_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    why = missing_requirements()
    if why is not None:
        pytest.skip(why)
    monkeypatch.setenv("CI", "true")
    require_namespace_hosts()  # neither skips nor fails


@pytest.mark.parametrize("ci", ["true", None], ids=["CI=true", "no-CI"])
def test_the_shared_fixture_fails_under_ci_and_skips_elsewhere(
    tmp_path: Path, ci: str | None
) -> None:
    """tests/test_hostkit.py in a pytest of its own, on a PATH without the tools: its tests error under CI, skip without."""
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(PATH=str(empty), PYTHONPATH=str(Path(__file__).parent.parent))
    if ci is not None:
        env["CI"] = ci
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_hostkit.py"]
    done = subprocess.run(
        argv,
        cwd=Path(__file__).parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if ci is None:
        assert done.returncode == 0, done.stdout + done.stderr
        assert " skipped" in done.stdout, done.stdout
        assert " error" not in done.stdout, done.stdout
    else:
        assert done.returncode == 1, done.stdout + done.stderr
        assert "CI is set, so the namespace-host tests must run, but" in done.stdout, done.stdout
        assert " error" in done.stdout, done.stdout
        assert " skipped" not in done.stdout, done.stdout
