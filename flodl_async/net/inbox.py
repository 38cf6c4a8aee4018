"""A link's receive side: decoded frames queued for its one receiver, then what ended the stream.

The protocol puts each read's frames in (:meth:`FrameInbox.put`) and records the first failure
(:meth:`FrameInbox.fail`); the receiver awaits :meth:`FrameInbox.get`, which hands out every frame
queued before a failure, then raises it. Past a high-water mark the inbox asks the transport to
stop reading, and to read again once the receiver drained half of it: a slow receiver holds the
peer back instead of growing the queue.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable

from ..wire.frame import Frame

#: Frames queued for the receiver before we stop reading from the socket.
RECV_HIGH_WATER = 64


class FrameInbox:
    """One link's received frames and its failure; see the module docstring.

    ``pause()`` and ``resume()`` stop and restart reading from the transport, and return False
    when there is no transport to ask (nothing changed).
    """

    def __init__(self, *, pause: Callable[[], bool], resume: Callable[[], bool]) -> None:
        self._pause = pause
        self._resume = resume
        self._frames: collections.deque[Frame] = collections.deque()
        self._wakeup: asyncio.Future[None] | None = None
        self._paused = False
        #: The first failure that ended the stream (None while it runs).
        self.failure: BaseException | None = None

    @property
    def receiving(self) -> bool:
        """True while a receiver waits in :meth:`get`."""
        return self._wakeup is not None

    def put(self, frames: Iterable[Frame]) -> None:
        """Queue ``frames``; those taken before ``frames`` raised stay queued (then it raises)."""
        self._frames.extend(frames)

    def throttle(self) -> None:
        """A read was queued: stop reading past the high-water mark, and wake the receiver."""
        if len(self._frames) >= RECV_HIGH_WATER and not self._paused:
            self._paused = self._pause()
        self.wake()

    def fail(self, exc: BaseException) -> None:
        """The stream ended with ``exc`` (the first failure is kept): wake the receiver."""
        if self.failure is None:
            self.failure = exc
        self.wake()

    def wake(self) -> None:
        """Wake the receiver, if one waits."""
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def get(self) -> Frame:
        """The next frame; raises the failure once every frame before it was taken. One receiver
        at a time: the caller checks :attr:`receiving` first."""
        assert self._wakeup is None, "a second receiver"
        while not self._frames:
            if self.failure is not None:
                raise self.failure
            self._wakeup = asyncio.get_running_loop().create_future()
            try:
                await self._wakeup
            finally:
                self._wakeup = None
        frame = self._frames.popleft()
        if self._paused and len(self._frames) < RECV_HIGH_WATER // 2 and self._resume():
            self._paused = False
        return frame
