"""The devices mini-language: which devices a host's ranks run on, parsed in one place.

Text forms, wherever they come from (``flodl-agent --devices``, ``flodl-launch
--devices``, a cluster file's ``devices:`` scalar)::

    all        every GPU the host has (counted by the agent on that host)
    0,1,3      these GPU ids, one rank each
    cpu:4      four CPU ranks (gloo)

Errors say what the text should have been and what it was; the caller says
where it came from (``--devices: ...``, ``cluster.yml:7: workers[0].devices: ...``).
Pure: no I/O.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from ..errors import ConfigError

#: What every devices error says the text should have been.
EXPECTED = "expected `all`, GPU ids like 0,1, or cpu:N with N >= 1"

_CPU = re.compile(r"cpu:(\d+)")
_GPU_LIST = re.compile(r"\d+(?:\s*,\s*\d+)*")


class DeviceKind(enum.Enum):
    """How a worker's ranks are placed."""

    ALL_GPUS = "all"
    GPU_LIST = "gpus"
    CPU = "cpu"


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """A worker's devices: every GPU, a list of GPU ids, or N CPU ranks."""

    kind: DeviceKind
    gpu_ids: tuple[int, ...] = ()
    cpu_ranks: int = 0

    @property
    def is_gpu(self) -> bool:
        """GPU ranks use NCCL; CPU ranks use gloo."""
        return self.kind is not DeviceKind.CPU

    @property
    def known_count(self) -> int | None:
        """Ranks this spec yields, or None for ``all`` (known once the agent probes its host)."""
        if self.kind is DeviceKind.CPU:
            return self.cpu_ranks
        if self.kind is DeviceKind.GPU_LIST:
            return len(self.gpu_ids)
        return None

    def labels(self, gpu_count: int = 0) -> tuple[str, ...]:
        """Device labels an agent offers when joining (``cpu:0``.., ``cuda:3``..)."""
        if self.kind is DeviceKind.CPU:
            return tuple(f"cpu:{i}" for i in range(self.cpu_ranks))
        ids = self.gpu_ids if self.kind is DeviceKind.GPU_LIST else tuple(range(gpu_count))
        return tuple(f"cuda:{i}" for i in ids)

    @classmethod
    def cpu(cls, ranks: int) -> DeviceSpec:
        """``ranks`` CPU ranks."""
        return cls(kind=DeviceKind.CPU, cpu_ranks=ranks)

    @classmethod
    def gpus(cls, ids: tuple[int, ...]) -> DeviceSpec:
        """One rank on each of these GPU ids."""
        return cls(kind=DeviceKind.GPU_LIST, gpu_ids=ids)


def parse_gpu_ids(text: str) -> tuple[int, ...]:
    """``"0,1,3"`` → (0, 1, 3); distinct and non-negative, else :class:`ConfigError`."""
    try:
        ids = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"{text!r} is not a list of GPU ids like 0,1") from None
    if len(set(ids)) != len(ids) or min(ids) < 0:
        raise ConfigError(f"GPU ids {text!r} must be distinct and non-negative")
    return ids


def parse_devices(text: str, *, bare_cpu_ranks: int | None = None) -> DeviceSpec:
    """Parse one text form of the devices mini-language into a :class:`DeviceSpec`.

    ``bare_cpu_ranks`` lets a caller that already knows the rank count accept a plain
    ``cpu`` (``flodl-launch --nproc 4 --devices cpu`` means ``cpu:4``); without it,
    ``cpu`` alone is an error that asks for ``cpu:N``. Policy on top of the parse
    (``auto``, whether ``all`` has enough GPUs) stays with the caller.
    """
    choice = text.strip()
    if choice == "all":
        return DeviceSpec(kind=DeviceKind.ALL_GPUS)
    if choice == "cpu" and bare_cpu_ranks is not None:
        return DeviceSpec.cpu(bare_cpu_ranks)
    cpu = _CPU.fullmatch(choice)
    if cpu is not None:
        count = int(cpu.group(1))
        if count < 1:
            raise ConfigError(f"{EXPECTED}; got {text!r} (a host needs at least one CPU rank)")
        return DeviceSpec.cpu(count)
    if _GPU_LIST.fullmatch(choice):
        return DeviceSpec.gpus(parse_gpu_ids(choice.replace(" ", "")))
    raise ConfigError(f"{EXPECTED}; got {text!r}")
