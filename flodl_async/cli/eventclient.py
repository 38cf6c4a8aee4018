"""``flodl top``'s client of ``/events``: a blocking server-sent-events reader.

Imports nothing heavy: no torch, no asyncio, no rich.

Theory of operation
-------------------
:class:`SseParser` is pure: it takes the body's bytes as they come and returns the complete
messages (``event``, ``id``, ``data``), a line longer than :data:`MAX_SSE_LINE` being an error
(a server that never sends a newline cannot make it buffer without end). :func:`read_events`
is the shell: one HTTP request whose answer is checked as ``flodl status`` checks its own
(a redirect is refused, the type must be ``text/event-stream``), then each message's data is
parsed as JSON and cleaned with :func:`~flodl_async.cli.statusclient.clean` (every string
stripped of what could act on a terminal) before the caller sees it; a ``snapshot`` must
carry the status schema and pass :data:`~flodl_async.cli.statusclient.DOCUMENT_SHAPE`.
The controller sends a keepalive comment every 15 s, so a read that waits
:data:`STREAM_SILENCE` finds a dead link, not a quiet run.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import NotFlodlStatus
from ..status.model import SCHEMA, SCHEMA_FAMILY
from .statusclient import DOCUMENT_SHAPE, clean, strip_controls

#: A message line is a status document at most; past this it is not a flodl stream.
MAX_SSE_LINE = 16 * 1024 * 1024
#: Seconds without a byte (the controller's keepalive comes every 15 s) before the link is dead.
STREAM_SILENCE = 45.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SseMessage:
    """One server-sent message: its ``event`` name (``message`` when unnamed), ``id`` and data."""

    event: str
    id: str | None
    data: str


class SseParser:
    """Bytes in, complete messages out (the WHATWG event-stream format, ``retry`` ignored)."""

    def __init__(self) -> None:
        self._buffer = b""
        self._event = ""
        self._id: str | None = None
        self._data: list[str] = []

    def feed(self, data: bytes) -> list[SseMessage]:
        """The messages that ``data`` completes; raises :class:`NotFlodlStatus` on a line past
        :data:`MAX_SSE_LINE`."""
        self._buffer += data
        out: list[SseMessage] = []
        while True:
            cut = self._buffer.find(b"\n")
            if cut < 0:
                break
            line = self._buffer[:cut].rstrip(b"\r").decode("utf-8", "replace")
            self._buffer = self._buffer[cut + 1 :]
            message = self._line(line)
            if message is not None:
                out.append(message)
        if len(self._buffer) > MAX_SSE_LINE:
            raise NotFlodlStatus(
                f"an event stream line of more than {MAX_SSE_LINE} bytes is not a flodl stream"
            )
        return out

    def _line(self, line: str) -> SseMessage | None:
        if not line:  # a blank line dispatches the message
            message = None
            if self._data:
                message = SseMessage(
                    event=self._event or "message", id=self._id, data="\n".join(self._data)
                )
            self._event, self._data = "", []
            return message
        if line.startswith(":"):  # a comment: the keepalive
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id":
            self._id = value
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamItem:
    """A message as ``flodl top`` reads it: ``snapshot`` (the status document) or ``event`` (one
    run event: ``kind``, ``at`` and its fields), every string in it already stripped."""

    name: str
    doc: dict[str, object]


def _checked(message: SseMessage, where: str) -> StreamItem | None:
    try:
        doc = json.loads(message.data)
    except (ValueError, RecursionError):
        raise NotFlodlStatus(
            f"{where} sent an event whose data is not JSON, so not a flodl stream"
        ) from None
    if not isinstance(doc, dict):
        return None  # a newer controller's message this client does not know
    try:
        cleaned = clean(doc)
    except NotFlodlStatus:
        raise NotFlodlStatus(
            f"{where} sent an event nested too deeply for a flodl stream"
        ) from None
    assert isinstance(cleaned, dict)
    if message.event == "snapshot":
        schema = cleaned.get("schema")
        if not isinstance(schema, str) or not schema.startswith(SCHEMA_FAMILY):
            raise NotFlodlStatus(
                f"{where} sent a snapshot that lacks the {SCHEMA!r} schema marker, so not a "
                "flodl stream"
            )
        problem = DOCUMENT_SHAPE(cleaned, "")
        if problem is not None:
            raise NotFlodlStatus(f"{where} sent a snapshot that is not a flodl status: {problem}")
        return StreamItem(name="snapshot", doc=cleaned)
    if isinstance(cleaned.get("kind"), str):
        return StreamItem(name="event", doc=cleaned)
    return None


def read_events(
    host: str, port: int, *, timeout: float = 3.0, after: int = 0
) -> Iterator[StreamItem]:
    """GET /events and yield its messages until the controller closes the stream; ``after`` > 0
    resumes after that event id (``Last-Event-ID``).

    ``timeout`` bounds the connection and the answer's head; after it, the stream may stay quiet
    up to :data:`STREAM_SILENCE` between keepalives. Raises what
    :func:`~flodl_async.cli.statusclient.fetch_status` raises, for the same reasons.
    """
    where = f"{host}:{port}"
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.connect()
        sock = conn.sock  # kept: http.client hands it to the answer when the server will close
        assert sock is not None
        headers = {"Accept": "text/event-stream"}
        if after > 0:
            headers["Last-Event-ID"] = str(after)
        conn.request("GET", "/events", headers=headers)
        response = conn.getresponse()
        if response.status != 200:
            detail = strip_controls(response.read(4096).decode("utf-8", "replace")).strip()
            raise NotFlodlStatus(
                f"{where} answered /events with HTTP {response.status}"
                + (f": {detail[:200]}" if detail else "")
                + (" (a redirect, not followed)" if 300 <= response.status < 400 else "")
            )
        kind = response.getheader("Content-Type") or ""
        if not kind.startswith("text/event-stream"):
            raise NotFlodlStatus(
                f"{where} answered /events with {strip_controls(kind)[:80] or 'no type'}, not an "
                "event stream (another service on that port, or a controller older than this "
                "flodl?)"
            )
        sock.settimeout(STREAM_SILENCE)
        parser = SseParser()
        while chunk := response.read1(65536):
            for message in parser.feed(chunk):
                item = _checked(message, where)
                if item is not None:
                    yield item
    finally:
        conn.close()
