"""The proof throttle and the accept-rate breaker, pure: a fake clock, addresses as strings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_async.errors import ConfigError
from flodl_async.net.arrivals import ArrivalBreaker, ArrivalPolicy
from flodl_async.net.proofthrottle import ProofThrottle, ThrottlePolicy

# ----- the proof throttle ---------------------------------------------------------------------------


def test_an_address_without_failures_is_answered_at_once() -> None:
    throttle = ProofThrottle()
    assert throttle.delay("a", 0.0) == 0.0
    throttle.failed("b", 0.0)
    assert throttle.delay("a", 0.0) == 0.0  # another address's failures are not a's
    assert throttle.statistics().delayed_answers == 0


def test_the_delay_doubles_with_failures_up_to_its_cap() -> None:
    throttle = ProofThrottle(ThrottlePolicy(first_delay=0.25, max_delay=2.0))
    delays = []
    for i in range(6):
        throttle.failed("a", float(i))
        delays.append(throttle.delay("a", float(i)))
    assert delays == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]
    stats = throttle.statistics()
    assert (stats.failed_proofs, stats.delayed_answers, stats.addresses_now) == (6, 6, 1)


def test_a_successful_proof_resets_the_delay() -> None:
    throttle = ProofThrottle()
    for _ in range(5):
        throttle.failed("a", 0.0)
    assert throttle.delay("a", 1.0) > 0
    throttle.succeeded("a")
    assert throttle.delay("a", 1.0) == 0.0
    throttle.failed("a", 2.0)
    assert throttle.delay("a", 2.0) == throttle.policy.first_delay  # grows from the start again


def test_a_quiet_address_is_forgotten() -> None:
    throttle = ProofThrottle(ThrottlePolicy(forget_after=60.0))
    throttle.failed("a", 0.0)
    assert throttle.delay("a", 59.0) > 0
    assert throttle.delay("a", 60.0) == 0.0
    assert throttle.statistics().addresses_now == 0


def test_memory_is_bounded_by_forgetting_the_least_recently_failed() -> None:
    throttle = ProofThrottle(ThrottlePolicy(max_peers=2))
    for peer in "abc":
        throttle.failed(peer, 0.0)
    throttle.failed("b", 1.0)  # b is fresh again, so c and b stay
    throttle.failed("d", 1.0)
    assert [throttle.delay(peer, 1.0) > 0 for peer in "abcd"] == [False, True, False, True]


def test_a_cap_below_the_first_delay_lowers_both() -> None:
    policy = ThrottlePolicy(first_delay=0.25, max_delay=2.0).capped_at(0.1)
    assert (policy.first_delay, policy.max_delay) == (0.1, 0.1)
    assert ThrottlePolicy().capped_at(10.0) == ThrottlePolicy()


@pytest.mark.parametrize(
    "kwargs",
    [{"first_delay": 0.0}, {"first_delay": 3.0, "max_delay": 2.0}, {"forget_after": 0.0}],
)
def test_a_bad_throttle_policy_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="proof throttle"):
        ThrottlePolicy(**kwargs)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.sampled_from(["fail", "ok", "ask"]), st.sampled_from("abc"), st.floats(0, 30)),
        max_size=80,
    )
)
def test_the_delay_is_never_above_its_cap_and_zero_right_after_a_success(
    events: list[tuple[str, str, float]],
) -> None:
    policy = ThrottlePolicy(first_delay=0.1, max_delay=1.5, forget_after=20.0)
    throttle = ProofThrottle(policy)
    now = 0.0
    for op, peer, step in events:
        now += step
        if op == "fail":
            throttle.failed(peer, now)
        elif op == "ok":
            throttle.succeeded(peer)
            assert throttle.delay(peer, now) == 0.0
        else:
            assert 0.0 <= throttle.delay(peer, now) <= policy.max_delay


def test_the_failure_count_saturates_instead_of_overflowing() -> None:
    throttle = ProofThrottle()
    for _ in range(5000):
        throttle.failed("a", 0.0)
    assert throttle.delay("a", 0.0) == throttle.policy.max_delay


# ----- the accept-rate breaker -----------------------------------------------------------------------


def test_a_burst_gets_in_then_the_rate_holds() -> None:
    breaker = ArrivalBreaker(ArrivalPolicy(rate=10.0, burst=5.0))
    assert [breaker.arrive("a", 0.0) for _ in range(6)] == [True] * 5 + [False]
    assert breaker.statistics().closed == 1
    assert breaker.statistics().addresses_now == 1
    assert not breaker.arrive("a", 0.05)  # half a token
    assert breaker.arrive("a", 0.1)  # refilled at 10 a second
    assert breaker.statistics().addresses_now == 0  # it got in: no longer closed


def test_one_address_churning_leaves_another_alone() -> None:
    breaker = ArrivalBreaker(ArrivalPolicy(rate=10.0, burst=5.0))
    for i in range(1000):
        breaker.arrive("flood", i / 10_000)
    assert all(breaker.arrive("other", 0.1) for _ in range(5))
    assert breaker.statistics().closed > 900


def test_a_bad_breaker_policy_is_refused() -> None:
    with pytest.raises(ConfigError, match="accept-rate breaker"):
        ArrivalPolicy(rate=0.0)


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(1.0, 1000.0),
    burst=st.integers(1, 50),
    gaps=st.lists(st.floats(0.0, 0.05), min_size=1, max_size=300),
)
def test_served_connections_never_exceed_the_burst_plus_the_rate_times_the_span(
    rate: float, burst: int, gaps: list[float]
) -> None:
    breaker = ArrivalBreaker(ArrivalPolicy(rate=rate, burst=float(burst)))
    now, served = 0.0, 0
    for gap in gaps:
        now += gap
        served += breaker.arrive("a", now)
    assert served <= burst + rate * now + 1e-6
    assert served + breaker.statistics().closed == len(gaps)
