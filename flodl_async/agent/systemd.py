"""``flodl-agent`` as a systemd service: session events as notifications, the watchdog, credentials.

Under ``Type=notify`` (deploy/flodl-agent.service) the agent says ``READY=1``
once its join link to the controller is up (a persisting agent already at start,
while it waits for a controller: :mod:`flodl_async.agent.daemon`), keeps ``STATUS=`` current
("waiting for a controller at …", "run X: ranks 4–7 running"), says
``STOPPING=1`` when its ranks begin to stop, and pings ``WATCHDOG=1`` from the
event loop (a task of the agent's own TaskGroup). Outside systemd all of it is
a no-op (:class:`flodl_async.host.sdnotify.Notifier`).

The cluster token comes as a systemd credential: ``LoadCredential=flodl-token:PATH``
puts it in ``$CREDENTIALS_DIRECTORY`` (0400, the service's own), and the unit passes
``--token-file %d/flodl-token`` (``%d`` is that directory), read with the same checks
as any token file. (``--token-credential``, which fed a one-run session secret, is gone:
a service persists, and a persisting agent holds the token.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import TypeVar

from ..host.sdnotify import Notifier
from .lifecycle import Phase, SessionEvent, SessionObserver

T = TypeVar("T")


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
    """The session observer that keeps systemd told: READY=1 once connected, STATUS= at every step,
    STOPPING=1."""

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
    """Await ``work`` with the watchdog ticker beside it in one TaskGroup; ``work``'s own error
    comes out unwrapped.

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
