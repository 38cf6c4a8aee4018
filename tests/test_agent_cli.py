"""flodl-agent's failure reporting: what a session raised → one line and an exit code; output that loses its reader."""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path

import pytest

from flodl_async.agent import RankOutput, SessionConfig
from flodl_async.agent.failures import exit_code_for_error, failure_line, session_failure
from flodl_async.config.devices import DeviceSpec
from flodl_async.errors import (
    AgentError,
    AuthenticationFailed,
    ConfigError,
    ConnectionClosed,
    ControllerLost,
    ControllerUnreachable,
    FormationAborted,
    JoinFailed,
)
from flodl_async.verdict import ExitCode

CONFIG = SessionConfig(
    controller_host="10.0.0.1",
    controller_port=1337,
    secret=bytes(16),
    host="node-b",
    devices=DeviceSpec.cpu(1),
)
LOST = ConnectionClosed("join channel to 10.0.0.1:1337", by_peer=True)


def _group(*excs: Exception) -> ExceptionGroup[Exception]:
    return ExceptionGroup("unhandled errors in a TaskGroup", list(excs))


def test_a_session_error_is_itself() -> None:
    exc = FormationAborted(
        "node-b", "the controller closed the join link while waiting for the world to form"
    )
    assert session_failure(exc, CONFIG) is exc
    assert exit_code_for_error(exc) is ExitCode.FORMATION


def test_the_first_session_error_in_a_task_group_is_picked_out_of_it() -> None:
    lost = ControllerLost("node-b", "lost the join link to the controller")
    nested = _group(LOST, ExceptionGroup("inner", [lost]))
    assert session_failure(nested, CONFIG) is lost
    assert exit_code_for_error(lost) is ExitCode.RANK_FAILURE


def test_a_bare_link_error_is_the_controller_lost_before_joining() -> None:
    failure = session_failure(LOST, CONFIG)
    assert isinstance(failure, JoinFailed)
    assert exit_code_for_error(failure) is ExitCode.FORMATION
    assert "lost the controller at 10.0.0.1:1337 before joining" in failure.reason


@pytest.mark.parametrize("leaf", [LOST, AuthenticationFailed("bad tag on the join channel")])
def test_link_errors_in_a_task_group_are_the_controller_lost_mid_run(leaf: Exception) -> None:
    failure = session_failure(_group(leaf), CONFIG)
    assert isinstance(failure, ControllerLost)
    assert exit_code_for_error(failure) is ExitCode.RANK_FAILURE
    assert failure.reason == f"lost the controller at 10.0.0.1:1337 mid-run: {leaf}"


def test_a_config_error_is_a_usage_error() -> None:
    exc = ConfigError("runtime directory /run/user/0/flodl: is a symlink")
    assert session_failure(_group(exc), CONFIG) is exc
    assert exit_code_for_error(exc) is ExitCode.USAGE
    assert failure_line(exc, CONFIG.controller_addr) == f"flodl-agent: {exc}"


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("a bug"),
        _group(RuntimeError("a bug")),
        _group(
            ControllerLost("node-b", "lost"), RuntimeError("a bug alongside")
        ),  # a bug is never hidden behind a user error
        _group(BrokenPipeError(32, "Broken pipe")),
    ],
)
def test_anything_else_is_a_bug(exc: Exception) -> None:
    assert session_failure(exc, CONFIG) is None


def test_the_line_names_host_controller_and_cause_once() -> None:
    without = FormationAborted(
        "node-b", "the controller closed the join link while waiting for the world to form"
    )
    line = failure_line(without, CONFIG.controller_addr)
    assert line == (
        "flodl-agent: agent node-b: the controller closed the join link while waiting for the world to form (controller 10.0.0.1:1337)"
        f" — {FormationAborted.advice}"
    )
    already = ControllerUnreachable(
        "node-b", "cannot reach the controller at 10.0.0.1:1337: Connection refused"
    )
    assert failure_line(already, CONFIG.controller_addr).count("10.0.0.1:1337") == 1
    assert "\n" not in failure_line(AgentError("node-b", "x"), CONFIG.controller_addr)


def test_rank_output_retires_a_pipe_whose_reader_is_gone(caplog: pytest.LogCaptureFixture) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader died (with the controller, an ssh session, `| head`)
    stdout = os.fdopen(write_end, "wb")
    stderr = io.BytesIO()
    output = RankOutput(stdout=stdout, stderr=stderr)
    with caplog.at_level(logging.WARNING, logger="flodl_async.agent"):
        output.chunk("node-b", 0, 1, "out", b"got SIGTERM\n")  # would raise BrokenPipeError
        output.chunk("node-b", 0, 1, "out", b"and more\n")
        output.chunk("node-b", 0, 1, "err", b"still here\n")
    assert [r.getMessage() for r in caplog.records] == [
        "stdout is gone (Broken pipe): rank output to it is dropped from now on; the ranks keep running"
    ]
    assert stderr.getvalue() == b"[node-b:r1] still here\n"
    stdout.close()  # its descriptor now points at /dev/null: the buffered line no longer fails at close


def test_rank_output_keeps_the_log_files_when_stdout_is_gone(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)
    with os.fdopen(write_end, "wb") as stdout:
        output = RankOutput(stdout=stdout, stderr=io.BytesIO(), log_dir=tmp_path, run_id="r")
        output.chunk("node-b", 0, 0, "out", b"one\n")
        output.chunk("node-b", 0, 0, "out", b"two\n")
        output.close()
    assert (tmp_path / "r" / "attempt_0" / "0" / "stdout.log").read_bytes() == b"one\ntwo\n"
