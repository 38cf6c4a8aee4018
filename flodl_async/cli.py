"""The ``flodl`` command: operator subcommands (``flodl status``).

Imports nothing heavy: no torch, no asyncio — a status query is one blocking
HTTP request.

What answers on the port is untrusted: the body is read up to a limit, must be
a JSON object carrying the flodl status schema marker, and every string taken
from it (or from an HTTP error about it) is stripped of control characters
before it reaches the terminal, so a hostile server cannot send escape
sequences to the operator's terminal.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import unicodedata
from collections.abc import Sequence

from .cluster import DEFAULT_PORT
from .errors import ConfigError
from .status.model import SCHEMA, SCHEMA_FAMILY
from .verdict import STATUS_EXIT_MEANINGS, StatusExit

#: A status document is kilobytes; a body this large is not one (and is not buffered past it).
MAX_STATUS_BODY = 16 * 1024 * 1024


class NotFlodlStatus(ConfigError):
    """Something answered at the address, but not with a flodl status document."""


def parse_addr(text: str, *, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """``HOST:PORT``, ``HOST``, ``:PORT`` or ``[v6]:PORT`` → (host, port)."""
    text = text.strip()
    host, port_text = text, ""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ConfigError(f"address {text!r}: unclosed '[' in an IPv6 literal")
        host, rest = text[1:end], text[end + 1 :]
        port_text = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    host = host or "127.0.0.1"
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"address {text!r}: port must be a number from 1 to 65535")
    return host, int(port_text)


def strip_controls(text: str) -> str:
    """``text`` without control characters (C0, DEL, C1: terminal escape sequences start with them)."""
    return "".join(ch for ch in text if unicodedata.category(ch) != "Cc")


def clean(value: object) -> object:
    """A JSON value with :func:`strip_controls` applied to every string in it, keys included."""
    if isinstance(value, str):
        return strip_controls(value)
    if isinstance(value, list):
        return [clean(v) for v in value]
    if isinstance(value, dict):
        return {strip_controls(str(k)): clean(v) for k, v in value.items()}
    return value


def fetch_status(host: str, port: int, *, timeout: float = 3.0) -> tuple[int, dict[str, object]]:
    """GET /state.json; returns (HTTP status, document with control characters stripped).

    Raises :class:`NotFlodlStatus` when the answer is not a flodl status
    document (not JSON, not an object, no ``schema`` marker, or too large), and
    ``OSError``/``http.client.HTTPException`` when nothing answers over HTTP.
    """
    where = f"{host}:{port}"
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/state.json")
        response = conn.getresponse()
        body = response.read(MAX_STATUS_BODY + 1)
    finally:
        conn.close()
    if len(body) > MAX_STATUS_BODY:
        raise NotFlodlStatus(f"{where} answered with more than {MAX_STATUS_BODY} bytes, which is not a flodl status (is another service on that port?)")
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise NotFlodlStatus(f"{where} answered, but not with JSON, so not a flodl status (is another service on that port?)") from exc
    if not isinstance(doc, dict):
        raise NotFlodlStatus(f"{where} answered with JSON that is not an object, so not a flodl status (is another service on that port?)")
    schema = doc.get("schema")
    if not isinstance(schema, str) or not schema.startswith(SCHEMA_FAMILY):
        raise NotFlodlStatus(
            f"{where} answered with JSON that lacks the {SCHEMA!r} schema marker, so not a flodl status "
            "(another service on that port, or a controller older than this flodl?)"
        )
    cleaned = clean(doc)
    assert isinstance(cleaned, dict)
    return response.status, cleaned


def format_status(doc: dict[str, object]) -> str:
    """A human table of a status document."""
    lines = [
        f"run      {doc.get('run_id', '?')}",
        f"phase    {doc.get('phase', '?')}",
        f"ranks    {doc.get('joined_ranks', 0)} joined, world size {doc.get('world_size', 0)} "
        f"(quorum {doc.get('min_rank_start', 0)}, target {doc.get('target_ranks', 0)}), restarts {doc.get('restart_count', 0)}",
    ]
    if doc.get("verdict"):
        lines.append(f"verdict  {doc['verdict']}")
    members = doc.get("members") or []
    if isinstance(members, list) and members:
        lines.append("")
        lines.append(f"{'HOST':<24} {'RANKS':<16} {'DEVICES':<24} STATE")
        for member in members:
            if not isinstance(member, dict):
                continue
            ranks = ",".join(str(r) for r in member.get("ranks", []))
            devices = ",".join(str(d) for d in member.get("devices", []))
            lines.append(f"{member.get('host', '?'):<24} {ranks:<16} {devices:<24} {member.get('state', '?')}")
    rank_rows = doc.get("ranks") or []
    if isinstance(rank_rows, list) and rank_rows:
        lines.append("")
        lines.append(f"{'RANK':<6} {'HOST':<24} {'PID':<8} STATE")
        for rank in rank_rows:
            if isinstance(rank, dict):
                lines.append(f"{rank.get('rank', '?')!s:<6} {rank.get('host', '?'):<24} {rank.get('pid') or '-'!s:<8} {rank.get('state', '?')}")
    return "\n".join(lines)


def _say(text: str, *, error: bool = False) -> None:
    # The last line of defence: whatever reaches the terminal has no control characters,
    # even text that quotes a server (an http.client error repeats a bad status line).
    print("\n".join(strip_controls(line) for line in text.split("\n")), file=sys.stderr if error else sys.stdout)


def _status(args: argparse.Namespace) -> StatusExit:
    try:
        host, port = parse_addr(args.addr)
    except ConfigError as exc:
        _say(f"flodl status: {exc}", error=True)
        return StatusExit.USAGE
    try:
        status, doc = fetch_status(host, port, timeout=args.timeout)
    except (OSError, http.client.HTTPException) as exc:
        # The error may quote the server (a bad status line, its newline included): one clean line.
        reason = strip_controls(str(exc)).strip()
        _say(f"flodl status: no flodl controller answers at {host}:{port} ({reason}); is a run active on that port?", error=True)
        return StatusExit.UNREACHABLE
    except NotFlodlStatus as exc:
        _say(f"flodl status: {exc}", error=True)
        return StatusExit.UNREACHABLE
    if args.json:
        _say(json.dumps(doc, indent=2, sort_keys=True))
    elif status == 503:
        _say(f"controller at {host}:{port} is starting: {doc.get('error', 'no status yet')}")
    elif status != 200:
        _say(f"flodl status: the controller at {host}:{port} answered HTTP {status}: {doc.get('error', 'no state')}", error=True)
        return StatusExit.UNREACHABLE
    else:
        _say(format_status(doc))
    return StatusExit.OK


def _exit_epilog() -> str:
    return "exit codes:\n" + "\n".join(f"  {int(code):<4} {text}" for code, text in STATUS_EXIT_MEANINGS.items()) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flodl``."""
    parser = argparse.ArgumentParser(prog="flodl", description="Operate flodl_async runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser(
        "status",
        help="show a run's status",
        description="Query a controller's status endpoint and print it.",
        epilog="examples:\n  flodl status\n  flodl status --addr 10.0.0.1:1337 --json\n\n" + _exit_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    status.add_argument("--addr", default=f"127.0.0.1:{DEFAULT_PORT}", help="controller HOST:PORT (default %(default)s)")
    status.add_argument("--json", action="store_true", help="print the raw JSON document")
    status.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer (default %(default)s)")
    status.set_defaults(handler=_status)
    args = parser.parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
