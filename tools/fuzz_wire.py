#!/usr/bin/env python3
"""Fuzz the wire: the mux sniffer, every handshake state, and frames on every channel and side
(issue 7).

The property under fuzz: decoding any byte string either yields frames or raises exactly
one :class:`~flodl_async.errors.WireError` subclass — never another exception, never a hang; nothing
random establishes a handshake or yields a frame its sender did not make; and a connection that
failed stays failed.

Theory of operation. A *target* is one decoder in one state; it turns a per-input PRNG into a
:class:`Case` (the bytes, and how to feed them) and runs it against a fresh decoder, checking the
property as it goes. The targets:

* ``sniff`` — :func:`~flodl_async.wire.channels.sniff` on every prefix of the input, against its
  spec;
* ``server-hello`` / ``server-proof`` — a :class:`~flodl_async.wire.ServerHandshake` fresh, and
  after a
  valid ClientHello (awaiting the proof), on every channel, with session and rank credentials;
* ``client-hello`` — a :class:`~flodl_async.wire.ClientHandshake` awaiting the ServerHello;
* ``wire/<channel>/<side>`` — a :class:`~flodl_async.wire.FrameConnection` after a real handshake,
  fed
  what an outsider can send: mutations of streams a real sender made (not re-tagged) and random
  bytes. Oracle: every delivered frame is the one sent at its position (message and payload), and
  every frame that arrived intact before the damage is delivered;
* ``keyed/<channel>/<side>`` — the same codec fed what a *keyed* but broken peer can send: frames
  forged with the connection's real keys around mutated kinds, sequence numbers, msgpack bodies,
  seals and payload chunks, so the mutation reaches the kind table, GCM, msgpack and the schema.
  Oracle: every delivered message is of a kind legal on that route and well-typed per its schema;
* ``tensors`` — :func:`~flodl_async.wire.tensor.unpack_tensors` on the tensor specs of the
  contributions such a peer can send;
* ``store`` — the TCPStore parser (:mod:`flodl_async.wire.storeproto`) over every request type,
  under its byte budget and value limit, with a second client waiting on its keys.

Most inputs are mutations of valid transcripts (:class:`Mutator`: bit flips, interesting integers
over length, kind and sequence fields, truncations, insertions, deletions, duplicated, dropped and
reordered frames or messages, splices), because random bytes die at the first length check. Each
input is fed under a random plan: cut at random points (whole, byte by byte, at message boundaries),
read through ``frames()``, ``next_frame()``, both, or ``get_buffer``/``buffer_updated``, with EOF at
a random point. After the first failure every later call must fail again, also when a valid
continuation follows.

Every input has its own PRNG, seeded from (seed, target, index): a run is deterministic per seed and
one input replays alone (``--replay TARGET:INDEX``). A violation prints that command and the input's
hex; the run then exits 1. ``--live`` adds a loopback run of a real PortMux and FramedService
(uvloop) against a few thousand connections of fuzzed bytes (see :func:`live`).

    python tools/fuzz_wire.py --inputs 100000 [--seed N] [--live] [--targets 'wire/*']
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import collections
import contextlib
import dataclasses
import enum
import fnmatch
import functools
import hmac
import itertools
import logging
import math
import random
import signal
import struct
import sys
import time
import traceback
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import msgpack
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from flodl_async.deadlines import Deadlines
from flodl_async.errors import (
    HandshakeRefused,
    MalformedBody,
    StoreLimitExceeded,
    StoreProtocolError,
    WireError,
)
from flodl_async.net.admission import AdmissionLimits
from flodl_async.net.framed import FramedProtocol, open_framed
from flodl_async.net.http import StatusHttpProtocol
from flodl_async.net.loop import run as run_loop
from flodl_async.net.mux import PortMux
from flodl_async.net.service import FramedService
from flodl_async.status import StatusBoard
from flodl_async.wire import (
    CHANNEL_MAGIC,
    CLOSED,
    LEGAL_KINDS,
    MAGIC_LEN,
    NEED_DATA,
    PROTOCOL_VERSION,
    Channel,
    ClientHandshake,
    Credential,
    CredentialKind,
    CredentialResolver,
    Direction,
    Established,
    Frame,
    FrameConnection,
    FrameLimits,
    LinkKeys,
    Message,
    NeedMore,
    PeerHello,
    Routed,
    ServerHandshake,
    Side,
    Unrouted,
    registered_kinds,
    sniff,
)
from flodl_async.wire import messages as m
from flodl_async.wire.channels import HTTP_PREFIXES, STORE_PREFIX
from flodl_async.wire.frame import (
    BODY_INDEX,
    GCM_TAG_LEN,
    HEADER,
    SEAL_CHUNK,
    chunk_count,
    seal_nonce,
)
from flodl_async.wire.handshake import session_resolver
from flodl_async.wire.keys import rank_credential_key
from flodl_async.wire.schema import pack_message, sealed_kinds, unpack_message
from flodl_async.wire.storeproto import (
    ENTRY_OVERHEAD,
    VALIDATION_MAGIC,
    Query,
    StoreConnection,
    StoreLimits,
    StoreState,
)
from flodl_async.wire.tensor import DTYPE_ITEMSIZE

FRAMED_CHANNELS = (Channel.JOIN, Channel.RENDEZVOUS, Channel.DATA, Channel.CONTROL)
RUN_ID = "fuzz-run"
VERSION = "fuzz"
#: Payload ceiling of the fuzzed data-channel codecs. The default (64 MiB) is checked the same way
#: but
#: would make every mutated payload length near it allocate tens of MiB, and the run crawl.
TENSOR_CEILING = 1 << 20
#: Plaintext bytes per GCM chunk, per stream: small ones give multi-chunk payloads from a few bytes.
SEAL_CHUNKS = (1, 3, 16, 61, 1024, SEAL_CHUNK)
#: Seconds one sans-IO input may take before the watchdog calls it a hang.
HANG_SECONDS = 10.0

INTERESTING_BYTES = (0x00, 0x01, 0x02, 0x7F, 0x80, 0xFE, 0xFF)
INTERESTING_INTS = (
    *(0, 1, 2, 3, 4, 7, 8, 15, 16, 23, 24, 31, 32, 33, 63, 64, 127, 128, 255, 256),
    *(
        1023,
        1024,
        4095,
        4096,
        65535,
        65536,
        1 << 20,
        (1 << 20) + 1,
        1 << 24,
        (1 << 31) - 1,
        1 << 31,
    ),
    *((1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1),
)
_TEXT_ALPHABET = "abcXYZ019 _-./:=é☃🙂\x00\n\t"


def input_rng(seed: int, *parts: object) -> random.Random:
    """The PRNG of one input (or of a target's set-up): a pure function of the seed and the
    names."""
    # Not for secrets: a seeded, reproducible stream is the point; nothing made here guards
    # anything.
    return random.Random("/".join(map(str, (seed, *parts))))  # noqa: S311


# ----- what a run finds
# ----------------------------------------------------------------------------


class Violation(Exception):
    """One input broke the property: which clause (``check``) and how."""

    def __init__(self, check: str, detail: str) -> None:
        super().__init__(f"{check}: {detail}")
        self.check = check
        self.detail = detail


class Reader(enum.Enum):
    """How a frame codec's input is read."""

    FRAMES = "frames()"
    NEXT_FRAME = "next_frame()"
    MIXED = "frames() and next_frame() in turn"
    BUFFERED = "get_buffer/buffer_updated + frames()"


@dataclass(frozen=True, slots=True, kw_only=True)
class Sent:
    """What a sender put in one frame, for the oracle."""

    #: The message the receiver must decode from it; None when the frame must not be delivered as
    #: sent.
    message: Message | None
    payload: bytes = b""
    #: Offset just past this frame in the stream.
    end: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One input: the bytes, the fixture they go to, how they are fed, and what the oracle knows."""

    data: bytes
    origin: str
    fixture: int = 0
    cuts: tuple[int, ...] = ()
    reader: Reader = Reader.FRAMES
    #: Feed EOF after this many bytes; the rest is never fed. None: no EOF.
    eof_at: int | None = None
    #: Frame targets: the seal chunk both ends use, a tight body ceiling (None: the channel's), what
    #: was sent.
    chunk: int = SEAL_CHUNK
    max_body: int | None = None
    sent: tuple[Sent, ...] = ()
    #: Frame targets: how many leading frames arrive intact and within the ceilings (they must be
    #: delivered).
    intact: int = 0
    #: Client handshake target: the run id the client expects the server to name.
    expect_run_id: str | None = None
    #: Tensors target: the length of the payload the contribution describes.
    payload_len: int = 0

    @property
    def fed(self) -> bytes:
        """The bytes the decoder sees before EOF (all of them when there is no EOF)."""
        return self.data if self.eof_at is None else self.data[: self.eof_at]

    def describe(self) -> str:
        """The plan in one line, for a reproducer."""
        cuts = f"{len(self.cuts)} cuts {list(self.cuts[:12])}{'…' if len(self.cuts) > 12 else ''}"
        eof = "no EOF" if self.eof_at is None else f"EOF after {self.eof_at} bytes"
        return (
            f"fixture {self.fixture}, {len(self.data)} bytes ({self.origin}), {cuts}, "
            f"{self.reader.value}, {eof}, seal chunk {self.chunk}"
        )


@dataclass(slots=True)
class Outcome:
    """What one input did, for the statistics."""

    error: WireError | None = None
    frames: int = 0
    established: bool = False
    label: str = ""


# ----- the mutation engine
# -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """A valid input to mutate, with hints: where its units (messages, frames) start, where its
    integer fields lie."""

    data: bytes
    units: tuple[int, ...] = ()
    #: (offset, width) of length, kind, version and sequence fields.
    fields: tuple[tuple[int, int], ...] = ()


Operator = Callable[["Mutator", bytearray, Sample], None]
_OPERATORS: list[Operator] = []


def _operator(fn: Operator) -> Operator:
    _OPERATORS.append(fn)
    return fn


class Mutator:
    """Stacked byte- and structure-level mutations of a :class:`Sample`, driven by one input's
    PRNG."""

    def __init__(
        self, rng: random.Random, *, donors: Sequence[bytes] = (), tokens: Sequence[bytes] = ()
    ) -> None:
        self.rng = rng
        self._donors = donors
        self._tokens = tokens

    def mutate(self, sample: Sample, *, max_ops: int = 4) -> tuple[bytes, tuple[str, ...]]:
        """A mutant of ``sample`` and the names of the operators that made it."""
        data = bytearray(sample.data)
        names = []
        for _ in range(self.rng.randint(1, max_ops)):
            op = self.rng.choice(_OPERATORS)
            op(self, data, sample)
            names.append(op.__name__)
        return bytes(data), tuple(names)

    def _at(self, data: bytearray, *, end: bool = False) -> int:
        return self.rng.randrange(len(data) + (1 if end else 0)) if data or end else 0

    def _unit(self, data: bytearray, sample: Sample) -> tuple[int, int] | None:
        """A unit's [start, end) in ``data`` (the sample's boundaries, clamped: they are hints after
        other edits)."""
        bounds = sorted({0, *sample.units, len(sample.data)})
        if len(bounds) < 2:
            return None
        i = self.rng.randrange(len(bounds) - 1)
        start, end = min(bounds[i], len(data)), min(bounds[i + 1], len(data))
        return (start, end) if start < end else None

    @_operator
    def flip_bit(self, data: bytearray, sample: Sample) -> None:
        if data:
            data[self._at(data)] ^= 1 << self.rng.randrange(8)

    @_operator
    def set_byte(self, data: bytearray, sample: Sample) -> None:
        if data:
            data[self._at(data)] = (
                self.rng.choice(INTERESTING_BYTES)
                if self.rng.random() < 0.6
                else self.rng.randrange(256)
            )

    @_operator
    def put_int(self, data: bytearray, sample: Sample) -> None:
        if sample.fields and self.rng.random() < 0.8:
            offset, width = self.rng.choice(sample.fields)
        else:
            offset, width = self._at(data), self.rng.choice((1, 2, 4, 8))
        value = (self.rng.choice(INTERESTING_INTS) + self.rng.choice((0, 0, 0, -1, 1))) % (
            1 << (8 * width)
        )
        data[offset : offset + width] = value.to_bytes(
            width, "little" if self.rng.random() < 0.8 else "big"
        )

    @_operator
    def insert_bytes(self, data: bytearray, sample: Sample) -> None:
        at = self._at(data, end=True)
        if self._tokens and self.rng.random() < 0.3:
            data[at:at] = self.rng.choice(self._tokens)
        else:
            data[at:at] = self.rng.randbytes(self.rng.randint(1, 16))

    @_operator
    def delete_range(self, data: bytearray, sample: Sample) -> None:
        at = self._at(data)
        del data[at : at + self.rng.randint(1, 32)]

    @_operator
    def truncate(self, data: bytearray, sample: Sample) -> None:
        del data[self._at(data, end=True) :]

    @_operator
    def duplicate_range(self, data: bytearray, sample: Sample) -> None:
        if data:
            start = self._at(data)
            piece = data[start : start + self.rng.randint(1, 64)]
            at = self._at(data, end=True)
            data[at:at] = piece

    @_operator
    def swap_adjacent(self, data: bytearray, sample: Sample) -> None:
        if len(data) > 2:
            a = self.rng.randrange(len(data) - 1)
            b = self.rng.randint(a + 1, min(len(data), a + 64))
            c = self.rng.randint(b, min(len(data), b + 64))
            data[a:c] = data[b:c] + data[a:b]

    @_operator
    def drop_unit(self, data: bytearray, sample: Sample) -> None:
        unit = self._unit(data, sample)
        if unit is not None:
            del data[unit[0] : unit[1]]

    @_operator
    def duplicate_unit(self, data: bytearray, sample: Sample) -> None:
        unit = self._unit(data, sample)
        if unit is not None:
            data[unit[1] : unit[1]] = data[unit[0] : unit[1]]

    @_operator
    def swap_units(self, data: bytearray, sample: Sample) -> None:
        first, second = self._unit(data, sample), self._unit(data, sample)
        if first is not None and second is not None and first != second:
            (a, b), (c, d) = sorted((first, second))
            if b <= c:
                data[a:d] = data[c:d] + data[b:c] + data[a:b]

    @_operator
    def cut_inside_unit(self, data: bytearray, sample: Sample) -> None:
        unit = self._unit(data, sample)
        if unit is not None:
            del data[self.rng.randint(*unit) :]

    @_operator
    def splice(self, data: bytearray, sample: Sample) -> None:
        if self._donors:
            donor = self.rng.choice(self._donors)
            data[self._at(data, end=True) :] = donor[self.rng.randrange(len(donor) + 1) :]


def random_cuts(rng: random.Random, length: int, units: Sequence[int] = ()) -> tuple[int, ...]:
    """Where to cut ``length`` bytes into reads: nowhere, everywhere, around unit boundaries, or at
    random."""
    roll = rng.random()
    if length < 2 or roll < 0.25:
        return ()
    if roll < 0.35:
        return (
            tuple(range(1, length))
            if length <= 512
            else tuple(sorted(rng.sample(range(1, length), 256)))
        )
    if roll < 0.65 and units:
        return tuple(
            sorted({u + rng.choice((-1, 0, 0, 0, 1)) for u in units} & set(range(1, length)))
        )
    return tuple(sorted(rng.sample(range(1, length), min(length - 1, rng.randint(1, 8)))))


def random_eof(rng: random.Random, length: int) -> int | None:
    """EOF after everything, at a random point, or never."""
    roll = rng.random()
    if roll < 0.35:
        return length
    if roll < 0.5:
        return rng.randint(0, length)
    return None


def pieces(data: bytes, cuts: Sequence[int]) -> Iterator[bytes]:
    """``data`` cut at ``cuts`` (offsets beyond it are ignored); no empty piece."""
    points = sorted({0, len(data), *(c for c in cuts if 0 < c < len(data))})
    for start, end in itertools.pairwise(points):
        yield data[start:end]


def common_prefix(a: bytes, b: bytes) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


# ----- messages: random, mutated, and checked against their schema
# ----------------------------------

_HINTS: dict[type[Message], dict[str, typing.Any]] = {}


def _hints(cls: type[Message]) -> dict[str, typing.Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def random_text(rng: random.Random, max_len: int = 12) -> str:
    """Short text, some of it outside ASCII (never a lone surrogate: no sender can encode one)."""
    return "".join(rng.choice(_TEXT_ALPHABET) for _ in range(rng.randint(0, max_len)))


def random_int(rng: random.Random) -> int:
    """An int msgpack can carry, often a boundary value."""
    if rng.random() < 0.5:
        return rng.randint(-3, 300)
    value = rng.choice(INTERESTING_INTS)
    return (
        value if value < 1 << 63 and rng.random() < 0.5 else (-value if value <= 1 << 63 else value)
    )


def random_float(rng: random.Random) -> float:
    """A finite or infinite float (never NaN: the oracle compares messages with ==)."""
    return rng.choice(
        (0.0, -0.0, 1.5, -2.25, 1e-310, 1e308, math.inf, -math.inf, rng.uniform(-1e6, 1e6))
    )


def random_value(rng: random.Random, hint: typing.Any) -> object:
    """A value of the schema type ``hint`` (what a correct sender may put in that field)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        return tuple(random_value(rng, args[0]) for _ in range(rng.randint(0, 3)))
    if origin is dict:
        return {random_text(rng, 6): random_value(rng, args[1]) for _ in range(rng.randint(0, 3))}
    if origin in (types.UnionType, typing.Union):
        options = [a for a in args if a is not type(None)]
        return (
            None
            if len(options) < len(args) and rng.random() < 0.4
            else random_value(rng, rng.choice(options))
        )
    if isinstance(hint, type) and issubclass(hint, Message):
        return random_message(rng, hint)
    if hint is bool:
        return rng.random() < 0.5
    if hint is int:
        return random_int(rng)
    if hint is float:
        return random_float(rng)
    if hint is str:
        return random_text(rng)
    if hint is bytes:
        return rng.randbytes(rng.randint(0, 16))
    raise TypeError(f"no generator for {hint!r}")


