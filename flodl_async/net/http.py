"""The status channel: a minimal HTTP/1.1 server on the controller port, parsed by h11.

One request per connection (``Connection: close``), with a request-size and
a request-time limit. ``/state.json`` is the board's cached encoding (see
:mod:`flodl_async.status.board`: a request never rebuilds the snapshot) and
``/`` the dashboard from package data, so serving status never waits on the
controller. Every JSON body, errors included, carries the schema marker.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import typing

import h11

from ..deadlines import Deadlines
from ..status import SCHEMA, StatusBoard, dashboard_html

log = logging.getLogger("flodl_async.status")

MAX_REQUEST_HEAD = 8 * 1024
MAX_REQUEST_BODY = 16 * 1024
ENDPOINTS = ("/", "/state.json")


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
        # what each h11 event does; True: the request is answered or refused, the pump stops
        self._on_event: dict[type, typing.Callable[[typing.Any], bool]] = {
            h11.Request: self._on_request,
            h11.Data: self._on_data,
            h11.EndOfMessage: self._on_end,
            h11.ConnectionClosed: self._on_closed,
        }

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
        else:
            self._send(
                404,
                _json({"error": f"no such endpoint: {path}", "endpoints": list(ENDPOINTS)}),
                head=head,
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
