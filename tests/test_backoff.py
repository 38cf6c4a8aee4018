"""The persistent agent's reconnect schedule (pure): capped exponential backoff with jitter."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flodl_async.control.backoff import Backoff, BackoffPolicy, BoundedRetry


def test_the_ceiling_doubles_from_initial_up_to_the_cap() -> None:
    policy = BackoffPolicy(initial=0.5, factor=2.0, cap=30.0, jitter=0.5)
    assert [policy.ceiling(n) for n in range(9)] == [
        0.5,
        1.0,
        2.0,
        4.0,
        8.0,
        16.0,
        30.0,
        30.0,
        30.0,
    ]
    assert policy.ceiling(100_000) == 30.0  # no overflow however long the controller stays away


def test_jitter_draws_within_the_lower_part_of_the_ceiling() -> None:
    policy = BackoffPolicy(initial=1.0, factor=2.0, cap=8.0, jitter=0.5)
    assert policy.delay(2, 0.0) == 4.0
    assert policy.delay(2, 1.0) == 2.0
    assert policy.delay(2, 0.5) == 3.0
    assert BackoffPolicy(initial=1.0, cap=8.0, jitter=0.0).delay(3, 0.9) == 8.0


def test_failures_advance_the_schedule_and_a_success_resets_it() -> None:
    backoff = Backoff(BackoffPolicy(initial=1.0, factor=2.0, cap=4.0, jitter=0.0))
    assert [backoff.failed(100.0, 0.3) for _ in range(4)] == [101.0, 102.0, 104.0, 104.0]
    assert backoff.failures == 4
    backoff.succeeded()
    assert backoff.failed(200.0, 0.3) == 201.0


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"initial": 0.0}, "initial"),
        ({"initial": 5.0, "cap": 1.0}, "cap"),
        ({"factor": 0.5}, "factor"),
        ({"jitter": 1.5}, "jitter"),
    ],
)
def test_a_bad_policy_is_refused(kwargs: dict[str, float], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        BackoffPolicy(**kwargs)


@given(
    initial=st.floats(0.01, 10.0),
    extra=st.floats(0.0, 100.0),
    factor=st.floats(1.0, 10.0),
    jitter=st.floats(0.0, 1.0),
    attempt=st.integers(0, 10_000),
    draw=st.floats(0.0, 1.0),
)
def test_every_delay_is_within_the_cap_and_the_ceilings_never_shrink(
    initial: float, extra: float, factor: float, jitter: float, attempt: int, draw: float
) -> None:
    policy = BackoffPolicy(initial=initial, cap=initial + extra, factor=factor, jitter=jitter)
    delay = policy.delay(attempt, draw)
    assert 0 <= delay <= policy.cap
    assert (1 - jitter) * policy.ceiling(attempt) - 1e-9 <= delay
    assert policy.ceiling(attempt) <= policy.ceiling(attempt + 1)


def test_a_bounded_retry_cuts_its_last_wait_at_the_deadline_then_gives_up() -> None:
    policy = BackoffPolicy(initial=1.0, factor=2.0, cap=30.0, jitter=0.0)
    retry = BoundedRetry(policy, give_up_at=105.0)
    assert retry.failed(100.0, 0.5) == 101.0
    assert retry.failed(101.0, 0.5) == 103.0
    assert retry.failed(103.0, 0.5) == 105.0  # 107 would pass the deadline: one last try at it
    assert retry.failed(105.0, 0.5) is None  # the deadline has come: give up
    assert retry.failures == 3


def test_a_bounded_retry_with_no_time_tries_once() -> None:
    # --connect-timeout 0: the deadline is the start
    assert BoundedRetry(BackoffPolicy(), give_up_at=50.0).failed(50.0, 0.0) is None


@given(
    start=st.floats(0.0, 1e6),
    window=st.floats(0.0, 600.0),
    draws=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=50),
)
def test_a_bounded_retry_never_schedules_past_its_deadline(
    start: float, window: float, draws: list[float]
) -> None:
    retry = BoundedRetry(BackoffPolicy(initial=0.5, cap=30.0), give_up_at=start + window)
    now = start
    for draw in draws:
        at = retry.failed(now, draw)
        if at is None:
            assert now >= start + window
            return
        assert now < at <= start + window
        now = at
