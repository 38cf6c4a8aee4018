"""Network deadlines, all scaled by one knob: ``FLODL_NET_TIMEOUT_SCALE`` (see :mod:`flodl_async.deadlines`)."""

from __future__ import annotations

from collections.abc import Mapping

from ..deadlines import SCALE_VARIABLE, timeout_scale

__all__ = ["SCALE_VARIABLE", "scaled", "timeout_scale"]


def scaled(seconds: float, env: Mapping[str, str] | None = None) -> float:
    """``seconds`` multiplied by the deadline scale."""
    return seconds * timeout_scale(env)
