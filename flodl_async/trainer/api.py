"""The Trainer: ``state = await trainer.run()``, the same script as launcher, as every rank, or
inline.

Theory of operation. ``Trainer(...)`` is pure: it validates its arguments and
touches no CUDA, socket or model, so building it at import time is safe in
every role. What ``run()`` does is decided from the environment alone
(:func:`flodl_async.trainer.entry.decide_entry`):

- INLINE: train in this process (compute thread), no coordinator
  (:mod:`flodl_async.trainer.inline`);
- RANK: the link thread joins the coordinator through the host's relay, the compute thread
  trains what it is planned and contributes to the reduces (:mod:`flodl_async.trainer.rank`);
- LAUNCHER: the controller runs on the caller's event loop and re-executes this
  program as the ranks (:mod:`flodl_async.trainer.launcher`);
- AGENT: the agent runs until its session ends, then the process exits.

``start()`` returns a :class:`TrainingRun` handle at once. The run is a task held
by the module-level ``_LIVE_RUNS`` set, not by the handle: asyncio keeps only
weak references to tasks, and dropping the handle must not cancel training.
``join()`` is shielded; ``shutdown()``, from any process of the run, is the one explicit cancel;
cancelling ``trainer.run()`` is an orderly shutdown, and so is Ctrl-C (or SIGTERM) to the
launcher or to an inline run, which take the first stop signal on the caller's loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import secrets
import sys
import threading
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..agent.cli import main as agent_main
from ..cli.verdictline import verdict_line
from ..config.cluster import ClusterSpec
from ..config.rankenv import RUN_ID_VAR
from ..config.roles import AGENT_VAR, Role, detect_role
from ..errors import ConfigError, TrainingFailed
from ..host.gpus import host_visible_gpus
from ..net.loop import run as run_loop
from ..training.outer import OuterAvg
from ..training.policy import Backend, Policy
from ..training.spec import Checkpointing, ElCheConfig, MaxFailure, TrainerSpec
from ..verdict import ExitCode, RunResult
from .checks import check_data, check_functions, check_policy, check_rest
from .checks import max_failure as max_failure_of
from .entry import Entry, decide_entry, note_rank_restarts, restarts_setting
from .inline import InlineDriver, inline_worker
from .rank import RankDriver, rank_worker
from .state import RunRequest, TrainedState
from .worker import ComputeConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..training.metrics import EpochMetrics
    from ..training.outer import OuterSpec
    from .worker import Worker

log = logging.getLogger("flodl_async.trainer.api")


class _Driver(Protocol):
    """One role's way of running a training (inline, rank, launcher)."""

    primary: bool

    async def run(self, publish: Callable[[EpochMetrics], None]) -> TrainedState:
        """Train; ``publish`` may be called from any thread."""
        ...

    def request_stop(self) -> None:
        """Ask for an orderly stop (a final round where there is a cohort); returns at once."""
        ...

    def force_stop(self) -> None:
        """The grace is over: stop now."""
        ...

    def request_checkpoint(self) -> None:
        """A checkpoint bundle at the next reduce boundary; returns at once."""
        ...


#: Runs in flight in this process: the owner of their tasks (a dropped handle must not let a run be
#: collected).
_LIVE_RUNS: set[TrainingRun] = set()


