"""The compute side of a Trainer process: what a step is, which batch comes next, and the
cooperative ``Worker``.

Theory of operation. :class:`Compute` owns one process's model, optimizer and
dataset: it fetches a batch (``__getitems__`` when the dataset has it, else one
``__getitem__`` per sample, then ``collate``), moves it to the device, and
finishes a step (clip, ``optimizer.step()``, ``zero_grad``). Which batch comes
next is a :class:`Schedule`'s business (:mod:`flodl_async.trainer.schedule`): the
inline schedule walks every epoch's permutation in this process; the rank
schedule follows the coordinator's plans and carries out its reduces at step
boundaries. Both run on a compute thread that is not an event loop's: the
managed loop (:func:`run_managed`) or the user's own thread (:class:`Worker`).

torch is imported only here and only when a :class:`Compute` is built: the
Trainer's construction and the launcher never need it.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, SupportsFloat

from ..config.roles import Role, detect_role
from ..errors import ConfigError, RoleError
from ..training.partition import permutation

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..training.metrics import EpochMetrics
    from .reporter import Reporter

#: What ``collate`` returns and ``train_step`` takes: the user's business.
Batch = Any

_sink = threading.local()


def report(**scalars: float) -> None:
    """Report named scalars (``fa.report(loss=..., lr=...)``) to the run's status.

    Inside a Trainer's ``train_step`` they are averaged per epoch over every rank's reports (the
    epoch's metrics, on the page and in ``/metrics`` as ``flodl_scalar{rank="all"}``). Anywhere
    else in a flodl rank — a plain torchrun-contract script — the latest value of each goes up
    this host's relay within a second (``flodl_scalar{name,rank}``, the page, the event log).
    Outside a flodl run it does nothing, so a script keeps working under torchrun or alone.
    """
    for name, value in scalars.items():
        if isinstance(value, bool) or not isinstance(value, SupportsFloat):
            raise TypeError(f"fa.report: {name}={value!r} is not a number (pass a float)")
    stats: WindowStats | None = getattr(_sink, "stats", None)
    if stats is not None:
        for name, value in scalars.items():
            stats.scalar_sums[name] = stats.scalar_sums.get(name, 0.0) + float(value)
            stats.scalar_counts[name] = stats.scalar_counts.get(name, 0) + 1
        return
    reporter = _reporter()
    if reporter is not None:
        reporter.offer(scalars)


def record_scalar(name: str, value: float) -> None:
    """The older name of :func:`report` for one scalar: ``report(**{name: value})``."""
    report(**{name: value})


_reporter_lock = threading.Lock()
_reporter_made: list[Reporter | None] = []  # empty until the first report outside a step


def _reporter() -> Reporter | None:
    """This process's reporter: made on the first report of a flodl rank, None anywhere else."""
    with _reporter_lock:
        if not _reporter_made:
            try:
                rank = detect_role(os.environ) is Role.RANK
            except RoleError:  # a mixed-up environment is the launch's to report, not a metric's
                rank = False
            if rank:
                # deferred: start path — the relay link's modules load on the first report only
                from .reporter import Reporter

                _reporter_made.append(Reporter())
            else:
                _reporter_made.append(None)
        return _reporter_made[0]


@dataclass(slots=True)
class WindowStats:
    """What a process trained since it last reported (one ``WindowDone``, or one inline epoch)."""

    batches: int = 0
    samples: int = 0
    compute_ms: float = 0.0
    data_ms: float = 0.0
    loss_sum: float = 0.0
    scalar_sums: dict[str, float] = field(default_factory=dict)
    scalar_counts: dict[str, int] = field(default_factory=dict)

    def add(self, *, loss: float, samples: int, compute_ms: float, data_ms: float) -> None:
        """One finished batch."""
        self.batches += 1
        self.samples += samples
        self.compute_ms += compute_ms
        self.data_ms += data_ms
        self.loss_sum += loss

    def merge(self, other: WindowStats) -> None:
        """Add what ``other`` gathered."""
        self.batches += other.batches
        self.samples += other.samples
        self.compute_ms += other.compute_ms
        self.data_ms += other.data_ms
        self.loss_sum += other.loss_sum
        for name, value in other.scalar_sums.items():
            self.scalar_sums[name] = self.scalar_sums.get(name, 0.0) + value
            self.scalar_counts[name] = self.scalar_counts.get(name, 0) + other.scalar_counts[name]

    def take(self) -> WindowStats:
        """A copy of what was gathered, and start again from zero."""
        taken = WindowStats(
            self.batches,
            self.samples,
            self.compute_ms,
            self.data_ms,
            self.loss_sum,
            dict(self.scalar_sums),
            dict(self.scalar_counts),
        )
        self.batches, self.samples, self.compute_ms, self.data_ms, self.loss_sum = (
            0,
            0,
            0.0,
            0.0,
            0.0,
        )
        self.scalar_sums.clear()
        self.scalar_counts.clear()
        return taken


def fetch_batch(
    dataset: Any, indices: Sequence[int], collate: Callable[[list[Any]], Batch]
) -> Batch:
    """The samples at ``indices``, collated: one ``__getitems__`` call when the dataset has it
    (torch's batched fetch)."""
    getitems = getattr(dataset, "__getitems__", None)
    items = list(getitems(list(indices))) if getitems is not None else [dataset[i] for i in indices]
    return collate(items)


def to_device(batch: Batch, device: torch.device) -> Batch:
    """``batch`` with every tensor inside it (lists, tuples, dicts) on ``device``; a no-op on
    CPU."""
    import torch  # deferred: torch loads when a process builds its model, never before

    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, list):
        return [to_device(v, device) for v in batch]
    if isinstance(batch, tuple):
        moved = [to_device(v, device) for v in batch]
        # a namedtuple keeps its type
        return type(batch)(*moved) if hasattr(batch, "_fields") else tuple(moved)
    return batch


