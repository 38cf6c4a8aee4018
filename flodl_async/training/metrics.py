"""Per-epoch training metrics, aggregated from the ranks' window reports.

Theory of operation. Pure. The coordinator feeds every accepted ``WindowDone`` into the
ledger of its epoch (:meth:`EpochLedger.add_window`) and every completed reduce
(:meth:`EpochLedger.add_reduce`); at the reduce that closes the epoch it calls
:meth:`EpochLedger.close` and gets one frozen :class:`EpochMetrics`: ``avg_loss =
Σ loss_sum / Σ batches``, per-rank throughput ``batches / busy seconds``, ``batch_share =
batches / Σ batches``, scalars ``Σ sum / Σ count`` per name, ``epoch_ms`` from the first
plan of the epoch to that reduce. A dead rank's late frames are not fed (the coordinator
drops them), and a rank that reported nothing still appears, with zeros.

:class:`EpochMetrics` and :class:`RankEpochStats` are declared in :mod:`flodl_async.wire.messages`
and re-exported here: the ranks receive the very value the ledger closed (in ``EpochAggregated``),
so one declaration serves as the domain type and its wire form.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..wire import messages as m
from ..wire.messages import EpochMetrics, RankEpochStats

__all__ = ["EpochLedger", "EpochMetrics", "RankEpochStats"]


@dataclass(slots=True)
class _RankTotals:
    batches: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    compute_ms: float = 0.0
    data_ms: float = 0.0


class EpochLedger:
    """One epoch's accumulating reports (mutable, owned by the coordinator)."""

    def __init__(self, epoch: int, *, ranks: Iterable[int], started_at: float) -> None:
        self.epoch = epoch
        self.started_at = started_at
        self._ranks = {r: _RankTotals() for r in ranks}
        self._scalar_sums: dict[str, float] = {}
        self._scalar_counts: dict[str, int] = {}
        self._reduces = 0
        self._reduce_ms = 0.0

    @property
    def batches(self) -> int:
        """Batches reported so far this epoch, over all ranks."""
        return sum(t.batches for t in self._ranks.values())

    def add_window(self, report: m.WindowDone) -> None:
        """One accepted window report of this epoch."""
        t = self._ranks.setdefault(report.rank, _RankTotals())
        t.batches += report.batches
        t.samples += report.samples
        t.loss_sum += report.loss_sum
        t.compute_ms += report.compute_ms
        t.data_ms += report.data_ms
        for name, total in report.scalar_sums.items():
            count = report.scalar_counts.get(name, 0)
            if count > 0:
                self._scalar_sums[name] = self._scalar_sums.get(name, 0.0) + total
                self._scalar_counts[name] = self._scalar_counts.get(name, 0) + count

    def add_reduce(self, duration_ms: float) -> None:
        """One completed reduce attributed to this epoch."""
        self._reduces += 1
        self._reduce_ms += duration_ms

    def close(
        self, *, now: float, anchor: int, counts: tuple[int, ...], alive: frozenset[int]
    ) -> EpochMetrics:
        """The epoch's metrics, at the reduce that closed it (``now``: that reduce's completion)."""
        total = self.batches
        loss = sum(t.loss_sum for t in self._ranks.values())
        per_rank = tuple(
            RankEpochStats(
                rank=r,
                batches=t.batches,
                samples=t.samples,
                avg_loss=t.loss_sum / t.batches if t.batches else 0.0,
                throughput=t.batches / ((t.compute_ms + t.data_ms) / 1000)
                if t.compute_ms + t.data_ms > 0
                else 0.0,
                batch_share=t.batches / total if total else 0.0,
                compute_ms=t.compute_ms,
                data_ms=t.data_ms,
                alive=r in alive,
            )
            for r, t in sorted(self._ranks.items())
        )
        return EpochMetrics(
            epoch=self.epoch + 1,  # what a user counts (and the log's "epoch 3/5"): from 1
            avg_loss=loss / total if total else 0.0,
            epoch_ms=max(0.0, (now - self.started_at) * 1000),
            batches=total,
            samples=sum(t.samples for t in self._ranks.values()),
            reduces=self._reduces,
            avg_reduce_ms=self._reduce_ms / self._reduces if self._reduces else 0.0,
            anchor=anchor,
            counts=counts,
            per_rank=per_rank,
            scalars={
                name: self._scalar_sums[name] / self._scalar_counts[name]
                for name in sorted(self._scalar_sums)
            },
        )
