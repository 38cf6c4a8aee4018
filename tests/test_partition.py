"""Pure tests of the partition planner: permutations, slices, the chunk pool."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_async.training.partition import (
    ChunkPool,
    batch_samples,
    batches_per_epoch,
    coalesce,
    largest_remainder,
    permutation,
    range_size,
    splitmix64,
    sync_slices,
    tail_allocation,
)

SETTINGS = settings(max_examples=200, deadline=None)


def test_splitmix64_matches_the_reference_stream() -> None:
    # The published SplitMix64 outputs for state 0 (Vigna's reference implementation).
    state, first = splitmix64(0)
    _, second = splitmix64(state)
    assert (first, second) == (0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4)


def test_golden_permutations() -> None:
    # Pinned: every rank and every later version must shuffle exactly so (resume equals uninterrupted).
    assert list(permutation(10, 0, 0)) == [4, 9, 2, 5, 1, 7, 6, 0, 3, 8]
    assert list(permutation(10, 0, 1)) == [9, 0, 1, 4, 8, 2, 3, 7, 6, 5]
    assert list(permutation(10, 1, 1)) == [7, 0, 3, 2, 8, 1, 9, 4, 6, 5]
    # The seed of epoch e is seed + e (flodl's Rng::seed(seed + epoch)).
    assert permutation(10, 1, 0) == permutation(10, 0, 1)


def test_the_seed_wraps_mod_2_64() -> None:
    assert permutation(50, 2**64 - 1, 1) == permutation(50, 0, 0)


@SETTINGS
@given(n=st.integers(0, 300), seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 1000))
def test_a_permutation_is_a_permutation(n: int, seed: int, epoch: int) -> None:
    assert sorted(permutation(n, seed, epoch)) == list(range(n))


def test_epochs_shuffle_differently() -> None:
    orders = {tuple(permutation(100, 7, e)) for e in range(20)}
    assert len(orders) == 20


def test_batches_per_epoch() -> None:
    assert batches_per_epoch(100, 8, drop_last=True) == 12
    assert batches_per_epoch(100, 8, drop_last=False) == 13
    assert batches_per_epoch(96, 8, drop_last=False) == 12
    perm = permutation(10, 0, 0)
    assert list(batch_samples(perm, 3, 3)) == [8]  # the short last batch without drop_last
    assert list(batch_samples(perm, 0, 3)) == [4, 9, 2]


def test_largest_remainder_examples() -> None:
    assert largest_remainder(10, [1, 1, 1]) == (4, 3, 3)  # ties to the lower index
    assert largest_remainder(7, [0.5, 0.25, 0.25]) == (3, 2, 2)
    assert largest_remainder(0, [1, 2]) == (0, 0)
    assert largest_remainder(5, [3, 0]) == (5, 0)
    with pytest.raises(ValueError, match="sum to zero"):
        largest_remainder(3, [0, 0])


@SETTINGS
@given(
    total=st.integers(0, 10_000), weights=st.lists(st.floats(0.01, 100), min_size=1, max_size=12)
)
def test_largest_remainder_sums_and_stays_within_one_of_the_quota(
    total: int, weights: list[float]
) -> None:
    parts = largest_remainder(total, weights)
    assert sum(parts) == total
    mass = sum(weights)
    for part, w in zip(parts, weights, strict=True):
        quota = total * w / mass
        assert quota - 1 < part < quota + 1


@SETTINGS
@given(n_batches=st.integers(0, 500), world=st.integers(1, 9), data=st.data())
def test_sync_slices_cover_each_batch_exactly_once(
    n_batches: int, world: int, data: st.DataObject
) -> None:
    ratios = data.draw(st.none() | st.lists(st.floats(0.05, 1), min_size=world, max_size=world))
    slices = sync_slices(n_batches, world, ratios)
    assert len(slices) == world
    covered = [b for first, n in slices for b in range(first, first + n)]
    assert covered == list(range(n_batches))  # contiguous, in rank order, each batch once
    # Every rank computes the same slices (pure function of its inputs).
    assert sync_slices(n_batches, world, ratios) == slices


def test_what_a_caller_gets_wrong_is_named_in_the_error() -> None:
    with pytest.raises(ValueError, match=r"^permutation of a negative length -1$"):
        permutation(-1, 0, 0)
    with pytest.raises(ValueError, match=r"^cannot split a negative total -1$"):
        largest_remainder(-1, [1.0])
    with pytest.raises(ValueError, match=r"^weights must be non-negative and non-empty, got \[\]$"):
        largest_remainder(3, [])
    with pytest.raises(
        ValueError, match=r"^weights must be non-negative and non-empty, got \[2.0, -1.0\]$"
    ):
        largest_remainder(3, [2.0, -1.0])  # sums to a positive mass: still refused
    with pytest.raises(ValueError, match=r"^weights sum to zero: nothing to split by$"):
        largest_remainder(3, [0, 0])
    with pytest.raises(ValueError, match=r"^a pool of -1 batches$"):
        ChunkPool(-1)


def test_sync_slices_follow_ratios() -> None:
    assert sync_slices(10, 2) == ((0, 5), (5, 5))
    assert sync_slices(10, 2, [0.7, 0.3]) == ((0, 7), (7, 3))
    with pytest.raises(ValueError, match="3 partition ratios for a world of 2"):
        sync_slices(10, 2, [0.3, 0.3, 0.4])


def test_tail_allocation() -> None:
    assert tail_allocation(100, [10, 20]) == (10, 20)  # not the tail: the counts stand
    assert tail_allocation(9, [10, 20]) == (3, 6)
    assert tail_allocation(1, [10, 20]) == (0, 1)  # a rank with 0 gets a quota-0 plan
    assert tail_allocation(30, [10, 20]) == (10, 20)  # exactly what is left: the counts stand
    assert tail_allocation(0, [0, 0]) == (0, 0)  # nothing left and nothing asked: no error


def test_coalesce_sorts_merges_and_drops_empty_ranges() -> None:
    assert coalesce([(5, 2), (0, 3), (3, 2)]) == ((0, 7),)  # adjacent ranges merge
    assert coalesce([(0, 10), (2, 3)]) == ((0, 10),)  # one inside another
    assert coalesce([(0, 4), (2, 6)]) == ((0, 8),)  # overlapping
    assert coalesce([(4, 0), (1, 1), (9, 0)]) == ((1, 1),)
    assert coalesce([(0, 1), (2, 1)]) == ((0, 1), (2, 1))  # a gap stays a gap


@SETTINGS
@given(remaining=st.integers(0, 200), counts=st.lists(st.integers(1, 64), min_size=1, max_size=8))
def test_tail_allocation_sums_to_what_is_left(remaining: int, counts: list[int]) -> None:
    parts = tail_allocation(remaining, counts)
    assert sum(parts) == min(remaining, sum(counts))
    assert all(0 <= p <= c for p, c in zip(parts, counts, strict=True))


def test_pool_hands_out_from_the_front_and_forfeits_back() -> None:
    pool = ChunkPool(10)
    assert pool.take(0, 1, 3) == ((0, 3),)
    assert pool.take(1, 1, 4) == ((3, 4),)
    assert pool.remaining == 3
    assert pool.forfeit(0) == ((0, 3),)
    assert pool.take(1, 2, 6) == ((0, 3), (7, 3))  # the forfeited front first, then the rest
    assert pool.drained
    assert not pool.complete
    with pytest.raises(ValueError, match="already holds"):
        pool.take(1, 2, 1)
    pool.complete_round(2)
    assert pool.complete
    assert pool.covered_ranges() == ((0, 10),)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("take"), st.integers(0, 3), st.integers(0, 12)),
        st.tuples(st.just("complete"), st.integers(0, 3), st.just(0)),
        st.tuples(st.just("forfeit"), st.integers(0, 3), st.just(0)),
    ),
    max_size=40,
)


@SETTINGS
@given(total=st.integers(0, 80), ops=operations)
def test_pool_partitions_every_batch_under_any_sequence(
    total: int, ops: list[tuple[str, int, int]]
) -> None:
    pool = ChunkPool(total)
    round_ = 0
    for op, rank, k in ops:
        if op == "take":
            round_ += 1
            taken = pool.take(rank, round_, k)
            assert range_size(taken) == min(k, range_size(taken) + pool.remaining)
        elif op == "complete":
            pool.complete_round(round_)
        else:
            pool.forfeit(rank)
        covered = [b for f, n in pool.covered_ranges() for b in range(f, f + n)]
        free_or_flying = [b for f, n in pool.uncovered_ranges() for b in range(f, f + n)]
        assert sorted(covered + free_or_flying) == list(range(total))  # disjoint and complete
        flying = [
            b for ranges in pool.in_flight().values() for f, n in ranges for b in range(f, f + n)
        ]
        assert len(flying) == len(set(flying))
        assert range_size(pool.uncovered_ranges()) == pool.remaining + len(flying)
    # A resume from what a checkpoint would record hands out exactly the uncovered batches.
    resumed = ChunkPool.from_coverage(total, pool.uncovered_ranges())
    assert resumed.uncovered_ranges() == pool.uncovered_ranges()
    assert resumed.covered_ranges() == pool.covered_ranges()
    assert resumed.take(0, 1, total) == pool.uncovered_ranges()


def test_a_take_spans_the_free_ranges_until_it_has_its_count() -> None:
    pool = ChunkPool(10)
    pool.take(0, 1, 2)
    pool.take(1, 1, 3)
    assert pool.forfeit(0) == ((0, 2),)  # free now: (0, 2) and (5, 5)
    assert pool.take(1, 2, 6) == ((0, 2), (5, 4))
    assert pool.uncovered_ranges() == ((0, 10),)
    assert pool.remaining == 1


def test_an_empty_epoch_is_complete_from_the_start() -> None:
    pool = ChunkPool(0)
    assert pool.total == 0
    assert pool.drained
    assert pool.complete
    assert pool.take(0, 1, 5) == ()


def test_a_pool_hands_out_single_batches() -> None:
    pool = ChunkPool(3)
    assert pool.total == 3
    assert pool.take(0, 1, 1) == ((0, 1),)
    assert pool.take(1, 1, 1) == ((1, 1),)
    assert pool.remaining == 1
    assert pool.take(0, 2, 0) == ()
    assert pool.remaining == 1


def test_from_coverage_counts_everything_outside_the_uncovered_ranges_as_covered() -> None:
    pool = ChunkPool.from_coverage(10, [(5, 2), (0, 2)])
    assert pool.total == 10
    assert pool.covered_ranges() == ((2, 3), (7, 3))
    assert pool.uncovered_ranges() == ((0, 2), (5, 2))
    assert pool.remaining == 4
    head = ChunkPool.from_coverage(10, [(0, 4)])
    assert head.covered_ranges() == ((4, 6),)
    assert ChunkPool.from_coverage(10, []).complete
    assert ChunkPool.from_coverage(10, [(0, 10)]).covered_ranges() == ()


def test_from_coverage_refuses_ranges_outside_the_epoch() -> None:
    with pytest.raises(ValueError, match="outside the epoch's 10 batches"):
        ChunkPool.from_coverage(10, [(8, 4)])


@SETTINGS
@given(n_batches=st.integers(1, 300), counts=st.lists(st.integers(1, 40), min_size=1, max_size=6))
def test_windows_of_an_epoch_cover_each_batch_exactly_once(
    n_batches: int, counts: list[int]
) -> None:
    """CADENCE's dispatch: windows of ``counts`` (tail by largest remainder) until the pool drains."""
    pool = ChunkPool(n_batches)
    seen: list[int] = []
    round_ = 0
    while not pool.drained:
        round_ += 1
        for rank, k in enumerate(tail_allocation(pool.remaining, counts)):
            seen.extend(b for f, n in pool.take(rank, round_, k) for b in range(f, f + n))
        pool.complete_round(round_)
    assert sorted(seen) == list(range(n_batches))
    assert pool.complete