def default_device(local_rank: int = 0) -> torch.device:
    """``cuda:<local_rank>`` when CUDA is available (the agent's ``CUDA_VISIBLE_DEVICES`` picks the
    GPU), else CPU."""
    import torch  # deferred: torch loads when a process builds its model, never before

    if torch.cuda.is_available():
        index = local_rank % max(torch.cuda.device_count(), 1)
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


@dataclass(frozen=True, slots=True, kw_only=True)
class ComputeConfig:
    """The Trainer's arguments that make a step (everything but the coordination)."""

    model: Callable[[Any], Any]
    optimizer: Callable[[Any], Any]
    train_step: Callable[[Any, Batch], Any]
    dataset: Any
    collate: Callable[[list[Any]], Batch] | None
    batch_size: int
    drop_last: bool
    seed: int
    lr_schedule: Callable[[float], float] | None
    max_grad_norm: float | None


class Compute:
    """One process's model, optimizer and data (built on the compute side, on its device)."""

    def __init__(self, config: ComputeConfig, device: torch.device) -> None:
        import torch  # deferred: torch loads when a process builds its model, never before
        from torch.utils.data import default_collate  # deferred with torch

        self.config = config
        self.device = device
        model = config.model(device)
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(
                "Trainer(model=...) must return a torch.nn.Module built on the device it is "
                f"given; it returned {type(model).__name__}"
            )
        self.model: nn.Module = model
        optimizer = config.optimizer(model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                "Trainer(optimizer=...) must return a torch.optim.Optimizer, it returned "
                f"{type(optimizer).__name__}"
            )
        self.optimizer: torch.optim.Optimizer = optimizer
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self.collate: Callable[[list[Any]], Batch] = config.collate or default_collate
        self.dataset_len = len(config.dataset)
        full, rest = divmod(self.dataset_len, config.batch_size)
        self.n_batches = full if config.drop_last or rest == 0 else full + 1
        self._perm_epoch = -1
        self._perm: Sequence[int] = ()
        self.param_names = tuple(name for name, _ in model.named_parameters())

    def batch_indices(self, epoch: int, batch: int) -> list[int]:
        """Samples of batch ``batch`` of epoch ``epoch``: a slice of that epoch's permutation (the
        same on every rank)."""
        if epoch != self._perm_epoch:
            self._perm = permutation(self.dataset_len, self.config.seed, epoch)
            self._perm_epoch = epoch
        size = self.config.batch_size
        return [int(i) for i in self._perm[batch * size : (batch + 1) * size]]

    def load(self, epoch: int, batch: int) -> tuple[Batch, int]:
        """Batch ``batch`` of epoch ``epoch``, collated and on the device, and its sample count."""
        indices = self.batch_indices(epoch, batch)
        return to_device(fetch_batch(self.config.dataset, indices, self.collate), self.device), len(
            indices
        )

    def set_progress(self, progress: float) -> None:
        """Epoch progress → each group's LR (a function of progress, not of per-rank step
        counts)."""
        schedule = self.config.lr_schedule
        if schedule is None:
            return
        factor = float(schedule(progress))
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor

    def finish_step(self) -> None:
        """Clip, step, zero the gradients (the user's code did forward, loss and backward)."""
        import torch  # deferred: torch loads when a process builds its model, never before

        if self.config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def train_one(self, epoch: int, batch: int, stats: WindowStats) -> float:
        """The managed tier's step: fetch, ``train_step``, backward, finish; its numbers go to
        ``stats``."""
        started = time.perf_counter()
        data, samples = self.load(epoch, batch)
        loaded = time.perf_counter()
        _sink.stats = stats
        try:
            loss = self.config.train_step(self.model, data)
            loss_value = _check_loss(loss)
            loss.backward()
            self.finish_step()
        finally:
            _sink.stats = None
        done = time.perf_counter()
        stats.add(
            loss=loss_value,
            samples=samples,
            compute_ms=(done - loaded) * 1e3,
            data_ms=(loaded - started) * 1e3,
        )
        return loss_value

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state on CPU, detached copies (tied keys included, as ``state_dict()`` has
        them)."""
        return {
            name: t.detach().to("cpu", copy=True) for name, t in self.model.state_dict().items()
        }


def _check_loss(loss: Any) -> float:
    import torch  # deferred: torch loads when a process builds its model, never before

    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError(
            "Trainer(train_step=...) must return the loss as a one-element tensor, it returned "
            f"{type(loss).__name__}"
        )
    value = float(loss.detach())
    if not math.isfinite(value):
        raise FloatingPointError(
            f"the loss is {value}: training diverged (lower the learning rate, or set "
            "max_grad_norm)"
        )
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class Work:
    """One batch to train: which epoch's pool and which batch index in it; ``plan`` numbers the plan
    it belongs to."""

    epoch: int
    batch: int
    plan: int
    progress: float


class Schedule(Protocol):
    """Which batch comes next, and what happens between steps (reduces, metrics, stops)."""

    def next_work(self) -> Work | None:
        """The next batch (blocking while the coordinator holds this process); None once the run is
        over."""
        ...

    def after_step(self, stats: WindowStats) -> bool:
        """One batch finished (its numbers are in ``stats``); True when the run is stopping."""
        ...

    def finish(self) -> Mapping[str, Any]:
        """The run is over on this side: the final state and counters (``TrainedState`` fields)."""
        ...

    def fail(self, exc: BaseException) -> None:
        """The compute side failed with ``exc``: tell whoever waits on this process."""
        ...

    def request_checkpoint(self) -> None:
        """A checkpoint bundle at the next reduce boundary (inline: after this step)."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOutcome:
    """What ``Worker.step()`` did."""

    loss: float
    shutdown: bool


