"""``flodl-agent``: join a controller's run as one host and run that host's ranks.

Signals: the first SIGTERM or SIGINT (``systemctl stop``, Ctrl-C) stops this
host's ranks by the signal table — the same signal first, then TERM, then
KILL at one deadline, ``--stop-grace`` after the first — closes the join link
(the controller sees the host leave) and exits 143 or 130. A second signal
kills the ranks at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from ..deadlines import DEFAULT_STOP_GRACE, Deadlines
from ..devices import parse_devices
from ..errors import AgentError, ConfigError, JoinFailed
from ..verdict import ExitCode, exit_code_for_signal, exit_help
from ..wire.keys import secret_from_hex
from .output import RankOutput
from .session import Ending, HostSession, SessionConfig, SessionOutcome

log = logging.getLogger("flodl_async.agent")

#: What flodl-agent's exit codes mean (rendered into --help).
AGENT_EXIT_MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "the run finished (the controller said Finish)",
    ExitCode.INTERNAL: "internal error (a bug: please report it)",
    ExitCode.USAGE: "bad arguments, secret or runtime directory; nothing was started",
    ExitCode.FORMATION: "could not join: controller unreachable, join refused, or the world did not form",
    ExitCode.RANK_FAILURE: "the run failed: the controller aborted it (a rank failed) or the controller was lost",
    ExitCode.INTERRUPTED: "stopped by SIGINT (the ranks got SIGINT first); a second signal kills them at once",
    ExitCode.TERMINATED: "stopped by SIGTERM (the ranks got SIGTERM first); a second signal kills them at once",
}

EXAMPLES = """\
examples:
  flodl-agent --controller 10.0.0.1:1337 --devices cpu:4 --secret-file /run/flodl/secret
  ssh node-b flodl-agent --controller 10.0.0.1:1337 --devices 0,1 < secret
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flodl-agent",
        description="Join a flodl controller's run and run this host's ranks. The session secret "
        "comes on stdin (32 hex characters) or from --secret-file, never on the command line.",
        epilog=EXAMPLES + "\n" + exit_help(AGENT_EXIT_MEANINGS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--controller", required=True, help="controller HOST:PORT")
    parser.add_argument("--devices", default="all", help="`all` GPUs, ids like 0,1, or cpu:N (default %(default)s)")
    parser.add_argument("--host", default=socket.gethostname(), help="this host's name in the run (default: hostname)")
    parser.add_argument("--secret-file", help="file holding the session secret in hex")
    parser.add_argument("--workdir", help="working directory of the ranks")
    parser.add_argument(
        "--stop-grace",
        type=float,
        default=DEFAULT_STOP_GRACE,
        help="seconds from the first stop signal to KILL when this agent is stopped (default %(default)g)",
    )
    return parser


def _read_secret(secret_file: str | None) -> bytes:
    if secret_file:
        try:
            return secret_from_hex(Path(secret_file).read_text())
        except OSError as exc:
            raise ConfigError(f"--secret-file {secret_file}: {exc.strerror or exc}") from exc
    if sys.stdin.isatty():
        raise ConfigError("no session secret: pipe it on stdin (never on the command line) or pass --secret-file")
    return secret_from_hex(sys.stdin.readline())


def build_config(args: argparse.Namespace) -> SessionConfig:
    """The parsed command line as a session config; mistakes raise :class:`ConfigError`."""
    from ..cli import parse_addr

    if args.stop_grace < 0:
        raise ConfigError(f"--stop-grace must be 0 or more seconds (got {args.stop_grace:g})")
    host, port = parse_addr(args.controller)
    try:
        devices = parse_devices(args.devices)
    except ConfigError as exc:
        raise ConfigError(f"--devices: {exc}") from None
    return SessionConfig(
        controller_host=host,
        controller_port=port,
        secret=_read_secret(args.secret_file),
        host=args.host,
        devices=devices,
        workdir=args.workdir,
        deadlines=Deadlines.resolve(stop_grace=args.stop_grace),
    )


async def serve(session: HostSession) -> SessionOutcome:
    """Run ``session`` with SIGTERM/SIGINT wired: the first stops gracefully, the second forces."""
    loop = asyncio.get_running_loop()
    received: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig)
        if len(received) == 1:
            grace = session.config.deadlines.stop_grace
            log.info("%s: stopping this host's ranks (KILL in %gs; a second signal kills them now)", sig.name, grace)
            session.request_stop(sig)
        else:
            log.warning("second signal (%s): killing this host's ranks now", sig.name)
            session.force_stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await session.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def exit_code_for(outcome: SessionOutcome) -> ExitCode:
    """The exit code of a session that ended without an error."""
    if outcome.ending is Ending.FINISHED:
        return ExitCode.OK
    if outcome.ending is Ending.STOPPED and outcome.signal is not None:
        return exit_code_for_signal(outcome.signal)
    return ExitCode.RANK_FAILURE


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flodl-agent``: join a controller and run this host's ranks; returns the exit code."""
    from ..net.fdlimit import raise_descriptor_limit
    from ..net.loop import run

    args = _parser().parse_args(argv)  # --help and argparse's own errors exit here (code 2)
    logging.basicConfig(level=logging.INFO, format="flodl-agent: %(message)s")
    raise_descriptor_limit()
    try:
        config = build_config(args)
    except ConfigError as exc:
        print(f"flodl-agent: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    output = RankOutput(stdout=sys.stdout.buffer, stderr=sys.stderr.buffer)
    try:
        outcome = run(serve(HostSession(config, output=output)))
    except ConfigError as exc:
        print(f"flodl-agent: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    except JoinFailed as exc:
        print(f"flodl-agent: {exc}", file=sys.stderr)
        return int(ExitCode.FORMATION)
    except AgentError as exc:
        print(f"flodl-agent: {exc}", file=sys.stderr)
        return int(ExitCode.RANK_FAILURE)
    except KeyboardInterrupt:  # a Ctrl-C before the handlers were in place
        return int(ExitCode.INTERRUPTED)
    except (Exception, BaseExceptionGroup):  # FlodlError included: one we did not expect here is a bug
        log.exception("internal error")
        return int(ExitCode.INTERNAL)
    finally:
        output.close()
    if outcome.ending is not Ending.FINISHED:
        print(f"flodl-agent: {outcome.ending.value}: {outcome.reason}", file=sys.stderr)
    return int(exit_code_for(outcome))
