"""The accept-rate breaker: an address that opens connections faster than the port can afford
has its new ones closed at once.

Theory of operation
-------------------
Admission (:mod:`flodl_async.net.admission`) caps the connections an address *holds*, not how
fast it opens them: a client that opens and drops thousands a second makes the loop accept,
admit and evict each one, and everyone else's connections wait behind them in the listen queue.
So each address (:func:`~flodl_async.net.admission.peer_key`) has a token bucket: ``burst``
connections at once, refilled at ``rate`` a second. A connection that finds its address's bucket
empty is closed as it is accepted — no admission, no eviction, no sniffing, no handshake — and
counted (``churning``); the loop's time and the held-connection caps stay with the other
addresses.

Why per address and these defaults: an honest host opens a handful of connections at a time
(join, relay, data links) and one store connection per rank at a world's start, all within
a burst of 1,024 (the per-address store cap); 256 a second after that is more than any run
reopens, while the floods seen were 10,000–30,000 a second. A connection from a churning address
is best effort, an agent's included: it dials again within its connect timeout.

Pure: addresses are strings, ``now`` comes from one monotonic clock; memory is bounded by
``max_peers`` (the least recently seen address is forgotten first: a fresh full bucket, which is
what a quiet address would have anyway).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class ArrivalPolicy:
    """One address's bucket: ``burst`` connections at once, ``rate`` a second after that."""

    rate: float = 256.0
    burst: float = 1024.0
    max_peers: int = 4096

    def __post_init__(self) -> None:
        if not (self.rate > 0 and self.burst >= 1 and self.max_peers >= 1):
            raise ConfigError(
                f"accept-rate breaker: need rate > 0 ({self.rate:g}/s), burst >= 1 "
                f"({self.burst:g}) and max_peers >= 1 ({self.max_peers})"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class BreakerStatistics:
    """Connections closed at once so far, and addresses whose bucket is empty now."""

    closed: int
    addresses_now: int


class _Bucket:
    __slots__ = ("at", "tokens")

    def __init__(self, tokens: float, at: float) -> None:
        self.tokens = tokens
        self.at = at


class ArrivalBreaker:
    """Token buckets by address: :meth:`arrive` says whether a new connection may be served."""

    def __init__(self, policy: ArrivalPolicy | None = None) -> None:
        self.policy = policy or ArrivalPolicy()
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._closed = 0
        self._tripped: set[str] = set()

    def arrive(self, peer: str, now: float) -> bool:
        """A connection from ``peer`` was accepted at ``now``: True to serve it, False to close it
        at once (counted)."""
        policy = self.policy
        bucket = self._buckets.get(peer)
        if bucket is None:
            bucket = self._buckets[peer] = _Bucket(policy.burst, now)
            while len(self._buckets) > policy.max_peers:
                gone, _ = self._buckets.popitem(last=False)
                self._tripped.discard(gone)
        else:
            self._buckets.move_to_end(peer)
            bucket.tokens = min(policy.burst, bucket.tokens + (now - bucket.at) * policy.rate)
            bucket.at = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            self._tripped.discard(peer)
            return True
        self._closed += 1
        self._tripped.add(peer)
        return False

    def statistics(self) -> BreakerStatistics:
        """A snapshot: closed connections in all, addresses closed last time they connected."""
        return BreakerStatistics(closed=self._closed, addresses_now=len(self._tripped))
