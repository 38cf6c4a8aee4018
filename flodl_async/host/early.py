"""Rank processes started before the control plane that will own them, and their adoption.

Theory of operation. A one-host ``flodl-launch --nproc`` run knows its whole world from its
arguments: which ranks, their environment, the port. Its ranks spend their first second importing
torch, so the launcher starts them at once (:func:`start_early`) and builds its controller and
in-process agent while they import. The agent then *adopts* them at its first ``StartRanks``
(:func:`claim` and :func:`adopt`) instead of starting them, but only when it would have started
exactly that command line, environment and directory: anything it decided differently (another
port, another interface, a secret file) kills the early process and starts the rank as usual, so
the early start can make a run faster, never different. A rank nobody claims is killed with its
group when the launcher ends (:func:`discard_all`).

Early ranks are started as :func:`flodl_async.host.procs.spawn` starts every rank: own session,
the parent-death signal, stdin closed, stdout and stderr piped (what they write before the
adoption waits in the pipes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from .procs import die_with_parent, signal_group

log = logging.getLogger("flodl_async.agent")

#: (run id, host, rank) of the first round.
EarlyKey = tuple[str, str, int]


@dataclass(frozen=True, slots=True)
class _Early:
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str | None
    popen: subprocess.Popen[bytes]


_waiting: dict[EarlyKey, _Early] = {}


def start_early(
    key: EarlyKey, argv: tuple[str, ...], *, env: Mapping[str, str], cwd: str | None
) -> None:
    """Start ``argv`` now, to be claimed as ``key``'s rank (an OSError leaves nothing started)."""
    popen = subprocess.Popen(
        argv,
        env=dict(env),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=die_with_parent,  # noqa: PLW1509 — the launcher's one thread: nothing to fork
    )
    _waiting[key] = _Early(argv=argv, env=dict(env), cwd=cwd, popen=popen)


def early_ranks_of(run_id: str, host: str) -> bool:
    """Whether ranks of ``host`` in ``run_id`` were started early and wait for their agent."""
    return any(key[:2] == (run_id, host) for key in _waiting)


def claim(
    key: EarlyKey, argv: tuple[str, ...], *, env: Mapping[str, str], cwd: str | None
) -> subprocess.Popen[bytes] | None:
    """The early process of ``key`` when it is exactly ``argv`` in ``env`` and ``cwd``; None when
    there is none, or it differs (then it is killed: the caller starts the rank itself)."""
    early = _waiting.pop(key, None)
    if early is None:
        return None
    if (early.argv, dict(early.env), early.cwd) == (tuple(argv), dict(env), cwd):
        return early.popen
    differs = sorted(name for name in {*early.env, *env} if early.env.get(name) != env.get(name))
    log.debug(
        "rank %d started early differs from its start (%s): started again",
        key[2],
        ", ".join(differs) or "command line or directory",
    )
    _kill(early.popen)
    return None


def discard_all() -> None:
    """Kill every early rank nobody claimed (the run ended, or failed, before its agent did)."""
    while _waiting:
        _kill(_waiting.popitem()[1].popen)


def _kill(popen: subprocess.Popen[bytes]) -> None:
    signal_group(popen.pid, signal.SIGKILL)
    popen.wait()
    for pipe in (popen.stdout, popen.stderr):
        if pipe is not None:
            pipe.close()


class AdoptedProcess:
    """A :class:`subprocess.Popen` seen as :class:`asyncio.subprocess.Process` is used here:
    ``pid``, ``returncode``, the ``stdout``/``stderr`` readers and ``await wait()``."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        stdout: asyncio.StreamReader,
        stderr: asyncio.StreamReader,
        exited: asyncio.Future[int],
    ) -> None:
        self._popen = popen
        self._exited = exited
        self._streams = (stdout, stderr)

    @property
    def pid(self) -> int:
        """Its pid."""
        return self._popen.pid

    @property
    def stdout(self) -> asyncio.StreamReader | None:
        """Its standard output."""
        return self._streams[0]

    @property
    def stderr(self) -> asyncio.StreamReader | None:
        """Its standard error."""
        return self._streams[1]

    @property
    def returncode(self) -> int | None:
        """Its exit status once reaped (negative: the signal that ended it), like asyncio's."""
        return self._popen.returncode

    async def wait(self) -> int:
        """Its exit status, once it has exited."""
        return await asyncio.shield(self._exited)


async def adopt(popen: subprocess.Popen[bytes], *, line_limit: int) -> AdoptedProcess:
    """``popen`` under this loop: its pipes read as streams, its exit awaited through a pidfd (the
    kernel says when it exits; no SIGCHLD handler of asyncio's or uvloop's is involved)."""
    loop = asyncio.get_running_loop()
    readers = []
    for pipe in (popen.stdout, popen.stderr):
        assert pipe is not None
        reader = asyncio.StreamReader(limit=line_limit, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader)
        await loop.connect_read_pipe(lambda p=protocol: p, pipe)  # type: ignore[misc]
        readers.append(reader)
    exited: asyncio.Future[int] = loop.create_future()
    pidfd = os.pidfd_open(popen.pid)

    def reap() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        code = popen.wait()  # it has exited: this only reaps
        if not exited.done():
            exited.set_result(code)

    loop.add_reader(pidfd, reap)
    with contextlib.suppress(ChildProcessError):
        if popen.poll() is not None:  # exited before the reader was in place
            reap()
    return AdoptedProcess(popen, readers[0], readers[1], exited)
