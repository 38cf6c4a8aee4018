"""How a run's verdict line reads: ``done``, ``stopped`` (a stop someone asked for) or ``FAILED``.

One rule for ``flodl-launch`` and a Trainer's launcher, plain scripts and Trainer runs alike: a run
ended by SIGINT or SIGTERM (exit 130/143, whether its ranks stopped in order or were forced) was
stopped, not failed, and so was a Trainer run that ended by a ``TrainingRun.shutdown()`` in one of
its processes (exit 0: every rank returned the state). Pure: no I/O.
"""

from __future__ import annotations

from ..verdict import ExitCode, RunResult

#: The exit codes of a run stopped by a signal (the exit table's 128 + N).
STOP_CODES = frozenset({ExitCode.INTERRUPTED, ExitCode.TERMINATED, ExitCode.PREEMPTED})


def verdict_word(result: RunResult, *, interrupted: bool = False) -> str:
    """``done``, ``stopped`` or ``FAILED``; ``interrupted``: the Trainer's run ended by a stop."""
    if result.exit_code in STOP_CODES or (interrupted and result.exit_code is ExitCode.OK):
        return "stopped"
    return "done" if result.exit_code is ExitCode.OK else "FAILED"


def verdict_line(
    prog: str, result: RunResult, *, interrupted: bool = False, elapsed: float | None = None
) -> str:
    """``prog: stopped — interrupted by SIGINT (3.1s)``: the one line a run ends with."""
    took = "" if elapsed is None else f" ({elapsed:.1f}s)"
    return f"{prog}: {verdict_word(result, interrupted=interrupted)} — {result.reason}{took}"
