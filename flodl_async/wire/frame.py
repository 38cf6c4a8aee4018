"""Authenticated, encrypted frames, sans-IO: bytes in, frames out; messages in, bytes out.

Theory of operation. After the channel magic and the handshake (:mod:`.handshake`),
which gives this connection its own :class:`~.keys.LinkKeys`, a connection carries frames::

    header  (24 bytes, little-endian)
        u8  protocol version
        u8  flags (reserved, must be 0)
        u16 message kind
        u64 sequence number (0, 1, 2, ... per direction)
        u32 body length      (bytes on the wire; capped by the channel's body ceiling)
        u64 payload length   (plaintext tensor bytes; capped by the payload ceiling,
                              0 on most channels)
    body     msgpack — for a sealed kind (``Message.SEALED``):
             AES-256-GCM(msgpack) ‖ 16-byte GCM tag
    payload  AES-256-GCM of the raw tensor bytes, in chunks of at most ``SEAL_CHUNK``
             plaintext bytes, each chunk's ciphertext followed by its 16-byte GCM tag
    tag      HMAC-SHA256 over header ‖ body ‖ the payload's GCM tags, 32 bytes

HMAC-SHA256 authenticates every frame, as the protocol always did; the bulk bytes
are authenticated by GCM instead of HMAC (the HMAC binds their GCM tags), so they
are confidential as well, and the frame is not limited by HMAC's speed. Every GCM
call takes the header as associated data.

**A GCM nonce never repeats under one key.** The nonce is 12 bytes,
``u64 sequence ‖ u32 index``: the index is the chunk number for payload chunks
and ``0xFFFFFFFF`` for a sealed body. (1) Keys are per connection and per
direction (the handshake mixes both sides' fresh nonces into them), so two
encryptions under one key are two encryptions by one sender on one connection.
(2) That sender takes a new sequence number for every frame, strictly
increasing, and refuses to send once it would wrap. (3) Within a frame, chunk
indexes are distinct and below ``0xFFFFFFFF`` (a payload ceiling far below
``2³² · SEAL_CHUNK`` bytes is enforced), and the body uses the one index no chunk
uses. So every (key, nonce) pair is used once. A property test checks the
nonces a sender produces are unique. ``cryptography`` refuses more than 2³¹−1
bytes per call; ``SEAL_CHUNK`` (4 MiB; a codec accepts at most 1 GiB) stays below that.

The order of checks on receipt is the security argument:

1. the header alone: version (:class:`~flodl_async.errors.VersionMismatch`),
   reserved flags (:class:`~flodl_async.errors.ReservedFlags`: a newer peer or
   corruption) and lengths against the ceilings
   (:class:`~flodl_async.errors.FrameTooLarge`), *before* anything is buffered;
2. the HMAC tag, with a constant-time compare, *before* anything else reads the body;
3. the sequence number (replays, drops and reorders inside one connection;
   the handshake already made bytes of any other connection fail step 2);
4. the kind: it must be in this link's row of the kind table
   (:data:`.legality.LEGAL_KINDS`, by channel and by the direction this side
   receives), else :class:`~flodl_async.errors.IllegalKind` (or
   :class:`~flodl_async.errors.UnknownKind` for a kind this build lacks);
5. GCM: a sealed body and every payload chunk must decrypt under their tags
   (:class:`~flodl_async.errors.AuthenticationFailed` otherwise);
6. only then msgpack and the schema (:class:`~flodl_async.errors.MalformedBody`).

Payload chunks are decrypted as soon as each has arrived (so opening overlaps the rest of
the frame's transfer), but that is bookkeeping, not a check: a chunk that fails its tag is
reported at step 5, and no plaintext leaves the codec before steps 1-5 all passed.

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

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

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
from .handshake import PROTOCOL_VERSION
from .keys import Direction, LinkKeys
from .legality import legal_kinds
from .schema import Message, message_class, pack_message, sealed_kinds, unpack_message

HEADER = struct.Struct("<BBHQIQ")
HEADER_LEN = HEADER.size
TAG_LEN = 32
GCM_TAG_LEN = 16
#: The 12-byte GCM nonce: sequence number, then chunk index (``BODY_INDEX`` for a sealed body).
NONCE = struct.Struct("<QI")
BODY_INDEX = 0xFFFFFFFF
#: The largest chunk a codec accepts (cryptography takes at most 2**31 - 1 bytes per call).
MAX_SEAL_CHUNK = 1 << 30
#: Plaintext bytes per GCM chunk of a payload. Small enough that a large payload is a pipeline:
#: the sender writes chunk i while it seals chunk i+1, and the receiver opens chunk i while
#: chunk i+1 is still on the wire (benchmarks/averaging.py --uplink tcp); large enough that the
#: per-chunk costs (a tag, a nonce, a GCM set-up) stay negligible.
SEAL_CHUNK = 4 << 20
#: The sender refuses to take a sequence number past this: the nonce's counter never wraps.
_LAST_SEQ = (1 << 64) - 1

KiB = 1024
_SCRATCH_BYTES = 256 * 1024
MiB = 1024 * KiB

#: Default body ceiling on every channel: control messages carry at most a traceback and some lines.
DEFAULT_MAX_BODY = 1 * MiB
#: Default payload ceiling on the data channel when no model size is known: the floor of
#: :meth:`tensor_ceiling_for_model`'s rule, 64 MiB.
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
    def for_channel(
        cls, channel: Channel, *, tensor_ceiling: int = DEFAULT_MAX_TENSOR_PAYLOAD
    ) -> FrameLimits:
        """Tensors travel on the data channel only; every other channel gets the small fixed
        limit."""
        return cls(max_payload=tensor_ceiling if channel is Channel.DATA else 0)

    @staticmethod
    def tensor_ceiling_for_model(model_bytes: int) -> int:
        """Twice the model's bytes (a frame holds at most the whole model, with room to spare),
        at least 64 MiB."""
        return max(2 * model_bytes, DEFAULT_MAX_TENSOR_PAYLOAD)


def seal_nonce(seq: int, index: int) -> bytes:
    """The GCM nonce of chunk ``index`` (or ``BODY_INDEX``) of frame ``seq``; the one place nonces
    are made."""
    return NONCE.pack(seq, index)


def chunk_count(payload_len: int, chunk: int = SEAL_CHUNK) -> int:
    """How many GCM chunks seal ``payload_len`` plaintext bytes."""
    return -(-payload_len // chunk)


def sealed_length(payload_len: int, chunk: int = SEAL_CHUNK) -> int:
    """Bytes a payload of ``payload_len`` plaintext bytes takes on the wire."""
    return payload_len + GCM_TAG_LEN * chunk_count(payload_len, chunk)


class Frame(NamedTuple):
    """One authenticated, decoded frame. ``payload`` is a writable view of the plaintext, owned by
    this frame.

    A named tuple rather than a frozen dataclass: equally immutable, and a third of the
    construction cost on a path that runs once per frame.
    """

    seq: int
    message: Message
    payload: memoryview | None = None


Buffer = bytes | bytearray | memoryview


class SealingFrame:
    """A payload frame between :meth:`FrameConnection.start_parts` and its write.

    :meth:`seal` is the expensive part (AES-GCM over the payload) and releases the GIL, so
    an I/O shell may run it in a worker thread while its loop keeps writing earlier frames.
    """

    __slots__ = (
        "_aead",
        "_chunk",
        "_key",
        "_mac",
        "_mac_key",
        "_next",
        "_parts",
        "_plain",
        "_seq",
        "_source_index",
        "_source_offset",
        "_sources",
        "_tag",
        "buffer",
        "head",
        "payload_len",
    )

    def __init__(
        self,
        *,
        head: bytes,
        parts: tuple[Buffer, ...],
        payload_len: int,
        buffer: bytearray,
        seq: int,
        keys: LinkKeys,
        aead: AESGCM,
        chunk: int,
        plain: bool = False,
    ) -> None:
        self.head = head
        self.payload_len = payload_len
        #: The sealed payload's bytes (the caller's recycled buffer, or a new one); written by
        #: :meth:`parts`.
        self.buffer = buffer
        self._parts = parts
        self._seq = seq
        self._key = keys.send_aead
        self._aead = aead
        self._mac_key = keys.send_mac
        self._chunk = chunk
        self._plain = plain
        self._tag: bytes | None = None
        self._mac: hmac.HMAC | None = None
        self._sources: list[memoryview] = []
        self._source_index = 0
        self._source_offset = 0
        self._next = 0  # the next chunk seal_chunk() seals

    @property
    def chunks(self) -> int:
        """How many GCM chunks :meth:`seal_chunk` seals (0 on a plain-payload link)."""
        return 0 if self._plain else chunk_count(self.payload_len, self._chunk)

    def seal(self) -> None:
        """Encrypt the payload into :attr:`buffer` and tag the frame (touches only this frame:
        thread-safe)."""
        if self._plain:
            # A plain-payload link (a private unix socket, see FrameConnection): copy, tag the head
            # only.
            out = memoryview(self.buffer)
            at = 0
            for part in self._parts:
                view = memoryview(part).cast("B")
                out[at : at + view.nbytes] = view
                at += view.nbytes
            self._tag = hmac.digest(self._mac_key, self.head, "sha256")
            return
        for index in range(self._next, self.chunks):
            self.seal_chunk(index)
        self.finish()

    def seal_chunk(self, index: int) -> tuple[int, int]:
        """Seal chunk ``index`` (chunks go in order, 0 first) into :attr:`buffer`; its (start, end)
        there.

        Once it returns, those bytes are final: an I/O shell may write them while the next
        chunk is sealed (thread-safe like :meth:`seal`; one thread per frame at a time).
        """
        if self._plain or index != self._next or index >= self.chunks:
            raise RuntimeError(
                f"seal_chunk({index}): chunks are sealed in order, {self._next} is next of "
                f"{self.chunks}"
            )
        if self._mac is None:
            self._mac = hmac.new(self._mac_key, self.head, hashlib.sha256)
            self._sources = [memoryview(p).cast("B") for p in self._parts]
        out = memoryview(self.buffer)
        aad = self.head[:HEADER_LEN]
        sources = self._sources
        source_index, source_offset = self._source_index, self._source_offset
        size = min(self._chunk, self.payload_len - index * self._chunk)
        sealed_at = index * (self._chunk + GCM_TAG_LEN)
        nonce = seal_nonce(self._seq, index)
        while sources[source_index].nbytes == source_offset:
            source_index, source_offset = source_index + 1, 0
        source = sources[source_index]
        if source.nbytes - source_offset >= size:
            # The common case: the chunk lies inside one buffer (one tensor, or a flat bucket).
            self._aead.encrypt_into(
                nonce,
                source[source_offset : source_offset + size],
                aad,
                out[sealed_at : sealed_at + size + GCM_TAG_LEN],
            )
            source_offset += size
        else:
            # Spread over several tensors: stream them through one GCM context, no gather copy.
            encryptor = Cipher(algorithms.AES(self._key), modes.GCM(nonce)).encryptor()
            encryptor.authenticate_additional_data(aad)
            filled = 0
            while filled < size:
                while sources[source_index].nbytes == source_offset:
                    source_index, source_offset = source_index + 1, 0
                take = min(size - filled, sources[source_index].nbytes - source_offset)
                encryptor.update_into(
                    sources[source_index][source_offset : source_offset + take],
                    out[sealed_at + filled : sealed_at + filled + take],
                )
                filled += take
                source_offset += take
            encryptor.finalize()
            out[sealed_at + size : sealed_at + size + GCM_TAG_LEN] = encryptor.tag
        self._mac.update(out[sealed_at + size : sealed_at + size + GCM_TAG_LEN])
        self._source_index, self._source_offset = source_index, source_offset
        self._next = index + 1
        return sealed_at, sealed_at + size + GCM_TAG_LEN

    def finish(self) -> bytes:
        """The frame's tag, once every chunk is sealed (:meth:`seal` calls it)."""
        if self._plain or self._next != self.chunks:
            raise RuntimeError(f"finish(): {self._next} of {self.chunks} chunks are sealed")
        if self._mac is None:
            self._mac = hmac.new(self._mac_key, self.head, hashlib.sha256)  # an empty payload
        self._tag = self._mac.digest()
        return self._tag

    def parts(self) -> list[Buffer]:
        """The buffers to write, in order."""
        if self._tag is None:
            raise RuntimeError("seal() has not run")
        wire_len = self.payload_len if self._plain else sealed_length(self.payload_len, self._chunk)
        return [self.head, memoryview(self.buffer)[:wire_len], self._tag]


