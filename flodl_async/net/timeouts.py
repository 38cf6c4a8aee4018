"""Network deadlines, all scaled by one knob: ``FLODL_NET_TIMEOUT_SCALE``."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from ..errors import ConfigError

SCALE_VARIABLE = "FLODL_NET_TIMEOUT_SCALE"


def timeout_scale(env: Mapping[str, str] | None = None) -> float:
    """The deadline multiplier from the environment (default 1.0; finite and at least 0.1)."""
    env = os.environ if env is None else env
    raw = env.get(SCALE_VARIABLE, "").strip()
    if not raw:
        return 1.0
    try:
        scale = float(raw)
    except ValueError:
        scale = math.nan
    if not math.isfinite(scale) or scale < 0.1:
        raise ConfigError(f"{SCALE_VARIABLE}={raw!r} must be a finite number of at least 0.1 (it multiplies every network deadline)")
    return scale


def scaled(seconds: float, env: Mapping[str, str] | None = None) -> float:
    """``seconds`` multiplied by the deadline scale."""
    return seconds * timeout_scale(env)
