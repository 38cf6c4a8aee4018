"""Tensor payloads: zero-copy out, frombuffer in, fed whole and one byte at a time."""

from __future__ import annotations

import pytest
import torch

from flodl_async.errors import FrameTooLarge, MalformedBody
from flodl_async.wire import Channel, SessionKeys
from flodl_async.wire import messages as m
from flodl_async.wire.frame import Frame, FrameLimits
from flodl_async.wire.tensor import pack_tensors, tensor_bytes, unpack_tensors, validate_bundle

from .conftest import codec_pair


@pytest.mark.parametrize("bytewise", [False, True], ids=["whole", "bytewise"])
def test_tensor_bundle_round_trip(keys: SessionKeys, bytewise: bool) -> None:
    tensors = {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "steps": torch.tensor([7], dtype=torch.int64),
        "empty": torch.zeros(0, 3),
    }
    peer, controller = codec_pair(keys, channel=Channel.DATA)
    bundle, parts = pack_tensors(tensors, round=3, weight=0.5)
    wire = b"".join(bytes(p) for p in peer.send_parts(bundle, parts))
    chunks = [wire[i : i + 1] for i in range(len(wire))] if bytewise else [wire]
    frames: list[Frame] = []
    for chunk in chunks:
        controller.receive_data(chunk)
        frames.extend(controller.frames())
    [frame] = frames
    assert isinstance(frame.message, m.TensorBundle)
    assert frame.message.round == 3
    out = unpack_tensors(frame.message, frame.payload)
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


def test_tensor_over_the_ceiling_refused(keys: SessionKeys) -> None:
    peer, _ = codec_pair(keys, channel=Channel.DATA, limits=FrameLimits(max_payload=1024))
    bundle, parts = pack_tensors({"big": torch.ones(1024)})
    with pytest.raises(FrameTooLarge, match="4096 bytes"):
        peer.send_parts(bundle, parts)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (m.TensorSpec(name="x", dtype="complex64", shape=(1,), offset=0, nbytes=8), "unknown dtype"),
        (m.TensorSpec(name="x", dtype="float32", shape=(3,), offset=0, nbytes=8), "is not 8 bytes"),
        (m.TensorSpec(name="x", dtype="float32", shape=(4,), offset=8, nbytes=16), "outside the payload"),
        (m.TensorSpec(name="x", dtype="float32", shape=(-1,), offset=0, nbytes=4), "negative"),
    ],
)
def test_inconsistent_tensor_specs_are_malformed(spec: m.TensorSpec, match: str) -> None:
    with pytest.raises(MalformedBody, match=match):
        validate_bundle(m.TensorBundle(round=0, weight=1.0, tensors=(spec,)), payload_len=16)


def test_model_derived_ceiling() -> None:
    assert FrameLimits.tensor_ceiling_for_model(10) == 64 * 1024 * 1024
    assert FrameLimits.tensor_ceiling_for_model(100 * 1024 * 1024) == 200 * 1024 * 1024
