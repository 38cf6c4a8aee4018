"""Pure tests of the fold barrier the reducer and the relay's host fold share."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_async.training.foldround import FoldRound, Refusal, Refused

SETTINGS = settings(max_examples=300, deadline=None)


def drain_ready(barrier: FoldRound[str]) -> list[str]:
    """What a shell's driver does on a wake: fold every item the barrier hands out."""
    out = []
    while (item := barrier.next_to_fold()) is not None:
        out.append(item)
    return out


# ----- order ------------------------------------------------------------------------------------


def test_single_rank_frames_fold_in_ascending_rank_order_whatever_their_arrival() -> None:
    barrier: FoldRound[str] = FoldRound({0, 1, 2, 3})
    barrier.offer([2], "r2")
    barrier.offer([3], "r3")
    assert drain_ready(barrier) == []  # 0 and 1 may still come
    barrier.offer([0], "r0")
    assert drain_ready(barrier) == ["r0"]  # 1 may still come before 2
    barrier.offer([1], "r1")
    assert drain_ready(barrier) == ["r1", "r2", "r3"]
    assert barrier.complete


def test_the_lowest_rank_folds_at_once() -> None:
    barrier: FoldRound[str] = FoldRound({0, 1})
    barrier.offer([0], "r0")
    assert barrier.next_to_fold() == "r0"
    assert barrier.next_to_fold() is None
    assert not barrier.complete


def test_a_multi_rank_frame_takes_its_place_by_its_lowest_rank() -> None:
    barrier: FoldRound[str] = FoldRound(range(6))
    barrier.offer([3, 1], "h1")  # a host's frame, its ranks in any order
    barrier.offer([2, 5], "h2")
    assert drain_ready(barrier) == []  # rank 0 may still come
    barrier.offer([0, 4], "h0")
    # h0 covers 0 and 4; h1 (lowest 1) then h2 (lowest 2): nothing below either can still arrive
    assert drain_ready(barrier) == ["h0", "h1", "h2"]
    assert barrier.complete


def test_a_frame_folds_while_a_rank_above_its_lowest_is_still_missing() -> None:
    barrier: FoldRound[str] = FoldRound(range(5))
    barrier.offer([0, 4], "h0")
    # 1..3 are missing, but none is below 0
    assert drain_ready(barrier) == ["h0"]
    barrier.offer([2, 3], "h2")
    assert drain_ready(barrier) == []  # rank 1 is below 2 and may still come
    barrier.offer([1], "h1")
    assert drain_ready(barrier) == ["h1", "h2"]
    assert barrier.complete


def test_a_frame_offered_while_others_fold_takes_its_turn() -> None:
    barrier: FoldRound[str] = FoldRound({0, 1, 2})
    barrier.offer([0], "r0")
    barrier.offer([2], "r2")
    assert barrier.next_to_fold() == "r0"
    # the shell is folding r0 (an await); rank 1 arrives meanwhile
    barrier.offer([1], "r1")
    assert drain_ready(barrier) == ["r1", "r2"]


def test_items_come_back_as_offered() -> None:
    @dataclass
    class Frame:
        payload: bytearray

    frame = Frame(bytearray(b"x"))
    barrier: FoldRound[Frame] = FoldRound({7})
    barrier.offer([7], frame)
    assert barrier.next_to_fold() is frame


# ----- completion -------------------------------------------------------------------------------


def test_a_round_is_complete_only_once_nothing_waits() -> None:
    barrier: FoldRound[str] = FoldRound({0, 1})
    barrier.offer([1], "r1")
    barrier.offer([0], "r0")
    assert barrier.covered == {0, 1}
    assert not barrier.complete  # both covered, but nothing was folded yet
    assert barrier.next_to_fold() == "r0"
    assert not barrier.complete
    assert barrier.next_to_fold() == "r1"
    assert barrier.complete
    assert barrier.next_to_fold() is None


def test_a_round_expecting_nobody_is_complete_at_once() -> None:
    barrier: FoldRound[str] = FoldRound(())
    assert barrier.complete
    assert barrier.next_to_fold() is None


def test_the_barriers_counts() -> None:
    barrier: FoldRound[str] = FoldRound({0, 1, 2}, dead={2})
    assert barrier.expected == {0, 1, 2}
    assert barrier.alive == {0, 1}
    barrier.offer([1], "r1")
    assert (barrier.covered, barrier.waiting) == (frozenset({1}), 1)
    barrier.offer([0], "r0")
    assert barrier.waiting == 2
    drain_ready(barrier)
    assert (barrier.covered, barrier.waiting) == (frozenset({0, 1}), 0)
    assert barrier.complete


# ----- deaths -----------------------------------------------------------------------------------


def test_ranks_dead_before_the_round_are_not_waited_for() -> None:
    barrier: FoldRound[str] = FoldRound({0, 1, 2}, dead={0, 9})  # 9: not expected, no matter
    assert barrier.alive == {1, 2}
    barrier.offer([2], "r2")
    assert drain_ready(barrier) == []  # 1 is alive and below 2
    barrier.offer([1], "r1")
    assert drain_ready(barrier) == ["r1", "r2"]
    assert barrier.complete


