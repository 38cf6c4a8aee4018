"""The Trainer in one process, on one device: no coordinator, no averaging.

The inline driver trains every epoch on a compute thread of its own; the inline worker hands the
same schedule to the user's thread (the cooperative tier). Both read only the compute config and
the epoch count: with no other process there is no spec to agree on.

While the driver trains, the first SIGINT (Ctrl-C) or SIGTERM is the orderly stop a launcher's is:
training ends after the current batch and ``run()`` returns the state with ``interrupted`` (left to
``asyncio.run``, Ctrl-C would cancel the program's main task and lose it). A second one goes to the
handler that was there before (``asyncio.run``'s, the interpreter's): the plain stop, without the
state.
"""

from __future__ import annotations

import collections
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import CheckpointInvalid, ConfigError, TrainingFailed
from ..net.signals import StopSignals
from ..training.metrics import EpochMetrics
from ..training.spec import TrainerSpec
from ..verdict import ExitCode, RunResult
from .inlinesave import InlineCheckpoints
from .schedule import InlineSchedule
from .state import TrainedState, on_thread, trained_state
from .worker import Compute, ComputeConfig, Worker, default_device, run_managed


class InlineDriver:
    """One process, one device: the compute thread trains every epoch."""

    primary = True

    def __init__(self, config: ComputeConfig, *, spec: TrainerSpec) -> None:
        self._config = config
        self._spec = spec
        self._schedule: InlineSchedule | None = None
        self._stop = threading.Event()
        self._signals = StopSignals(self._first_signal, self._later_signal, guest=True)

    async def run(self, publish: Callable[[EpochMetrics], None]) -> TrainedState:
        """Train every epoch on a compute thread; ``publish`` gets each epoch's metrics."""
        config, spec = self._config, self._spec

        def train() -> Mapping[str, Any]:
            compute = Compute(config, default_device())
            self._schedule = _schedule(compute, spec, publish, self._stop)
            return run_managed(compute, self._schedule)

        # A guest on the caller's loop: a program that handles these signals itself keeps them.
        self._signals.install()
        try:
            fields = await on_thread(train, name="flodl-compute", on_cancel=self._stop.set)
        except CheckpointInvalid as exc:
            # ends as the launcher's would (exit 2, one line): the bundle named cannot be resumed
            raise TrainingFailed(RunResult(exit_code=ExitCode.USAGE, reason=str(exc))) from None
        except ConfigError:
            raise
        except Exception as exc:
            raise TrainingFailed(
                RunResult(exit_code=ExitCode.RANK_FAILURE, reason=f"this process raised {exc!r}")
            ) from exc
        finally:
            self._signals.restore()
        return trained_state(fields, primary=True)

    def _first_signal(self, sig: signal.Signals) -> None:
        again = "Ctrl-C" if sig is signal.SIGINT else sig.name
        print(
            f"flodl: {sig.name}: stopping after the current batch, and run() returns the state "
            f"({again} again to stop without it)",
            file=sys.stderr,
            flush=True,
        )
        self._stop.set()

    def _later_signal(self, sig: signal.Signals) -> None:
        # forced: the handler that was there before (asyncio.run's, the interpreter's) takes it
        self._signals.restore()
        signal.raise_signal(sig)

    def request_stop(self) -> None:
        """Stop after the current batch."""
        self._stop.set()

    def force_stop(self) -> None:
        """The same as :meth:`request_stop`: inline stops after the current batch, there is
        nothing to kill."""
        self._stop.set()

    def request_checkpoint(self) -> None:
        """A bundle after the current batch."""
        schedule = self._schedule
        if schedule is not None and schedule.checkpoints is not None:
            schedule.checkpoints.request()


def _schedule(
    compute: Compute,
    spec: TrainerSpec,
    publish: Callable[[EpochMetrics], None],
    stop: threading.Event,
) -> InlineSchedule:
    checkpointing = spec.checkpoint.save_path is not None or spec.checkpoint.resume_from is not None
    return InlineSchedule(
        compute,
        epochs=spec.epochs,
        publish=publish,
        stop=stop,
        checkpoints=InlineCheckpoints(spec, compute) if checkpointing else None,
    )


def inline_worker(config: ComputeConfig, *, spec: TrainerSpec) -> Worker:
    """The cooperative tier in one process: the user's thread trains every epoch."""
    compute = Compute(config, default_device())
    inbox: collections.deque[EpochMetrics] = collections.deque()
    schedule = _schedule(compute, spec, inbox.append, threading.Event())
    return Worker(
        compute,
        schedule,
        primary=True,
        inbox=inbox,
        finish=lambda fields: trained_state(fields, primary=True),
        close=lambda: None,
    )
