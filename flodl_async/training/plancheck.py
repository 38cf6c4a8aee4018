"""What a rank may claim about a round, checked against what the coordinator planned for it.

Theory of operation. A rank is believed about nothing it says of itself: its steps, its weight,
its window counts and timings, its tensors. Each receiving side checks what reaches it against the
plan, and a violation is a sentence naming the rank, which the shell feeds to the death chain (a
rank that lies is a rank that failed):

* the coordinator opens a round with a :class:`~flodl_async.wire.messages.RoundPlan`
  (:func:`round_plan`): the most steps each rank can have trained since its last contribution,
  and how a contribution's weight follows from its steps. It rides the round's ``Reduce``, so the
  relays see it on its way down and the reducer gets it with the round;
* a relay's host fold checks each rank's contribution (:func:`check_contribution`) before the
  barrier takes it, and its tensors (:func:`first_bad_tensor`) in the executor before folding
  them, so a host frame never carries a liar's work;
* the reducer checks each host frame's per-rank claims (:func:`check_host_claims`), and the
  tensors of a frame that one rank's bytes went into unfolded (:func:`tensor_owner`);
* the coordinator checks each ``WindowDone`` (:func:`check_window`).

The weight a contribution may carry follows from its steps, and its steps are capped by the
plan: no rank moves the consensus by more than the share the coordinator planned for it.

Pure: no asyncio, no sockets; torch only inside :func:`first_bad_tensor`, which callers run in an
executor thread (one pass over the tensors: ``aminmax``, which propagates NaN).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError, ProtocolError
from ..wire import messages as m
from ..wire.tensor import DTYPE_ITEMSIZE
from .foldmath import acc_dtype, check_specs, schema_specs
from .modelschema import FLOAT_DTYPES, ModelSchema
from .partition import Range, range_size

if TYPE_CHECKING:
    import torch

#: Round kinds whose consensus is the root's state alone (the lowest rank the round expects: a
#: COLLECTIVE world that lost its rank 0 uploads its next one's; the others contribute nothing).
ROOT_KINDS = frozenset({"init", "upload"})
#: A batch's compute (or data wait) longer than a day is not believed.
MAX_MS_PER_BATCH = 86_400_000.0
#: More ``record_scalar`` calls per name and batch than this are not believed.
MAX_RECORDS_PER_BATCH = 65_536
#: A weighted value this close to the accumulator's largest finite value would overflow the sum
#: of a few billion such terms: it is not a model's.
_HEADROOM = 2.0**32


@dataclass(frozen=True, slots=True, kw_only=True)
class Violation:
    """``rank`` broke the plan: ``reason`` is the sentence the log and the verdict carry."""

    rank: int
    reason: str


def count(n: int) -> str:
    """``n`` as the log says it: ``10^15`` for a power of ten past a million, else the digits."""
    magnitude = abs(n)
    if magnitude >= 10**6:
        exponent = len(str(magnitude)) - 1
        if magnitude == 10**exponent:
            return f"{'-' if n < 0 else ''}10^{exponent}"
        return f"{n:.3g}"
    return str(n)


# ----- the coordinator's side: the plan --------------------------------------------------------


def in_flight_batches(in_flight: Mapping[tuple[int, int], Sequence[Range]]) -> dict[int, int]:
    """Per rank, the batches of its windows not completed into a consensus yet
    (:meth:`~flodl_async.training.partition.ChunkPool.in_flight`, keyed ``(rank, round)``).

    CADENCE/ASYNC: a rank's contribution to round ``k`` carries the steps it trained since its
    contribution to ``k - 1``, and by then it had trained all of window ``k - 1`` (it reported
    it, and the reduce waits for the report), so they lie in windows ``>= k``: exactly the ones
    still in flight when round ``k`` opens.
    """
    out: dict[int, int] = {}
    for (rank, _round), ranges in in_flight.items():
        out[rank] = out.get(rank, 0) + range_size(ranges)
    return out


def sync_claimable(left: Mapping[int, int], reported: Mapping[int, int]) -> dict[int, int]:
    """SYNC, per rank: what is left unreported of its slice (``left``) plus what it reported since
    the last round opened (``reported``).

    The steps a rank contributes were trained after its previous contribution, which came after
    the previous round opened; each was reported since then, or not yet.
    """
    return {r: left.get(r, 0) + reported.get(r, 0) for r in {*left, *reported}}


def round_plan(
    *,
    world_size: int,
    expected: Iterable[int],
    claimable: Mapping[int, int],
    gamma: float,
    equal: bool,
) -> m.RoundPlan:
    """The plan of one round: ``claimable[r]`` steps for each expected rank, 0 for the others."""
    steps = [0] * world_size
    for rank in expected:
        steps[rank] = max(0, claimable.get(rank, 0))
    root = min(expected, default=0)
    return m.RoundPlan(steps=tuple(steps), gamma=gamma, equal=equal, root=root)


# ----- contributions -------------------------------------------------------------------------


def planned_weight(plan: m.RoundPlan, *, kind: str, rank: int, steps: int) -> float:
    """The weight rank ``rank``'s contribution of ``steps`` steps carries in a ``kind`` round.

    The same rule the ranks follow (:meth:`~flodl_async.training.schedule.RankPolicy.handle`'s
    contribution): the root alone in ``init`` and ``upload``, 1 each under ``equal``, else
    ``steps ** gamma`` with 0 steps weighing 0.
    """
    if kind in ROOT_KINDS:
        return 1.0 if rank == plan.root else 0.0
    if plan.equal:
        return 1.0
    return 0.0 if steps == 0 else float(steps) ** plan.gamma


def carries_tensors(kind: str, rank: int, *, root: int) -> bool:
    """Whether rank ``rank``'s contribution to a ``kind`` round rooted at ``root`` carries its
    tensors."""
    return rank == root if kind in ROOT_KINDS else True


def _claim(plan: m.RoundPlan, *, rank: int, round: int, steps: int) -> str | None:
    """Why ``steps`` is not a claim rank ``rank`` can make in round ``round``, or None."""
    if steps < 0:
        return (
            f"rank {rank} claimed {count(steps)} steps in round {round} (steps are never negative)"
        )
    planned = plan.steps[rank] if 0 <= rank < len(plan.steps) else 0
    if steps > planned:
        return (
            f"rank {rank} claimed {count(steps)} steps in a round planned for {count(planned)} "
            f"(round {round})"
        )
    return None


def contribution_layout(model: m.ModelSchemaWire) -> tuple[m.TensorSpec, ...] | None:
    """The tensors a rank whose ``TrainerHello`` carried ``model`` contributes (None for a schema
    the coordinator will refuse anyway).

    Each rank's contributions are judged against its own hello's model, which the coordinator
    holds to the run's: a rank whose frames disagree with it is the one that lies, whichever of
    a host's ranks contributes first."""
    try:
        schema = ModelSchema.from_wire(model)
    except ConfigError:
        return None
    if any(meta.dtype not in DTYPE_ITEMSIZE for meta in schema.tensors):
        return None
    return schema_specs(schema.tensors)[0]


