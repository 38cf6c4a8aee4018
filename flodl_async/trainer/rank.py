"""A Trainer rank: the link thread that speaks to the coordinator, and the schedule the compute side
follows.

Theory of operation (spec §2.1, D5). Networking runs on a **link thread** with
its own event loop, so heartbeats flow while a batch computes: it dials the
relay (``RankHello``), says ``TrainerHello`` (spec, model schema, digest), waits
for ``TrainerWelcome``, opens the data link, then only moves messages: control
messages from the coordinator go into the compute side's inbox (a
``queue.Queue``), the compute side's ``WindowDone``/``Exiting`` go up, and its
contributions go to the data link, each answered by a future. A heartbeat goes
up every second; no frame from the controller within the heartbeat deadline,
or the relay link closing, is a lost coordinator.

The compute side (the managed loop on a compute thread, or the user's thread in
the cooperative tier) asks :class:`RankSchedule` for its next batch. Between
batches the schedule drains the inbox and does what the policy says (§2.5):
send ``WindowDone`` at the plan's quota or when out of data, hold at
``hold_after``, contribute to a pending ``Reduce`` (blocking until the consensus
is applied under SYNC/CADENCE, submitting and blending later under ASYNC), and
end at ``Shutdown``. Tensor math runs on the compute side, never on a loop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import math
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..deadlines import timeout_scale
from ..errors import (
    ConfigError,
    ConnectionClosed,
    CoordinatorLost,
    FlodlError,
    TrainingFailed,
    TrainingStopped,
    WireError,
)
from ..training.metrics import EpochMetrics
from ..training.policy import Backend, Policy
from ..verdict import ExitCode, RunResult
from ..wire import messages as m
from ..wire.schema import Message
from .worker import Compute, WindowStats, Work, Worker, default_device, run_managed

if TYPE_CHECKING:
    import torch

    from ..training.modelschema import ModelSchema
    from .api import TrainedState, Trainer

log = logging.getLogger("flodl_async.relay.ranklink")

#: Heartbeat cadence, not scaled (FI §H7).
HEARTBEAT_INTERVAL = 1.0
#: The coordinator must welcome a rank within this (scaled): it waits for every rank's hello.
WELCOME_TIMEOUT = 150.0
#: A contribution's consensus must arrive within this (scaled), the coordinator's stall ceiling
#: (§2.7).
REDUCE_DEADLINE = 120.0
#: ``Shutdown.save_reason`` values that end a run normally; any other is a failure.
_NORMAL_ENDS = frozenset({"", "completed", "graceful_shutdown"})


@dataclass(frozen=True, slots=True)
class _Lost:
    """The link thread's last word: why the coordinator is gone."""

    error: FlodlError


@dataclass(frozen=True, slots=True)
class _Woken:
    """An ASYNC contribution's consensus arrived (the compute side blends it at its next step
    boundary)."""


_Inbound = Message | _Lost | _Woken


