"""Which round a contribution goes to, and whether it may join it, before the fold barrier sees it.

Theory of operation. The fold barrier (:mod:`flodl_async.training.foldround`) decides the order
inside one open round; what comes before it is decided here, for both folds:

* the reducer's :class:`RoundGate` routes a host frame for round ``k``: to the open round; held
  until ``k`` opens when it is at most ``early_rounds`` past the newest one (one frame per host);
  dropped when ``k`` completed and every rank it lists died since (the round went on without
  them); refused otherwise (late for a completed round, or a round that was never opened);
* :func:`check_host_frame` (the reducer) and :func:`check_rank_contribution` (the relay's host
  fold) say whether a frame may join the round it was routed to: its kind, the ranks its round's
  barrier would refuse, its weight, and its tensors against the layout every other frame of the
  round has.

Pure: no asyncio, no torch. A refusal is a :class:`~flodl_async.errors.ProtocolError` whose text
names the frame, which the shell logs and answers by closing the sender's link.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from ..errors import ProtocolError
from ..wire import messages as m
from . import foldmath
from .foldround import Refusal, Refused

T = TypeVar("T")

#: What a host frame the round's barrier refuses is told: formatted with (frame, rank, round).
_REFUSALS = {
    Refused.NO_RANKS: "{0} lists no ranks",
    Refused.TWICE: (
        "{0} lists rank {1}, which is already covered in this round (each rank contributes "
        "exactly once)"
    ),
    Refused.UNEXPECTED: "{0} lists rank {1}, which round {2} does not expect",
}


class Route(enum.Enum):
    """Where a host frame goes (:meth:`RoundGate.route`)."""

    #: Its round is open: it joins that round's barrier now.
    OPEN = "open"
    #: Its round opens soon: the gate keeps it, and :meth:`RoundGate.open` hands it back.
    HELD = "held"
    #: Its round completed without the dead ranks it lists: the shell releases it.
    DROPPED = "dropped"


class RoundGate(Generic[T]):
    """The reducer's rounds, opened, completed and soon to open; see the module docstring.

    ``early_rounds``: how far past the newest opened round a host may run (its frame waits here).
    """

    def __init__(self, *, early_rounds: int) -> None:
        self._early_rounds = early_rounds
        self._open: set[int] = set()
        self._completed: set[int] = set()
        self._newest = -1
        self._dead: set[int] = set()
        # per round not opened yet: (the frame's sender, the frame), in arrival order
        self._held: dict[int, list[tuple[object, T]]] = {}

    @property
    def dead(self) -> frozenset[int]:
        """The ranks declared dead so far (a round opened later starts without them)."""
        return frozenset(self._dead)

    def open(self, round: int, expected: Iterable[int] = ()) -> list[T]:
        """Round ``round`` opens: the frames held for it, in arrival order, join it now.
        ``expected``: its ranks, alive by the coordinator's word (a restarted rank readmitted).

        Raises ``ValueError`` for a round opened before (open or completed)."""
        if round in self._open or round in self._completed:
            raise ValueError(f"round {round} was already opened")
        self._dead.difference_update(expected)
        self._open.add(round)
        self._newest = max(self._newest, round)
        return [item for _, item in self._held.pop(round, [])]

    def complete(self, round: int) -> None:
        """Round ``round`` is done: a later frame for it is late."""
        self._open.discard(round)
        self._completed.add(round)

    def declare_dead(self, rank: int) -> None:
        """``rank`` is lost: its late frames for a completed round are dropped, not refused."""
        self._dead.add(rank)

    def route(self, round: int, ranks: Sequence[int], sender: object, item: T) -> Route:
        """Where ``item``, ``sender``'s frame for ``round`` listing ``ranks``, goes; raises
        :class:`ProtocolError` for a frame no round takes (the shell closes ``sender``)."""
        if round in self._open:
            return Route.OPEN
        if round in self._completed:
            if set(ranks) <= self._dead:
                # a dead rank's late frame: the round went on without it
                return Route.DROPPED
            raise ProtocolError(
                f"round {round} is already complete; ranks {list(ranks)} sent to it late"
            )
        if round <= self._newest or round > self._newest + self._early_rounds:
            raise ProtocolError(f"round {round} was never opened (newest: {self._newest})")
        held = self._held.setdefault(round, [])
        if any(s is sender for s, _ in held):
            raise ProtocolError(f"two frames for round {round} before it opened")
        held.append((sender, item))
        return Route.HELD


def check_host_frame(
    msg: m.HostContribution,
    *,
    what: str,
    kind: str,
    takes_contributions: bool,
    refusal: Refusal | None,
    gamma: float | None,
    specs: Sequence[m.TensorSpec],
    acc_specs: Sequence[m.TensorSpec],
    payload_len: int,
) -> None:
    """Raise :class:`ProtocolError` unless host frame ``msg`` (named ``what``) may join its round.

    ``kind``: the round's; ``takes_contributions``: False for a round whose consensus the
    controller sends; ``refusal``: the round barrier's answer for the frame's ranks; ``gamma``:
    a ``model`` frame's weight is its ranks' ``steps ** gamma`` summed (None: the round's plan
    judges weights, :func:`~flodl_async.training.plancheck.check_host_claims`); ``specs`` and
    ``acc_specs``: the model's layout, plain and prescaled (accumulated); ``payload_len``: the
    bytes behind the frame."""
    if not takes_contributions:
        raise ProtocolError(
            f"{what}: round {msg.round} takes no contributions (the controller sends its consensus)"
        )
    if msg.kind != kind:
        raise ProtocolError(f"{what} is a {msg.kind!r} contribution; the round is {kind!r}")
    if refusal is not None:
        raise ProtocolError(_REFUSALS[refusal.reason].format(what, refusal.rank, msg.round))
    if not (math.isfinite(msg.weight) and msg.weight >= 0):
        raise ProtocolError(f"{what} has weight {msg.weight!r}; weights are finite and >= 0")
    if gamma is not None and kind == "model" and len(msg.steps) == len(msg.ranks):
        # Weights are steps ** gamma (0 steps weigh 0); a rank that computed them with another
        # gamma disagrees here.
        want = 0.0
        for steps in msg.steps:
            want += 0.0 if steps == 0 else float(steps) ** gamma
        if not math.isclose(msg.weight, want, rel_tol=1e-9, abs_tol=1e-12):
            raise ProtocolError(
                f"{what} weighs {msg.weight!r}, but its ranks' steps {list(msg.steps)} ** "
                f"gamma {gamma:g} give {want!r}"
            )
    if msg.tensors:
        expected = acc_specs if msg.prescaled else specs
        foldmath.check_specs(msg.tensors, expected, payload_len, what=what)
    elif msg.weight != 0 or payload_len:
        raise ProtocolError(f"{what} carries no tensors, so it must weigh 0 and have no payload")


def check_rank_contribution(
    msg: m.Contribution,
    *,
    kind: str,
    refusal: Refusal | None,
    layout: tuple[m.TensorSpec, ...] | None,
    payload_len: int,
) -> tuple[m.TensorSpec, ...] | None:
    """Raise :class:`ProtocolError` unless rank contribution ``msg`` may join its host round;
    returns the round's tensor layout from now on.

    ``kind``: the round's (its first contribution's); ``refusal``: the round barrier's answer for
    the rank; ``layout``: the tensors the round's contributions describe so far (None before the
    first with tensors, which becomes the reference); ``payload_len``: the bytes behind ``msg``."""
    if msg.kind != kind:
        raise ProtocolError(
            f"rank {msg.rank} contributed to round {msg.round} as {msg.kind!r}, the host's "
            f"other ranks as {kind!r}"
        )
    if refusal is not None and refusal.reason is Refused.TWICE:
        raise ProtocolError(f"rank {msg.rank} contributed twice to round {msg.round}")
    if refusal is not None:
        # the rank socket's handshake admits only this host's ranks: not reached from there
        raise ProtocolError(f"rank {msg.rank} does not run on this host")
    if not (math.isfinite(msg.weight) and msg.weight >= 0):
        raise ProtocolError(
            f"rank {msg.rank} contributed to round {msg.round} with weight {msg.weight!r}; "
            "weights are finite and >= 0"
        )
    if not msg.tensors:
        if msg.weight != 0 or payload_len:
            raise ProtocolError(
                f"rank {msg.rank}: an empty contribution to round {msg.round} must have weight "
                "0 and no payload"
            )
        return layout
    # Every contribution of a host describes the same tensors: the first one is the reference.
    reference = (
        layout
        if layout is not None
        else foldmath.packed_specs([(s.name, s.dtype, tuple(s.shape)) for s in msg.tensors])[0]
    )
    foldmath.check_specs(
        msg.tensors,
        reference,
        payload_len,
        what=f"rank {msg.rank}'s contribution to round {msg.round}",
    )
    return reference
