"""flodl-agent's failure reporting: what a session raised → one line and an exit code; output that loses its reader."""

from __future__ import annotations

import io
import logging
import os
import socket
from pathlib import Path

import pytest

from flodl_async.agent import RankOutput, SessionConfig
from flodl_async.agent.failures import (
    exit_code_for_error,
    failure_line,
    persist_exit_code,
    persist_retry_level,
    session_failure,
)
from flodl_async.agent.join import mends_by_waiting
from flodl_async.config.devices import DeviceSpec
from flodl_async.errors import (
    AgentError,
    AuthenticationFailed,
    ClosedBeforeJoin,
    ConfigError,
    ConnectionClosed,
    ControllerLost,
    ControllerNotProved,
    ControllerUnreachable,
    FormationAborted,
    JoinFailed,
    JoinRejected,
    WrongToken,
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


def _caused(exc: AgentError, cause: BaseException) -> AgentError:
    exc.__cause__ = cause
    return exc


NOT_PROVED = _caused(
    ControllerNotProved(
        "node-b",
        "cannot join the controller at 10.0.0.1:1337: join channel: the controller's proof did not "
        "verify: it holds another cluster token, or it is not our controller",
    ),
    WrongToken("join channel: the controller's proof did not verify"),
)
EVICTED = ClosedBeforeJoin(
    "node-b", "the controller at 10.0.0.1:1337 closed the connection before its handshake finished"
)


@pytest.mark.parametrize(
    ("exc", "mends"),
    [
        (
            _caused(ControllerUnreachable("node-b", "refused"), ConnectionRefusedError(111, "x")),
            True,
        ),
        (EVICTED, True),  # the per-address cap evicted it: the next try may get in
        (NOT_PROVED, False),  # a one-run agent says a wrong token now, not in a minute
        (_caused(ControllerUnreachable("node-b", "hung"), TimeoutError()), False),
        (_caused(ControllerUnreachable("node-b", "no such name"), socket.gaierror(-2, "x")), False),
        (JoinRejected("node-b", "join rejected by the controller: version"), False),
        (FormationAborted("node-b", "the world did not form"), False),
    ],
)
def test_what_a_one_run_agent_waits_out_within_its_connect_timeout(
    exc: AgentError, mends: bool
) -> None:
    assert mends_by_waiting(exc) is mends


@pytest.mark.parametrize(
    ("exc", "level"),
    [
        (NOT_PROVED, logging.WARNING),  # an impostor or another token: said every time
        (EVICTED, logging.WARNING),
        (ControllerUnreachable("node-b", "refused"), logging.INFO),  # between runs: expected
        (ControllerLost("node-b", "lost"), logging.INFO),
        (JoinRejected("node-b", "join rejected by the controller: version"), logging.INFO),
    ],
)
def test_a_persistent_agent_retries_every_session_failure_the_proof_ones_loudly(
    exc: AgentError, level: int
) -> None:
    assert persist_exit_code(exc) is None
    assert persist_retry_level(exc) == level


def test_only_a_usage_problem_ends_a_persistent_agent() -> None:
    assert persist_exit_code(ConfigError("no devices")) is ExitCode.USAGE


def test_a_failed_proof_names_both_causes_and_no_session_secret() -> None:
    assert exit_code_for_error(NOT_PROVED) is ExitCode.FORMATION  # one run: exit 3 at once
    line = failure_line(NOT_PROVED, CONFIG.controller_addr)
    assert "another cluster token" in line
    assert "not our controller" in line
    assert "session secret" not in line  # a dial-in agent holds none
    evicted = failure_line(EVICTED, CONFIG.controller_addr)
    assert "session secret" not in evicted
    assert "evicts" in evicted


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