def random_message(rng: random.Random, cls: type[Message]) -> Message:
    """A random, well-typed instance of ``cls``."""
    hints = _hints(cls)
    return cls(
        **{
            f.name: random_value(rng, hints[f.name])
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            if f.init  # a retired position is not settable: it travels as its default
        }
    )


#: The messages that carry tensors (their bytes follow the body as the frame's payload).
TENSOR_MESSAGES: frozenset[type[Message]] = frozenset(
    {m.Contribution, m.HostContribution, m.Consensus}
)


def random_with_payload(rng: random.Random, cls: type[Message]) -> tuple[Message, bytes]:
    """A random ``cls`` and its payload: for a tensor message, consistent specs (laid end to end,
    as a rank's data link lays them out) and their bytes; for any other, no payload."""
    msg = random_message(rng, cls)
    if cls not in TENSOR_MESSAGES:
        return msg, b""
    specs, offset = [], 0
    for i in range(rng.randint(0, 4)):
        dtype = rng.choice(sorted(DTYPE_ITEMSIZE))
        shape = tuple(rng.randint(0, 5) for _ in range(rng.randint(0, 3)))
        nbytes = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
        specs.append(
            m.TensorSpec(
                name=f"t{i}.{random_text(rng, 4)}",
                dtype=dtype,
                shape=shape,
                offset=offset,
                nbytes=nbytes,
            )
        )
        offset += nbytes
    if rng.random() < 0.2:
        offset += rng.randint(1, 3000)  # a bigger payload: many GCM chunks with a small seal chunk
    return dataclasses.replace(msg, tensors=tuple(specs)), rng.randbytes(offset)  # type: ignore[type-var]


def conforms(value: object, hint: typing.Any) -> bool:
    """Whether ``value`` has exactly the schema type ``hint`` (what a decoded message must
    satisfy)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        return type(value) is tuple and all(conforms(v, args[0]) for v in value)
    if origin is dict:
        return type(value) is dict and all(
            type(k) is str and conforms(v, args[1]) for k, v in value.items()
        )
    if origin in (types.UnionType, typing.Union):
        return any(value is None if a is type(None) else conforms(value, a) for a in args)
    if isinstance(hint, type) and issubclass(hint, Message):
        hints = _hints(hint)
        return type(value) is hint and all(
            conforms(getattr(value, f.name), hints[f.name])
            for f in dataclasses.fields(hint)  # type: ignore[arg-type]
        )
    return type(value) is hint


def random_plain(rng: random.Random, depth: int = 0) -> object:
    """Any msgpack value, biased to what trips schema decoding (wrong types, bytes and int map
    keys)."""
    roll = rng.randrange(10 if depth < 3 else 8)
    if roll == 0:
        return None
    if roll == 1:
        return rng.random() < 0.5
    if roll in (2, 3):
        return random_int(rng)
    if roll == 4:
        return random_float(rng)
    if roll == 5:
        return random_text(rng)
    if roll in (6, 7):
        return rng.randbytes(rng.randint(0, 8))
    if roll == 8:
        return [random_plain(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = (random_text(rng, 4), rng.randbytes(2), rng.randint(-2, 2))
    return {rng.choice(keys): random_plain(rng, depth + 1) for _ in range(rng.randint(0, 3))}


#: A place in a msgpack tree: a list and an index, or a map and a key.
Slot = tuple[list[object], int] | tuple[dict[object, object], object]


def _get(slot: Slot) -> object:
    container, key = slot
    return container[key] if isinstance(container, dict) else container[typing.cast(int, key)]


def _put(slot: Slot, value: object) -> None:
    container, key = slot
    if isinstance(container, dict):
        container[key] = value
    else:
        container[typing.cast(int, key)] = value


def _slots(tree: object, out: list[Slot], budget: int = 64) -> None:
    """Every (container, key) in a msgpack tree, for a mutation to replace (at most ``budget``)."""
    if isinstance(tree, list):
        for i, child in enumerate(tree):
            if len(out) >= budget:
                return
            out.append((tree, i))
            _slots(child, out, budget)
    elif isinstance(tree, dict):
        for key, child in list(tree.items()):
            if len(out) >= budget:
                return
            out.append((tree, key))
            _slots(child, out, budget)


def confuse(rng: random.Random, value: object) -> object:
    """A value of a neighbouring msgpack type: str and bin, int and float, bool and int, array and
    map."""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes):
        return value.decode("latin-1")
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return float(value) if abs(value) < 1 << 53 else rng.choice((True, None))
    if isinstance(value, float):
        return int(value) if math.isfinite(value) else str(value)
    if isinstance(value, list):
        return (
            dict(enumerate(value))
            if rng.random() < 0.5
            else {str(i): v for i, v in enumerate(value)}
        )
    if isinstance(value, dict):
        return (
            [*value.values()]
            if rng.random() < 0.5
            else {(k.encode() if isinstance(k, str) else k): v for k, v in value.items()}
        )
    return rng.choice((0, "", b"", [], {}))


def mutate_body(rng: random.Random, body: bytes) -> bytes:
    """A value-level mutant of a msgpack body: a field retyped or replaced, fields dropped or added,
    the version changed, nested."""
    tree: object = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=False)
    slots: list[Slot] = []
    _slots(tree, slots)
    roll = rng.randrange(8)
    if roll == 0 and slots:
        _put(rng.choice(slots), random_plain(rng))
    elif roll == 1 and slots:
        slot = rng.choice(slots)
        _put(slot, confuse(rng, _get(slot)))
    elif roll == 7:  # a map key of another type (a str field's key as bin)
        maps = [c for c, _ in slots if isinstance(c, dict) and c]
        if maps:
            target = rng.choice(maps)
            key = rng.choice(list(target))
            target[confuse(rng, key)] = target.pop(key)
    elif roll == 2 and isinstance(tree, list):
        del tree[rng.randrange(len(tree) + 1) :]
    elif roll == 3 and isinstance(tree, list):
        tree.extend(random_plain(rng) for _ in range(rng.randint(1, 3)))
    elif roll == 4 and isinstance(tree, list) and tree:
        tree[0] = rng.choice((0, -1, 2, 255, "1", None, 1.0, True))
    elif roll == 5:
        for _ in range(rng.choice((1, 2, 100, 2000))):
            tree = [tree]
    else:
        tree = {random_text(rng, 3): tree} if rng.random() < 0.5 else random_plain(rng)
    try:
        return msgpack.packb(tree, use_bin_type=True)  # type: ignore[no-any-return]
    # nested past the packer's limit: keep the original
    except (ValueError, OverflowError, TypeError):
        return body


# ----- fixtures: real handshakes with fixed nonces, and forged frames
# -------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkPair:
    """Both ends' keys of one connection, from a real handshake."""

    peer: LinkKeys
    controller: LinkKeys

    def sender(self, direction: Direction) -> LinkKeys:
        """The keys of whoever sends frames travelling ``direction``."""
        return self.peer if direction is Direction.TO_CONTROLLER else self.controller


