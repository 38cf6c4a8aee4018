"""``flodl-agent``: join a controller's run as one host and run that host's ranks.

Signals: the first SIGTERM or SIGINT (``systemctl stop``, Ctrl-C) stops this
host's ranks by the signal table — the same signal first, then TERM, then
KILL at one deadline, ``--stop-grace`` after the first — closes the join link
(the controller sees the host leave) and exits 143 or 130. A second signal
kills the ranks at once.

Failures are one line naming this host, the controller's address and the cause,
with the exit code of :data:`AGENT_EXIT_MEANINGS`; a traceback means a bug. One run waits
within ``--connect-timeout`` for a controller that is not listening yet or that closed the
connection before answering (an eviction), and exits 3 at once when the controller's proof did
not verify: a user at a terminal wants to hear of a wrong token now, not in a minute.

``--persist`` (with ``--token-file``) runs :class:`~flodl_async.agent.daemon.PersistentAgent`
instead of one session: run after run, until a signal. It never exits 3 or 4: every failure
to join, a failed proof included, is dialed again with backoff; only a usage problem ends it
(exit 2).

Under systemd (deploy/flodl-agent.service) it notifies READY/STATUS/STOPPING and
pings the watchdog from its loop (:mod:`flodl_async.agent.systemd`); the unit hands
it the cluster token as a credential, ``--token-file $CREDENTIALS_DIRECTORY/NAME``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Sequence

from .._version import __version__
from ..config.addr import parse_addr
from ..config.argtypos import HintingParser, hyphenate
from ..config.devices import parse_devices
from ..control.backoff import BackoffPolicy
from ..deadlines import DEFAULT_STOP_GRACE, Deadlines
from ..errors import ConfigError
from ..host.ifnames import stand_alone_default_ifname
from ..host.sdnotify import Notifier
from ..host.secretfile import read_secret_file, read_token_file
from ..net.fdlimit import raise_descriptor_limit
from ..net.loop import run
from ..net.signals import StopSignals
from ..verdict import AGENT_EXIT_MEANINGS, ExitCode, exit_code_for_signal, exit_help
from ..wire.keys import secret_from_hex
from .endings import Ending, SessionOutcome
from .failures import exit_code_for_error, failure_line, session_failure
from .join import SessionConfig
from .session import HostSession
from .specline import read_spec, serve_spec_stdin
from .systemd import notification_observer, with_watchdog

log = logging.getLogger("flodl_async.agent")

EXAMPLES = """\
examples:
  flodl-agent --controller 10.0.0.1:1337 --devices all --secret-file ~/.flodl/secret
  flodl-agent --controller 10.0.0.1:1337 --devices all --connect-timeout 120 < secret
  flodl-agent --controller 10.0.0.1:1337 --devices cpu:4 --secret-file /run/flodl/secret
  flodl-agent --controller 10.0.0.1:1337 --devices 0,1 --token-file /etc/flodl/token --persist
  ssh node-b flodl-agent --controller 10.0.0.1:1337 --devices 0,1 < secret
