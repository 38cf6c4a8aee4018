"""The round in flight, and what a COLLECTIVE world's loss asks of its survivors.

A CPU-backend round survives a death by itself: the reducer and the relays stop waiting for the
dead rank, and its window goes back to the pool. A COLLECTIVE world's ranks average among
themselves with ``torch.distributed``, whose process group cannot shrink: the survivors re-form
it in place (a new group on the run's store under a fresh prefix, the old one destroyed), and the
all_reduce that was in flight when the rank died is settled one of two ways:

* every survivor had finished it: the dead rank's contribution is in every survivor's state (an
  all_reduce finishes nowhere without every member's data), so the round stands, the dead rank's
  window counted in it;
* some survivor had not: no survivor's result can be trusted to match another's, so all of them
  redo the round in the new group from the state they entered it with (a survivor that had
  finished and trained on keeps what it trained since, as a delta on the redone consensus). The
  dead rank's window goes back to the pool. The redo keeps the round's number; the survivors'
  ``ReduceDone`` says its group's generation, so a late one from the old group counts for nothing.

Pure.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(slots=True, kw_only=True)
class InFlight:
    """The coordinator's round in flight: whom it waits for, and since when."""

    round: int
    kind: str
    started_at: float
    collective: bool
    waiting: set[int]
    closes_epoch: int | None = None
    ms: float = 0.0
    #: Ranks lost after every survivor finished their all_reduce: their windows are in.
    dead_in: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True, kw_only=True)
class Regroup:
    """The survivors' new process group (``ranks`` in order: its ranks 0, 1, …) under re-form
    ``generation``, and the round they redo in it first (-1: none)."""

    ranks: tuple[int, ...]
    generation: int
    redo: int = -1


def regroup_after_loss(
    flying: InFlight | None, *, dead: int, alive: Iterable[int], generation: int, now: float
) -> Regroup:
    """COLLECTIVE: ``dead`` is lost (no longer in ``alive`` nor in ``flying.waiting``); settle the
    collective round in flight as the module says (``flying`` is updated in place) and return the
    survivors' re-form."""
    survivors = tuple(sorted(alive))
    redo = -1
    if flying is not None and flying.collective:
        if flying.waiting:
            # a survivor is still in it: everyone redoes it, and the deadline starts again
            flying.waiting = set(survivors)
            flying.started_at = now
            flying.ms = 0.0
            redo = flying.round
        else:
            flying.dead_in.add(dead)
    return Regroup(ranks=survivors, generation=generation, redo=redo)
