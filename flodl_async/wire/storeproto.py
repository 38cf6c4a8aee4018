"""The c10d TCPStore wire protocol, server side, sans-IO.

Theory of operation. ``torch.distributed`` ranks rendezvous through a
TCPStore. Serving it from the agent's own event loop, in Python, means the
store host never imports torch (about 2 s of CPU on the critical path, on a
machine whose cores the ranks need for their own import) and needs no extra
process. The protocol is torch's: every request starts with a one-byte query
type; integers are little-endian, strings and byte values are a u64 length
followed by the bytes. A connection must open with ``VALIDATE`` and the magic
number before anything else is accepted.

:class:`StoreState` holds the keys, queues and waiters of one store;
:class:`StoreConnection` parses one client's byte stream and applies complete
requests to the state. Replies are returned as ``(connection, bytes)`` pairs
because a ``SET`` on one connection can wake a ``WAIT`` on another.

Bounds. Torch's rendezvous needs kilobytes, so a store's memory has two budgets
(:class:`StoreLimits`): what it holds for its clients — keys, values, queued
items, registered waits and the requests still arriving, each entry charged
:data:`ENTRY_OVERHEAD` for the Python objects around it — and the replies its
clients have not read yet (the shell reports those, :meth:`StoreState.owe`).
No value may grow past ``max_value``, ``APPEND`` included. A request that would
break a bound raises :class:`StoreLimitExceeded` before it changes anything
(a ``MULTI_SET`` is applied whole or not at all), so a refused client leaves
the other keys as they were. While a request is applied its bytes count twice,
as arriving and as stored, since both copies exist then: six values of 8 MiB
fit the default budget, not seven. Lengths are checked as soon as their header
arrives, before the bytes they announce are buffered.

Incomplete requests. A request that is not whole yet is *framed*: its length
fields are walked without copying, and the walk resumes where it stopped when
more bytes come, so a client that dribbles a request byte by byte costs linear
time, and the request is parsed once, when it is complete. Complete requests
take the direct path.

Flow control. One call answers requests until :data:`REPLY_BATCH` reply bytes
are owed to the caller's client, and holds the rest back
(:attr:`StoreConnection.wants_more`): the shell asks again once its transport
has room, so a client pipelining ``GET`` s it never reads cannot make replies
faster than it takes them. A bad request after some replies were made lets
those replies out (other clients' wake-ups among them) and raises on the next
call; a connection that failed stays failed.
"""

from __future__ import annotations

import collections
import enum
import struct
from dataclasses import dataclass

from ..errors import ConfigError
from ..errors import StoreLimitExceeded as StoreLimitExceeded  # noqa: PLC0414

# Re-exported: the store's callers import it from here, next to the protocol it guards. The
# redundant alias is mypy --strict's explicit re-export form, which ruff's PLC0414 does not know.
from ..errors import StoreProtocolError as StoreProtocolError  # noqa: PLC0414

VALIDATION_MAGIC = 0x3C85F7CE
MAX_KEY_LEN = 8 * 1024
MAX_VALUE_LEN = 8 * 1024 * 1024
MAX_KEY_COUNT = 128 * 1024
#: Bytes charged per stored key, queued item or registered wait on top of its own: what the dict
#: slot, the str and bytes objects and the list entry around it cost (about 130 bytes in CPython).
ENTRY_OVERHEAD = 128
#: Reply bytes one :meth:`StoreConnection.receive_data` call makes for its own client before it
#: holds the remaining requests back (the shell asks again when its transport has room).
REPLY_BATCH = 64 * 1024
#: From this size on a value is copied out of the buffer through a memoryview.
_COPY_ONCE = 64 * 1024
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreLimits:
    """A store's bounds.

    Why these defaults. A run's rendezvous (torch's ``init_process_group``, gloo's and NCCL's
    ids, a barrier or two) stores kilobytes; 64 MiB leaves three orders of magnitude for
    applications that put their own small objects in the store, while keeping what a broken or
    hostile client can make the controller hold to a fraction of a rank's own memory. 8 MiB per
    value is what the store accepted before it had a budget.
    """

    #: Keys, values, queued items, waits and requests arriving, in all; unsent replies the same
    #: again.
    max_bytes: int = 64 * 1024 * 1024
    #: One value, after an APPEND too.
    max_value: int = MAX_VALUE_LEN

    def __post_init__(self) -> None:
        if not 1 <= self.max_value <= self.max_bytes:
            raise ConfigError(
                f"store limits: need 1 <= the value limit ({self.max_value}) <= the store's byte "
                f"budget ({self.max_bytes})"
            )


