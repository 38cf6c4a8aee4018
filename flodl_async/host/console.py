"""The launcher's console streams, written by a thread of their own: the event loop never blocks on
them.

Theory of operation. Rank output goes to the launcher's stdout and stderr. A blocking write
there stalls the whole event loop while nobody reads the pipe (a supervisor that reads
late, a paused ``| less``): no heartbeat is answered, no status page served, no control
frame read. A :class:`ConsoleWriter` takes the bytes (``write`` never blocks and never
drops) and a writer thread does the blocking writes, one queued piece after another, so
lines keep their order and are never torn.

Back-pressure: past ``limit`` bytes not yet written, :meth:`ConsoleWriter.wait_room`
waits (until the backlog is down to half) — the launcher's own agents await it before
handing on a chunk, so their readers stop reading the ranks' pipes and the ranks'
writes block, as with a slow terminal. Chunks that arrive on a remote host's join link
are queued without waiting (the link also carries that host's control frames, which must
not wait behind output), so while the console is stuck they are held in memory.

A stream whose write fails (its reader went away: EPIPE) is retired with one warning and
pointed at /dev/null; later bytes to it are dropped, the run goes on. :meth:`close`
writes out everything still queued and stops the thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import threading
from typing import BinaryIO

log = logging.getLogger("flodl_async.host.console")

#: Bytes queued but not yet written past which the launcher's own agents wait.
DEFAULT_LIMIT = 1 << 20
#: At most this much goes into one write (the queue is joined up to it).
WRITE_LIMIT = 1 << 20


class ConsoleWriter:
    """One console stream (stdout or stderr) behind a writer thread; ``write`` and ``flush`` never
    block."""

    def __init__(self, stream: BinaryIO, *, name: str, limit: int = DEFAULT_LIMIT) -> None:
        self._stream = stream
        self.name = name
        self._limit = limit
        self._cond = threading.Condition()
        self._queue: collections.deque[bytes] = collections.deque()
        self._backlog = 0
        self._closed = False
        self._failed = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._thread = threading.Thread(target=self._run, name=f"console-{name}", daemon=True)
        self._thread.start()

    @property
    def backlog(self) -> int:
        """Bytes queued and not yet written."""
        with self._cond:
            return self._backlog

    def write(self, data: bytes) -> int:
        """Queue ``data`` (never blocks; dropped only once the stream has failed).

        After :meth:`close` there is no thread and no loop to protect: the bytes are written inline.
        """
        if not data:
            return 0
        with self._cond:
            if self._failed:
                return len(data)
            if not self._closed:
                self._queue.append(bytes(data))
                self._backlog += len(data)
                self._cond.notify()
                return len(data)
        with contextlib.suppress(OSError, ValueError):
            self._stream.write(data)
            self._stream.flush()
        return len(data)

    def text(self) -> TextConsole:
        """A text view (what ``logging.StreamHandler`` writes to): the launcher's log lines keep
        their place among the ranks'."""
        return TextConsole(self)

    def flush(self) -> None:
        """Nothing to do here: the thread flushes after every write."""

    async def wait_room(self) -> None:
        """Return once the backlog is under the limit (at once when it is, or when the stream
        failed)."""
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._backlog <= self._limit or self._failed or self._closed:
                return
            future: asyncio.Future[None] = loop.create_future()
            self._waiters.append((loop, future))
        await future

    def close(self) -> None:
        """Write out what is queued (blocking until the reader takes it or the stream fails), stop
        the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    # ----- the writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    self._wake_waiters_locked()
                    return
                pieces: list[bytes] = []
                size = 0
                while self._queue and size < WRITE_LIMIT:
                    piece = self._queue.popleft()
                    pieces.append(piece)
                    size += len(piece)
            data = b"".join(pieces)
            error: OSError | None = None
            try:
                self._stream.write(data)
                self._stream.flush()
            except OSError as exc:  # EPIPE: its reader went away; EIO: the terminal hung up
                error = exc
            except ValueError:  # the stream was closed under us (interpreter shutdown)
                error = OSError("the stream is closed")
            with self._cond:
                self._backlog -= size
                if error is not None:
                    self._failed = True
                    self._backlog -= sum(len(p) for p in self._queue)
                    self._queue.clear()
                if self._backlog <= self._limit // 2 or self._failed:
                    self._wake_waiters_locked()
            if error is not None:
                point_at_devnull(self._stream)
                log.warning(
                    "%s is gone (%s): rank output to it is dropped from now on; the ranks keep "
                    "running",
                    self.name,
                    error.strerror or error,
                )
                with self._cond:  # nothing more will be written: wait only for close()
                    while not self._closed:
                        self._cond.wait()
                    self._queue.clear()
                return

    def _wake_waiters_locked(self) -> None:
        waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            # a loop already closed has nobody waiting any more
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, future)


class TextConsole:
    """``str`` in, UTF-8 into the writer (undecodable characters escaped, never an error)."""

    def __init__(self, writer: ConsoleWriter) -> None:
        self._writer = writer

    def write(self, text: str) -> int:
        self._writer.write(text.encode("utf-8", "backslashreplace"))
        return len(text)

    def flush(self) -> None:
        """The writer's thread flushes."""


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def point_at_devnull(stream: BinaryIO) -> None:
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
