"""The one exit-code table and the one signal table."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from flodl_async.verdict import (
    AGENT_EXIT_MEANINGS,
    EXIT_MEANINGS,
    ExitCode,
    RunResult,
    StopStep,
    device_ranges,
    exit_code_for_signal,
    exit_help,
    exit_table_markdown,
    rank_ranges,
    rank_signal_for,
    restarts_text,
    stop_schedule,
)

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_reserved_codes_are_the_documented_ones() -> None:
    assert {int(c) for c in ExitCode} == {0, 1, 2, 3, 4, 5, 6, 7, 130, 143}
    assert set(EXIT_MEANINGS) == set(ExitCode)


def test_readme_exit_table_is_the_table() -> None:
    assert exit_table_markdown() in README.read_text()


def test_readme_agent_exit_table_is_flodl_agents_table() -> None:
    assert exit_table_markdown(AGENT_EXIT_MEANINGS) in README.read_text()
    assert set(AGENT_EXIT_MEANINGS) <= set(ExitCode)


def test_readme_links_stay_inside_the_repository() -> None:
    """A link to ../shared or to another site is dead in a clone or out of our hands: only files of the repository."""
    import re

    text = README.read_text()
    for target in re.findall(r"\]\(([^)]+)\)", text):
        assert not target.startswith(("http:", "https:", "/", "..")), target
        assert (README.parent / target.split("#", 1)[0]).exists(), target


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
    assert stop_schedule(signal.SIGTERM, 4.0) == (
        StopStep(after=0.0, signal=signal.SIGTERM),
        StopStep(after=4.0, signal=signal.SIGKILL),
    )


@pytest.mark.parametrize("grace", [0.0, -1.0])
def test_no_grace_is_kill_now(grace: float) -> None:
    assert stop_schedule(signal.SIGINT, grace) == (StopStep(after=0.0, signal=signal.SIGKILL),)


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ((), ""),
        ((0,), "0"),
        (range(100), "0-99"),
        ((7, 0, 1, 2, 3), "0-3,7"),
        ((1, 3, 5), "1,3,5"),
        ((4, 4, 5), "4-5"),
    ],
)
def test_rank_lists_are_compressed(ranks: tuple[int, ...], text: str) -> None:
    assert rank_ranges(ranks) == text


def test_device_lists_fold_per_kind() -> None:
    assert device_ranges([f"cpu:{i}" for i in range(100)]) == "cpu:0-99"
    assert device_ranges(["cuda:0", "cuda:1", "cuda:3", "weird"]) == "cuda:0-1,3, weird"


def test_restarts_are_counted_in_words() -> None:
    assert (restarts_text(1), restarts_text(2)) == ("1 restart", "2 restarts")


def test_a_console_that_showed_the_rank_gets_the_short_details() -> None:
    result = RunResult(
        exit_code=ExitCode.RANK_FAILURE,
        reason="r",
        details="long",
        rank=3,
        details_if_shown="short",
    )
    assert result.details_for(None) == "short"
    assert result.details_for(frozenset({3})) == "short"
    assert (
        result.details_for(frozenset({0})) == "long"
    )  # --local-ranks-filter hid rank 3: the whole traceback
    assert (
        RunResult(exit_code=ExitCode.USAGE, reason="r", details="only").details_for(None) == "only"
    )
