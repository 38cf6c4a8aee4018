"""The pure round gate: which round a frame goes to, and whether it may join it (no sockets)."""

from __future__ import annotations

import math

import pytest

from flodl_async.errors import ProtocolError
from flodl_async.training import foldmath
from flodl_async.training.foldround import FoldRound, Refusal, Refused
from flodl_async.training.roundgate import (
    RoundGate,
    Route,
    check_host_frame,
    check_rank_contribution,
)
from flodl_async.wire import messages as m

# ----- RoundGate --------------------------------------------------------------------------------


def test_a_frame_for_an_open_round_joins_it() -> None:
    gate: RoundGate[str] = RoundGate(early_rounds=2)
    assert gate.open(0) == []
    assert gate.route(0, [0, 1], "host a", "frame") is Route.OPEN


def test_frames_held_for_a_round_come_back_in_arrival_order_when_it_opens() -> None:
    gate: RoundGate[str] = RoundGate(early_rounds=2)
    assert gate.route(1, [2], "b", "from b") is Route.HELD
    assert gate.route(1, [0], "a", "from a") is Route.HELD
    assert gate.open(1) == ["from b", "from a"]
    assert gate.open(2) == []  # nothing was held for it


def test_a_host_may_run_early_rounds_ahead_of_the_newest_opened_round() -> None:
    gate: RoundGate[str] = RoundGate(early_rounds=2)
    gate.open(3)
    assert gate.route(4, [0], "a", "x") is Route.HELD
    assert gate.route(5, [0], "a", "y") is Route.HELD
    with pytest.raises(ProtocolError, match=r"^round 6 was never opened \(newest: 3\)$"):
        gate.route(6, [0], "a", "z")


def test_before_any_round_opened_only_the_early_window_from_round_zero_is_held() -> None:
    gate: RoundGate[str] = RoundGate(early_rounds=2)
    assert gate.route(0, [0], "a", "x") is Route.HELD
    assert gate.route(1, [0], "a", "y") is Route.HELD
    with pytest.raises(ProtocolError, match=r"never opened \(newest: -1\)"):
        gate.route(2, [0], "a", "z")


def test_a_round_below_the_newest_that_never_opened_is_refused() -> None:
    gate: RoundGate[str] = RoundGate(early_rounds=2)
    gate.open(3)
    with pytest.raises(ProtocolError, match=r"^round 2 was never opened \(newest: 3\)$"):
        gate.route(2, [0], "a", "x")
    with pytest.raises(ProtocolError, match="never opened"):
        gate.route(0, [0], "a", "x")


def test_the_newest_round_only_grows() -> None:
    gate: RoundGate[str] = RoundGate(early_rounds=1)
    gate.open(5)
    gate.open(2)  # opened late: the window still counts from 5
    assert gate.route(6, [0], "a", "x") is Route.HELD
    with pytest.raises(ProtocolError, match=r"newest: 5"):
        gate.route(7, [0], "a", "x")


def test_one_frame_per_host_waits_for_a_round() -> None:
    gate: RoundGate[str] = RoundGate(early_rounds=2)
    host_a, twin = ["a"], ["a"]  # equal, but another host's connection
    assert gate.route(0, [0], host_a, "x") is Route.HELD
    assert gate.route(0, [1], twin, "y") is Route.HELD
    with pytest.raises(ProtocolError, match=r"^two frames for round 0 before it opened$"):
        gate.route(0, [0], host_a, "z")
    assert gate.open(0) == ["x", "y"]


def test_opening_a_round_twice_is_a_caller_bug() -> None:
    gate: RoundGate[str] = RoundGate(early_rounds=2)
    gate.open(0)
    with pytest.raises(ValueError, match=r"^round 0 was already opened$"):
        gate.open(0)
    gate.complete(0)
    with pytest.raises(ValueError, match="already opened"):
        gate.open(0)


def test_a_late_frame_for_a_completed_round_is_refused_unless_all_its_ranks_died() -> None:
    gate: RoundGate[str] = RoundGate(early_rounds=2)
    gate.open(0)
    gate.complete(0)
    with pytest.raises(
        ProtocolError, match=r"^round 0 is already complete; ranks \[1, 2\] sent to it late$"
    ):
        gate.route(0, (1, 2), "a", "x")
    gate.declare_dead(1)
    with pytest.raises(ProtocolError, match="late"):
        gate.route(0, (1, 2), "a", "x")  # rank 2 is alive: it had no business sending late
    gate.declare_dead(2)
    assert gate.route(0, (1, 2), "a", "x") is Route.DROPPED


def test_the_dead_are_remembered_for_rounds_that_open_later() -> None:
    gate: RoundGate[str] = RoundGate(early_rounds=2)
    assert gate.dead == frozenset()
    gate.declare_dead(3)
    gate.declare_dead(1)
    assert gate.dead == {1, 3}
    assert isinstance(gate.dead, frozenset)


