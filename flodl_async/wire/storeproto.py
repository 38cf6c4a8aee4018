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
"""

from __future__ import annotations

import collections
import enum
import struct

# Re-exported: the store's callers import it from here, next to the protocol it guards. The
# redundant alias is mypy --strict's explicit re-export form, which ruff's PLC0414 does not know.
from ..errors import StoreProtocolError as StoreProtocolError  # noqa: PLC0414

VALIDATION_MAGIC = 0x3C85F7CE
MAX_KEY_LEN = 8 * 1024
MAX_VALUE_LEN = 8 * 1024 * 1024
MAX_KEY_COUNT = 128 * 1024

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


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


CHECK_READY, CHECK_NOT_READY = b"\x00", b"\x01"
STOP_WAITING, WAIT_CANCELED = b"\x00", b"\x01"


class _Incomplete(Exception):
    """Not enough bytes yet for the whole request."""


def _vector(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


Reply = tuple["StoreConnection", bytes]


class StoreState:
    """Keys, queues and waiting clients of one store."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.queues: dict[str, collections.deque[bytes]] = {}
        self._waiting: dict[str, list[StoreConnection]] = {}
        self._awaited: dict[StoreConnection, int] = {}

    def _has(self, key: str) -> bool:
        return key in self.data or bool(self.queues.get(key))

    def set(self, key: str, value: bytes) -> list[Reply]:
        self.data[key] = value
        return self._wake_all(key)

    def wait(self, conn: StoreConnection, keys: list[str]) -> list[Reply]:
        if all(self._has(k) for k in keys):
            return [(conn, STOP_WAITING)]
        missing = [k for k in keys if k not in self.data]
        for key in missing:
            self._waiting.setdefault(key, []).append(conn)
        self._awaited[conn] = len(missing)
        return []

    def cancel_wait(self, conn: StoreConnection) -> None:
        if self._awaited.pop(conn, None) is None:
            return
        for key in list(self._waiting):
            self._waiting[key] = [c for c in self._waiting[key] if c is not conn]
            if not self._waiting[key]:
                del self._waiting[key]

    def _wake_all(self, key: str) -> list[Reply]:
        replies: list[Reply] = []
        for conn in self._waiting.pop(key, []):
            left = self._awaited.get(conn, 0) - 1
            self._awaited[conn] = left
            if left == 0:
                del self._awaited[conn]
                replies.append((conn, STOP_WAITING))
        return replies

    def _wake_one(self, key: str) -> list[Reply]:
        for conn in self._waiting.get(key, []):
            left = self._awaited.get(conn, 0) - 1
            self._awaited[conn] = left
            if left == 0:
                del self._awaited[conn]
                self._waiting[key].remove(conn)
                return [(conn, STOP_WAITING)]
        return []

    def queue_push(self, key: str, value: bytes) -> list[Reply]:
        self.queues.setdefault(key, collections.deque()).append(value)
        return self._wake_one(key)


