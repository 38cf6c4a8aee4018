"""The status board: the latest snapshot, encoded once, and its live subscribers.

Theory of operation
-------------------
The controller calls :meth:`StatusBoard.publish` at every lifecycle event.
Publishing encodes the snapshot to JSON once and offers it to every
:class:`Subscription`; an HTTP request for ``/state.json`` only reads
:attr:`StatusBoard.encoded`, so answering a request never rebuilds or
re-encodes a snapshot.

*Live counters.* The connection counters (``connections`` in the document)
change between lifecycle events: every accepted or dropped connection bumps
them. The board takes a cheap ``counters`` provider instead of the controller
republishing per request. It is *pulled*, lazily: reading :attr:`encoded`
asks the provider again only when the encoding is older than
``counters_interval`` (0.5 s) on the board's own monotonic ``clock``, and
re-encodes only when the counters actually changed. So a request costs O(1),
amortised — at most one re-encode per interval however many clients poll — the
counters are never staler than the interval while someone is looking, and an
unwatched board does no work at all. (A timer that pushed fresh counters would
need a task and would run when nobody looks; a re-encode per request is what
this design replaces.) Counter refreshes are not lifecycle events: they update
the served document and :attr:`StatusBoard.snapshot`, but are not offered to
subscribers.

*Subscribers.* :meth:`StatusBoard.subscribe` returns a :class:`Subscription`:
a bounded queue with one receiver. A slow subscriber never slows the
publisher: when its queue is full the oldest snapshot is dropped (the latest
state is what matters) and counted in :meth:`Subscription.statistics`. The
queue is a plain deque; the only asyncio object is the future a waiting
receiver parks on, created lazily — so importing this package (as the
``flodl`` command does, for :data:`~flodl_async.status.model.SCHEMA`) does not
import asyncio.

Everything here runs on the controller's event-loop thread.
"""

from __future__ import annotations

import dataclasses
import math
import time
import typing
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from ..errors import BusyError, SubscriptionClosed
from .model import Counters, StatusSnapshot

if typing.TYPE_CHECKING:
    import asyncio

#: How old (seconds) the served counters may get while someone is reading them.
COUNTERS_INTERVAL = 0.5
#: A subscription's queue bound when the subscriber does not choose one.
DEFAULT_MAXSIZE = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class SubscriptionStatistics:
    """What one subscription has seen: snapshots handed out, dropped as the oldest of a full queue,
    still queued."""

    delivered: int
    dropped: int
    queued: int
    maxsize: int
    closed: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class BoardStatistics:
    """What the board has done: snapshots published, JSON encodes (publishes plus counter
    refreshes), live subscriptions."""

    published: int
    encodes: int
    subscribers: int


