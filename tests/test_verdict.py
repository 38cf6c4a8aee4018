"""The one exit-code table and the one signal table."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from flodl_async.verdict import EXIT_MEANINGS, ExitCode, StopStep, exit_code_for_signal, exit_help, exit_table_markdown, rank_signal_for, stop_schedule

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_reserved_codes_are_the_documented_ones() -> None:
    assert {int(c) for c in ExitCode} == {0, 1, 2, 3, 4, 5, 6, 130, 143}
    assert set(EXIT_MEANINGS) == set(ExitCode)


def test_readme_exit_table_is_the_table() -> None:
    assert exit_table_markdown() in README.read_text()


def test_help_block_lists_every_code() -> None:
    text = exit_help()
    for code in ExitCode:
        assert f"  {int(code):<4} {EXIT_MEANINGS[code]}" in text


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_exit_codes_follow_the_shell_convention(sig: signal.Signals, code: int) -> None:
    assert exit_code_for_signal(sig) == code == 128 + sig


def test_ctrl_c_reaches_ranks_as_sigint_everything_else_as_sigterm() -> None:
    assert rank_signal_for(signal.SIGINT) is signal.SIGINT
    assert rank_signal_for(signal.SIGTERM) is signal.SIGTERM
    assert rank_signal_for(signal.SIGHUP) is signal.SIGTERM


def test_stop_schedule_sigint_then_term_halfway_then_kill_at_the_grace() -> None:
    assert stop_schedule(signal.SIGINT, 10.0) == (
        StopStep(after=0.0, signal=signal.SIGINT),
        StopStep(after=5.0, signal=signal.SIGTERM),
        StopStep(after=10.0, signal=signal.SIGKILL),
    )


def test_stop_schedule_starting_with_term_has_no_second_term() -> None:
    assert stop_schedule(signal.SIGTERM, 4.0) == (StopStep(after=0.0, signal=signal.SIGTERM), StopStep(after=4.0, signal=signal.SIGKILL))


@pytest.mark.parametrize("grace", [0.0, -1.0])
def test_no_grace_is_kill_now(grace: float) -> None:
    assert stop_schedule(signal.SIGINT, grace) == (StopStep(after=0.0, signal=signal.SIGKILL),)