def relay_resolver(secret: bytes, *, ranks: frozenset[int], round_: int) -> CredentialResolver:
    """A relay's resolver (as :meth:`flodl_async.relay.control.Relay._rank_key`): its ranks'
    credentials, in its round."""

    def resolve(peer: PeerHello) -> bytes:
        if peer.kind is not CredentialKind.RANK or peer.rank not in ranks or peer.round != round_:
            raise HandshakeRefused(
                f"rank credential for round {peer.round}, rank {peer.rank} not taken here"
            )
        return rank_credential_key(secret, run_id=RUN_ID, round=peer.round, rank=peer.rank)

    return resolve


@dataclass(frozen=True, slots=True, kw_only=True)
class HandshakeFixture:
    """One complete, valid handshake with fixed nonces: every message of it, and what each side must
    learn."""

    channel: Channel
    credential: Credential
    resolve: CredentialResolver
    client_nonce: bytes
    server_nonce: bytes
    client_version: str
    hello: bytes
    server_hello: bytes
    proof: bytes
    #: The client's first frames, sent right after its proof.
    first_frames: bytes
    client_side: Established
    server_side: Established
    #: A ServerHello that refuses (another credential's fixture would be refused this way).
    refusal: bytes

    def server(self) -> ServerHandshake:
        """A fresh server that answers this fixture's hello with this fixture's ServerHello."""
        return ServerHandshake(
            channel=self.channel,
            resolve=self.resolve,
            run_id=RUN_ID,
            version=VERSION,
            nonce=self.server_nonce,
        )

    def client(self, *, expect_run_id: str | None = None) -> ClientHandshake:
        """A fresh client whose hello is this fixture's hello."""
        return ClientHandshake(
            channel=self.channel,
            credential=self.credential,
            version=self.client_version,
            expect_run_id=expect_run_id,
            nonce=self.client_nonce,
        )

    def describe(self) -> str:
        """Channel and credential, for a reproducer."""
        return (
            f"{self.channel.value} channel, {self.credential.kind.name.lower()} credential "
            f"(round {self.credential.round}, rank {self.credential.rank})"
        )


def handshake_fixture(
    rng: random.Random, secret: bytes, channel: Channel, kind: CredentialKind
) -> HandshakeFixture:
    """Run a real handshake in memory with nonces from ``rng``."""
    if kind is CredentialKind.SESSION:
        credential, resolve = Credential.session(secret), session_resolver(secret)
    else:
        round_, rank = rng.randint(0, 3), rng.randint(0, 7)
        credential = Credential.for_rank(secret, run_id=RUN_ID, round=round_, rank=rank)
        resolve = relay_resolver(secret, ranks=frozenset({rank, rank + 1}), round_=round_)
    version = random_text(rng, 8) or VERSION
    while len(version.encode()) > 64:
        version = version[:-1]
    client_nonce, server_nonce = rng.randbytes(32), rng.randbytes(32)
    client = ClientHandshake(
        channel=channel, credential=credential, version=version, nonce=client_nonce
    )
    server = ServerHandshake(
        channel=channel, resolve=resolve, run_id=RUN_ID, version=VERSION, nonce=server_nonce
    )
    hello = client.hello()
    answer = server.receive_data(hello)
    proof = client.receive_data(answer.send)
    done = server.receive_data(proof.send)
    assert proof.established is not None
    assert done.established is not None
    codec = FrameConnection(channel=channel, side=Side.PEER, keys=proof.established.keys)
    first_frames = b""
    for cls in sorted(LEGAL_KINDS[(channel, Direction.TO_CONTROLLER)], key=lambda cls: cls.KIND):
        if cls in TENSOR_MESSAGES:
            msg, payload = random_with_payload(rng, cls)
            first_frames += b"".join(map(bytes, codec.send_parts(msg, [payload])))
        else:
            first_frames += codec.send(random_message(rng, cls))
    refuser = ServerHandshake(
        channel=channel,
        resolve=relay_resolver(secret, ranks=frozenset(), round_=-1),
        run_id=RUN_ID,
        version=VERSION,
    )
    refusal = refuser.receive_data(hello).send
    return HandshakeFixture(
        channel=channel,
        credential=credential,
        resolve=resolve,
        client_nonce=client_nonce,
        server_nonce=server_nonce,
        client_version=version,
        hello=hello,
        server_hello=answer.send,
        proof=proof.send,
        first_frames=first_frames,
        client_side=proof.established,
        server_side=done.established,
        refusal=refusal,
    )


def link_pair(rng: random.Random, secret: bytes, channel: Channel) -> LinkPair:
    """Both ends' frame keys from a real handshake on ``channel``."""
    fixture = handshake_fixture(rng, secret, channel, CredentialKind.SESSION)
    return LinkPair(peer=fixture.client_side.keys, controller=fixture.server_side.keys)


def frame_fields(start: int) -> tuple[tuple[int, int], ...]:
    """(offset, width) of the header fields of a frame starting at ``start``."""
    return tuple(
        (start + offset, width)
        for offset, width in ((0, 1), (1, 1), (2, 2), (4, 8), (12, 4), (16, 8))
    )


class Forger:
    """Builds frames from their parts with one direction's real keys: anything a keyed peer can put
    on the wire.

    It follows the format of :mod:`flodl_async.wire.frame` independently (it is the oracle's
    sender), and
    can break any step the receiver checks after the tag: the kind, the sequence number, the seal of
    the body, one payload chunk's ciphertext (the HMAC covers only the chunks' GCM tags).
    """

    def __init__(self, keys: LinkKeys) -> None:
        self._mac = keys.send_mac
        self._aead = AESGCM(keys.send_aead)

    def frame(
        self,
        *,
        kind: int,
        seq: int,
        body: bytes,
        seal_body: bool,
        payload: bytes = b"",
        chunk: int = SEAL_CHUNK,
        version: int = PROTOCOL_VERSION,
        flags: int = 0,
        spoil_chunk: int | None = None,
    ) -> bytes:
        """One frame with a valid tag; ``spoil_chunk`` flips a ciphertext bit of that payload
        chunk."""
        header = HEADER.pack(
            version, flags, kind, seq, len(body) + (GCM_TAG_LEN if seal_body else 0), len(payload)
        )
        wire_body = (
            self._aead.encrypt(seal_nonce(seq, BODY_INDEX), body, header) if seal_body else body
        )
        sealed, tags = bytearray(), bytearray()
        for index in range(chunk_count(len(payload), chunk)):
            piece = bytearray(
                self._aead.encrypt(
                    seal_nonce(seq, index), payload[index * chunk : (index + 1) * chunk], header
                )
            )
            if index == spoil_chunk:
                piece[0] ^= 0x01
            sealed += piece
            tags += piece[-GCM_TAG_LEN:]
        return (
            header
            + wire_body
            + sealed
            + hmac.digest(self._mac, header + wire_body + tags, "sha256")
        )


# ----- drivers: feed a decoder under a plan, and hold it to "a failed connection stays failed"
# ------


@dataclass(slots=True)
class Fed:
    """What a frame codec yielded under one plan."""

    frames: list[Frame] = field(default_factory=list)
    error: WireError | None = None
    closed: bool = False


def _pull(conn: FrameConnection, reader: Reader, turn: int, out: list[Frame]) -> None:
    """Collect what the codec yields now, appending as it goes (so frames before a raise are
    kept)."""
    if reader is Reader.NEXT_FRAME or (reader is Reader.MIXED and turn % 2):
        while True:
            item = conn.next_frame()
            if item is NEED_DATA or item is CLOSED:
                return
            assert isinstance(item, Frame)
            out.append(item)
    out.extend(conn.frames())


def _push_buffered(conn: FrameConnection, piece: bytes, turn: int, out: list[Frame]) -> None:
    """One socket read of ``piece`` the BufferedProtocol way: as many get_buffer/buffer_updated
    rounds as it takes."""
    view = memoryview(piece)
    while view:
        target = conn.get_buffer(-1)
        if not len(target):
            # asyncio and uvloop close the transport with a fatal error on an empty buffer.
            raise Violation(
                "empty get_buffer",
                "get_buffer() returned an empty buffer while bytes were still to come",
            )
        n = min(len(target), len(view))
        target[:n] = view[:n]
        target.release()
        view = view[n:]
        conn.buffer_updated(n)
        _pull(conn, Reader.FRAMES, turn, out)


def stays_failed(conn: FrameConnection, first: WireError, *, more: bytes) -> None:
    """After ``first``, every later call raises again, with the same class (also after more
    bytes)."""
    if conn.failure is not first:
        raise Violation(
            "failure attribute", f"after {first!r}, FrameConnection.failure is {conn.failure!r}"
        )

    def more_then_frames() -> list[Frame]:
        conn.receive_data(more)
        return conn.frames()

    calls: list[tuple[str, Callable[[], object]]] = [
        ("frames()", conn.frames),
        ("next_frame()", conn.next_frame),
    ]
    if more:
        calls.append(("receive_data(more) + frames()", more_then_frames))
    calls.append(("next_frame()", conn.next_frame))
    for name, call in calls:
        try:
            got = call()
        except WireError as exc:
            if type(exc) is not type(first):
                raise Violation(
                    "stays failed",
                    f"after {type(first).__name__}, {name} raised {type(exc).__name__}",
                ) from exc
        else:
            raise Violation("stays failed", f"after {first!r}, {name} returned {got!r}")


def feed_frames(conn: FrameConnection, case: Case) -> Fed:
    """Feed ``case`` to ``conn`` under its plan; returns what was delivered and the error that ended
    it."""
    fed = Fed()
    data, offset = case.fed, 0
    for turn, piece in enumerate(pieces(data, case.cuts)):
        offset += len(piece)
        try:
            if case.reader is Reader.BUFFERED:
                _push_buffered(conn, piece, turn, fed.frames)
            else:
                conn.receive_data(piece)
                _pull(conn, case.reader, turn, fed.frames)
        except WireError as exc:
            fed.error = exc
        else:
            # frames() delivered good frames and holds the error for the next call
            fed.error = conn.failure
        if fed.error is not None:
            # the rest of the input still arrives
            stays_failed(conn, fed.error, more=data[offset:] + b"\x00")
            return fed
    if case.eof_at is None:
        return fed
    conn.receive_data(b"")
    try:
        _pull(conn, case.reader, 0, fed.frames)
        if conn.failure is None:
            end = conn.next_frame()
            if end is not CLOSED:
                raise Violation(
                    "hang at EOF",
                    f"after EOF, next_frame() returned {end!r} instead of CLOSED or an error",
                )
            fed.closed = True
    except WireError as exc:
        fed.error = exc
    if conn.failure is not None:
        fed.error = fed.error or conn.failure
        stays_failed(conn, fed.error, more=b"")
    return fed


@dataclass(slots=True)
class HandshakeRun:
    """What a handshake did under one plan."""

    error: WireError | None = None
    established: Established | None = None
    #: Bytes fed up to and including the call that established.
    consumed: int = 0


def handshake_stays_failed(
    hs: ServerHandshake | ClientHandshake,
    first: WireError,
    later: Sequence[bytes],
    *,
    refused: bool,
) -> None:
    """After ``first``, no later call produces anything: not the rest of the input, not even a valid
    continuation.

    After a refusal (``Step.failure``, server only) the handshake is finished and says so with
    ``RuntimeError``; after a raised error it must raise a :class:`WireError` again.
    """
    for piece in later:
        try:
            step = hs.receive_data(piece)
        except WireError:
            continue
        except RuntimeError:
            if refused:
                continue
            raise
        what = (
            "established"
            if step.established
            else f"answered {len(step.send)} bytes"
            if step.send
            else "returned a step"
        )
        raise Violation(
            "revived after failure",
            f"after {type(first).__name__} ({first}), receive_data({len(piece)} bytes: "
            f"{piece[:8].hex()}…) {what} instead of raising",
        )


