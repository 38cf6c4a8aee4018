"""Plain payloads: the relay's owner-only unix data socket carries tensor bytes unencrypted, headers still tagged."""

from __future__ import annotations

import asyncio

import pytest
import torch

from flodl_async.errors import AuthenticationFailed, ConnectionClosed, WireError
from flodl_async.net.framed import open_framed
from flodl_async.net.mux import PortMux
from flodl_async.net.service import FramedService
from flodl_async.wire import Channel, Credential
from flodl_async.wire import messages as m
from flodl_async.wire.frame import FrameConnection, Side
from flodl_async.wire.handshake import session_resolver
from flodl_async.wire.tensor import unpack_tensors

from .wirekit import LinkPair, contribution, feed_buffered


def _pair(
    keys: LinkPair, *, peer_plain: bool = True, controller_plain: bool = True
) -> tuple[FrameConnection, FrameConnection]:
    peer = FrameConnection(
        channel=Channel.DATA, side=Side.PEER, keys=keys.peer, plain_payloads=peer_plain
    )
    controller = FrameConnection(
        channel=Channel.DATA,
        side=Side.CONTROLLER,
        keys=keys.controller,
        plain_payloads=controller_plain,
    )
    return peer, controller


@pytest.mark.parametrize("chunk", [1, 4096, 1 << 20])
def test_plain_payloads_round_trip_in_place_with_exact_buffers(keys: LinkPair, chunk: int) -> None:
    peer, controller = _pair(keys)
    tensors = {
        "a": torch.arange(50_000, dtype=torch.float32),
        "b": torch.ones(3, dtype=torch.int64),
    }
    msg, parts = contribution(tensors, round=1)
    wire = b"".join(bytes(p) for p in peer.send_parts(msg, parts))
    payload_len = sum(p.nbytes for p in parts)
    sealed_peer = FrameConnection(channel=Channel.DATA, side=Side.PEER, keys=keys.peer)
    sealed_wire = b"".join(bytes(p) for p in sealed_peer.send_parts(msg, parts))
    assert len(sealed_wire) - len(wire) == 16  # the payload travels as it is: no GCM tag
    assert bytes(parts[0]) in wire  # the tensor's own bytes are on the wire
    frames = feed_buffered(
        controller, wire + peer.send(contribution({}, round=2, weight=0.0)[0]), chunk=chunk
    )
    assert len(frames) == 2
    assert frames[0].payload is not None
    assert frames[0].payload.nbytes == payload_len
    assert isinstance(frames[0].message, m.Contribution)
    out = unpack_tensors(frames[0].message.tensors, frames[0].payload)
    assert torch.equal(out["a"], tensors["a"])
    assert torch.equal(out["b"], tensors["b"])
    assert frames[1].payload is None


def test_a_tampered_header_or_body_still_fails_the_tag(keys: LinkPair) -> None:
    peer, controller = _pair(keys)
    msg, parts = contribution({"a": torch.ones(10)}, round=1)
    wire = bytearray(b"".join(bytes(p) for p in peer.send_parts(msg, parts)))
    wire[30] ^= 0x01  # inside the msgpack body
    with pytest.raises(AuthenticationFailed):
        feed_buffered(controller, bytes(wire))


def test_both_ends_must_agree_on_plain_payloads(keys: LinkPair) -> None:
    """A mismatch (a bug: both ends are ours) reads the next bytes as the missing GCM tags and fails, never decodes garbage."""
    peer, controller = _pair(keys, peer_plain=True, controller_plain=False)
    msg, parts = contribution({"a": torch.ones(1000)}, round=1)
    wire = b"".join(bytes(p) for p in peer.send_parts(msg, parts)) + peer.send(
        contribution({}, round=2, weight=0.0)[0]
    )
    with pytest.raises(WireError):
        feed_buffered(controller, wire)


async def test_plain_payloads_are_refused_on_a_tcp_link(secret: bytes) -> None:
    mux = PortMux(host="127.0.0.1", port=0)

    async def idle(link: object) -> None:
        await asyncio.Event().wait()

    try:
        async with asyncio.timeout(20), asyncio.TaskGroup() as tg:
            service = FramedService(
                channel=Channel.DATA,
                resolve=session_resolver(secret),
                run_id="r",
                handler=idle,
                task_group=tg,
                plain_payloads=True,
            )  # type: ignore[arg-type]
            mux.register(Channel.DATA, service.protocol_factory)
            await mux.start()
            with pytest.raises((ConnectionClosed, WireError, OSError)):
                await open_framed(
                    "127.0.0.1",
                    mux.port,
                    channel=Channel.DATA,
                    credential=Credential.session(secret),
                )
            await mux.aclose()
    finally:
        await mux.aclose()
