"""Child processes that cannot outlive us: own process group, parent-death signal, shared-deadline stop.

Every rank and store process is started in a new session (its own process
group, so a kill reaches the grandchildren it forks, e.g. data-loader workers)
with ``PR_SET_PDEATHSIG=SIGKILL``, so it dies even when the launcher or agent
is SIGKILLed and has no chance to clean up. Stopping is TERM to every group,
then KILL to the survivors at one deadline shared by all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


async def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | None = None,
    stdin: int | None = asyncio.subprocess.DEVNULL,
    stdout: int | None = asyncio.subprocess.PIPE,
    stderr: int | None = asyncio.subprocess.PIPE,
    pass_fds: tuple[int, ...] = (),
    line_limit: int = 64 * 1024,
) -> asyncio.subprocess.Process:
    """Start ``argv`` in its own process group, tied to our life."""
    return await asyncio.create_subprocess_exec(
        *argv,
        env=dict(env),
        cwd=cwd,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        pass_fds=pass_fds,
        limit=line_limit,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )


def signal_group(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the process group led by ``pid`` (gone already is fine)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def stop_processes(
    procs: Iterable[asyncio.subprocess.Process],
    *,
    grace: float,
    force: asyncio.Event | None = None,
) -> None:
    """TERM every group, then KILL whatever is left at one shared deadline (or when ``force`` is set)."""
    live = [p for p in procs if p.returncode is None]
    for proc in live:
        signal_group(proc.pid, signal.SIGTERM)
    waiters: set[asyncio.Future[Any]] = {asyncio.ensure_future(p.wait()) for p in live}
    force_wait: asyncio.Future[Any] | None = asyncio.ensure_future(force.wait()) if force is not None else None
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        pending = set(waiters)
        while pending and not (force is not None and force.is_set()):
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            watch = pending | ({force_wait} if force_wait is not None else set())
            await asyncio.wait(watch, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            pending = {w for w in pending if not w.done()}
        for proc in live:
            # The whole group, even when its leader already exited: forked helpers die too.
            signal_group(proc.pid, signal.SIGKILL)
        if waiters:
            await asyncio.gather(*waiters)
    finally:
        for waiter in (*waiters, *([force_wait] if force_wait is not None else [])):
            waiter.cancel()
