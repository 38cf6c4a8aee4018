"""This host's GPUs as the caller sees them: counted from the device nodes, placed within
``CUDA_VISIBLE_DEVICES``.

The caller's mask is law, as under torchrun: with ``CUDA_VISIBLE_DEVICES=2,3``
on a four-GPU box a run has two GPUs, and they are physical GPUs 2 and 3.
Every device id a user gives (``--devices 0,1``, a cluster file's
``devices: [0, 1]``) is an index into that visible set, the way
``cuda:0`` is. Each rank gets the host's selected GPUs as its own
``CUDA_VISIBLE_DEVICES``, written in the caller's own terms (an index, or a
``GPU-<uuid>`` / ``MIG-<uuid>`` name), so that ``cuda:LOCAL_RANK`` is the
rank's GPU.

The count is read without importing torch or the driver: the ``nvidiaN``
nodes under ``/dev``. ``FLODL_INTERNAL_DEV_DIR`` names another directory to
count them in (tests make a host look like it has four GPUs with it; nothing
else changes). The mask itself follows CUDA's rule: it is read up to its
first invalid entry (an index past the host's count, or not a device name),
so ``0,7,1`` on a two-GPU host is just GPU 0, as CUDA would see it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence

from ..errors import ConfigError

#: Where the device nodes are counted (tests point it at a directory of empty files).
DEV_DIR_VARIABLE = "FLODL_INTERNAL_DEV_DIR"
MASK_VARIABLE = "CUDA_VISIBLE_DEVICES"
_NAMED_PREFIXES = ("GPU-", "MIG-")


def physical_gpu_count(env: Mapping[str, str] | None = None) -> int:
    """The ``/dev/nvidiaN`` nodes of this host (none means 0)."""
    env = os.environ if env is None else env
    dev = env.get(DEV_DIR_VARIABLE) or "/dev"
    with contextlib.suppress(OSError):
        return sum(
            1 for name in os.listdir(dev) if name.startswith("nvidia") and name[6:].isdigit()
        )
    return 0


def visible_gpus(mask: str | None, physical: int) -> tuple[str, ...]:
    """The GPUs a process sees, in the mask's own terms: every one without a mask, else the mask up
    to its first invalid entry."""
    if mask is None:
        return tuple(str(i) for i in range(physical))
    seen: list[str] = []
    for raw in mask.split(","):
        entry = raw.strip()
        if entry.startswith(_NAMED_PREFIXES) and len(entry) > 4:
            pass
        elif entry.isdigit() and int(entry) < physical:
            entry = str(int(entry))
        else:
            break  # CUDA stops at the first entry it cannot use
        if entry in seen:
            break  # a repeated device is invalid too
        seen.append(entry)
    return tuple(seen)


def host_visible_gpus(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """This process's visible GPUs (the caller's ``CUDA_VISIBLE_DEVICES`` applied to the host's
    count)."""
    env = os.environ if env is None else env
    return visible_gpus(env.get(MASK_VARIABLE), physical_gpu_count(env))


def select(indices: Sequence[int], visible: Sequence[str]) -> tuple[str, ...]:
    """Device indices (into the visible set) → the ranks' ``CUDA_VISIBLE_DEVICES`` entries; an index
    past it is a ConfigError."""
    missing = [i for i in indices if i >= len(visible)]
    if missing:
        shown = f"visible: {','.join(visible)}" if visible else "none visible"
        raise ConfigError(
            f"GPU {missing[0]} is not visible here: this host shows {len(visible)} GPU(s) "
            f"({shown}); "
            f"device ids count from 0 within the visible set ({MASK_VARIABLE} narrows it)"
        )
    return tuple(visible[i] for i in indices)
