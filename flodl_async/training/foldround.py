"""One round's fold barrier: which contribution folds next, whether the round is complete.

Theory of operation. A round expects a set of ranks. Contributions arrive in any order, each
covering one or more of those ranks (a rank's own frame on a host; a host's frame at the
reducer), and are *offered* to the barrier with the item the shell will fold. The barrier hands
them back to fold in ascending order of their lowest rank, so that a round's floating-point sum
does not depend on which frame came first:

* the waiting item with the lowest rank folds once no lower rank can still arrive, that is once
  every alive expected rank below it is covered (arrived, folded or not);
* a death (:meth:`FoldRound.declare_dead`) takes the rank out of the barrier: what waited for it
  folds; a frame a dead rank sent before or after its death, while the round is open, still
  counts;
* the round is complete when nothing waits and every alive expected rank is covered.

Each rank contributes once: :meth:`FoldRound.refusal` says why a frame may not be offered (the
shell turns that into its own protocol error). A frame for a round already completed is the
shell's to judge; the barrier of a completed round is dropped.

Pure: no asyncio, no torch. The shells (the controller's reducer, the relay's host fold) keep the
tensor math, which runs off the loop thread, and the sends.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


class Refused(enum.Enum):
    """Why a frame may not join a round's barrier."""

    #: It lists no rank at all.
    NO_RANKS = "no ranks"
    #: A rank it lists is covered already (by an earlier frame, or twice in this one).
    TWICE = "twice"
    #: A rank it lists is not one the round expects.
    UNEXPECTED = "unexpected"


@dataclass(frozen=True, slots=True, kw_only=True)
class Refusal:
    """A frame the barrier will not take: the first offending rank (None for ``NO_RANKS``)."""

    reason: Refused
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class _Waiting(Generic[T]):
    first: int  # the frame's lowest rank: its place in the fold order
    item: T


class FoldRound(Generic[T]):
    """The fold barrier of one round over ``expected`` ranks; see the module docstring.

    ``dead``: ranks known dead when the round opens (later deaths go to :meth:`declare_dead`).
    """

    def __init__(self, expected: Iterable[int], *, dead: Iterable[int] = ()) -> None:
        self.expected = frozenset(expected)
        self._dead = set(dead) & self.expected
        self._covered: set[int] = set()
        # sorted by lowest rank; no two share one, since no rank is covered twice
        self._waiting: list[_Waiting[T]] = []

    @property
    def alive(self) -> frozenset[int]:
        """The expected ranks not declared dead."""
        return self.expected - self._dead

    @property
    def covered(self) -> frozenset[int]:
        """Every rank some offered frame lists, folded or still waiting."""
        return frozenset(self._covered)

    @property
    def waiting(self) -> int:
        """How many offered frames have not been handed out to fold."""
        return len(self._waiting)

    @property
    def complete(self) -> bool:
        """Nothing waits and every alive expected rank is covered."""
        return not self._waiting and self.alive <= self._covered

    def refusal(self, ranks: Sequence[int]) -> Refusal | None:
        """Why a frame listing ``ranks`` may not be offered, or None; ranks are checked in the
        frame's order, each first for being covered already, then for being expected."""
        if not ranks:
            return Refusal(reason=Refused.NO_RANKS)
        seen: set[int] = set()
        for rank in ranks:
            if rank in self._covered or rank in seen:
                return Refusal(reason=Refused.TWICE, rank=rank)
            if rank not in self.expected:
                return Refusal(reason=Refused.UNEXPECTED, rank=rank)
            seen.add(rank)
        return None

    def offer(self, ranks: Sequence[int], item: T) -> None:
        """A frame listing ``ranks`` arrived; ``item`` comes back from :meth:`next_to_fold` in its
        turn. Check :meth:`refusal` first: offering a refused frame raises ``ValueError``."""
        refusal = self.refusal(ranks)
        if refusal is not None:
            raise ValueError(f"a refused frame was offered: {refusal}")
        self._covered.update(ranks)
        entry = _Waiting(min(ranks), item)
        bisect.insort(self._waiting, entry, key=lambda w: w.first)

    def declare_dead(self, rank: int) -> None:
        """``rank`` is lost: nothing waits for it any more (its frame, if offered, still folds)."""
        if rank in self.expected:
            self._dead.add(rank)

    def next_to_fold(self) -> T | None:
        """The next item to fold, taken out of the barrier; None while none may fold yet."""
        if not self._waiting:
            return None
        # the lowest alive rank no frame covers yet: nothing at or above it may fold before it
        blocking = min(self.expected - self._dead - self._covered, default=None)
        if blocking is not None and self._waiting[0].first > blocking:
            return None
        return self._waiting.pop(0).item

    def drain(self) -> list[T]:
        """Take every waiting item out, in fold order (the round is given up: release them)."""
        items = [w.item for w in self._waiting]
        self._waiting.clear()
        return items