class StoreConnection:
    """One client connection: feed it bytes, get replies (possibly for other connections)."""

    def __init__(self, state: StoreState) -> None:
        self._state = state
        self._buf = bytearray()
        self._pos = 0
        self._validated = False

    def receive_data(self, data: bytes) -> list[Reply]:
        """Apply every complete request in ``data`` (plus what was buffered); raises on bad
        input."""
        self._buf += data
        replies: list[Reply] = []
        while self._buf:
            self._pos = 0
            try:
                replies.extend(self._one_request())
            except _Incomplete:
                break
            del self._buf[: self._pos]
        return replies

    @property
    def validated(self) -> bool:
        """True once the client's VALIDATE arrived: it speaks torch's store protocol."""
        return self._validated

    def closed(self) -> None:
        """The client went away: forget its waits."""
        self._state.cancel_wait(self)

    # ----- parsing helpers ---------------------------------------------------------------

    def _take(self, n: int) -> bytes:
        end = self._pos + n
        if end > len(self._buf):
            raise _Incomplete
        chunk = bytes(self._buf[self._pos : end])
        self._pos = end
        return chunk

    def _u64(self) -> int:
        return int(_U64.unpack(self._take(8))[0])

    def _key(self) -> str:
        size = self._u64()
        if size > MAX_KEY_LEN:
            raise StoreProtocolError(f"key of {size} bytes (at most {MAX_KEY_LEN})")
        return self._take(size).decode("utf-8", "surrogateescape")

    def _value(self) -> bytes:
        size = self._u64()
        if size > MAX_VALUE_LEN:
            raise StoreProtocolError(f"value of {size} bytes (at most {MAX_VALUE_LEN})")
        return self._take(size)

    def _keys(self) -> list[str]:
        count = self._u64()
        if count > MAX_KEY_COUNT:
            raise StoreProtocolError(f"{count} keys in one request (at most {MAX_KEY_COUNT})")
        return [self._key() for _ in range(count)]

    # ----- requests ------------------------------------------------------------------------

    def _one_request(self) -> list[Reply]:  # noqa: C901, PLR0915 — one branch per query type, as the protocol lists them
        raw = self._take(1)[0]
        try:
            query = Query(raw)
        except ValueError:
            raise StoreProtocolError(f"unknown store query type {raw}") from None
        state = self._state
        if not self._validated:
            if query is not Query.VALIDATE or _U32.unpack(self._take(4))[0] != VALIDATION_MAGIC:
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
            if current == expected:
                state.data[key] = new
            return [(self, _vector(state.data[key])), *state._wake_all(key)]
        if query is Query.GET:
            return [(self, _vector(state.data.get(self._key(), b"")))]
        if query is Query.ADD:
            key = self._key()
            delta = int(_I64.unpack(self._take(8))[0])
            try:
                total = delta + int(state.data.get(key, b"0"))
            except ValueError:
                raise StoreProtocolError(
                    f"ADD on key {key!r} whose value is not an integer"
                ) from None
            return [(self, _I64.pack(total)), *state.set(key, str(total).encode())]
        if query is Query.CHECK:
            ready = all(state._has(k) for k in self._keys())
            return [(self, CHECK_READY if ready else CHECK_NOT_READY)]
        if query is Query.WAIT:
            return state.wait(self, self._keys())
        if query is Query.GETNUMKEYS:
            return [(self, _I64.pack(len(state.data)))]
        if query is Query.DELETE_KEY:
            return [(self, _I64.pack(1 if state.data.pop(self._key(), None) is not None else 0))]
        if query is Query.APPEND:
            key, value = self._key(), self._value()
            return state.set(key, state.data.get(key, b"") + value)
        if query is Query.MULTI_GET:
            keys = self._keys()
            return [(self, b"".join(_vector(state.data.get(k, b"")) for k in keys))]
        if query is Query.MULTI_SET:
            count = self._u64()
            if count > MAX_KEY_COUNT:
                raise StoreProtocolError(f"{count} keys in one request (at most {MAX_KEY_COUNT})")
            pairs = [(self._key(), self._value()) for _ in range(count)]
            replies: list[Reply] = []
            for key, value in pairs:
                replies.extend(state.set(key, value))
            return replies
        if query is Query.CANCEL_WAIT:
            state.cancel_wait(self)
            return [(self, WAIT_CANCELED)]
        if query is Query.QUEUE_PUSH:
            key, value = self._key(), self._value()
            return state.queue_push(key, value)
        if query is Query.QUEUE_POP:
            queue = state.queues.setdefault(self._key(), collections.deque())
            if not queue:
                return [(self, _I64.pack(0))]
            size = len(queue)
            return [(self, _I64.pack(size) + _vector(queue.popleft()))]
        assert query is Query.QUEUE_LEN
        return [(self, _I64.pack(len(state.queues.get(self._key(), ()))))]
