"""The averaging arithmetic shared by the relay's host fold and the controller's reducer.

Theory of operation. A round's consensus is ``Σ_r w_r·t_r / Σ_r w_r``, summed in a
fixed order (ascending rank within a host, ascending host by lowest rank at the
controller, so the same inputs always give the same bits) into an accumulator of
float32 — float64 for float64 tensors and for integer and bool buffers — and divided
once. A relay that folds several ranks sends its partial sum *in the
accumulator dtype* (``prescaled``): casting it back to bf16 before the divide would
lose precision. After the divide, float tensors are cast back to their dtype and
integer ones are rounded half-to-even first.

The documented arithmetic, which tests replay exactly::

    acc = 0                               # per tensor, accumulator dtype
    acc.add_(t, alpha=w)                  # a raw (one-rank) contribution
    acc.add_(t)                           # a prescaled (folded) one
    acc.div_(mass)                        # mass = Σ w, summed in the same order
    round half-to-even (integers), cast back

Implementation shortcuts keep that arithmetic bit for bit: the first term is written
straight into the accumulator (``0 + w·t`` is ``w·t``), and a prescaled first frame
whose bytes already have the accumulator's layout *becomes* the accumulator.

Spec checks (:func:`check_specs`, :func:`packed_specs`) are pure; everything that
touches tensors imports torch inside the function, so callers run it in an executor
thread and the control plane never loads torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import ProtocolError
from ..wire.messages import TensorSpec
from ..wire.tensor import DTYPE_ITEMSIZE
from .modelschema import FLOAT_DTYPES, TensorMeta

if TYPE_CHECKING:
    import torch


def acc_dtype(dtype: str) -> str:
    """The accumulator dtype of a tensor of ``dtype``: float64 for float64 and non-float, else
    float32."""
    if dtype == "float64" or dtype not in FLOAT_DTYPES:
        return "float64"
    return "float32"


def packed_specs(
    metas: Sequence[tuple[str, str, tuple[int, ...]]],
) -> tuple[tuple[TensorSpec, ...], int]:
    """Specs of tensors packed back to back in one payload, and the payload's length."""
    specs: list[TensorSpec] = []
    offset = 0
    for name, dtype, shape in metas:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * DTYPE_ITEMSIZE[dtype]
        specs.append(TensorSpec(name=name, dtype=dtype, shape=shape, offset=offset, nbytes=nbytes))
        offset += nbytes
    return tuple(specs), offset


def acc_specs(specs: Sequence[TensorSpec]) -> tuple[tuple[TensorSpec, ...], int]:
    """The packed accumulator layout for tensors described by ``specs``."""
    return packed_specs([(s.name, acc_dtype(s.dtype), s.shape) for s in specs])


def schema_specs(
    metas: Sequence[TensorMeta], *, accumulated: bool = False
) -> tuple[tuple[TensorSpec, ...], int]:
    """The packed layout of a schema's tensors, in their own dtypes or in accumulator dtypes."""
    return packed_specs(
        [(m.name, acc_dtype(m.dtype) if accumulated else m.dtype, m.shape) for m in metas]
    )


def check_specs(
    specs: Sequence[TensorSpec], expected: Sequence[TensorSpec], payload_len: int, *, what: str
) -> None:
    """``specs`` must describe exactly ``expected`` (names, dtypes, shapes, in order), packed inside
    the payload.

    Offsets are checked too, so a payload is always read where its sender wrote it. The error
    names the first tensor that differs.
    """
    for index, (got, want) in enumerate(zip(specs, expected, strict=False)):
        if (got.name, got.dtype, tuple(got.shape)) != (want.name, want.dtype, tuple(want.shape)):
            raise ProtocolError(
                f"{what}: tensor {index} is {got.name!r} ({got.dtype}, shape {tuple(got.shape)}) "
                "but the model has "
                f"{want.name!r} ({want.dtype}, shape {tuple(want.shape)}) there; every rank must "
                "build the same model"
            )
        if got.nbytes != want.nbytes or got.offset < 0 or got.offset + got.nbytes > payload_len:
            raise ProtocolError(
                f"{what}: tensor {got.name!r} claims bytes [{got.offset}, "
                f"{got.offset + got.nbytes}) of a {payload_len}-byte payload"
            )
    if len(specs) != len(expected):
        raise ProtocolError(
            f"{what}: {len(specs)} tensors, but the model has {len(expected)}; every rank must "
            "build the same model"
        )


def views(specs: Sequence[TensorSpec], buffer: bytearray | memoryview) -> list[torch.Tensor]:
    """Tensors viewing ``buffer`` where ``specs`` say (no copy, writable); checked specs only."""
    import torch

    out: list[torch.Tensor] = []
    for spec in specs:
        dtype = getattr(torch, spec.dtype)
        if spec.nbytes == 0:
            out.append(torch.empty(spec.shape, dtype=dtype))
            continue
        flat = torch.frombuffer(
            buffer, dtype=dtype, offset=spec.offset, count=spec.nbytes // DTYPE_ITEMSIZE[spec.dtype]
        )
        out.append(flat.view(spec.shape))
    return out


def add_term(
    acc: Sequence[torch.Tensor], terms: Sequence[torch.Tensor], weight: float | None, *, first: bool
) -> None:
    """``acc += weight·terms`` (``weight=None``: a prescaled term, added as it is), per tensor.

    ``first``: the accumulator holds garbage (a pooled buffer), so the term is written, not added.
    """
    for a, t in zip(acc, terms, strict=True):
        if first:
            if weight is None:
                a.copy_(t)
            elif t.dtype == a.dtype:
                torch_mul(t, weight, a)
            else:
                # mul(t, w) would compute in t's dtype (bf16, or float32 for an int64 tensor): copy,
                # then scale.
                a.copy_(t)
                a.mul_(weight)
        elif weight is None:
            a.add_(t)
        else:
            a.add_(t, alpha=weight)


def torch_mul(t: torch.Tensor, weight: float, out: torch.Tensor) -> None:
    import torch

    torch.mul(t, weight, out=out)


def finish(
    acc: Sequence[torch.Tensor],
    dtypes: Sequence[str],
    mass: float,
    out: Sequence[torch.Tensor | None],
) -> list[torch.Tensor]:
    """Divide by ``mass``, round integers half-to-even, cast back; returns the consensus tensors.

    ``out[i]`` receives tensor ``i`` when its dtype differs from the accumulator's (None: the
    accumulator itself is the result, divided in place).
    """
    import torch

    result: list[torch.Tensor] = []
    for a, dtype, target in zip(acc, dtypes, out, strict=True):
        a.div_(mass)
        if dtype not in FLOAT_DTYPES:
            a.round_()  # half-to-even, as torch.round
        if target is None:
            result.append(a)
            continue
        if dtype == "bool":
            torch.ne(a, 0, out=target)
        else:
            target.copy_(a)
        result.append(target)
    return result