def test_completing_a_round_closes_it() -> None:
    gate: RoundGate[str] = RoundGate(early_rounds=2)
    gate.open(0)
    gate.open(1)
    gate.complete(0)
    assert gate.route(1, [0], "a", "x") is Route.OPEN
    with pytest.raises(ProtocolError, match="already complete"):
        gate.route(0, [0], "a", "x")


# ----- check_host_frame -------------------------------------------------------------------------

SPECS, MODEL_LEN = foldmath.packed_specs([("w", "float16", (2,)), ("b", "int64", (1,))])
ACC_SPECS, ACC_LEN = foldmath.acc_specs(SPECS)
WHAT = "host a's frame for round 4"


def host_frame(
    *,
    kind: str = "model",
    ranks: tuple[int, ...] = (0, 1),
    weight: float = 2.0,
    steps: tuple[int, ...] = (1, 1),
    tensors: tuple[m.TensorSpec, ...] = SPECS,
    prescaled: bool = False,
) -> m.HostContribution:
    return m.HostContribution(
        round=4,
        kind=kind,
        host="a",
        ranks=ranks,
        weight=weight,
        prescaled=prescaled,
        tensors=tensors,
        steps=steps,
    )


def check(
    msg: m.HostContribution,
    *,
    kind: str = "model",
    takes: bool = True,
    refusal: Refusal | None = None,
    gamma: float = 1.0,
    payload_len: int = MODEL_LEN,
) -> None:
    check_host_frame(
        msg,
        what=WHAT,
        kind=kind,
        takes_contributions=takes,
        refusal=refusal,
        gamma=gamma,
        specs=SPECS,
        acc_specs=ACC_SPECS,
        payload_len=payload_len,
    )


def test_a_well_formed_host_frame_passes() -> None:
    check(host_frame())
    check(host_frame(prescaled=True, tensors=ACC_SPECS), payload_len=ACC_LEN)


def test_a_round_whose_consensus_the_controller_sends_takes_no_frame() -> None:
    with pytest.raises(
        ProtocolError,
        match=r"^host a's frame for round 4: round 4 takes no contributions \(the controller "
        r"sends its consensus\)$",
    ):
        check(host_frame(kind="init"), kind="other", takes=False)


def test_a_frame_of_another_kind_is_refused() -> None:
    with pytest.raises(
        ProtocolError, match=r"^host a's frame for round 4 is a 'init' contribution; the round is "
    ):
        check(host_frame(kind="init"))


