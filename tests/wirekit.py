"""The one way wire tests build codec pairs, feed them bytes and forge frames.

Every pure codec test feeds its input through :func:`feed` (whole, in chunks, one byte at a
time, or cut at given points) or :func:`feed_buffered` (the ``BufferedProtocol`` path), so a
new way of slicing input is added here once and every test gets it.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
from collections.abc import Iterable

import pytest

from flodl_async.wire import Channel, Direction, FrameConnection, SessionKeys, Side
from flodl_async.wire.frame import HEADER, PROTOCOL_VERSION, Frame, FrameLimits, Pending

#: Parametrise a test over feeding its bytes whole and one byte at a time.
WHOLE_AND_BYTEWISE = pytest.mark.parametrize("chunk", [None, 1], ids=["whole", "bytewise"])


def codec_pair(keys: SessionKeys, channel: Channel = Channel.CONTROL, limits: FrameLimits | None = None) -> tuple[FrameConnection, FrameConnection]:
    """(peer side, controller side) codecs of one connection."""
    peer = FrameConnection(channel=channel, side=Side.PEER, keys=keys, limits=limits)
    controller = FrameConnection(channel=channel, side=Side.CONTROLLER, keys=keys, limits=limits)
    return peer, controller


def sender_and_receiver(
    keys: SessionKeys, channel: Channel, direction: Direction, limits: FrameLimits | None = None
) -> tuple[FrameConnection, FrameConnection]:
    """(sending, receiving) codecs of one connection for frames travelling ``direction``."""
    peer, controller = codec_pair(keys, channel, limits)
    return (peer, controller) if direction is Direction.TO_CONTROLLER else (controller, peer)


def _pieces(data: bytes, chunk: int | None) -> Iterable[bytes]:
    if chunk is None:
        return [data]
    return (data[i : i + chunk] for i in range(0, len(data), chunk))


def feed(conn: FrameConnection, data: bytes, *, chunk: int | None = None, eof: bool = False) -> list[Frame]:
    """Feed ``data`` whole (``chunk=None``) or ``chunk`` bytes at a time, collecting ``frames()``.

    ``eof`` feeds the end of the stream afterwards (which may raise ``TruncatedFrame``).
    """
    out: list[Frame] = []
    for piece in _pieces(data, chunk):
        conn.receive_data(piece)
        out.extend(conn.frames())
    if eof:
        conn.receive_data(b"")
        out.extend(conn.frames())
    return out


def feed_cut(conn: FrameConnection, data: bytes, cuts: Iterable[int]) -> list[Frame]:
    """Feed ``data`` cut at the given offsets (taken modulo its length + 1), collecting frames one at a time."""
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    out: list[Frame] = []
    for start, end in itertools.pairwise(points):
        conn.receive_data(data[start:end])
        out.extend(drain(conn))
    return out


def feed_buffered(conn: FrameConnection, data: bytes, *, chunk: int | None = None) -> list[Frame]:
    """Feed ``data`` the ``BufferedProtocol`` way (``get_buffer``/``buffer_updated``), at most ``chunk`` bytes per read."""
    out: list[Frame] = []
    offset = 0
    while offset < len(data):
        target = conn.get_buffer(-1)
        n = min(len(target), chunk or len(data), len(data) - offset)
        target[:n] = data[offset : offset + n]
        target.release()
        conn.buffer_updated(n)
        offset += n
        out.extend(conn.frames())
    return out


def drain(conn: FrameConnection) -> list[Frame]:
    """Every frame ``next_frame()`` yields now (the one-at-a-time path)."""
    out: list[Frame] = []
    while True:
        item = conn.next_frame()
        if isinstance(item, Pending):
            return out
        out.append(item)


def sealed(
    keys: SessionKeys,
    kind: int,
    body: bytes,
    *,
    channel: Channel = Channel.CONTROL,
    direction: Direction = Direction.TO_CONTROLLER,
    seq: int = 0,
    flags: int = 0,
) -> bytes:
    """A frame with a valid tag around an arbitrary kind and body (what a buggy but keyed peer could send)."""
    header = HEADER.pack(PROTOCOL_VERSION, flags, kind, seq, len(body), 0)
    tag = hmac.new(keys.key(channel, direction), header + body, hashlib.sha256).digest()
    return header + body + tag