def check_layout(
    msg: m.Contribution, layout: Sequence[m.TensorSpec], payload_len: int
) -> str | None:
    """Why ``msg``'s tensors are not ``layout`` packed in its ``payload_len`` bytes, or None."""
    if not msg.tensors:
        return None
    try:
        check_specs(
            msg.tensors,
            layout,
            payload_len,
            what=f"rank {msg.rank}'s contribution to round {msg.round}",
        )
    except ProtocolError as exc:
        return str(exc)
    return None


def check_contribution(msg: m.Contribution, plan: m.RoundPlan, *, kind: str) -> str | None:
    """Why rank contribution ``msg`` breaks ``plan`` for its ``kind`` round, or None (the relay).

    Its kind, its steps (never negative, never past the plan), whether it carries tensors, and
    its weight against what its steps give."""
    rank, round_ = msg.rank, msg.round
    if msg.kind != kind:
        return f"rank {rank} contributed to round {round_} as {msg.kind!r}; the round is {kind!r}"
    bad = _claim(plan, rank=rank, round=round_, steps=msg.steps)
    if bad is not None:
        return bad
    expect_tensors = carries_tensors(kind, rank, root=plan.root)
    if bool(msg.tensors) != expect_tensors:
        if expect_tensors:
            return f"rank {rank} sent no tensors to {kind} round {round_}"
        return f"rank {rank} sent tensors to {kind} round {round_}, which takes rank {plan.root}'s"
    want = planned_weight(plan, kind=kind, rank=rank, steps=msg.steps)
    if not _same_weight(msg.weight, want):
        return (
            f"rank {rank} weighted its contribution to round {round_} {msg.weight!r}, but its "
            f"{count(msg.steps)} steps give {want!r}"
        )
    return None