def test_a_death_releases_what_waited_on_it() -> None:
    barrier: FoldRound[str] = FoldRound({0, 1, 2})
    barrier.offer([1], "r1")
    barrier.offer([2], "r2")
    assert drain_ready(barrier) == []
    barrier.declare_dead(0)
    assert drain_ready(barrier) == ["r1", "r2"]
    assert barrier.complete


def test_a_death_releases_only_up_to_the_next_missing_rank() -> None:
    barrier: FoldRound[str] = FoldRound(range(4))
    barrier.offer([1], "r1")
    barrier.offer([3], "r3")
    barrier.declare_dead(0)
    assert drain_ready(barrier) == ["r1"]  # 2 is alive and below 3
    assert not barrier.complete
    barrier.declare_dead(2)
    assert drain_ready(barrier) == ["r3"]
    assert barrier.complete


def test_the_death_of_the_last_missing_rank_completes_the_round() -> None:
    barrier: FoldRound[str] = FoldRound({0, 1})
    barrier.offer([0], "r0")
    assert drain_ready(barrier) == ["r0"]
    assert not barrier.complete
    barrier.declare_dead(1)
    assert barrier.complete


def test_every_rank_dead_completes_the_round_with_nothing_folded() -> None:
    barrier: FoldRound[str] = FoldRound({0, 1})
    barrier.declare_dead(1)
    assert not barrier.complete
    barrier.declare_dead(0)
    assert barrier.complete
    assert barrier.next_to_fold() is None


def test_a_dead_ranks_frame_that_arrived_still_folds() -> None:
    barrier: FoldRound[str] = FoldRound({0, 1})
    barrier.offer([1], "r1")
    barrier.declare_dead(1)  # its frame is here: it counts
    barrier.offer([0], "r0")
    assert drain_ready(barrier) == ["r0", "r1"]
    assert barrier.complete


def test_a_dead_ranks_frame_offered_while_the_round_is_open_still_folds_in_its_turn() -> None:
    barrier: FoldRound[str] = FoldRound({0, 1, 2})
    barrier.offer([2], "r2")
    barrier.declare_dead(0)
    barrier.declare_dead(1)
    assert drain_ready(barrier) == ["r2"]
    assert barrier.complete
    # a frame rank 1 sent before it was declared dead reaches the barrier only now: it is not
    # refused, and it folds (after 2: nothing waited for it)
    assert barrier.refusal([1]) is None
    barrier.offer([1], "r1")
    assert not barrier.complete
    assert drain_ready(barrier) == ["r1"]
    assert barrier.complete


def test_a_frame_covering_a_dead_and_an_alive_rank_covers_both() -> None:
    barrier: FoldRound[str] = FoldRound(range(4), dead={1})
    barrier.offer([1, 3], "h1")
    assert drain_ready(barrier) == []  # rank 0 may still come
    barrier.offer([0, 2], "h0")
    assert drain_ready(barrier) == ["h0", "h1"]
    assert barrier.complete


def test_declaring_a_rank_dead_twice_or_an_unexpected_one_changes_nothing() -> None:
    barrier: FoldRound[str] = FoldRound({0, 1})
    barrier.declare_dead(5)
    assert barrier.alive == {0, 1}
    barrier.declare_dead(0)
    barrier.declare_dead(0)
    assert barrier.alive == {1}


# ----- refusals ---------------------------------------------------------------------------------


def test_a_frame_listing_no_rank_is_refused() -> None:
    barrier: FoldRound[str] = FoldRound({0})
    assert barrier.refusal([]) == Refusal(reason=Refused.NO_RANKS)
    with pytest.raises(ValueError, match="refused"):
        barrier.offer([], "nothing")


def test_a_rank_covered_twice_is_refused_waiting_or_folded() -> None:
    barrier: FoldRound[str] = FoldRound({0, 1, 2})
    barrier.offer([1, 2], "h1")
    assert barrier.refusal([2]) == Refusal(reason=Refused.TWICE, rank=2)  # still waiting
    barrier.offer([0], "h0")
    drain_ready(barrier)
    assert barrier.refusal([0]) == Refusal(reason=Refused.TWICE, rank=0)  # folded


def test_a_rank_listed_twice_in_one_frame_is_refused() -> None:
    barrier: FoldRound[str] = FoldRound({0, 1})
    assert barrier.refusal([1, 0, 1]) == Refusal(reason=Refused.TWICE, rank=1)


def test_a_rank_the_round_does_not_expect_is_refused() -> None:
    barrier: FoldRound[str] = FoldRound({0, 1})
    assert barrier.refusal([0, 4]) == Refusal(reason=Refused.UNEXPECTED, rank=4)


def test_the_first_offending_rank_in_the_frames_order_is_named() -> None:
    barrier: FoldRound[str] = FoldRound({0, 1, 2})
    barrier.offer([1], "r1")
    assert barrier.refusal([7, 1]) == Refusal(reason=Refused.UNEXPECTED, rank=7)
    assert barrier.refusal([1, 7]) == Refusal(reason=Refused.TWICE, rank=1)
    assert barrier.refusal([9, 9]) == Refusal(reason=Refused.UNEXPECTED, rank=9)


