"""``flodl status``'s client: one blocking HTTP request for a controller's status, checked and
printed as a table.

Imports nothing heavy: no torch, no asyncio.

What answers on the port is untrusted. The whole answer shares one deadline
(a server that drips a byte at a time cannot stretch it); a redirect is
refused, not followed; the body is read up to a limit, must be JSON nested no
deeper than a status document can be, must be an object carrying the flodl
status schema marker, and the fields this client reads must have their
documented types (:data:`DOCUMENT_SHAPE`). Only then is it a flodl status;
anything else raises :class:`~flodl_async.errors.NotFlodlStatus`. Every string
taken from the answer is stripped of what can act on a terminal or mislead its
reader — control characters, format characters such as bidi overrides, lone
surrogates, line separators — before the caller sees it (:func:`strip_controls`).
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import time
import unicodedata
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ..errors import NotFlodlStatus
from ..status.model import SCHEMA, SCHEMA_FAMILY
from ..verdict import device_ranges, rank_ranges

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

#: A status document is kilobytes; a body this large is not one (and is not buffered past it).
MAX_STATUS_BODY = 16 * 1024 * 1024
#: A status document nests four deep (document, members, a member, its ranks); this leaves room to
#: grow.
MAX_STATUS_DEPTH = 32
#: How much of a redirect's target the refusal quotes.
_QUOTE_LIMIT = 200

#: Unicode categories never printed: controls (C0, DEL, C1: terminal escape sequences start with
#: them), format characters (bidi overrides and isolates, zero-width ones), lone surrogates (which
#: cannot even be encoded), and the line and paragraph separators.
UNPRINTED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def strip_controls(text: str) -> str:
    """``text`` without the characters of :data:`UNPRINTED_CATEGORIES`."""
    if text.isprintable():  # the common case, checked in C: nothing of those categories in it
        return text
    return "".join(ch for ch in text if unicodedata.category(ch) not in UNPRINTED_CATEGORIES)


def clean(value: object, *, depth: int = 0) -> object:
    """A JSON value with :func:`strip_controls` applied to every string in it, keys included.

    Raises :class:`NotFlodlStatus` when it nests deeper than :data:`MAX_STATUS_DEPTH`.
    """
    if depth > MAX_STATUS_DEPTH:
        raise NotFlodlStatus(f"JSON nested more than {MAX_STATUS_DEPTH} deep")
    if isinstance(value, str):
        return strip_controls(value)
    if isinstance(value, list):
        return [clean(v, depth=depth + 1) for v in value]
    if isinstance(value, dict):
        return {strip_controls(str(k)): clean(v, depth=depth + 1) for k, v in value.items()}
    return value


# ----- the shape of a status document (the fields this client reads) ---------------------------

#: Checks one value at ``path``; returns what is wrong with it, or None.
_Check = Callable[[object, str], "str | None"]


def _kind(value: object) -> str:
    if isinstance(value, bool):
        return "true/false"
    if value is None:
        return "null"
    kinds: Mapping[type, str] = {
        str: "text",
        int: "a number",
        float: "a number",
        list: "a list",
        dict: "an object",
    }
    return kinds.get(type(value), type(value).__name__)


def _text(value: object, path: str) -> str | None:
    return None if isinstance(value, str) else f"{path}: expected text, got {_kind(value)}"


def _count(value: object, path: str) -> str | None:
    return None if type(value) is int else f"{path}: expected an integer, got {_kind(value)}"


def _optional_count(value: object, path: str) -> str | None:
    return None if value is None else _count(value, path)


def _optional_number(value: object, path: str) -> str | None:
    ok = value is None or (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    )
    return None if ok else f"{path}: expected a number, got {_kind(value)}"


def _optional_text(value: object, path: str) -> str | None:
    return None if value is None else _text(value, path)


def _optional_flag(value: object, path: str) -> str | None:
    return (
        None
        if value is None or isinstance(value, bool)
        else f"{path}: expected true/false, got {_kind(value)}"
    )


def _list_of(item: _Check) -> _Check:
    def check(value: object, path: str) -> str | None:
        if not isinstance(value, list):
            return f"{path}: expected a list, got {_kind(value)}"
        for i, element in enumerate(value):
            problem = item(element, f"{path}[{i}]")
            if problem is not None:
                return problem
        return None

    return check


def _object_with(fields: Mapping[str, _Check]) -> _Check:
    """An object whose listed fields, where present, pass their checks (other fields are a newer
    minor version's)."""

    def check(value: object, path: str) -> str | None:
        if not isinstance(value, dict):
            return f"{path or 'the document'}: expected an object, got {_kind(value)}"
        for key, field_check in fields.items():
            if key in value:
                problem = field_check(value[key], f"{path}.{key}" if path else key)
                if problem is not None:
                    return problem
        return None

    return check


#: The shape of ``/state.json`` as :mod:`flodl_async.status.model` writes it, for the fields printed
#: here.
DOCUMENT_SHAPE = _object_with(
    {
        "run_id": _text,
        "phase": _text,
        "verdict": _text,
        "error": _text,
        **dict.fromkeys(
            ("world_size", "joined_ranks", "min_rank_start", "target_ranks", "restart_count"),
            _count,
        ),
        "members": _list_of(
            _object_with(
                {
                    "host": _text,
                    "ranks": _list_of(_count),
                    "devices": _list_of(_text),
                    "state": _text,
                }
            )
        ),
        "ranks": _list_of(
            _object_with(
                {
                    "rank": _count,
                    "host": _text,
                    "pid": _optional_count,
                    "state": _text,
                    "process": _optional_text,
                    "last_line": _text,
                    "store_connected": _optional_flag,
                    **dict.fromkeys(
                        ("uptime_s", "cpu_percent", "output_age_s", "quiet_s"), _optional_number
                    ),
                }
            )
        ),
        # a Trainer run's coordinator (absent for a plain script)
        "training": _object_with(
            {
                **dict.fromkeys(("epoch", "epochs", "world_size", "alive"), _count),
                "policy": _text,
                "backend": _text,
                "lost": _list_of(_object_with({"rank": _count, "host": _text, "reason": _text})),
            }
        ),
    }
)


# ----- the request -----------------------------------------------------------------------------


class _DeadlineSocket(socket.socket):
    """A connected socket whose every read shares one deadline (``http.client`` reads through
    ``recv_into``)."""

    _deadline: float

    @classmethod
    def wrap(cls, sock: socket.socket, deadline: float) -> _DeadlineSocket:
        wrapped = cls(sock.family, sock.type, sock.proto, fileno=sock.detach())
        wrapped._deadline = deadline
        wrapped.settimeout(max(deadline - time.monotonic(), 0.001))
        return wrapped

    def recv_into(self, buffer: WriteableBuffer, nbytes: int = 0, flags: int = 0) -> int:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out")
        self.settimeout(remaining)
        return super().recv_into(buffer, nbytes, flags)


class _DeadlineConnection(http.client.HTTPConnection):
    """An HTTP connection that must connect, send and receive the whole answer within
    ``timeout``."""

    def __init__(self, host: str, port: int, *, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._deadline = time.monotonic() + timeout

    def connect(self) -> None:
        super().connect()
        self.sock = _DeadlineSocket.wrap(self.sock, self._deadline)


def _read_body(response: http.client.HTTPResponse, where: str) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size <= MAX_STATUS_BODY:
        chunk = response.read(min(65536, MAX_STATUS_BODY + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > MAX_STATUS_BODY:
        raise NotFlodlStatus(
            f"{where} answered with more than {MAX_STATUS_BODY} bytes, which is not a flodl status "
            "(is another service on that port?)"
        )
    if response.length:  # Content-Length promised more than came before the close
        raise NotFlodlStatus(
            f"{where} answered with a body cut short ({size} bytes, {response.length} missing), so "
            "not a flodl status"
        )
    return b"".join(chunks)


def fetch_status(host: str, port: int, *, timeout: float = 3.0) -> tuple[int, dict[str, object]]:
    """GET /state.json; returns (HTTP status, document with unprintable characters stripped).

    Raises :class:`NotFlodlStatus` when the answer is not a flodl status document (a
    redirect, too large, cut short, not JSON, nested too deeply, not an object, no
    ``schema`` marker, or fields of the wrong type), ``TimeoutError`` when the whole
    answer did not come within ``timeout``, and ``OSError``/``http.client.HTTPException``
    when nothing answers over HTTP.
    """
    where = f"{host}:{port}"
    conn = _DeadlineConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/state.json")
        response = conn.getresponse()
        if 300 <= response.status < 400:
            target = strip_controls(response.getheader("Location") or "")[:_QUOTE_LIMIT]
            to = f", a redirect to {target}" if target else ", a redirect"
            raise NotFlodlStatus(
                f"{where} answered HTTP {response.status}{to}; a flodl controller never redirects, "
                "so this is not one (not followed)"
            )
        body = _read_body(response, where)
    finally:
        conn.close()
    try:
        doc = json.loads(body)
    except RecursionError:
        raise NotFlodlStatus(
            f"{where} answered with JSON nested too deeply to be a flodl status (is another "
            "service on that port?)"
        ) from None
    except ValueError as exc:
        raise NotFlodlStatus(
            f"{where} answered, but not with JSON, so not a flodl status (is another service on "
            "that port?)"
        ) from exc
    if not isinstance(doc, dict):
        raise NotFlodlStatus(
            f"{where} answered with JSON that is not an object, so not a flodl status (is another "
            "service on that port?)"
        )
    schema = doc.get("schema")
    if not isinstance(schema, str) or not schema.startswith(SCHEMA_FAMILY):
        raise NotFlodlStatus(
            f"{where} answered with JSON that lacks the {SCHEMA!r} schema marker, so not a flodl "
            "status "
            "(another service on that port, or a controller older than this flodl?)"
        )
    try:
        cleaned = clean(doc)
    except NotFlodlStatus:
        raise NotFlodlStatus(
            f"{where} answered with JSON nested too deeply to be a flodl status (is another "
            "service on that port?)"
        ) from None
    problem = DOCUMENT_SHAPE(cleaned, "")
    if problem is not None:
        raise NotFlodlStatus(
            f"{where} answered with the {SCHEMA!r} marker but is not a flodl status: {problem}"
        )
    assert isinstance(cleaned, dict)
    return response.status, cleaned


# ----- the table ---------------------------------------------------------------------------------

#: ``flodl status`` flags a running rank with neither output nor CPU progress for this long
#: (``--silent-after``).
SILENT_AFTER = 60.0


def format_status(doc: dict[str, object], *, silent_after: float = SILENT_AFTER) -> str:
    """A human table of a status document."""
    lines = [
        f"run      {doc.get('run_id', '?')}",
        f"phase    {doc.get('phase', '?')}",
        f"ranks    {doc.get('joined_ranks', 0)} joined, world size {doc.get('world_size', 0)} "
        f"(quorum {doc.get('min_rank_start', 0)}, target {doc.get('target_ranks', 0)}), restarts "
        f"{doc.get('restart_count', 0)}",
    ]
    training = doc.get("training")
    if isinstance(training, dict):
        lines.append(f"training {training_line(training)}")
    if doc.get("verdict"):
        lines.append(f"verdict  {doc['verdict']}")
    members = doc.get("members") or []
    if isinstance(members, list) and members:
        lines.append("")
        lines.append(f"{'HOST':<24} {'RANKS':<16} {'DEVICES':<24} STATE")
        for member in members:
            if not isinstance(member, dict):
                continue
            ranks, devices = _folded(member.get("ranks")), _folded(member.get("devices"))
            lines.append(
                f"{member.get('host', '?'):<24} {ranks:<16} {devices:<24} "
                f"{member.get('state', '?')}"
            )
    rank_rows = doc.get("ranks") or []
    if isinstance(rank_rows, list) and rank_rows:
        lines.append("")
        lines.append(
            f"{'RANK':<6} {'HOST':<20} {'PID':<8} {'STATE':<10} {'PROCESS':<16} {'CPU':>6} "
            f"{'UP':>7} {'STORE':<6} {'OUTPUT':>7}  LAST LINE"
        )
        flagged: list[str] = []
        # a CPU-backend Trainer's ranks rendezvous through the coordinator: no store to reach
        no_store = isinstance(training, dict) and training.get("backend") == "cpu"
        for rank in rank_rows:
            if not isinstance(rank, dict):
                continue
            lines.append(_rank_row(rank, no_store=no_store))
            quiet = rank.get("quiet_s")
            if (
                isinstance(quiet, int | float)
                and quiet >= silent_after
                and rank.get("state") in ("running", "connected")
            ):
                flagged.append(
                    f"rank {rank.get('rank', '?')} on {rank.get('host', '?')}: silent and idle for "
                    f"{format_age(quiet)} ({rank.get('process') or '?'})"
                )
        for flag in flagged:
            lines.append(f"SILENT   {flag} — hung? (a stack: py-spy dump --pid PID)")
    return "\n".join(lines)


def training_line(training: Mapping[str, object]) -> str:
    """A Trainer run's world in one line: ``2/4 epochs done, CADENCE on cpu, 2 of 3 ranks alive —
    lost: rank 2 on host b: killed by SIGKILL at epoch 1`` (the status page says the same)."""
    # the count of epochs closed (as the launcher's ``epoch 2/4`` line counts): said as such, since
    # ``epoch 0/4`` would misread as the epoch being trained
    text = (
        f"{training.get('epoch', '?')}/{training.get('epochs', '?')} epochs done, "
        f"{str(training.get('policy') or '?').upper()} on {training.get('backend') or '?'}"
    )
    if "alive" in training:  # a controller older than the elastic Trainer does not say
        text += f", {training['alive']} of {training.get('world_size', '?')} ranks alive"
    lost = training.get("lost")
    if isinstance(lost, list) and lost:
        text += " — lost: " + "; ".join(_lost_rank(r) for r in lost if isinstance(r, dict))
    return text


def _lost_rank(lost: Mapping[str, object]) -> str:
    host = lost.get("host")
    where = f" on host {host}" if host else ""
    return f"rank {lost.get('rank', '?')}{where}: {lost.get('reason') or '?'}"


def _folded(items: object) -> str:
    """A host's ranks (``0-99``) or devices (``cpu:0-99``) as short as they can be said; anything
    else as it came."""
    if not isinstance(items, list):
        return ""
    if items and all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        return rank_ranges(items)
    if items and all(isinstance(i, str) for i in items):
        return device_ranges(items)
    return ",".join(str(i) for i in items)


def _rank_row(rank: Mapping[str, object], *, no_store: bool = False) -> str:
    """One rank of the table; activity columns show ``-`` until its agent's first report, the store
    ``n/a`` where the ranks use none (``no_store``)."""

    def number(key: str, fmt: str) -> str:
        value = rank.get(key)
        return (
            format(value, fmt)
            if isinstance(value, int | float) and not isinstance(value, bool)
            else "-"
        )

    age = rank.get("output_age_s")
    output = format_age(age) if isinstance(age, int | float) and not isinstance(age, bool) else "-"
    up = rank.get("uptime_s")
    uptime = format_age(up) if isinstance(up, int | float) and not isinstance(up, bool) else "-"
    connected = rank.get("store_connected")
    store = (
        "n/a"
        if no_store
        else "-"
        if not isinstance(connected, bool)
        else "yes"
        if connected
        else "no"
    )
    cpu = number("cpu_percent", ".0f") + (
        "%" if isinstance(rank.get("cpu_percent"), int | float) else ""
    )
    last = str(rank.get("last_line") or "")
    return (
        f"{rank.get('rank', '?')!s:<6} {rank.get('host', '?')!s:<20} {rank.get('pid') or '-'!s:<8} "
        f"{rank.get('state', '?')!s:<10} "
        f"{rank.get('process') or '-'!s:<16} {cpu:>6} {uptime:>7} {store:<6} {output:>7}  {last}"
    ).rstrip()


def format_age(seconds: float) -> str:
    """``45s``, ``12m``, ``3h05m``, ``2d04h``."""
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
