"""The one way wire tests build codec pairs, feed them bytes and forge frames.

Every pure codec test feeds its input through :func:`feed` (whole, in chunks, one byte at a
time, or cut at given points) or :func:`feed_buffered` (the ``BufferedProtocol`` path), so a
new way of slicing input is added here once and every test gets it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

from flodl_async.training.foldmath import packed_specs
from flodl_async.wire import (
    CHANNEL_MAGIC,
    Channel,
    ClientHandshake,
    Credential,
    Direction,
    FrameConnection,
    LinkKeys,
    ServerHandshake,
    Side,
)
from flodl_async.wire import messages as m
from flodl_async.wire.frame import HEADER, Frame, FrameLimits, Pending
from flodl_async.wire.handshake import PROTOCOL_VERSION, session_resolver
from flodl_async.wire.tensor import tensor_bytes

if TYPE_CHECKING:
    import torch

#: Parametrise a test over feeding its bytes whole and one byte at a time.
WHOLE_AND_BYTEWISE = pytest.mark.parametrize("chunk", [None, 1], ids=["whole", "bytewise"])


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkPair:
    """Both ends' keys of one connection, as its handshake gave them."""

    peer: LinkKeys
    controller: LinkKeys

    def mac_key(self, direction: Direction) -> bytes:
        """The HMAC key of frames travelling ``direction``."""
        return (
            self.peer.send_mac if direction is Direction.TO_CONTROLLER else self.controller.send_mac
        )


def handshake_keys(
    secret: bytes, channel: Channel = Channel.CONTROL, *, run_id: str = "test-run"
) -> LinkPair:
    """Run a real handshake in memory (client and server, session secret) and return both key sets."""
    client = ClientHandshake(channel=channel, credential=Credential.session(secret), version="test")
    server = ServerHandshake(
        channel=channel, resolve=session_resolver(secret), run_id=run_id, version="test"
    )
    server_hello = server.receive_data(client.hello())
    proof = client.receive_data(server_hello.send)
    done = server.receive_data(proof.send)
    assert proof.established is not None
    assert done.established is not None
    return LinkPair(peer=proof.established.keys, controller=done.established.keys)


def codec_pair(
    keys: LinkPair, channel: Channel = Channel.CONTROL, limits: FrameLimits | None = None
) -> tuple[FrameConnection, FrameConnection]:
    """(peer side, controller side) codecs of one connection."""
    peer = FrameConnection(channel=channel, side=Side.PEER, keys=keys.peer, limits=limits)
    controller = FrameConnection(
        channel=channel, side=Side.CONTROLLER, keys=keys.controller, limits=limits
    )
    return peer, controller


def sender_and_receiver(
    keys: LinkPair, channel: Channel, direction: Direction, limits: FrameLimits | None = None
) -> tuple[FrameConnection, FrameConnection]:
    """(sending, receiving) codecs of one connection for frames travelling ``direction``."""
    peer, controller = codec_pair(keys, channel, limits)
    return (peer, controller) if direction is Direction.TO_CONTROLLER else (controller, peer)


def tensor_parts(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[tuple[m.TensorSpec, ...], list[memoryview]]:
    """Specs of ``tensors`` laid end to end, and their bytes: a tensor message's payload, as a
    rank's data link lays it out."""
    metas = [
        (name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in tensors.items()
    ]
    specs, _ = packed_specs(metas)
    return specs, [tensor_bytes(t) for t in tensors.values()]


def contribution(
    tensors: Mapping[str, torch.Tensor], *, round: int = 0, weight: float = 1.0
) -> tuple[m.Contribution, list[memoryview]]:
    """A rank's contribution of ``tensors`` to ``round`` (up the data channel) and its payload parts."""
    specs, parts = tensor_parts(tensors)
    return m.Contribution(
        round=round, kind="model", rank=0, weight=weight, steps=1, tensors=specs
    ), parts


def consensus(
    tensors: Mapping[str, torch.Tensor], *, round: int = 0, mass: float = 1.0
) -> tuple[m.Consensus, list[memoryview]]:
    """The consensus ``tensors`` of ``round`` (down the data channel) and its payload parts."""
    specs, parts = tensor_parts(tensors)
    return m.Consensus(round=round, kind="model", mass=mass, tensors=specs), parts


def _pieces(data: bytes, chunk: int | None) -> Iterable[bytes]:
    if chunk is None:
        return [data]
    return (data[i : i + chunk] for i in range(0, len(data), chunk))


def feed(
    conn: FrameConnection, data: bytes, *, chunk: int | None = None, eof: bool = False
) -> list[Frame]:
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
    keys: LinkPair,
    kind: int,
    body: bytes,
    *,
    direction: Direction = Direction.TO_CONTROLLER,
    seq: int = 0,
    flags: int = 0,
) -> bytes:
    """A frame with a valid tag around an arbitrary kind and body (what a buggy but keyed peer could send).

    Keys belong to one connection of one channel, so the frame is valid on whichever channel
    that connection's codecs are built for.
    """
    header = HEADER.pack(PROTOCOL_VERSION, flags, kind, seq, len(body), 0)
    tag = hmac.new(keys.mac_key(direction), header + body, hashlib.sha256).digest()
    return header + body + tag


async def raw_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    secret: bytes,
    channel: Channel,
    *,
    limits: FrameLimits | None = None,
) -> FrameConnection:
    """Do a client's handshake by hand on a raw stream (magic first), and return the codec it keys.

    For tests that write frames byte by byte: forged, cut or tampered after a real handshake.
    """
    client = ClientHandshake(channel=channel, credential=Credential.session(secret), version="test")
    writer.write(CHANNEL_MAGIC[channel] + client.hello())
    while True:
        step = client.receive_data(await reader.read(4096))
        if step.established is not None:
            writer.write(step.send)
            return FrameConnection(
                channel=channel, side=Side.PEER, keys=step.established.keys, limits=limits
            )
