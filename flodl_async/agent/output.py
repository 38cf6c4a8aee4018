"""Rank output: whole lines forwarded with ``[host:rN]`` prefixes, and per-rank log files."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

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
        target = self._stderr if err else self._stdout
        target.write(f"[{host}:r{rank}] ".encode() + data)
        target.flush()
        file = self._log_file(rank)
        if file is not None:
            file.write(data)
            file.flush()

    def close(self) -> None:
        """Close the per-rank log files."""
        for file in self._files.values():
            file.close()
        self._files.clear()


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