def run_managed(compute: Compute, schedule: Schedule) -> Mapping[str, Any]:
    """The managed tier's loop, on the compute thread: train what the schedule gives until it
    ends."""
    stats = WindowStats()
    try:
        while (work := schedule.next_work()) is not None:
            compute.set_progress(work.progress)
            compute.train_one(work.epoch, work.batch, stats)
            if schedule.after_step(stats):
                break
        return schedule.finish()
    except BaseException as exc:
        schedule.fail(exc)
        raise


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanView:
    """One plan the cooperative loop works through: ``epoch`` repeats across a CADENCE epoch's
    windows."""

    epoch: int
    plan: int


class Worker:
    """The cooperative tier: the user owns the batch loop, the coordinator stays
    authoritative.

    A synchronous API, used from the user's own thread::

        with trainer.worker() as w:
            for plan in w.plans():
                for batch in w.batches():
                    loss = my_loss(w.model, batch)
                    loss.backward()
                    if w.step(loss).shutdown:
                        break
            state = w.finish()

    ``step()`` is where the reduce happens; the user never calls ``optimizer.step()``. Leaving the
    ``with`` block on an exception without ``finish()`` tells the coordinator (a death record, so no
    peer waits on this rank) and re-raises.
    """

    def __init__(
        self,
        compute: Compute,
        schedule: Schedule,
        *,
        primary: bool,
        inbox: collections.deque[EpochMetrics],
        finish: Callable[[Mapping[str, Any]], Any],
        close: Callable[[], None],
    ) -> None:
        self._compute = compute
        self._schedule = schedule
        self.primary = primary
        self._finish_state = finish
        self._close = close
        self._stats = WindowStats()
        self._next: Work | None = None
        self._started = False
        self._over = False
        self._current: Work | None = None
        self._fetched_at = 0.0
        self._loaded_at = 0.0
        self._samples = 0
        self._result: Any = None
        # appended to by whoever receives the aggregated epochs (a deque: thread-safe)
        self._inbox = inbox

    @property
    def model(self) -> nn.Module:
        """The model, on this process's device."""
        return self._compute.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer (read it, e.g. for its LR; the framework steps it)."""
        return self._compute.optimizer

    @property
    def device(self) -> torch.device:
        """This process's device."""
        return self._compute.device

    def _peek(self) -> Work | None:
        if not self._started:
            self._next = self._schedule.next_work()
            self._started = True
        return self._next

    def plans(self) -> Iterator[PlanView]:
        """One view per plan, until the run is over."""
        while not self._over:
            work = self._peek()
            if work is None:
                self._over = True
                return
            yield PlanView(epoch=work.epoch, plan=work.plan)
            # the user skipped the plan's batches: train them is not optional
            if self._next is work:
                raise ConfigError(
                    "Worker.plans(): iterate w.batches() inside each plan (the coordinator planned "
                    "those batches)"
                )

    def batches(self) -> Iterator[Batch]:
        """The current plan's batches, collated and on the device; after each one call
        :meth:`step`."""
        work = self._peek()
        if work is None:
            return
        plan = work.plan
        while work is not None and work.plan == plan:
            self._compute.set_progress(work.progress)
            self._fetched_at = time.perf_counter()
            batch, self._samples = self._compute.load(work.epoch, work.batch)
            self._loaded_at = time.perf_counter()
            self._current = work
            _sink.stats = self._stats
            yield batch
            if self._awaiting_step():
                raise ConfigError(
                    "Worker.batches(): call w.step(loss) after each batch (it steps the optimizer "
                    "and reduces when due)"
                )
            work = self._next
            if self._over:
                return

    def _awaiting_step(self) -> bool:
        """The batch handed out last has not been stepped (``step()`` clears it, from the caller's
        side of the yield)."""
        return self._current is not None

    def request_checkpoint(self) -> None:
        """A checkpoint bundle of the whole run at the next reduce boundary (inline: after the
        current step); training goes on meanwhile. Needs ``Checkpointing(save_path=...)``."""
        self._schedule.request_checkpoint()

    def step(self, loss: torch.Tensor) -> StepOutcome:
        """Finish the batch (clip, step, zero_grad) and do the reduce when one is due."""
        if self._current is None:
            raise ConfigError(
                "Worker.step() without a batch: call it once after each batch of w.batches()"
            )
        _sink.stats = None
        value = _check_loss(loss)
        self._compute.finish_step()
        done = time.perf_counter()
        self._stats.add(
            loss=value,
            samples=self._samples,
            compute_ms=(done - self._loaded_at) * 1e3,
            data_ms=(self._loaded_at - self._fetched_at) * 1e3,
        )
        self._current = None
        stopping = self._schedule.after_step(self._stats)
        self._next = None if stopping else self._schedule.next_work()
        if self._next is None:
            self._over = True
        return StepOutcome(loss=value, shutdown=self._next is None)

    def poll_metrics(self) -> list[EpochMetrics]:
        """Aggregated epochs that arrived since the last call (non-blocking)."""
        drained: list[EpochMetrics] = []
        while self._inbox:
            drained.append(self._inbox.popleft())
        return drained

    def finish(self) -> Any:
        """End this process's part of the run and return its
        :class:`~flodl_async.trainer.state.TrainedState`."""
        if self._result is None:
            if not self._over:
                raise ConfigError(
                    "Worker.finish() before the plans ran out: finish the loop over w.plans() (or "
                    "break when w.step() says shutdown)"
                )
            self._result = self._finish_state(self._schedule.finish())
        return self._result

    def __enter__(self) -> Worker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc is not None and self._result is None:
                self._schedule.fail(exc)
        finally:
            _sink.stats = None
            self._close()
