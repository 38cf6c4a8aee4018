"""The run's event log in ``--log-dir``: ``DIR/<run id>/events.jsonl`` and ``verdict.json``.

Every event the status board records (:mod:`flodl_async.status.events`) is one JSON object a line,
with its id and wall-clock time, written as it happens: the board calls :meth:`EventLog.write` as
one of its sinks. Lines are flushed at once, except a Trainer round's (rounds can come every few
milliseconds, and every rank's ``fa.report``; they reach the disk with the next other event, or at
the close). The controller
closes the log on every way out of its run — a verdict, an internal error, a cancel (SIGINT) —
after its last publish, so the file ends with the verdict, which :meth:`EventLog.close` also
writes alone to ``verdict.json``. A relaunch with the same run id (a resubmitted job) never
writes into an earlier launch's files, as its attempts never do: it takes the next free
``events.<n>.jsonl`` and ``verdict.<n>.json``, and ``flodl status --from-log`` replays the
newest. A log that cannot be written is said once in the launcher's log and then left alone: it
never fails the run.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
from pathlib import Path
from typing import TextIO

from ..status import StatusBoard, StatusSnapshot
from ..status.events import RoundDone, ScalarsReported, Stamped

log = logging.getLogger("flodl_async.cli.launch")

#: The names of the two files in ``DIR/<run id>/``.
EVENTS_FILE = "events.jsonl"
VERDICT_FILE = "verdict.json"
#: Events that can come many a second (every round; every rank's reports): flushed with the next.
_UNFLUSHED = (RoundDone, ScalarsReported)


def numbered(name: str, n: int) -> str:
    """``events.jsonl`` for a run id's first launch, ``events.<n>.jsonl`` for the n-th after."""
    if n == 0:
        return name
    stem, dot, ext = name.rpartition(".")
    return f"{stem}.{n}{dot}{ext}"


def open_event_log(log_dir: Path | None, run_id: str, board: StatusBoard) -> EventLog | None:
    """The run's event log in ``log_dir`` (None without ``--log-dir``), fed by the board."""
    if log_dir is None:
        return None
    event_log = EventLog(log_dir / run_id)
    board.add_sink(event_log.write)
    return event_log


class EventLog:
    """One run's event log file (see the module)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._file: TextIO | None = None
        self._verdict = VERDICT_FILE
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for n in itertools.count():
                try:
                    self._file = (directory / numbered(EVENTS_FILE, n)).open("x", encoding="utf-8")
                except FileExistsError:  # an earlier launch of this run id: left as it is
                    continue
                self._verdict = numbered(VERDICT_FILE, n)
                break
        except OSError as exc:
            self._failed(exc)

    def write(self, stamped: Stamped) -> None:
        """Append one event (the board's sink)."""
        if self._file is None:
            return
        try:
            self._file.write(stamped.to_json().decode() + "\n")
            if not isinstance(stamped.event, _UNFLUSHED):
                self._file.flush()
        except OSError as exc:
            self._failed(exc)

    def close(self, final: StatusSnapshot | None) -> None:
        """Flush and close the log; write ``final``'s verdict (if any) to ``verdict.json``."""
        file, self._file = self._file, None
        if file is None:
            return
        try:
            file.close()
            if final is not None and final.verdict:
                doc = {
                    "run_id": final.run_id,
                    "phase": final.phase.value,
                    "exit_code": final.exit_code,
                    "verdict": final.verdict,
                    "ended_at": final.updated_at,
                }
                part = self.directory / (self._verdict + ".part")
                part.write_text(json.dumps(doc, sort_keys=True) + "\n", encoding="utf-8")
                os.replace(part, self.directory / self._verdict)
        except OSError as exc:
            self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):  # the error being reported is the one to say
                file.close()
        log.warning(
            "--log-dir: cannot write the event log in %s (%s); the run goes on without it",
            self.directory,
            exc.strerror or exc,
        )