class _State(enum.Enum):
    HEADER = 1
    BODY = 2
    PAYLOAD = 3
    TAG = 4


class FrameConnection:
    """Sans-IO codec for both directions of one established connection on one channel."""

    def __init__(
        self,
        *,
        channel: Channel,
        side: Side,
        keys: LinkKeys,
        limits: FrameLimits | None = None,
        allocate: Callable[[int], bytearray] = bytearray,
        seal_chunk: int = SEAL_CHUNK,
        plain_payloads: bool = False,
    ) -> None:
        """``keys`` come from this connection's handshake. ``allocate(n)`` supplies each received
        payload's buffer; pass a pool's ``acquire`` to reuse buffers (a fresh 16 MiB buffer costs
        ~20 ms of first-touch page faults here). ``seal_chunk`` is a protocol constant that both
        ends must share; only tests change it, to cover multi-chunk payloads cheaply.

        ``plain_payloads``: tensor payloads travel as they are — neither encrypted nor covered by
        the frame's tag (headers and bodies still are) — and land straight in their own buffer.
        Both ends must agree (a mismatch fails the first payload frame's tag). Only for a relay's
        owner-only unix socket, whose peers are the same user (who could read the ranks' memory
        anyway): it removes two AES-GCM passes and a copy per tensor frame on that leg
        (measured by benchmarks/averaging.py)."""
        if channel is Channel.STATUS:
            raise ValueError("the status channel speaks HTTP, not frames")
        if not 0 < seal_chunk <= MAX_SEAL_CHUNK:
            raise ValueError(f"seal_chunk must be in 1..{MAX_SEAL_CHUNK}")
        outgoing = Direction.TO_CONTROLLER if side is Side.PEER else Direction.FROM_CONTROLLER
        incoming = Direction.FROM_CONTROLLER if side is Side.PEER else Direction.TO_CONTROLLER
        self._keys = keys
        self._send_key = keys.send_mac
        self._recv_key = keys.recv_mac
        # Keyed templates for frames MAC'd in pieces: copying one skips the key schedule (~1 µs of
        # 2-4 µs).
        self._recv_mac = hmac.new(self._recv_key, digestmod=hashlib.sha256)
        self._send_aead = AESGCM(keys.send_aead)
        self._recv_aead = AESGCM(keys.recv_aead)
        self._chunk = seal_chunk
        self._plain = plain_payloads
        self.channel = channel
        self.side = side
        self.limits = limits or FrameLimits.for_channel(channel)
        if chunk_count(self.limits.max_payload, seal_chunk) >= BODY_INDEX:
            raise ValueError("payload ceiling too large for the chunk nonce space")
        # The kind table's two rows for this link, as kind numbers: one set lookup per frame.
        self._send_kinds = legal_kinds(channel, outgoing)
        self._recv_kinds = legal_kinds(channel, incoming)
        self._sealed = sealed_kinds()
        self._send_seq = 0
        self._recv_seq = 0
        self._buf = bytearray()
        self._pos = 0
        self._scratch: bytearray | None = None  # allocated on first get_buffer (bulk channels only)
        self._direct = False
        self._allocate = allocate
        self._eof = False
        self._failed: WireError | None = None
        # _failed was found by frames() behind good frames and not raised yet
        self._unraised = False
        self._state = _State.HEADER
        self._header = b""
        self._kind = 0
        self._seq = 0
        self._body_len = 0
        self._body = b""
        self._payload_len = 0
        # The sealed payload lands here (reused across frames), then decrypts into the frame's own
        # buffer.
        self._sealed_buf = bytearray()
        self._sealed_len = 0
        self._payload_filled = 0
        # Chunks are opened as they arrive (see _open_arrived): into this frame's plaintext buffer.
        self._opened = 0
        self._plain_out: bytearray | None = None
        # the first chunk that did not decrypt, reported in step 5
        self._open_failed: int | None = None
        self._mac = self._recv_mac.copy()

    # ----- sending -------------------------------------------------------------------------

    def _take_seq(self) -> int:
        seq = self._send_seq
        if seq == _LAST_SEQ:
            # 2**64 frames: never in practice
            raise RuntimeError("sequence numbers exhausted on this connection; open a new one")
        self._send_seq = seq + 1
        return seq

    def _seal_body(self, header: bytes, seq: int, body: bytes) -> bytes:
        return self._send_aead.encrypt(seal_nonce(seq, BODY_INDEX), body, header)

    def _wire_body(self, msg: Message) -> bytes:
        body = pack_message(msg)
        wire_len = len(body) + (GCM_TAG_LEN if msg.SEALED else 0)
        if wire_len > self.limits.max_body:
            raise FrameTooLarge(
                f"{type(msg).__name__} body is {wire_len} bytes, above the "
                f"{self.limits.max_body}-byte ceiling"
            )
        return body

    def send(self, msg: Message) -> bytes:
        """One frame without payload, as a single bytes object (one write, one syscall).

        Raises ``TypeError`` for a kind the table does not allow from this side on this channel.
        """
        if msg.KIND not in self._send_kinds:
            self._refuse_send(msg)
        body = self._wire_body(msg)
        if msg.SEALED:
            seq = self._take_seq()
            header = HEADER.pack(PROTOCOL_VERSION, 0, msg.KIND, seq, len(body) + GCM_TAG_LEN, 0)
            sealed = header + self._seal_body(header, seq, body)
        else:
            sealed = (
                HEADER.pack(PROTOCOL_VERSION, 0, msg.KIND, self._take_seq(), len(body), 0) + body
            )
        # One-shot C HMAC: a third of the per-frame cost of the copy/update/digest wrapper calls.
        return sealed + hmac.digest(self._send_key, sealed, "sha256")

    def send_parts(self, msg: Message, payload: Sequence[Buffer]) -> list[Buffer]:
        """One frame whose payload is ``payload`` (concatenated), encrypted without gathering it
        first.

        The returned list is meant for ``transport.writelines``.
        """
        sealing = self.start_parts(msg, payload)
        sealing.seal()
        return sealing.parts()

    def _payload_head(self, msg: Message, payload: Sequence[Buffer]) -> tuple[bytes, int, int]:
        """Check a payload frame and take its sequence number: (header + wire body, seq, payload
        length)."""
        if msg.KIND not in self._send_kinds:
            self._refuse_send(msg)
        body = self._wire_body(msg)
        payload_len = sum(memoryview(p).nbytes for p in payload)
        if payload_len > self.limits.max_payload:
            raise FrameTooLarge(
                f"{type(msg).__name__} payload is {payload_len} bytes, above the "
                f"{self.limits.max_payload}-byte ceiling of the {self.channel.value} channel"
            )
        seq = self._take_seq()
        wire_len = len(body) + (GCM_TAG_LEN if msg.SEALED else 0)
        header = HEADER.pack(PROTOCOL_VERSION, 0, msg.KIND, seq, wire_len, payload_len)
        return (
            header + (self._seal_body(header, seq, body) if msg.SEALED else body),
            seq,
            payload_len,
        )

    def start_parts(
        self, msg: Message, payload: Sequence[Buffer], *, buffer: bytearray | None = None
    ) -> SealingFrame:
        """Reserve the next sequence number for a payload frame whose sealing the caller completes.

        ``buffer`` (at least :func:`sealed_length` bytes) receives the ciphertext; an I/O shell
        recycles buffers once the transport has written them. Frames must be written in the
        order they were started.
        """
        need = self.wire_payload_length(sum(memoryview(p).nbytes for p in payload))
        if buffer is not None and len(buffer) < need:
            raise ValueError(
                f"sealing buffer of {len(buffer)} bytes is smaller than the {need} the frame needs"
            )
        head, seq, payload_len = self._payload_head(msg, payload)
        return SealingFrame(
            head=head,
            parts=tuple(payload),
            payload_len=payload_len,
            buffer=buffer if buffer is not None else bytearray(need),
            seq=seq,
            keys=self._keys,
            aead=self._send_aead,
            chunk=self._chunk,
            plain=self._plain,
        )

    @property
    def plain_payloads(self) -> bool:
        """Payloads travel as they are on this link (see the constructor)."""
        return self._plain

    def send_parts_borrowed(self, msg: Message, payload: Sequence[Buffer]) -> list[Buffer]:
        """A plain-payload frame that writes ``payload``'s own buffers (no copy): head, the buffers,
        the tag.

        The caller keeps the buffers alive and unchanged until the transport wrote them.
        """
        if not self._plain:
            raise RuntimeError("only a plain-payload link can send borrowed payload buffers")
        head, _seq, _payload_len = self._payload_head(msg, payload)
        return [head, *payload, hmac.digest(self._send_key, head, "sha256")]

    def wire_payload_length(self, payload_len: int) -> int:
        """Bytes a payload of ``payload_len`` takes on this link's wire (sealed, or as it is)."""
        return payload_len if self._plain else sealed_length(payload_len, self._chunk)

    def _refuse_send(self, msg: Message) -> NoReturn:
        # TypeError, not a WireError: this is our own bug, and the handlers that turn a peer's
        # WireError into "close that link" must not hide it. No sequence number was taken.
        raise TypeError(
            f"{type(msg).__name__} may not be sent by the {self.side.value} on the "
            f"{self.channel.value} channel "
            "(flodl_async.wire.legality.LEGAL_KINDS); add it to the table if this link should "
            "carry it"
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
        if self._state is _State.PAYLOAD and not self._buf:
            # Bulk path: copy straight into the sealed payload buffer, once.
            view = memoryview(data)
            take = min(len(view), self._sealed_len - self._payload_filled)
            self._sealed_buf[self._payload_filled : self._payload_filled + take] = view[:take]
            self._payload_filled += take
            if not self._plain:
                self._open_arrived()
            if take < len(view):
                self._buf += view[take:]
            return
        self._buf += data

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next received bytes should go (``asyncio.BufferedProtocol`` shape).

        In the middle of a payload with nothing else buffered, that is the payload's own
        buffer: the socket writes the ciphertext straight into it, with no copy and no
        intermediate allocation. Otherwise it is a reusable scratch buffer.
        """
        if self._state is _State.PAYLOAD and self._pos >= len(self._buf):
            self._direct = True
            return memoryview(self._sealed_buf)[self._payload_filled : self._sealed_len]
        self._direct = False
        if self._scratch is None:
            self._scratch = bytearray(_SCRATCH_BYTES)
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` were written into the buffer :meth:`get_buffer` returned."""
        if self._direct:
            self._payload_filled += nbytes
            if not self._plain:
                self._open_arrived()
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
            self._state = _State.PAYLOAD if self._sealed_len else _State.TAG
        if self._state is _State.PAYLOAD:
            want = self._sealed_len - self._payload_filled
            take = min(want, len(buf) - self._pos)
            if take:
                with memoryview(buf) as view:
                    chunk = view[self._pos : self._pos + take]
                    self._sealed_buf[self._payload_filled : self._payload_filled + take] = chunk
                    chunk.release()
                self._pos += take
                self._payload_filled += take
            if not self._plain:
                self._open_arrived()
            if self._payload_filled < self._sealed_len:
                return self._starved(mid_frame=True)
            if not self._plain:
                self._mac_gcm_tags()
            self._state = _State.TAG
        if len(buf) - self._pos < TAG_LEN:
            return self._starved(mid_frame=True)
        tag = bytes(buf[self._pos : self._pos + TAG_LEN])
        self._pos += TAG_LEN
        return self._finish_frame(tag)

    def _mac_gcm_tags(self) -> None:
        # The HMAC covers the payload's GCM tags, which cover its ciphertext (16 bytes per chunk).
        with memoryview(self._sealed_buf) as view:
            at = 0
            for index in range(chunk_count(self._payload_len, self._chunk)):
                at += min(self._chunk, self._payload_len - index * self._chunk)
                self._mac.update(view[at : at + GCM_TAG_LEN])
                at += GCM_TAG_LEN

    def _whole_frames(self, out: list[Frame]) -> None:
        # Appends to the caller's list, so frames decoded before a bad one survive the raise.
        buf, pos = self._buf, self._pos
        size = len(buf)
        key, max_body, unpack_from, digest, same = (
            self._recv_key,
            self.limits.max_body,
            HEADER.unpack_from,
            hmac.digest,
            hmac.compare_digest,
        )
        recv_kinds, sealed = self._recv_kinds, self._sealed
        with memoryview(buf) as view:
            while size - pos >= HEADER_LEN:
                version, flags, kind, seq, body_len, payload_len = unpack_from(buf, pos)
                end = pos + HEADER_LEN + body_len
                if (
                    payload_len
                    or version != PROTOCOL_VERSION
                    or flags
                    or body_len > max_body
                    or size < end + TAG_LEN
                ):
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
                    msg = (
                        unpack_message(
                            kind, self._open_body(bytes(view[pos : pos + HEADER_LEN]), seq, body)
                        )
                        if kind in sealed
                        else unpack_message(kind, body)
                    )
                finally:
                    body.release()
                out.append(Frame(seq, msg))
                self._recv_seq += 1
                pos = end + TAG_LEN
                self._pos = pos

    def _open_body(self, header: bytes, seq: int, body: Buffer) -> bytes:
        try:
            return self._recv_aead.decrypt(seal_nonce(seq, BODY_INDEX), body, header)
        except InvalidTag:
            raise AuthenticationFailed(
                f"{self.channel.value} channel: a sealed body did not decrypt under its GCM tag "
                "(tampered, or a peer bug)"
            ) from None

    def _open_arrived(self) -> None:
        """Decrypt every payload chunk whose ciphertext and tag have all arrived.

        Opening a chunk while the next one is still on the wire overlaps the two, and the
        sealed bytes are read again while they are still in cache. A chunk that fails its GCM
        tag is only remembered: the failure is raised in step 5 of the order of checks, after
        the frame's HMAC, sequence and kind (a tampered header fails GCM too, and must still
        be reported by the HMAC check). No plaintext leaves the codec before every check passed.
        """
        chunks = chunk_count(self._payload_len, self._chunk)
        while self._opened < chunks:
            index = self._opened
            start = index * self._chunk
            size = min(self._chunk, self._payload_len - start)
            at = start + index * GCM_TAG_LEN
            if self._payload_filled < at + size + GCM_TAG_LEN:
                return
            if self._open_failed is None:
                if self._plain_out is None:
                    self._plain_out = self._allocate(self._payload_len)
                with memoryview(self._sealed_buf) as sealed, memoryview(self._plain_out) as out:
                    nonce = seal_nonce(self._seq, index)
                    try:
                        self._recv_aead.decrypt_into(
                            nonce,
                            sealed[at : at + size + GCM_TAG_LEN],
                            self._header,
                            out[start : start + size],
                        )
                    except InvalidTag:
                        self._open_failed = index
            self._opened = index + 1

    def _open_payload(self) -> bytearray:
        self._open_arrived()  # every chunk has arrived by now: this opens any not opened yet
        if self._open_failed is not None:
            raise AuthenticationFailed(
                f"{self.channel.value} channel: payload chunk {self._open_failed} did not decrypt "
                "under its GCM tag (tampered, or a peer bug)"
            )
        plain, self._plain_out = self._plain_out, None
        assert plain is not None
        return plain

    def _auth_failure(self) -> AuthenticationFailed:
        return AuthenticationFailed(
            f"{self.channel.value} channel: frame tag did not verify (kind={self._kind:#06x}, "
            f"len={self._body_len}) — a tampered frame, or a peer bug (this connection's handshake "
            "succeeded, "
            "so both sides hold the same keys)"
        )

    def _sequence_failure(self, seq: int) -> SequenceError:
        return SequenceError(
            f"{self.channel.value} channel: frame sequence {seq}, expected {self._recv_seq} "
            "(replayed, dropped or reordered frame)"
        )

    def _refuse_kind(self, kind: int) -> NoReturn:
        cls = message_class(kind)  # raises UnknownKind for a kind this build does not know at all
        sender = "controller" if self.side is Side.PEER else "peer"
        raise IllegalKind(
            f"{self.channel.value} channel: the {sender} sent {cls.__name__} ({kind:#06x}), which "
            "is not legal "
            "on this channel in this direction (flodl_async.wire.legality.LEGAL_KINDS) — a peer of "
            "another "
            "flodl_async version, or a bug in it; run the same version on every host"
        )

    def _starved(self, *, mid_frame: bool) -> Pending:
        if not self._eof:
            return NEED_DATA
        if mid_frame or self._state is not _State.HEADER:
            raise TruncatedFrame(
                f"{self.channel.value} channel: the peer closed in the middle of a frame"
            )
        return CLOSED

    def _start_frame(self, header: bytes) -> None:
        version, flags, kind, seq, body_len, payload_len = HEADER.unpack(header)
        if version != PROTOCOL_VERSION:
            raise VersionMismatch(
                f"{self.channel.value} channel: peer speaks wire protocol v{version}, this build "
                "speaks "
                f"v{PROTOCOL_VERSION}; run the same flodl_async version on every host"
            )
        if flags != 0:
            # Checked before the tag (like the version): the flags could one day change how the rest
            # is read.
            raise ReservedFlags(
                f"{self.channel.value} channel: reserved header flags {flags:#04x} set — a newer "
                "peer using a feature "
                "this build lacks (run the same flodl_async version on every host), or corrupted "
                "bytes"
            )
        if body_len > self.limits.max_body:
            raise FrameTooLarge(
                f"{self.channel.value} channel: frame body of {body_len} bytes exceeds the "
                f"{self.limits.max_body}-byte ceiling"
            )
        if payload_len > self.limits.max_payload:
            raise FrameTooLarge(
                f"{self.channel.value} channel: frame payload of {payload_len} bytes exceeds the "
                f"{self.limits.max_payload}-byte ceiling (raise the tensor ceiling if the model is "
                "that large)"
            )
        self._header = header
        self._kind = kind
        self._seq = seq
        self._body_len = body_len
        self._mac = self._recv_mac.copy()
        self._mac.update(header)
        self._payload_len = payload_len
        self._sealed_len = self.wire_payload_length(payload_len)
        if self._plain:
            if payload_len:
                # the payload's own buffer: no decrypt, no copy
                self._sealed_buf = self._allocate(payload_len)
        elif len(self._sealed_buf) < self._sealed_len:
            # grows to the largest frame once, then is reused
            self._sealed_buf = bytearray(self._sealed_len)
        self._payload_filled = 0
        self._opened = 0
        self._plain_out = None
        self._open_failed = None
        self._state = _State.BODY

    def _finish_frame(self, tag: bytes) -> Frame:
        if not hmac.compare_digest(self._mac.digest(), tag):
            raise self._auth_failure()
        if self._seq != self._recv_seq:
            raise self._sequence_failure(self._seq)
        if self._kind not in self._recv_kinds:
            self._refuse_kind(self._kind)
        body = (
            self._open_body(self._header, self._seq, self._body)
            if self._kind in self._sealed
            else self._body
        )
        if not self._payload_len:
            payload = None
        elif self._plain:
            # received in place: the frame owns this buffer now
            payload = memoryview(self._sealed_buf)
            self._sealed_buf = bytearray()
        else:
            payload = memoryview(self._open_payload())
        msg = unpack_message(self._kind, body)
        frame = Frame(seq=self._seq, message=msg, payload=payload)
        self._recv_seq += 1
        self._state = _State.HEADER
        self._body = b""
        self._sealed_len = 0
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
