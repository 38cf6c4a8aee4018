"""Authenticated frames, sans-IO: bytes in, frames out; messages in, bytes out.

Theory of operation. After the channel magic, a connection carries frames::

    header  (24 bytes, little-endian)
        u8  protocol version
        u8  flags (reserved, must be 0)
        u16 message kind
        u64 sequence number (0, 1, 2, ... per direction)
        u32 body length      (msgpack map; capped by the channel's body ceiling)
        u64 payload length   (raw tensor bytes; capped by the payload ceiling, 0 on most channels)
    body     msgpack
    payload  raw contiguous bytes (tensors), outside msgpack so they are never copied by it
    tag      HMAC-SHA256 over header || body || payload, 32 bytes

Keys are derived per run, channel and direction from the session secret
(:mod:`.keys`), so a frame can neither be replayed on another channel nor
reflected back at its sender; the sequence number rejects replays, drops and
reorders inside one direction. The order of checks is the security argument:

1. the header alone: version (:class:`~flodl_async.errors.VersionMismatch`),
   reserved flags (:class:`~flodl_async.errors.ReservedFlags`: a newer peer or
   corruption) and lengths against the ceilings
   (:class:`~flodl_async.errors.FrameTooLarge`), *before* anything is buffered;
2. the tag, with a constant-time compare, *before* anything else reads the body;
3. the sequence number;
4. the kind: it must be in this link's row of the kind table
   (:data:`.legality.LEGAL_KINDS`, by channel and by the direction this side
   receives), else :class:`~flodl_async.errors.IllegalKind` (or
   :class:`~flodl_async.errors.UnknownKind` for a kind this build lacks);
5. only then msgpack and the schema (:class:`~flodl_async.errors.MalformedBody`).

The sending side applies the same table to itself: ``send`` of a kind its row
lacks raises ``TypeError`` (our bug, not the peer's) before taking a sequence number.

Any receive failure raises a :class:`~flodl_async.errors.WireError` subclass
and fails the connection for good: the caller must close it without replying.
Frames that verified before the bad one are still delivered (h11's rule):
``frames()`` returns them and raises on its next call; ``next_frame()`` hands
them out one by one, then raises; every call after that raises again, and
:attr:`FrameConnection.failure` tells an I/O shell at once that, after the
frames it was just given, the connection is done.

:class:`FrameConnection` has h11's shape: ``receive_data(data)`` (``b""`` for
EOF), ``next_frame()`` returning a :class:`Frame`, ``NEED_DATA`` or ``CLOSED``,
and ``send(msg)`` / ``send_parts(msg, payload)`` returning bytes to write.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, NoReturn

from ..errors import (
    AuthenticationFailed,
    FrameTooLarge,
    IllegalKind,
    ReservedFlags,
    SequenceError,
    TruncatedFrame,
    VersionMismatch,
    WireError,
)
from .channels import Channel
from .keys import Direction, SessionKeys
from .legality import legal_kinds
from .schema import Message, message_class, pack_message, unpack_message

PROTOCOL_VERSION = 1
HEADER = struct.Struct("<BBHQIQ")
HEADER_LEN = HEADER.size
TAG_LEN = 32

KiB = 1024
_SCRATCH_BYTES = 256 * 1024
MiB = 1024 * KiB

#: Default body ceiling on every channel: control messages carry at most a traceback and some lines.
DEFAULT_MAX_BODY = 1 * MiB
#: Default payload ceiling on the data channel when no model size is known (design §3: at least 64 MiB).
DEFAULT_MAX_TENSOR_PAYLOAD = 64 * MiB


class Pending(enum.Enum):
    """What :meth:`FrameConnection.next_frame` returns when it has no frame."""

    NEED_DATA = "need data"
    CLOSED = "closed"


NEED_DATA = Pending.NEED_DATA
CLOSED = Pending.CLOSED


class Side(enum.Enum):
    """Which end of a connection this codec sits on."""

    CONTROLLER = "controller"
    PEER = "peer"


@dataclass(frozen=True, slots=True, kw_only=True)
class FrameLimits:
    """Ceilings checked against a header before its frame is buffered."""

    max_body: int = DEFAULT_MAX_BODY
    max_payload: int = 0

    @classmethod
    def for_channel(cls, channel: Channel, *, tensor_ceiling: int = DEFAULT_MAX_TENSOR_PAYLOAD) -> FrameLimits:
        """Tensors travel on the data channel only; every other channel gets the small fixed limit."""
        return cls(max_payload=tensor_ceiling if channel is Channel.DATA else 0)

    @staticmethod
    def tensor_ceiling_for_model(model_bytes: int) -> int:
        """Design §3: twice the model's bytes, at least 64 MiB."""
        return max(2 * model_bytes, DEFAULT_MAX_TENSOR_PAYLOAD)


