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

*Events.* The board is also where the run's event stream
(:mod:`flodl_async.status.events`) is recorded: every publish asks a
:class:`~flodl_async.status.events.Chronicle` what changed and records those
events; :meth:`StatusBoard.emit` records what a snapshot cannot say (rounds,
epochs, checkpoints). Each recorded event is stamped with the next id, kept in a
bounded history (``history``, for ``Last-Event-ID`` resumes and late joiners),
handed to the synchronous ``sinks`` (the metrics, which must see every event and
cost O(1) each) and offered to the event subscriptions. An event subscription
differs from a snapshot one in what a full queue means: a stream with a gap is a
lie, so a subscriber whose queue is full is *dropped* (closed, counted as
``overflowed``) and the publisher goes on — a slow client never slows the run.
A push consumer (the ``/events`` protocol, which has no task of its own) passes
``notify``, called after every offer, and drains with ``get_nowait``.

Everything here runs on the controller's event-loop thread.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
import typing
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from ..errors import BusyError, SubscriptionClosed
from .events import Chronicle, RunEvent, Stamped
from .metrics import RunMetrics
from .model import Counters, StatusSnapshot

if typing.TYPE_CHECKING:
    import asyncio

#: How old (seconds) the served counters may get while someone is reading them.
COUNTERS_INTERVAL = 0.5
#: A subscription's queue bound when the subscriber does not choose one.
DEFAULT_MAXSIZE = 16
#: Events the board keeps for resumes (``Last-Event-ID``) and for late joiners.
DEFAULT_HISTORY = 4096
#: An event subscription's queue bound: a burst of this many unread events drops the subscriber.
EVENT_MAXSIZE = 1024

T = typing.TypeVar("T")


class Overflow(enum.Enum):
    """What a full subscription queue does with one more item."""

    #: Drop the oldest queued item (snapshots: only the latest state matters).
    DROP_OLDEST = "drop oldest"
    #: Close the subscription (events: a stream with a gap would mislead its reader).
    CLOSE = "close"


@dataclass(frozen=True, slots=True, kw_only=True)
class SubscriptionStatistics:
    """What one subscription has seen: snapshots handed out, dropped as the oldest of a full queue,
    still queued."""

    delivered: int
    dropped: int
    queued: int
    maxsize: int
    closed: bool
    #: Closed because its queue was full (an event subscription whose reader fell behind).
    overflowed: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class BoardStatistics:
    """What the board has done: snapshots published, JSON encodes (publishes plus counter
    refreshes), live subscriptions."""

    published: int
    encodes: int
    subscribers: int
    #: Events recorded so far (the last one's id), and live event subscriptions.
    events: int = 0
    event_subscribers: int = 0


