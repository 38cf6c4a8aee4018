"""Reconnect pacing for a persistent agent: capped exponential backoff with jitter, pure (time and
randomness passed in).

Theory of operation. Attempt ``n`` (0 for the first retry after a failure) waits
``min(cap, initial · factor**n)`` scaled by a jitter draw: the delay is taken
uniformly from ``[(1 - jitter) · d, d]`` ("equal jitter" when ``jitter`` is
0.5), so a fleet of agents that lost the same controller at the same moment
does not come back in lockstep, yet no agent waits longer than the cap. A
success (the agent joined a run) resets the count: the next failure starts
from ``initial`` again. :class:`BoundedRetry` is the same schedule with a last
moment (a one-run agent's ``--connect-timeout``): the wait before the last try
ends at that moment, and a failure at or after it means give up. The shell owns
the clock and the random source; this module only does arithmetic, so the
schedule is tested exactly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class BackoffPolicy:
    """The shape of the schedule, in seconds."""

    initial: float = 0.5
    factor: float = 2.0
    cap: float = 30.0
    #: Fraction of each delay that is random: 0 is no jitter, 1 draws from ``[0, d]``.
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.cap:
            raise ValueError(f"backoff: need 0 < initial ({self.initial:g}) <= cap ({self.cap:g})")
        if self.factor < 1:
            raise ValueError(f"backoff: factor must be at least 1 (got {self.factor:g})")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"backoff: jitter must be in [0, 1] (got {self.jitter:g})")

    def ceiling(self, attempt: int) -> float:
        """The un-jittered delay of ``attempt`` (0-based): ``min(cap, initial ·
        factor**attempt)``."""
        if attempt < 0:
            raise ValueError(f"backoff: attempt must be 0 or more (got {attempt})")
        delay = self.initial
        # a loop, not `**`: no overflow however long the controller stays away
        for _ in range(attempt):
            delay *= self.factor
            if delay >= self.cap:
                return self.cap
        return min(delay, self.cap)

    def delay(self, attempt: int, draw: float) -> float:
        """The delay of ``attempt`` for a uniform ``draw`` in [0, 1)."""
        if not 0 <= draw <= 1:
            raise ValueError(f"backoff: draw must be in [0, 1] (got {draw})")
        ceiling = self.ceiling(attempt)
        return ceiling * (1 - self.jitter * draw)


class Backoff:
    """The schedule's state: how many failures in a row, and when the next attempt is due."""

    def __init__(self, policy: BackoffPolicy) -> None:
        self.policy = policy
        self.failures = 0

    def failed(self, now: float, draw: float) -> float:
        """Record a failed attempt at ``now``; returns when (monotonic) to try again."""
        at = now + self.policy.delay(self.failures, draw)
        self.failures += 1
        return at

    def succeeded(self) -> None:
        """The agent joined a run: the next failure starts the schedule over."""
        self.failures = 0


class BoundedRetry:
    """A :class:`Backoff` that gives up at ``give_up_at`` (monotonic): the one-run agent's
    ``--connect-timeout``."""

    def __init__(self, policy: BackoffPolicy, *, give_up_at: float) -> None:
        self._backoff = Backoff(policy)
        self.give_up_at = give_up_at

    @property
    def failures(self) -> int:
        """Failed attempts so far."""
        return self._backoff.failures

    def failed(self, now: float, draw: float) -> float | None:
        """Record a failed attempt at ``now``: when to try again (never past ``give_up_at``), or
        None once ``give_up_at`` has come (give up)."""
        if now >= self.give_up_at:
            return None
        # the last wait is cut short rather than skipped: one more try lands right at the deadline
        return min(self._backoff.failed(now, draw), self.give_up_at)
