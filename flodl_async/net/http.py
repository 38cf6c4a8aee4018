"""The status channel: a minimal HTTP/1.1 server on the controller port, parsed by h11.

One request per connection (``Connection: close``), with a request-size and
a request-time limit. ``/state.json`` is the board's cached encoding (see
:mod:`flodl_async.status.board`: a request never rebuilds the snapshot),
``/metrics`` the Prometheus exposition (:mod:`flodl_async.status.metrics`) and
``/`` the dashboard from package data, so serving status never waits on the
controller. Every JSON body, errors included, carries the schema marker.

``/events`` is the one long-lived answer: server-sent events. The connection
first moves to the port's stream budget (the mux's ``bind_stream`` hook; a full
budget is a 503), then gets the current snapshot (``event: snapshot``), the
recorded events after the client's ``Last-Event-ID`` (all the history holds, for
a new client), and from then on each event as it is recorded (``id:`` its
sequence number) and a fresh ``snapshot`` when one is published (at most one a
:data:`SNAPSHOT_INTERVAL`, the latest). Writes are coalesced to one per loop
turn; a client that leaves more than :data:`MAX_STREAM_BACKLOG` bytes unread is
dropped, so it never holds the controller back. The protocol has no task: the
board's subscriptions call it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import typing

import h11

from ..deadlines import Deadlines
from ..errors import SubscriptionClosed
from ..status import SCHEMA, StatusBoard, dashboard_html
from ..status.board import Subscription
from ..status.events import Stamped
from ..status.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ..status.model import StatusSnapshot

log = logging.getLogger("flodl_async.status")

MAX_REQUEST_HEAD = 8 * 1024
MAX_REQUEST_BODY = 16 * 1024
ENDPOINTS = ("/", "/state.json", "/metrics", "/events")
#: Bytes an event stream's client may leave unread in our send buffer before it is dropped.
MAX_STREAM_BACKLOG = 1 << 20
#: Seconds between comment lines on an idle event stream (a dead client shows up as a failed write).
STREAM_KEEPALIVE = 15.0
#: How long an ``EventSource`` waits before it reconnects (sent as ``retry:``, milliseconds).
STREAM_RETRY_MS = 2000
#: Seconds between two snapshots on one stream (events are never held back): a busy controller
#: publishes many a second, and a large world's snapshot is large.
SNAPSHOT_INTERVAL = 1.0


class StatusHttpProtocol(asyncio.Protocol):
    """Serves one HTTP request from the status board's cached bytes, then closes."""

    def __init__(self, board: StatusBoard, *, request_timeout: float | None = None) -> None:
        self._board = board
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_HEAD)
        self._transport: asyncio.Transport | None = None
        self._request: h11.Request | None = None
        self._body_bytes = 0
        self._received = 0
        self._timeout = (
            Deadlines.resolve().http_request if request_timeout is None else request_timeout
        )
        self._timer: asyncio.TimerHandle | None = None
        self._answered = False
        # a client on the controller's own host (loopback) also sees the ranks' output lines
        self._local = False
        # the mux's say in whether this connection may become an event stream (None: not asked)
        self._to_stream: typing.Callable[[], str | None] | None = None
        self._stream: _EventStream | None = None
        # what each h11 event does; True: the request is answered or refused, the pump stops
        self._on_event: dict[type, typing.Callable[[typing.Any], bool]] = {
            h11.Request: self._on_request,
            h11.Data: self._on_data,
            h11.EndOfMessage: self._on_end,
            h11.ConnectionClosed: self._on_closed,
        }

    def bind_stream(self, to_stream: typing.Callable[[], str | None]) -> None:
        """The mux's hook: ``to_stream()`` moves this connection to the stream budget (None) or
        says why not."""
        self._to_stream = to_stream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = typing.cast(asyncio.Transport, transport)
        self._local = _is_loopback(transport.get_extra_info("peername"))
        self._timer = asyncio.get_running_loop().call_later(self._timeout, self._expire)

    def data_received(self, data: bytes) -> None:
        if self._answered:
            return
        self._received += len(data)
        # h11 bounds only an *incomplete* head; a large head that arrives whole needs this check.
        if self._request is None and self._received > MAX_REQUEST_HEAD + MAX_REQUEST_BODY:
            self._respond_error(431, f"request head above {MAX_REQUEST_HEAD} bytes")
            return
        self._conn.receive_data(data)
        self._pump()

    def eof_received(self) -> bool | None:
        if not self._answered:
            self._conn.receive_data(b"")
            self._pump()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._stream is not None:
            self._stream.close()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if not self._answered and self._transport is not None:
            log.info("status: request not complete within %gs; closing", self._timeout)
            self._transport.abort()

    def _pump(self) -> None:
        while not self._answered:
            try:
                event = self._conn.next_event()
            except h11.RemoteProtocolError as exc:
                self._respond_error(exc.error_status_hint, f"bad request: {exc}")
                return
            if event is h11.NEED_DATA:
                return
            on_event = self._on_event.get(type(event))
            # a server is sent no other h11 event; PAUSED never comes (the pump stops at the
            # request's end)
            if on_event is not None and on_event(event):
                return

    def _on_request(self, event: h11.Request) -> bool:
        self._request = event
        if sum(len(k) + len(v) + 4 for k, v in event.headers.raw_items()) > MAX_REQUEST_HEAD:
            self._respond_error(431, f"request head above {MAX_REQUEST_HEAD} bytes")
            return True
        return False

    def _on_data(self, event: h11.Data) -> bool:
        self._body_bytes += len(event.data)
        if self._body_bytes > MAX_REQUEST_BODY:
            self._respond_error(413, f"request body above {MAX_REQUEST_BODY} bytes")
            return True
        return False

    def _on_end(self, event: h11.EndOfMessage) -> bool:
        self._serve()
        return True

    def _on_closed(self, event: h11.ConnectionClosed) -> bool:
        self._close()
        return True

    def _serve(self) -> None:
        request = self._request
        assert request is not None
        method = request.method.decode("ascii", "replace")
        path = request.target.decode("ascii", "replace").split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            self._send(
                405,
                _json({"error": f"method {method} not allowed", "allowed": ["GET", "HEAD"]}),
                head=False,
                extra=[(b"Allow", b"GET, HEAD")],
            )
            return
        head = method == "HEAD"
        if path == "/state.json":
            encoded = self._board.encoded_for(local=self._local)
            if encoded is None:
                self._send(
                    503,
                    _json({"error": "no status published yet; the controller is starting"}),
                    head=head,
                )
            else:
                self._send(200, encoded, head=head)
        elif path == "/":
            self._send(200, dashboard_html(), head=head, content_type=b"text/html; charset=utf-8")
        elif path == "/metrics":
            _ = self._board.encoded  # the connection counters, refreshed when due
            body = self._board.metrics.exposition(self._board.snapshot)
            self._send(200, body, head=head, content_type=METRICS_CONTENT_TYPE)
        elif path == "/events" and head:
            self._send(200, b"", head=True, content_type=b"text/event-stream; charset=utf-8")
        elif path == "/events":
            self._start_stream(request)
        else:
            self._send(
                404,
                _json({"error": f"no such endpoint: {path}", "endpoints": list(ENDPOINTS)}),
                head=head,
            )

    def _start_stream(self, request: h11.Request) -> None:
        refusal = self._to_stream() if self._to_stream is not None else None
        if refusal is not None:
            self._send(
                503,
                _json(
                    {
                        "error": f"no room for another event stream: {refusal}; close one, or "
                        "poll /state.json"
                    }
                ),
                head=False,
                extra=[(b"Retry-After", b"10")],
            )
            return
        self._answered = True
        if self._timer is not None:  # a stream has no request deadline: it ends when either closes
            self._timer.cancel()
            self._timer = None
        headers = [
            (b"Content-Type", b"text/event-stream; charset=utf-8"),
            (b"Cache-Control", b"no-cache"),
            (b"Connection", b"close"),
        ]
        head = self._conn.send(h11.Response(status_code=200, headers=headers)) or b""
        assert self._transport is not None
        self._transport.write(head)
        self._stream = _EventStream(
            self._board,
            self._transport,
            lambda data: self._conn.send(h11.Data(data=data)) or b"",
            local=self._local,
            after=_last_event_id(request),
        )

    def _respond_error(self, status: int, message: str) -> None:
        if self._conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self._send(
                status if 400 <= status < 600 else 400, _json({"error": message}), head=False
            )
        else:
            self._close()

    def _send(
        self,
        status: int,
        body: bytes,
        *,
        head: bool,
        content_type: bytes = b"application/json",
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        self._answered = True
        headers = [
            (b"Content-Type", content_type),
            (b"Content-Length", str(len(body)).encode()),
            (b"Cache-Control", b"no-cache"),
            (b"Connection", b"close"),
            *(extra or []),
        ]
        out = self._conn.send(h11.Response(status_code=status, headers=headers)) or b""
        if not head:
            out += self._conn.send(h11.Data(data=body)) or b""
        out += self._conn.send(h11.EndOfMessage()) or b""
        if self._transport is not None:
            self._transport.write(out)
        self._close()

    def _close(self) -> None:
        self._answered = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._transport is not None:
            self._transport.close()


class _EventStream:
    """One ``/events`` client: the snapshot, the backlog, then every event (see the module)."""

    def __init__(
        self,
        board: StatusBoard,
        transport: asyncio.Transport,
        frame: typing.Callable[[bytes], bytes],
        *,
        local: bool,
        after: int | None,
    ) -> None:
        self._board = board
        self._transport = transport
        self._frame = frame  # h11's body framing (chunked for an HTTP/1.1 client)
        self._local = local
        self._loop = asyncio.get_running_loop()
        self._flush_due = False
        self._snapshot_due = True
        self._closed = False
        # subscribed before the backlog is read: nothing is recorded in between (one thread)
        self._events: Subscription[Stamped] = board.subscribe_events(notify=self._due)
        self._snapshots: Subscription[StatusSnapshot] = board.subscribe(1, notify=self._due)
        self._keepalive = self._loop.call_later(STREAM_KEEPALIVE, self._ping)
        self._snapshot_sent = self._loop.time()
        self._snapshot_timer: asyncio.TimerHandle | None = None
        out = [f"retry: {STREAM_RETRY_MS}\n".encode()]
        encoded = board.encoded_for(local=local)
        if encoded is not None:  # the snapshot first
            out.append(b"event: snapshot\ndata: " + encoded + b"\n\n")
        self._snapshot_due = False
        out += [_frame_event(s) for s in board.events_after(0 if after is None else after)]
        self._write(b"".join(out))

    def _due(self) -> None:
        if not self._flush_due and not self._closed:
            self._flush_due = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        if self._closed:
            return
        out: list[bytes] = []
        try:
            while (stamped := self._events.get_nowait()) is not None:
                out.append(_frame_event(stamped))
            while self._snapshots.get_nowait() is not None:
                self._snapshot_due = True
        except SubscriptionClosed:  # it fell so far behind that its queue overflowed
            self._drop()
            return
        if self._snapshot_due:
            wait = self._snapshot_sent + SNAPSHOT_INTERVAL - self._loop.time()
            if wait > 0:
                if self._snapshot_timer is None:
                    self._snapshot_timer = self._loop.call_later(wait, self._snapshot_paced)
            else:
                self._snapshot_due = False
                self._snapshot_sent = self._loop.time()
                encoded = self._board.encoded_for(local=self._local)
                if encoded is not None:
                    out.append(b"event: snapshot\ndata: " + encoded + b"\n\n")
        if out:
            self._write(b"".join(out))

    def _snapshot_paced(self) -> None:
        self._snapshot_timer = None
        self._flush()

    def _ping(self) -> None:
        self._write(b": keepalive\n\n")
        if not self._closed:
            self._keepalive = self._loop.call_later(STREAM_KEEPALIVE, self._ping)

    def _write(self, data: bytes) -> None:
        if self._closed or self._transport.is_closing():
            self.close()
            return
        self._transport.write(self._frame(data))
        if self._transport.get_write_buffer_size() > MAX_STREAM_BACKLOG:
            log.info(
                "status: an event stream's client is %d bytes behind; dropping it",
                self._transport.get_write_buffer_size(),
            )
            self._drop()

    def _drop(self) -> None:
        self.close()
        self._transport.abort()

    def close(self) -> None:
        """Unsubscribe and stop the keepalive (idempotent; the connection closes on its own)."""
        if self._closed:
            return
        self._closed = True
        self._events.close()
        self._snapshots.close()
        self._keepalive.cancel()
        if self._snapshot_timer is not None:
            self._snapshot_timer.cancel()


def _frame_event(stamped: Stamped) -> bytes:
    return b"id: %d\ndata: %s\n\n" % (stamped.id, stamped.to_json())


def _last_event_id(request: h11.Request) -> int | None:
    """The ``Last-Event-ID`` a reconnecting client sends (None: absent or not ours)."""
    for name, value in request.headers:
        if name == b"last-event-id" and value.isdigit() and len(value) <= 18:
            return int(value)
    return None


def _is_loopback(peer: object) -> bool:
    """Whether a transport's ``peername`` is this host's loopback (unix sockets and unknown peers
    are not)."""
    if not isinstance(peer, tuple) or not peer:
        return False
    try:
        return ipaddress.ip_address(str(peer[0]).split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _json(doc: dict[str, object]) -> bytes:
    # The marker lets `flodl status` tell our errors (a 503 while starting) from another server's
    # JSON.
    return json.dumps({"schema": SCHEMA, **doc}).encode()
