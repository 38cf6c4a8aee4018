"""The send side's sealing work, apart from the protocol: buffers reused once written, and large
payloads sealed chunk by chunk in a worker thread.

A link seals each payload frame into a buffer of its own and hands the buffer to the
transport. uvloop writes from our buffers without copying, so a buffer may be sealed into
again only once the kernel has every byte of it: :class:`SealingBuffers` counts the bytes
handed to the transport, notes where each buffer's last byte lies, and takes a buffer back
once the transport's unflushed bytes no longer reach it (a fresh 16 MiB buffer costs ~20 ms of
page faults). :func:`seal_streaming` seals a large payload in a worker thread and hands each
sealed chunk to the loop as soon as it is done, so the socket sends chunk i while the thread
seals chunk i+1.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from ..wire.frame import SealingFrame

#: Sealing buffers kept for reuse per link once written.
SPARE_SEALING_BUFFERS = 4


class SealingBuffers:
    """One link's sealing buffers: each taken for a frame, and reused once the kernel has its
    bytes."""

    __slots__ = ("_in_flight", "_keep", "_spare", "allocations", "written")

    def __init__(self, *, keep: int = SPARE_SEALING_BUFFERS) -> None:
        self._keep = keep
        self._in_flight: collections.deque[tuple[int, bytearray]] = collections.deque()
        self._spare: list[bytearray] = []
        #: Bytes ever handed to the transport; minus its buffered bytes, what reached the kernel.
        self.written = 0
        #: Buffers that had to be allocated (the rest were reused): steady traffic stops
        #: allocating.
        self.allocations = 0

    def wrote(self, nbytes: int) -> None:
        """``nbytes`` more were handed to the transport."""
        self.written += nbytes

    def sent(self, buffer: bytearray) -> None:
        """The last byte sealed into ``buffer`` was just handed to the transport."""
        self._in_flight.append((self.written, buffer))

    def take(self, need: int, *, unflushed: int | None) -> bytearray:
        """A buffer of at least ``need`` bytes; ``unflushed``: the transport's buffered bytes
        (None: no transport, nothing is known to be flushed)."""
        if unflushed is not None:
            flushed = self.written - unflushed
            while self._in_flight and self._in_flight[0][0] <= flushed:
                done = self._in_flight.popleft()[1]
                if len(self._spare) < self._keep:
                    self._spare.append(done)
        for index, spare in enumerate(self._spare):
            if len(spare) >= need:
                return self._spare.pop(index)
        self.allocations += 1
        return bytearray(need)


async def seal_streaming(sealing: SealingFrame, write_chunk: Callable[[int, int], None]) -> bytes:
    """Seal ``sealing``'s payload chunk by chunk in a worker thread; returns the tag.

    ``write_chunk(start, end)`` runs on the loop for each sealed chunk, in order
    (``call_soon_threadsafe`` is FIFO, and the job's completion comes after its last chunk).
    A failed or cancelled wait stops the thread at its next chunk; the buffer may still be
    written into by then, so the caller drops it rather than reuse it.
    """
    loop = asyncio.get_running_loop()
    stop = False

    def work() -> bytes:
        for index in range(sealing.chunks):
            if stop:
                return b""  # the send was cancelled: nobody writes the rest
            start, end = sealing.seal_chunk(index)
            loop.call_soon_threadsafe(write_chunk, start, end)
        return sealing.finish()

    try:
        return await loop.run_in_executor(None, work)
    except BaseException:
        stop = True
        raise
