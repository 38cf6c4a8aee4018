"""A pool of large byte buffers: payloads and accumulators reused across averaging rounds.

Why: a fresh 16 MiB ``bytearray`` costs ~20 ms of first-touch page faults on a
2-vCPU machine, more than the arithmetic on it. Steady rounds therefore take
their receive buffers, accumulators and consensus buffers from a pool, by exact
size (a model's frames have the same few sizes every round).

Pass :meth:`BufferPool.acquire` as a link's ``allocate``; hand a buffer back with
:meth:`BufferPool.release` once no tensor views it any more. Thread-safe: buffers
are acquired on the event loop and may be released from the executor threads that
did the arithmetic on them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class BufferPoolStatistics:
    """How often a buffer was reused (``hits``): steady rounds stop allocating."""

    hits: int


class BufferPool:
    """Recycles ``bytearray`` buffers by exact size, keeping at most ``max_per_size`` of each."""

    def __init__(self, *, max_per_size: int = 4) -> None:
        self._free: dict[int, list[bytearray]] = {}
        self._max_per_size = max_per_size
        self._lock = threading.Lock()
        self._hits = 0

    def acquire(self, size: int) -> bytearray:
        """A buffer of exactly ``size`` bytes; its contents are whatever the last user left."""
        with self._lock:
            free = self._free.get(size)
            if free:
                self._hits += 1
                return free.pop()
        return bytearray(size)

    def release(self, buffer: bytearray | memoryview | None) -> None:
        """Give a buffer back (a frame's payload view or the bytearray itself); None is ignored.

        A view is released first; if a tensor still exports it (a bug upstream), the buffer is
        dropped instead of being handed to someone else while it is read.
        """
        if buffer is None:
            return
        if isinstance(buffer, memoryview):
            raw = buffer.obj
            try:
                buffer.release()
            except BufferError:
                return  # still viewed: never reuse memory someone reads
            if not isinstance(raw, bytearray):
                return
            buffer = raw
        with self._lock:
            free = self._free.setdefault(len(buffer), [])
            if len(free) < self._max_per_size and all(b is not buffer for b in free):
                free.append(buffer)

    def clear(self) -> None:
        """Drop every held buffer (the memory goes back to the allocator)."""
        with self._lock:
            self._free.clear()

    def statistics(self) -> BufferPoolStatistics:
        """The reuse counter."""
        with self._lock:
            return BufferPoolStatistics(hits=self._hits)


#: The process's pool for averaging buffers: a relay and the reducer in one process (the launcher's
#: own host) hand buffers to each other, so they draw from one pool.
SHARED = BufferPool(max_per_size=8)
