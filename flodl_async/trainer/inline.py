"""The Trainer in one process, on one device: no coordinator, no averaging.

The inline driver trains every epoch on a compute thread of its own; the inline worker hands the
same schedule to the user's thread (the cooperative tier). Both read only the compute config and
the epoch count: with no other process there is no spec to agree on.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ConfigError, TrainingFailed
from ..training.metrics import EpochMetrics
from ..verdict import ExitCode, RunResult
from .schedule import InlineSchedule
from .state import TrainedState, on_thread, trained_state
from .worker import Compute, ComputeConfig, Worker, default_device, run_managed


class InlineDriver:
    """One process, one device: the compute thread trains every epoch."""

    primary = True

    def __init__(self, config: ComputeConfig, *, epochs: int) -> None:
        self._config = config
        self._epochs = epochs
        self._stop = threading.Event()

    async def run(self, publish: Callable[[EpochMetrics], None]) -> TrainedState:
        """Train every epoch on a compute thread; ``publish`` gets each epoch's metrics."""
        config, epochs = self._config, self._epochs

        def train() -> Mapping[str, Any]:
            compute = Compute(config, default_device())
            schedule = InlineSchedule(compute, epochs=epochs, publish=publish, stop=self._stop)
            return run_managed(compute, schedule)

        try:
            fields = await on_thread(train, name="flodl-compute", on_cancel=self._stop.set)
        except ConfigError:
            raise
        except Exception as exc:
            raise TrainingFailed(
                RunResult(exit_code=ExitCode.RANK_FAILURE, reason=f"this process raised {exc!r}")
            ) from exc
        return trained_state(fields, primary=True)

    def request_stop(self) -> None:
        """Stop after the current batch."""
        self._stop.set()

    def force_stop(self) -> None:
        """The same as :meth:`request_stop`: inline stops after the current batch, there is
        nothing to kill."""
        self._stop.set()


def inline_worker(config: ComputeConfig, *, epochs: int) -> Worker:
    """The cooperative tier in one process: the user's thread trains every epoch."""
    compute = Compute(config, default_device())
    inbox: collections.deque[EpochMetrics] = collections.deque()
    schedule = InlineSchedule(compute, epochs=epochs, publish=inbox.append, stop=threading.Event())
    return Worker(
        compute,
        schedule,
        primary=True,
        inbox=inbox,
        finish=lambda fields: trained_state(fields, primary=True),
        close=lambda: None,
    )
