"""Tensor payloads: zero-copy out, frombuffer in, fed whole and one byte at a time."""

from __future__ import annotations

import pytest
import torch

from flodl_async.errors import AuthenticationFailed, FrameTooLarge, MalformedBody
from flodl_async.wire import Channel
from flodl_async.wire import messages as m
from flodl_async.wire.frame import FrameLimits
from flodl_async.wire.tensor import tensor_bytes, unpack_tensors, validate_specs

from .wirekit import (
    WHOLE_AND_BYTEWISE,
    LinkPair,
    codec_pair,
    consensus,
    contribution,
    feed,
    feed_buffered,
)


@WHOLE_AND_BYTEWISE
def test_tensor_message_round_trip(keys: LinkPair, chunk: int | None) -> None:
    tensors = {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "steps": torch.tensor([7], dtype=torch.int64),
        "empty": torch.zeros(0, 3),
    }
    peer, controller = codec_pair(keys, channel=Channel.DATA)
    msg, parts = contribution(tensors, round=3, weight=0.5)
    wire = b"".join(bytes(p) for p in peer.send_parts(msg, parts))
    [frame] = feed(controller, wire, chunk=chunk)
    assert isinstance(frame.message, m.Contribution)
    assert frame.message.round == 3
    out = unpack_tensors(frame.message.tensors, frame.payload)
    for name, tensor in tensors.items():
        assert out[name].dtype == tensor.dtype
        assert torch.equal(out[name], tensor)
    out["w"].add_(1)  # received tensors are writable views of the frame's own buffer
    assert out["w"][0, 0].item() == 1.0


def test_send_side_does_not_copy_the_tensor() -> None:
    t = torch.ones(1024)
    view = tensor_bytes(t)
    t[0] = 5.0
    assert bytes(view[:4]) == torch.tensor([5.0]).numpy().tobytes()


def test_non_contiguous_tensor_refused() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        tensor_bytes(torch.ones(4, 4).t())


def test_tensors_travel_both_ways_on_the_data_channel_only(keys: LinkPair) -> None:
    peer, controller = codec_pair(keys, channel=Channel.DATA)
    average = torch.ones(4)  # held until its bytes are written: payload views do not keep it alive
    msg, parts = consensus({"avg": average}, round=1)
    [down] = feed(
        peer, b"".join(bytes(p) for p in controller.send_parts(msg, parts))
    )  # a reduced result comes back
    assert isinstance(down.message, m.Consensus)
    assert torch.equal(unpack_tensors(down.message.tensors, down.payload)["avg"], average)
    with pytest.raises(TypeError, match="Heartbeat may not be sent"):
        peer.send(m.Heartbeat(sent_at=1.0))


def test_tensor_over_the_ceiling_refused(keys: LinkPair) -> None:
    peer, _ = codec_pair(keys, channel=Channel.DATA, limits=FrameLimits(max_payload=1024))
    msg, parts = contribution({"big": torch.ones(1024)})
    with pytest.raises(FrameTooLarge, match="4096 bytes"):
        peer.send_parts(msg, parts)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (
            m.TensorSpec(name="x", dtype="complex64", shape=(1,), offset=0, nbytes=8),
            "unknown dtype",
        ),
        (m.TensorSpec(name="x", dtype="float32", shape=(3,), offset=0, nbytes=8), "is not 8 bytes"),
        (
            m.TensorSpec(name="x", dtype="float32", shape=(4,), offset=8, nbytes=16),
            "outside the payload",
        ),
        (m.TensorSpec(name="x", dtype="float32", shape=(-1,), offset=0, nbytes=4), "negative"),
    ],
)
def test_inconsistent_tensor_specs_are_malformed(spec: m.TensorSpec, match: str) -> None:
    with pytest.raises(MalformedBody, match=match):
        validate_specs((spec,), payload_len=16)


def test_model_derived_ceiling() -> None:
    assert FrameLimits.tensor_ceiling_for_model(10) == 64 * 1024 * 1024
    assert FrameLimits.tensor_ceiling_for_model(100 * 1024 * 1024) == 200 * 1024 * 1024


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_buffered_receive_path_writes_payloads_in_place(keys: LinkPair, chunk: int) -> None:
    """The BufferedProtocol shape: get_buffer/buffer_updated, including straight-into-payload writes."""
    peer, controller = codec_pair(keys, channel=Channel.DATA)
    tensors = {
        "a": torch.arange(50_000, dtype=torch.float32),
        "b": torch.ones(3, dtype=torch.int64),
    }
    wire = b""
    for i in range(3):
        msg, parts = contribution(tensors, round=i)
        wire += b"".join(bytes(p) for p in peer.send_parts(msg, parts))
    wire += peer.send(
        contribution({}, round=3, weight=0.0)[0]
    )  # a payload-less frame after payload ones
    frames = feed_buffered(controller, wire, chunk=chunk)
    assert [
        (f.message.round, f.payload is None)
        for f in frames
        if isinstance(f.message, m.Contribution)
    ] == [(0, False), (1, False), (2, False), (3, True)]
    for frame in frames[:3]:
        assert isinstance(frame.message, m.Contribution)
        out = unpack_tensors(frame.message.tensors, frame.payload)
        assert torch.equal(out["a"], tensors["a"])
        assert torch.equal(out["b"], tensors["b"])


def test_buffered_path_still_rejects_a_tampered_payload(keys: LinkPair) -> None:
    peer, controller = codec_pair(keys, channel=Channel.DATA)
    msg, parts = contribution({"a": torch.ones(100_000)})
    wire = bytearray(b"".join(bytes(p) for p in peer.send_parts(msg, parts)))
    wire[len(wire) // 2] ^= 0x10
    with pytest.raises(AuthenticationFailed):
        feed_buffered(controller, bytes(wire))
