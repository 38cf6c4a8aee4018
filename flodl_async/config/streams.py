"""torchrun's ``--redirects`` and ``--tee``: which of a rank's streams go to its log files, which
to the console.

The values are torchrun's: ``0`` none, ``1`` stdout, ``2`` stderr, ``3`` both, for every rank, or a
per-rank map like ``0:3,1:1`` (a rank the map leaves out gets ``0``). A redirected stream goes to
its log file only; a teed one to its log file and the console; one neither names stays on the
console and, as torchrun has it, in no file. Without either option ``--log-dir`` keeps every
stream in its file and the console shows them all (``--local-ranks-filter`` narrows the console
either way). The ranks are those of the ``[host:rN]`` prefix and the log layout (on one host, the
local ranks torchrun's maps name).

Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import ConfigError

#: A stream set as torchrun numbers it: bit 1 stdout, bit 2 stderr.
_BITS = {"out": 1, "err": 2}


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamSet:
    """One option's value: the stream bits of every rank (``default``), or of the ranks named."""

    default: int = 0
    per_rank: Mapping[int, int] = field(default_factory=dict)

    def has(self, rank: int, stream: str) -> bool:
        """Whether ``rank``'s ``stream`` ('out' or 'err') is in the set."""
        return bool(self.per_rank.get(rank, self.default) & _BITS[stream])


def parse_stream_set(option: str, raw: str) -> StreamSet:
    """``3`` or ``0:3,1:1`` → a :class:`StreamSet`; anything else is a :class:`ConfigError`."""
    text = raw.strip()
    expected = (
        f"{option} takes 0 (none), 1 (stdout), 2 (stderr) or 3 (both), for every rank or per rank "
        f"like 0:3,1:1 (got {raw!r})"
    )
    if ":" not in text:
        return StreamSet(default=_bits(text, expected))
    per_rank: dict[int, int] = {}
    for item in text.split(","):
        rank_text, sep, bits_text = item.partition(":")
        rank_text = rank_text.strip()
        if not sep or not rank_text.isdigit():
            raise ConfigError(expected)
        rank = int(rank_text)
        if rank in per_rank:
            raise ConfigError(f"{option}: rank {rank} is given twice (got {raw!r})")
        per_rank[rank] = _bits(bits_text.strip(), expected)
    return StreamSet(per_rank=per_rank)


def _bits(text: str, expected: str) -> int:
    if text not in ("0", "1", "2", "3"):
        raise ConfigError(expected)
    return int(text)


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamRouting:
    """Where each rank's streams go, from ``--redirects`` and ``--tee``."""

    redirects: StreamSet = field(default_factory=StreamSet)
    tee: StreamSet = field(default_factory=StreamSet)

    def to_file(self, rank: int, stream: str) -> bool:
        """Whether ``rank``'s ``stream`` is written to its log file."""
        return self.redirects.has(rank, stream) or self.tee.has(rank, stream)

    def to_console(self, rank: int, stream: str) -> bool:
        """Whether ``rank``'s ``stream`` is shown on the console (a redirect that is not teed
        hides it)."""
        return self.tee.has(rank, stream) or not self.redirects.has(rank, stream)
