"""Rank output: chunks from the ranks' pipes, ``[host:rN]`` lines on the launcher's console,
per-rank log files.

Theory of operation. Each rank's stdout and stderr are read by
:func:`forward_output`, which cuts them into chunks
(:class:`~flodl_async.agent.outputlines.OutputChunker`: whole lines at once, a
partial line after a short idle time) and hands each to an :class:`OutputSink`:

- :class:`LinkOutput`, in a stand-alone ``flodl-agent``: every chunk goes up
  the join link as a sealed ``RankOutput`` message, after ``link.drain()``.
  While the link is saturated the reader waits, the rank's pipe fills and its
  writes block, as with a slow terminal: nothing is dropped, and the session's
  control messages (``RankExited``, ``RanksStopped``) never queue behind output.
- :class:`RankOutput`, in the launcher: the controller hands it the chunks that
  arrive from every host's link, and its own in-process agents hand it theirs
  directly (the same bytes, without the loopback hop and two AES-GCM passes).
  It assembles lines per rank and stream
  (:class:`~flodl_async.agent.outputlines.LineAssembler`), writes whole prefixed lines
  to its stdout/stderr (one write each, so ranks never tear each other's lines),
  and the raw bytes to torchrun's log layout
  ``<log_dir>/<run_id>/attempt_<n>/<rank>/{stdout,stderr}.log``.

The launcher hands it :class:`~flodl_async.host.console.ConsoleWriter` streams, so a console
nobody reads never blocks the event loop; the in-process agents' chunks wait for room
there (:meth:`RankOutput.send`), which is what makes a stuck console fill the ranks' pipes.

Where the console goes may go away while the ranks run: the reader of a pipe
(``| head``, a supervisor piping the launcher) can die. A stream that fails a
write is retired, with one warning: the ranks keep running and their later
lines to it are dropped, so a lost reader never takes the run down with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import BinaryIO, Protocol

from ..config.streams import StreamRouting
from ..errors import ConnectionClosed, WireError
from ..host.console import ConsoleWriter, point_at_devnull
from ..net.framed import FramedProtocol
from ..wire import messages as m
from .outputlines import CHUNK_LIMIT, LineAssembler, OutputChunker

log = logging.getLogger("flodl_async.agent")

#: Lines longer than this are forwarded in pieces rather than buffered without bound.
LINE_LIMIT = CHUNK_LIMIT
#: The two streams of a rank, as ``RankOutput.stream`` names them, and their log file names.
STREAMS = {"out": "stdout.log", "err": "stderr.log"}
#: A console stream: a plain binary stream (written inline), or a writer thread's (never blocks).
Console = BinaryIO | ConsoleWriter


class OutputSink(Protocol):
    """Where a host's rank output goes (the launcher's :class:`RankOutput`, or the join link)."""

    def rank_started(self, host: str, attempt: int, rank: int) -> None:
        """A rank of ``attempt`` started (its log files exist from now on, even if it never
        prints)."""
        ...

    async def send(self, host: str, attempt: int, rank: int, stream: str, data: bytes) -> None:
        """One chunk of a rank's ``stream`` ('out' or 'err'); returns when the next one may
        follow."""
        ...


class LinkOutput:
    """A stand-alone agent's sink: chunks up the join link, behind the link's back-pressure."""

    def __init__(self, link: FramedProtocol) -> None:
        self._link = link

    def rank_started(self, host: str, attempt: int, rank: int) -> None:
        # An empty chunk per stream tells the launcher the rank started (its files are created).
        for stream in STREAMS:
            # a lost or broken link is the command reader's to report
            with contextlib.suppress(ConnectionClosed, WireError):
                self._link.send(m.RankOutput(attempt=attempt, rank=rank, stream=stream, data=b""))

    async def send(self, host: str, attempt: int, rank: int, stream: str, data: bytes) -> None:
        # drain() first: output waits for the link, control messages (sent without waiting) never
        # do.
        # On a lost or broken link the chunk is dropped (the command reader reports the loss and the
        # ranks are stopped); reading on keeps the ranks from blocking on a pipe nobody empties.
        with contextlib.suppress(ConnectionClosed, WireError):
            await self._link.drain()
            self._link.send(m.RankOutput(attempt=attempt, rank=rank, stream=stream, data=data))


class TeeOutput:
    """An every-node run's agent node (``flodl-launch --nnodes``): each chunk to its own node's
    console first, then up the join link (the controller's node logs it, but leaves its printing
    to this node)."""

    def __init__(self, console: OutputSink, link: OutputSink) -> None:
        self._console = console
        self._link = link

    def rank_started(self, host: str, attempt: int, rank: int) -> None:
        self._console.rank_started(host, attempt, rank)
        self._link.rank_started(host, attempt, rank)

    async def send(self, host: str, attempt: int, rank: int, stream: str, data: bytes) -> None:
        await self._console.send(host, attempt, rank, stream, data)
        await self._link.send(host, attempt, rank, stream, data)


class RankOutput:
    """The launcher's rank output: ``[host:rN]`` lines on its console, raw bytes in per-rank log
    files.

    One instance serves every host of a run. ``show_ranks`` (``--local-ranks-filter``)
    limits which ranks reach the console; the files get every rank.
    """

    def __init__(
        self,
        *,
        stdout: Console,
        stderr: Console,
        log_dir: Path | None = None,
        run_id: str = "run",
        show_ranks: Collection[int] | None = None,
        routing: StreamRouting | None = None,
        first_attempt: int = 0,
        remote_console: bool = True,
    ) -> None:
        """``routing``: torchrun's ``--redirects``/``--tee`` (None: every stream to both).
        ``remote_console``: print the lines that arrive over join links too; an every-node run
        (``--nnodes``) leaves them to their own node's console, so a merged output (srun's) shows
        each line once.
        ``first_attempt``: the number of this run's first attempt directory (a resubmitted run id
        continues after the attempts its log dir already holds)."""
        self._stdout = stdout
        self._stderr = stderr
        self._log_dir = log_dir
        self._run_id = run_id
        self._show = None if show_ranks is None else frozenset(show_ranks)
        self._routing = routing
        self._first_attempt = first_attempt
        self._remote_console = remote_console
        self._lines: dict[tuple[int, str], LineAssembler] = {}
        # (rank, stream) → (attempt, file)
        self._files: dict[tuple[int, str], tuple[int, BinaryIO]] = {}
        self._retired: list[Console] = []  # streams that failed a write (compared by identity)

    @property
    def consoles(self) -> tuple[Console, Console]:
        """Its stdout and stderr (for the agents' own lines: the same writers, in the same
        order)."""
        return self._stdout, self._stderr

    def log_path(self, attempt: int, rank: int, stream: str) -> Path | None:
        """Where ``rank``'s ``stream`` of ``attempt`` is logged (torchrun's layout), or None without
        a log dir."""
        if self._log_dir is None:
            return None
        if self._routing is not None and not self._routing.to_file(rank, stream):
            return None
        number = self._first_attempt + attempt
        return self._log_dir / self._run_id / f"attempt_{number}" / str(rank) / STREAMS[stream]

    def rank_started(self, host: str, attempt: int, rank: int) -> None:
        """Open the rank's log files now, so every rank has them even if it never prints."""
        for stream in STREAMS:
            self._stream_started(host, attempt, rank, stream)

    def _stream_started(self, host: str, attempt: int, rank: int, stream: str) -> None:
        old = self._lines.pop((rank, stream), None)
        if old is not None:  # the previous attempt's unfinished line, if it was never shown
            for line in old.end():
                self._console(host, rank, stream, line.text)
        self._log_file(attempt, rank, stream)

    def _log_file(self, attempt: int, rank: int, stream: str) -> BinaryIO | None:
        path = self.log_path(attempt, rank, stream)
        if path is None:
            return None
        held = self._files.get((rank, stream))
        if held is not None and held[0] == attempt:
            return held[1]
        if held is not None:
            with contextlib.suppress(OSError):
                held[1].close()
        path.parent.mkdir(parents=True, exist_ok=True)
        file = open(path, "ab")  # noqa: SIM115 — kept open for the attempt, closed in close() or at the next attempt
        self._files[(rank, stream)] = (attempt, file)
        return file

    def chunk(
        self, host: str, attempt: int, rank: int, stream: str, data: bytes, *, console: bool = True
    ) -> None:
        """One chunk of ``rank``'s ``stream`` ('out' or 'err'); an empty one marks the stream's
        start. ``console``: False writes the log file only."""
        if stream not in STREAMS:
            log.warning(
                "rank output from %s for rank %d names an unknown stream %r; dropped",
                host,
                rank,
                stream,
            )
            return
        if not data:
            if console:
                self._stream_started(host, attempt, rank, stream)
            else:
                self._log_file(attempt, rank, stream)
            return
        if console:
            assembler = self._lines.get((rank, stream))
            if assembler is None:
                assembler = self._lines[(rank, stream)] = LineAssembler()
            for line in assembler.receive_data(data):
                self._console(host, rank, stream, line.text)
        file = self._log_file(attempt, rank, stream)
        if file is not None:
            self._write(file, data, f"the log file of rank {rank}")

    async def send(self, host: str, attempt: int, rank: int, stream: str, data: bytes) -> None:
        """:class:`OutputSink` for the launcher's in-process agents: the chunk is written once its
        console has room."""
        console = self._stderr if stream == "err" else self._stdout
        if isinstance(console, ConsoleWriter):
            # a console nobody reads: this rank's pipe fills, its writes block
            await console.wait_room()
        self.chunk(host, attempt, rank, stream, data)

    def receive(self, host: str, msg: m.RankOutput) -> None:
        """A ``RankOutput`` message from ``host``'s join link."""
        self.chunk(host, msg.attempt, msg.rank, msg.stream, msg.data, console=self._remote_console)

    def _console(self, host: str, rank: int, stream: str, text: bytes) -> None:
        if self._show is not None and rank not in self._show:
            return
        if self._routing is not None and not self._routing.to_console(rank, stream):
            return
        err = stream == "err"
        self._write(
            self._stderr if err else self._stdout,
            f"[{host}:r{rank}] ".encode() + text,
            "stderr" if err else "stdout",
        )

    def _write(self, stream: Console | BinaryIO, data: bytes, name: str) -> None:
        if any(stream is gone for gone in self._retired):
            return
        try:
            stream.write(data)
            stream.flush()
        # EPIPE: its reader went away; EIO: the terminal hung up; ENOSPC: a full disk
        except OSError as exc:
            self._retired.append(stream)
            # a writer thread's stream never raises here: it retires itself
            if not isinstance(stream, ConsoleWriter):
                point_at_devnull(stream)
            log.warning(
                "%s is gone (%s): rank output to it is dropped from now on; the ranks keep running",
                name,
                exc.strerror or exc,
            )

    def close(self) -> None:
        """Close the per-rank log files."""
        for _attempt, file in self._files.values():
            # a retired file's buffered tail cannot be written either
            with contextlib.suppress(OSError):
                file.close()
        self._files.clear()


async def forward_output(
    stream: asyncio.StreamReader, *, idle: float, emit: Callable[[bytes], Awaitable[None]]
) -> None:
    """Hand ``stream``'s bytes to ``emit`` in chunks until EOF (whole lines at once, a partial line
    after ``idle``).

    ``emit`` is awaited before the pipe is read again: a slow sink makes the rank's
    writes block rather than this buffer grow.
    """
    loop = asyncio.get_running_loop()
    chunker = OutputChunker(idle=idle, limit=CHUNK_LIMIT)
    while True:
        while (chunk := chunker.next_chunk(loop.time())) is not None:
            await emit(chunk)
            chunker.handed_on(loop.time())
        try:
            async with asyncio.timeout_at(chunker.next_deadline()):
                # cancelling a read loses nothing: the bytes stay buffered
                data = await stream.read(CHUNK_LIMIT)
        except TimeoutError:
            continue
        if not data:
            rest = chunker.end()
            if rest:
                await emit(rest)
            return
        chunker.receive_data(data, loop.time())
