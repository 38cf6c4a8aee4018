"""The ``flodl`` command: operator subcommands (``flodl status``).

Imports nothing heavy: no torch, no asyncio loop — a status query is one
blocking HTTP request.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
from collections.abc import Sequence

from .cluster import DEFAULT_PORT
from .errors import ConfigError

EXIT_OK = 0
EXIT_UNREACHABLE = 1
EXIT_USAGE = 2


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


def fetch_status(host: str, port: int, *, timeout: float = 3.0) -> tuple[int, dict[str, object]]:
    """GET /state.json; returns (HTTP status, document)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/state.json")
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise ConfigError(f"{host}:{port} answered, but not with flodl status JSON (is another service on that port?)") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"{host}:{port} answered with unexpected JSON")
    return response.status, doc


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


def _status(args: argparse.Namespace) -> int:
    try:
        host, port = parse_addr(args.addr)
    except ConfigError as exc:
        print(f"flodl status: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        status, doc = fetch_status(host, port, timeout=args.timeout)
    except (OSError, http.client.HTTPException) as exc:
        print(f"flodl status: no flodl controller answers at {host}:{port} ({exc}); is a run active on that port?", file=sys.stderr)
        return EXIT_UNREACHABLE
    except ConfigError as exc:
        print(f"flodl status: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    elif status == 503:
        print(f"controller at {host}:{port} is starting: {doc.get('error', 'no status yet')}")
    else:
        print(format_status(doc))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flodl``."""
    parser = argparse.ArgumentParser(prog="flodl", description="Operate flodl_async runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser(
        "status",
        help="show a run's status",
        description="Query a controller's status endpoint and print it.",
        epilog="examples:\n  flodl status\n  flodl status --addr 10.0.0.1:1337 --json",
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
