"""``flodl top`` (and ``flodl status --watch``): a run watched live from its ``/events`` stream.

Theory of operation
-------------------
:class:`TopView` is pure: it folds the stream's items (the snapshot, each event) into what is
shown — the latest status document, the last round, the last :data:`LAST_EVENTS` event lines,
the verdict — and says, for the plain mode, which lines are new (:meth:`TopView.take`). Two
shells draw it:

* on a terminal, a ``rich`` live view redrawn in place (``rich`` is imported here, inside
  :func:`watch`, and nowhere on the launcher's path);
* when stdout is not a terminal, or under journald (``JOURNAL_STREAM`` set), plain lines
  appended as things happen: each event, and the training line when it changes.

A stream that ends before the verdict (the controller drops a client that fell behind; a link
may blip) is opened again with ``Last-Event-ID``, so nothing is missed or told twice; after
:data:`RESUME_TRIES` streams in a row with nothing new, the run is given up on.

Every string shown came through :func:`~flodl_async.cli.statusclient.clean` (control and
format characters stripped) and reaches rich as a ``Text``, which is never parsed for markup:
a rank that prints ``[bold]`` shows ``[bold]``.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from ..verdict import rank_ranges
from .eventclient import StreamItem
from .statusclient import format_age, strip_controls, training_line

if TYPE_CHECKING:
    from rich.console import RenderableType

#: How many event lines the view keeps.
LAST_EVENTS = 8
#: Events too frequent for the event list: they move the training line instead.
_QUIET_KINDS = frozenset({"round", "scalars"})


def _num(value: object, fmt: str, default: str = "?") -> str:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return format(value, fmt) if ok else default


def _ranks(value: object) -> str:
    if isinstance(value, list) and all(type(r) is int for r in value):
        return rank_ranges(value) or "none"
    return "?"


#: How each event kind reads as one line (kinds a newer controller adds read as their name).
_EVENT_LINES: Mapping[str, Callable[[Mapping[str, object]], str]] = {
    "phase": lambda e: f"phase {e.get('phase', '?')}",
    "host_joined": lambda e: (
        f"host {e.get('host', '?')} joined with ranks {_ranks(e.get('ranks'))}"
    ),
    "world_formed": lambda e: (
        f"world formed: {e.get('world_size', '?')} ranks on {e.get('hosts', '?')} hosts"
        + (f" (restart {e['restart']})" if e.get("restart") else "")
    ),
    "epoch": lambda e: (
        f"epoch {e.get('epoch', '?')}/{e.get('epochs', '?')}: loss {_num(e.get('avg_loss'), '.4f')}"
        f" in {_num(e.get('epoch_s'), '.1f')}s, {e.get('batches', '?')} batches, "
        f"{e.get('reduces', '?')} reduces, anchor rank {e.get('anchor', '?')}"
    ),
    "rank_died": lambda e: (
        f"rank {e.get('rank', '?')} on {e.get('host', '?')} died: {e.get('reason', '?')}"
    ),
    "rank_recovered": lambda e: (
        f"rank {e.get('rank', '?')} on {e.get('host', '?')}: recovered by "
        f"{e.get('by', '?')} after {_num(e.get('seconds'), '.1f')}s"
    ),
    "restart": lambda e: f"world restarted (restart {e.get('restart', '?')})",
    "checkpoint": lambda e: (
        f"checkpoint of epoch {e.get('epoch', '?')} written to "
        f"{e.get('path', '?')} in {_num(e.get('seconds'), '.1f')}s"
    ),
    "verdict": lambda e: f"verdict: {e.get('reason', '?')} (exit {e.get('exit_code', '?')})",
}


def event_line(event: Mapping[str, object]) -> str:
    """One event as ``HH:MM:SS what happened``."""
    kind = str(event.get("kind", "?"))
    at = event.get("at")
    when = time.strftime("%H:%M:%S", time.localtime(at)) if isinstance(at, int | float) else "--"
    told = _EVENT_LINES.get(kind)
    text = told(event) if told is not None else kind
    return strip_controls(f"{when} {text}")


class TopView:
    """What ``flodl top`` shows, folded from the stream (see the module)."""

    def __init__(self) -> None:
        self.doc: dict[str, object] = {}
        self.last_round: dict[str, object] | None = None
        self.events: collections.deque[str] = collections.deque(maxlen=LAST_EVENTS)
        self.verdict: str | None = None
        self.last_id = 0  # the board numbers events from 1, in order: one told twice is skipped
        self._fresh: list[str] = []
        self._told_training = ""

    def apply(self, item: StreamItem) -> None:
        """Fold one stream item in."""
        if item.name == "snapshot":
            self.doc = item.doc
            self._training_changed()
            return
        event = item.doc
        event_id = event.get("id")
        if type(event_id) is int:
            if event_id <= self.last_id:
                return
            self.last_id = event_id
        kind = event.get("kind")
        if kind == "round":
            self.last_round = event
            return
        if kind in _QUIET_KINDS:
            return
        line = event_line(event)
        if kind == "verdict":
            self.verdict = line.split(" ", 1)[1].removeprefix("verdict: ")
        self.events.append(line)
        self._fresh.append(line)

    def _training_changed(self) -> None:
        training = self.doc.get("training")
        text = training_line(training) if isinstance(training, dict) else ""
        if text and text != self._told_training:
            self._told_training = text
            self._fresh.append(f"{time.strftime('%H:%M:%S')} training {text}")

    @property
    def ended(self) -> bool:
        """The run has its verdict."""
        return self.verdict is not None

    def take(self) -> list[str]:
        """The plain-mode lines since the last call."""
        fresh, self._fresh = self._fresh, []
        return fresh

    def header(self) -> list[str]:
        """The run, phase, ranks and training lines above the table."""
        d = self.doc
        lines = [
            f"run {d.get('run_id', '?')}   phase {d.get('phase', '?')}   "
            f"{d.get('joined_ranks', 0)} ranks joined, world size {d.get('world_size', 0)}, "
            f"restarts {d.get('restart_count', 0)}"
        ]
        training = d.get("training")
        if isinstance(training, dict):
            text = f"training {training_line(training)}"
            r = self.last_round
            if r is not None:
                text += (
                    f"; round {r.get('round', '?')}: loss {_num(r.get('loss'), '.4f', '-')}, "
                    f"reduce {_num(r.get('reduce_s'), '.3f')}s"
                )
            lines.append(text)
        return lines

    def rank_rows(self) -> list[tuple[str, ...]]:
        """One row per rank, grouped by host: host, rank, state, process, CPU, up, output age,
        last line."""
        ranks = [r for r in self.doc.get("ranks") or [] if isinstance(r, dict)]  # type: ignore[attr-defined]
        ranks.sort(key=lambda r: (str(r.get("host", "")), _num(r.get("rank"), "08d", "")))
        rows: list[tuple[str, ...]] = []
        previous = None
        for r in ranks:
            host = str(r.get("host", "?"))
            up, age = r.get("uptime_s"), r.get("output_age_s")
            rows.append(
                (
                    host if host != previous else "",
                    str(r.get("rank", "?")),
                    str(r.get("state", "?")),
                    str(r.get("process") or "-"),
                    _num(r.get("cpu_percent"), ".0f", "-"),
                    format_age(up) if isinstance(up, int | float) else "-",
                    format_age(age) if isinstance(age, int | float) else "-",
                    str(r.get("last_line") or ""),
                )
            )
            previous = host
        return rows


_COLUMNS = ("HOST", "RANK", "STATE", "PROCESS", "CPU%", "UP", "OUTPUT", "LAST LINE")


def render(view: TopView) -> RenderableType:
    """The live view as a rich renderable: every server string a ``Text`` (never markup)."""
    from rich.console import Group  # deferred: rich's import cost is flodl top's alone
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, pad_edge=False, header_style="bold", expand=False)
    for name in _COLUMNS:
        table.add_column(Text(name), no_wrap=name != "LAST LINE", overflow="ellipsis")
    for row in view.rank_rows():
        table.add_row(*(Text(cell) for cell in row))
    parts: list[RenderableType] = [Text(line, style="bold") for line in view.header()]
    parts += [Text(""), table, Text(""), Text("events", style="bold")]
    parts += [Text(line) for line in view.events] or [Text("(none yet)", style="dim")]
    return Group(*parts)


def plain_wanted() -> bool:
    """Plain appended lines: stdout is not a terminal, or journald reads it."""
    return bool(os.environ.get("JOURNAL_STREAM")) or not sys.stdout.isatty()


#: Streams in a row that may end without a new event before ``flodl top`` gives up on the run.
RESUME_TRIES = 3


def _resumed(view: TopView, connect: Callable[[int], Iterable[StreamItem]]) -> Iterator[StreamItem]:
    """The stream, opened again after the last event seen when it ends before the verdict (the
    controller drops a client that fell behind; a link may blip); what the controller raises on a
    new connection passes to the caller."""
    idle = 0
    while idle < RESUME_TRIES:
        before = view.last_id
        yield from connect(before)
        idle = idle + 1 if view.last_id == before else 0


def watch(
    connect: Callable[[int], Iterable[StreamItem]], *, plain: bool, say: Callable[[str], None]
) -> TopView:
    """Show the stream that ``connect(after)`` opens until the verdict, or until it ends
    :data:`RESUME_TRIES` times in a row with nothing new; returns the view as it ended.

    ``KeyboardInterrupt`` passes to the caller after the live view is closed.
    """
    view = TopView()
    items = _resumed(view, connect)
    if plain:
        for item in items:
            view.apply(item)
            for line in view.take():
                say(line)
            if view.ended:
                break
        return view
    from rich.console import Console  # deferred: see render
    from rich.live import Live

    console = Console()
    with Live(render(view), console=console, refresh_per_second=4, transient=False) as live:
        for item in items:
            view.apply(item)
            view.take()
            live.update(render(view))
            if view.ended:
                break
    return view