class Query(enum.IntEnum):
    """Request types, in torch's order (the byte values are the protocol)."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16


#: By byte value: a tuple index is quicker than the enum's own lookup, and this runs per request.
_QUERIES = tuple(Query)
CHECK_READY, CHECK_NOT_READY = b"\x00", b"\x01"
STOP_WAITING, WAIT_CANCELED = b"\x00", b"\x01"


class _Incomplete(Exception):
    """Not enough bytes yet for the whole request."""


def _vector(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


Reply = tuple["StoreConnection", bytes]

# Field kinds of the framer (see the module's theory of operation): a fixed run of bytes, one
# length-prefixed key or value, a count of keys or of (key, value) pairs, one such pair.
_RAW, _KEY, _VALUE, _KEYS, _PAIRS, _PAIR = range(6)
#: What a length or count field announces: the bytes of a key or value, keys, (key, value) pairs.
_INNER = {_KEY: _RAW, _VALUE: _RAW, _KEYS: _KEY, _PAIRS: _PAIR}
_LAYOUT: dict[Query, tuple[tuple[int, int], ...]] = {
    Query.VALIDATE: ((_RAW, 4),),
    Query.SET: ((_KEY, 1), (_VALUE, 1)),
    Query.COMPARE_SET: ((_KEY, 1), (_VALUE, 1), (_VALUE, 1)),
    Query.GET: ((_KEY, 1),),
    Query.ADD: ((_KEY, 1), (_RAW, 8)),
    Query.CHECK: ((_KEYS, 1),),
    Query.WAIT: ((_KEYS, 1),),
    Query.GETNUMKEYS: (),
    Query.DELETE_KEY: ((_KEY, 1),),
    Query.APPEND: ((_KEY, 1), (_VALUE, 1)),
    Query.MULTI_GET: ((_KEYS, 1),),
    Query.MULTI_SET: ((_PAIRS, 1),),
    Query.CANCEL_WAIT: (),
    Query.PING: ((_RAW, 4),),
    Query.QUEUE_PUSH: ((_KEY, 1), (_VALUE, 1)),
    Query.QUEUE_POP: ((_KEY, 1),),
    Query.QUEUE_LEN: ((_KEY, 1),),
}


def _entry(key: str, value: bytes) -> int:
    return len(key) + len(value) + ENTRY_OVERHEAD


class StoreState:
    """Keys, queues and waiting clients of one store, and what they cost against its limits."""

    def __init__(self, limits: StoreLimits | None = None) -> None:
        self.limits = limits or StoreLimits()
        self._max_bytes = self.limits.max_bytes
        self.data: dict[str, bytes] = {}
        self.queues: dict[str, collections.deque[bytes]] = {}
        self._waiting: dict[str, list[StoreConnection]] = {}
        self._awaited: dict[StoreConnection, int] = {}
        self._registered: dict[StoreConnection, list[str]] = {}
        self._held = 0
        self._buffered = 0
        self._owed: dict[StoreConnection, int] = {}
        self._owed_total = 0

    @property
    def held(self) -> int:
        """Bytes charged to the store now: entries, waits and requests arriving."""
        return self._held + self._buffered

    @property
    def owed(self) -> int:
        """Reply bytes the clients have not read yet (as the shell last reported them)."""
        return self._owed_total

    def owe(self, conn: StoreConnection, nbytes: int) -> None:
        """The shell's transport of ``conn`` now holds ``nbytes`` unsent; raises if all the
        clients together hold more than the budget."""
        self._owed_total += nbytes - self._owed.pop(conn, 0)
        if nbytes:
            self._owed[conn] = nbytes
        if self._owed_total > self.limits.max_bytes:
            raise StoreLimitExceeded(
                f"the client does not read its replies: {nbytes} bytes wait for it, "
                f"{self._owed_total} for every client (at most {self.limits.max_bytes})"
            )

    def _charge(self, delta: int, what: str, *args: object) -> None:
        # ``what % args`` is formatted only for a refusal: this runs on every SET
        if delta > 0 and self._held + self._buffered + delta > self._max_bytes:
            raise StoreLimitExceeded(
                f"{what % args} would take the store to {self.held + delta} bytes (its budget is "
                f"{self._max_bytes}; it holds {self.held})"
            )
        self._held += delta

    def _buffer(self, nbytes: int) -> None:
        self._buffered += nbytes
        if nbytes > 0 and self.held > self.limits.max_bytes:
            raise StoreLimitExceeded(
                f"the client's requests would take the store to {self.held} bytes (its budget "
                f"is {self.limits.max_bytes})"
            )

    def _has(self, key: str) -> bool:
        return key in self.data or bool(self.queues.get(key))

    def set(self, key: str, value: bytes) -> list[Reply]:
        old = self.data.get(key)
        self._charge(
            len(value) - len(old) if old is not None else len(key) + len(value) + ENTRY_OVERHEAD,
            "setting %r",
            key,
        )
        self.data[key] = value
        return self._wake_all(key) if key in self._waiting else []

    def set_many(self, pairs: list[tuple[str, bytes]]) -> list[Reply]:
        last = dict(pairs)  # a key set twice in one request holds its last value
        delta = sum(
            _entry(key, value) - (_entry(key, self.data[key]) if key in self.data else 0)
            for key, value in last.items()
        )
        self._charge(delta, "a MULTI_SET of %d keys", len(pairs))  # all of it, or nothing
        self.data.update(last)
        replies: list[Reply] = []
        for key in last:
            replies.extend(self._wake_all(key))
        return replies

    def delete(self, key: str) -> bool:
        old = self.data.pop(key, None)
        if old is None:
            return False
        self._held -= _entry(key, old)
        return True

    def wait(self, conn: StoreConnection, keys: list[str]) -> list[Reply]:
        if all(self._has(k) for k in keys):
            return [(conn, STOP_WAITING)]
        missing = [k for k in keys if k not in self.data]
        self._charge(sum(len(k) + ENTRY_OVERHEAD for k in missing), "a WAIT on %d keys", len(keys))
        for key in missing:
            self._waiting.setdefault(key, []).append(conn)
        self._registered.setdefault(conn, []).extend(missing)
        self._awaited[conn] = len(missing)
        return []

    def cancel_wait(self, conn: StoreConnection) -> None:
        self._awaited.pop(conn, None)
        for key in self._registered.pop(conn, ()):
            waiters = self._waiting.get(key)
            if waiters is not None and conn in waiters:
                waiters.remove(conn)
                self._held -= len(key) + ENTRY_OVERHEAD
                if not waiters:
                    del self._waiting[key]

    def _woken(self, conn: StoreConnection, key: str) -> bool:
        self._held -= len(key) + ENTRY_OVERHEAD
        left = self._awaited.get(conn, 0) - 1
        self._awaited[conn] = left
        if left:
            return False
        del self._awaited[conn]
        self._registered.pop(conn, None)
        return True

    def _wake_all(self, key: str) -> list[Reply]:
        if key not in self._waiting:
            return []
        return [(conn, STOP_WAITING) for conn in self._waiting.pop(key) if self._woken(conn, key)]

    def _wake_one(self, key: str) -> list[Reply]:
        waiters = self._waiting.get(key, [])
        for conn in waiters:
            if self._awaited.get(conn, 0) == 1:
                waiters.remove(conn)
                if not waiters:
                    del self._waiting[key]
                self._woken(conn, key)
                return [(conn, STOP_WAITING)]
        return []

    def queue_push(self, key: str, value: bytes) -> list[Reply]:
        self._charge(_entry(key, value), "a QUEUE_PUSH on %r", key)
        self.queues.setdefault(key, collections.deque()).append(value)
        return self._wake_one(key)

    def queue_pop(self, key: str) -> tuple[int, bytes | None]:
        """The queue's length before the pop, and its first item (None: the queue is empty)."""
        queue = self.queues.get(key)
        if not queue:
            return 0, None
        size = len(queue)
        value = queue.popleft()
        if not queue:
            del self.queues[key]  # an empty queue is no queue: QUEUE_LEN and CHECK say the same
        self._held -= _entry(key, value)
        return size, value

    def add(self, key: str, delta: int) -> tuple[int, list[Reply]]:
        try:
            total = delta + int(self.data.get(key, b"0"))
        except ValueError:
            raise StoreProtocolError(f"ADD on key {key!r} whose value is not an integer") from None
        if not _INT64_MIN <= total <= _INT64_MAX:
            raise StoreProtocolError(
                f"ADD of {delta} on key {key!r} overflows a 64-bit integer ({total})"
            )
        return total, self.set(key, str(total).encode())

    def append(self, key: str, value: bytes) -> list[Reply]:
        old = self.data.get(key, b"")
        if len(old) + len(value) > self.limits.max_value:
            raise StoreLimitExceeded(
                f"APPEND would make key {key!r} {len(old) + len(value)} bytes (at most "
                f"{self.limits.max_value} a value)"
            )
        return self.set(key, old + value)

    def multi_get(self, keys: list[str]) -> bytes:
        size = sum(8 + len(self.data.get(k, b"")) for k in keys)
        if size > self.limits.max_bytes:  # checked before the reply exists: keys may repeat
            raise StoreLimitExceeded(
                f"a MULTI_GET of {len(keys)} keys would make a reply of {size} bytes (at most "
                f"{self.limits.max_bytes})"
            )
        return b"".join(_vector(self.data.get(k, b"")) for k in keys)

    def _release(self, conn: StoreConnection, buffered: int) -> None:
        self._buffered -= buffered
        self.cancel_wait(conn)
        self._owed_total -= self._owed.pop(conn, 0)


