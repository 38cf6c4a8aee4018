"""ElChe: the slow rank anchors the cadence, fast ranks do proportionally more.

Theory of operation. Pure (no clock, no I/O): the coordinator calls :meth:`ElChe.report`
once per reduce with each rank's window cost (ms), batches and the previous round's
``sync_ms``, and reads :attr:`ElChe.counts` — the batches each rank trains in the next
window. Per report:

1. each rank with batches and a finite cost pushes ``ms / batches`` into its trust
   window (the last 5 readings; their mean is the smoothed cost); 5 empty reports in a
   row clear a rank's window;
2. the phase advances with the calibrations (WARMUP at 1, STABLE at 5, MATURE at 20);
3. the slow anchor is (re-)elected when none is set or from STABLE on: the cohort is the
   ranks within 15 % of the slowest; the incumbent stays unless a cohort member is more
   than 10 % slower; the lowest rank breaks ties;
4. auto-tune (grow only, never under SYNC): from the second calibration, when the sync
   overhead ``sync_ms / (anchor·slow + sync_ms)`` exceeds the target (twice it in WARMUP),
   propose ``ceil(anchor · min(overhead/target, 2))`` within ``[min_anchor, max_anchor]``;
5. the :class:`TrendGuard` judges the replicas' divergence: ``Stable`` commits a proposal,
   ``SuppressGrowth`` drops it and latches growth off, ``NudgeDown`` also shrinks the
   anchor; 5 consecutive ``Stable`` re-arm growth;
6. proportional dispatch: each rank gets ``round(anchor · min(slow/ms_r, 64))`` (the anchor
   rank gets the anchor), inside a 5 % dead zone and a ``max_batch_diff`` clamp, then a
   window over one epoch is scaled down to one epoch, each rank keeping at least one batch
   (so a window never holds more than ``max(world, batches_per_epoch)``).

``adapt=False`` freezes the counts (and the anchor) at their initial values.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .spec import ElCheSettings

TRUST_WINDOW = 5
COHORT_BAND = 0.15
DOMINANCE_MARGIN = 0.10
MAX_SPEED_RATIO = 64.0
DEAD_ZONE = 0.05
MISSED_REPORTS_CLEAR = 5
GROWTH_CAP = 2.0
GROWTH_REARM_STABLE = 5
GUARD_HISTORY = 5


class ElChePhase(enum.IntEnum):
    """Calibration maturity; ordered, so ``phase >= STABLE`` reads as it says."""

    PROBE = 0
    WARMUP = 1
    STABLE = 2
    MATURE = 3


_PHASE_AT = ((20, ElChePhase.MATURE), (5, ElChePhase.STABLE), (1, ElChePhase.WARMUP))


# ----- the guard -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Stable:
    """Replicas agree: a pending growth proposal may be committed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SuppressGrowth:
    """Divergence is rising, still under the threshold: do not grow."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NudgeDown:
    """Divergence is rising past the threshold: shrink the anchor by ``factor``."""

    factor: float


Verdict = Stable | SuppressGrowth | NudgeDown


class TrendGuard:
    """A ring of the last 5 window divergences; three strictly rising values are a trend."""

    def __init__(
        self, *, threshold: float, nudge_factor: float, history: Sequence[float] = ()
    ) -> None:
        self.threshold = threshold
        self.nudge_factor = nudge_factor
        self._ring: deque[float] = deque(history, maxlen=GUARD_HISTORY)

    @property
    def history(self) -> tuple[float, ...]:
        """The divergences it judges by, oldest first."""
        return tuple(self._ring)

    def observe(self, divergence: float) -> Verdict:
        """Push one window's divergence (max over ranks) and judge the trend."""
        self._ring.append(divergence)
        if len(self._ring) < 3:
            return Stable()
        a, b, c = list(self._ring)[-3:]
        if a < b < c:
            return NudgeDown(factor=self.nudge_factor) if c > self.threshold else SuppressGrowth()
        return Stable()


# ----- ElChe ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ElCheState:
    """What a checkpoint keeps of ElChe (restored only into the same world size)."""

    anchor: int
    anchor_rank: int | None
    smoothed_ms_per_batch: tuple[float | None, ...]
    phase: ElChePhase
    calibration_count: int
    trend_history: tuple[float, ...]
    counts: tuple[int, ...]


class WorldSizeMismatch(ValueError):
    """A saved ElChe state belongs to another world size."""