"""


def _parser() -> argparse.ArgumentParser:
    parser = HintingParser(
        prog="flodl-agent",
        description="Join a flodl controller's run and run this host's ranks. The session secret "
        "comes on stdin (32 hex characters) or from --secret-file, or the agent holds the cluster "
        "token "
        "(--token-file) and the controller sends it the secret sealed; never on the command line.",
        epilog=EXAMPLES + "\n" + exit_help(AGENT_EXIT_MEANINGS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"flodl-agent {__version__}")
    parser.add_argument("--controller", help="controller HOST:PORT (required unless --spec-stdin)")
    parser.add_argument(
        "--spec-stdin",
        action="store_true",
        help="started by flodl-launch over ssh: read the whole spec as one JSON line on stdin; EOF "
        "on stdin stops the agent",
    )
    parser.add_argument(
        "--devices", default="all", help="`all` GPUs, ids like 0,1, or cpu:N (default %(default)s)"
    )
    parser.add_argument(
        "--host",
        default=socket.gethostname(),
        help="this host's name in the run (default: hostname)",
    )
    parser.add_argument(
        "--secret-file", help="file holding the session secret in hex (yours, mode 0600): one run"
    )
    parser.add_argument(
        "--token-file",
        help="file holding the cluster token (`flodl token new`; yours, mode 0600): join as a "
        "dial-in agent, given each run's secret sealed",
    )
    parser.add_argument("--workdir", help="working directory of the ranks")
    parser.add_argument(
        "--open-admission",
        action="store_true",
        help="hold no credential: join a controller that runs join.open_admission (trusted "
        "networks only)",
    )
    parser.add_argument(
        "--persist",
        action="store_true",
        help="with --token-file: stay up across runs, dialing again (capped exponential backoff "
        "with jitter) after each run, while no controller answers, and (warning each time) while "
        "what answers fails its proof; only a usage error (exit 2) or SIGTERM (exit 143) ends it",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=60.0,
        help="started before the controller: keep dialing (the capped backoff of --persist) this "
        "many seconds while nothing listens at --controller or it closes the connection before "
        "answering (evicted by its admission cap); 0 tries once (default %(default)g)",
    )
    parser.add_argument(
        "--reconnect-max",
        type=float,
        default=30.0,
        help="with --persist: the longest wait between two dials, in seconds (default %(default)g)",
    )
    parser.add_argument(
        "--stop-grace",
        type=float,
        default=DEFAULT_STOP_GRACE,
        help="seconds from the first stop signal to KILL when this agent is stopped (default "
        "%(default)g)",
    )
    return parser


def _read_secret(secret_file: str | None) -> bytes:
    if secret_file:
        return read_secret_file(secret_file)  # refused unless private, as ssh refuses a loose key
    if sys.stdin.isatty():
        raise ConfigError(
            "no session secret: pipe it on stdin (never on the command line) or pass --secret-file"
        )
    return secret_from_hex(sys.stdin.readline())


def build_config(args: argparse.Namespace) -> SessionConfig:
    """The parsed command line as a session config; mistakes raise :class:`ConfigError`."""
    if args.controller is None:
        raise ConfigError(
            "--controller HOST:PORT is required (or --spec-stdin, when flodl-launch starts this "
            "agent)"
        )
    if args.stop_grace < 0:
        raise ConfigError(f"--stop-grace must be 0 or more seconds (got {args.stop_grace:g})")
    host, port = parse_addr(args.controller)
    try:
        devices = parse_devices(args.devices)
    except ConfigError as exc:
        raise ConfigError(f"--devices: {exc}") from None
    if args.open_admission and (args.token_file or args.secret_file):
        raise ConfigError(
            "--open-admission means no credential: drop --token-file / --secret-file, or drop "
            "--open-admission"
        )
    if args.persist and not (args.token_file or args.open_admission):
        raise ConfigError(
            "--persist needs --token-file: a session secret is good for one run only, the cluster "
            "token for every run"
        )
    if not args.reconnect_max > 0:
        raise ConfigError(
            f"--reconnect-max must be more than 0 seconds (got {args.reconnect_max:g})"
        )
    if not args.connect_timeout >= 0:
        raise ConfigError(
            f"--connect-timeout must be 0 or more seconds (got {args.connect_timeout:g})"
        )
    if args.token_file and args.secret_file:
        raise ConfigError(
            "--token-file and --secret-file exclude each other: a dial-in agent learns the secret "
            "from the controller"
        )
    token = read_token_file(args.token_file) if args.token_file else None
    return SessionConfig(
        controller_host=host,
        controller_port=port,
        secret=b"" if token is not None or args.open_admission else _read_secret(args.secret_file),
        token=token,
        open_admission=args.open_admission,
        host=args.host,
        devices=devices,
        workdir=args.workdir,
        deadlines=Deadlines.resolve(stop_grace=args.stop_grace),
        # --persist paces its own dials between runs; one run waits for its controller here.
        connect_timeout=0.0 if args.persist else args.connect_timeout,
        connect_backoff=BackoffPolicy(initial=min(0.5, args.reconnect_max), cap=args.reconnect_max),
        default_ifname=stand_alone_default_ifname(host),
    )


async def serve(session: HostSession) -> SessionOutcome:
    """Run ``session`` with SIGTERM/SIGINT wired: the first stops gracefully, the second forces."""

    def graceful(sig: signal.Signals) -> None:
        grace = session.config.deadlines.stop_grace
        log.info(
            "%s: stopping this host's ranks (KILL in %gs; a second signal kills them now)",
            sig.name,
            grace,
        )
        session.request_stop(sig)

    def forced(sig: signal.Signals) -> None:
        log.warning("second signal (%s): killing this host's ranks now", sig.name)
        session.force_stop()

    with StopSignals(graceful, forced):
        return await session.run()


def exit_code_for(outcome: SessionOutcome) -> ExitCode:
    """The exit code of a session that ended without an error."""
    if outcome.ending is Ending.FINISHED:
        return ExitCode.OK
    if outcome.ending is Ending.STOPPED and outcome.signal is not None:
        return exit_code_for_signal(outcome.signal)
    return ExitCode.RANK_FAILURE


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flodl-agent``: join a controller and run this host's ranks; returns the exit
    code."""
    parser = _parser()
    # --help and argparse's own errors exit here (code 2)
    args = parser.parse_args(hyphenate(parser, sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="flodl-agent: %(message)s")
    raise_descriptor_limit()
    try:
        config = read_spec() if args.spec_stdin else build_config(args)
    except ConfigError as exc:
        _say(f"flodl-agent: {exc}")
        return int(ExitCode.USAGE)
    if args.persist:
        return _persist(config, reconnect_max=args.reconnect_max)
    # a no-op outside systemd; the ranks do not inherit $NOTIFY_SOCKET
    notifier = Notifier.from_environ()
    # The ranks' output goes up the join link to the launcher, not to this process's stdout.
    session = HostSession(config, observer=notification_observer(notifier))
    try:
        work = serve_spec_stdin(session, serve) if args.spec_stdin else serve(session)
        outcome = run(with_watchdog(work, notifier))
    except KeyboardInterrupt:  # a Ctrl-C before the handlers were in place
        return int(ExitCode.INTERRUPTED)
    except (Exception, BaseExceptionGroup) as exc:
        failure = session_failure(exc, config)
        if failure is None:  # not an error of the run, the controller or the user: a bug
            log.exception("internal error")
            return int(ExitCode.INTERNAL)
        _say(failure_line(failure, config.controller_addr))
        return int(exit_code_for_error(failure))
    finally:
        notifier.close()
    # An Abort's reason is the controller's own verdict: an agent it started (over ssh, its stderr
    # relayed to the controller's console) would only repeat it there, once per host.
    if outcome.ending is not Ending.FINISHED and not (
        args.spec_stdin and outcome.ending is Ending.ABORTED
    ):
        _say(f"flodl-agent: agent {config.host}: {outcome.ending.value}: {outcome.reason}")
    return int(exit_code_for(outcome))


def _persist(config: SessionConfig, *, reconnect_max: float) -> int:
    from .daemon import (  # deferred: off the ssh agent's start path
        PersistentAgent,
        serve_persistently,
    )

    policy = BackoffPolicy(initial=min(0.5, reconnect_max), cap=reconnect_max)
    notifier = Notifier.from_environ()  # as for one run: a no-op outside systemd
    # Each run's rank output goes up that run's join link, as for one run.
    agent = PersistentAgent(
        config,
        policy=policy,
        observer=notification_observer(notifier),
        ready=notifier.ready,
        status=notifier.status,
    )
    try:
        return int(run(with_watchdog(serve_persistently(agent), notifier)))
    except KeyboardInterrupt:
        return int(ExitCode.INTERRUPTED)
    except (Exception, BaseExceptionGroup):
        log.exception("internal error")
        return int(ExitCode.INTERNAL)
    finally:
        notifier.close()


def _say(line: str) -> None:
    """To stderr; a stderr that is gone too (its reader died with the controller) has no one to
    tell."""
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)
