"""One table of exit codes and one table of stop signals, for every command.

``flodl-launch``, ``flodl-agent`` and ``flodl`` exit with codes from
:class:`ExitCode` (``flodl status`` with :class:`StatusExit`); the README's
table and every ``--help`` epilog are rendered from :data:`EXIT_MEANINGS`, and a
test holds the README to it.

The signal table (:func:`stop_schedule`) is what every agent, local or remote,
does to its plain-script ranks when a run stops: the signal the launcher got
first reaches the ranks as that signal (Ctrl-C is SIGINT, so ``except
KeyboardInterrupt: save()`` runs, as under torchrun; ``systemctl stop`` is
SIGTERM), then TERM, then KILL at one deadline shared by every rank. A second
signal to the launcher or agent forces: KILL at once. ``Abort`` carries the
first signal down, so a remote agent follows the same schedule.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Iterable
from dataclasses import dataclass


class ExitCode(enum.IntEnum):
    """Exit codes of ``flodl-launch`` and ``flodl-agent``."""

    OK = 0
    INTERNAL = 1
    USAGE = 2
    FORMATION = 3
    RANK_FAILURE = 4
    MAX_FAILURE = 5
    STALLED = 6
    PREEMPTED = 7
    INTERRUPTED = 130
    TERMINATED = 143


#: What each code means, for ``--help`` and the README (one source for both).
EXIT_MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "every rank exited 0, or a Trainer run completed with ranks lost under "
    "max_failure (its verdict says DEGRADED and names them)",
    ExitCode.INTERNAL: "internal error (a bug: please report it)",
    ExitCode.USAGE: "bad arguments, cluster file or runtime directory, or the port is taken; "
    "nothing was started",
    ExitCode.FORMATION: "the world did not form (join window failed, join refused, store did not "
    "come up)",
    ExitCode.RANK_FAILURE: "a rank failed (after any allowed restarts), or an agent or the "
    "controller was lost",
    ExitCode.MAX_FAILURE: "more ranks failed than max_failure allows (elastic runs)",
    ExitCode.STALLED: "training stalled: no progress within the hang deadline",
    ExitCode.PREEMPTED: "preempted, checkpoint written: run the same command to resume (a Trainer "
    "run with a save_path got the preemption signal, SIGUSR1 unless --preempt-signal says)",
    ExitCode.INTERRUPTED: "interrupted by SIGINT (Ctrl-C); a second signal kills at once",
    ExitCode.TERMINATED: "terminated by SIGTERM; a second signal kills at once",
}


#: What flodl-agent's exit codes mean (its --help and the README's agent table are rendered from
#: it).
AGENT_EXIT_MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "the run finished (the controller said Finish)",
    ExitCode.INTERNAL: "internal error (a bug: please report it)",
    ExitCode.USAGE: "bad arguments, secret or token file, or runtime directory; nothing was "
    "started (the one failure that ends --persist)",
    ExitCode.FORMATION: "could not join: no controller answered within --connect-timeout, its "
    "handshake proof did not verify (another token, or not our controller), join refused, or the "
    "world did not form; never with --persist, which dials again",
    ExitCode.RANK_FAILURE: "the run failed: the controller aborted it (a rank failed, the launcher "
    "was stopped) or the controller was lost",
    ExitCode.INTERRUPTED: "stopped by SIGINT (the ranks got SIGINT first); a second signal kills "
    "them at once",
    ExitCode.TERMINATED: "stopped by SIGTERM (the ranks got SIGTERM first); a second signal kills "
    "them at once",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """A run's verdict: an exit code, a one-line reason, and details for the operator."""

    exit_code: ExitCode
    reason: str
    details: str = ""
    #: The failed rank the verdict names, if one; its live output may already hold the traceback.
    rank: int | None = None
    #: ``details`` for a console that already showed that rank's stderr live: the traceback is not
    #: repeated.
    details_if_shown: str = ""

    def details_for(self, shown: frozenset[int] | None) -> str:
        """The details to print when the console shows the ranks in ``shown`` (None: every rank)."""
        if (
            self.rank is not None
            and (shown is None or self.rank in shown)
            and self.details_if_shown
        ):
            return self.details_if_shown
        return self.details


