"""How a rank's exit reads in a verdict (control/exits, pure)."""

from __future__ import annotations

import signal

import pytest

from flodl_async.control.exits import describe_exit, failed, failure_details, signal_name
from flodl_async.wire import messages as m

TRACEBACK = (
    'Traceback (most recent call last):\n  File "t.py", line 3, in main\n'
    '    raise ValueError("x")\nValueError: x\n'
)


def _exit(
    *,
    exit_code: int | None = 1,
    sig: int | None = None,
    error_file: str = "",
    stderr_tail: tuple[str, ...] = (),
) -> m.RankExited:
    return m.RankExited(
        round=0,
        rank=2,
        local_rank=0,
        host="a",
        exit_code=exit_code,
        signal=sig,
        error_file=error_file,
        stderr_tail=stderr_tail,
    )


@pytest.mark.parametrize(
    ("exit_code", "sig", "is_failure"),
    [(0, None, False), (3, None, True), (None, signal.SIGTERM, True), (0, signal.SIGKILL, True)],
)
def test_a_failure_is_a_nonzero_code_or_a_signal(
    exit_code: int | None, sig: int | None, is_failure: bool
) -> None:
    assert failed(_exit(exit_code=exit_code, sig=sig)) is is_failure


def test_signals_are_named_and_unknown_numbers_stay_numbers() -> None:
    assert (signal_name(15), signal_name(200)) == ("SIGTERM", "signal 200")


def test_an_exit_code_reads_as_one() -> None:
    assert (
        describe_exit(_exit(exit_code=3)) == "rank 2 (local rank 0) on host 'a' exited with code 3"
    )


def test_the_whole_traceback_then_the_stderr_lines_it_does_not_hold() -> None:
    report = _exit(error_file=TRACEBACK, stderr_tail=("a warning", *TRACEBACK.splitlines()))
    assert failure_details(report) == (
        "traceback (from the rank's error file):\n"
        "  Traceback (most recent call last):\n"
        '    File "t.py", line 3, in main\n'
        '      raise ValueError("x")\n'
        "  ValueError: x\n"
        "last 1 stderr line(s) of rank 2:\n"
        "  a warning"
    )


def test_a_traceback_shown_live_is_pointed_at_and_only_its_last_line_repeated() -> None:
    report = _exit(error_file=TRACEBACK, stderr_tail=("a warning", *TRACEBACK.splitlines()))
    assert failure_details(report, shown_live=True) == (
        "traceback: above, in rank 2's stderr (also in its error file); it ended with:\n"
        "  ValueError: x\n"
        "last 1 stderr line(s) of rank 2:\n"
        "  a warning"
    )


def test_without_an_error_file_the_stderr_tail_is_all_there_is() -> None:
    assert (
        failure_details(_exit(stderr_tail=("boom",))) == "last 1 stderr line(s) of rank 2:\n  boom"
    )
    assert failure_details(_exit()) == ""


def test_a_rank_prefixed_traceback_on_stderr_is_the_error_file_s_with_its_outer_frames() -> None:
    """torch's excepthook writes ``[rank2]:`` before each line of a process group's rank, and the
    stderr copy holds the frames above ``@record`` too: neither makes it a second traceback."""
    printed = (
        "[rank2]: Traceback (most recent call last):",
        '[rank2]:   File "t.py", line 9, in <module>',
        "[rank2]:     main()",
        *(f"[rank2]: {line}" for line in TRACEBACK.splitlines()[1:]),
    )
    report = _exit(error_file=TRACEBACK, stderr_tail=("a warning", *printed, "after it"))
    assert failure_details(report, shown_live=True) == (
        "traceback: above, in rank 2's stderr (also in its error file); it ended with:\n"
        "  ValueError: x\n"
        "last 2 stderr line(s) of rank 2:\n"
        "  a warning\n"
        "  after it"
    )


def test_a_traceback_cut_by_the_tail_s_start_is_dropped_back_to_its_first_frame_line() -> None:
    outer = ('  File "t.py", line 9, in <module>', "    main()")
    report = _exit(error_file=TRACEBACK, stderr_tail=(*outer, *TRACEBACK.splitlines()[1:]))
    assert failure_details(report, shown_live=True) == (
        "traceback: above, in rank 2's stderr (also in its error file); it ended with:\n"
        "  ValueError: x"
    )
