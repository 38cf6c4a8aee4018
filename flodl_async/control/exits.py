"""How a rank's exit reads in a verdict: its description, the OOM hint, the traceback and the
last stderr lines, and a signal's name.

Pure: the supervisor builds its verdicts from these; the controller's log names signals with
:func:`signal_name`.
"""

from __future__ import annotations

import re
import signal

from ..wire import messages as m


def failed(report: m.RankExited) -> bool:
    """A rank that exited non-zero or by a signal."""
    return report.exit_code != 0 or report.signal is not None


def signal_name(number: int) -> str:
    """``SIGTERM`` for 15: how a signal is named (a number it does not know stays one)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


#: Said of a SIGKILL that reached a running rank: flodl sends KILL only when it stops a run, and
#: then the run has already ended.
OOM_HINT = (
    "not sent by flodl; the kernel's OOM killer is the usual cause: look for \"Out of "
    'memory" in `dmesg` or `journalctl -k`'
)


def describe_exit(report: m.RankExited) -> str:
    """``rank 1 (local rank 1) on host 'vm' exited with code 3`` (or ``was killed by SIGKILL``, with
    the OOM hint)."""
    where = f"rank {report.rank} (local rank {report.local_rank}) on host {report.host!r}"
    return f"{where} {exit_cause(report)}"


def exit_cause(report: m.RankExited) -> str:
    """``exited with code 3`` or ``was killed by SIGKILL (...)``: :func:`describe_exit` without the
    rank."""
    how = (
        f"was killed by {signal_name(report.signal)}"
        if report.signal is not None
        else f"exited with code {report.exit_code}"
    )
    if report.signal == signal.SIGKILL and report.killed_because:
        how += f" (by its agent: {report.killed_because})"
    elif report.signal == signal.SIGKILL:
        how += f" ({OOM_HINT})"
    return how


def failure_details(report: m.RankExited, *, shown_live: bool = False) -> str:
    """The traceback from the rank's error file and its last stderr lines, for the verdict — each
    line once.

    ``@record`` writes the traceback to the error file and Python prints it to stderr too,
    so the stderr tail lines the traceback already holds are not repeated. ``shown_live``:
    the console showed the rank's stderr as it came, traceback included; the verdict then
    points at it and repeats only its last line (the exception).
    """
    details: list[str] = []
    tail = list(report.stderr_tail)
    if report.error_file:
        traceback = report.error_file.rstrip().splitlines()
        if shown_live:
            details.append(
                f"traceback: above, in rank {report.rank}'s stderr (also in its error file); it "
                "ended with:"
            )
            details.extend(f"  {line}" for line in traceback[-1:])
        else:
            details.append("traceback (from the rank's error file):")
            details.extend(f"  {line}" for line in traceback)
        tail = _without_traceback(tail, traceback)
    if tail:
        details.append(f"last {len(tail)} stderr line(s) of rank {report.rank}:")
        details.extend(f"  {line}" for line in tail)
    return "\n".join(details)


#: What torch's excepthook puts before each line a rank of a process group writes to stderr.
_RANK_PREFIX = re.compile(r"\[rank\d+\]:")
_TRACEBACK_HEADER = "Traceback (most recent call last):"


def _plain(line: str) -> str:
    """``line`` without torch's ``[rank1]:`` prefix (its indentation kept)."""
    return _RANK_PREFIX.sub("", line, count=1) if line.startswith("[rank") else line


def _without_traceback(tail: list[str], traceback: list[str]) -> list[str]:
    """The stderr tail without the traceback Python printed there too: the whole block up to the
    error file's last line (the outer frames ``@record`` did not see included), then any line the
    error file holds."""
    plain = [_plain(line) for line in tail]
    told = {line.strip() for line in traceback}
    ends = [i for i, line in enumerate(plain) if line.strip() == traceback[-1].strip()]
    block = range(0)
    if ends:
        start = ends[-1]
        # back over the frames (indented) and the chained causes (in the error file) to the header
        while start > 0 and plain[start].strip() != _TRACEBACK_HEADER:
            before = plain[start - 1]
            if not (before.startswith(" ") or before.strip() in told | {_TRACEBACK_HEADER}):
                break
            start -= 1
        block = range(start, ends[-1] + 1)
    return [
        line
        for i, (line, bare) in enumerate(zip(tail, plain, strict=True))
        if i not in block and bare.strip() not in told
    ]
