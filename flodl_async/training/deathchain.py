"""The death chain's pure steps: whether a run survives a lost rank, and how each loss reads.

The coordinator runs the chain once per lost rank (:meth:`Coordinator._on_lost
<flodl_async.training.coordinator.Coordinator>`): it keeps the bookkeeping (who is alive, whose
batches go back to the pool); this module holds the decisions and words that need no more than
their arguments — the verdict of a loss the run cannot survive (``max_failure`` reached, every
rank lost, a rank lost before training started), a COLLECTIVE world's re-form announcement, the
reasons a deadline gives, and the small action builders the coordinator's phases share.

Pure.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..control.vocab import Announce, Level, Tell
from ..verdict import ExitCode
from ..wire import messages as m
from .coordination import EVERY_RANK, Action, Fail
from .losses import LostRanks
from .policy import failure_limit, unrecoverable_reason
from .regroup import InFlight, Regroup, regroup_after_loss
from .spec import TrainerSpec

#: Save reasons that are the operator's limit rather than a plain failure.
EXIT_FOR_SAVE_REASON = {"max_failure_exceeded": ExitCode.MAX_FAILURE}


def warning(text: str) -> Announce:
    """A line the operator should read."""
    return Announce(text=text, level=Level.WARNING)


def reject(rank: int, reason: str) -> Tell[int]:
    """``rank``'s hello is refused."""
    return Tell(to=rank, message=m.TrainerReject(rank=rank, reason=reason))


def unrecoverable_end(
    lost: LostRanks,
    spec: TrainerSpec,
    *,
    world_size: int,
    rank: int,
    reason: str,
    joining: bool,
) -> list[Action] | None:
    """After ``rank`` (already in ``lost``) died of ``reason``: None when the survivors train on,
    else the end of the run (every rank shut down, the verdict naming the first rank lost)."""
    mf = spec.max_failure
    limit = failure_limit(
        world_size=world_size,
        absolute=mf.absolute if mf else None,
        percent=mf.percent if mf else None,
    )
    why = unrecoverable_reason(world_size=world_size, dead=len(lost), limit=limit)
    if why is None and joining:
        why = "rank_lost"  # the world never started: nothing to train on without it
    if why is None:
        return None
    text = lost.unrecoverable(
        why, rank=rank, reason=reason, world_size=world_size, limit=limit, joining=joining
    )
    first, details = lost.first()
    return [
        Tell(to=EVERY_RANK, message=m.Shutdown(reason=text, save_reason=why)),
        Fail(
            code=EXIT_FOR_SAVE_REASON.get(why, ExitCode.RANK_FAILURE),
            reason=text,
            rank=first,
            details=details,
            save_reason=why,
        ),
    ]


def regroup(
    flying: InFlight | None, *, dead: int, alive: set[int], generation: int, now: float
) -> tuple[Regroup, Announce]:
    """COLLECTIVE: the survivors' re-form after ``dead`` (``flying`` settled in place,
    :func:`~flodl_async.training.regroup.regroup_after_loss`), and how it is announced."""
    new = regroup_after_loss(flying, dead=dead, alive=alive, generation=generation, now=now)
    redo = f"; round {new.redo} is redone" if new.redo >= 0 else ""
    text = f"the survivors re-form their process group as ranks {list(new.ranks)}"
    return new, Announce(text=text + redo)


def late_hello(*, late: int, where: str, first: int, hello_timeout: float) -> str:
    """Why the run ends when rank ``late`` (on ``where``) never said hello."""
    return (
        f"rank {late} on {where} did not start its Trainer within {hello_timeout:g} s of rank "
        f"{first} — is it running the same script, and does it reach trainer.run()?"
    )


def silent(timeout: float) -> str:
    """Why a rank quiet for ``timeout`` seconds is lost."""
    return f"no frame for {timeout:g} s (heartbeat timeout: the rank is frozen, stopped or cut off)"


def next_deadline(
    *,
    hello: float | None,
    heartbeat: float | None,
    last_seen: Mapping[int, float],
    stall: float | None,
) -> float | None:
    """The earliest of the coordinator's deadlines: the join window's end (``hello``), each watched
    rank's heartbeat expiry (``last_seen`` + ``heartbeat``), the round in flight's stall."""
    candidates = [t for t in (hello, stall) if t is not None]
    if heartbeat is not None:
        candidates.extend(seen + heartbeat for seen in last_seen.values())
    return min(candidates, default=None)


def first_silent(last_seen: Mapping[int, float], heartbeat: float | None, now: float) -> int | None:
    """The lowest watched rank with no frame for ``heartbeat`` seconds at ``now``, or None."""
    if heartbeat is None:
        return None
    return next((r for r in sorted(last_seen) if now >= last_seen[r] + heartbeat), None)


def stalled(flying: InFlight, reduce_stall: float) -> str:
    """Why the run ends when ``flying`` found no consensus in time."""
    return f"round {flying.round} ({flying.kind}) stalled: no consensus within {reduce_stall:g} s"
