"""``flodl status --from-log DIR``: a finished run's summary, replayed from its event log.

Reads ``DIR/<run id>/events.jsonl`` (:mod:`flodl_async.controller.eventlog` writes it; ``DIR`` may
be the ``--log-dir`` itself when it holds one run, or the run's own directory) and says, in a few
lines, what the run did: its phases with their times, the hosts and the world, the Trainer's epochs
and rounds, deaths, recoveries and restarts, the verdict. A relaunch of the same run id writes
its own numbered file beside the earlier ones; the newest is replayed. Pure but for reading the
file; like ``flodl status``, it imports neither torch nor asyncio, and every string taken from the
log is stripped of what could act on a terminal.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from ..errors import ConfigError
from .statusclient import format_age, strip_controls

EVENTS_FILE = "events.jsonl"  # the name controller/eventlog.py writes (that package loads asyncio)
#: A relaunch of a run id writes ``events.<n>.jsonl`` beside the earlier launches' files.
_NUMBERED = re.compile(r"events(?:\.(\d+))?\.jsonl")


def _newest(run_dir: Path) -> Path | None:
    """The newest launch's event log in a run's directory, or None."""
    try:
        logs = [
            (int(match.group(1) or 0), p)
            for p in run_dir.iterdir()
            if (match := _NUMBERED.fullmatch(p.name)) and p.is_file()
        ]
    except OSError:
        return None
    return max(logs)[1] if logs else None


def find_log(directory: Path) -> Path:
    """The newest event log in ``directory`` (a run's directory, or a log dir holding exactly one
    run)."""
    own = _newest(directory)
    if own is not None:
        return own
    try:
        runs = sorted(p for p in directory.iterdir() if p.is_dir())
    except OSError as exc:
        raise ConfigError(f"--from-log: cannot read {directory}: {exc.strerror or exc}") from None
    found = [log for log in map(_newest, runs) if log is not None]
    if len(found) == 1:
        return found[0]
    if not found:
        raise ConfigError(
            f"--from-log: no event log in {directory} (a run writes DIR/<run id>/{EVENTS_FILE} "
            "when flodl-launch is given --log-dir DIR)"
        )
    names = ", ".join(p.parent.name for p in found)
    raise ConfigError(
        f"--from-log: {directory} holds {len(found)} runs ({names}); pass one: --from-log "
        f"{directory}/RUN_ID"
    )


def read_events(path: Path) -> list[dict[str, object]]:
    """The run's events in the log (unreadable lines are skipped: a run killed mid-line)."""
    events: list[dict[str, object]] = []
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ConfigError(f"--from-log: cannot read {path}: {exc.strerror or exc}") from None
    for line in text.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("id"), int):
            continue
        if doc["id"] == 1:
            events.clear()  # a relaunch with the same run id: the last run is the one to replay
        events.append(doc)
    return events


def _clock(at: object) -> str:
    if not isinstance(at, int | float) or isinstance(at, bool):
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def _num(value: object, fmt: str) -> str:
    return (
        format(value, fmt)
        if isinstance(value, int | float) and not isinstance(value, bool)
        else "?"
    )


#: What each kind of event says in the summary's event list (rounds are counted, not listed).
_SAYS: Mapping[str, Callable[[Mapping[str, object]], str]] = {
    "phase": lambda e: f"phase {e.get('phase')}",
    "host_joined": lambda e: f"host {e.get('host')} joined",
    "world_formed": lambda e: (
        f"world of {e.get('world_size')} rank(s) formed"
        + (f" (restart {e.get('restart')})" if e.get("restart") else "")
    ),
    "epoch": lambda e: (
        f"epoch {e.get('epoch')}/{e.get('epochs')}: loss "
        f"{_num(e.get('avg_loss'), '.5g')} in {_num(e.get('epoch_s'), '.1f')} s"
    ),
    "rank_died": lambda e: (
        f"rank {e.get('rank')} on {e.get('host') or '?'} died: {e.get('reason')}"
    ),
    "rank_recovered": lambda e: (
        f"rank {e.get('rank')} recovered by {e.get('by')} after {_num(e.get('seconds'), '.1f')} s"
    ),
    "restart": lambda e: f"restart {e.get('restart')}",
    "checkpoint": lambda e: (
        f"checkpoint of epoch {e.get('epoch')} in {_num(e.get('seconds'), '.1f')} s"
    ),
    "verdict": lambda e: f"verdict: {e.get('reason')} (exit {e.get('exit_code')})",
}


def summarize(run_id: str, events: Iterable[Mapping[str, object]]) -> str:
    """A finished (or interrupted) run, told from its events."""
    events = list(events)
    if not events:
        return f"run      {run_id}\nno events in its log"
    first, last = events[0].get("at"), events[-1].get("at")
    span = (
        format_age(last - first)
        if isinstance(first, int | float) and isinstance(last, int | float)
        else "?"
    )
    rounds = [e for e in events if e.get("kind") == "round"]
    verdicts = [e for e in events if e.get("kind") == "verdict"]
    lines = [
        f"run      {run_id}",
        f"from     {_clock(first)} to {_clock(last)} ({span})",
        "verdict  "
        + (
            f"{verdicts[-1].get('reason')} (exit {verdicts[-1].get('exit_code')})"
            if verdicts
            else "none logged (the controller ended without one)"
        ),
    ]
    epochs = [e for e in events if e.get("kind") == "epoch"]
    if epochs or rounds:
        reduce_s = sum(
            float(r) for r in (e.get("reduce_s") for e in rounds) if isinstance(r, int | float)
        )
        lines.append(
            f"training {len(epochs)} epoch(s), {len(rounds)} round(s), "
            f"{reduce_s:.2f} s reducing; loss by epoch: "
            + (", ".join(_num(e.get("avg_loss"), ".5g") for e in epochs) or "-")
        )
    lines.append("")
    lines += [
        f"{_clock(e.get('at'))}  {_SAYS[str(e.get('kind'))](e)}"
        for e in events
        if str(e.get("kind")) in _SAYS
    ]
    return "\n".join(strip_controls(line) for line in lines)


def replay(directory: Path) -> str:
    """``flodl status --from-log DIR``'s output."""
    path = find_log(directory)
    return summarize(path.parent.name, read_events(path))
