"""The runners of a Trainer process's schedule: they block, touch the tensors, carry out the policy.

Theory of operation. The compute side (the managed loop on a compute thread, or the user's thread
in the cooperative tier) asks its schedule for the next batch (:class:`~.worker.Schedule`). What
to do is the pure policy's decision (:mod:`flodl_async.training.schedule`); a runner here blocks
on the link, touches the tensors and carries out the policy's actions from a table.

- :class:`InlineSchedule` walks every epoch's permutation in this one process.
- :class:`RankSchedule` follows the coordinator. Between batches it drains the inbox the link
  thread (:mod:`flodl_async.trainer.link`) fills into the policy and does what it says: send
  ``WindowDone``, hold (block on the inbox), contribute to a pending ``Reduce`` (blocking until the
  consensus is applied under SYNC/CADENCE, submitting and blending later under ASYNC), and end at
  ``Shutdown``. Tensor math runs on the compute side, never on a loop.
"""

from __future__ import annotations

import concurrent.futures
import copy
import enum
import logging
import math
import queue
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, ConnectionClosed, CoordinatorLost, TrainingStopped, WireError
from ..training import saves
from ..training.metrics import EpochMetrics, RankEpochStats
from ..training.outer import OuterAvg, OuterStepper
from ..training.policy import Backend
from ..training.regroup import Regroup
from ..training.schedule import (
    Asked,
    CloseEpoch,
    Contribute,
    End,
    Finishing,
    Hold,
    InlineAction,
    InlinePolicy,
    NoteLost,
    Publish,
    RankAction,
    RankPolicy,
    Report,
    Settle,
    Settled,
    Stepped,
    Stop,
    StopSeen,
    Train,
    Via,
)
from ..wire import messages as m
from .collective import OuterHooks, ProcessGroup
from .inlinesave import InlineCheckpoints
from .link import Inbound, LinkThread, Lost, Woken
from .rankstate import RankStateWriter
from .worker import Compute, WindowStats, Work

if TYPE_CHECKING:
    import torch

    from ..training.modelschema import ModelSchema
    from ..training.spec import TrainerSpec

log = logging.getLogger("flodl_async.relay.ranklink")

_NO_SAVE_PATH = (
    "a checkpoint needs somewhere to write: pass "
    "Trainer(checkpoint=fa.Checkpointing(save_path='ckpt/run'))"
)


class _Again(enum.Enum):
    """An action after which the runner asks its policy again."""

    AGAIN = "again"


#: What carrying out an action gives ``next_work``: a batch, the end, or go on.
_Step = Work | None | _Again
_AGAIN = _Again.AGAIN
_ASKED = Asked()


def _work(action: Train) -> Work:
    return Work(epoch=action.epoch, batch=action.batch, plan=action.plan, progress=action.progress)


