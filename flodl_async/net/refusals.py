"""Refused connections, summed up: at most one log line per interval, never a line per connection.

Sans-IO, like :mod:`flodl_async.net.admission` whose decisions it reports: the port mux records
each refusal with its reason and ``now``, and logs the :class:`SummaryLine` that is due.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

#: Seconds between two summary lines of refused connections. A reporting period, not a deadline:
#: it does not scale with FLODL_NET_TIMEOUT_SCALE.
SUMMARY_INTERVAL = 10.0
#: Distinct notes (why connections were refused, in words) one summary line keeps; more are counted.
MAX_NOTES = 8
#: Notes one summary line shows; the rest are summed up as "and N more".
_SHOWN_NOTES = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class SummaryLine:
    """One log line of refusals; ``warning`` when it carries a note (evictions, exhausted
    resources)."""

    text: str
    warning: bool


class RejectionSummary:
    """Refused connections, counted by reason and reported at most once per interval.

    The first refusal after a quiet interval is reported at once (an operator sees the first
    bad agent without waiting); later ones are summed up until ``interval`` has passed since
    that line. :meth:`next_due` says when the shell should ask :meth:`due` again, so pending
    counts are reported even if the flood stops. Cumulative counts by reason are in :meth:`totals`.
    Memory is bounded: reasons come from code, and notes are capped per line (:data:`MAX_NOTES`).
    """

    def __init__(
        self,
        *,
        interval: float = SUMMARY_INTERVAL,
        subject: str = "port mux",
        max_notes: int = MAX_NOTES,
    ) -> None:
        self._interval = interval
        self._subject = subject
        self._max_notes = max_notes
        self._totals: Counter[str] = Counter()
        self._pending: Counter[str] = Counter()
        self._notes: dict[str, int] = {}
        self._other_notes = 0
        self._since: float | None = None
        self._last_line: float | None = None

    def record(self, reason: str, now: float, *, note: str = "") -> None:
        """One connection refused for ``reason``; ``note`` says in words why, and makes the line a
        warning."""
        self._totals[reason] += 1
        self._pending[reason] += 1
        if note:
            self._add_note(note)
        if self._since is None:
            self._since = now

    def note(self, text: str, now: float) -> None:
        """A problem that is not one connection's (accept failing for want of descriptors): reported
        as a warning."""
        self._add_note(text)
        if self._since is None:
            self._since = now

    def next_due(self) -> float | None:
        """When the pending refusals may be reported, or None when nothing is pending."""
        if self._since is None:
            return None
        if self._last_line is None:
            return self._since
        return max(self._since, self._last_line + self._interval)

    def due(self, now: float) -> SummaryLine | None:
        """The summary line, if one is due at ``now``; at most one per interval."""
        at = self.next_due()
        if at is None or now < at:
            return None
        return self._line(now)

    def flush(self, now: float) -> SummaryLine | None:
        """Whatever is pending, due or not (the port is closing)."""
        return None if self._since is None else self._line(now)

    def totals(self) -> dict[str, int]:
        """Connections refused since the start, by reason."""
        return dict(self._totals)

    def _add_note(self, text: str) -> None:
        if text in self._notes:
            self._notes[text] += 1
        elif len(self._notes) < self._max_notes:
            self._notes[text] = 1
        else:
            self._other_notes += 1

    def _line(self, now: float) -> SummaryLine:
        assert self._since is not None
        window = now - self._since
        span = f" in the last {window:.3g} s" if window >= 0.05 else ""
        parts: list[str] = []
        refused = sum(self._pending.values())
        if refused:
            by_reason = ", ".join(
                f"{n} {reason}"
                for reason, n in sorted(self._pending.items(), key=lambda item: (-item[1], item[0]))
            )
            parts.append(
                f"refused {refused} connection{'' if refused == 1 else 's'}{span}: {by_reason}"
            )
        notes = sorted(self._notes.items(), key=lambda item: (-item[1], item[0]))
        parts += [text if n == 1 else f"{text} ({n}×)" for text, n in notes[:_SHOWN_NOTES]]
        hidden = sum(n for _, n in notes[_SHOWN_NOTES:]) + self._other_notes
        if hidden:
            parts.append(f"{hidden} more for other reasons")
        if not refused:
            parts[0] += span
        warning = bool(notes) or self._other_notes > 0
        self._pending.clear()
        self._notes.clear()
        self._other_notes = 0
        self._since = None
        self._last_line = now
        return SummaryLine(
            text=f"{self._subject}: {'; '.join(parts)}; continuing to accept", warning=warning
        )
