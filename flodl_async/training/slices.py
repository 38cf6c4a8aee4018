"""One SYNC epoch's slices: what each rank was planned, what it reported, what a consensus holds.

Under SYNC each rank trains one contiguous slice of the epoch, in order (the partition's
``sync_slices``). The gate asks whether a rank still has data to report (:meth:`SyncSlices.left`);
the death chain asks which of a dead rank's batches no consensus holds, and shares them, in order,
among the survivors (:meth:`SyncSlices.share_dead`), so that every batch of the epoch ends in the
consensus exactly once. A rank's batches are counted in when a round's consensus holds its
contribution (:meth:`SyncSlices.settle`, the steps the reducer folded), never when it reports: a
report may come from a rank that dies before it contributes.

Pure: no asyncio, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ..wire import messages as m
from . import partition as part
from . import plancheck
from .policy import hold_after
from .spec import TrainerSpec


def plan_hold_after(spec: TrainerSpec, *, quota: int) -> int:
    """The batches a rank with a plan of ``quota`` may train past it (the policy's slack)."""
    s = spec.settings
    return hold_after(
        spec.policy, quota=quota, max_batch_diff=s.max_batch_diff, max_overshoot=s.max_overshoot
    )


def epoch_slices(spec: TrainerSpec, ranks: Sequence[int]) -> dict[int, part.Range]:
    """Each of ``ranks``' slice of a new epoch (the spec's partition ratios when they fit)."""
    ratios = spec.elche.partition_ratios
    if ratios is not None and len(ratios) != len(ranks):
        ratios = None
    return dict(zip(ranks, part.sync_slices(spec.n_batches, len(ranks), ratios), strict=True))


def sync_plan(
    spec: TrainerSpec, *, rank: int, round_: int, epoch: int, ranges: tuple[part.Range, ...]
) -> m.Plan:
    """A SYNC plan: ``ranges`` of epoch ``epoch`` to train in order (none: an empty plan)."""
    return m.Plan(
        rank=rank,
        round=round_,
        epoch=epoch,
        ranges=ranges,
        quota=1 if ranges else 0,
        hold_after=plan_hold_after(spec, quota=1),
        progress=float(epoch),
    )


class SyncSlices:
    """The slices of the epoch being trained (empty before the first :meth:`open`)."""

    __slots__ = ("_held", "_left", "_ranges", "_since_round")

    def __init__(self) -> None:
        # rank -> its batches in plan order (its slice, then any share of a dead rank's)
        self._ranges: dict[int, tuple[part.Range, ...]] = {}
        # rank -> batches planned and not reported yet
        self._left: dict[int, int] = {}
        # rank -> batches of its ranges a consensus holds
        self._held: dict[int, int] = {}
        # rank -> batches it reported since the last round opened (a round's plan)
        self._since_round: dict[int, int] = {}

    def open(self, slices: Mapping[int, part.Range]) -> None:
        """A new epoch: each rank's one slice."""
        self._ranges = {r: ((first, n),) if n else () for r, (first, n) in slices.items()}
        self._left = {r: n for r, (_first, n) in slices.items()}
        self._held = dict.fromkeys(slices, 0)

    def open_ranges(self, ranges: Mapping[int, tuple[part.Range, ...]]) -> None:
        """A resumed epoch: each rank's share of the batches no consensus holds yet (the rest
        counts as held by nobody, and is not planned again)."""
        self._ranges = dict(ranges)
        self._left = {r: part.range_size(rs) for r, rs in ranges.items()}
        self._held = dict.fromkeys(ranges, 0)

    def covered_ranges(self) -> tuple[part.Range, ...]:
        """The batches of the epoch a consensus holds (what a checkpoint's coverage records)."""
        held: list[part.Range] = []
        for rank, ranges in self._ranges.items():
            held.extend(part.split_ranges(ranges, self._held.get(rank, 0))[0])
        return part.coalesce(held)

    def left(self, rank: int) -> int:
        """Batches planned to ``rank`` that it has not reported yet."""
        return self._left.get(rank, 0)

    def reported(self, rank: int, batches: int) -> None:
        """``rank`` reported ``batches`` more."""
        if rank in self._left:
            self._left[rank] = max(0, self._left[rank] - batches)
        self._since_round[rank] = self._since_round.get(rank, 0) + batches

    def round_opened(self) -> None:
        """A round opened: what :meth:`claimable` counts as reported starts again from here."""
        self._since_round = {}

    def claimable(self) -> dict[int, int]:
        """The most steps each rank can contribute to the round opening now (its plan's bound:
        :func:`~flodl_async.training.plancheck.sync_claimable`)."""
        return plancheck.sync_claimable(self._left, self._since_round)

    def settle(self, folded: Mapping[int, int]) -> None:
        """A round's consensus holds each listed rank's contribution, of that many steps."""
        for rank, steps in folded.items():
            if rank in self._held:
                self._held[rank] += steps

    def settle_reported(self, ranks: Iterable[int]) -> None:
        """A consensus holds everything each of ``ranks`` reported so far (an all_reduce among
        them, or a round runner that does not list what it folded)."""
        for rank in ranks:
            if rank in self._held:
                self._held[rank] = part.range_size(self._ranges[rank]) - self._left[rank]

    @property
    def covered(self) -> bool:
        """Every batch of the epoch is in a consensus."""
        return all(self._held[r] >= part.range_size(ranges) for r, ranges in self._ranges.items())

    def share_dead(
        self, dead: Iterable[int], alive: Sequence[int]
    ) -> list[tuple[int, tuple[part.Range, ...]]]:
        """What no consensus holds of each dead rank's ranges, cut in order among ``alive``: the
        (survivor, ranges) to plan, each added to that survivor's ranges (nothing twice)."""
        out: list[tuple[int, tuple[part.Range, ...]]] = []
        for rank in sorted(set(dead) & set(self._ranges)):
            done, rest = part.split_ranges(self._ranges[rank], self._held[rank])
            if not rest or not alive:
                continue
            self._ranges[rank] = done
            self._left[rank] = 0
            for survivor, share in zip(alive, part.share_ranges(rest, len(alive)), strict=True):
                if share:
                    self._ranges[survivor] = (*self._ranges[survivor], *share)
                    self._left[survivor] = self._left.get(survivor, 0) + part.range_size(share)
                    out.append((survivor, share))
        return out