def drive_handshake(
    hs: ServerHandshake | ClientHandshake, case: Case, *, continuation: Sequence[bytes]
) -> HandshakeRun:
    """Feed ``case`` to a handshake under its plan, then hold a failure to
    :func:`handshake_stays_failed`."""
    run = HandshakeRun()
    chunks = list(pieces(case.fed, case.cuts)) + ([b""] if case.eof_at is not None else [])
    for i, piece in enumerate(chunks):
        try:
            step = hs.receive_data(piece)
        except WireError as exc:
            run.error = exc
            handshake_stays_failed(
                hs, exc, [*chunks[i + 1 :], *continuation, b"\x00"], refused=False
            )
            return run
        run.consumed += len(piece)
        if step.failure is not None:
            if isinstance(hs, ClientHandshake):
                raise Violation(
                    "client refusal", "a client handshake returned a failure instead of raising it"
                )
            run.error = step.failure
            handshake_stays_failed(
                hs, step.failure, [*chunks[i + 1 :], *continuation], refused=True
            )
            return run
        if step.established is not None:
            run.established = step.established
            return run
    return run


def check_established(
    run: HandshakeRun, case: Case, *, needed: bytes, expected: Established
) -> None:
    """An established handshake consumed exactly the valid bytes, hands on the rest, and learned the
    truth."""
    assert run.established is not None
    fed = case.fed[: run.consumed]
    if not fed.startswith(needed):
        raise Violation(
            "forged handshake",
            f"established on {fed[: len(needed)].hex()}, which is not the valid {needed.hex()}",
        )
    got = run.established
    if got.leftover != fed[len(needed) :]:
        raise Violation(
            "leftover",
            f"established with leftover {got.leftover.hex()}, but {fed[len(needed) :].hex()} "
            "followed the handshake",
        )
    if (got.keys, got.run_id, got.peer) != (expected.keys, expected.run_id, expected.peer):
        raise Violation(
            "forged handshake",
            f"established as {got.peer} of {got.run_id!r} with other keys than the valid "
            "transcript's",
        )


# ----- targets
# -------------------------------------------------------------------------------------


class Target(abc.ABC):
    """One decoder in one state: makes cases from a PRNG and runs them against fresh decoders."""

    name: str
    group: str
    weight: float = 1.0

    @abc.abstractmethod
    def generate(self, rng: random.Random) -> Case:
        """One input."""

    @abc.abstractmethod
    def execute(self, case: Case) -> Outcome:
        """Run one input; raises :class:`Violation` when the property breaks."""

    def describe(self, case: Case) -> str:
        """What the case's fixture is, for a reproducer."""
        return case.describe()


def _magic_samples() -> list[Sample]:
    heads = [*CHANNEL_MAGIC.values(), *HTTP_PREFIXES, STORE_PREFIX]
    return [
        Sample(data=head + tail, units=(0, len(head)))
        for head in heads
        for tail in (b"", b"\x02\x01", b" / HTTP/1.1\r\n")
    ]


class SniffTarget(Target):
    """The mux sniffer on every prefix of arbitrary bytes, against its specification."""

    name = "sniff"
    group = "sniff"
    weight = 3.0

    def __init__(self, seed: int) -> None:
        self._samples = _magic_samples()

    def generate(self, rng: random.Random) -> Case:
        if rng.random() < 0.2:
            data, origin = rng.randbytes(rng.randint(0, 8)), "random"
        else:
            data, ops = Mutator(rng, donors=[s.data for s in self._samples]).mutate(
                rng.choice(self._samples), max_ops=2
            )
            origin = "mutated: " + ", ".join(ops)
        return Case(data=data, origin=origin)

    @staticmethod
    def spec(prefix: bytes) -> tuple[str, Channel | None, bytes]:
        """What sniff must answer for ``prefix`` (channels.py's theory of operation)."""
        if prefix[:1] == STORE_PREFIX[:1]:  # torch's VALIDATE: all five bytes, none consumed
            if prefix[: len(STORE_PREFIX)] == STORE_PREFIX:
                return ("routed", Channel.STORE, prefix)
            return ("need more" if STORE_PREFIX.startswith(prefix) else "unrouted", None, b"")
        if len(prefix) < MAGIC_LEN:
            fits = not prefix or any(
                c.startswith(prefix) for c in (*CHANNEL_MAGIC.values(), *HTTP_PREFIXES)
            )
            return ("need more" if fits else "unrouted", None, b"")
        head = prefix[:MAGIC_LEN]
        for channel, magic in CHANNEL_MAGIC.items():
            if head == magic:
                return ("routed", channel, prefix[MAGIC_LEN:])
        return (
            ("routed", Channel.STATUS, prefix) if head in HTTP_PREFIXES else ("unrouted", None, b"")
        )

    def execute(self, case: Case) -> Outcome:
        label = ""
        for k in sorted({*range(min(len(case.data), len(STORE_PREFIX) + 1) + 1), len(case.data)}):
            result = sniff(case.data[:k])
            if isinstance(result, Routed):
                got: tuple[str, Channel | None, bytes] = ("routed", result.channel, result.leftover)
            elif isinstance(result, Unrouted):
                got = ("unrouted", None, b"")
            elif isinstance(result, NeedMore):
                got = ("need more", None, b"")
            else:
                raise Violation("sniff result", f"sniff({case.data[:k].hex()}) returned {result!r}")
            if got != self.spec(case.data[:k]):
                raise Violation(
                    "sniff spec",
                    f"sniff({case.data[:k].hex()}) returned {result!r}, the spec says "
                    f"{self.spec(case.data[:k])}",
                )
            label = got[0] if got[1] is None else f"routed: {got[1].value}"
        return Outcome(label=label)


class _HandshakeTarget(Target):
    """Fixtures for every channel, with a session and a rank credential."""

    group = "handshake"
    weight = 6.0

    def __init__(self, seed: int) -> None:
        rng = input_rng(seed, self.name, "setup")
        secret = rng.randbytes(16)
        self.fixtures = [
            handshake_fixture(rng, secret, channel, kind)
            for channel in FRAMED_CHANNELS
            for kind in (CredentialKind.SESSION, CredentialKind.RANK)
        ]
        self._donors = [
            d
            for f in self.fixtures
            for d in (f.hello, f.server_hello, f.proof + f.first_frames, f.refusal)
        ]

    @abc.abstractmethod
    def sample(self, fixture: HandshakeFixture) -> Sample:
        """The valid bytes this state expects, to mutate."""

    def generate(self, rng: random.Random) -> Case:
        index = rng.randrange(len(self.fixtures))
        sample = self.sample(self.fixtures[index])
        roll = rng.random()
        if roll < 0.12:
            data, origin = rng.randbytes(rng.randint(0, 160)), "random"
        elif roll < 0.25:
            data, origin = sample.data, "valid"
        else:
            data, ops = Mutator(rng, donors=self._donors).mutate(sample)
            origin = "mutated: " + ", ".join(ops)
        return Case(
            data=data,
            origin=origin,
            fixture=index,
            cuts=random_cuts(rng, len(data), sample.units),
            eof_at=random_eof(rng, len(data)),
        )

    def describe(self, case: Case) -> str:
        return f"{self.fixtures[case.fixture].describe()}; {case.describe()}"


def _hello_fields(start: int = 0) -> tuple[tuple[int, int], ...]:
    """The preamble of a handshake message (version, kind or status, length) and the version-length
    byte."""
    return ((start, 1), (start + 1, 1), (start + 2, 2), (start + 44, 1))


class ServerHelloTarget(_HandshakeTarget):
    """A fresh server handshake fed a client's hello, proof and first frames (or what became of
    them)."""

    name = "server-hello"

    def sample(self, fixture: HandshakeFixture) -> Sample:
        h = len(fixture.hello)
        return Sample(
            data=fixture.hello + fixture.proof + fixture.first_frames,
            units=(0, h, h + 32),
            fields=_hello_fields(),
        )

    def execute(self, case: Case) -> Outcome:
        fixture = self.fixtures[case.fixture]
        run = drive_handshake(fixture.server(), case, continuation=(fixture.hello, fixture.proof))
        if run.established is not None:
            check_established(
                run, case, needed=fixture.hello + fixture.proof, expected=fixture.server_side
            )
        return Outcome(error=run.error, established=run.established is not None)


class ServerProofTarget(_HandshakeTarget):
    """A server handshake that answered a valid hello, fed the proof and first frames (or what
    became of them)."""

    name = "server-proof"

    def sample(self, fixture: HandshakeFixture) -> Sample:
        return Sample(
            data=fixture.proof + fixture.first_frames, units=(0, 32), fields=frame_fields(32)
        )

    def execute(self, case: Case) -> Outcome:
        fixture = self.fixtures[case.fixture]
        server = fixture.server()
        answer = server.receive_data(fixture.hello)
        assert answer.send == fixture.server_hello
        run = drive_handshake(server, case, continuation=(fixture.proof,))
        if run.established is not None:
            check_established(run, case, needed=fixture.proof, expected=fixture.server_side)
        return Outcome(error=run.error, established=run.established is not None)


class ClientHelloTarget(_HandshakeTarget):
    """A client handshake that sent its hello, fed the server's hello or refusal (or what became of
    them)."""

    name = "client-hello"

    def sample(self, fixture: HandshakeFixture) -> Sample:
        return Sample(
            data=fixture.server_hello,
            units=(0, len(fixture.server_hello) - 32),
            fields=(*_hello_fields(), (36, 1)),
        )

    def generate(self, rng: random.Random) -> Case:
        case = super().generate(rng)
        if rng.random() < 0.15:  # a refusal, or the server's hello followed by early bytes
            fixture = self.fixtures[case.fixture]
            data = (
                fixture.refusal
                if rng.random() < 0.5
                else fixture.server_hello + fixture.first_frames
            )
            data = (
                Mutator(rng, donors=self._donors).mutate(Sample(data=data, fields=_hello_fields()))[
                    0
                ]
                if rng.random() < 0.7
                else data
            )
            case = dataclasses.replace(
                case,
                data=data,
                origin="refusal or early bytes",
                cuts=random_cuts(rng, len(data)),
                eof_at=random_eof(rng, len(data)),
            )
        # Some clients check the run id the server names: a mismatch fails after the proof verified.
        return dataclasses.replace(case, expect_run_id=rng.choice((None, RUN_ID, "another-run")))

    def execute(self, case: Case) -> Outcome:
        fixture = self.fixtures[case.fixture]
        run = drive_handshake(
            fixture.client(expect_run_id=case.expect_run_id),
            case,
            continuation=(fixture.server_hello,),
        )
        if run.established is not None:
            if case.expect_run_id not in (None, RUN_ID):
                raise Violation(
                    "run id",
                    f"established with a server of {run.established.run_id!r} though "
                    f"{case.expect_run_id!r} was expected",
                )
            check_established(run, case, needed=fixture.server_hello, expected=fixture.client_side)
        return Outcome(error=run.error, established=run.established is not None)

    def describe(self, case: Case) -> str:
        return f"{super().describe(case)}; expect_run_id={case.expect_run_id!r}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Stream:
    """A valid frame stream a real sender made, and what each frame carried."""

    data: bytes
    sent: tuple[Sent, ...]
    chunk: int
    sample: Sample