class TrainingRun:
    """A handle on a run started by :meth:`Trainer.start`; dropping it does not cancel the run.

    ``metrics()``, ``poll_metrics()`` and ``next_metrics()`` share one queue: each
    :class:`~flodl_async.training.metrics.EpochMetrics` is delivered once.
    """

    def __init__(
        self, driver: _Driver, *, entry: Entry, run_id: str, checkpoint: Checkpointing
    ) -> None:
        self.entry = entry
        self._checkpointing = checkpoint
        self.primary = driver.primary
        self.run_id = run_id
        self._driver = driver
        self._loop = asyncio.get_running_loop()
        self._queue: collections.deque[EpochMetrics] = collections.deque()
        self._arrived = asyncio.Event()
        self._stopping = False
        self._task = self._loop.create_task(self._main(), name=f"trainer-run-{run_id}")
        _LIVE_RUNS.add(self)
        self._task.add_done_callback(self._ended)

    async def _main(self) -> TrainedState:
        try:
            return await self._driver.run(self._publish)
        except asyncio.CancelledError:
            # Only the loop closing cancels this task (nothing else holds it): stop in order, then
            # go.
            if not self._stopping:
                log.warning(
                    "the event loop is closing with run %s still training; stopping it (keep a "
                    "reference and await run.join(), or call run.shutdown())",
                    self.run_id,
                )
            self._driver.request_stop()
            raise

    def _ended(self, _task: asyncio.Task[TrainedState]) -> None:
        _LIVE_RUNS.discard(self)
        self._arrived.set()

    def _publish(self, metrics: EpochMetrics) -> None:
        """Thread-safe: queue one epoch's metrics for the handle (in order, ahead of the run's end,
        which is scheduled after)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody can read them any more
            self._loop.call_soon_threadsafe(self._push, metrics)

    def _push(self, metrics: EpochMetrics) -> None:
        self._queue.append(metrics)
        self._arrived.set()

    def poll_metrics(self) -> list[EpochMetrics]:
        """Every queued epoch, without waiting."""
        drained = list(self._queue)
        self._queue.clear()
        return drained

    async def next_metrics(self) -> EpochMetrics | None:
        """The next epoch's metrics; None once the run is over and the queue is empty."""
        while not self._queue:
            if self._task.done():
                return None
            self._arrived.clear()
            await self._arrived.wait()
        return self._queue.popleft()

    async def metrics(self) -> AsyncIterator[EpochMetrics]:
        """Each aggregated epoch as it comes; ends when the run ends."""
        while (metrics := await self.next_metrics()) is not None:
            yield metrics

    def done(self) -> bool:
        """True once the run has ended (either way)."""
        return self._task.done()

    async def join(self) -> TrainedState:
        """Wait for the end. Shielded: cancelling this await does not cancel the run.

        A failed run raises :class:`~flodl_async.errors.TrainingFailed`; a degraded success returns
        with ``lost_ranks`` set.
        """
        return await asyncio.shield(self._task)

    async def checkpoint(self) -> None:
        """A checkpoint bundle at the next reduce boundary, asked from any process of the run
        (inline: after the current batch). Returns once asked: the bundle is written in the
        background while training goes on (the launcher's log names it, and the run's
        ``TrainedState.checkpoint`` is the last one written). Needs a ``Checkpointing(save_path=)``.
        """
        if self._checkpointing.save_path is None:
            raise ConfigError(
                "TrainingRun.checkpoint() needs somewhere to write: pass "
                "Trainer(checkpoint=fa.Checkpointing(save_path='ckpt/run'))"
            )
        self._driver.request_checkpoint()

    async def shutdown(self, *, save: bool | None = None, grace: float = 30.0) -> TrainedState:
        """The explicit cancel, from any process of the run: an orderly stop of the whole run.

        The launcher, any rank or the inline process asks the coordinator for a final round (inline:
        the run ends after the current batch); every process's run then returns the state with
        ``interrupted=True``. After ``grace`` seconds the launcher forces its ranks to stop; a rank
        keeps waiting for the coordinator's end (forcing it is its agent's business).

        The stop writes a checkpoint bundle when the Trainer's ``Checkpointing`` has a
        ``save_path`` and ``on_shutdown`` (the default). ``save``: None, as configured; ``True`` or
        ``False`` must agree with it (the run's processes agreed on it at the start, so it is not
        changed here): a ``save`` that disagrees is a ``ConfigError`` saying what to set instead.
        """
        configured = self._checkpointing.save_path is not None and self._checkpointing.on_shutdown
        if save is not None and bool(save) != configured:
            raise ConfigError(
                f"TrainingRun.shutdown(save={save!r}): this run "
                + (
                    "writes a bundle on an orderly stop; to stop without one, build the Trainer "
                    "with Checkpointing(on_shutdown=False)"
                    if configured
                    else "has no Checkpointing(save_path=..., on_shutdown=True) to save with; "
                    "set it on the Trainer, or call shutdown() without save="
                )
            )
        self._stopping = True
        self._driver.request_stop()
        try:
            async with asyncio.timeout(grace):
                return await asyncio.shield(self._task)
        except TimeoutError:
            self._driver.force_stop()
            return await asyncio.shield(self._task)


