"""Which batch a Trainer process trains next, and what it does between steps: one schedule per role.

Theory of operation. The compute side (the managed loop on a compute thread, or the user's thread
in the cooperative tier) asks its schedule for the next batch (:class:`~.worker.Schedule`).

- :class:`InlineSchedule` walks every epoch's permutation in this one process.
- :class:`RankSchedule` follows the coordinator. Between batches it drains the inbox the link
  thread (:mod:`flodl_async.trainer.link`) fills and does what the policy says: send
  ``WindowDone`` at the plan's quota or when out of data, hold at ``hold_after``, contribute to a
  pending ``Reduce`` (blocking until the consensus is applied under SYNC/CADENCE, submitting and
  blending later under ASYNC), and end at ``Shutdown``. Tensor math runs on the compute side, never
  on a loop.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import queue
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConnectionClosed, CoordinatorLost, TrainingStopped, WireError
from ..training.metrics import EpochMetrics, RankEpochStats
from ..training.outer import OuterAvg, OuterStepper
from ..training.policy import Backend, Policy
from ..wire import messages as m
from ..wire.schema import Message
from .link import Inbound, LinkThread, Lost, Woken
from .worker import Compute, WindowStats, Work

if TYPE_CHECKING:
    import torch

    from ..training.modelschema import ModelSchema
    from ..training.spec import TrainerSpec

log = logging.getLogger("flodl_async.relay.ranklink")

#: ``Shutdown.save_reason`` values that end a run normally; any other is a failure.
_NORMAL_ENDS = frozenset({"", "completed", "graceful_shutdown"})


class InlineSchedule:
    """Every epoch's batches in order, in this one process: no coordinator, no averaging (the
    INLINE entry).

    The policy, backend, ElChe and outer optimizer are ignored: there is no cross-rank averaging to
    steer. Each epoch's metrics are published as it ends (world size 1, every batch rank 0's).
    """

    def __init__(
        self,
        compute: Compute,
        *,
        epochs: int,
        publish: Callable[[EpochMetrics], None],
        stop: threading.Event,
    ) -> None:
        self._compute = compute
        self._epochs = epochs
        self._publish = publish
        self._stop = stop
        self._epoch = 0
        self._batch = 0
        self._epoch_started = time.monotonic()
        self._epoch_stats = WindowStats()
        self.epochs_completed = 0
        self.global_step = 0
        self.interrupted = False

    def next_work(self) -> Work | None:
        if self._stop.is_set():
            self.interrupted = True
            return None
        if self._batch >= self._compute.n_batches:
            self._close_epoch()
            self._epoch += 1
            self._batch = 0
            self._epoch_started = time.monotonic()
        if self._epoch >= self._epochs:
            return None
        progress = self._epoch + self._batch / self._compute.n_batches
        return Work(epoch=self._epoch, batch=self._batch, plan=self._epoch, progress=progress)

    def after_step(self, stats: WindowStats) -> bool:
        self._batch += 1
        self.global_step += 1
        self._epoch_stats.merge(stats.take())
        if self._stop.is_set():
            self.interrupted = True
        return self.interrupted

    def _close_epoch(self) -> None:
        s = self._epoch_stats.take()
        busy_s = (s.compute_ms + s.data_ms) / 1e3
        avg_loss = s.loss_sum / s.batches if s.batches else math.nan
        rank = RankEpochStats(
            rank=0,
            batches=s.batches,
            samples=s.samples,
            avg_loss=avg_loss,
            throughput=s.batches / busy_s if busy_s > 0 else 0.0,
            batch_share=1.0,
            compute_ms=s.compute_ms,
            data_ms=s.data_ms,
            alive=True,
        )
        scalars = {name: total / s.scalar_counts[name] for name, total in s.scalar_sums.items()}
        self._publish(
            EpochMetrics(
                epoch=self._epoch,
                avg_loss=avg_loss,
                epoch_ms=(time.monotonic() - self._epoch_started) * 1e3,
                batches=s.batches,
                samples=s.samples,
                reduces=0,
                avg_reduce_ms=0.0,
                anchor=0,
                counts=(s.batches,),
                per_rank=(rank,),
                scalars=scalars,
            )
        )
        self.epochs_completed += 1

    def finish(self) -> Mapping[str, Any]:
        if (
            self._batch >= self._compute.n_batches
            and self._epoch < self._epochs
            and not self.interrupted
        ):
            self._close_epoch()  # the stop came on the epoch's last batch: the epoch is complete
        return {
            "state_dict": self._compute.state_dict(),
            "param_names": self._compute.param_names,
            "epochs_completed": self.epochs_completed,
            "global_step": self.global_step,
            "world_size": 1,
            "lost_ranks": (),
            "interrupted": self.interrupted and self.epochs_completed < self._epochs,
        }

    def fail(self, exc: BaseException) -> None:
        """Nothing waits on an inline run but its own handle, which gets the exception."""


@dataclass(slots=True)
class _PlanState:
    """A plan being worked through: its batches in order and how far the rank got."""

    plan: m.Plan
    batches: list[int]
    done: int = 0

    @property
    def exhausted(self) -> bool:
        return self.done >= len(self.batches)


def _flatten(ranges: tuple[tuple[int, ...], ...]) -> list[int]:
    out: list[int] = []
    for first, count in ranges:
        out.extend(range(first, first + count))
    return out


class RankSchedule:
    """What the compute side of one rank trains next, and what it does between steps."""

    def __init__(
        self,
        compute: Compute,
        link: LinkThread,
        *,
        welcome: m.TrainerWelcome,
        spec: TrainerSpec,
        schema: ModelSchema,
        publish: Callable[[EpochMetrics], None],
        reduce_deadline: float,
    ) -> None:
        self._compute = compute
        self._link = link
        self._spec = spec
        self._schema = schema
        self._publish = publish
        self.rank = link.rank
        self.welcome = welcome
        self._policy = spec.policy
        self._collective = spec.backend is Backend.COLLECTIVE
        settings = spec.settings
        self._gamma = settings.gamma
        self._alpha = settings.easgd_alpha
        self._deadline = reduce_deadline
        self._plans: collections.deque[_PlanState] = collections.deque()
        self._reduces: collections.deque[m.Reduce] = collections.deque()
        self._initialized = False
        self._final_round = False  # the final (or upload) round is done: only Shutdown is left
        self._ended: m.Shutdown | None = None
        self._window_round = -1
        self._window_steps = 0
        self._window_sent = False
        self._since_contribution = 0
        self._stats: WindowStats | None = None
        self._outstanding: concurrent.futures.Future[Any] | None = None
        self._divergence = -1.0
        self._lost: set[int] = set()
        self._epochs_seen = -1
        self._cohort_batches = 0
        self._stepper: Any = None

    # ----- the Schedule protocol -----------------------------------------------------------------

    def next_work(self) -> Work | None:
        while True:
            self._drain(block=False)
            self._apply_outstanding(wait=False)
            if self._reduces:  # every call here is a step boundary: contribute now
                self._reduce(self._reduces.popleft())
                continue
            if self._ended is not None:
                self._apply_outstanding(wait=True)
                return None
            if not self._initialized or self._final_round:
                # before INIT nothing may train; after the final round nothing must
                self._drain(block=True)
                continue
            current = self._current_plan()
            if current is not None and self._window_due(current):
                self._report_window(current.plan)
                # what the report brings (a Reduce, a next plan) is handled before the next batch
                continue
            if current is None or current.exhausted or self._holding():
                self._drain(block=True)
                continue
            plan = current.plan
            batch = current.batches[current.done]
            n_batches = self._compute.n_batches
            progress = plan.progress + current.done / n_batches if n_batches else plan.progress
            return Work(epoch=plan.epoch, batch=batch, plan=plan.round, progress=progress)

    def after_step(self, stats: WindowStats) -> bool:
        self._stats = stats
        current = self._current_plan()
        assert current is not None
        current.done += 1
        self._window_steps += 1
        self._since_contribution += 1
        return False

    def finish(self) -> Mapping[str, Any]:
        assert self._ended is not None
        world = self.welcome.world_size
        return {
            "state_dict": self._compute.state_dict(),
            "param_names": self._compute.param_names,
            "epochs_completed": self._epochs_seen + 1,
            "global_step": self._cohort_batches // max(world, 1),
            "world_size": world - len(self._lost),
            "lost_ranks": tuple(sorted(self._lost)),
            "interrupted": self._ended.save_reason == "graceful_shutdown",
        }

    def fail(self, exc: BaseException) -> None:
        text = "".join(traceback.format_exception(exc)).strip()
        self._link.close(
            m.Exiting(rank=self.rank, reason=f"{type(exc).__name__}: {exc}", error=text)
        )

    # ----- plans, windows, holds -----------------------------------------------------------------

    def _current_plan(self) -> _PlanState | None:
        """The plan being trained; a finished plan whose window is reported gives way to the next
        one."""
        while self._plans and self._plans[0].exhausted and len(self._plans) > 1:
            if not self._window_sent and self._plans[0].plan.round == self._window_round:
                self._report_window(self._plans[0].plan)
            self._plans.popleft()
            self._open_window(self._plans[0].plan.round)
        return self._plans[0] if self._plans else None

    def _window_due(self, current: _PlanState) -> bool:
        """Report now: the quota is reached, or the planned data ran out with steps unreported; a
        window planned empty at once.

        Nothing else is reported: a SYNC rank past its slice with everything reported is exempt from
        the gate, and under CADENCE the next plan may simply not have arrived yet (it rides the
        control link, the consensus the data link).
        """
        if self._window_sent:
            return False
        if current.plan.quota == 0:
            return current.plan.round == self._window_round
        if current.exhausted and len(self._plans) == 1:
            return self._stats is not None and self._stats.batches > 0
        return self._window_steps > 0 and self._window_steps >= current.plan.quota

    def _open_window(self, round_: int) -> None:
        if round_ > self._window_round:
            self._window_round = round_
            self._window_steps = 0
            self._window_sent = False

    def _holding(self) -> bool:
        current = self._plans[0] if self._plans else None
        if current is None:
            return True
        hold_after = current.plan.hold_after
        held = hold_after >= 0 and self._since_contribution >= hold_after
        return held or (self._outstanding is not None and current.exhausted)

    def _report_window(self, plan: m.Plan) -> None:
        # Everything trained since the last report (under SYNC that includes the steps past the
        # quota).
        stats = self._stats.take() if self._stats is not None else WindowStats()
        self._window_sent = True
        self._link.send(
            m.WindowDone(
                rank=self.rank,
                round=self._window_round,
                epoch=plan.epoch,
                batches=stats.batches,
                samples=stats.samples,
                compute_ms=stats.compute_ms,
                data_ms=stats.data_ms,
                loss_sum=stats.loss_sum,
                divergence=self._divergence,
                scalar_sums=stats.scalar_sums,
                scalar_counts=stats.scalar_counts,
            )
        )

    # ----- the inbox -----------------------------------------------------------------------------

    def _drain(self, *, block: bool) -> None:
        """Handle what the link thread delivered; with ``block``, wait for at least one item."""
        try:
            item = self._link.inbox.get(block=block)
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._link.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: Inbound) -> None:
        log.debug(
            "rank %d: %r (window %d, %d steps in it)",
            self.rank,
            item,
            self._window_round,
            self._window_steps,
        )
        if isinstance(item, Lost):
            raise item.error
        if isinstance(item, Woken):
            return
        handler = _INBOUND.get(type(item))
        if handler is not None:
            handler(self, item)

    def _on_plan(self, plan: Message) -> None:
        assert isinstance(plan, m.Plan)
        self._plans.append(_PlanState(plan=plan, batches=_flatten(plan.ranges)))
        if len(self._plans) == 1:
            self._open_window(plan.round)

    def _on_reduce(self, reduce: Message) -> None:
        assert isinstance(reduce, m.Reduce)
        self._reduces.append(reduce)

    def _on_epoch(self, msg: Message) -> None:
        assert isinstance(msg, m.EpochAggregated)
        metrics = msg.metrics
        self._epochs_seen = max(self._epochs_seen, metrics.epoch)
        self._cohort_batches += metrics.batches
        self._publish(metrics)

    def _on_dead(self, msg: Message) -> None:
        assert isinstance(msg, m.DeclareDead)
        self._lost.add(msg.dead_rank)
        log.warning(
            "rank %d: the coordinator declared rank %d lost: %s",
            self.rank,
            msg.dead_rank,
            msg.reason,
        )

    def _on_shutdown(self, msg: Message) -> None:
        assert isinstance(msg, m.Shutdown)
        if msg.save_reason not in _NORMAL_ENDS:
            raise TrainingStopped(f"the coordinator stopped the run: {msg.reason}")
        self._ended = msg

    def _on_reject(self, msg: Message) -> None:
        assert isinstance(msg, m.TrainerReject)
        raise TrainingStopped(f"the coordinator refused rank {self.rank}: {msg.reason}")

    # ----- reduces -------------------------------------------------------------------------------

    def _reduce(self, reduce: m.Reduce) -> None:
        self._apply_outstanding(wait=True)  # at most one contribution outstanding
        steps = self._since_contribution
        if reduce.kind == "model" or (reduce.kind == "final" and not reduce.from_controller):
            self._since_contribution = 0
            self._open_window(reduce.round + 1)
        if self._collective and reduce.kind != "upload":
            self._collective_reduce(reduce, steps)
        else:
            self._cpu_reduce(reduce, steps)
        if reduce.kind == "init":
            self._initialized = True
        elif reduce.kind in ("final", "upload"):
            self._final_round = True
        if reduce.reset_inner:
            self._compute.optimizer.state.clear()  # DiLoCo: inner state is disposable each round

    def _cpu_reduce(self, reduce: m.Reduce, steps: int) -> None:
        kind = reduce.kind
        # the controller holds the consensus (natural end, resume): only wait for it
        if reduce.from_controller:
            self._apply(self._wait(self._link.receive(reduce.round)), blend=False)
            return
        if kind in ("init", "upload"):
            # init: the root's state seeds every rank; upload (COLLECTIVE): the ranks agree, rank
            # 0's copy
            # goes to the controller. Either way the others send an empty contribution and wait.
            tensors, weight = (self._tensors(copy=False), 1.0) if self.rank == 0 else (None, 0.0)
        elif kind == "final" and self._policy is Policy.ASYNC:
            # ASYNC locals differ on purpose: the final round is a plain mean
            tensors, weight = self._tensors(copy=False), 1.0
        else:
            weight = float(steps) ** self._gamma if steps > 0 else 0.0
            tensors = self._tensors(copy=self._policy is Policy.ASYNC and kind == "model")
        future = self._link.contribute(reduce.round, kind, tensors, steps, weight)
        if kind == "model" and self._policy is Policy.ASYNC:
            self._outstanding = future
            future.add_done_callback(lambda _f: self._link.inbox.put(Woken()))
            return
        self._apply(self._wait(future), blend=False)

    def _wait(self, future: concurrent.futures.Future[Any]) -> Any:
        """The consensus of a contribution; the link failing meanwhile is a lost coordinator."""
        try:
            return future.result(timeout=self._deadline)
        except concurrent.futures.TimeoutError:
            raise CoordinatorLost(
                f"rank {self.rank}: no consensus within {self._deadline:g}s (the reduce stalled)"
            ) from None
        except (ConnectionClosed, WireError) as exc:
            raise CoordinatorLost(
                f"rank {self.rank}: the data link closed while waiting for a consensus ({exc})"
            ) from None

    def _apply_outstanding(self, *, wait: bool) -> None:
        future = self._outstanding
        if future is None or not (wait or future.done()):
            return
        self._outstanding = None
        self._apply(self._wait(future), blend=True)

    def _tensors(self, *, copy: bool) -> dict[str, torch.Tensor]:
        """This rank's state in schema order, on CPU (views of the live CPU tensors unless
        ``copy``)."""
        state = self._compute.model.state_dict()
        out = {}
        for name in self._schema.names:
            t = state[name].detach()
            out[name] = t.to("cpu", copy=True) if copy or t.device.type != "cpu" else t
        return out

    def _apply(self, result: Any, *, blend: bool) -> None:
        """Adopt a consensus: overwrite (SYNC/CADENCE, init, final) or EASGD-blend (ASYNC model
        rounds); mass 0 keeps local state."""
        import torch  # deferred: torch loads only where a tensor is touched

        if result.mass <= 0 or not result.tensors:
            return
        state = self._compute.model.state_dict()
        params = set(self._schema.param_names)
        diff_sq, post_sq = 0.0, 0.0
        with torch.no_grad():
            for name, incoming in result.tensors.items():
                local = state[name]
                value = incoming.to(local.device, non_blocking=True)
                if name in params:
                    diff_sq += float((local.double() - value.double()).pow(2).sum())
                if blend and local.is_floating_point():
                    local.lerp_(value.to(local.dtype), self._alpha)
                else:
                    local.copy_(value)
                if name in params:
                    post_sq += float(local.double().pow(2).sum())
        post = math.sqrt(post_sq)
        self._divergence = 0.0 if post < 1e-10 else math.sqrt(diff_sq) / post

    def _collective_reduce(self, reduce: m.Reduce, steps: int) -> None:
        """COLLECTIVE: torch.distributed in place, the outer step replicated on every rank;
        ``ReduceDone`` up."""
        import torch  # deferred: torch loads only where a tensor is touched
        import torch.distributed as dist  # deferred with torch

        started = time.perf_counter()
        tensors = [self._compute.model.state_dict()[name] for name in self._schema.names]
        mass = 1.0
        with torch.no_grad():
            if reduce.kind == "init":
                for t in tensors:
                    dist.broadcast(t, src=0)
            else:
                w = float(steps) ** self._gamma if steps > 0 else 0.0
                total = torch.tensor([w], dtype=torch.float64)
                dist.all_reduce(total)
                mass = float(total.item())
                if mass > 0:
                    for t in tensors:
                        if t.is_floating_point():
                            t.mul_(w / mass)
                            dist.all_reduce(t)
                        else:
                            acc = t.double().mul_(w / mass)
                            dist.all_reduce(acc)
                            # round half to even, as the CPU reducer
                            t.copy_(torch.round(acc).to(t.dtype))
                    if reduce.kind == "model":
                        self._outer_step()
        self._link.send(
            m.ReduceDone(
                rank=self.rank,
                round=reduce.round,
                mass=mass,
                ms=(time.perf_counter() - started) * 1e3,
            )
        )

    def _outer_step(self) -> None:
        outer = self._spec.outer
        if isinstance(outer, OuterAvg):
            return
        import torch  # deferred: torch loads only where a tensor is touched

        if self._stepper is None:
            self._stepper = OuterStepper(outer)
        state = self._compute.model.state_dict()
        params = {name: state[name].detach() for name in self._schema.param_names}
        stepped = self._stepper.step({k: v.to("cpu") for k, v in params.items()})
        with torch.no_grad():
            for name, value in stepped.items():
                params[name].copy_(value)


_INBOUND: dict[type[Message], Callable[[RankSchedule, Message], None]] = {
    m.Plan: RankSchedule._on_plan,
    m.Reduce: RankSchedule._on_reduce,
    m.EpochAggregated: RankSchedule._on_epoch,
    m.DeclareDead: RankSchedule._on_dead,
    m.Shutdown: RankSchedule._on_shutdown,
    m.TrainerReject: RankSchedule._on_reject,
}