class Subscription:
    """The snapshots published on a board from the moment of subscribing, in a bounded queue.

    Receive with ``await sub.next()`` or ``async for snapshot in sub``; one
    receiver at a time (a second concurrent one raises
    :class:`~flodl_async.errors.BusyError`). :meth:`close` (or leaving
    ``with``/``async with``) unsubscribes: queued snapshots are discarded, a
    waiting receiver wakes, ``next()`` raises
    :class:`~flodl_async.errors.SubscriptionClosed` and ``async for`` ends.
    Made by :meth:`StatusBoard.subscribe`.
    """

    def __init__(self, board: StatusBoard, *, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"a subscription holds at least one snapshot (maxsize={maxsize})")
        self._board: StatusBoard | None = board
        self._queue: deque[StatusSnapshot] = deque()
        self._maxsize = maxsize
        self._waiter: asyncio.Future[None] | None = None
        self._delivered = 0
        self._dropped = 0

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._board is None

    def _offer(self, snapshot: StatusSnapshot) -> None:
        """Queue ``snapshot``, dropping the oldest when full (the board calls this on publish)."""
        if self._board is None:
            return
        if len(self._queue) >= self._maxsize:
            self._queue.popleft()
            self._dropped += 1
        self._queue.append(snapshot)
        self._wake()

    def get_nowait(self) -> StatusSnapshot | None:
        """The oldest queued snapshot, or None when none is queued; raises SubscriptionClosed once
        closed."""
        if self._board is None:
            raise SubscriptionClosed()
        if not self._queue:
            return None
        self._delivered += 1
        return self._queue.popleft()

    async def next(self) -> StatusSnapshot:
        """The oldest queued snapshot, waiting for a publish when none is queued."""
        if self._waiter is not None:
            raise BusyError(
                "another task is already waiting on this status subscription; it has one receiver "
                "at a time"
            )
        while (snapshot := self.get_nowait()) is None:
            # Deferred: the package is imported by the CLI, which must not pay for asyncio.
            import asyncio

            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                # The queue, not the future, holds the snapshots: a cancelled wait loses none.
                self._waiter = None
        return snapshot

    def close(self) -> None:
        """Unsubscribe (idempotent): discard what is queued and wake a waiting receiver."""
        board, self._board = self._board, None
        if board is not None:
            board.unsubscribe(self)
        self._queue.clear()
        self._wake()

    def statistics(self) -> SubscriptionStatistics:
        """Counts so far, as a frozen snapshot."""
        return SubscriptionStatistics(
            delivered=self._delivered,
            dropped=self._dropped,
            queued=len(self._queue),
            maxsize=self._maxsize,
            closed=self._board is None,
        )

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> StatusSnapshot:
        try:
            return await self.next()
        except SubscriptionClosed:
            raise StopAsyncIteration from None

    def __enter__(self) -> Subscription:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class StatusBoard:
    """Holds the latest published snapshot, pre-encoded, and the subscriptions to it.

    ``counters`` supplies the live connection counters (see the module's
    theory of operation); ``clock`` is the monotonic clock that ages them.
    """

    def __init__(
        self,
        *,
        counters: Callable[[], Counters] | None = None,
        counters_interval: float = COUNTERS_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._counters = counters
        self._interval = counters_interval
        self._clock = clock
        self._snapshot: StatusSnapshot | None = None
        self._encoded: bytes | None = None
        self._encoded_public: bytes | None = None
        self._encoded_at = -math.inf
        self._subscriptions: dict[Subscription, None] = {}  # a dict: ordered, O(1) removal
        self._published = 0
        self._encodes = 0

    def publish(self, snapshot: StatusSnapshot) -> None:
        """Make ``snapshot`` the served one (with the counters as of now) and offer it to every
        subscriber."""
        if self._counters is not None:
            snapshot = dataclasses.replace(snapshot, connections=self._counters())
        self._published += 1
        self._set(snapshot, self._clock())
        for subscription in self._subscriptions:
            subscription._offer(snapshot)

    def subscribe(self, maxsize: int = DEFAULT_MAXSIZE) -> Subscription:
        """Subscribe to every snapshot published from now on, keeping at most the newest
        ``maxsize``."""
        subscription = Subscription(self, maxsize=maxsize)
        self._subscriptions[subscription] = None
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        """Stop offering snapshots to ``subscription`` (idempotent; :meth:`Subscription.close` calls
        it)."""
        self._subscriptions.pop(subscription, None)

    @property
    def snapshot(self) -> StatusSnapshot | None:
        """The snapshot behind :attr:`encoded` (counters as of its last encode), or None before the
        first publish."""
        return self._snapshot

    @property
    def encoded(self) -> bytes | None:
        """The served JSON document, or None before the first publish; counters at most
        ``counters_interval`` old."""
        if self._counters is not None and self._snapshot is not None:
            now = self._clock()
            if now - self._encoded_at >= self._interval:
                self._refresh_counters(self._snapshot, self._counters(), now)
        return self._encoded

    def encoded_for(self, *, local: bool) -> bytes | None:
        """:attr:`encoded` for a client on the controller's own host; without the ranks' output
        lines for any other."""
        encoded = self.encoded  # refreshes the counters (both encodings) when due
        return encoded if local else self._encoded_public

    def statistics(self) -> BoardStatistics:
        """Counts so far, as a frozen snapshot."""
        return BoardStatistics(
            published=self._published, encodes=self._encodes, subscribers=len(self._subscriptions)
        )

    def _refresh_counters(self, current: StatusSnapshot, counters: Counters, now: float) -> None:
        if counters == current.connections:
            self._encoded_at = now  # unchanged: the bytes stand, look again an interval later
            return
        self._set(dataclasses.replace(current, connections=counters), now)

    def _set(self, snapshot: StatusSnapshot, now: float) -> None:
        self._snapshot = snapshot
        self._encoded = snapshot.to_json()
        # What clients on other hosts get: the ranks' output lines (which may carry secrets) left
        # out.
        self._encoded_public = (
            snapshot.without_output().to_json() if snapshot.quotes_output else self._encoded
        )
        self._encoded_at = now
        self._encodes += 1