def check_host_claims(msg: m.HostContribution, plan: m.RoundPlan) -> Violation | None:
    """The first listed rank whose steps break ``plan`` in host frame ``msg``, or None (the
    reducer).

    Raises :class:`ProtocolError` for what no single rank did: steps that do not line up with
    the ranks, or a total weight the listed steps do not give (the relay's own sum)."""
    if len(msg.steps) != len(msg.ranks):
        raise ProtocolError(
            f"host {msg.host}'s frame for round {msg.round} lists {len(msg.ranks)} ranks but "
            f"{len(msg.steps)} step counts"
        )
    for rank, steps in zip(msg.ranks, msg.steps, strict=True):
        bad = _claim(plan, rank=rank, round=msg.round, steps=steps)
        if bad is not None:
            return Violation(rank=rank, reason=bad)
    want = 0.0
    for rank, steps in zip(msg.ranks, msg.steps, strict=True):
        want += planned_weight(plan, kind=msg.kind, rank=rank, steps=steps)
    if _same_weight(msg.weight, want):
        return None
    owner = tensor_owner(msg, root=plan.root)
    if owner is not None and len(msg.ranks) == 1:
        return Violation(
            rank=owner,
            reason=(
                f"rank {owner} weighted its contribution to round {msg.round} {msg.weight!r}, but "
                f"its {count(msg.steps[0])} steps give {want!r}"
            ),
        )
    raise ProtocolError(
        f"host {msg.host}'s frame for round {msg.round} weighs {msg.weight!r}, but its ranks' "
        f"steps {list(msg.steps)} give {want!r}"
    )


def tensor_owner(msg: m.HostContribution, *, root: int) -> int | None:
    """The rank whose own bytes a raw (not prescaled) host frame carries, or None when that is not
    one rank's: a root round's root, or the one rank a frame of another kind lists."""
    if msg.prescaled or not msg.tensors:
        return None
    if msg.kind in ROOT_KINDS:
        return root if root in msg.ranks else None
    return msg.ranks[0] if len(msg.ranks) == 1 else None


def _same_weight(got: float, want: float) -> bool:
    return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12)


# ----- tensors -------------------------------------------------------------------------------


def first_bad_tensor(
    specs: Sequence[m.TensorSpec], tensors: Sequence[torch.Tensor], weight: float | None
) -> tuple[str, str] | None:
    """``(what, tensor name)`` for the first tensor that holds a non-finite value, or one so large
    that ``weight`` times it would overflow the accumulator; None when all are sound.

    One pass per float tensor (``aminmax``, which returns NaN when any element is NaN); integer
    and bool tensors are always finite. ``weight=None``: the tensors are a prescaled sum already.
    Executor thread: imports torch.
    """
    import torch

    for spec, t in zip(specs, tensors, strict=True):
        if spec.dtype not in FLOAT_DTYPES or t.numel() == 0:
            continue
        low, high = (float(v) for v in torch.aminmax(t))
        if not (math.isfinite(low) and math.isfinite(high)):
            return "non-finite parameters", spec.name
        largest = max(abs(low), abs(high))
        limit = torch.finfo(getattr(torch, acc_dtype(spec.dtype))).max / _HEADROOM
        if largest * (1.0 if weight is None else weight) > limit:
            what = f"parameters of magnitude {largest:.3g}, which would overflow the average"
            return what, spec.name
    return None


