"""The proof throttle: an address whose handshakes failed their proofs waits for its next answers.

Theory of operation
-------------------
On the controller's port the server proves first: its answer to a ClientHello (the ServerHello)
carries a proof under the credential the client claims, so every answer lets a client check one
guess of a token or secret. A handshake that got our answer and then did not authenticate — the
peer closed instead of proving (a wrong token), sent a proof that did not verify, or ran out its
deadline — is a *failed proof* of its address (:func:`~flodl_async.net.admission.peer_key`).
After failures, that address's next answers go out only after a delay: ``first_delay``, doubling
with each further failure, capped at ``max_delay``. A proof that verifies from the address resets
it; so does a quiet ``forget_after`` without failures.

The delay is never a refusal and never applies to an address without failures: an agent behind
the same address as a guesser (loopback, a NAT) is answered within ``max_delay``, well inside
its handshake deadline, and joins. The delay applies per connection, so a guesser's rate is at
most its concurrent handshakes (the per-address cap on unproven connections) per ``max_delay``,
and one guess at a time is one per ``max_delay``. Refusals (a credential this endpoint does not
take, another version) give nothing to check and are never delayed.

Pure: addresses are strings, ``now`` comes from one monotonic clock; memory is bounded by
``max_peers`` (the least recently failed address is forgotten first). The port mux
(:mod:`flodl_async.net.mux`) performs the delays.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class ThrottlePolicy:
    """The shape of the delay, in seconds.

    Why these defaults: 2 s caps a guesser that keeps one handshake in flight at half a guess a
    second (from thousands), while an honest handshake behind that address still ends well inside
    the 5 s handshake deadline; four failures reach the cap. A minute of quiet forgets an address.
    """

    first_delay: float = 0.25
    max_delay: float = 2.0
    forget_after: float = 60.0
    #: Addresses remembered at once; beyond it the least recently failed is forgotten.
    max_peers: int = 4096

    def __post_init__(self) -> None:
        if not 0 < self.first_delay <= self.max_delay:
            raise ConfigError(
                f"proof throttle: need 0 < first delay ({self.first_delay:g}s) <= max delay "
                f"({self.max_delay:g}s)"
            )
        if self.forget_after <= 0 or self.max_peers < 1:
            raise ConfigError(
                f"proof throttle: need forget_after > 0 ({self.forget_after:g}s) and max_peers >= 1"
                f" ({self.max_peers})"
            )

    def capped_at(self, ceiling: float) -> ThrottlePolicy:
        """This policy with the delays at most ``ceiling`` (a fraction of the handshake deadline:
        a delayed answer must leave the client time to prove)."""
        top = min(self.max_delay, ceiling)
        return ThrottlePolicy(
            first_delay=min(self.first_delay, top),
            max_delay=top,
            forget_after=self.forget_after,
            max_peers=self.max_peers,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ThrottleStatistics:
    """Failed proofs counted and answers delayed so far, and addresses throttled now."""

    failed_proofs: int
    delayed_answers: int
    addresses_now: int


#: Failures counted per address: far past any cap of the delay, and 2.0 ** it stays a float.
_MAX_FAILURES = 64


class _Record:
    __slots__ = ("failures", "last_failure")

    def __init__(self, last_failure: float) -> None:
        self.failures = 0
        self.last_failure = last_failure


class ProofThrottle:
    """Failed proofs by address, and the delay each address's next answer waits."""

    def __init__(self, policy: ThrottlePolicy | None = None) -> None:
        self.policy = policy or ThrottlePolicy()
        self._records: OrderedDict[str, _Record] = OrderedDict()
        self._failed = 0
        self._delayed = 0

    def failed(self, peer: str, now: float) -> None:
        """A handshake from ``peer`` got our answer and did not prove the key."""
        self._failed += 1
        record = self._current(peer, now)
        if record is None:
            record = self._records[peer] = _Record(now)
            while len(self._records) > self.policy.max_peers:
                self._records.popitem(last=False)
        record.failures = min(record.failures + 1, _MAX_FAILURES)
        record.last_failure = now
        self._records.move_to_end(peer)

    def succeeded(self, peer: str) -> None:
        """A handshake from ``peer`` proved the key: its answers go out at once again."""
        self._records.pop(peer, None)

    def delay(self, peer: str, now: float) -> float:
        """Seconds to wait before answering a hello from ``peer`` now (0: at once); a positive
        answer is counted as a delayed answer."""
        record = self._current(peer, now)
        if record is None:
            return 0.0
        self._delayed += 1
        return min(self.policy.max_delay, self.policy.first_delay * 2.0 ** (record.failures - 1))

    def statistics(self) -> ThrottleStatistics:
        """A snapshot of the counts (addresses forgotten by time still count until next touched)."""
        return ThrottleStatistics(
            failed_proofs=self._failed,
            delayed_answers=self._delayed,
            addresses_now=len(self._records),
        )

    def _current(self, peer: str, now: float) -> _Record | None:
        record = self._records.get(peer)
        if record is not None and now - record.last_failure >= self.policy.forget_after:
            del self._records[peer]
            return None
        return record
