"""Tensor payloads: dtype + shape + raw contiguous bytes, without extra copies.

Sending takes a zero-copy byte view of each contiguous CPU tensor (ctypes over
its storage, so numpy is not required and bfloat16 works); the frame codec
MACs and writes those views directly. Receiving wraps slices of the frame's
own payload buffer with ``torch.frombuffer``: no copy, writable. torch is
imported only inside these functions, never at module import, so the control
plane stays torch-free.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import MalformedBody
from .messages import TensorSpec

if TYPE_CHECKING:
    import torch

_MAX_TORCH_BYTES = 2**63 - 1

#: Wire dtype names and their element sizes; the names match ``str(torch.<dtype>)`` minus
#: ``torch.``.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A read-only byte view of a contiguous CPU tensor's storage (no copy).

    The view does not keep the tensor alive: the caller holds the tensor until the
    bytes are written.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            "tensor payloads must be contiguous CPU tensors; call .contiguous().cpu() first"
        )
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    raw = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    return memoryview(raw).cast("B").toreadonly()


def validate_specs(specs: Sequence[TensorSpec], payload_len: int) -> None:
    """Check that every spec is consistent and lies inside the payload (pure, no torch)."""
    for spec in specs:
        itemsize = DTYPE_ITEMSIZE.get(spec.dtype)
        if itemsize is None:
            raise MalformedBody(f"tensor {spec.name!r}: unknown dtype {spec.dtype!r}")
        if any(d < 0 for d in spec.shape):
            raise MalformedBody(f"tensor {spec.name!r}: negative dimension in shape {spec.shape}")
        # torch sizes strides and storage as if empty dimensions were 1: a shape whose product
        # overflows int64 that way cannot be made even when it holds no elements.
        if math.prod(max(d, 1) for d in spec.shape) * itemsize > _MAX_TORCH_BYTES:
            raise MalformedBody(
                f"tensor {spec.name!r}: shape {spec.shape} is larger than any tensor torch can make"
            )
        numel = 1
        for d in spec.shape:
            numel *= d
        if numel * itemsize != spec.nbytes:
            raise MalformedBody(
                f"tensor {spec.name!r}: shape {spec.shape} of {spec.dtype} is not {spec.nbytes} "
                "bytes"
            )
        if spec.offset < 0 or spec.offset + spec.nbytes > payload_len:
            raise MalformedBody(
                f"tensor {spec.name!r}: bytes [{spec.offset}, {spec.offset + spec.nbytes}) lie "
                "outside the payload"
            )


def unpack_tensors(
    specs: Sequence[TensorSpec], payload: memoryview | None
) -> dict[str, torch.Tensor]:
    """The tensors ``specs`` (a tensor message's ``tensors``) describe, viewing the received
    payload in place (no copy; writable); inconsistent specs are a :class:`MalformedBody`."""
    import torch  # deferred: the control plane never pays for it

    payload = payload if payload is not None else memoryview(bytearray())
    validate_specs(specs, payload.nbytes)
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        dtype = getattr(torch, spec.dtype)
        if spec.nbytes == 0:
            out[spec.name] = torch.empty(spec.shape, dtype=dtype)
            continue
        flat = torch.frombuffer(
            payload,
            dtype=dtype,
            offset=spec.offset,
            count=spec.nbytes // DTYPE_ITEMSIZE[spec.dtype],
        )
        out[spec.name] = flat.view(spec.shape)
    return out