class ElChe:
    """The cadence of one run; pure."""

    def __init__(
        self,
        world_size: int,
        settings: ElCheSettings,
        *,
        batches_per_epoch: int,
        growth: bool,
        dispatch: bool = True,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"ElChe needs at least one rank, got {world_size}")
        self.world_size = world_size
        self.settings = settings
        self.batches_per_epoch = max(1, batches_per_epoch)
        self._growth_applies = growth and settings.adapt
        self._dispatch = dispatch and settings.adapt
        self.anchor = settings.anchor
        self.anchor_rank: int | None = None
        self.phase = ElChePhase.PROBE
        self.calibration_count = 0
        self.proposed_anchor: int | None = None
        self.growth_enabled = True
        self._stable_streak = 0
        self._windows: list[deque[float]] = [deque(maxlen=TRUST_WINDOW) for _ in range(world_size)]
        self._missed = [0] * world_size
        self.guard = (
            None
            if settings.guard is None
            else TrendGuard(threshold=settings.guard[0], nudge_factor=settings.guard[1])
        )
        counts = [self.anchor] * world_size
        if settings.speed_hint is not None:
            slow, ratio = settings.speed_hint
            if slow < world_size:
                counts = [
                    self.anchor if r == slow else max(1, round(self.anchor * ratio))
                    for r in range(world_size)
                ]
                self.anchor_rank = slow
        self.counts: tuple[int, ...] = self._cap(counts)

    # ----- queries ------------------------------------------------------------------------

    def smoothed(self, rank: int) -> float | None:
        """Rank's mean ms per batch over its trust window, or None without a reading."""
        window = self._windows[rank]
        return sum(window) / len(window) if window else None

    @property
    def cap_binding(self) -> bool:
        """The window is limited by the epoch (growth would not change anything)."""
        return sum(self.counts) >= self.batches_per_epoch

    # ----- the one entry point ------------------------------------------------------------

    def report(
        self,
        ms: Sequence[float],
        batches: Sequence[int],
        *,
        sync_ms: float,
        divergence: float | None = None,
    ) -> Verdict | None:
        """One window: every rank's cost and batches, the last round's ``sync_ms``; returns the
        guard's verdict."""
        if len(ms) != self.world_size or len(batches) != self.world_size:
            raise ValueError(
                f"a report of {len(ms)} costs and {len(batches)} batch counts for a world of "
                f"{self.world_size}"
            )
        calibrated = False
        for rank, (cost, n) in enumerate(zip(ms, batches, strict=True)):
            per_batch = cost / n if n > 0 and math.isfinite(cost) else 0.0
            if per_batch > 0:  # a sub-denormal quotient is no reading either
                self._windows[rank].append(per_batch)
                self._missed[rank] = 0
                calibrated = True
            else:
                self._missed[rank] += 1
                if self._missed[rank] >= MISSED_REPORTS_CLEAR:
                    self._windows[rank].clear()
        if not calibrated:
            return None
        first = self.calibration_count == 0
        self.calibration_count += 1
        self.phase = next(
            phase
            for at, phase in (*_PHASE_AT, (0, ElChePhase.PROBE))
            if self.calibration_count >= at
        )
        self._elect()
        if self._growth_applies and not first:
            self._propose(sync_ms)
        verdict: Verdict | None = None
        if self.guard is not None and divergence is not None and divergence >= 0:
            verdict = self.guard.observe(divergence)
            self._apply_verdict(verdict)
        elif self.proposed_anchor is not None:
            # no guard: commit at once
            self.anchor, self.proposed_anchor = self.proposed_anchor, None
        if self._dispatch:
            self.counts = self._cap(self._proportional(first))
        return verdict

    def forget(self, rank: int) -> None:
        """``rank`` is gone: its readings no longer steer the cadence."""
        self._windows[rank].clear()
        if self.anchor_rank == rank:
            self.anchor_rank = None

    # ----- steps --------------------------------------------------------------------------

    def _elect(self) -> None:
        incumbent = self.anchor_rank
        pinned_lost = incumbent is not None and not self._windows[incumbent]
        if incumbent is not None and not pinned_lost and self.phase < ElChePhase.STABLE:
            return
        readings = {r: s for r in range(self.world_size) if (s := self.smoothed(r)) is not None}
        if not readings:
            return
        slowest = max(readings.values())
        cohort = sorted(r for r, s in readings.items() if s >= slowest * (1 - COHORT_BAND))
        if incumbent is None or pinned_lost or incumbent not in readings:
            self.anchor_rank = cohort[0]
            return
        challengers = [
            r for r in cohort if readings[r] > readings[incumbent] * (1 + DOMINANCE_MARGIN)
        ]
        if challengers:
            self.anchor_rank = challengers[0]

    def _slow(self) -> float | None:
        return None if self.anchor_rank is None else self.smoothed(self.anchor_rank)

    def _propose(self, sync_ms: float) -> None:
        slow = self._slow()
        if (
            not self.growth_enabled
            or self.cap_binding
            or slow is None
            or self.phase < ElChePhase.WARMUP
        ):
            return
        overhead = sync_ms / (self.anchor * slow + sync_ms) if sync_ms > 0 else 0.0
        target = self.settings.overhead_target
        threshold = target if self.phase >= ElChePhase.STABLE else 2 * target
        if overhead <= threshold:
            return
        grown = math.ceil(self.anchor * min(overhead / target, GROWTH_CAP))
        new = min(max(grown, self.settings.min_anchor), self.settings.max_anchor)
        if new > self.anchor:
            self.proposed_anchor = new

    def _apply_verdict(self, verdict: Verdict) -> None:
        if isinstance(verdict, Stable):
            if self.proposed_anchor is not None:
                self.anchor = self.proposed_anchor
            self._stable_streak += 1
            if not self.growth_enabled and self._stable_streak >= GROWTH_REARM_STABLE:
                self.growth_enabled = True
        else:
            self.growth_enabled = False
            self._stable_streak = 0
            if isinstance(verdict, NudgeDown):
                factor = min(max(verdict.factor, 0.1), 1.0)
                # ignores min_anchor: the guard's shrink path
                self.anchor = max(1, math.ceil(self.anchor * factor))
        self.proposed_anchor = None

    def _proportional(self, first: bool) -> list[int]:
        slow = self._slow()
        out = list(self.counts)
        for rank in range(self.world_size):
            mine = self.smoothed(rank)
            anchored = rank == self.anchor_rank or mine is None or slow is None
            if mine is None or slow is None or anchored:
                target = self.anchor
            else:
                target = max(1, round(self.anchor * min(slow / mine, MAX_SPEED_RATIO)))
            current = out[rank]
            if not first and not anchored and abs(target - current) <= DEAD_ZONE * current:
                continue  # inside the dead zone: no churn for noise
            d = self.settings.max_batch_diff
            if d is not None and not first:
                target = min(max(target, current - d), current + d)
            out[rank] = max(1, target)
        return out

    def _cap(self, counts: list[int]) -> tuple[int, ...]:
        """Scale a window larger than one epoch down to one epoch, each rank keeping at least one
        batch: never more than ``max(world, batches_per_epoch)``."""
        cap, total = self.batches_per_epoch, sum(counts)
        if total <= cap:
            return tuple(counts)
        scaled = [max(1, c * cap // total) for c in counts]
        left = cap - sum(scaled)
        if left >= 0:  # what rounding down left over goes to the largest count
            largest = max(range(len(counts)), key=lambda r: (counts[r], -r))
            scaled[largest] += left
            return tuple(scaled)
        # Each rank raised to its floor of 1 holds a batch the budget never had. Giving that
        # excess back from one rank could not always be done (it keeps 1 too), so take it one
        # batch at a time from whichever rank holds the most; among equals, from the smaller
        # count, so a faster rank never ends with fewer batches than a slower one.
        while left < 0:
            rank = max(range(len(counts)), key=lambda r: (scaled[r], -counts[r], r))
            if scaled[rank] == 1:
                break  # more ranks than batches: every rank at its floor
            scaled[rank] -= 1
            left += 1
        return tuple(scaled)

    # ----- snapshot -----------------------------------------------------------------------

    def snapshot(self) -> ElCheState:
        """The state a checkpoint records."""
        return ElCheState(
            anchor=self.anchor,
            anchor_rank=self.anchor_rank,
            smoothed_ms_per_batch=tuple(self.smoothed(r) for r in range(self.world_size)),
            phase=self.phase,
            calibration_count=self.calibration_count,
            trend_history=self.guard.history if self.guard is not None else (),
            counts=self.counts,
        )

    def restore(self, state: ElCheState) -> None:
        """Continue from ``state``; another world size is refused with the text the resume turns
        into a warning."""
        if len(state.smoothed_ms_per_batch) != self.world_size:
            raise WorldSizeMismatch(
                f"ElChe state was saved with world size {len(state.smoothed_ms_per_batch)} but "
                f"this run has {self.world_size}; "
                "resume must use the same world size as the saved run"
            )
        self.anchor, self.anchor_rank, self.phase, self.calibration_count = (
            state.anchor,
            state.anchor_rank,
            state.phase,
            state.calibration_count,
        )
        self.counts = tuple(state.counts)
        for rank, smoothed in enumerate(state.smoothed_ms_per_batch):
            self._windows[rank].clear()
            if smoothed is not None:
                self._windows[rank].append(smoothed)
        if self.guard is not None:
            self.guard = TrendGuard(
                threshold=self.guard.threshold,
                nudge_factor=self.guard.nudge_factor,
                history=state.trend_history,
            )