class Trainer:
    """Distributed data-parallel training that copes with ranks of different speeds.

    Every process (launcher and ranks) builds the same Trainer from the same
    arguments; each rank builds its own dataset and model. Construction is pure
    and validates: each error names the field and what to do.
    """

    def __init__(
        self,
        *,
        model: Callable[[torch.device], nn.Module],
        optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        train_step: Callable[[nn.Module, Any], torch.Tensor],
        dataset: Any,
        batch_size: int,
        epochs: int,
        collate: Callable[[list[Any]], Any] | None = None,
        policy: Policy = Policy.CADENCE,
        backend: Backend = Backend.CPU,
        elche: ElCheConfig | None = None,
        outer: OuterSpec | None = None,
        checkpoint: Checkpointing | None = None,
        max_failure: MaxFailure | int | float | None = None,
        cluster: ClusterSpec | str | os.PathLike[str] | None = None,
        rank_command: Sequence[str] | None = None,
        max_restarts: int = 0,
        auto_promote: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        lr_schedule: Callable[[float], float] | None = None,
        max_grad_norm: float | None = None,
        heartbeat_timeout: float = 10.0,
        name: str = "",
    ) -> None:
        check_functions(
            model=model,
            optimizer=optimizer,
            train_step=train_step,
            collate=collate,
            lr_schedule=lr_schedule,
        )
        self.dataset_len = check_data(
            dataset, batch_size=batch_size, epochs=epochs, drop_last=drop_last
        )
        self.batch_size, self.epochs = batch_size, epochs
        elche = ElCheConfig() if elche is None else elche
        outer = OuterAvg() if outer is None else outer
        checkpoint = Checkpointing() if checkpoint is None else checkpoint
        check_policy(
            policy=policy, backend=backend, elche=elche, outer=outer, checkpoint=checkpoint
        )
        self.max_failure = max_failure_of(max_failure)
        #: The launcher's ``--max-restarts`` (:func:`~.entry.restarts_setting`).
        self.max_restarts = restarts_setting(max_restarts)
        check_rest(
            cluster=cluster,
            rank_command=rank_command,
            seed=seed,
            max_grad_norm=max_grad_norm,
            heartbeat_timeout=heartbeat_timeout,
            name=name,
        )
        self.model = model
        self.optimizer = optimizer
        self.train_step = train_step
        self.dataset = dataset
        self.collate = collate
        self.policy = policy
        self.backend = backend
        self.elche = elche
        self.outer: OuterSpec = outer
        self.checkpoint = checkpoint
        self.cluster = cluster
        self.rank_command = tuple(rank_command) if rank_command is not None else None
        self.auto_promote = bool(auto_promote)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.lr_schedule = lr_schedule
        self.max_grad_norm = float(max_grad_norm) if max_grad_norm is not None else None
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.name = name
        self.spec()  # the cross-field rules (a setting this policy or backend does not honour)

    # ----- what this process is ----------------------------------------------------------------

    @property
    def entry(self) -> Entry:
        """What ``run()`` would do in this process, without doing it."""
        env = os.environ
        return decide_entry(
            env,
            cluster_given=self.cluster is not None,
            auto_promote=self.auto_promote,
            visible_gpus=len(host_visible_gpus(env)),
        )

    def spec(self) -> TrainerSpec:
        """The serializable, digestable config the coordinator and reducer run from."""
        return TrainerSpec(
            policy=self.policy,
            backend=self.backend,
            epochs=self.epochs,
            batch_size=self.batch_size,
            dataset_len=self.dataset_len,
            drop_last=self.drop_last,
            seed=self.seed,
            elche=self.elche,
            outer=self.outer,
            checkpoint=self.checkpoint,
            max_failure=self.max_failure,
            heartbeat_timeout=self.heartbeat_timeout,
            lr_schedule=self.lr_schedule is not None,
            max_grad_norm=self.max_grad_norm,
            name=self.name,
        )

    def compute_config(self) -> ComputeConfig:
        """The arguments that make a step, for the compute side."""
        return ComputeConfig(
            model=self.model,
            optimizer=self.optimizer,
            train_step=self.train_step,
            dataset=self.dataset,
            collate=self.collate,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            seed=self.seed,
            lr_schedule=self.lr_schedule,
            max_grad_norm=self.max_grad_norm,
        )

    def run_request(self) -> RunRequest:
        """What a rank or launcher driver runs from: this Trainer's arguments, frozen."""
        return RunRequest(
            spec=self.spec(),
            compute=self.compute_config(),
            cluster=self.cluster,
            rank_command=self.rank_command,
            max_restarts=self.max_restarts,
        )

    # ----- entry points ------------------------------------------------------------------------

    async def run(self) -> TrainedState:
        """``start()`` + ``join()``; cancelling this coroutine is an orderly shutdown (bounded by 30
        s), then it re-raises."""
        return await _join_or_stop(self.start())

    def start(self) -> TrainingRun:
        """Start the run on the running loop and return its handle at once."""
        entry = self.entry
        if entry is Entry.AGENT:
            exit_if_worker_role()
        driver = self._driver(entry)
        _end_uncaught_training_failures_plainly(entry)
        run_id = (
            getattr(driver, "run_id", None)
            or os.environ.get(RUN_ID_VAR)
            or f"inline-{secrets.token_hex(4)}"
        )
        return TrainingRun(driver, entry=entry, run_id=run_id, checkpoint=self.checkpoint)

    def _driver(self, entry: Entry) -> _Driver:
        if entry is Entry.INLINE:
            return InlineDriver(self.compute_config(), spec=self.spec())
        if entry is Entry.RANK:
            self._one_session()
            note_rank_restarts(self.max_restarts, os.environ)
            return RankDriver(self.run_request())
        from .launcher import LauncherDriver  # deferred: it loads asyncssh, which no rank needs

        return LauncherDriver(self.run_request())

    async def _launch_to_its_end(self) -> int:
        """The cooperative tier's launcher: the run, its verdict line once it is not a plain
        ``done`` and the exit-table code, as ``flodl-launch`` ends (130/143 after a signal)."""
        try:
            handle = self.start()
            state = await _join_or_stop(handle)
        except TrainingFailed as exc:
            _print_verdict(exc)
            return int(exc.result.exit_code)
        result: RunResult | None = getattr(handle._driver, "result", None)
        if result is None:
            return 0
        if state.interrupted:
            print(verdict_line("flodl", result, interrupted=True), file=sys.stderr)
        return int(result.exit_code)

    def _one_session(self) -> None:
        if _RANK_SESSION.is_set():
            raise ConfigError(
                "a cluster training session was already run in this process — the rank's relay "
                "link and the coordinator are per-session. "
                "Run one Trainer per process: loop at the process level (invoke the script once "
                "per model)."
            )
        _RANK_SESSION.set()

    def worker(self) -> Worker:
        """The cooperative tier: ``with trainer.worker() as w:`` — a synchronous API,
        the user owns the loop."""
        entry = self.entry
        if entry is Entry.AGENT:
            exit_if_worker_role()
        if entry is Entry.LAUNCHER:
            # The launcher has no cooperative loop to hand back: it runs the launch, reports and
            # exits.
            clean_exit(run_loop(self._launch_to_its_end()))
        if entry is Entry.RANK:
            self._one_session()
            return rank_worker(self.run_request())
        return inline_worker(self.compute_config(), spec=self.spec())


