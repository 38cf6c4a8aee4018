"""Rank output in chunks and lines: the agent's chunker and the launcher's line assembler (sans-IO).

Theory of operation. A rank's pipe delivers bytes in arbitrary pieces. On the
agent, :class:`OutputChunker` turns them into the chunks sent up the host link:
whole lines as soon as they are complete, and a partial line (a progress bar
drawn with ``\\r`` before its newline) once it has waited ``idle`` seconds, so
it is visible without flooding the link with every keystroke. The idle clock
starts when the oldest unsent byte arrived, not at the last write: a bar that
redraws every 50 ms is still shown every ``idle`` seconds. Time the reader spent
away handing a chunk on does not count (:meth:`OutputChunker.handed_on`): a
partial line is sent for the rank's pause, never for a slow sink. A line longer than
``limit`` goes in pieces, so no buffer grows without bound.

On the launcher, :class:`LineAssembler` (one per rank and stream) turns chunks
back into console lines: every complete line once, whole, and after each chunk
that leaves a line unfinished, an *update* line showing what a terminal would
show of it so far (its last ``\\r`` segment). A redrawn line (one with a
``\\r``) that ends just as its last update showed it is not shown a second
time: a finished progress bar reads ``100%|###`` once, not twice. Console
writes are always whole lines, so output of different ranks never tears; files
get the raw bytes.
Nothing here imports asyncio; time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

#: A chunk (and a console line) is at most this many bytes; longer lines travel in pieces.
CHUNK_LIMIT = 64 * 1024


class OutputChunker:
    """Agent side: bytes from one rank's pipe → chunks to send (``receive_data``, ``next_chunk``,
    ``next_deadline``)."""

    def __init__(self, *, idle: float, limit: int = CHUNK_LIMIT) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1 byte")
        self._idle = idle
        self._limit = limit
        self._buffer = bytearray()
        self._pending_since: float | None = None  # when the oldest unsent byte arrived

    def receive_data(self, data: bytes, now: float) -> None:
        """Bytes read from the pipe at ``now``."""
        if data and not self._buffer:
            self._pending_since = now
        self._buffer += data

    def next_chunk(self, now: float) -> bytes | None:
        """The next chunk due at ``now``, or None: whole lines first, then a partial line that
        waited ``idle``."""
        buf = self._buffer
        if not buf:
            return None
        cut = buf.rfind(b"\n", 0, self._limit)
        if cut >= 0:
            return self._take(cut + 1, now)
        if len(buf) >= self._limit:
            return self._take(self._limit, now)
        assert self._pending_since is not None
        if now >= self._pending_since + self._idle:
            return self._take(len(buf), now)
        return None

    def next_deadline(self) -> float | None:
        """When the buffered partial line becomes due (None when nothing waits)."""
        if not self._buffer or self._pending_since is None:
            return None
        return self._pending_since + self._idle

    def handed_on(self, now: float) -> None:
        """The chunk just taken was handed on at ``now``: a partial line it left waits ``idle`` from
        now.

        The reader was away while the sink took the chunk (a saturated link can hold it for
        seconds), so what the rank wrote meanwhile is still in its pipe, unread: the line it
        was finishing would otherwise go out in two pieces, shown half first, for the sink's
        slowness rather than the rank's pause.
        """
        if self._buffer:
            self._pending_since = now

    def end(self) -> bytes:
        """End of the stream: everything still buffered."""
        rest = bytes(self._buffer)
        self._buffer.clear()
        self._pending_since = None
        return rest

    def _take(self, n: int, now: float) -> bytes:
        chunk = bytes(self._buffer[:n])
        del self._buffer[:n]
        # What stays behind is new as of now: it was just uncovered, not sent late.
        self._pending_since = now if self._buffer else None
        return chunk


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsoleLine:
    """One line for the console, without prefix, ending in ``\\n``; ``update`` when its rank has not
    finished it yet."""

    text: bytes
    update: bool = False


class LineAssembler:
    """Launcher side: one rank's one stream, chunks → :class:`ConsoleLine` s."""

    def __init__(self, *, limit: int = CHUNK_LIMIT) -> None:
        self._limit = limit
        self._partial = bytearray()
        self._shown = False  # the unfinished line, as it stands, was shown as an update
        self._last_update: bytes | None = None  # the last update shown of the unfinished line

    def receive_data(self, data: bytes) -> list[ConsoleLine]:
        """The lines to show after ``data``: complete lines, then an update for an unfinished
        one."""
        lines: list[ConsoleLine] = []
        self._partial += data
        start = 0
        buf = self._partial
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = bytes(buf[start:nl])
            text = _visible(line) + b"\n"
            # Only the first line of a chunk can have been shown as an update; a redrawn one that
            # ends exactly as last shown is on the console already (its newline repeats nothing).
            if not (start == 0 and b"\r" in line and text == self._last_update):
                lines.append(ConsoleLine(text=text))
            self._last_update = None
            start = nl + 1
        del buf[:start]
        if data:
            self._shown = False
        if len(buf) >= self._limit:  # an over-long line is shown in pieces, as it travelled
            lines.append(ConsoleLine(text=_visible(bytes(buf)) + b"\n"))
            buf.clear()
            self._last_update = None
        elif buf and data:
            update = ConsoleLine(text=_visible(bytes(buf)) + b"\n", update=True)
            lines.append(update)
            self._shown = True
            self._last_update = update.text
        return lines

    def end(self) -> list[ConsoleLine]:
        """The stream ended: an unfinished line not shown as it stands is shown as a line of its
        own."""
        shown, self._shown = self._shown, False
        self._last_update = None
        if not self._partial:
            return []
        line = ConsoleLine(text=_visible(bytes(self._partial)) + b"\n")
        self._partial.clear()
        return [] if shown else [line]


def _visible(line: bytes) -> bytes:
    """What a terminal shows of ``line``: its last non-empty ``\\r`` segment (tqdm redraws with
    ``\\r``)."""
    if b"\r" not in line:
        return line
    for segment in reversed(line.split(b"\r")):
        if segment:
            return segment
    return b""