class Frame(NamedTuple):
    """One authenticated, decoded frame. ``payload`` is a writable view owned by this frame.

    A named tuple rather than a frozen dataclass: equally immutable, and a third of the
    construction cost on a path that runs once per frame.
    """

    seq: int
    message: Message
    payload: memoryview | None = None


class SealingFrame:
    """A payload frame between :meth:`FrameConnection.start_parts` and its write."""

    __slots__ = ("_mac", "_tag", "head", "payload")

    def __init__(self, *, head: bytes, payload: tuple[Buffer, ...], mac: hmac.HMAC) -> None:
        self.head = head
        self.payload = payload
        self._mac = mac
        self._tag: bytes | None = None

    def mac_payload(self) -> None:
        """MAC the payload (thread-safe with respect to the event loop: touches only this frame)."""
        for part in self.payload:
            self._mac.update(part)
        self._tag = self._mac.digest()

    def parts(self) -> list[Buffer]:
        """The buffers to write, in order."""
        if self._tag is None:
            raise RuntimeError("mac_payload() has not run")
        return [self.head, *self.payload, self._tag]


class _State(enum.Enum):
    HEADER = 1
    BODY = 2
    PAYLOAD = 3
    TAG = 4


Buffer = bytes | bytearray | memoryview


class FrameConnection:
    """Sans-IO codec for one direction pair of one connection on one channel."""

    def __init__(
        self,
        *,
        channel: Channel,
        side: Side,
        keys: SessionKeys,
        limits: FrameLimits | None = None,
        allocate: Callable[[int], bytearray] = bytearray,
    ) -> None:
        """``allocate(n)`` supplies each received payload's buffer; pass a pool's ``acquire``
        to reuse buffers (a fresh 16 MiB buffer costs ~20 ms of first-touch page faults here)."""
        if channel is Channel.STATUS:
            raise ValueError("the status channel speaks HTTP, not frames")
        outgoing = Direction.TO_CONTROLLER if side is Side.PEER else Direction.FROM_CONTROLLER
        incoming = Direction.FROM_CONTROLLER if side is Side.PEER else Direction.TO_CONTROLLER
        # Keyed templates: copying one skips the per-frame key schedule (~1 µs of 2-4 µs).
        self._send_key = keys.key(channel, outgoing)
        self._recv_key = keys.key(channel, incoming)
        # Keyed templates for frames MAC'd in pieces (payloads): copying one skips the key schedule.
        self._send_mac = hmac.new(self._send_key, digestmod=hashlib.sha256)
        self._recv_mac = hmac.new(self._recv_key, digestmod=hashlib.sha256)
        self.channel = channel
        self.side = side
        self.limits = limits or FrameLimits.for_channel(channel)
        # The kind table's two rows for this link, as kind numbers: one set lookup per frame.
        self._send_kinds = legal_kinds(channel, outgoing)
        self._recv_kinds = legal_kinds(channel, incoming)
        self._send_seq = 0
        self._recv_seq = 0
        self._buf = bytearray()
        self._pos = 0
        self._scratch: bytearray | None = None  # allocated on first get_buffer (bulk channels only)
        self._direct = False
        self._allocate = allocate
        self._eof = False
        self._failed: WireError | None = None
        self._unraised = False  # _failed was found by frames() behind good frames and not raised yet
        self._state = _State.HEADER
        self._kind = 0
        self._seq = 0
        self._body_len = 0
        self._body = b""
        self._payload: bytearray | None = None
        self._payload_filled = 0
        self._mac = self._recv_mac.copy()

    # ----- sending -------------------------------------------------------------------------

    def send(self, msg: Message) -> bytes:
        """One frame without payload, as a single bytes object (one write, one syscall).

        Raises ``TypeError`` for a kind the table does not allow from this side on this channel.
        """
        if msg.KIND not in self._send_kinds:
            self._refuse_send(msg)
        body = pack_message(msg)
        if len(body) > self.limits.max_body:
            raise FrameTooLarge(f"{type(msg).__name__} body is {len(body)} bytes, above the {self.limits.max_body}-byte ceiling")
        sealed = HEADER.pack(PROTOCOL_VERSION, 0, msg.KIND, self._send_seq, len(body), 0) + body
        self._send_seq += 1
        # One-shot C HMAC: a third of the per-frame cost of the copy/update/digest wrapper calls.
        return sealed + hmac.digest(self._send_key, sealed, "sha256")

    def send_parts(self, msg: Message, payload: Sequence[Buffer]) -> list[Buffer]:
        """One frame whose raw payload is ``payload`` (concatenated), without copying it.

        The returned list is meant for ``transport.writelines``; the payload buffers must
        stay unchanged until they are written.
        """
        sealing = self.start_parts(msg, payload)
        sealing.mac_payload()
        return sealing.parts()

    def start_parts(self, msg: Message, payload: Sequence[Buffer]) -> SealingFrame:
        """Reserve the next sequence number for a payload frame whose MAC the caller completes.

        ``SealingFrame.mac_payload`` is the expensive part (1.5 GB/s) and releases the GIL, so
        an I/O shell may run it in a worker thread while its loop keeps writing the previous
        frame. Frames must be written in the order they were started.
        """
        if msg.KIND not in self._send_kinds:
            self._refuse_send(msg)
        body = pack_message(msg)
        payload_len = sum(memoryview(p).nbytes for p in payload)
        if len(body) > self.limits.max_body:
            raise FrameTooLarge(f"{type(msg).__name__} body is {len(body)} bytes, above the {self.limits.max_body}-byte ceiling")
        if payload_len > self.limits.max_payload:
            raise FrameTooLarge(
                f"{type(msg).__name__} payload is {payload_len} bytes, above the {self.limits.max_payload}-byte ceiling of the {self.channel.value} channel"
            )
        head = HEADER.pack(PROTOCOL_VERSION, 0, msg.KIND, self._send_seq, len(body), payload_len) + body
        mac = self._send_mac.copy()
        mac.update(head)
        self._send_seq += 1
        return SealingFrame(head=head, payload=tuple(payload), mac=mac)

    def _refuse_send(self, msg: Message) -> NoReturn:
        # TypeError, not a WireError: this is our own bug, and the handlers that turn a peer's
        # WireError into "close that link" must not hide it. No sequence number was taken.
        raise TypeError(
            f"{type(msg).__name__} may not be sent by the {self.side.value} on the {self.channel.value} channel "
            "(flodl_async.wire.legality.LEGAL_KINDS); add it to the table if this link should carry it"
        )

    # ----- receiving -----------------------------------------------------------------------

    def receive_data(self, data: Buffer) -> None:
        """Feed bytes from the peer; ``b""`` means the peer closed its side."""
        if not data:
            self._eof = True
            return
        if self._eof:
            raise RuntimeError("receive_data after EOF")
        if self._pos:
            del self._buf[: self._pos]  # O(1) for bytearray: CPython moves its start offset
            self._pos = 0
        if self._state is _State.PAYLOAD and not self._buf and self._payload is not None:
            # Bulk path: copy straight into the frame's payload, once, and MAC it while it is hot.
            view = memoryview(data)
            take = min(len(view), len(self._payload) - self._payload_filled)
            chunk = view[:take]
            self._payload[self._payload_filled : self._payload_filled + take] = chunk
            self._payload_filled += take
            if take < len(view):
                self._buf += view[take:]
            return
        self._buf += data

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next received bytes should go (``asyncio.BufferedProtocol`` shape).

        In the middle of a payload with nothing else buffered, that is the payload itself:
        the socket writes tensor bytes straight into the frame's buffer, with no copy and no
        intermediate allocation. Otherwise it is a reusable scratch buffer.
        """
        if self._state is _State.PAYLOAD and self._payload is not None and self._pos >= len(self._buf):
            self._direct = True
            return memoryview(self._payload)[self._payload_filled :]
        self._direct = False
        if self._scratch is None:
            self._scratch = bytearray(_SCRATCH_BYTES)
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` were written into the buffer :meth:`get_buffer` returned."""
        if self._direct:
            assert self._payload is not None
            # MAC'd in one pass when the payload is complete (see _advance).
            self._payload_filled += nbytes
            return
        assert self._scratch is not None
        with memoryview(self._scratch) as view:
            self.receive_data(view[:nbytes])

    @property
    def failure(self) -> WireError | None:
        """The error that failed this connection, if any.

        Set as soon as the bad frame is found, while frames decoded before it may still be
        waiting to be delivered: an I/O shell queues those, then closes the connection.
        """
        return self._failed

    def next_frame(self) -> Frame | Pending:
        """The next complete frame, ``NEED_DATA``, or ``CLOSED`` after a clean EOF."""
        self._raise_if_failed()
        try:
            return self._advance()
        except WireError as exc:
            self._failed = exc
            raise

    def _raise_if_failed(self) -> None:
        if self._failed is None:
            return
        if self._unraised:
            # The first time the caller meets it: the original error, not the "already failed" echo.
            self._unraised = False
            raise self._failed
        raise type(self._failed)(f"connection already failed: {self._failed}")

    def _available(self) -> int:
        return len(self._buf) - self._pos

    def _advance(self) -> Frame | Pending:
        buf = self._buf
        if self._state is _State.HEADER:
            if len(buf) - self._pos < HEADER_LEN:
                return self._starved(mid_frame=self._available() > 0)
            self._start_frame(bytes(buf[self._pos : self._pos + HEADER_LEN]))
            self._pos += HEADER_LEN
        if self._state is _State.BODY:
            if len(buf) - self._pos < self._body_len:
                return self._starved(mid_frame=True)
            end = self._pos + self._body_len
            self._body = bytes(buf[self._pos : end])
            self._pos = end
            self._mac.update(self._body)
            self._state = _State.PAYLOAD if self._payload is not None else _State.TAG
        if self._state is _State.PAYLOAD:
            payload = self._payload
            assert payload is not None
            want = len(payload) - self._payload_filled
            take = min(want, len(buf) - self._pos)
            if take:
                with memoryview(buf) as view:
                    chunk = view[self._pos : self._pos + take]
                    payload[self._payload_filled : self._payload_filled + take] = chunk
                    chunk.release()
                self._pos += take
                self._payload_filled += take
            if self._payload_filled < len(payload):
                return self._starved(mid_frame=True)
            self._mac.update(payload)  # one pass over the whole payload, once it is complete
            self._state = _State.TAG
        if len(buf) - self._pos < TAG_LEN:
            return self._starved(mid_frame=True)
        tag = bytes(buf[self._pos : self._pos + TAG_LEN])
        self._pos += TAG_LEN
        return self._finish_frame(tag)

    def _whole_frames(self, out: list[Frame]) -> None:
        # Appends to the caller's list, so frames decoded before a bad one survive the raise.
        buf, pos = self._buf, self._pos
        size = len(buf)
        key, max_body, unpack_from, digest, same = self._recv_key, self.limits.max_body, HEADER.unpack_from, hmac.digest, hmac.compare_digest
        recv_kinds = self._recv_kinds
        with memoryview(buf) as view:
            while size - pos >= HEADER_LEN:
                version, flags, kind, seq, body_len, payload_len = unpack_from(buf, pos)
                end = pos + HEADER_LEN + body_len
                if payload_len or version != PROTOCOL_VERSION or flags or body_len > max_body or size < end + TAG_LEN:
                    break  # the state machine takes it, and performs every check itself
                if not same(digest(key, view[pos:end], "sha256"), view[end : end + TAG_LEN]):
                    self._kind, self._body_len = kind, body_len
                    raise self._auth_failure()
                if seq != self._recv_seq:
                    raise self._sequence_failure(seq)
                if kind not in recv_kinds:
                    self._refuse_kind(kind)
                body = view[pos + HEADER_LEN : end]
                try:
                    msg = unpack_message(kind, body)
                finally:
                    body.release()
                out.append(Frame(seq, msg))
                self._recv_seq += 1
                pos = end + TAG_LEN
                self._pos = pos

    def _auth_failure(self) -> AuthenticationFailed:
        return AuthenticationFailed(
            f"{self.channel.value} channel: frame tag did not verify (kind={self._kind:#06x}, "
            f"len={self._body_len}) — a session-secret mismatch (a peer from another run), "
            "a tampered frame, or a frame sent on another channel"
        )

    def _sequence_failure(self, seq: int) -> SequenceError:
        return SequenceError(f"{self.channel.value} channel: frame sequence {seq}, expected {self._recv_seq} (replayed, dropped or reordered frame)")

    def _refuse_kind(self, kind: int) -> NoReturn:
        cls = message_class(kind)  # raises UnknownKind for a kind this build does not know at all
        sender = "controller" if self.side is Side.PEER else "peer"
        raise IllegalKind(
            f"{self.channel.value} channel: the {sender} sent {cls.__name__} ({kind:#06x}), which is not legal "
            "on this channel in this direction (flodl_async.wire.legality.LEGAL_KINDS) — a peer of another "
            "flodl_async version, or a bug in it; run the same version on every host"
        )

    def _starved(self, *, mid_frame: bool) -> Pending:
        if not self._eof:
            return NEED_DATA
        if mid_frame or self._state is not _State.HEADER:
            raise TruncatedFrame(f"{self.channel.value} channel: the peer closed in the middle of a frame")
        return CLOSED

    def _start_frame(self, header: bytes) -> None:
        version, flags, kind, seq, body_len, payload_len = HEADER.unpack(header)
        if version != PROTOCOL_VERSION:
            raise VersionMismatch(
                f"{self.channel.value} channel: peer speaks wire protocol v{version}, this build speaks "
                f"v{PROTOCOL_VERSION}; run the same flodl_async version on every host"
            )
        if flags != 0:
            # Checked before the tag (like the version): the flags could one day change how the rest is read.
            raise ReservedFlags(
                f"{self.channel.value} channel: reserved header flags {flags:#04x} set — a newer peer using a feature "
                "this build lacks (run the same flodl_async version on every host), or corrupted bytes"
            )
        if body_len > self.limits.max_body:
            raise FrameTooLarge(f"{self.channel.value} channel: frame body of {body_len} bytes exceeds the {self.limits.max_body}-byte ceiling")
        if payload_len > self.limits.max_payload:
            raise FrameTooLarge(
                f"{self.channel.value} channel: frame payload of {payload_len} bytes exceeds the "
                f"{self.limits.max_payload}-byte ceiling (raise the tensor ceiling if the model is that large)"
            )
        self._kind = kind
        self._seq = seq
        self._body_len = body_len
        self._mac = self._recv_mac.copy()
        self._mac.update(header)
        self._payload = self._allocate(payload_len) if payload_len else None
        self._payload_filled = 0
        self._state = _State.BODY

    def _finish_frame(self, tag: bytes) -> Frame:
        if not hmac.compare_digest(self._mac.digest(), tag):
            raise self._auth_failure()
        if self._seq != self._recv_seq:
            raise self._sequence_failure(self._seq)
        if self._kind not in self._recv_kinds:
            self._refuse_kind(self._kind)
        msg = unpack_message(self._kind, self._body)
        payload = memoryview(self._payload) if self._payload is not None else None
        frame = Frame(seq=self._seq, message=msg, payload=payload)
        self._recv_seq += 1
        self._state = _State.HEADER
        self._payload = None
        self._body = b""
        return frame

    def frames(self) -> list[Frame]:
        """Every complete frame buffered now; raises on a bad one, like :meth:`next_frame`.

        Frames that decoded before a bad one in the same buffer are returned first, and the
        error is raised by the next call (then by every call after it).

        Runs of whole payload-less frames (the control plane's common case: a socket read
        holds hundreds of them) are decoded in one tight loop over one buffer view; anything
        else goes through the state machine.
        """
        self._raise_if_failed()
        out: list[Frame] = []
        try:
            if self._state is _State.HEADER:
                self._whole_frames(out)
            while not isinstance(item := self._advance(), Pending):
                out.append(item)
        except WireError as exc:
            self._failed = exc
            if not out:
                raise
            # h11's rule: the frames that verified before the bad one are delivered now; the
            # error waits for the next call, and every call after that raises too.
            self._unraised = True
        return out


class PayloadPool:
    """Recycles payload buffers by size, so steady tensor traffic stops paying page faults.

    Pass :meth:`acquire` as a codec's ``allocate``; hand a frame's payload back with
    :meth:`release` once no tensor views it any more.
    """

    def __init__(self, *, max_per_size: int = 8) -> None:
        self._free: dict[int, list[bytearray]] = {}
        self._max_per_size = max_per_size

    def acquire(self, size: int) -> bytearray:
        """A buffer of exactly ``size`` bytes (contents undefined)."""
        free = self._free.get(size)
        return free.pop() if free else bytearray(size)

    def release(self, payload: memoryview | bytearray) -> None:
        """Return a payload (the frame's memoryview or its bytearray) to the pool."""
        buffer = payload.obj if isinstance(payload, memoryview) else payload
        if isinstance(payload, memoryview):
            payload.release()
        if isinstance(buffer, bytearray):
            free = self._free.setdefault(len(buffer), [])
            if len(free) < self._max_per_size:
                free.append(buffer)
