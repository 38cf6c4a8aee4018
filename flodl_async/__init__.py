"""flodl_async: an asyncio-native launcher and orchestration daemon for distributed PyTorch training.

The Trainer API (``fa.Trainer``, ``fa.Policy``, ...) is imported on first use: the control plane
(``flodl-launch``, ``flodl-agent``) never pays for it, and nothing here imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> the module that defines it (loaded on first attribute access, PEP 562).
_LAZY = {
    "Trainer": "trainer",
    "TrainedState": "trainer",
    "TrainingRun": "trainer",
    "exit_if_worker_role": "trainer",
    "clean_exit": "trainer",
    "current_role": "trainer",
    "Entry": "trainer_roles",
    "Worker": "worker",
    "record_scalar": "worker",
    "Policy": "policy",
    "Backend": "policy",
    "ElCheConfig": "trainspec",
    "TrendGuard": "trainspec",
    "Checkpointing": "trainspec",
    "MaxFailure": "trainspec",
    "OuterAvg": "outer",
    "SlowMo": "outer",
    "DiLoCo": "outer",
    "EpochMetrics": "metrics",
    "RankEpochStats": "metrics",
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
    from .metrics import EpochMetrics, RankEpochStats
    from .net.loop import run
    from .outer import DiLoCo, OuterAvg, SlowMo
    from .policy import Backend, Policy
    from .trainer import TrainedState, Trainer, TrainingRun, clean_exit, current_role, exit_if_worker_role
    from .trainer_roles import Entry
    from .trainspec import Checkpointing, ElCheConfig, MaxFailure, TrendGuard
    from .worker import Worker, record_scalar


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'flodl_async' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