class StatusExit(enum.IntEnum):
    """Exit codes of ``flodl status``."""

    OK = 0
    UNREACHABLE = 1
    USAGE = 2


STATUS_EXIT_MEANINGS: dict[StatusExit, str] = {
    StatusExit.OK: "a flodl controller answered",
    StatusExit.UNREACHABLE: "nothing answers at that address, or what answers is not a flodl "
    "status",
    StatusExit.USAGE: "bad arguments",
}


def exit_help(meanings: dict[ExitCode, str] | None = None) -> str:
    """The ``exit codes:`` block of an epilog."""
    rows = EXIT_MEANINGS if meanings is None else meanings
    return (
        "exit codes:\n"
        + "\n".join(f"  {int(code):<4} {text}" for code, text in rows.items())
        + "\n"
    )


def exit_table_markdown(meanings: dict[ExitCode, str] | None = None) -> str:
    """The README's exit-code table, rendered from :data:`EXIT_MEANINGS` (or flodl-agent's,
    :data:`AGENT_EXIT_MEANINGS`)."""
    rows = EXIT_MEANINGS if meanings is None else meanings
    lines = ["| code | meaning |", "| --- | --- |"]
    lines.extend(f"| {int(code)} | {text} |" for code, text in rows.items())
    return "\n".join(lines)


def rank_ranges(ranks: Iterable[int]) -> str:
    """``0-99`` or ``0-3,7``: a rank list as short as it can be said (sorted, duplicates
    dropped)."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    start = prev = None
    for rank in ordered:
        if prev is not None and rank == prev + 1:
            prev = rank
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = rank
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def device_ranges(labels: Iterable[str]) -> str:
    """``cpu:0-99`` or ``cuda:0-3,7``: device labels of one kind folded like :func:`rank_ranges`
    (others as they are)."""
    kinds: dict[str, list[int]] = {}
    others: list[str] = []
    for label in labels:
        kind, _, index = label.partition(":")
        if index.isdigit():
            kinds.setdefault(kind, []).append(int(index))
        else:
            others.append(label)
    return ", ".join([f"{kind}:{rank_ranges(ids)}" for kind, ids in kinds.items()] + others)


def restarts_text(count: int) -> str:
    """``1 restart`` / ``2 restarts``."""
    return f"{count} restart" if count == 1 else f"{count} restarts"


def exit_code_for_signal(sig: int) -> ExitCode:
    """The code a run stopped by ``sig`` exits with (the shell's 128 + N convention)."""
    return ExitCode.INTERRUPTED if sig == signal.SIGINT else ExitCode.TERMINATED


# ----- the signal table -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StopStep:
    """Send ``signal`` to every surviving rank's process group ``after`` seconds into the stop."""

    after: float
    signal: signal.Signals


def rank_signal_for(received: int) -> signal.Signals:
    """The first signal plain-script ranks get when the launcher or agent received ``received``."""
    return signal.SIGINT if received == signal.SIGINT else signal.SIGTERM


def stop_schedule(first: int, grace: float) -> tuple[StopStep, ...]:
    """First ``first`` now, then TERM halfway (when the first was not TERM), then KILL at ``grace``.

    The TERM step gives a script that caught SIGINT (to save a checkpoint) and then hung a
    second, conventional chance before the KILL; every rank shares the one KILL deadline.
    ``grace`` 0 is "force": KILL at once.
    """
    if grace <= 0:
        return (StopStep(after=0.0, signal=signal.SIGKILL),)
    first_signal = signal.Signals(first)
    steps = [StopStep(after=0.0, signal=first_signal)]
    if first_signal is not signal.SIGTERM:
        steps.append(StopStep(after=grace / 2, signal=signal.SIGTERM))
    steps.append(StopStep(after=grace, signal=signal.SIGKILL))
    return tuple(steps)