class LinkThread:
    """The rank's links (control and data) on a thread of their own, with their own event loop."""

    def __init__(
        self,
        *,
        hello: m.TrainerHello,
        schema: ModelSchema,
        heartbeat_timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._hello = hello
        self._schema = schema
        self._env = dict(os.environ if env is None else env)
        scale = timeout_scale(self._env)
        self._silence = heartbeat_timeout * scale
        self._welcome_timeout = WELCOME_TIMEOUT * scale
        self.inbox: queue.Queue[_Inbound] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._welcome: m.TrainerWelcome | None = None
        self._failure: BaseException | None = None
        self._link: Any = None
        self._data: Any = None
        self._closing: asyncio.Event | None = None
        self._farewell: m.Exiting | None = None
        self._thread = threading.Thread(target=self._main, name="flodl-link", daemon=True)
        self.rank = hello.rank

    # ----- compute side --------------------------------------------------------------------------

    def start(self) -> m.TrainerWelcome:
        """Start the thread and wait for the welcome (or raise why there is none)."""
        self._thread.start()
        self._started.wait()
        # A failure wins over a welcome: the data link can fail after the coordinator welcomed us.
        if self._failure is not None:
            raise self._failure
        assert self._welcome is not None
        return self._welcome

    def send(self, msg: Message) -> None:
        """Send a control message up (thread-safe; dropped once the link is gone)."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._send_now, msg)

    def contribute(
        self,
        round_: int,
        kind: str,
        tensors: dict[str, torch.Tensor] | None,
        steps: int,
        weight: float,
    ) -> concurrent.futures.Future[Any]:
        """Submit a contribution; the future holds the round's ``ConsensusResult``."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(
            self._data.contribute(round_, kind, tensors, steps, weight), self._loop
        )

    def receive(self, round_: int) -> concurrent.futures.Future[Any]:
        """Wait for a round's consensus without contributing (``from_controller`` rounds)."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(self._data.receive(round_), self._loop)

    def close(self, farewell: m.Exiting | None) -> None:
        """Say goodbye (``Exiting``) and close both links; waits for the thread (bounded)."""
        loop, closing = self._loop, self._closing
        if loop is not None and closing is not None:
            self._farewell = farewell
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(closing.set)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10.0)

    # ----- link thread ---------------------------------------------------------------------------

    def _main(self) -> None:
        from ..net.loop import loop_factory

        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            try:
                runner.run(self._serve())
            except BaseException as exc:  # handed over: the compute side raises or reports it
                if not self._started.is_set():
                    self._failure = exc
                else:
                    self.inbox.put(
                        _Lost(
                            exc
                            if isinstance(exc, FlodlError)
                            else CoordinatorLost(f"the rank's link thread failed: {exc!r}")
                        )
                    )
            finally:
                self._started.set()

    def _send_now(self, msg: Message) -> None:
        if self._link is not None:
            with contextlib.suppress(ConnectionClosed):
                self._link.send(msg)

    async def _serve(self) -> None:
        from ..relay.datalink import DataLink
        from ..relay.ranklink import RankLink

        self._loop = asyncio.get_running_loop()
        self._closing = asyncio.Event()
        async with asyncio.timeout(self._welcome_timeout):
            self._link = await RankLink.connect(self._env)
            try:
                self._link.send(self._hello)
                welcome = await self._await_welcome()
                self._data = await DataLink.connect(
                    self._link.spec, self.rank, self._schema, self._hello.digest
                )
                self._welcome = welcome  # only once both links are up
            except BaseException:
                await self._link.aclose()
                raise
        self._started.set()
        try:
            async with asyncio.TaskGroup() as tg:
                reader = tg.create_task(self._read(), name="rank-control-reader")
                beat = tg.create_task(self._beat(), name="rank-heartbeat")
                await self._closing.wait()
                if self._farewell is not None:
                    self._send_now(self._farewell)
                    with contextlib.suppress(ConnectionClosed, TimeoutError):
                        async with asyncio.timeout(2.0):
                            await self._link.drain()
                reader.cancel()
                beat.cancel()
        finally:
            with contextlib.suppress(Exception):
                await self._data.aclose()
            with contextlib.suppress(Exception):
                await self._link.aclose()

    async def _await_welcome(self) -> m.TrainerWelcome:
        while True:
            msg = await self._link.recv()
            if isinstance(msg, m.TrainerWelcome):
                return msg
            if isinstance(msg, m.TrainerReject):
                raise TrainingStopped(f"the coordinator refused rank {self.rank}: {msg.reason}")
            # Heartbeat echoes and the like before the welcome: nothing to do.

    async def _read(self) -> None:
        try:
            while True:
                async with asyncio.timeout(self._silence):
                    msg = await self._link.recv()
                if isinstance(msg, m.Heartbeat):
                    continue  # the echo: a sign of life, and nothing else
                self.inbox.put(msg)
        except TimeoutError:
            self.inbox.put(
                _Lost(
                    CoordinatorLost(
                        f"rank {self.rank}: nothing from the coordinator for {self._silence:g}s "
                        "(it is frozen, gone or cut off)"
                    )
                )
            )
        except (ConnectionClosed, WireError) as exc:
            assert self._closing is not None
            if not self._closing.is_set():
                self.inbox.put(
                    _Lost(
                        CoordinatorLost(
                            f"rank {self.rank}: the link to the relay closed ({exc}); the agent or "
                            "the controller is gone"
                        )
                    )
                )
        assert self._closing is not None
        await self._closing.wait()

    async def _beat(self) -> None:
        while True:
            self._send_now(m.Heartbeat(sent_at=time.monotonic(), rank=self.rank))
            await asyncio.sleep(HEARTBEAT_INTERVAL)


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
    """What the compute side of one rank trains next, and what it does between steps (spec §2.5)."""

    def __init__(
        self,
        compute: Compute,
        link: LinkThread,
        *,
        welcome: m.TrainerWelcome,
        trainer: Trainer,
        schema: ModelSchema,
        publish: Callable[[EpochMetrics], None],
    ) -> None:
        self._compute = compute
        self._link = link
        self._trainer = trainer
        self._schema = schema
        self._publish = publish
        self.rank = link.rank
        self.welcome = welcome
        self._policy = trainer.policy
        self._collective = trainer.backend is Backend.COLLECTIVE
        from ..training.spec import resolve_elche

        settings = resolve_elche(trainer.elche, trainer.policy)
        self._gamma = settings.gamma
        self._alpha = settings.easgd_alpha
        self._deadline = REDUCE_DEADLINE * timeout_scale()
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

    def _handle(self, item: _Inbound) -> None:
        log.debug(
            "rank %d: %r (window %d, %d steps in it)",
            self.rank,
            item,
            self._window_round,
            self._window_steps,
        )
        if isinstance(item, _Lost):
            raise item.error
        if isinstance(item, _Woken):
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
            future.add_done_callback(lambda _f: self._link.inbox.put(_Woken()))
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
        import torch

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
        """COLLECTIVE (§2.10): torch.distributed in place, the outer step replicated on every rank;
        ``ReduceDone`` up."""
        import torch
        import torch.distributed as dist

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
        from ..training.outer import OuterAvg, OuterStepper

        outer = self._trainer.outer
        if isinstance(outer, OuterAvg):
            return
        import torch

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


# ----- the rank's session: hello, compute, goodbye
# -------------------------------------------------


@dataclass(slots=True)
class _Session:
    compute: Compute
    link: LinkThread
    schedule: RankSchedule
    rank: int
    primary: bool


def _open_session(trainer: Trainer, publish: Callable[[EpochMetrics], None]) -> _Session:
    """Build the model on this rank's device, say hello, wait for the welcome (compute side,
    blocking)."""
    from ..training.modelschema import ModelSchema

    env = os.environ
    rank = int(env["RANK"])
    device = default_device(int(env.get("LOCAL_RANK", "0")))
    compute = Compute(trainer.compute_config(), device)
    schema = ModelSchema.from_module(compute.model)
    spec_wire, digest = trainer.spec_wire_and_digest(schema)
    hello = m.TrainerHello(
        rank=rank,
        spec=spec_wire,
        digest=digest,
        model=schema.to_wire(),
        model_bytes=schema.model_bytes,
        device=str(device),
    )
    link = LinkThread(hello=hello, schema=schema, heartbeat_timeout=trainer.heartbeat_timeout)
    welcome = link.start()
    try:
        if trainer.backend is Backend.COLLECTIVE:
            _init_process_group(device)
        schedule = RankSchedule(
            compute, link, welcome=welcome, trainer=trainer, schema=schema, publish=publish
        )
    except BaseException:
        # the links are up: a failed start must not leave them (and their thread) open
        link.close(None)
        raise
    return _Session(
        compute=compute, link=link, schedule=schedule, rank=rank, primary=rank_is_primary(env)
    )


def _init_process_group(device: torch.device) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def _close_session(session: _Session, farewell: m.Exiting | None) -> None:
    session.link.close(farewell)
    if session.schedule._collective:
        import torch.distributed as dist

        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


#: Set by a Trainer launcher on its ranks: the launcher is the run's primary process, no rank is.
LAUNCHER_PRIMARY_VAR = "FLODL_TRAINER_LAUNCHER_PRIMARY"


def rank_is_primary(env: Mapping[str, str]) -> bool:
    """Rank 0 is primary, unless the script is also the launcher (then the launcher is)."""
    return env.get("RANK") == "0" and env.get(LAUNCHER_PRIMARY_VAR) != "1"


class RankDriver:
    """The managed tier in a rank: a compute thread trains what the coordinator plans."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self.run_id = os.environ.get("FLODL_RUN_ID", "")
        self.primary = rank_is_primary(os.environ)

    async def run(self, publish: Callable[[EpochMetrics], None]) -> TrainedState:
        from .api import _on_thread, _trained

        box: list[_Session] = []

        def train() -> tuple[Mapping[str, Any], bool]:
            session = _open_session(self._trainer, publish)
            box.append(session)
            try:
                fields = run_managed(session.compute, session.schedule)
            except BaseException:
                _close_session(session, None)  # fail() already said why
                raise
            _close_session(session, m.Exiting(rank=session.rank, reason="done"))
            return fields, session.primary

        try:
            fields, primary = await _on_thread(
                train, name="flodl-compute", on_cancel=self.request_stop
            )
        except (ConfigError, TrainingStopped, CoordinatorLost):
            raise
        except FlodlError as exc:
            raise TrainingFailed(
                RunResult(exit_code=ExitCode.RANK_FAILURE, reason=str(exc))
            ) from exc
        except Exception as exc:
            raise TrainingFailed(
                RunResult(
                    exit_code=ExitCode.RANK_FAILURE,
                    reason=f"rank {os.environ.get('RANK')} raised {exc!r}",
                )
            ) from exc
        return _trained(fields, primary=primary)

    def request_stop(self) -> None:
        """A rank does not stop on its own: the coordinator decides (a signal reaches the launcher
        first)."""

    def force_stop(self) -> None:
        """Forcing a rank is the agent's business (TERM, then KILL)."""


def rank_worker(trainer: Trainer) -> Worker:
    """The cooperative tier in a rank: the user's thread is the compute side."""
    from .api import _trained

    inbox: collections.deque[EpochMetrics] = collections.deque()
    session = _open_session(trainer, inbox.append)

    def finish(fields: Mapping[str, Any]) -> TrainedState:
        session.link.close(m.Exiting(rank=session.rank, reason="done"))
        return _trained(fields, primary=session.primary)

    return Worker(
        session.compute,
        session.schedule,
        primary=session.primary,
        inbox=inbox,
        finish=finish,
        close=lambda: _close_session(session, None),
    )
