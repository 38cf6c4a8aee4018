"""flodl_async: an asyncio-native launcher and orchestration daemon for distributed PyTorch
training.

The Trainer API (``fa.Trainer``, ``fa.Policy``, ...) is imported on first use: the control plane
(``flodl-launch``, ``flodl-agent``) never pays for it, and nothing here imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_names
from ._version import __version__

#: Public name -> the module that defines it (loaded on first attribute access, PEP 562).
_LAZY = {
    "Trainer": "trainer.api",
    "TrainedState": "trainer.state",
    "TrainingRun": "trainer.api",
    "exit_if_worker_role": "trainer.api",
    "clean_exit": "trainer.api",
    "current_role": "trainer.api",
    "Entry": "trainer.entry",
    "Worker": "trainer.worker",
    "record_scalar": "trainer.worker",
    "report": "trainer.worker",
    "Policy": "training.policy",
    "Backend": "training.policy",
    "ElCheConfig": "training.spec",
    "TrendGuard": "training.spec",
    "Checkpointing": "training.spec",
    "MaxFailure": "training.spec",
    "OuterAvg": "training.outer",
    "SlowMo": "training.outer",
    "DiLoCo": "training.outer",
    "EpochMetrics": "training.metrics",
    "RankEpochStats": "training.metrics",
    "TrainingFailed": "errors",
    "TrainingStopped": "errors",
    "run": "net.loop",
}

__all__ = [  # noqa: RUF022 (grouped as _LAZY is)
    "__version__",
    "Trainer",
    "TrainedState",
    "TrainingRun",
    "exit_if_worker_role",
    "clean_exit",
    "current_role",
    "Entry",
    "Worker",
    "record_scalar",
    "report",
    "Policy",
    "Backend",
    "ElCheConfig",
    "TrendGuard",
    "Checkpointing",
    "MaxFailure",
    "OuterAvg",
    "SlowMo",
    "DiLoCo",
    "EpochMetrics",
    "RankEpochStats",
    "TrainingFailed",
    "TrainingStopped",
    "run",
]

if TYPE_CHECKING:
    from .errors import TrainingFailed, TrainingStopped
    from .net.loop import run
    from .trainer.api import (
        Trainer,
        TrainingRun,
        clean_exit,
        current_role,
        exit_if_worker_role,
    )
    from .trainer.entry import Entry
    from .trainer.state import TrainedState
    from .trainer.worker import Worker, record_scalar, report
    from .training.metrics import EpochMetrics, RankEpochStats
    from .training.outer import DiLoCo, OuterAvg, SlowMo
    from .training.policy import Backend, Policy
    from .training.spec import Checkpointing, ElCheConfig, MaxFailure, TrendGuard

__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__, globals())
