"""Epochs and deterministic partitions: who trains which batch.

Theory of operation. Pure (no asyncio, no torch): the controller deals in *batch indices*
only and no data is ever shipped. Every rank computes the same epoch permutation from
``(seed, epoch)`` with :func:`permutation` — SplitMix64 driving Fisher-Yates, in plain
Python integers, so the result is identical on every platform and Python version — and
batch ``b`` of an epoch is samples ``perm[b*B:(b+1)*B]``.

Two ways to hand batches out:

* SYNC: :func:`sync_slices` — each rank owns one contiguous slice of the epoch, sized by
  :func:`largest_remainder` over equal ratios or ``partition_ratios``.
* CADENCE / ASYNC: a :class:`ChunkPool` per epoch; each window takes the next
  ``counts[r]`` batches for rank ``r`` (:func:`tail_allocation` once the pool runs short).
  A dead rank's in-flight ranges go back to the front (:meth:`ChunkPool.forfeit`), and
  :meth:`ChunkPool.uncovered_ranges` / :meth:`ChunkPool.from_coverage` are what a
  checkpoint records and a resume rebuilds.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterable, Sequence

#: ``(first_batch, n)``: ``n`` consecutive batches of an epoch's pool.
Range = tuple[int, int]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def permutation(n: int, seed: int, epoch: int) -> array[int]:
    """The sample order of ``epoch``: Fisher-Yates driven by SplitMix64 seeded ``(seed + epoch) mod
    2**64``.

    ``x += golden; z = mix(x)`` per draw; for ``i = n-1 .. 1``: ``j = (z * (i+1)) >> 64``, swap.
    """
    if n < 0:
        raise ValueError(f"permutation of a negative length {n}")
    out = array("Q", range(n))
    x = (seed + epoch) & _MASK
    for i in range(n - 1, 0, -1):
        x, z = splitmix64(x)
        j = (z * (i + 1)) >> 64
        out[i], out[j] = out[j], out[i]
    return out


def splitmix64(state: int) -> tuple[int, int]:
    """One SplitMix64 step: ``(next state, output)``, all mod 2**64."""
    x = (state + _GOLDEN) & _MASK
    z = ((x ^ (x >> 30)) * _MIX1) & _MASK
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK
    return x, z ^ (z >> 31)


def batches_per_epoch(n: int, batch_size: int, *, drop_last: bool) -> int:
    """``n // B`` with ``drop_last``; otherwise ``ceil(n / B)`` (the last batch short)."""
    full, rest = divmod(n, batch_size)
    return full if drop_last or rest == 0 else full + 1


def batch_samples(perm: Sequence[int], batch: int, batch_size: int) -> Sequence[int]:
    """The sample indices of ``batch`` in an epoch's permutation (the last one may be short)."""
    return perm[batch * batch_size : (batch + 1) * batch_size]


def largest_remainder(total: int, weights: Sequence[float]) -> tuple[int, ...]:
    """Split ``total`` proportionally to ``weights`` (Hamilton's method; ties go to the lower
    index).

    The parts sum to ``total`` exactly; each is the floor of its quota or one more.
    """
    if total < 0:
        raise ValueError(f"cannot split a negative total {total}")
    if not weights or any(w < 0 for w in weights):
        raise ValueError(f"weights must be non-negative and non-empty, got {list(weights)}")
    mass = float(sum(weights))
    if mass <= 0:
        raise ValueError("weights sum to zero: nothing to split by")
    quotas = [total * w / mass for w in weights]
    parts = [int(q) for q in quotas]
    short = total - sum(parts)
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - parts[i]), i))
    for i in by_remainder[:short]:
        parts[i] += 1
    return tuple(parts)


def sync_slices(
    n_batches: int, world_size: int, ratios: Sequence[float] | None = None
) -> tuple[Range, ...]:
    """Each rank's contiguous slice of an epoch under SYNC (equal, or by ``partition_ratios``)."""
    if ratios is not None and len(ratios) != world_size:
        raise ValueError(f"{len(ratios)} partition ratios for a world of {world_size}")
    sizes = largest_remainder(n_batches, ratios if ratios is not None else [1.0] * world_size)
    out, first = [], 0
    for size in sizes:
        out.append((first, size))
        first += size
    return tuple(out)


def tail_allocation(remaining: int, counts: Sequence[int]) -> tuple[int, ...]:
    """The final window of an epoch: ``remaining`` batches split proportionally to ``counts``."""
    if remaining >= sum(counts):
        return tuple(counts)
    return largest_remainder(remaining, [float(c) for c in counts])


def coalesce(ranges: Iterable[Range]) -> tuple[Range, ...]:
    """Sorted, merged, non-empty ranges."""
    out: list[Range] = []
    for first, n in sorted(r for r in ranges if r[1] > 0):
        if out and out[-1][0] + out[-1][1] >= first:
            last_first, last_n = out[-1]
            out[-1] = (last_first, max(last_first + last_n, first + n) - last_first)
        else:
            out.append((first, n))
    return tuple(out)


def range_size(ranges: Iterable[Range]) -> int:
    """How many batches ``ranges`` hold."""
    return sum(n for _first, n in ranges)


def split_ranges(ranges: Sequence[Range], at: int) -> tuple[tuple[Range, ...], tuple[Range, ...]]:
    """``ranges`` in their order (not sorted): the first ``at`` batches, and the rest."""
    head: list[Range] = []
    tail: list[Range] = []
    left = at
    for first, n in ranges:
        if left >= n:
            head.append((first, n))
            left -= n
        elif left > 0:
            head.append((first, left))
            tail.append((first + left, n - left))
            left = 0
        else:
            tail.append((first, n))
    return tuple(r for r in head if r[1]), tuple(r for r in tail if r[1])