async def _join_or_stop(handle: TrainingRun) -> TrainedState:
    """``handle.join()``; cancelled, an orderly shutdown (bounded by 30 s), then it re-raises."""
    try:
        return await handle.join()
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await handle.shutdown(grace=30.0)
        raise


#: Set once a rank's session started: a rank's relay link and coordinator are per process.
_RANK_SESSION = threading.Event()


def _print_verdict(exc: TrainingFailed) -> None:
    # a signal's end is "stopped — interrupted by SIGINT", as flodl-launch says it
    print(verdict_line("flodl", exc.result), file=sys.stderr)
    # the launcher's console shows every rank: a traceback it showed is not repeated
    details = exc.result.details_for(None)
    if details:
        print(details, file=sys.stderr)


def _end_uncaught_training_failures_plainly(entry: Entry) -> None:
    """A script that lets ``TrainingFailed`` escape ends plainly, without a traceback of flodl's
    internals.

    In the launcher (and inline, after the traceback of what the user's code raised) it ends as
    ``flodl-launch`` would: the verdict line and the exit-code table's
    code (4 for a rank failure, 3 for a world that did not form...) instead of exit 1; the failing
    rank's own traceback is already in the run's output. In a rank, the traceback of what the
    user's code raised (the failure's cause) and one line, instead of that traceback chained to
    the internals that re-raised it; the rank exits 1, as for any uncaught exception. An
    application that catches the exception is not affected, and any other uncaught exception goes
    to the hook that was there before.
    """
    previous = sys.excepthook
    if getattr(previous, "flodl_training_hook", False):
        return

    def end_plainly(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        if not isinstance(exc, TrainingFailed):
            previous(kind, exc, tb)
            return
        if entry is not Entry.RANK:  # the launcher, or one process inline
            if entry is Entry.INLINE and exc.__cause__ is not None:
                traceback.print_exception(exc.__cause__)  # no rank printed it: this process ran it
            _print_verdict(exc)
            code = int(exc.result.exit_code)
        else:
            if exc.__cause__ is not None:
                traceback.print_exception(exc.__cause__)
            print(f"flodl: rank {os.environ.get('RANK', '?')}: {exc}", file=sys.stderr)
            code = 1
        # CPython exits with a SystemExit raised by the excepthook (atexit handlers still run).
        raise SystemExit(code)

    end_plainly.flodl_training_hook = True  # type: ignore[attr-defined]
    sys.excepthook = end_plainly


# ----- roles that never train here ---------------------------------------------------------------


def current_role() -> Role:
    """This process's role, from the environment (for scripts that gate themselves before
    ``run()``)."""
    return detect_role(os.environ)


def clean_exit(code: int) -> None:
    """Flush stdout/stderr and ``os._exit(code)``: skip interpreter teardown (torch's costs 0.3-0.5
    s)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def exit_if_worker_role() -> None:
    """In an agent process, run the agent to its end and exit; anywhere else, return at once.

    Call it first in a script that gates before ``run()``. Launcher and rank pass through — and rank
    processes run the gate too, so a gate must not assume it sees the whole world.
    ``FLODL_INTERNAL_AGENT_SPEC`` holds the ``flodl-agent`` arguments as a JSON list.
    """
    env = os.environ
    if detect_role(env) is not Role.AGENT:
        return
    try:
        args = json.loads(env[AGENT_VAR])
    except ValueError:
        args = None
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        print(
            f"flodl: {AGENT_VAR} must hold the flodl-agent arguments as a JSON list of strings; "
            f"got {env[AGENT_VAR]!r}",
            file=sys.stderr,
        )
        clean_exit(int(ExitCode.USAGE))
    clean_exit(agent_main(args))