def test_a_refused_offer_changes_nothing() -> None:
    barrier: FoldRound[str] = FoldRound({0, 1, 2})
    barrier.offer([1], "r1")
    with pytest.raises(ValueError, match="refused"):
        barrier.offer([2, 1], "bad")  # 2 is fine, 1 is not: 2 must stay uncovered
    assert barrier.covered == {1}
    assert barrier.waiting == 1
    barrier.offer([2], "r2")
    barrier.offer([0], "r0")
    assert drain_ready(barrier) == ["r0", "r1", "r2"]


# ----- giving a round up ------------------------------------------------------------------------


def test_drain_takes_every_waiting_item_out_in_fold_order() -> None:
    barrier: FoldRound[str] = FoldRound(range(4))
    barrier.offer([3], "r3")
    barrier.offer([0], "r0")
    barrier.offer([2], "r2")
    assert barrier.next_to_fold() == "r0"
    assert barrier.drain() == ["r2", "r3"]
    assert barrier.waiting == 0
    assert barrier.next_to_fold() is None
    assert barrier.drain() == []


# ----- properties -------------------------------------------------------------------------------


@SETTINGS
@given(st.integers(1, 8).flatmap(lambda n: st.tuples(st.just(n), st.permutations(range(n)))))
def test_without_deaths_the_fold_order_is_ascending_and_independent_of_arrival(
    case: tuple[int, list[int]],
) -> None:
    n, arrival = case
    barrier: FoldRound[str] = FoldRound(range(n))
    folded: list[str] = []
    for i, rank in enumerate(arrival):
        assert not barrier.complete
        barrier.offer([rank], f"r{rank}")
        folded += drain_ready(barrier)
        assert barrier.complete == (i == n - 1)
    assert folded == [f"r{r}" for r in range(n)]


@st.composite
def host_frames(draw: st.DrawFn) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Ranks 0..n-1 split into frames (a host's ranks need not be consecutive), and an order of
    arrival of those frames."""
    n = draw(st.integers(1, 8))
    ranks = draw(st.permutations(range(n)))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    frames = [tuple(ranks[a:b]) for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    return frames, draw(st.permutations(frames))


@SETTINGS
@given(host_frames())
def test_host_frames_fold_by_lowest_rank_whatever_their_arrival(
    case: tuple[list[tuple[int, ...]], list[tuple[int, ...]]],
) -> None:
    frames, arrival = case
    barrier: FoldRound[tuple[int, ...]] = FoldRound(r for f in frames for r in f)
    folded: list[tuple[int, ...]] = []
    for i, frame in enumerate(arrival):
        assert not barrier.complete
        barrier.offer(frame, frame)
        while (item := barrier.next_to_fold()) is not None:
            folded.append(item)
        assert barrier.complete == (i == len(arrival) - 1)
    assert folded == sorted(frames, key=min)


@st.composite
def rounds(draw: st.DrawFn) -> tuple[int, list[tuple[str, object]]]:
    """A round over ranks 0..n-1 split into frames, and an arrival order of offers and deaths:
    some frames never come, some ranks die (before or after their frame)."""
    frames, _ = draw(host_frames())
    n = sum(len(f) for f in frames)
    offered = draw(st.lists(st.booleans(), min_size=len(frames), max_size=len(frames)))
    dead = draw(st.sets(st.sampled_from(range(n))))
    events: list[tuple[str, object]] = [
        ("offer", f) for f, sent in zip(frames, offered, strict=True) if sent
    ]
    events += [("dead", r) for r in sorted(dead)]
    return n, draw(st.permutations(events))


@SETTINGS
@given(rounds())
def test_with_deaths_the_barrier_keeps_its_rules(
    case: tuple[int, list[tuple[str, object]]],
) -> None:
    n, events = case
    barrier: FoldRound[tuple[int, ...]] = FoldRound(range(n))
    dead: set[int] = set()
    covered: set[int] = set()
    offered: list[tuple[int, ...]] = []
    folded: list[tuple[int, ...]] = []
    for what, arg in events:
        if what == "offer":
            assert isinstance(arg, tuple)
            assert barrier.refusal(arg) is None  # frames are disjoint: none is refused
            barrier.offer(arg, arg)
            offered.append(arg)
            covered.update(arg)
        else:
            assert isinstance(arg, int)
            barrier.declare_dead(arg)
            dead.add(arg)
        while (item := barrier.next_to_fold()) is not None:
            # handed out only once every alive rank below its lowest is covered
            assert all(r in covered for r in range(min(item)) if r not in dead)
            folded.append(item)
        alive = set(range(n)) - dead
        # after a driver's pass, the round is complete exactly when every alive rank is covered
        assert barrier.complete == (alive <= covered)
        assert barrier.covered == covered
    # every offered frame folds exactly once, if the round completed
    if barrier.complete:
        assert sorted(folded) == sorted(offered)
    # frames whose lowest rank never died fold in ascending order (a dead rank's late frame may
    # come after higher ones: nothing waited for it)
    steady = [min(f) for f in folded if min(f) not in dead]
    assert steady == sorted(steady)