class _FrameTarget(Target):
    """A frame codec on one channel and side, after a real handshake."""

    group = "frames"

    def __init__(self, seed: int, channel: Channel, side: Side) -> None:
        self.channel, self.side = channel, side
        self.incoming = Direction.FROM_CONTROLLER if side is Side.PEER else Direction.TO_CONTROLLER
        self.legal = sorted(LEGAL_KINDS[(channel, self.incoming)], key=lambda cls: cls.KIND)
        self.weight = 4.0 if self.legal else 1.5
        self.name = self.route_name(channel, side)
        self.setup_rng = input_rng(seed, self.name, "setup")
        self.secret = self.setup_rng.randbytes(16)
        self.keys = link_pair(self.setup_rng, self.secret, channel)
        self.max_payload = TENSOR_CEILING if channel is Channel.DATA else 0
        self.chunks = SEAL_CHUNKS if channel is Channel.DATA else (SEAL_CHUNK,)

    @classmethod
    def route_name(cls, channel: Channel, side: Side) -> str:
        """The target's name: its group, channel, and the side of the receiving codec."""
        return f"{cls.group}/{channel.value}/{side.value}"

    def receiver(self, case: Case) -> FrameConnection:
        """A fresh codec at the receiving end, with the case's seal chunk and ceilings."""
        max_body = FrameLimits().max_body if case.max_body is None else case.max_body
        limits = FrameLimits(max_body=max_body, max_payload=self.max_payload)
        keys = self.keys.peer if self.side is Side.PEER else self.keys.controller
        return FrameConnection(
            channel=self.channel, side=self.side, keys=keys, limits=limits, seal_chunk=case.chunk
        )

    def message_for(self, rng: random.Random, cls: type[Message]) -> tuple[Message, bytes]:
        """A random message of ``cls`` and its payload (consistent specs and their bytes for a
        tensor message)."""
        return random_with_payload(rng, cls)

    @staticmethod
    def within(case: Case, frame: bytes) -> bool:
        """Whether a valid frame passes the case's body ceiling (its header is the first 24
        bytes)."""
        return case.max_body is None or HEADER.unpack_from(frame)[4] <= case.max_body

    def check_delivered(self, fed: Fed, case: Case) -> None:
        """Each delivered frame sits at its position, is legal here and well-typed, and equals what
        was sent when that is known."""
        for i, frame in enumerate(fed.frames):
            if frame.seq != i or i >= len(case.sent):
                raise Violation(
                    "forged frame",
                    f"frame {i} delivered with seq {frame.seq}; {len(case.sent)} frames were sent",
                )
            sent = case.sent[i]
            if type(frame.message) not in LEGAL_KINDS[(self.channel, self.incoming)]:
                raise Violation(
                    "illegal kind delivered",
                    f"frame {i}: {type(frame.message).__name__} is not legal on this route",
                )
            if not conforms(frame.message, type(frame.message)):
                raise Violation(
                    "ill-typed message", f"frame {i}: {frame.message!r} does not match its schema"
                )
            if sent.message is not None and frame.message != sent.message:
                raise Violation(
                    "forged frame", f"frame {i}: delivered {frame.message!r}, sent {sent.message!r}"
                )
            payload = b"" if frame.payload is None else bytes(frame.payload)
            if payload != sent.payload or (frame.payload is None) != (not sent.payload):
                raise Violation(
                    "forged payload",
                    f"frame {i}: payload of {len(payload)} bytes differs from the "
                    f"{len(sent.payload)} sent",
                )
        if len(fed.frames) < case.intact:
            raise Violation(
                "lost frame",
                f"{case.intact} frames arrived intact, {len(fed.frames)} were delivered (error: "
                f"{fed.error!r})",
            )

    def execute(self, case: Case) -> Outcome:
        fed = feed_frames(self.receiver(case), case)
        self.check_delivered(fed, case)
        return Outcome(error=fed.error, frames=len(fed.frames))

    def plan(
        self, rng: random.Random, data: bytes, units: Sequence[int], **fields: typing.Any
    ) -> Case:
        """A case feeding ``data`` under a random plan."""
        return Case(
            data=data,
            cuts=random_cuts(rng, len(data), units),
            reader=rng.choice(list(Reader)),
            eof_at=random_eof(rng, len(data)),
            **fields,
        )


class WireFramesTarget(_FrameTarget):
    """What an outsider can send: mutations of streams a real sender made, not re-tagged, and random
    bytes."""

    group = "wire"

    def __init__(self, seed: int, channel: Channel, side: Side) -> None:
        super().__init__(seed, channel, side)
        self.corpus = [self._stream(self.setup_rng, self.keys) for _ in range(48)]
        # Splices come from other connections of the same run (same secret, their own handshakes):
        # frames an
        # outsider could have recorded. Streams of this very key set cannot exist twice in real
        # life.
        elsewhere = link_pair(self.setup_rng, self.secret, channel)
        self._donors = [self._stream(self.setup_rng, elsewhere).data for _ in range(8)]

    def _stream(self, rng: random.Random, keys: LinkPair) -> Stream:
        chunk = rng.choice(self.chunks)
        other = Side.CONTROLLER if self.side is Side.PEER else Side.PEER
        sender = FrameConnection(
            channel=self.channel, side=other, keys=keys.sender(self.incoming), seal_chunk=chunk
        )
        forger = Forger(keys.sender(self.incoming))
        data, sent, starts = b"", [], []
        for seq in range(rng.randint(1, 5)):
            starts.append(len(data))
            if self.legal:
                msg, payload = self.message_for(rng, rng.choice(self.legal))
                data += (
                    b"".join(map(bytes, sender.send_parts(msg, [payload])))
                    if self.channel is Channel.DATA
                    else sender.send(msg)
                )
                sent.append(Sent(message=msg, payload=payload, end=len(data)))
            # nothing is legal this way (rendezvous, down): what a confused keyed peer would send,
            # never to be delivered
            else:
                cls = rng.choice(
                    sorted(
                        LEGAL_KINDS[(self.channel, Direction.TO_CONTROLLER)], key=lambda c: c.KIND
                    )
                )
                msg = random_message(rng, cls)
                data += forger.frame(
                    kind=cls.KIND, seq=seq, body=pack_message(msg), seal_body=cls.SEALED
                )
                sent.append(Sent(message=None, end=len(data)))
        fields = tuple(f for start in starts for f in frame_fields(start))
        return Stream(
            data=data,
            sent=tuple(sent),
            chunk=chunk,
            sample=Sample(data=data, units=tuple(starts), fields=fields),
        )

    def generate(self, rng: random.Random) -> Case:
        index = rng.randrange(len(self.corpus))
        stream = self.corpus[index]
        roll = rng.random()
        if roll < 0.08:
            data, origin = rng.randbytes(rng.randint(0, 256)), "random"
        elif roll < 0.16:
            data, origin = stream.data, "valid"
        elif roll < 0.22:
            data, origin = (
                stream.data[: rng.randrange(len(stream.data))] + rng.randbytes(rng.randint(1, 64)),
                "valid prefix, random tail",
            )
        else:
            data, ops = Mutator(rng, donors=self._donors).mutate(stream.sample)
            origin = "mutated: " + ", ".join(ops)
        max_body = rng.randint(0, 256) if rng.random() < 0.08 else None
        case = self.plan(
            rng,
            data,
            stream.sample.units,
            origin=origin,
            fixture=index,
            chunk=stream.chunk,
            max_body=max_body,
            sent=stream.sent,
        )
        return dataclasses.replace(case, intact=self._intact(stream, case))

    def _intact(self, stream: Stream, case: Case) -> int:
        """Leading frames the fed bytes share whole with the valid stream, deliverable and within
        the ceiling."""
        prefix = common_prefix(case.fed, stream.data)
        count, start = 0, 0
        for sent in stream.sent:
            if (
                sent.end > prefix
                or sent.message is None
                or not self.within(case, stream.data[start : sent.end])
            ):
                break
            count, start = count + 1, sent.end
        return count


class KeyedFramesTarget(_FrameTarget):
    """What a keyed but broken peer can send: frames forged with the real keys around mutated
    parts."""

    group = "keyed"

    def __init__(self, seed: int, channel: Channel, side: Side) -> None:
        super().__init__(seed, channel, side)
        self.forger = Forger(self.keys.sender(self.incoming))
        self.registered = [cls for _kind, cls in sorted(registered_kinds().items())]
        self.sealed = sealed_kinds()

    def generate(self, rng: random.Random) -> Case:
        chunk = rng.choice(self.chunks)
        max_body = rng.randint(0, 256) if rng.random() < 0.05 else None
        data, sent, starts, exact, notes = b"", [], [], True, []
        for seq in range(rng.randint(1, 5)):
            frame, message, payload, note = self._forge(rng, seq, chunk)
            starts.append(len(data))
            data += frame
            notes.append(note)
            # Frames are pristine up to the first one forged wrong; the rest only need to decode
            # well-typed.
            exact = (
                exact
                and message is not None
                and (max_body is None or HEADER.unpack_from(frame)[4] <= max_body)
            )
            sent.append(Sent(message=message, payload=payload, end=len(data)))
            if not exact and rng.random() < 0.5:
                break
        case = self.plan(
            rng,
            data,
            starts,
            origin="forged: " + "; ".join(notes),
            chunk=chunk,
            max_body=max_body,
            sent=tuple(sent),
        )
        intact = next(
            (i for i, s in enumerate(sent) if s.message is None or s.end > len(case.fed)), len(sent)
        )
        if max_body is not None:
            intact = min(
                intact,
                next(
                    (
                        i
                        for i, start in enumerate(starts)
                        if HEADER.unpack_from(data, start)[4] > max_body
                    ),
                    len(sent),
                ),
            )
        return dataclasses.replace(case, intact=intact)

    def _kind(self, rng: random.Random) -> tuple[int, type[Message] | None]:
        roll = rng.random()
        if roll < 0.8 and self.legal:
            cls: type[Message] | None = rng.choice(self.legal)
        elif roll < 0.93:
            cls = rng.choice(self.registered)
        else:
            kind = rng.randrange(0x10000)
            return kind, registered_kinds().get(kind)
        assert cls is not None
        return cls.KIND, cls

    def _forge(
        self, rng: random.Random, seq: int, chunk: int
    ) -> tuple[bytes, Message | None, bytes, str]:
        """One forged frame, the message it must decode to (None: unknown), its payload, and what
        was done to it."""
        kind, cls = self._kind(rng)
        msg, payload = self.message_for(rng, cls) if cls is not None else (None, b"")
        body = pack_message(msg) if msg is not None else rng.randbytes(rng.randint(0, 24))
        notes = [cls.__name__ if cls is not None else f"kind {kind:#06x}"]
        roll = rng.random()
        if roll < 0.35 and msg is not None:
            body, msg = mutate_body(rng, body), None
            notes.append("value-mutated body")
        elif roll < 0.55:
            body, msg = Mutator(rng).mutate(Sample(data=body))[0], None
            notes.append("byte-mutated body")
        seal, seq_field, version, flags, spoil = kind in self.sealed, seq, PROTOCOL_VERSION, 0, None
        if rng.random() < 0.12:
            name = rng.choice(("seq", "version", "flags", "seal", "spoil_chunk", "payload"))
            notes.append(f"bad {name}")
            msg, wrong = None, rng.choice((1, 2, 3, 255, seq + 1, seq - 1 if seq else 7))
            if name == "seal":
                seal = not seal
            elif name == "payload":
                payload = payload + rng.randbytes(rng.randint(1, 64))
            elif name == "spoil_chunk":
                spoil = rng.randrange(max(1, chunk_count(len(payload), chunk)))
            elif name == "seq":
                seq_field = wrong
            elif name == "version":
                version = wrong
            else:
                flags = wrong
        frame = self.forger.frame(
            kind=kind,
            seq=seq_field,
            body=body,
            seal_body=seal,
            payload=payload,
            chunk=chunk,
            version=version,
            flags=flags,
            spoil_chunk=spoil,
        )
        if cls is None or cls not in LEGAL_KINDS[(self.channel, self.incoming)]:
            msg = None
        return frame, msg, payload, " ".join(notes)