def tensor_lie(rank: int, round: int, bad: tuple[str, str]) -> str:
    """The log's sentence for :func:`first_bad_tensor`'s finding in rank ``rank``'s tensors."""
    what, name = bad
    return f"rank {rank} sent {what} in round {round} (tensor {name!r})"


# ----- window reports ------------------------------------------------------------------------

#: windows a rank may report ahead of the coordinator's current round
REPORTS_AHEAD_LIMIT = 64


def window_out_of_place(
    report: m.WindowDone, *, current: int, again: bool, planned: bool
) -> str | None:
    """Why window report ``report`` is not taken at all (ignored with a warning), or None.

    Not a death: a slow honest rank sends a late report too. ``current``: the coordinator's round;
    ``again``: the rank already reported this window; ``planned``: it was planned this window (or
    under SYNC, any)."""
    rank, round_ = report.rank, report.round
    if round_ < current or again:
        return f"rank {rank} reported window {round_} again or too late; ignoring"
    if round_ > current + REPORTS_AHEAD_LIMIT:
        # A rank numbers its windows from the reduces it has seen, so it is never more than a round
        # or two ahead; anything further is a broken peer, and keeping its reports would grow
        # without bound.
        return f"rank {rank} reported window {round_}, far ahead of round {current}; ignoring"
    if not planned:
        return f"rank {rank} reported window {round_}, which it was never planned; ignoring"
    return None


def check_window(report: m.WindowDone, *, planned: int, epoch: int, batch_size: int) -> str | None:
    """Why window report ``report`` breaks its plan, or None (the coordinator).

    ``planned``: the most batches the window can hold (its plan's, or under SYNC what is left
    unreported of the rank's slice); ``epoch``: the epoch the plan is of; ``batch_size``: the most
    samples a batch holds. Counts are never negative or past the plan, timings and sums finite
    and in range."""
    rank, round_, batches = report.rank, report.round, report.batches
    where = f"window {round_}"
    if report.epoch != epoch:
        return (
            f"rank {rank} reported {where} as epoch {report.epoch}; it was planned in epoch {epoch}"
        )
    if batches < 0:
        return (
            f"rank {rank} reported {count(batches)} batches for {where} (counts are never negative)"
        )
    if batches > planned:
        return (
            f"rank {rank} reported {count(batches)} batches for {where}, planned for "
            f"{count(planned)}"
        )
    if not 0 <= report.samples <= batches * batch_size:
        return (
            f"rank {rank} reported {count(report.samples)} samples for {where}: its "
            f"{batches} batches of at most {batch_size} hold {batches * batch_size}"
        )
    most_ms = max(batches, 1) * MAX_MS_PER_BATCH
    for name, value in (("compute_ms", report.compute_ms), ("data_ms", report.data_ms)):
        if not (math.isfinite(value) and 0 <= value <= most_ms):
            return f"rank {rank} reported {name}={value!r} for {where} of {batches} batches"
    if not math.isfinite(report.loss_sum):
        return f"rank {rank} reported a loss sum of {report.loss_sum!r} for {where}"
    divergence = report.divergence
    if not (math.isfinite(divergence) and (divergence >= 0 or divergence == -1.0)):
        return f"rank {rank} reported a divergence of {divergence!r} for {where}"
    most_records = batches * MAX_RECORDS_PER_BATCH
    for name, records in report.scalar_counts.items():
        if not 0 <= records <= most_records:
            return (
                f"rank {rank} reported {count(records)} records of scalar {name!r} for {where} "
                f"of {batches} batches"
            )
    for name, total in report.scalar_sums.items():
        if not math.isfinite(total):
            return f"rank {rank} reported scalar {name!r} summing to {total!r} for {where}"
    return None
