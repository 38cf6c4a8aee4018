"""The rank side of the coordinator protocol against a scripted coordinator, in one process.

The link is a stand-in for the link thread (the same inbox, the same calls); the compute side is
real: a real model trains real batches on the managed loop. What is asserted is the rank's half of
the protocol: when it reports windows, when it holds, what it contributes with what weight, what it
does with a consensus, and that every planned batch is trained exactly once.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import flodl_async as fa
from flodl_async.deadlines import Deadlines
from flodl_async.errors import TrainingStopped
from flodl_async.trainer.schedule import RankSchedule
from flodl_async.trainer.worker import Compute, run_managed
from flodl_async.training.modelschema import ModelSchema
from flodl_async.wire import messages as m
from flodl_async.wire.schema import Message

from .scripts import trainer_mlp as mlp


@dataclass
class Result:
    round: int
    kind: str
    mass: float
    tensors: dict[str, torch.Tensor] | None


@dataclass
class ScriptedLink:
    """What RankSchedule uses of the link thread; ``coordinator`` answers each message like the real one would."""

    coordinator: Callable[[ScriptedLink, Any], None]
    rank: int = 0
    inbox: queue.Queue[Any] = field(default_factory=queue.Queue)
    up: list[Message] = field(default_factory=list)
    contributions: list[tuple[int, str, int, float, bool]] = field(default_factory=list)
    pending: list[tuple[concurrent.futures.Future[Result], Result]] = field(default_factory=list)
    closed: list[m.Exiting | None] = field(default_factory=list)
    defer: bool = False

    def send(self, msg: Message) -> None:
        self.up.append(msg)
        self.coordinator(self, msg)

    def contribute(
        self,
        round_: int,
        kind: str,
        tensors: dict[str, torch.Tensor] | None,
        steps: int,
        weight: float,
    ) -> concurrent.futures.Future[Result]:
        self.contributions.append((round_, kind, steps, weight, tensors is not None))
        future: concurrent.futures.Future[Result] = concurrent.futures.Future()
        # The consensus: the contribution itself, halved (so applying it is visible), mass = weight.
        result = Result(
            round_,
            kind,
            weight,
            None if tensors is None else {k: v.clone() * 0.5 for k, v in tensors.items()},
        )
        if self.defer and kind == "model":
            self.pending.append((future, result))
        else:
            future.set_result(result)
        self.coordinator(self, ("contributed", round_, kind))
        return future

    def receive(self, round_: int) -> concurrent.futures.Future[Result]:
        self.contributions.append((round_, "received", 0, 0.0, False))
        future: concurrent.futures.Future[Result] = concurrent.futures.Future()
        future.set_result(Result(round_, "final", 0.0, None))
        self.coordinator(self, ("contributed", round_, "final"))
        return future

    def close(self, farewell: m.Exiting | None) -> None:
        self.closed.append(farewell)

    def push(self, *msgs: Message) -> None:
        for msg in msgs:
            self.inbox.put(msg)


N_BATCHES = 16  # 512 samples / 32


def plan(
    round_: int, first: int, n: int, *, hold_after: int, quota: int | None = None, epoch: int = 0
) -> m.Plan:
    quota = n if quota is None else quota
    return m.Plan(
        rank=0,
        round=round_,
        epoch=epoch,
        ranges=((first, n),),
        quota=quota,
        hold_after=hold_after,
        progress=first / N_BATCHES,
    )


def trained_batches(compute: Compute) -> list[tuple[int, int]]:
    return compute.trained  # type: ignore[attr-defined,no-any-return]


def run_rank(
    policy: fa.Policy, link: ScriptedLink, **trainer_kw: Any
) -> tuple[Compute, RankSchedule, dict[str, Any]]:
    trainer = fa.Trainer(
        model=mlp.model,
        optimizer=mlp.optimizer,
        train_step=mlp.mse,
        dataset=mlp.dataset(),
        batch_size=32,
        epochs=1,
        policy=policy,
        **trainer_kw,
    )
    compute = Compute(trainer.compute_config(), torch.device("cpu"))
    seen: list[tuple[int, int]] = []
    original = compute.load

    def load(epoch: int, batch: int) -> Any:
        seen.append((epoch, batch))
        return original(epoch, batch)

    compute.load = load  # type: ignore[method-assign]
    compute.trained = seen  # type: ignore[attr-defined]
    schema = ModelSchema.from_module(compute.model)
    welcome = m.TrainerWelcome(rank=0, world_size=1, run_id="t")
    schedule = RankSchedule(
        compute,
        link,  # type: ignore[arg-type]
        welcome=welcome,
        spec=trainer.spec(),
        schema=schema,
        publish=lambda _m: None,
        reduce_deadline=Deadlines.resolve().reduce_stall,
    )
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out.update(run_managed(compute, schedule))
        except Exception as exc:  # asserted by the caller
            out["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    return compute, schedule, out


def windows(link: ScriptedLink) -> list[tuple[int, int]]:
    return [(msg.round, msg.batches) for msg in link.up if isinstance(msg, m.WindowDone)]


def cadence_coordinator(windows_of: list[int]) -> Callable[[ScriptedLink, Any], None]:
    """Windows of the given sizes over one epoch; the final round from the controller, then Shutdown."""
    starts = [sum(windows_of[:i]) for i in range(len(windows_of))]

    def respond(link: ScriptedLink, msg: Any) -> None:
        if isinstance(msg, m.WindowDone):
            k = msg.round
            if k < len(windows_of):
                link.push(
                    m.Reduce(round=k, kind="model"),
                    plan(k + 1, starts[k], windows_of[k], hold_after=windows_of[k]),
                )
            else:
                link.push(
                    m.Reduce(round=k, kind="model"),
                    m.Reduce(round=k + 1, kind="final", from_controller=True),
                )
        elif msg == ("contributed", len(windows_of) + 1, "final"):
            link.push(m.Shutdown(reason="training complete", save_reason="completed"))

    return respond


def test_cadence_trains_each_window_then_holds_and_contributes_its_steps() -> None:
    sizes = [4, 4, 8]
    link = ScriptedLink(cadence_coordinator(sizes))
    link.push(m.Reduce(round=0, kind="init"), plan(1, 0, 4, hold_after=4))
    compute, _schedule, out = run_rank(fa.Policy.CADENCE, link)
    # init: rank 0 is the root, weight 1; then each window's steps ** gamma (1.0)
    assert link.contributions[0] == (0, "init", 0, 1.0, True)
    assert [c[:4] for c in link.contributions[1:]] == [
        (1, "model", 4, 4.0),
        (2, "model", 4, 4.0),
        (3, "model", 8, 8.0),
        (4, "received", 0, 0.0),
    ]
    assert windows(link) == [(1, 4), (2, 4), (3, 8)]
    assert sorted(b for _e, b in trained_batches(compute)) == list(
        range(16)
    )  # every planned batch once
    assert out["state_dict"].keys() == compute.model.state_dict().keys()
    assert isinstance(link.closed, list)


def test_sync_reports_after_one_step_keeps_training_until_the_reduce_and_covers_the_slice() -> None:
    reported = [0]

    def respond(link: ScriptedLink, msg: Any) -> None:
        if isinstance(msg, m.WindowDone):
            reported[0] += msg.batches
            link.push(m.Reduce(round=msg.round, kind="model"))
            if (
                reported[0] == N_BATCHES
            ):  # the slice is covered: the natural end, from the controller's consensus
                link.push(m.Reduce(round=msg.round + 1, kind="final", from_controller=True))
        elif isinstance(msg, tuple) and msg[2] == "final":
            link.push(m.Shutdown(reason="training complete", save_reason="completed"))

    link = ScriptedLink(respond)
    link.push(m.Reduce(round=0, kind="init"), plan(1, 0, 16, quota=1, hold_after=-1))
    compute, _s, _out = run_rank(fa.Policy.SYNC, link)
    assert windows(link) == [
        (k, 1) for k in range(1, 17)
    ]  # the reduce is there by the next step: lockstep here
    model_rounds = [c for c in link.contributions if c[1] == "model"]
    assert [(c[0], c[2]) for c in model_rounds] == [(k, 1) for k in range(1, 17)]
    assert sorted(b for _e, b in trained_batches(compute)) == list(range(16))


def test_a_consensus_is_adopted_and_zero_mass_keeps_the_local_state() -> None:
    link = ScriptedLink(cadence_coordinator([16]))
    link.push(m.Reduce(round=0, kind="init"), plan(1, 0, 16, hold_after=16))
    compute, _s, out = run_rank(fa.Policy.CADENCE, link)
    # The last model consensus was the contribution halved; the final round (mass 0) kept it.
    before_final = out["state_dict"]
    assert link.contributions[-1][1:4] == ("received", 0, 0.0)
    for name, tensor in compute.model.state_dict().items():
        assert torch.equal(tensor, before_final[name])


def test_async_submits_without_blocking_and_blends_the_consensus() -> None:
    def respond(link: ScriptedLink, msg: Any) -> None:
        if isinstance(msg, m.WindowDone):
            k = msg.round
            for (
                future,
                result,
            ) in link.pending:  # the previous round's consensus comes back a window late
                future.set_result(result)
            link.pending.clear()
            if k < 4:
                link.push(plan(k + 1, 4 * k, 4, hold_after=4 + 3), m.Reduce(round=k, kind="model"))
            else:
                link.defer = False  # the last model round completes before the final one (the reducer's order)
                link.push(m.Reduce(round=k, kind="model"), m.Reduce(round=k + 1, kind="final"))
        elif isinstance(msg, tuple) and msg[2] == "final":
            link.push(m.Shutdown(reason="training complete", save_reason="completed"))

    link = ScriptedLink(respond, defer=True)
    link.push(m.Reduce(round=0, kind="init"), plan(1, 0, 4, hold_after=7))
    compute, _s, _out = run_rank(fa.Policy.ASYNC, link)
    # Rounds 1-3 were submitted and training went on: the consensus of round k came back only after window k+1.
    assert [c[1:3] for c in link.contributions[1:5]] == [("model", 4)] * 4
    assert windows(link) == [(1, 4), (2, 4), (3, 4), (4, 4)]
    final = link.contributions[-1]
    assert final[1:5] == ("final", 0, 1.0, True)  # ASYNC's final round: every rank weighs 1
    assert sorted(b for _e, b in trained_batches(compute)) == list(range(16))


def test_a_failure_shutdown_stops_the_rank() -> None:
    def respond(link: ScriptedLink, msg: Any) -> None:
        if isinstance(msg, m.WindowDone):
            link.push(m.Shutdown(reason="rank 1 lost: killed", save_reason="all_ranks_lost"))

    link = ScriptedLink(respond)
    link.push(m.Reduce(round=0, kind="init"), plan(1, 0, 4, hold_after=4))
    _c, _s, out = run_rank(fa.Policy.CADENCE, link)
    assert isinstance(out["error"], TrainingStopped)
    exiting = link.closed[-1]
    assert exiting is not None
    assert "TrainingStopped" in exiting.reason
    assert "rank 1 lost" in exiting.error