class TensorsTarget(Target):
    """unpack_tensors on the specs of every contribution a keyed peer can send: decoded from a
    (mutated) body, with a payload of some length."""

    name = "tensors"
    group = "tensors"
    weight = 3.0

    def __init__(self, seed: int) -> None:
        self._torch_ready = False

    def generate(self, rng: random.Random) -> Case:
        specs = tuple(self._spec(rng, i) for i in range(rng.randint(0, 3)))
        base = random_message(rng, m.Contribution)
        assert isinstance(base, m.Contribution)
        contribution = dataclasses.replace(base, tensors=specs)
        body = pack_message(contribution)
        origin = "contribution"
        if rng.random() < 0.25:
            body, origin = mutate_body(rng, body), "value-mutated contribution"
        total = sum(s.nbytes for s in specs if 0 <= s.nbytes < 4096)
        payload_len = rng.choice(
            (0, total, total, total + rng.randint(1, 64), rng.randint(0, 4096))
        )
        return Case(data=body, origin=origin, payload_len=payload_len)

    @staticmethod
    def _spec(rng: random.Random, i: int) -> m.TensorSpec:
        dtype = (
            rng.choice(sorted(DTYPE_ITEMSIZE))
            if rng.random() < 0.85
            else rng.choice(("float", "Tensor", "__class__", "", "complex64", random_text(rng)))
        )
        dims = rng.choice((0, 1, 2, 3, 4, rng.randint(5, 80)))
        shape = [
            rng.choice((0, 1, 2, 3, 7, rng.choice(INTERESTING_INTS), -1))
            if rng.random() < 0.3
            else rng.randint(0, 4)
            for _ in range(dims)
        ]
        if shape and rng.random() < 0.3:
            shape[rng.randrange(len(shape))] = 0  # an empty tensor: any other dimension still fits
        itemsize = DTYPE_ITEMSIZE.get(dtype, 1)
        nbytes = (
            math.prod(shape) * itemsize
            if rng.random() < 0.75
            else rng.choice((0, 1, 4, 8, 1 << 63, -1))
        )
        nbytes = max(-(1 << 63), min(nbytes, (1 << 64) - 1))
        offset = rng.choice((0, 0, 1, 3, rng.randint(0, 64), rng.choice(INTERESTING_INTS), -1))
        return m.TensorSpec(
            name=f"t{i}",
            dtype=dtype,
            shape=tuple(max(-(1 << 63), min(d, (1 << 64) - 1)) for d in shape),
            offset=offset,
            nbytes=nbytes,
        )

    def execute(self, case: Case) -> Outcome:
        from flodl_async.wire.tensor import unpack_tensors

        try:
            contribution = unpack_message(m.Contribution.KIND, case.data)
            assert isinstance(contribution, m.Contribution)
            tensors = unpack_tensors(
                contribution.tensors,
                memoryview(bytearray(case.payload_len)) if case.payload_len else None,
            )
        except MalformedBody as exc:
            return Outcome(error=exc)
        except WireError as exc:
            raise Violation(
                "tensor error class",
                f"unpack_tensors raised {type(exc).__name__}, not MalformedBody: {exc}",
            ) from exc
        if len(tensors) != len(contribution.tensors):
            return Outcome(frames=len(tensors), label="decoded (names repeat)")
        for spec in contribution.tensors:
            tensor = tensors[spec.name]
            if (
                tuple(tensor.shape) != spec.shape
                or tensor.numel() * tensor.element_size() != spec.nbytes
            ):
                raise Violation(
                    "tensor shape",
                    f"{spec} decoded as a {tuple(tensor.shape)} tensor of {tensor.dtype}",
                )
        return Outcome(frames=len(tensors), label="decoded")

    def describe(self, case: Case) -> str:
        return (
            f"a Contribution body of {len(case.data)} bytes ({case.origin}) over a payload of "
            f"{case.payload_len} bytes"
        )


# ----- the TCPStore parser ----------------------------------------------------------------------

#: Keys the store samples use: few, so requests meet each other's keys (waits woken, ADD on a SET).
STORE_KEYS = (b"init/", b"k", b"n", b"q", b"rank/0", b"", "é☃".encode(), b"\x00\xff")
#: Limits of the fuzzed stores, by fixture: small ones (so that mutations reach every bound) and
#: the defaults.
STORE_LIMITS = (StoreLimits(max_bytes=16 * 1024, max_value=2048), StoreLimits())