class StoreConnection:
    """One client connection: feed it bytes, get replies (possibly for other connections)."""

    def __init__(self, state: StoreState) -> None:
        self._state = state
        self._max_value = state.limits.max_value
        self._buf = bytearray()
        self._pos = 0
        self._validated = False
        #: The framer's walk over an incomplete request: a stack of (kind, times), and where it is.
        self._todo: list[list[int]] | None = None
        self._scan = 0
        #: Buffer length before which nothing can progress.
        self._need = 0
        self._more = False
        self._error: StoreProtocolError | None = None
        self._raised = False
        self._closed = False

    def receive_data(self, data: bytes) -> list[Reply]:
        """Apply the complete requests in ``data`` (plus what was buffered); raises on bad input.

        At most about :data:`REPLY_BATCH` reply bytes for this client per call: the rest waits
        (:attr:`wants_more`) for a call with ``b""``.
        """
        if self._error is not None:
            self._raised = True
            raise self._error
        replies: list[Reply] = []
        try:
            if data:
                self._buf += data
                self._state._buffer(len(data))
            self._serve(replies)
        except StoreProtocolError as exc:
            self._fail(exc)
            if not replies:
                self._raised = True
                raise
        return replies

    @property
    def validated(self) -> bool:
        """True once the client's VALIDATE arrived: it speaks torch's store protocol."""
        return self._validated

    @property
    def wants_more(self) -> bool:
        """True while ``receive_data(b"")`` has something to do: requests held back for flow
        control, or an error to raise."""
        return self._more or (self._error is not None and not self._raised)

    @property
    def buffered(self) -> int:
        """Bytes received and not yet applied."""
        return len(self._buf)

    def closed(self) -> None:
        """The client went away: forget its waits, and give back what it was charged.
        Idempotent."""
        if not self._closed:
            self._closed = True
            self._state._release(self, len(self._buf))
            self._buf = bytearray()

    def _fail(self, exc: StoreProtocolError) -> None:
        # A copy without the traceback: its frames hold this connection and its buffer, a cycle
        # that would keep megabytes alive until the cyclic collector happens to run.
        self._error = type(exc)(*exc.args)
        self._more = False
        self._todo = None
        self._state._buffered -= len(self._buf)  # nothing more of it is ever parsed
        self._buf = bytearray()

    def _serve(self, replies: list[Reply]) -> None:
        owed = 0
        buf = self._buf
        while buf and owed < REPLY_BATCH:
            if len(buf) < self._need:
                break
            if self._todo is not None and not self._frame():
                break
            self._pos = 0
            try:
                out = self._one_request()
            except _Incomplete:
                self._start_framing()
                if not self._frame():
                    break
                continue  # whole now: the direct path parses it
            self._todo = None
            self._need = 0
            del buf[: self._pos]
            self._state._buffered -= self._pos
            for conn, payload in out:
                if conn is self:
                    owed += len(payload)
            replies.extend(out)
        self._more = bool(buf) and owed >= REPLY_BATCH

    # ----- framing an incomplete request ----------------------------------------------------

    def _start_framing(self) -> None:
        query = self._query(self._buf[0])
        self._todo = [[kind, times] for kind, times in reversed(_LAYOUT[query])]
        self._scan = 1

    def _frame(self) -> bool:
        """Walk the incomplete request's length fields from where the walk stopped; True once
        the buffer holds all of it."""
        todo = self._todo
        assert todo is not None
        buf, scan, have = self._buf, self._scan, len(self._buf)
        limits = self._state.limits
        while todo:
            top = todo[-1]
            kind = top[0]
            if kind == _PAIR:
                top[1] -= 1
                if not top[1]:
                    todo.pop()
                todo += [[_VALUE, 1], [_KEY, 1]]
                continue
            size = top[1] if kind == _RAW else 8
            if scan + size > have:
                self._scan, self._need = scan, scan + size
                return False
            if kind == _RAW:
                scan += size
                todo.pop()
                continue
            n = int(_U64.unpack_from(buf, scan)[0])
            scan += 8
            top[1] -= 1
            if not top[1]:
                todo.pop()
            if kind == _KEY:
                n = _check_key(n)
            elif kind == _VALUE:
                n = _check_value(n, limits)
            else:
                n = _check_count(n)
            if n:
                todo.append([_INNER[kind], n])
        self._scan, self._need = scan, 0
        return True

    # ----- parsing helpers ---------------------------------------------------------------

    def _take(self, n: int) -> bytes:
        end = self._pos + n
        if end > len(self._buf):
            raise _Incomplete
        if n < _COPY_ONCE:
            chunk = bytes(self._buf[self._pos : end])
        else:  # a slice of a bytearray is a copy of its own: a big value is copied once, not twice
            with memoryview(self._buf) as view:
                chunk = bytes(view[self._pos : end])
        self._pos = end
        return chunk

    def _u64(self) -> int:
        return int(_U64.unpack(self._take(8))[0])

    def _key(self) -> str:
        size = self._u64()
        if size > MAX_KEY_LEN:
            _check_key(size)
        return self._take(size).decode("utf-8", "surrogateescape")

    def _value(self) -> bytes:
        size = self._u64()
        if size > self._max_value:
            _check_value(size, self._state.limits)
        return self._take(size)

    def _keys(self) -> list[str]:
        return [self._key() for _ in range(_check_count(self._u64()))]

    def _query(self, raw: int) -> Query:
        if raw >= len(_QUERIES):
            raise StoreProtocolError(f"unknown store query type {raw}")
        query = _QUERIES[raw]
        if not self._validated and query is not Query.VALIDATE:
            raise StoreProtocolError(
                "the first request was not a valid VALIDATE (not a torch TCPStore client)"
            )
        return query

    # ----- requests ------------------------------------------------------------------------

    def _one_request(self) -> list[Reply]:  # noqa: C901 — one branch per query type, as the protocol lists them
        query = self._query(self._take(1)[0])
        state = self._state
        if not self._validated:
            if _U32.unpack(self._take(4))[0] != VALIDATION_MAGIC:
                raise StoreProtocolError(
                    "the first request was not a valid VALIDATE (not a torch TCPStore client)"
                )
            self._validated = True
            return []
        if query is Query.VALIDATE:
            self._take(4)
            return []
        if query is Query.PING:
            return [(self, self._take(4))]
        if query is Query.SET:
            key, value = self._key(), self._value()
            return state.set(key, value)
        if query is Query.COMPARE_SET:
            key, expected, new = self._key(), self._value(), self._value()
            current = state.data.get(key)
            if current is None:
                if expected:
                    return [(self, _vector(expected)), *state._wake_all(key)]
                return [(self, _vector(new)), *state.set(key, new)]
            woken = state.set(key, new) if current == expected else state._wake_all(key)
            return [(self, _vector(state.data[key])), *woken]
        if query is Query.GET:
            return [(self, _vector(state.data.get(self._key(), b"")))]
        if query is Query.ADD:
            key = self._key()
            total, woken = state.add(key, int(_I64.unpack(self._take(8))[0]))
            return [(self, _I64.pack(total)), *woken]
        if query is Query.CHECK:
            ready = all(state._has(k) for k in self._keys())
            return [(self, CHECK_READY if ready else CHECK_NOT_READY)]
        if query is Query.WAIT:
            return state.wait(self, self._keys())
        if query is Query.GETNUMKEYS:
            return [(self, _I64.pack(len(state.data)))]
        if query is Query.DELETE_KEY:
            return [(self, _I64.pack(1 if state.delete(self._key()) else 0))]
        if query is Query.APPEND:
            key, value = self._key(), self._value()
            return state.append(key, value)
        if query is Query.MULTI_GET:
            return [(self, state.multi_get(self._keys()))]
        if query is Query.MULTI_SET:
            count = _check_count(self._u64())
            return state.set_many([(self._key(), self._value()) for _ in range(count)])
        if query is Query.CANCEL_WAIT:
            state.cancel_wait(self)
            return [(self, WAIT_CANCELED)]
        if query is Query.QUEUE_PUSH:
            key, value = self._key(), self._value()
            return state.queue_push(key, value)
        if query is Query.QUEUE_POP:
            size, popped = state.queue_pop(self._key())
            if popped is None:
                return [(self, _I64.pack(0))]
            return [(self, _I64.pack(size) + _vector(popped))]
        assert query is Query.QUEUE_LEN
        return [(self, _I64.pack(len(state.queues.get(self._key(), ()))))]


def _check_key(size: int) -> int:
    if size > MAX_KEY_LEN:
        raise StoreProtocolError(f"key of {size} bytes (at most {MAX_KEY_LEN})")
    return size


def _check_value(size: int, limits: StoreLimits) -> int:
    if size > limits.max_value:
        raise StoreLimitExceeded(f"value of {size} bytes (at most {limits.max_value})")
    return size


def _check_count(count: int) -> int:
    if count > MAX_KEY_COUNT:
        raise StoreProtocolError(f"{count} keys in one request (at most {MAX_KEY_COUNT})")
    return count
