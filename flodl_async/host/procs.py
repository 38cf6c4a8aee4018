"""Child processes that cannot outlive us: own process group, parent-death signal, shared-deadline
stop.

Every rank and store process is started in a new session (its own process
group, so a kill reaches the grandchildren it forks, e.g. data-loader workers)
with ``PR_SET_PDEATHSIG=SIGKILL``, so it dies even when the launcher or agent
is SIGKILLed and has no chance to clean up. Stopping follows the signal table
(:func:`flodl_async.verdict.stop_schedule`): the first signal to every group,
TERM halfway when the first was not TERM, then KILL to the survivors at one
deadline shared by all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from ..verdict import StopStep

_PR_SET_PDEATHSIG = 1


class ChildProcess(Protocol):
    """What a rank's watcher uses of its process: :class:`asyncio.subprocess.Process`, or an
    early-started rank adopted later (:class:`flodl_async.host.early.AdoptedProcess`)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    @property
    def stdout(self) -> asyncio.StreamReader | None: ...

    @property
    def stderr(self) -> asyncio.StreamReader | None: ...

    async def wait(self) -> int: ...


def die_with_parent() -> None:  # runs in the child between fork and exec
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
        preexec_fn=die_with_parent,
    )


def signal_group(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the process group led by ``pid`` (gone already is fine).

    A stopping signal is followed by SIGCONT: a stopped (SIGSTOPped, ^Z'd) rank would otherwise hold
    the signal pending until SIGKILL at the grace deadline, and its handlers (``except
    KeyboardInterrupt: save()``) would never run. SIGCONT to a running group is a no-op.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
        if sig is not signal.SIGKILL:
            os.killpg(pid, signal.SIGCONT)


async def _wait_all(procs: Sequence[ChildProcess]) -> None:
    for proc in procs:
        await proc.wait()


async def _until_exited_or_forced(
    procs: Sequence[ChildProcess], force: asyncio.Event | None, when: float
) -> None:
    """Return when every process exited, ``force`` is set, or the loop time ``when`` came, whichever
    is first."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout_at(when), asyncio.TaskGroup() as tg:
            exits = tg.create_task(_wait_all(procs), name="stop-wait-exits")
            if force is not None:
                forced = tg.create_task(force.wait(), name="stop-wait-force")
                # Whichever finishes first ends the other: the group then closes at once.
                exits.add_done_callback(lambda _: forced.cancel())
                forced.add_done_callback(lambda _: exits.cancel())


async def stop_processes(
    procs: Iterable[ChildProcess],
    *,
    schedule: Sequence[StopStep],
    force: asyncio.Event | None = None,
) -> None:
    """Follow ``schedule`` (:func:`flodl_async.verdict.stop_schedule`) over every process group.

    Each step's signal goes to the groups still running at its time, counted from the
    start of this call; the last step (KILL) is the one deadline shared by all of them.
    ``force`` set (a second signal) means KILL now. Returns once every process exited.
    """
    live = [p for p in procs if p.returncode is None]
    if not live:
        return
    loop = asyncio.get_running_loop()
    started = loop.time()
    for step in schedule:
        if step.signal is signal.SIGKILL:
            break  # the final KILL, below, reaches every group
        if started + step.after > loop.time():
            await _until_exited_or_forced(live, force, started + step.after)
        if all(p.returncode is not None for p in live) or (force is not None and force.is_set()):
            break
        for proc in live:
            if proc.returncode is None:
                signal_group(proc.pid, step.signal)
    deadline = started + schedule[-1].after if schedule else started
    if deadline > loop.time() and not all(p.returncode is not None for p in live):
        await _until_exited_or_forced(live, force, deadline)
    for proc in live:
        # The whole group, even when its leader already exited: forked helpers die too.
        signal_group(proc.pid, signal.SIGKILL)
    await _wait_all(live)
