"""The Trainer in one process (INLINE): construction validates, training converges, the handle behaves."""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import pytest
import torch
from torch import nn

import flodl_async as fa
from flodl_async.errors import ConfigError, TrainingFailed
from flodl_async.trainer.api import _LIVE_RUNS
from flodl_async.trainer.worker import fetch_batch

from .scripts import trainer_mlp as mlp


def trainer(**kw: Any) -> fa.Trainer:
    args: dict[str, Any] = {
        "model": mlp.model,
        "optimizer": mlp.optimizer,
        "train_step": mlp.mse,
        "dataset": mlp.dataset(),
        "batch_size": 32,
        "epochs": 3,
    }
    args.update(kw)
    return fa.Trainer(**args)


@pytest.fixture(autouse=True)
def _inline_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "FLODL_INTERNAL_CLUSTER_SPEC",
        "FLODL_INTERNAL_AGENT_SPEC",
        "FLODL_INTERNAL_RANK_SPEC",
        "FLODL_INTERNAL_LOCAL_RANK",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


# ----- construction ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "names"),
    [
        ({"model": 3}, ["model=", "model(device)"]),
        ({"optimizer": None}, ["optimizer=", "optimizer(model)"]),
        ({"train_step": "x"}, ["train_step="]),
        ({"dataset": iter(range(3))}, ["dataset=", "map-style"]),
        ({"dataset": []}, ["dataset=", "empty"]),
        ({"batch_size": 0}, ["batch_size=", "at least 1"]),
        ({"batch_size": 1000}, ["batch_size=1000", "drop_last=False"]),
        ({"epochs": 1.5}, ["epochs=", "whole number"]),
        ({"policy": "sync"}, ["policy=", "fa.Policy"]),
        ({"backend": "cpu"}, ["backend=", "fa.Backend"]),
        (
            {"policy": fa.Policy.ASYNC, "backend": fa.Backend.COLLECTIVE},
            ["(ASYNC, COLLECTIVE)", "use CADENCE with COLLECTIVE"],
        ),
        ({"elche": fa.ElCheConfig(partition_ratios=(0.5, 0.5))}, ["partition_ratios", "SYNC only"]),
        (
            {"policy": fa.Policy.SYNC, "elche": fa.ElCheConfig(easgd_alpha=0.5)},
            ["easgd_alpha", "ASYNC only"],
        ),
        ({"elche": fa.ElCheConfig(max_overshoot=2)}, ["max_overshoot", "ASYNC only"]),
        ({"outer": "slowmo"}, ["outer=", "fa.SlowMo"]),
        ({"max_failure": 0}, ["max_failure=0", "at least 1"]),
        ({"max_failure": 1.5}, ["max_failure=1.5", "fraction"]),
        ({"cluster": 3}, ["cluster=", "ClusterSpec"]),
        ({"rank_command": "python x.py"}, ["rank_command=", "list of strings"]),
        ({"seed": -1}, ["seed="]),
        ({"max_grad_norm": 0.0}, ["max_grad_norm="]),
        ({"heartbeat_timeout": float("inf")}, ["heartbeat_timeout="]),
    ],
)
def test_each_bad_argument_is_named_with_what_to_do(kw: dict[str, Any], names: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        trainer(**kw)
    for name in names:
        assert name in str(info.value)


def test_construction_is_pure_and_the_entry_is_inline_here() -> None:
    called: list[str] = []
    t = trainer(model=lambda d: called.append("model"), optimizer=lambda m: called.append("opt"))
    assert called == []
    assert t.entry is fa.Entry.INLINE
    assert trainer(cluster="c.yml").entry is fa.Entry.LAUNCHER
    assert trainer(max_failure=2).max_failure == fa.MaxFailure(absolute=2)
    assert trainer(max_failure=0.25).max_failure == fa.MaxFailure(percent=0.25)


# ----- batches --------------------------------------------------------------------------------


class Batched(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("__getitems__ is there: one call per batch")

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self.calls.append(indices)
        return [(torch.tensor([float(i)]), torch.tensor([2.0 * i])) for i in indices]


def test_a_batch_is_one_getitems_call_when_the_dataset_has_it() -> None:
    from torch.utils.data import default_collate

    ds = Batched()
    x, y = fetch_batch(ds, [3, 1], default_collate)
    assert ds.calls == [[3, 1]]
    assert x.tolist() == [[3.0], [1.0]]
    assert y.tolist() == [[6.0], [2.0]]
    plain = [(torch.tensor([float(i)]),) for i in range(4)]
    (only,) = fetch_batch(plain, [2, 0], default_collate)
    assert only.tolist() == [[2.0], [0.0]]


# ----- training -------------------------------------------------------------------------------


def test_inline_converges_and_reports_every_epoch_once() -> None:
    async def main() -> tuple[fa.TrainedState, list[fa.EpochMetrics]]:
        run = trainer(epochs=4).start()
        seen = [m async for m in run.metrics()]
        assert await run.next_metrics() is None
        assert run.poll_metrics() == []
        return await run.join(), seen

    state, seen = asyncio.run(main())
    assert [m.epoch for m in seen] == [1, 2, 3, 4]
    assert all(
        m.batches == 16 and m.samples == 512 and m.per_rank[0].batch_share == 1.0 for m in seen
    )
    assert seen[-1].avg_loss < 0.05 * seen[0].avg_loss
    assert (
        state.primary,
        state.world_size,
        state.epochs_completed,
        state.global_step,
        state.interrupted,
    ) == (True, 1, 4, 64, False)
    fresh = mlp.model(torch.device("cpu"))
    state.load_into(fresh)
    x, y = mlp.dataset().tensors
    assert nn.functional.mse_loss(fresh(x), y).item() < 2 * seen[-1].avg_loss
    assert set(state.param_names) <= set(state.state_dict)


def test_the_cooperative_worker_trains_the_same_as_the_managed_loop() -> None:
    managed = asyncio.run(trainer().run())
    with trainer().worker() as w:
        for _plan in w.plans():
            for batch in w.batches():
                loss = mlp.mse(w.model, batch)
                loss.backward()
                w.step(loss)
        state = w.finish()
        metrics = w.poll_metrics()
    assert [m.epoch for m in metrics] == [1, 2, 3]
    assert state.epochs_completed == 3
    for name, tensor in managed.state_dict.items():
        assert torch.equal(tensor, state.state_dict[name]), name


def _raising_loop() -> None:
    with trainer().worker() as w:
        for _plan in w.plans():
            for _batch in w.batches():
                raise RuntimeError("boom")


def _loop_without_step() -> None:
    with trainer().worker() as w:
        for _plan in w.plans():
            for _batch in w.batches():
                pass


def test_a_worker_loop_that_raises_re_raises_and_a_skipped_step_is_named() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        _raising_loop()
    with pytest.raises(ConfigError, match="step"):
        _loop_without_step()


def test_a_failing_train_step_fails_the_run_with_its_cause() -> None:
    def bad(m: nn.Module, batch: Any) -> torch.Tensor:
        raise ValueError("bad batch")

    with pytest.raises(TrainingFailed) as info:
        asyncio.run(trainer(train_step=bad).run())
    assert "bad batch" in info.value.result.reason
    assert isinstance(info.value.__cause__, ValueError)


def test_dropping_the_handle_does_not_cancel_the_run() -> None:
    async def main() -> fa.TrainedState:
        run = trainer(epochs=2).start()
        task = run._task
        del run
        gc.collect()
        assert len(_LIVE_RUNS) == 1
        return await task

    state = asyncio.run(main())
    assert state.epochs_completed == 2
    assert not _LIVE_RUNS


def test_shutdown_stops_after_the_current_batch_and_returns_the_state() -> None:
    async def main() -> fa.TrainedState:
        run = trainer(epochs=50).start()
        first = await run.next_metrics()
        assert first is not None
        return await run.shutdown(grace=30)

    state = asyncio.run(main())
    assert state.interrupted
    assert 1 <= state.epochs_completed < 50


def test_cancelling_trainer_run_is_an_orderly_stop_inside_a_busy_program() -> None:
    async def main() -> None:
        t = trainer(epochs=50)
        ticks = 0
        stop = asyncio.Event()

        async def other_work() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(other_work(), name="other")
            training = tg.create_task(t.run(), name="training")
            await asyncio.sleep(
                0
            )  # one turn: run() has started its handle (start() returns at once)
            (live,) = _LIVE_RUNS
            await live.next_metrics()
            training.cancel()
            with pytest.raises(asyncio.CancelledError):
                await training
            assert live.done()
            state = await live.join()
            assert state.interrupted
            stop.set()
        assert ticks > 0

    asyncio.run(main())
    assert not [t for t in threading.enumerate() if t.name == "flodl-compute"]


def test_record_scalar_is_averaged_per_epoch() -> None:
    def step(m: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        fa.record_scalar("batch_rows", float(batch[0].shape[0]))
        return mlp.mse(m, batch)

    async def main() -> list[fa.EpochMetrics]:
        run = trainer(train_step=step, epochs=1).start()
        return [m async for m in run.metrics()]

    (only,) = asyncio.run(main())
    assert only.scalars == {"batch_rows": 32.0}
    fa.record_scalar("outside", 1.0)  # outside a step: ignored, not an error


def test_a_second_session_in_a_rank_process_is_refused_with_the_advice() -> None:
    from flodl_async.trainer import api as trainer_module

    t = trainer()
    try:
        t._one_session()
        with pytest.raises(ConfigError) as info:
            t._one_session()
        assert "already run in this process" in str(info.value)
        assert "loop at the process level" in str(info.value)
    finally:
        trainer_module._RANK_SESSION.clear()


def test_lr_schedule_and_max_grad_norm_shape_the_steps() -> None:
    initial = mlp.model(torch.device("cpu")).state_dict()
    frozen = asyncio.run(
        trainer(epochs=1, lr_schedule=lambda progress: 0.0).run()
    )  # LR x 0 all along: nothing moves
    for name, tensor in initial.items():
        assert torch.equal(frozen.state_dict[name], tensor), name
    clipped = asyncio.run(
        trainer(epochs=1, max_grad_norm=1e-12).run()
    )  # every step clipped to (almost) nothing
    free = asyncio.run(trainer(epochs=1).run())
    for name, tensor in initial.items():
        assert torch.allclose(clipped.state_dict[name], tensor, atol=1e-9), name
    assert any(not torch.allclose(free.state_dict[n], t, atol=1e-3) for n, t in initial.items())
