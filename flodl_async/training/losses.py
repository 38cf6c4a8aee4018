"""The ranks a run lost: who, why, when, and how a verdict says it.

The coordinator's death chain records each lost rank once (:meth:`LostRanks.record`; the first
source of a death decides), lets a process's own exit refine the reason a link's close gave first
(:meth:`LostRanks.refine`), and asks here how the end reads: ``training complete, DEGRADED — 1 of 3
ranks lost (rank 2 on host b: its process was killed by SIGKILL at epoch 3)`` for a run that went
on, or the reason of one that could not (:meth:`LostRanks.unrecoverable`).

Pure: no asyncio, no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class _Loss:
    reason: str
    epoch: int  # 0-based: the epoch being trained when it died
    details: str
    vague: bool  # the reason is only a link's close


class LostRanks:
    """The dead ranks of one run, in the order they died.

    ``host_of(rank)``: how a verdict names a rank's host (``host b``).
    """

    __slots__ = ("_host_of", "_losses")

    def __init__(self, host_of: Callable[[int], str]) -> None:
        self._host_of = host_of
        self._losses: dict[int, _Loss] = {}

    def __contains__(self, rank: object) -> bool:
        return rank in self._losses

    def __len__(self) -> int:
        return len(self._losses)

    @property
    def ranks(self) -> frozenset[int]:
        """Every dead rank."""
        return frozenset(self._losses)

    def record(
        self, rank: int, reason: str, *, epoch: int, details: str = "", vague: bool = False
    ) -> None:
        """``rank`` died while ``epoch`` (0-based) trained; ``details``: its traceback, if any;
        ``vague``: ``reason`` is only that its link closed."""
        self._losses[rank] = _Loss(reason=reason, epoch=epoch, details=details, vague=vague)

    def refine(self, rank: int, reason: str) -> None:
        """A better reason for a rank already dead (its process's own exit, after its link's
        close); a death that came with its cause (its traceback, a lie, its silence) keeps it."""
        loss = self._losses[rank]
        if loss.vague:
            self._losses[rank] = _Loss(
                reason=reason, epoch=loss.epoch, details=loss.details, vague=False
            )

    def revive(self, rank: int) -> str:
        """``rank``'s restarted process rejoined: it is lost no more. How its previous one died
        (``reason at epoch N``)."""
        loss = self._losses.pop(rank)
        return f"{loss.reason} at epoch {loss.epoch + 1}"

    def why(self) -> tuple[tuple[int, str], ...]:
        """(rank, ``reason at epoch N``) for each dead rank, by rank."""
        return tuple(
            (rank, f"{loss.reason} at epoch {loss.epoch + 1}")
            for rank, loss in sorted(self._losses.items())
        )

    def text(self) -> str:
        """``rank 2 on host b: killed at epoch 3; rank 3 on host c: …``."""
        return "; ".join(f"rank {rank} on {self._host_of(rank)}: {why}" for rank, why in self.why())

    def degraded(self, reason: str, *, world_size: int) -> str:
        """``reason`` (``training complete: 4 epoch(s) on 2 rank(s)``) as a run that lost ranks
        says it; unchanged when none was lost."""
        if not self._losses:
            return reason
        head, _, rest = reason.partition(": ")
        lost = f"{len(self._losses)} of {world_size} ranks lost ({self.text()})"
        return f"{head}, DEGRADED — {lost}" + (f"; {rest}" if rest else "")

    def first(self) -> tuple[int, str]:
        """The first rank that died and its details: the likeliest cause of the deaths after it."""
        rank, loss = next(iter(self._losses.items()))
        return rank, loss.details

    def unrecoverable(
        self, why: str, *, rank: int, reason: str, world_size: int, limit: int | None, joining: bool
    ) -> str:
        """The verdict of a run that cannot go on after ``rank`` died of ``reason`` (``why``: the
        save reason, :func:`~flodl_async.training.policy.unrecoverable_reason`'s)."""
        where = f"rank {rank} on {self._host_of(rank)}"
        if joining:
            return f"{where} was lost before training started: {reason}"
        if why == "max_failure_exceeded":
            return (
                f"max_failure reached: {len(self._losses)} of {world_size} ranks lost (the limit "
                f"is {limit}) — {self.text()}"
            )
        if why == "all_ranks_lost" and len(self._losses) > 1:
            return f"every rank was lost — {self.text()}"
        return f"{where} was lost mid-training: {reason}"