@pytest.mark.parametrize(
    ("refusal", "text"),
    [
        (Refusal(reason=Refused.NO_RANKS), "host a's frame for round 4 lists no ranks"),
        (
            Refusal(reason=Refused.TWICE, rank=1),
            "host a's frame for round 4 lists rank 1, which is already covered in this round "
            "(each rank contributes exactly once)",
        ),
        (
            Refusal(reason=Refused.UNEXPECTED, rank=7),
            "host a's frame for round 4 lists rank 7, which round 4 does not expect",
        ),
    ],
)
def test_the_barriers_refusal_is_said_in_the_frames_terms(refusal: Refusal, text: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        check(host_frame(weight=math.nan), refusal=refusal)  # the refusal is said first
    assert str(caught.value) == text


@pytest.mark.parametrize("weight", [-1.0, math.inf, math.nan])
def test_a_weight_must_be_finite_and_not_negative(weight: float) -> None:
    with pytest.raises(ProtocolError, match=r"has weight .*; weights are finite and >= 0$"):
        check(host_frame(weight=weight, kind="init"), kind="init")


def test_a_model_frames_weight_is_its_ranks_steps_to_the_gamma() -> None:
    check(host_frame(weight=2.0**0.5 + 3.0**0.5, steps=(2, 3)), gamma=0.5)
    check(host_frame(weight=1.0, steps=(0, 1)), gamma=0.0)  # 0 steps weigh 0, even ** 0
    check(host_frame(weight=0.0, tensors=(), steps=(0, 0)), payload_len=0)
    with pytest.raises(
        ProtocolError,
        match=r"^host a's frame for round 4 weighs 2\.0, but its ranks' steps \[2, 3\] \*\* "
        r"gamma 0\.5 give 3\.14",
    ):
        check(host_frame(weight=2.0, steps=(2, 3)), gamma=0.5)


def test_the_weight_check_tolerates_rounding_only() -> None:
    want = 2.0**0.5 + 3.0**0.5
    check(host_frame(weight=want * (1 + 1e-10), steps=(2, 3)), gamma=0.5)
    with pytest.raises(ProtocolError, match="weighs"):
        check(host_frame(weight=want * (1 + 1e-8), steps=(2, 3)), gamma=0.5)
    with pytest.raises(ProtocolError, match="weighs"):
        check(host_frame(weight=1e-11, steps=(0, 0)))
    check(host_frame(weight=1e-13, steps=(0, 0)))


def test_the_weight_is_not_checked_without_every_ranks_steps_or_outside_model_rounds() -> None:
    check(host_frame(weight=5.0, steps=(1,)))  # an older peer: fewer steps than ranks
    check(host_frame(kind="buffers", weight=5.0), kind="buffers")


def test_the_tensors_must_be_the_models_in_the_frames_layout() -> None:
    with pytest.raises(ProtocolError, match=r"^host a's frame for round 4: tensor 0 is"):
        check(host_frame(prescaled=True), payload_len=ACC_LEN)  # plain specs, said prescaled
    with pytest.raises(ProtocolError, match="claims bytes"):
        check(host_frame(), payload_len=MODEL_LEN - 1)


def test_a_frame_without_tensors_weighs_nothing_and_carries_nothing() -> None:
    check(host_frame(kind="init", weight=0.0, tensors=()), kind="init", payload_len=0)
    text = (
        r"^host a's frame for round 4 carries no tensors, so it must weigh 0 and have no payload$"
    )
    with pytest.raises(ProtocolError, match=text):
        check(host_frame(kind="init", weight=1.0, tensors=()), kind="init", payload_len=0)
    with pytest.raises(ProtocolError, match=text):
        check(host_frame(kind="init", weight=0.0, tensors=()), kind="init", payload_len=1)


# ----- check_rank_contribution ------------------------------------------------------------------

RAW, RAW_LEN = foldmath.packed_specs([("w", "float32", (3,))])


def contribution(
    *, kind: str = "model", weight: float = 1.0, tensors: tuple[m.TensorSpec, ...] = RAW
) -> m.Contribution:
    return m.Contribution(round=4, kind=kind, rank=2, weight=weight, steps=1, tensors=tensors)


def rank_check(
    msg: m.Contribution,
    *,
    kind: str = "model",
    refusal: Refusal | None = None,
    layout: tuple[m.TensorSpec, ...] | None = None,
    payload_len: int = RAW_LEN,
) -> tuple[m.TensorSpec, ...] | None:
    return check_rank_contribution(
        msg, kind=kind, refusal=refusal, layout=layout, payload_len=payload_len
    )


def test_the_first_contribution_with_tensors_sets_the_rounds_layout() -> None:
    assert rank_check(contribution()) == RAW
    assert rank_check(contribution(), layout=RAW) == RAW


def test_the_first_contributions_layout_is_the_packed_one() -> None:
    # a sender's own offsets do not become the reference: every later frame is packed
    shifted = (m.TensorSpec(name="w", dtype="float32", shape=(3,), offset=4, nbytes=12),)
    assert rank_check(contribution(tensors=shifted), payload_len=16) == RAW


def test_later_contributions_must_match_the_first() -> None:
    other, other_len = foldmath.packed_specs([("w", "float32", (4,))])
    with pytest.raises(
        ProtocolError, match=r"^rank 2's contribution to round 4: tensor 0 is 'w' \(float32, shape"
    ):
        rank_check(contribution(tensors=other), layout=RAW, payload_len=other_len)
    with pytest.raises(ProtocolError, match="claims bytes"):
        rank_check(contribution(), payload_len=RAW_LEN - 1)


def test_an_empty_contribution_keeps_the_layout_and_weighs_nothing() -> None:
    assert rank_check(contribution(weight=0.0, tensors=()), payload_len=0) is None
    assert rank_check(contribution(weight=0.0, tensors=()), layout=RAW, payload_len=0) == RAW
    text = r"^rank 2: an empty contribution to round 4 must have weight 0 and no payload$"
    with pytest.raises(ProtocolError, match=text):
        rank_check(contribution(weight=1.0, tensors=()), payload_len=0)
    with pytest.raises(ProtocolError, match=text):
        rank_check(contribution(weight=0.0, tensors=()), payload_len=1)


def test_a_contribution_of_another_kind_than_the_hosts_other_ranks_is_refused() -> None:
    with pytest.raises(
        ProtocolError,
        match=r"^rank 2 contributed to round 4 as 'init', the host's other ranks as 'model'$",
    ):
        rank_check(contribution(kind="init"))


def test_the_barriers_refusal_of_a_rank_is_said_in_the_ranks_terms() -> None:
    with pytest.raises(ProtocolError, match=r"^rank 2 contributed twice to round 4$"):
        rank_check(contribution(), refusal=Refusal(reason=Refused.TWICE, rank=2))
    with pytest.raises(ProtocolError, match=r"^rank 2 does not run on this host$"):
        rank_check(contribution(), refusal=Refusal(reason=Refused.UNEXPECTED, rank=2))


@pytest.mark.parametrize("weight", [-0.5, math.inf, math.nan])
def test_a_ranks_weight_must_be_finite_and_not_negative(weight: float) -> None:
    with pytest.raises(
        ProtocolError,
        match=r"^rank 2 contributed to round 4 with weight .*; weights are finite and >= 0$",
    ):
        rank_check(contribution(weight=weight))
    rank_check(contribution(weight=0.0))


def test_the_gate_and_the_barrier_together_refuse_a_second_frame_from_a_rank() -> None:
    barrier: FoldRound[str] = FoldRound({0, 1, 2})
    barrier.offer([2], "first")
    with pytest.raises(ProtocolError, match="twice"):
        rank_check(contribution(), refusal=barrier.refusal([2]))