def subtract(ranges: Sequence[Range], minus: Iterable[Range]) -> tuple[Range, ...]:
    """``ranges`` in their order, without any batch of ``minus`` (a resumed epoch's covered
    batches)."""
    cut = coalesce(minus)
    out: list[Range] = []
    for first, n in ranges:
        at, end = first, first + n
        for c_first, c_n in cut:
            c_end = c_first + c_n
            if c_end <= at or c_first >= end:
                continue
            if c_first > at:
                out.append((at, c_first - at))
            at = max(at, c_end)
        if at < end:
            out.append((at, end - at))
    return tuple(out)


def share_ranges(ranges: Sequence[Range], parts: int) -> tuple[tuple[Range, ...], ...]:
    """``ranges`` cut in order into ``parts`` runs of sizes within one of each other (a dead SYNC
    rank's rest of its slice, over the survivors)."""
    out: list[tuple[Range, ...]] = []
    rest = tuple(ranges)
    for size in largest_remainder(range_size(ranges), [1.0] * parts):
        part, rest = split_ranges(rest, size)
        out.append(part)
    return tuple(out)


class ChunkPool:
    """One epoch's batches, ``[0, total)``: free, in flight per ``(rank, round)``, or covered.

    ``covered ∪ free ∪ in-flight`` is always every batch, disjoint (a property test holds it).
    """

    def __init__(self, total: int) -> None:
        if total < 0:
            raise ValueError(f"a pool of {total} batches")
        self.total = total
        self._free: list[Range] = [(0, total)] if total else []
        self._in_flight: dict[tuple[int, int], tuple[Range, ...]] = {}
        self._covered: list[Range] = []

    @classmethod
    def from_coverage(cls, total: int, uncovered: Iterable[Range]) -> ChunkPool:
        """A pool whose only free batches are ``uncovered`` (a resume); the rest counts as
        covered."""
        pool = cls(total)
        free = coalesce(uncovered)
        for first, n in free:
            if first < 0 or first + n > total:
                raise ValueError(
                    f"uncovered range ({first}, {n}) is outside the epoch's {total} batches"
                )
        pool._free = list(free)
        pool._covered = list(_complement(free, total))
        return pool

    @property
    def remaining(self) -> int:
        """Batches not handed out yet."""
        return range_size(self._free)

    @property
    def drained(self) -> bool:
        """Nothing left to hand out (some may still be in flight)."""
        return not self._free

    @property
    def complete(self) -> bool:
        """Every batch is covered: handed out and completed into a consensus."""
        return not self._free and not self._in_flight

    def in_flight(self) -> dict[tuple[int, int], tuple[Range, ...]]:
        """What each ``(rank, round)`` holds."""
        return dict(self._in_flight)

    def take(self, rank: int, round_: int, k: int) -> tuple[Range, ...]:
        """The next ``k`` batches (fewer when the pool runs short), from the front, for ``rank``'s
        window ``round_``."""
        if (rank, round_) in self._in_flight:
            raise ValueError(f"rank {rank} already holds a window of round {round_}")
        taken: list[Range] = []
        want = k
        while want > 0 and self._free:
            first, n = self._free[0]
            if n <= want:
                taken.append(self._free.pop(0))
                want -= n
            else:
                taken.append((first, want))
                self._free[0] = (first + want, n - want)
                want = 0
        self._in_flight[(rank, round_)] = tuple(taken)
        return tuple(taken)

    def complete_round(self, round_: int) -> None:
        """Every window of ``round_`` went into a consensus: its batches are covered."""
        for key in [key for key in self._in_flight if key[1] <= round_]:
            self._covered.extend(self._in_flight.pop(key))
        self._covered = list(coalesce(self._covered))

    def forfeit(self, rank: int, *, keep: int | None = None) -> tuple[Range, ...]:
        """``rank`` died: its in-flight batches go back to the front of the pool; returns them.

        ``keep``: a round being reduced as it died, whose window stays in flight until the
        round's result says whether its contribution made it in (:meth:`forfeit_window`, or
        :meth:`complete_round`)."""
        back: list[Range] = []
        for key in [key for key in self._in_flight if key[0] == rank and key[1] != keep]:
            back.extend(self._in_flight.pop(key))
        self._free = list(coalesce([*self._free, *back]))
        return coalesce(back)

    def forfeit_window(self, rank: int, round_: int) -> tuple[Range, ...]:
        """``rank``'s window of ``round_`` did not reach the consensus: back to the front of the
        pool; returns it."""
        back = self._in_flight.pop((rank, round_), ())
        self._free = list(coalesce([*self._free, *back]))
        return coalesce(back)

    def uncovered_ranges(self) -> tuple[Range, ...]:
        """Batches not yet completed into a consensus (free or in flight), coalesced and sorted."""
        flying = (r for ranges in self._in_flight.values() for r in ranges)
        return coalesce([*self._free, *flying])

    def covered_ranges(self) -> tuple[Range, ...]:
        """Batches completed into a consensus."""
        return coalesce(self._covered)


def _complement(ranges: Sequence[Range], total: int) -> Iterable[Range]:
    at = 0
    for first, n in heapq.nsmallest(len(ranges), ranges):
        if first > at:
            yield (at, first - at)
        at = max(at, first + n)
    if at < total:
        yield (at, total - at)