def _end(_action: End) -> None:
    return None


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
        checkpoints: InlineCheckpoints | None = None,
    ) -> None:
        self._compute = compute
        self._publish = publish
        self._stop = stop
        self.checkpoints = checkpoints
        self._spec_save_path = None if checkpoints is None else checkpoints.save_path
        start = None if checkpoints is None else checkpoints.resume()
        self._policy = InlinePolicy(
            epochs=epochs,
            n_batches=compute.n_batches,
            start_epoch=0 if start is None else start.epoch,
            covered=frozenset() if start is None else start.covered,
            start_step=0 if start is None else start.step,
        )
        self._epoch_started = time.monotonic()
        self._epoch_stats = WindowStats()
        self._carry_out: dict[type[InlineAction], Callable[[Any], Work | None]] = {
            Train: _work,
            CloseEpoch: self._close_epoch,
            End: _end,
        }

    def _see_stop(self) -> None:
        if self._stop.is_set():
            self._policy.handle(StopSeen())

    def next_work(self) -> Work | None:
        self._see_stop()
        work: Work | None = None
        for action in self._policy.handle(_ASKED):  # the last is the batch or the end
            work = self._carry_out[type(action)](action)
        return work

    def after_step(self, stats: WindowStats) -> bool:
        self._policy.handle(Stepped())
        if self.checkpoints is not None:
            self.checkpoints.after_step(self._policy)
        self._epoch_stats.merge(stats.take())
        self._see_stop()
        return self._policy.interrupted

    def _close_epoch(self, action: CloseEpoch) -> None:
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
        now = time.monotonic()
        self._publish(
            EpochMetrics(
                epoch=action.epoch + 1,  # counted from 1, as the coordinator's ledger does
                avg_loss=avg_loss,
                epoch_ms=(now - self._epoch_started) * 1e3,
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
        self._epoch_started = now

    def finish(self) -> Mapping[str, Any]:
        for action in self._policy.handle(Finishing()):
            self._carry_out[type(action)](action)
        outcome = self._policy.outcome
        checkpoints = self.checkpoints
        if checkpoints is not None:
            checkpoints.at_end(self._policy, interrupted=outcome.interrupted)
        return {
            "checkpoint": None if checkpoints is None else checkpoints.last,
            "state_dict": self._compute.state_dict(),
            "param_names": self._compute.param_names,
            "epochs_completed": outcome.epochs_completed,
            "global_step": outcome.global_step,
            "world_size": outcome.world_size,
            "lost_ranks": outcome.lost_ranks,
            "interrupted": outcome.interrupted,
        }

    def fail(self, exc: BaseException) -> None:
        """Nothing waits on an inline run but its own handle, which gets the exception."""

    def request_checkpoint(self) -> None:
        """A bundle after the current step."""
        if self.checkpoints is None or self._spec_save_path is None:
            raise ConfigError(_NO_SAVE_PATH)
        self.checkpoints.request()


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
        group: ProcessGroup | None = None,
        joining: bool = False,
    ) -> None:
        self._compute = compute
        self._group = group
        self._link = link
        self._spec = spec
        self._schema = schema
        self._publish = publish
        self.rank = link.rank
        self.welcome = welcome
        settings = spec.settings
        self._policy = RankPolicy(
            rank=link.rank,
            world_size=welcome.world_size,
            averaging=spec.policy,
            collective=spec.backend is Backend.COLLECTIVE,
            gamma=settings.gamma,
            n_batches=compute.n_batches,
            start_epoch=welcome.start_epoch,
            start_step=welcome.global_step,
            resumed=welcome.resumed,
            joining=joining,
        )
        #: The last bundle this rank wrote its state into (``TrainedState.checkpoint``).
        self.last_bundle: str | None = None
        self._states = RankStateWriter(link.rank, link.send)
        self._alpha = settings.easgd_alpha
        self._deadline = reduce_deadline
        self._stats: WindowStats | None = None
        self._outstanding: concurrent.futures.Future[Any] | None = None
        self._divergence = -1.0
        self._stepper: Any = None
        self._stepper_before: Any = None
        self._outer = OuterHooks(step=self._outer_step, rewind=self._outer_rewind)
        self._carry_out: dict[type[RankAction], Callable[[Any], _Step]] = {
            Train: _work,
            Report: self._report,
            Contribute: self._contribute,
            Settle: self._settle,
            Hold: self._hold,
            End: _end,
            Publish: self._on_publish,
            NoteLost: self._note_lost,
            Stop: self._stop,
            Regroup: self._regroup,
        }
        self._via: dict[Via, Callable[[Contribute], None]] = {
            Via.RECEIVE: self._receive,
            Via.LINK: self._send,
            Via.SUBMIT: self._submit,
            Via.COLLECTIVE: self._collective_reduce,
        }

    def _carry(self, action: RankAction) -> _Step:
        return self._carry_out[type(action)](action)

    # ----- the Schedule protocol -----------------------------------------------------------------

    def next_work(self) -> Work | None:
        while True:
            self._drain(block=False)
            self._poll_outstanding()
            step: _Step = _AGAIN
            for action in self._policy.handle(_ASKED):  # the last one decides
                step = self._carry(action)
            if step is not _AGAIN:
                return step

    def after_step(self, stats: WindowStats) -> bool:
        self._stats = stats
        self._policy.handle(Stepped())
        return False

    def finish(self) -> Mapping[str, Any]:
        outcome = self._policy.outcome
        self._states.close(wait=True)  # the end's bundle waits for this rank's file
        return {
            "state_dict": self._compute.state_dict(),
            "param_names": self._compute.param_names,
            "epochs_completed": outcome.epochs_completed,
            "global_step": outcome.global_step,
            "world_size": outcome.world_size,
            "lost_ranks": outcome.lost_ranks,
            "interrupted": outcome.interrupted,
            "checkpoint": self.last_bundle,
        }

    def fail(self, exc: BaseException) -> None:
        self._states.close(wait=False)
        text = "".join(traceback.format_exception(exc)).strip()
        self._link.close(
            m.Exiting(rank=self.rank, reason=f"{type(exc).__name__}: {exc}", error=text)
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
            self._policy.window_round,
            self._policy.window_steps,
        )
        if isinstance(item, Lost):
            raise item.error
        if isinstance(item, Woken):
            return  # it only woke a blocked drain: the consensus is polled at the boundary
        for action in self._policy.handle(item):
            self._carry(action)

    # ----- carrying out -------------------------------------------------------------------------

    def _hold(self, _action: Hold) -> _Step:
        self._drain(block=True)
        return _AGAIN

    def _report(self, action: Report) -> _Step:
        stats = self._stats.take() if self._stats is not None else WindowStats()
        self._link.send(
            m.WindowDone(
                rank=self.rank,
                round=action.round,
                epoch=action.epoch,
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
        return _AGAIN

    def _on_publish(self, action: Publish) -> _Step:
        self._publish(action.metrics)
        return _AGAIN

    def _note_lost(self, action: NoteLost) -> _Step:
        log.warning(
            "rank %d: the coordinator declared rank %d lost: %s",
            self.rank,
            action.rank,
            action.reason,
        )
        return _AGAIN

    def _stop(self, action: Stop) -> _Step:
        raise TrainingStopped(action.reason)

    # ----- reduces -------------------------------------------------------------------------------

    def _contribute(self, action: Contribute) -> _Step:
        self._via[action.via](action)
        if action.reset_inner:
            self._compute.optimizer.state.clear()  # DiLoCo: inner state is disposable each round
        if action.checkpoint > 0:
            self._save_state(action.checkpoint, action.checkpoint_name)
        return _AGAIN

    def request_checkpoint(self) -> None:
        """Ask the coordinator for a checkpoint at the next reduce boundary."""
        if self._spec.checkpoint.save_path is None:
            raise ConfigError(_NO_SAVE_PATH)
        self._link.send(m.Intent(rank=self.rank, kind=saves.INTENT))

    def _save_state(self, version: int, name: str) -> None:
        """A checkpoint round's consensus is applied: this rank's optimizer and RNG state go into
        the bundle (on this host; the save path is shared), and its hash to the controller."""
        checkpoint = self._spec.checkpoint
        assert checkpoint.save_path is not None  # only a run with a save_path marks rounds
        self.last_bundle = str(Path(checkpoint.save_path) / name)
        if checkpoint.rank_state:
            self._states.save(checkpoint.save_path, name, version, self._compute.optimizer)

    def _receive(self, action: Contribute) -> None:
        self._apply(self._wait(self._link.receive(action.round)), blend=False)

    def _send(self, action: Contribute) -> None:
        tensors = self._tensors(copy=False) if action.tensors else None
        future = self._link.contribute(
            action.round, action.kind, tensors, action.steps, action.weight
        )
        self._apply(self._wait(future), blend=False)

    def _submit(self, action: Contribute) -> None:
        tensors = self._tensors(copy=True) if action.tensors else None
        future = self._link.contribute(
            action.round, action.kind, tensors, action.steps, action.weight
        )
        self._outstanding = future
        future.add_done_callback(lambda _f: self._link.inbox.put(Woken()))

    def _settle(self, _action: Settle) -> _Step:
        future = self._outstanding
        assert future is not None  # the policy settles only what it submitted
        self._outstanding = None
        self._apply(self._wait(future), blend=True)
        return _AGAIN

    def _poll_outstanding(self) -> None:
        future = self._outstanding
        if future is None or not future.done():
            return
        self._outstanding = None
        self._apply(self._wait(future), blend=True)
        self._policy.handle(Settled())

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

    def _collective_reduce(self, action: Contribute) -> None:
        """COLLECTIVE: torch.distributed in place, the outer step replicated on every rank;
        ``ReduceDone`` up (not when a peer's death interrupted it: its redo says it)."""
        started = time.perf_counter()
        group = self._group
        assert group is not None  # a COLLECTIVE rank opens its group before its schedule
        if group.elastic and self._stepper is not None:
            self._stepper_before = copy.deepcopy(self._stepper)  # a redo steps from here again
        mass = group.reduce(action.round, action.kind, action.weight, self._live(), self._outer)
        if mass is not None:
            self._reduce_done(action.round, mass, started)

    def _regroup(self, action: Regroup) -> _Step:
        """Re-form the process group in place with the survivors; redo the round a death cut."""
        started = time.perf_counter()
        group = self._group
        assert group is not None  # only a COLLECTIVE world re-forms
        if not group.rendezvous(action, superseded=self._regroup_superseded):
            log.info("rank %d: re-form %d superseded by a later one", self.rank, action.generation)
            return _AGAIN  # the later one is the policy's next action
        mass = group.redo(action, self._live(), self._outer)
        log.info(
            "rank %d: process group re-formed with ranks %s (generation %d) in %.0f ms",
            self.rank,
            list(action.ranks),
            action.generation,
            (time.perf_counter() - started) * 1e3,
        )
        if mass is not None:
            self._reduce_done(action.redo, mass, started)
        return _AGAIN

    def _regroup_superseded(self) -> bool:
        """What arrived meanwhile is handled: a later loss replaces the re-form under way."""
        self._drain(block=False)
        return self._policy.regroup_pending

    def _live(self) -> list[torch.Tensor]:
        state = self._compute.model.state_dict()
        return [state[name] for name in self._schema.names]

    def _reduce_done(self, round_: int, mass: float, started: float) -> None:
        group = self._group
        assert group is not None
        self._link.send(
            m.ReduceDone(
                rank=self.rank,
                round=round_,
                mass=mass,
                ms=(time.perf_counter() - started) * 1e3,
                generation=group.generation,
            )
        )

    def _outer_rewind(self) -> None:
        """A redone round steps the outer optimizer again from where its first try started."""
        self._stepper = copy.deepcopy(self._stepper_before)

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
