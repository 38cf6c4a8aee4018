"""Rank output: whole lines forwarded with ``[host:rN]`` prefixes, and per-rank log files.

Where the output goes may go away while the ranks run: the reader of a pipe (an
ssh session, ``| head``, a supervisor piping the agent) can die with the
controller. A stream that fails a write is retired, with one warning: the ranks
keep running and their later lines to it are dropped, so a lost reader never
takes the session down with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger("flodl_async.agent")

#: Lines longer than this are forwarded in pieces rather than buffered without bound.
LINE_LIMIT = 64 * 1024


class RankOutput:
    """Forwards rank output line by line with ``[host:rN]`` prefixes, and to per-rank log files.

    One instance is shared by every session of a process (the controller's local hosts
    write to the launcher's stdout through it), so each line is one write.
    """

    def __init__(self, *, stdout: BinaryIO, stderr: BinaryIO, log_dir: Path | None = None) -> None:
        self._stdout = stdout
        self._stderr = stderr
        self._log_dir = log_dir
        self._files: dict[int, BinaryIO] = {}
        self._retired: list[BinaryIO] = []  # streams that failed a write (BinaryIO is compared by identity)

    def rank_started(self, rank: int) -> None:
        """Open the rank's log file now, so every rank has one even if it never prints."""
        self._log_file(rank)

    def _log_file(self, rank: int) -> BinaryIO | None:
        if self._log_dir is None:
            return None
        file = self._files.get(rank)
        if file is None:
            self._log_dir.mkdir(parents=True, exist_ok=True)
            file = open(self._log_dir / f"rank{rank}.log", "ab")  # noqa: SIM115 — kept open for the run, closed in close()
            self._files[rank] = file
        return file

    def line(self, host: str, rank: int, *, err: bool, data: bytes) -> None:
        """One whole line (one write, so lines from different ranks never interleave)."""
        if not data.endswith(b"\n"):
            data += b"\n"
        self._write(self._stderr if err else self._stdout, f"[{host}:r{rank}] ".encode() + data, "stderr" if err else "stdout")
        file = self._log_file(rank)
        if file is not None:
            self._write(file, data, f"the log file of rank {rank}")

    def _write(self, stream: BinaryIO, data: bytes, name: str) -> None:
        if any(stream is gone for gone in self._retired):
            return
        try:
            stream.write(data)
            stream.flush()
        except OSError as exc:  # EPIPE: its reader went away; EIO: the terminal hung up; ENOSPC: a full disk
            self._retired.append(stream)
            _point_at_devnull(stream)
            log.warning("%s is gone (%s): rank output to it is dropped from now on; the ranks keep running", name, exc.strerror or exc)

    def close(self) -> None:
        """Close the per-rank log files."""
        for file in self._files.values():
            with contextlib.suppress(OSError):  # a retired file's buffered tail cannot be written either
                file.close()
        self._files.clear()


def _point_at_devnull(stream: BinaryIO) -> None:
    """Send a failed stream's descriptor to /dev/null.

    What it still buffers would fail again at the interpreter's exit flush ("Exception
    ignored ... BrokenPipeError"); the Python docs' note on SIGPIPE does the same.
    A stream without a descriptor (a test's BytesIO) is left alone.
    """
    with contextlib.suppress(OSError, ValueError):
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)


async def forward_lines(stream: asyncio.StreamReader, emit: Callable[[bytes], None]) -> None:
    """Hand every line of ``stream`` to ``emit`` until EOF (an over-long line in pieces, a last partial line too)."""
    while True:
        try:
            data = await stream.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                emit(exc.partial)
            return
        except asyncio.LimitOverrunError as exc:
            data = await stream.readexactly(max(exc.consumed, 1))
        emit(data)