class Subscription(typing.Generic[T]):
    """The snapshots (or events) published on a board from the moment of subscribing, in a bounded
    queue.

    Receive with ``await sub.next()`` or ``async for snapshot in sub``; one
    receiver at a time (a second concurrent one raises
    :class:`~flodl_async.errors.BusyError`). :meth:`close` (or leaving
    ``with``/``async with``) unsubscribes: queued snapshots are discarded, a
    waiting receiver wakes, ``next()`` raises
    :class:`~flodl_async.errors.SubscriptionClosed` and ``async for`` ends.
    Made by :meth:`StatusBoard.subscribe`.
    """

    def __init__(
        self,
        board: StatusBoard,
        *,
        maxsize: int,
        overflow: Overflow = Overflow.DROP_OLDEST,
        notify: Callable[[], None] | None = None,
    ) -> None:
        if maxsize < 1:
            raise ValueError(f"a subscription holds at least one item (maxsize={maxsize})")
        self._board: StatusBoard | None = board
        self._queue: deque[T] = deque()
        self._maxsize = maxsize
        self._overflow = overflow
        self._notify = notify
        self._waiter: asyncio.Future[None] | None = None
        self._delivered = 0
        self._dropped = 0
        self._overflowed = False

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._board is None

    def _offer(self, item: T) -> None:
        """Queue ``item``; when full, drop the oldest or close, as the overflow policy says (the
        board calls this on publish)."""
        if self._board is None:
            return
        if len(self._queue) >= self._maxsize:
            self._dropped += 1
            if self._overflow is Overflow.CLOSE:
                self._overflowed = True
                self.close()
                return
            self._queue.popleft()
        self._queue.append(item)
        self._wake()

    def get_nowait(self) -> T | None:
        """The oldest queued snapshot, or None when none is queued; raises SubscriptionClosed once
        closed."""
        if self._board is None:
            raise SubscriptionClosed()
        if not self._queue:
            return None
        self._delivered += 1
        return self._queue.popleft()

    async def next(self) -> T:
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
            overflowed=self._overflowed,
        )

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self._notify is not None:
            self._notify()

    def __aiter__(self) -> Subscription[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return await self.next()
        except SubscriptionClosed:
            raise StopAsyncIteration from None

    def __enter__(self) -> Subscription[T]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Subscription[T]:
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
        history: int = DEFAULT_HISTORY,
        sinks: tuple[Callable[[Stamped], None], ...] = (),
    ) -> None:
        self._counters = counters
        self._interval = counters_interval
        self._clock = clock
        self._snapshot: StatusSnapshot | None = None
        self._encoded: bytes | None = None
        self._encoded_public: bytes | None = None
        self._encoded_at = -math.inf
        # dicts: ordered, O(1) removal
        self._subscriptions: dict[Subscription[StatusSnapshot], None] = {}
        self._event_subscriptions: dict[Subscription[Stamped], None] = {}
        self._published = 0
        self._encodes = 0
        self._chronicle = Chronicle()
        self._history: deque[Stamped] = deque(maxlen=history)
        #: ``/metrics``' accumulators: the first sink of every event.
        self.metrics = RunMetrics()
        self._sinks = [self.metrics.observe, *sinks]
        self._last_id = 0

    def publish(self, snapshot: StatusSnapshot) -> None:
        """Make ``snapshot`` the served one (with the counters as of now) and offer it to every
        subscriber."""
        if self._counters is not None:
            snapshot = dataclasses.replace(snapshot, connections=self._counters())
        self._published += 1
        self._set(snapshot, self._clock())
        for subscription in list(self._subscriptions):
            subscription._offer(snapshot)
        for event in self._chronicle.after_snapshot(snapshot):
            self._record(event, snapshot.updated_at)

    def emit(self, event: RunEvent, *, at: float | None = None) -> None:
        """Record an event no snapshot carries (a round, an epoch, a checkpoint); ``at``: its wall
        time (default: now)."""
        when = time.time() if at is None else at
        self._record(event, when)
        for follow_up in self._chronicle.after_event(event, when):
            self._record(follow_up, when)

    def add_sink(self, sink: Callable[[Stamped], None]) -> None:
        """Call ``sink`` with every event recorded from now on, synchronously (it must be cheap)."""
        self._sinks.append(sink)

    def subscribe(
        self, maxsize: int = DEFAULT_MAXSIZE, *, notify: Callable[[], None] | None = None
    ) -> Subscription[StatusSnapshot]:
        """Subscribe to every snapshot published from now on, keeping at most the newest
        ``maxsize``."""
        subscription: Subscription[StatusSnapshot] = Subscription(
            self, maxsize=maxsize, notify=notify
        )
        self._subscriptions[subscription] = None
        return subscription

    def subscribe_events(
        self, *, maxsize: int = EVENT_MAXSIZE, notify: Callable[[], None] | None = None
    ) -> Subscription[Stamped]:
        """Subscribe to the events recorded from now on (what came before: :meth:`events_after`).
        A subscriber that lets ``maxsize`` events pile up is dropped (see the module)."""
        subscription: Subscription[Stamped] = Subscription(
            self, maxsize=maxsize, overflow=Overflow.CLOSE, notify=notify
        )
        self._event_subscriptions[subscription] = None
        return subscription

    def events_after(self, after: int) -> tuple[Stamped, ...]:
        """The recorded events whose id is above ``after`` that the history still holds."""
        return tuple(s for s in self._history if s.id > after)

    @property
    def last_event_id(self) -> int:
        """The id of the last event recorded (0 before any)."""
        return self._last_id

    def unsubscribe(self, subscription: Subscription[typing.Any]) -> None:
        """Stop offering to ``subscription`` (idempotent; :meth:`Subscription.close` calls it)."""
        self._subscriptions.pop(subscription, None)
        self._event_subscriptions.pop(subscription, None)

    def _record(self, event: RunEvent, at: float) -> None:
        self._last_id += 1
        stamped = Stamped(id=self._last_id, at=at, event=event)
        self._history.append(stamped)
        for sink in self._sinks:
            sink(stamped)
        for subscription in list(self._event_subscriptions):
            subscription._offer(stamped)

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
            published=self._published,
            encodes=self._encodes,
            subscribers=len(self._subscriptions),
            events=self._last_id,
            event_subscribers=len(self._event_subscriptions),
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
