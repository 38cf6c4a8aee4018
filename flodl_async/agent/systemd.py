"""``flodl-agent`` as a systemd service: session events as notifications, the watchdog, credentials.

Under ``Type=notify`` (deploy/flodl-agent.service) the agent says ``READY=1``
once its join link to the controller is up, keeps ``STATUS=`` current
("waiting for a controller at …", "run X: ranks 4–7 running"), says
``STOPPING=1`` when its ranks begin to stop, and pings ``WATCHDOG=1`` from the
event loop (a task of the agent's own TaskGroup). Outside systemd all of it is
a no-op (:class:`flodl_async.sdnotify.Notifier`).

The session secret may come as a systemd credential (``LoadCredential=``):
``--token-credential NAME`` reads ``$CREDENTIALS_DIRECTORY/NAME`` with the same
checks as ``--secret-file`` (systemd makes the file 0400 and the service's own).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from ..errors import ConfigError
from ..sdnotify import Notifier
from .lifecycle import Phase, SessionEvent, SessionObserver

T = TypeVar("T")

CREDENTIALS_VARIABLE = "CREDENTIALS_DIRECTORY"


def rank_span(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 4–7`` for a contiguous block, else ``ranks 0, 2, 5``."""
    ordered = sorted(ranks)
    if not ordered:
        return "no ranks"
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    if ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"ranks {ordered[0]}–{ordered[-1]}"
    return "ranks " + ", ".join(map(str, ordered))


def status_line(event: SessionEvent) -> str:
    """The ``STATUS=`` text of a session event (what ``systemctl status`` shows)."""
    run = f"run {event.run_id}"
    match event.phase:
        case Phase.DIALING:
            return f"waiting for a controller at {event.controller}"
        case Phase.CONNECTED:
            return f"connected to the controller at {event.controller}, joining as {event.host}"
        case Phase.ADMITTED:
            return f"{run}: admitted with {rank_span(event.ranks)}, waiting for the world to form"
        case Phase.RUNNING:
            return f"{run}: {rank_span(event.ranks)} running (round {event.round})"
        case Phase.STOPPING if event.run_id is None:
            return f"stopping: {event.reason}"
        case Phase.STOPPING:
            return f"{run}: stopping {rank_span(event.ranks)} ({event.reason})"


def notification_observer(notifier: Notifier) -> SessionObserver:
    """The session observer that keeps systemd told: READY=1 once connected, STATUS= at every step, STOPPING=1."""

    def observe(event: SessionEvent) -> None:
        status = status_line(event)
        if event.phase is Phase.CONNECTED:
            notifier.ready(status)
        elif event.phase is Phase.STOPPING:
            notifier.stopping(status)
        else:
            notifier.status(status)

    return observe


async def with_watchdog(work: Coroutine[object, object, T], notifier: Notifier) -> T:
    """Await ``work`` with the watchdog ticker beside it in one TaskGroup; ``work``'s own error comes out unwrapped.

    The error is caught inside the group and re-raised after it so that callers see what
    the session raised, not an ExceptionGroup around it (the ticker itself never fails).
    """
    error: Exception | None = None
    results: list[T] = []  # a list, since T itself may be None
    async with asyncio.TaskGroup() as tg:
        ticker = tg.create_task(notifier.watchdog(), name="sd-watchdog")
        try:
            results.append(await work)
        except Exception as exc:  # re-raised below, outside the group, as it was
            error = exc
        finally:
            ticker.cancel()
    if error is not None:
        raise error
    return results[0]


# ----- credentials ---------------------------------------------------------------------------


def credential_path(name: str, env: Mapping[str, str] | None = None) -> Path:
    """``$CREDENTIALS_DIRECTORY/name``; a missing directory or a name that is not a plain file name raises :class:`ConfigError`."""
    env = os.environ if env is None else env
    if not name or "/" in name or name in (".", ".."):
        raise ConfigError(f"--token-credential {name!r}: a credential name is a plain file name (as in LoadCredential={name or 'NAME'}:PATH)")
    directory = env.get(CREDENTIALS_VARIABLE, "").strip()
    if not directory:
        raise ConfigError(
            f"--token-credential {name}: ${CREDENTIALS_VARIABLE} is not set; run under systemd with LoadCredential={name}:PATH, or use --secret-file PATH"
        )
    path = Path(directory) / name
    if not path.exists():
        raise ConfigError(f"--token-credential {name}: no credential {name!r} in {directory}; add LoadCredential={name}:PATH to the unit")
    return path


def add_service_options(parser: argparse.ArgumentParser) -> None:
    """The options for running under systemd."""
    group = parser.add_argument_group("running as a systemd service")
    group.add_argument(
        "--token-credential",
        metavar="NAME",
        help="read the session secret from systemd credential NAME ($CREDENTIALS_DIRECTORY/NAME, from LoadCredential=) instead of --secret-file",
    )


def apply_service_options(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> None:
    """Resolve ``--token-credential`` into the secret file it names; raises :class:`ConfigError`."""
    if args.token_credential is None:
        return
    if args.secret_file:
        raise ConfigError("--token-credential and --secret-file both name the session secret: give one")
    args.secret_file = str(credential_path(args.token_credential, env))
