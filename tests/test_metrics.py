"""Pure tests of the per-epoch metrics aggregation."""

from __future__ import annotations

import pytest

from flodl_async.training.metrics import EpochLedger, EpochMetrics
from flodl_async.wire import messages as m
from flodl_async.wire.schema import pack_message, unpack_message


def window(
    rank: int,
    batches: int,
    loss_sum: float,
    *,
    compute_ms: float = 100.0,
    data_ms: float = 0.0,
    **scalars: tuple[float, int],
) -> m.WindowDone:
    return m.WindowDone(
        rank=rank,
        round=1,
        epoch=0,
        batches=batches,
        samples=batches * 4,
        compute_ms=compute_ms,
        data_ms=data_ms,
        loss_sum=loss_sum,
        scalar_sums={k: v[0] for k, v in scalars.items()},
        scalar_counts={k: v[1] for k, v in scalars.items()},
    )


def test_an_epoch_aggregates_loss_shares_throughput_and_scalars() -> None:
    ledger = EpochLedger(3, ranks=(0, 1, 2), started_at=10.0)
    ledger.add_window(window(0, 6, 3.0, compute_ms=500.0, data_ms=100.0, acc=(5.0, 6)))
    ledger.add_window(window(1, 2, 3.0, compute_ms=400.0, acc=(1.0, 2)))
    ledger.add_window(window(0, 4, 1.0, compute_ms=400.0))
    ledger.add_reduce(10.0)
    ledger.add_reduce(30.0)
    out = ledger.close(now=12.5, anchor=2, counts=(4, 2, 2), alive=frozenset({0, 1}))
    assert out.epoch == 4  # the ledger's epoch 3 (from 0) is the user's 4th
    assert out.avg_loss == pytest.approx(7.0 / 12)  # batch-weighted over every rank's batches
    assert out.batches == 12
    assert out.samples == 48
    assert out.epoch_ms == pytest.approx(2500.0)
    assert (out.reduces, out.avg_reduce_ms) == (2, 20.0)
    r0, r1, r2 = out.per_rank
    assert (r0.batches, r0.batch_share, r0.avg_loss) == (
        10,
        pytest.approx(10 / 12),
        pytest.approx(0.4),
    )
    assert r0.throughput == pytest.approx(10 / 1.0)  # 10 batches over 1 s of compute + data
    assert r1.batch_share == pytest.approx(2 / 12)
    assert (r2.batches, r2.batch_share, r2.alive) == (
        0,
        0.0,
        False,
    )  # a rank with nothing still appears
    assert out.scalars == {"acc": pytest.approx(6.0 / 8)}
    assert unpack_message(EpochMetrics.KIND, pack_message(out)) == out  # its own wire form
    assert "epoch 4/5: loss 0.5833" in out.summary(5, 3)


def test_an_empty_epoch_has_zeros_not_errors() -> None:
    out = EpochLedger(0, ranks=(0,), started_at=0.0).close(
        now=0.0, anchor=1, counts=(1,), alive=frozenset({0})
    )
    assert (out.avg_loss, out.batches, out.avg_reduce_ms, out.per_rank[0].throughput) == (
        0.0,
        0,
        0.0,
        0.0,
    )
