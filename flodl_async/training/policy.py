"""When and how the Trainer averages: the policies, the backends and the reduce gate.

Theory of operation. Pure: no asyncio, no torch, no clock. The coordinator asks three
questions here each time a window report arrives or a round completes:

* :func:`should_reduce` — the count-based gate: no round in flight, at least one alive
  rank, every alive rank reported this window (SYNC: at least one step; CADENCE/ASYNC: its
  planned quota) or has no planned data left (a "quiesced" tail rank), and some rank
  actually stepped (``any_mover``). Never wall-time based: a wall-time gate
  self-reinforces into deadlock (flodl replaced it for that reason).
* :func:`hold_after` — how far a rank may train past its quota before it holds.
* :data:`RULES` — the per-policy table (static slices, early per-rank dispatch, ElChe's
  dispatch and timing feed), read as data rather than branched on.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass


class Policy(enum.Enum):
    """WHEN to average."""

    SYNC = "sync"  # K = 1: reduce once every alive rank stepped since the last reduce
    CADENCE = "cadence"  # K = ElChe counts: the slow rank anchors, fast ranks do more
    ASYNC = "async"  # Cadence counts, bounded overshoot, EASGD blend on the rank


class Backend(enum.Enum):
    """HOW to average."""

    CPU = "cpu"  # ranks -> relay (per-host fold) -> controller reducer -> back
    # torch.distributed all_reduce in the ranks (NCCL on CUDA, gloo on CPU)
    COLLECTIVE = "collective"


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyRules:
    """What differs between the policies, as data (read by the coordinator, not branched on)."""

    #: Partitions: one static slice per rank per epoch (SYNC), or windows from a progressive pool.
    static_slices: bool
    #: The next plan goes to a rank as soon as its window report arrives (ASYNC), not with the
    #: Reduce.
    early_dispatch: bool
    #: ElChe dispatches and grows the anchor (SYNC only observes: it has no window).
    elche_dispatch: bool
    #: ElChe's timing feed: delivered cost (compute + data wait), or compute only (SYNC).
    delivered_timing: bool


RULES: Mapping[Policy, PolicyRules] = {
    Policy.SYNC: PolicyRules(
        static_slices=True,
        early_dispatch=False,
        elche_dispatch=False,
        delivered_timing=False,
    ),
    Policy.CADENCE: PolicyRules(
        static_slices=False,
        early_dispatch=False,
        elche_dispatch=True,
        delivered_timing=True,
    ),
    Policy.ASYNC: PolicyRules(
        static_slices=False,
        early_dispatch=True,
        elche_dispatch=True,
        delivered_timing=True,
    ),
}

#: Supported (policy, backend) pairs; the one refused, with what to use instead.
UNSUPPORTED: Mapping[tuple[Policy, Backend], str] = {
    (Policy.ASYNC, Backend.COLLECTIVE): (
        "(ASYNC, COLLECTIVE) is not a supported combination — bounded-lookahead async averaging "
        "needs the CPU backend "
        "(use CADENCE with COLLECTIVE, or ASYNC with CPU)"
    ),
}


def hold_after(
    policy: Policy, *, quota: int, max_batch_diff: int | None, max_overshoot: int
) -> int:
    """Steps since the rank's last contribution at which it holds (-1: never).

    SYNC: ``1 + max_batch_diff`` (0 is strict lockstep), or keep training the slice until the
    Reduce arrives; CADENCE: at its quota (held at the barrier); ASYNC: ``quota + max_overshoot``.
    """
    if policy is Policy.SYNC:
        return -1 if max_batch_diff is None else 1 + max_batch_diff
    if policy is Policy.CADENCE:
        return quota
    return quota + max_overshoot


@dataclass(frozen=True, slots=True, kw_only=True)
class GateRank:
    """One alive rank, as the gate sees it for the current window."""

    #: Its ``WindowDone`` for this window arrived.
    reported: bool
    #: Steps it reported for this window.
    steps: int
    #: Steps the gate needs from it: 1 under SYNC, its plan's quota under CADENCE/ASYNC.
    need: int
    #: It has no planned data left (a quota-0 plan, or its SYNC slice is exhausted).
    quiesced: bool


def should_reduce(*, in_flight: bool, ranks: Mapping[int, GateRank]) -> bool:
    """The count-based reduce gate over the *alive* ranks (dead ones are simply absent)."""
    if in_flight or not ranks:
        return False
    any_mover = False
    for view in ranks.values():
        done = view.reported and view.steps >= view.need
        if not (done or view.quiesced):
            return False
        any_mover = any_mover or (view.reported and view.steps > 0)
    return any_mover


def failure_limit(*, world_size: int, absolute: int | None, percent: float | None) -> int | None:
    """Dead ranks at which ``max_failure`` is breached (None: no limit)."""
    if absolute is not None:
        return absolute
    if percent is not None:
        return math.ceil(min(max(percent, 0.0), 1.0) * world_size)
    return None


def unrecoverable_reason(*, world_size: int, dead: int, limit: int | None) -> str | None:
    """Why the run cannot continue after ``dead`` ranks were lost, as a save reason; None: it can
    (the survivors train on).

    Both backends are elastic: the coordinator plans the next rounds for the survivors (a
    COLLECTIVE world's survivors first re-form their process group in place). ``limit``
    (:func:`failure_limit`) is breached when the dead reach it.
    """
    if dead <= 0:
        return None
    if dead >= world_size:
        return "all_ranks_lost"
    if limit is not None and dead >= limit:
        return "max_failure_exceeded"
    return None
