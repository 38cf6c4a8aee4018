"""The ``flodl`` command: the operator's ``flodl ps``, ``flodl status``, ``flodl top`` and
``flodl token new``.

Imports nothing heavy: no torch, no asyncio, no rich (``flodl top`` imports it when it draws) — a
status query is one blocking HTTP request (:mod:`flodl_async.cli.statusclient`, which checks what
answered and strips what could act on a terminal). What is printed here goes through one more
:func:`~flodl_async.cli.statusclient.strip_controls`: even an HTTP error about
the answer may quote the server.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import io
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .._version import __version__
from ..config.addr import DEFAULT_PORT, parse_addr
from ..config.argtypos import HintingParser, hyphenate
from ..errors import ConfigError, NotFlodlStatus
from ..host.runs import LocalRun, local_runs
from ..host.secretfile import create_token_file
from ..verdict import STATUS_EXIT_MEANINGS, StatusExit
from .eventclient import read_events
from .eventreplay import replay
from .statusclient import SILENT_AFTER, fetch_status, format_age, format_status, strip_controls
from .top import plain_wanted, watch


def _say(text: str, *, error: bool = False) -> None:
    # The last line of defence: whatever reaches the terminal has nothing unprintable,
    # even text that quotes a server (an http.client error repeats a bad status line).
    print(
        "\n".join(strip_controls(line) for line in text.split("\n")),
        file=sys.stderr if error else sys.stdout,
    )


def _runs_table(runs: Sequence[LocalRun], *, timeout: float) -> str:
    """One row per local run: its registration, plus ranks and phase from its own /state.json."""
    now = time.time()
    rows = [f"{'RUN ID':<24} {'ADDRESS':<22} {'PID':<8} {'AGE':<7} {'RANKS':<8} PHASE"]
    for run in runs:
        ranks, phase = "?", "not answering"
        with contextlib.suppress(OSError, http.client.HTTPException, NotFlodlStatus, TimeoutError):
            _code, doc = fetch_status(run.address, run.port, timeout=timeout)
            ranks = str(doc.get("world_size") or doc.get("joined_ranks") or 0)
            phase = str(doc.get("phase", "?"))
        address = f"{run.address}:{run.port}"
        rows.append(
            f"{strip_controls(run.run_id):<24} {address:<22} {run.owner.pid:<8} "
            f"{format_age(now - run.started_at):<7} {ranks:<8} {phase}"
        )
    return "\n".join(rows)


def _ps(args: argparse.Namespace) -> StatusExit:
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        _say(
            f"flodl ps: --timeout must be a positive number of seconds (got {args.timeout:g})",
            error=True,
        )
        return StatusExit.USAGE
    runs = local_runs()
    if not runs:
        _say("no flodl run on this machine (of yours)")
        return StatusExit.OK
    _say(_runs_table(runs, timeout=args.timeout))
    return StatusExit.OK


def _resolve_addr(args: argparse.Namespace, prog: str) -> tuple[str, int] | StatusExit:
    """``--addr``, or the one run on this machine; a usage error is said and returned."""
    if args.addr is None:  # the local run, when there is exactly one
        runs = local_runs()
        if len(runs) > 1:
            _say(_runs_table(runs, timeout=args.timeout))
            _say(
                f"{prog}: {len(runs)} runs on this machine; pick one with --addr HOST:PORT",
                error=True,
            )
            return StatusExit.USAGE
        args.addr = f"{runs[0].address}:{runs[0].port}" if runs else f"127.0.0.1:{DEFAULT_PORT}"
    try:
        host, port = parse_addr(args.addr)
    except ConfigError as exc:
        _say(f"{prog}: {exc}", error=True)
        return StatusExit.USAGE
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        _say(
            f"{prog}: --timeout must be a positive number of seconds (got {args.timeout:g})",
            error=True,
        )
        return StatusExit.USAGE
    return host, port


def _unreachable(prog: str, host: str, port: int, exc: Exception, timeout: float) -> StatusExit:
    """Say why nothing (or not a flodl controller) answered at ``host:port``."""
    if isinstance(exc, TimeoutError):
        _say(
            f"{prog}: {host}:{port} did not answer within {timeout:g}s; is a run active "
            "on that port? (--timeout for a slow link)",
            error=True,
        )
    elif isinstance(exc, NotFlodlStatus):
        _say(f"{prog}: {exc}", error=True)
    else:
        # The error may quote the server (a bad status line, its newline included): one clean line.
        reason = strip_controls(str(exc)).strip()
        _say(
            f"{prog}: no flodl controller answers at {host}:{port} ({reason}); is a run "
            "active on that port?",
            error=True,
        )
    return StatusExit.UNREACHABLE


def _watch(host: str, port: int, args: argparse.Namespace) -> StatusExit:
    """The live view (``flodl top``, ``flodl status --watch``) until the verdict or Ctrl-C."""
    prog = "flodl top" if args.command == "top" else "flodl status"
    try:
        view = watch(
            lambda after: read_events(host, port, timeout=args.timeout, after=after),
            plain=plain_wanted(),
            say=_say,
        )
    except KeyboardInterrupt:
        return StatusExit.OK
    except (OSError, http.client.HTTPException, NotFlodlStatus) as exc:
        return _unreachable(prog, host, port, exc, args.timeout)
    if view.verdict is None:
        _say(
            f"{prog}: the controller at {host}:{port} closed the stream before the run's verdict, "
            "and again when asked to resume it (flodl status --from-log DIR tells a finished run "
            "from its event log)",
            error=True,
        )
        return StatusExit.UNREACHABLE
    _say(f"verdict  {view.verdict}")
    return StatusExit.OK


def _status(args: argparse.Namespace) -> StatusExit:
    if args.from_log is not None:
        if args.watch:
            _say("flodl status: --from-log replays a finished run; drop --watch", error=True)
            return StatusExit.USAGE
        if args.addr is not None:
            _say("flodl status: --from-log reads a finished run's log; drop --addr", error=True)
            return StatusExit.USAGE
        try:
            _say(replay(args.from_log))
        except ConfigError as exc:
            _say(f"flodl status: {exc}", error=True)
            return StatusExit.UNREACHABLE
        return StatusExit.OK
    where = _resolve_addr(args, "flodl status")
    if isinstance(where, StatusExit):
        return where
    host, port = where
    if args.watch:
        if args.json or args.silent_after != SILENT_AFTER:
            option = "--json" if args.json else "--silent-after"
            _say(f"flodl status: --watch shows the live view; drop {option}", error=True)
            return StatusExit.USAGE
        return _watch(host, port, args)
    try:
        status, doc = fetch_status(host, port, timeout=args.timeout)
    except (OSError, http.client.HTTPException, NotFlodlStatus) as exc:
        return _unreachable("flodl status", host, port, exc, args.timeout)
    if args.json:
        _say(json.dumps(doc, indent=2, sort_keys=True))
    elif status == 503:
        _say(f"controller at {host}:{port} is starting: {doc.get('error', 'no status yet')}")
    elif status != 200:
        _say(
            f"flodl status: the controller at {host}:{port} answered HTTP {status}: "
            f"{doc.get('error', 'no state')}",
            error=True,
        )
        return StatusExit.UNREACHABLE
    else:
        _say(format_status(doc, silent_after=args.silent_after))
    return StatusExit.OK


def _top(args: argparse.Namespace) -> StatusExit:
    where = _resolve_addr(args, "flodl top")
    if isinstance(where, StatusExit):
        return where
    return _watch(*where, args)


def _token_new(args: argparse.Namespace) -> int:
    try:
        create_token_file(args.path)
    except ConfigError as exc:
        _say(f"flodl token new: {exc}", error=True)
        return 2
    _say(
        f"wrote a new cluster token to {args.path} (mode 0600); give it to the controller "
        "(--token-file) and to each dial-in agent"
    )
    return 0


def _exit_epilog() -> str:
    return (
        "exit codes:\n"
        + "\n".join(f"  {int(code):<4} {text}" for code, text in STATUS_EXIT_MEANINGS.items())
        + "\n"
    )


def _target_arguments(command: argparse.ArgumentParser, *, timeout_help: str) -> None:
    """``--addr`` and ``--timeout``: which run a command asks, and how long it waits."""
    command.add_argument(
        "--addr",
        help="controller HOST:PORT (default: the one run on this machine, as `flodl ps` lists it; "
        f"else 127.0.0.1:{DEFAULT_PORT})",
    )
    command.add_argument(
        "--timeout", type=float, default=3.0, help=f"{timeout_help} (default %(default)s)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flodl``."""
    parser = HintingParser(
        prog="flodl",
        description="Operate flodl_async runs.",
        epilog="examples:\n  flodl ps\n  flodl status\n  flodl status --addr 10.0.0.1:1337\n  "
        "flodl top\n  flodl token new /etc/flodl/token\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"flodl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    ps = sub.add_parser(
        "ps",
        help="list the runs on this machine",
        description="List your flodl runs on this machine (every controller registers in the "
        "runtime directory): "
        "run id, status address, pid, age, ranks and phase.",
        epilog="examples:\n  flodl ps\n  flodl ps --timeout 5             # runs on a busy machine "
        "answer slowly\n\n"
        "exit codes:\n  0    listed (none is no error)\n  2    bad arguments\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ps.add_argument(
        "--timeout",
        type=float,
        default=1.0,
        help="seconds to wait for each run's status (default %(default)s)",
    )
    ps.set_defaults(handler=_ps)
    status = sub.add_parser(
        "status",
        help="show a run's status",
        description="Query a controller's status endpoint and print it.",
        epilog="examples:\n  flodl status                      # the run on this machine (flodl ps "
        "lists them)\n"
        "  flodl status --addr 10.0.0.1:1337 --json\n"
        "  flodl status --from-log logs/flodl-3f9a1c2e   # a finished run, from its event log\n\n"
        + _exit_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _target_arguments(status, timeout_help="seconds to wait for an answer")
    status.add_argument("--json", action="store_true", help="print the raw JSON document")
    status.add_argument(
        "--watch",
        action="store_true",
        help="watch the run live until its verdict, as flodl top does",
    )
    status.add_argument(
        "--from-log",
        type=Path,
        metavar="DIR",
        help="replay a finished run from its event log (flodl-launch --log-dir DIR writes "
        "DIR/<run id>/events.jsonl): DIR or DIR/<run id>; exit 1 when there is no log to read",
    )
    status.add_argument(
        "--silent-after",
        type=float,
        default=SILENT_AFTER,
        metavar="S",
        help="flag a rank with neither output nor CPU progress for S seconds (default %(default)g)",
    )
    status.set_defaults(handler=_status)
    top = sub.add_parser(
        "top",
        help="watch a run live",
        description="Watch a run live from its /events stream: hosts x ranks, the training line, "
        "the last events; redrawn in place on a terminal, plain appended lines when stdout is not "
        "one or under journald (JOURNAL_STREAM). Ends with the run's verdict, or on Ctrl-C.",
        epilog="examples:\n  flodl top                         # the run on this machine\n"
        "  flodl top --addr 10.0.0.1:1337\n  flodl top | tee watch.log          # plain lines\n\n"
        + _exit_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _target_arguments(top, timeout_help="seconds to wait for the stream to start")
    top.set_defaults(handler=_top)
    token = sub.add_parser(
        "token",
        help="manage the cluster token of dial-in agents",
        description="The cluster token admits dial-in agents (flodl-agent --token-file) to a "
        "controller started with --token-file or controller.token_file.",
        epilog="examples:\n  flodl token new /etc/flodl/token\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    token_sub = token.add_subparsers(dest="token_command", required=True)
    token_new = token_sub.add_parser(
        "new",
        help="write a fresh cluster token to a new file",
        description="Write a fresh 256-bit cluster token (hex) to PATH, created with mode 0600; an "
        "existing PATH is never "
        "overwritten. Nothing secret is printed: copy the file to each host (e.g. scp, then keep "
        "it 0600).",
        epilog="examples:\n  flodl token new /etc/flodl/token\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    token_new.add_argument("path", help="where to write the token (must not exist)")
    token_new.set_defaults(handler=_token_new)
    for command in (ps, status, top, token, token_new):  # `flodl status --version` answers too
        command.add_argument("--version", action="version", version=f"flodl {__version__}")
    args = parser.parse_args(hyphenate(parser, sys.argv[1:] if argv is None else argv))
    for stream in (sys.stdout, sys.stderr):
        # text the terminal's encoding lacks is escaped, never a traceback
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
