"""The coordinator's checkpoint desk: which round is a checkpoint round, and the bundles' actions.

The when is :class:`~flodl_async.training.saves.SaveClock`'s; this desk keeps the bookkeeping
around it (the rounds marked, a resumed run's bases, a request made before training started) and
builds the :class:`~flodl_async.training.coordination.SaveCheckpoint` actions the coordinator
returns: one when a marked round commits, and one from the last consensus when the run ends on a
failure it cannot survive. Pure.
"""

from __future__ import annotations

from collections.abc import Callable

from ..control.vocab import Announce, Level
from .coordination import Action, CoordPhase, SaveCheckpoint
from .elche import ElCheState
from .partition import Range
from .saves import (
    END,
    FAILURE_REASONS,
    PREEMPT,
    REQUEST,
    SHUTDOWN,
    ResumePoint,
    SaveBook,
    SaveClock,
)
from .spec import TrainerSpec

#: What the coordinator knows as a bundle is taken: the epoch in progress in the consensus and its
#: batches the consensus holds, ElChe's state, the alive ranks, the global step.
Facts = Callable[[], tuple[int, tuple[Range, ...], ElCheState, frozenset[int], int]]


class SaveDesk:
    """One run's checkpoint decisions, for the coordinator."""

    def __init__(self, resume: ResumePoint | None, *, world_size: int) -> None:
        self.book = SaveBook.resuming(resume)
        self.clock: SaveClock | None = None
        self._world_size = world_size
        #: the stop under way is a preemption: its final round is a ``preempt`` bundle, whatever
        #: ``on_shutdown`` says, since the job's requeue resumes from it
        self.preempting = False

    @property
    def enabled(self) -> bool:
        """The run writes bundles (known once training starts)."""
        return self.clock is not None and self.clock.enabled

    def start(self, spec: TrainerSpec, now: float) -> None:
        """Training starts: the clock runs from here."""
        self.clock = SaveClock(spec.checkpoint)
        self.clock.started(now)
        if self.book.early_request:
            self.clock.request()

    def request(self, reason: str, *, phase: CoordPhase, spec: TrainerSpec | None) -> list[Action]:
        """A checkpoint was asked for; what the operator reads about it."""
        if spec is not None and spec.checkpoint.save_path is None:
            return [
                _warning(
                    f"a checkpoint was requested ({reason}), but this run has no "
                    "Checkpointing(save_path=...): nothing is written"
                )
            ]
        if phase is CoordPhase.JOINING:
            self.book.early_request = True  # before training started: its first reduce takes it
            return [Announce(text=f"checkpoint requested ({reason}): at the first reduce")]
        if self.clock is None or phase not in (CoordPhase.INIT, CoordPhase.TRAINING):
            return [
                _warning(
                    f"a checkpoint was requested ({reason}) as training ends; the end's bundle "
                    "(if any) is the last one"
                )
            ]
        self.clock.request()
        return [Announce(text=f"checkpoint requested ({reason}): at the next reduce")]

    def due(self, *, closes_epoch: int | None, now: float) -> str | None:
        """A model round fires: its bundle's reason, or None."""
        clock = self.clock
        return None if clock is None else clock.due(closes_epoch=closes_epoch, now=now)

    def final_reason(
        self, *, natural: bool, from_controller: bool, on_shutdown: bool
    ) -> str | None:
        """The final round's bundle reason, or None (none written, or the last model round's bundle
        already holds this consensus)."""
        clock = self.clock
        if clock is None or not clock.enabled:
            return None
        if self.preempting:
            return PREEMPT  # whatever on_shutdown says; a pending request is folded into it
        reason = END if natural else SHUTDOWN if on_shutdown else None
        if clock.requested:
            return reason or REQUEST
        book = self.book
        if from_controller and 0 <= book.last_saved_round == book.last_model_round:
            return None
        return reason

    def mark(self, round_: int, reason: str) -> int:
        """Round ``round_`` is a checkpoint round; its bundle's round number."""
        self.book.pending[round_] = reason
        self.book.last_saved_round = round_
        return self.book.round_base + round_

    def committed(self, round_: int, facts: Facts) -> list[Action]:
        """Round ``round_`` committed: its bundle, when it was marked."""
        reason = self.book.pending.pop(round_, None)
        if reason is None:
            return []
        return [self._save(round_, reason, facts, last=False)]

    def failed(
        self, save_reason: str, committed: tuple[int, str, float] | None, facts: Facts
    ) -> list[Action]:
        """The run ends on ``save_reason``: a bundle of the last consensus (``committed``: the
        coordinator's last committed round), when there is one."""
        reason = FAILURE_REASONS.get(save_reason)
        if reason is None or not self.enabled or committed is None:
            return []
        return [self._save(committed[0], reason, facts, last=True)]

    def _save(self, round_: int, reason: str, facts: Facts, *, last: bool) -> SaveCheckpoint:
        epoch, coverage, elche, alive, step = facts()
        return SaveCheckpoint(
            round=round_,
            bundle_round=self.book.round_base + round_,
            reason=reason,
            epoch=epoch,
            global_step=step,
            coverage=coverage,
            elche=elche,
            ranks=frozenset() if last else alive,
            world_size=self._world_size,
            last=last,
        )


def _warning(text: str) -> Announce:
    return Announce(text=text, level=Level.WARNING)