class _StoreWriter:
    """Builds a valid request stream for the samples, noting request starts and integer fields."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.units: list[int] = []
        self.fields: list[tuple[int, int]] = []

    def request(self, query: Query) -> None:
        self.units.append(len(self.data))
        self.fields.append((len(self.data), 1))
        self.data.append(query)

    def u64(self, n: int) -> None:
        self.fields.append((len(self.data), 8))
        self.data += struct.pack("<Q", n)

    def blob(self, b: bytes) -> None:
        self.u64(len(b))
        self.data += b


class StoreTarget(Target):
    """The TCPStore parser (:mod:`flodl_async.wire.storeproto`) over every request type, with a
    second client waiting on its keys.

    Inputs are mutations of valid request streams (every :class:`Query`, values near the limits,
    ADD near the int64 bounds) fed whole and under a random plan (cuts, EOF), with the flow
    control's ``receive_data(b"")`` calls. Oracle: only :class:`StoreProtocolError` is raised
    and a failed connection stays failed; after every call the store holds no more than its
    budget and no value past its limit; once both clients are gone it is charged exactly for what
    it stores; and unless a limit refused the whole feed (a budget counts buffered bytes, so it
    depends on the cuts), the cut feed answers byte for byte what the whole feed answers, to both
    clients, and leaves the same keys.
    """

    name = "store"
    group = "store"
    weight = 3.0

    def __init__(self, seed: int) -> None:
        rng = input_rng(seed, self.name, "samples")
        self._samples = [self._sample(rng) for _ in range(64)]
        self.queries = {q for sample in self._samples for q in self._queries(sample)}

    @staticmethod
    def _queries(sample: Sample) -> set[Query]:
        return {Query(sample.data[u]) for u in sample.units}

    def _sample(self, rng: random.Random) -> Sample:
        out = _StoreWriter()
        out.request(Query.VALIDATE)
        out.data += struct.pack("<I", VALIDATION_MAGIC)
        for _ in range(rng.randint(1, 12)):
            self._request(rng, out, rng.choice(list(Query)))
        return Sample(data=bytes(out.data), units=tuple(out.units), fields=tuple(out.fields))

    @staticmethod
    def _value(rng: random.Random) -> bytes:
        roll = rng.random()
        if roll < 0.1:
            return str(rng.choice((0, 1, -1, _INT64[1], _INT64[0], _INT64[1] - 1))).encode()
        size = rng.choice((0, 1, 8, 64, 2047, 2048, 2049, rng.randint(0, 6000)))
        return rng.randbytes(size) if roll < 0.5 else b"v" * size

    def _request(self, rng: random.Random, out: _StoreWriter, query: Query) -> None:
        key = functools.partial(rng.choice, STORE_KEYS)
        out.request(query)
        if query in (Query.VALIDATE, Query.PING):
            out.data += struct.pack("<I", VALIDATION_MAGIC) if query is Query.VALIDATE else b"ping"
        elif query in (Query.SET, Query.APPEND, Query.QUEUE_PUSH):
            out.blob(key())
            out.blob(self._value(rng))
        elif query is Query.COMPARE_SET:
            out.blob(key())
            out.blob(rng.choice((b"", self._value(rng))))
            out.blob(self._value(rng))
        elif query in (Query.GET, Query.DELETE_KEY, Query.QUEUE_POP, Query.QUEUE_LEN):
            out.blob(key())
        elif query is Query.ADD:
            out.blob(key())
            out.fields.append((len(out.data), 8))
            delta = rng.choice((1, -1, 5, _INT64[1], _INT64[0], rng.randint(*_INT64)))
            out.data += struct.pack("<q", delta)
        elif query in (Query.CHECK, Query.WAIT, Query.MULTI_GET):
            keys = [key() for _ in range(rng.choice((0, 1, 2, 3, 8)))]
            out.u64(len(keys))
            for k in keys:
                out.blob(k)
        elif query is Query.MULTI_SET:
            count = rng.choice((0, 1, 2, 4))
            out.u64(count)
            for _ in range(count):
                out.blob(key())
                out.blob(self._value(rng))
        # GETNUMKEYS and CANCEL_WAIT carry nothing

    def generate(self, rng: random.Random) -> Case:
        sample = rng.choice(self._samples)
        if rng.random() < 0.1:
            data, origin = sample.data[:5] + rng.randbytes(rng.randint(0, 64)), "random requests"
        else:
            donors = [s.data for s in self._samples]
            data, ops = Mutator(rng, donors=donors).mutate(sample, max_ops=3)
            origin = "mutated: " + ", ".join(ops)
        origin += " of " + "/".join(sorted(q.name for q in self._queries(sample)))
        return Case(
            data=data,
            origin=origin,
            fixture=0 if rng.random() < 0.8 else 1,
            cuts=random_cuts(rng, len(data), sample.units),
            eof_at=random_eof(rng, len(data)),
        )

    def _feed(self, case: Case, cuts: Sequence[int]) -> _StoreRun:
        limits = STORE_LIMITS[case.fixture]
        state = StoreState(limits)
        watcher, conn = StoreConnection(state), StoreConnection(state)
        got: dict[StoreConnection, bytearray] = {watcher: bytearray(), conn: bytearray()}

        def take(replies: list[tuple[StoreConnection, bytes]]) -> None:
            for to, payload in replies:
                got[to] += payload
            if state.held > limits.max_bytes:
                raise Violation("store budget", f"the store holds {state.held} bytes")
            if any(len(v) > limits.max_value for v in state.data.values()) or any(
                len(item) > limits.max_value for queue in state.queues.values() for item in queue
            ):
                raise Violation("value limit", "a value past the limit was stored")

        take(watcher.receive_data(STORE_PREFIX + bytes([Query.WAIT]) + _store_keys(STORE_KEYS)))
        error: StoreProtocolError | None = None
        for piece in pieces(case.fed, cuts):
            try:
                take(conn.receive_data(piece))
                while conn.wants_more:
                    take(conn.receive_data(b""))
            except StoreProtocolError as exc:
                if error is None:
                    error = exc
                continue
            if error is not None:
                raise Violation("stays failed", f"after {error!r}, receive_data took more bytes")
        if error is not None:
            try:
                conn.receive_data(STORE_PREFIX)
            except StoreProtocolError:
                pass
            else:
                raise Violation("stays failed", f"after {error!r}, receive_data took a VALIDATE")
        data, queues = dict(state.data), {k: list(v) for k, v in state.queues.items()}
        conn.closed()
        watcher.closed()
        charged = sum(len(k) + len(v) + ENTRY_OVERHEAD for k, v in state.data.items()) + sum(
            len(k) + len(item) + ENTRY_OVERHEAD for k, q in state.queues.items() for item in q
        )
        if state.held != charged or state.owed:
            raise Violation(
                "store accounting",
                f"with every client gone the store is charged {state.held} bytes (owed "
                f"{state.owed}) for {charged} it stores",
            )
        return _StoreRun(
            replies=bytes(got[conn]), woken=bytes(got[watcher]), error=error, keys=(data, queues)
        )

    def execute(self, case: Case) -> Outcome:
        whole = self._feed(case, ())
        cut = self._feed(case, case.cuts)
        if not isinstance(whole.error, StoreLimitExceeded):
            theirs = (whole.replies, whole.woken, repr(whole.error), whole.keys)
            if (cut.replies, cut.woken, repr(cut.error), cut.keys) != theirs:
                raise Violation(
                    "cuts change the answers",
                    f"whole: {len(whole.replies)} reply bytes, {whole.error!r}; cut at "
                    f"{len(case.cuts)} points: {len(cut.replies)} reply bytes, {cut.error!r}",
                )
        label = "clean" if cut.error is None else type(cut.error).__name__
        return Outcome(error=cut.error, frames=len(cut.replies), label=label)

    def describe(self, case: Case) -> str:
        return f"store limits {STORE_LIMITS[case.fixture]}; " + case.describe()


_INT64 = (-(1 << 63), (1 << 63) - 1)


def _store_keys(keys: Sequence[bytes]) -> bytes:
    return struct.pack("<Q", len(keys)) + b"".join(struct.pack("<Q", len(k)) + k for k in keys)


@dataclass(frozen=True, slots=True, kw_only=True)
class _StoreRun:
    """What one feed of a store input did."""

    replies: bytes
    woken: bytes
    error: StoreProtocolError | None
    keys: tuple[dict[str, bytes], dict[str, list[bytes]]]


def all_targets(seed: int, pattern: str = "*") -> list[Target]:
    """The targets whose names match the glob ``pattern``, in table order (only those are built)."""
    makers: list[tuple[str, Callable[[], Target]]] = [
        (cls.name, functools.partial(cls, seed))
        for cls in (SniffTarget, ServerHelloTarget, ServerProofTarget, ClientHelloTarget)
    ]
    for group in (WireFramesTarget, KeyedFramesTarget):
        makers += [
            (group.route_name(channel, side), functools.partial(group, seed, channel, side))
            for channel in FRAMED_CHANNELS
            for side in (Side.PEER, Side.CONTROLLER)
        ]
    makers.append((TensorsTarget.name, functools.partial(TensorsTarget, seed)))
    makers.append((StoreTarget.name, functools.partial(StoreTarget, seed)))
    return [make() for name, make in makers if fnmatch.fnmatchcase(name, pattern)]


# ----- the runner
# ----------------------------------------------------------------------------------


class _Hang(BaseException):
    """Raised by the watchdog's alarm inside an input that ran too long (a BaseException: no `except
    Exception` swallows it)."""


@dataclass(slots=True)
class Found:
    """The first input that broke one clause on one target, and how many did."""

    target: str
    check: str
    detail: str
    index: int
    case: Case
    description: str
    count: int = 1


@dataclass(slots=True)
class TargetStats:
    """What one target's inputs did."""

    name: str
    group: str
    inputs: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    labels: collections.Counter[str] = field(default_factory=collections.Counter)
    frames: int = 0
    established: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class Report:
    """A whole run: per-target statistics and every clause broken."""

    seed: int
    stats: list[TargetStats] = field(default_factory=list)
    found: dict[tuple[str, str], Found] = field(default_factory=dict)

    def record(self, target: Target, index: int, case: Case, violation: Violation) -> None:
        """Keep the first reproducer of each (target, clause); count the rest."""
        key = (target.name, violation.check)
        if key in self.found:
            self.found[key].count += 1
        else:
            self.found[key] = Found(
                target.name, violation.check, violation.detail, index, case, target.describe(case)
            )


@contextlib.contextmanager
def watchdog(seconds: float | None) -> Iterator[Callable[[bool], None]]:
    """``arm(True)`` before an input, ``arm(False)`` after: an input that runs past ``seconds``
    raises :class:`_Hang`."""
    if seconds is None or not hasattr(signal, "setitimer"):
        yield lambda _on: None
        return

    def alarm(_signum: int, _frame: types.FrameType | None) -> None:
        raise _Hang

    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        yield lambda on: signal.setitimer(signal.ITIMER_REAL, seconds if on else 0) and None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_one(target: Target, seed: int, index: int) -> tuple[Case, Outcome | Violation]:
    """Generate and run one input; anything but a clean outcome or a WireError inside it is a
    :class:`Violation`."""
    case = target.generate(input_rng(seed, target.name, index))
    try:
        return case, target.execute(case)
    except Violation as violation:
        return case, violation
    except _Hang:
        return case, Violation("hang", f"the input ran past the watchdog's {HANG_SECONDS:g} s")
    except Exception as exc:  # the property's first clause: anything else is a bug
        where = (
            "".join(traceback.format_tb(exc.__traceback__, limit=-3))
            .rstrip()
            .replace("\n", "\n    ")
        )
        # torch appends its whole C++ stack to the message
        first_line = next(iter(str(exc).splitlines()), "")
        return case, Violation(f"non-WireError {type(exc).__name__}", f"{first_line}\n    {where}")


def fuzz(
    targets: Sequence[Target],
    *,
    seed: int,
    budget: dict[str, int],
    hang_seconds: float | None = HANG_SECONDS,
) -> Report:
    """Run ``budget[name]`` inputs on each target."""
    report = Report(seed=seed)
    with watchdog(hang_seconds) as arm:
        for target in targets:
            stats = TargetStats(name=target.name, group=target.group)
            started = time.perf_counter()
            for index in range(budget.get(target.name, 0)):
                arm(True)
                try:
                    case, result = run_one(target, seed, index)
                finally:
                    arm(False)
                stats.inputs += 1
                if isinstance(result, Violation):
                    report.record(target, index, case, result)
                    continue
                if result.error is not None:
                    stats.errors[type(result.error).__name__] += 1
                stats.frames += result.frames
                stats.established += result.established
                if result.label:
                    stats.labels[result.label] += 1
            stats.seconds = time.perf_counter() - started
            report.stats.append(stats)
    return report


def split_budget(targets: Sequence[Target], inputs: int) -> dict[str, int]:
    """``inputs`` shared by the targets' weights, to the input (largest remainders first); every
    target gets at least one."""
    total = sum(t.weight for t in targets)
    shares = [inputs * t.weight / total for t in targets]
    counts = [int(share) for share in shares]
    for i in sorted(range(len(targets)), key=lambda i: counts[i] - shares[i])[
        : inputs - sum(counts)
    ]:
        counts[i] += 1
    return {t.name: max(1, count) for t, count in zip(targets, counts, strict=True)}


# ----- the report
# ----------------------------------------------------------------------------------


def _row(cells: Sequence[object], widths: Sequence[int]) -> str:
    return "  ".join(
        str(c).ljust(w) if i == 0 else str(c).rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )


def format_report(report: Report) -> str:
    """The tables: inputs per target, then errors by WireError subclass per group, then what
    broke."""
    lines = [f"fuzz_wire: seed {report.seed}, {sum(s.inputs for s in report.stats)} inputs", ""]
    head = ("target", "inputs", "clean", "wire errors", "frames", "handshakes", "inputs/s")
    rows: list[tuple[object, ...]] = [
        (
            s.name,
            s.inputs,
            s.inputs - sum(s.errors.values()),
            sum(s.errors.values()),
            s.frames,
            s.established,
            f"{s.inputs / max(s.seconds, 1e-9):,.0f}",
        )
        for s in report.stats
    ]
    seconds = sum(s.seconds for s in report.stats)
    totals = [sum(typing.cast(int, r[i]) for r in rows) for i in range(1, 6)]
    rows.append(("total", *totals, f"{totals[0] / max(seconds, 1e-9):,.0f}"))
    widths = [max(len(str(r[i])) for r in (head, *rows)) for i in range(len(head))]
    lines += [_row(head, widths), _row(["-" * w for w in widths], widths)]
    lines += [_row(r, widths) for r in rows[:-1]] + [
        _row(["-" * w for w in widths], widths),
        _row(rows[-1], widths),
        "",
    ]
    groups = list(dict.fromkeys(s.group for s in report.stats))
    by_group: dict[str, collections.Counter[str]] = {g: collections.Counter() for g in groups}
    for s in report.stats:
        by_group[s.group].update(s.errors)
    names = sorted({name for c in by_group.values() for name in c})
    head2 = ("WireError subclass", *groups, "total")
    rows2 = [
        (name, *(by_group[g][name] for g in groups), sum(by_group[g][name] for g in groups))
        for name in names
    ]
    widths2 = [max(len(str(r[i])) for r in (head2, *rows2)) for i in range(len(head2))]
    lines += [
        _row(head2, widths2),
        _row(["-" * w for w in widths2], widths2),
        *(_row(r, widths2) for r in rows2),
        "",
    ]
    for s in report.stats:
        if s.labels:
            lines.append(
                f"{s.name} outcomes: "
                + ", ".join(f"{label} {n}" for label, n in sorted(s.labels.items()))
            )
    lines.append("")
    lines += format_found(report)
    return "\n".join(lines)


def format_found(report: Report) -> list[str]:
    """Each broken clause, with a reproducer."""
    if not report.found:
        return ["property held: no violation"]
    lines = [f"PROPERTY VIOLATED: {len(report.found)} clause(s) on some target"]
    for found in report.found.values():
        hexed = found.case.data.hex()
        lines += [
            "",
            f"[{found.target}] {found.check} — {found.count} input(s); first: index {found.index}",
            f"  {found.detail}",
            f"  input: {found.description}",
            f"  hex: {hexed[:4096]}"
            f"{'… (truncated: replay for all of it)' if len(hexed) > 4096 else ''}",
            f"  replay: python tools/fuzz_wire.py --seed {report.seed} --replay "
            f"{found.target}:{found.index}",
        ]
    return lines


def replay(targets: Sequence[Target], seed: int, spec: str) -> int:
    """Run one input alone and print everything about it."""
    name, _, index_text = spec.rpartition(":")
    target = next((t for t in targets if t.name == name), None)
    if target is None or not index_text.isdigit():
        print(
            f"--replay wants TARGET:INDEX, TARGET one of {', '.join(t.name for t in targets)}",
            file=sys.stderr,
        )
        return 2
    case, result = run_one(target, seed, int(index_text))
    print(f"{target.name} input {index_text} (seed {seed}): {target.describe(case)}")
    print(f"hex: {case.data.hex()}")
    if isinstance(result, Violation):
        print(f"VIOLATION {result.check}: {result.detail}")
        return 1
    print(
        f"ok: error={result.error!r}, frames={result.frames}, established={result.established} "
        f"{result.label}"
    )
    return 0


# ----- live: a real PortMux and FramedService on loopback
# ------------------------------------------

#: Channels whose service answers: join and control echo heartbeats, data answers a contribution
#: with a consensus of the same tensors (rendezvous sends nothing down).
_ECHOED = (Channel.JOIN, Channel.CONTROL, Channel.DATA)


@dataclass(slots=True)
class LiveReport:
    """What the live run saw: fuzzed connections by kind, how they ended, the good clients' answers,
    what broke."""

    seed: int
    connections: collections.Counter[str] = field(default_factory=collections.Counter)
    endings: collections.Counter[str] = field(default_factory=collections.Counter)
    probes: int = 0
    status_gets: int = 0
    server_links: int = 0
    mux: dict[str, object] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    #: Seconds the fuzzed connections took, and the whole run (which also waits out the stalled
    #: peers).
    flood_seconds: float = 0.0
    seconds: float = 0.0

    def format(self) -> str:
        """The live table."""
        rate = sum(self.connections.values()) / max(self.flood_seconds, 1e-9)
        lines = [
            f"live: seed {self.seed}, {sum(self.connections.values())} fuzzed connections in "
            f"{self.flood_seconds:.1f} s ({rate:,.0f}/s; "
            f"{self.seconds:.1f} s in all), {self.server_links} framed links accepted",
            "  by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(self.connections.items())),
            "  endings: " + ", ".join(f"{k} {n}" for k, n in sorted(self.endings.items())),
            f"  well-behaved clients answered throughout: {self.probes} framed round trips, "
            f"{self.status_gets} status GETs",
            f"  mux: {self.mux}",
        ]
        lines += [f"  LIVE VIOLATION: {v}" for v in self.violations] or [
            "  property held: no violation"
        ]
        return "\n".join(lines)


def consensus_of(contribution: m.Contribution) -> m.Consensus:
    """The live service's answer to ``contribution``: its tensors (and payload) as a consensus."""
    return m.Consensus(
        round=contribution.round,
        kind=contribution.kind,
        mass=contribution.weight,
        tensors=contribution.tensors,
    )


async def echo_handler(link: FramedProtocol) -> None:
    """The services' handler: echo heartbeats (join, control); answer a contribution with its
    :func:`consensus_of` and the same payload (data)."""
    while True:
        frame = await link.recv()
        if link.channel is Channel.DATA:
            if not isinstance(frame.message, m.Contribution):
                continue  # the other data messages have no answer
            link.send_parts(
                consensus_of(frame.message), [frame.payload] if frame.payload is not None else []
            )
        elif isinstance(frame.message, m.Heartbeat):
            link.send(frame.message)
        else:
            continue
        await link.drain()


async def read_to_end(reader: asyncio.StreamReader, seconds: float) -> tuple[str, bytes]:
    """Read until the server closes: ('closed' | 'reset' | 'open', what it sent)."""
    got = bytearray()
    try:
        async with asyncio.timeout(seconds):
            while chunk := await reader.read(65536):
                got += chunk
    except TimeoutError:
        return "open", bytes(got)
    except OSError:
        return "reset", bytes(got)
    return "closed", bytes(got)


class _LiveClients:
    """The clients of the live run: fuzzed ones, well-behaved ones, and peers that stall
    mid-handshake."""

    def __init__(self, seed: int, port: int, secret: bytes, report: LiveReport) -> None:
        self.seed, self.port, self.secret, self.report = seed, port, secret, report
        self.hello_fixture = handshake_fixture(
            input_rng(seed, "live", "fixture"), secret, Channel.JOIN, CredentialKind.SESSION
        )

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, channel: Channel
    ) -> Established:
        client = ClientHandshake(
            channel=channel, credential=Credential.session(self.secret), version=VERSION
        )
        writer.write(CHANNEL_MAGIC[channel] + client.hello())
        async with asyncio.timeout(5):
            while True:
                step = client.receive_data(await reader.read(4096))
                if step.established is not None:
                    writer.write(step.send)
                    return step.established

    def _fuzzed_bytes(self, rng: random.Random, kind: str, channel: Channel) -> bytes:
        fixture = self.hello_fixture
        mutator = Mutator(
            rng, donors=[fixture.hello, fixture.server_hello, *CHANNEL_MAGIC.values()]
        )
        if kind == "random":
            return rng.randbytes(rng.randint(0, 300))
        if kind == "mutated magic":
            return mutator.mutate(
                Sample(data=CHANNEL_MAGIC[channel] + fixture.hello, units=(0, 4)), max_ops=2
            )[0]
        if kind == "mutated hello":
            sample = Sample(
                data=fixture.hello + fixture.proof + fixture.first_frames,
                units=(0, len(fixture.hello)),
                fields=_hello_fields(),
            )
            return CHANNEL_MAGIC[channel] + mutator.mutate(sample)[0]
        request = b"GET /state.json HTTP/1.1\r\nHost: fuzz\r\nAccept: */*\r\n\r\n"
        return mutator.mutate(Sample(data=request, units=(0, 4, 26)))[0]

    async def _authenticated(
        self,
        rng: random.Random,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        channel: Channel,
    ) -> None:
        """A real handshake, then a mutated stream of legal frames (or a valid one) under this
        connection's keys."""
        keys = (await self._handshake(reader, writer, channel)).keys
        codec = FrameConnection(channel=channel, side=Side.PEER, keys=keys)
        legal = sorted(LEGAL_KINDS[(channel, Direction.TO_CONTROLLER)], key=lambda cls: cls.KIND)
        stream, starts = b"", []
        for _ in range(rng.randint(1, 4)):
            starts.append(len(stream))
            cls = rng.choice(legal)
            if cls in TENSOR_MESSAGES:
                msg, payload = random_with_payload(rng, cls)
                stream += b"".join(map(bytes, codec.send_parts(msg, [payload])))
            else:
                stream += codec.send(random_message(rng, cls))
        if rng.random() < 0.8:
            sample = Sample(
                data=stream,
                units=tuple(starts),
                fields=tuple(f for s in starts for f in frame_fields(s)),
            )
            stream = Mutator(rng).mutate(sample)[0]
        writer.write(stream)

    async def fuzzed(self, index: int) -> None:
        """One fuzzed connection: write its bytes, end it one way or another, and see the server end
        its side."""
        rng = input_rng(self.seed, "live", index)
        kind = rng.choice(
            (
                "random",
                "mutated magic",
                "mutated hello",
                "authenticated, fuzzed frames",
                "authenticated, fuzzed frames",
                "http",
            )
        )
        channel = rng.choice(FRAMED_CHANNELS)
        self.report.connections[kind] += 1
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            if kind.startswith("authenticated"):
                await self._authenticated(rng, reader, writer, channel)
            else:
                data = self._fuzzed_bytes(rng, kind, channel)
                for piece in pieces(data, random_cuts(rng, len(data))[:4]):
                    writer.write(piece)
                    await writer.drain()
            ending = rng.choice(("eof", "eof", "close", "abort"))
            if ending == "eof":
                writer.write_eof()
                how, _ = await read_to_end(reader, 5.0)
                self.report.endings[f"server {how}"] += 1
                if how == "open":
                    self.report.violations.append(
                        f"connection {index} ({kind}, {channel.value}): the server kept it open 5 "
                        "s after the peer's EOF"
                    )
            elif ending == "abort":
                writer.transport.abort()
                self.report.endings["client reset"] += 1
            else:
                self.report.endings["client close"] += 1
        except (OSError, WireError) as exc:
            self.report.endings[f"server ended it during the exchange ({type(exc).__name__})"] += 1
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def well_behaved(self, done: asyncio.Event) -> None:
        """Until ``done``: a framed round trip on each answering channel, and a status GET; each
        must succeed in time."""
        rng = input_rng(self.seed, "live", "probe")
        while not done.is_set():
            channel = rng.choice(_ECHOED)
            try:
                async with asyncio.timeout(5):
                    await self._round_trip(channel, rng)
                    await self._status_get()
            except (TimeoutError, OSError, WireError) as exc:
                self.report.violations.append(
                    f"a well-behaved {channel.value} client or status GET failed mid-run: {exc!r}"
                )
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.02)

    async def _round_trip(self, channel: Channel, rng: random.Random) -> None:
        link = await open_framed(
            "127.0.0.1", self.port, channel=channel, credential=Credential.session(self.secret)
        )
        try:
            msg: Message
            expected: Message
            if channel is Channel.DATA:
                msg, payload = random_with_payload(rng, m.Contribution)
                assert isinstance(msg, m.Contribution)
                expected = consensus_of(msg)
                link.send_parts(msg, [payload])
            else:
                msg, payload = m.Heartbeat(sent_at=rng.random()), b""
                expected = msg
                link.send(msg)
            frame = await link.recv()
            if (
                frame.message != expected
                or (bytes(frame.payload) if frame.payload is not None else b"") != payload
            ):
                self.report.violations.append(
                    f"a well-behaved {channel.value} client got {frame.message!r} back for {msg!r}"
                )
            self.report.probes += 1
        finally:
            await link.aclose()

    async def _status_get(self) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(b"GET /state.json HTTP/1.1\r\nHost: fuzz\r\n\r\n")
            how, answer = await read_to_end(reader, 5.0)
            if how != "closed" or not answer.startswith((b"HTTP/1.1 200 ", b"HTTP/1.1 503 ")):
                self.report.violations.append(f"a status GET mid-run got {how}: {answer[:40]!r}")
            self.report.status_gets += 1
        finally:
            writer.close()

    async def stalled(self, channel: Channel, wait: float) -> None:
        """A peer that sends the magic and half a hello, then nothing: the server must not hold it
        past the handshake deadline."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(CHANNEL_MAGIC[channel] + self.hello_fixture.hello[:5])
            how, _ = await read_to_end(reader, wait)
            self.report.endings[f"stalled peer: server {how}"] += 1
            if how == "open":
                self.report.violations.append(
                    f"a {channel.value} peer that stalled mid-handshake was still open {wait:g} s "
                    "later (the handshake deadline is "
                    f"{wait - 2:g} s): no server-side handshake deadline"
                )
        finally:
            writer.close()


def _tracked(
    factory: Callable[[], asyncio.BaseProtocol], links: list[FramedProtocol]
) -> Callable[[], asyncio.BaseProtocol]:
    """The service's factory, remembering each server-side link it makes."""

    def make() -> asyncio.BaseProtocol:
        link = factory()
        assert isinstance(link, FramedProtocol)
        links.append(link)
        return link

    return make


class _ErrorLog(logging.Handler):
    """Collects error records of flodl_async's loggers (a handler that failed on a bug logs one)."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def live(
    seed: int, connections: int, *, concurrency: int = 32, stall: bool = True
) -> LiveReport:
    """A real PortMux with every framed service and the status channel, against ``connections``
    fuzzed connections.

    Throughout, well-behaved clients must get their answers; afterwards, every server-side link must
    be
    closed, no task left behind, and neither the loop nor a handler may have reported an error.
    """
    report = LiveReport(seed=seed)
    started = time.perf_counter()
    secret = input_rng(seed, "live", "secret").randbytes(16)
    loop = asyncio.get_running_loop()
    loop_errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: loop_errors.append(context))
    errors = _ErrorLog()
    logging.getLogger("flodl_async").addHandler(errors)
    links: list[FramedProtocol] = []
    mux = PortMux(
        host="127.0.0.1",
        port=0,
        sniff_timeout=2.0,
        limits=AdmissionLimits(max_unauthenticated=4096, max_unauthenticated_per_peer=4096),
    )
    try:
        async with asyncio.timeout(120 + connections * 0.05), asyncio.TaskGroup() as services:
            for channel in FRAMED_CHANNELS:
                service = FramedService(
                    channel=channel,
                    resolve=session_resolver(secret),
                    run_id=RUN_ID,
                    handler=echo_handler,
                    task_group=services,
                )
                mux.register(channel, _tracked(service.protocol_factory, links))
            mux.register(
                Channel.STATUS, lambda: StatusHttpProtocol(StatusBoard(), request_timeout=2.0)
            )
            await mux.start()
            try:
                stall_wait = Deadlines.resolve().handshake + 2 if stall else None
                await _drive_clients(
                    _LiveClients(seed, mux.port, secret, report),
                    connections,
                    concurrency,
                    stall_wait,
                )
                await _all_closed(links, report)
                stats = mux.statistics()
                report.mux = {
                    "accepted": stats.accepted,
                    "routed": stats.routed,
                    "dropped": stats.dropped,
                    "unsniffed_now": stats.unsniffed_now,
                }
                if stats.unsniffed_now:
                    report.violations.append(
                        f"{stats.unsniffed_now} connections still unsniffed after every client "
                        "closed"
                    )
            finally:
                await mux.aclose()
    except TimeoutError:
        report.violations.append("the live run hung (its overall deadline passed)")
    finally:
        logging.getLogger("flodl_async").removeHandler(errors)
    left = [
        t.get_name()
        for t in asyncio.all_tasks()
        if t is not asyncio.current_task() and not t.done()
    ]
    if left:
        report.violations.append(f"tasks left behind: {left[:10]}")
    report.violations += [
        f"the event loop reported: {c.get('message')} {c.get('exception')!r}" for c in loop_errors
    ]
    report.violations += [
        f"flodl_async logged an error: {r.getMessage()} {r.exc_info[1] if r.exc_info else ''!r}"
        for r in errors.records
    ]
    report.server_links = len(links)
    report.seconds = time.perf_counter() - started
    return report


async def _drive_clients(
    clients: _LiveClients, connections: int, concurrency: int, stall_wait: float | None
) -> None:
    done = asyncio.Event()
    slots = asyncio.Semaphore(concurrency)

    async def one(index: int) -> None:
        async with slots:
            await clients.fuzzed(index)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(clients.well_behaved(done), name="live-well-behaved")
        if stall_wait is not None:
            for channel in FRAMED_CHANNELS:
                tg.create_task(
                    clients.stalled(channel, stall_wait), name=f"live-stalled-{channel.value}"
                )
        started = time.perf_counter()
        async with asyncio.TaskGroup() as flood:
            for index in range(connections):
                flood.create_task(one(index), name=f"live-fuzz-{index}")
        clients.report.flood_seconds = time.perf_counter() - started
        done.set()


async def _all_closed(links: Sequence[FramedProtocol], report: LiveReport) -> None:
    """Every server-side link ends once its peer is gone (within a few seconds)."""
    results = await asyncio.gather(
        *(asyncio.wait_for(link.wait_closed(), 5) for link in links), return_exceptions=True
    )
    still_open = sum(isinstance(r, TimeoutError) for r in results)
    if still_open:
        report.violations.append(
            f"{still_open} of {len(links)} server-side links still open 5 s after every client "
            "closed"
        )


# ----- the command line
# ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the fuzz targets (and the live run), print the tables; exit 1 on any violation."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--inputs",
        type=int,
        default=100_000,
        help="sans-IO inputs in all, shared by the targets' weights (default 100000)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="the run's seed: same seed, same inputs (default 0)"
    )
    parser.add_argument(
        "--targets",
        default="*",
        help="a glob over target names, e.g. 'wire/*' or 'server-*' (default: all)",
    )
    parser.add_argument("--replay", metavar="TARGET:INDEX", help="run one input alone and print it")
    parser.add_argument(
        "--live",
        action="store_true",
        help="also fuzz a real PortMux + FramedService on loopback (uvloop)",
    )
    parser.add_argument(
        "--connections",
        type=int,
        default=3000,
        help="fuzzed connections of the live run (default 3000)",
    )
    args = parser.parse_args(argv)
    import faulthandler

    faulthandler.enable()  # a crash in C (cryptography, msgpack) still prints where it happened
    # the services log every rejected peer; the tables say it all
    logging.basicConfig(level=logging.CRITICAL)
    if args.replay:
        return replay(
            all_targets(args.seed, args.replay.rpartition(":")[0] or "-"), args.seed, args.replay
        )
    targets = all_targets(args.seed, args.targets)
    failed = False
    if targets and args.inputs > 0:
        report = fuzz(targets, seed=args.seed, budget=split_budget(targets, args.inputs))
        print(format_report(report), flush=True)
        failed = bool(report.found)
    if args.live:
        live_report = run_loop(live(args.seed, args.connections))
        print("", live_report.format(), sep="\n")
        failed = failed or bool(live_report.violations)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
