"""The Trainer's argument checks: each error names the field and what to do instead.

Construction is pure (no CUDA, socket or model), so these look only at the values given; the
cross-field rules of the spec itself are :class:`~flodl_async.training.spec.TrainerSpec`'s.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from ..config.cluster import ClusterSpec
from ..errors import ConfigError
from ..training.outer import DiLoCo, OuterAvg, SlowMo
from ..training.policy import Backend, Policy
from ..training.spec import Checkpointing, ElCheConfig, MaxFailure

_OUTER_TYPES = (OuterAvg, SlowMo, DiLoCo)


def _positive_int(name: str, value: object, *, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(
            f"Trainer({name}=...) must be a whole number of at least 1 ({what}); got {value!r}"
        )
    return value


def check_functions(**functions: object) -> None:
    what = {
        "model": "that builds the model on the device it is given: model(device) -> nn.Module",
        "optimizer": (
            "that builds the optimizer for the model: optimizer(model) -> torch.optim.Optimizer"
        ),
        "train_step": "that returns the loss: train_step(model, batch) -> tensor",
        "collate": "that turns a list of samples into a batch",
        "lr_schedule": "of epoch progress (a float) returning the LR multiplier",
    }
    for name, value in functions.items():
        if value is None and name in ("collate", "lr_schedule"):
            continue
        if not callable(value):
            raise ConfigError(
                f"Trainer({name}=...) must be a function {what[name]}; got {type(value).__name__}"
            )


def check_data(dataset: Any, *, batch_size: object, epochs: object, drop_last: bool) -> int:
    if not (
        hasattr(dataset, "__len__")
        and (hasattr(dataset, "__getitem__") or hasattr(dataset, "__getitems__"))
    ):
        raise ConfigError(
            "Trainer(dataset=...) must be a map-style dataset (with __len__ and __getitem__), got "
            f"{type(dataset).__name__}; "
            "wrap an iterable in a list or a torch.utils.data.TensorDataset"
        )
    dataset_len = len(dataset)
    if dataset_len < 1:
        raise ConfigError("Trainer(dataset=...) is empty; give it at least one sample")
    size = _positive_int("batch_size", batch_size, what="samples per rank per step")
    _positive_int("epochs", epochs, what="passes over the dataset")
    if drop_last and dataset_len // size < 1:
        raise ConfigError(
            f"Trainer(batch_size={size}) is larger than the dataset ({dataset_len} samples), so "
            "with drop_last=True an epoch has no batch; "
            "lower batch_size or pass drop_last=False"
        )
    return int(dataset_len)


def check_policy(
    *, policy: object, backend: object, elche: object, outer: object, checkpoint: object
) -> None:
    if not isinstance(policy, Policy):
        raise ConfigError(
            f"Trainer(policy=...) must be fa.Policy.SYNC, CADENCE or ASYNC; got {policy!r}"
        )
    if not isinstance(backend, Backend):
        raise ConfigError(
            f"Trainer(backend=...) must be fa.Backend.CPU or COLLECTIVE; got {backend!r}"
        )
    if (policy, backend) == (Policy.ASYNC, Backend.COLLECTIVE):
        raise ConfigError(
            "Trainer: (ASYNC, COLLECTIVE) is not a supported combination — bounded-lookahead async "
            "averaging needs the CPU backend "
            "(use CADENCE with COLLECTIVE, or ASYNC with CPU)"
        )
    if not isinstance(elche, ElCheConfig):
        raise ConfigError(
            f"Trainer(elche=...) must be an fa.ElCheConfig(...); got {type(elche).__name__}"
        )
    if elche.partition_ratios is not None and policy is not Policy.SYNC:
        raise ConfigError(
            "Trainer(elche=ElCheConfig(partition_ratios=...)) is honored on SYNC only, and the "
            f"policy is {policy.name}: "
            "CADENCE/ASYNC size partitions from measured throughput; drop partition_ratios or use "
            "policy=fa.Policy.SYNC"
        )
    for knob in ("easgd_alpha", "max_overshoot"):
        if getattr(elche, knob) is not None and policy is not Policy.ASYNC:
            raise ConfigError(
                f"Trainer(elche=ElCheConfig({knob}=...)) applies to ASYNC only, and the policy is "
                f"{policy.name}; drop {knob} or use policy=fa.Policy.ASYNC"
            )
    if not isinstance(outer, _OUTER_TYPES):
        raise ConfigError(
            "Trainer(outer=...) must be fa.OuterAvg(), fa.SlowMo(...) or fa.DiLoCo(...); got "
            f"{type(outer).__name__}"
        )
    if not isinstance(checkpoint, Checkpointing):
        raise ConfigError(
            "Trainer(checkpoint=...) must be an fa.Checkpointing(...); got "
            f"{type(checkpoint).__name__}"
        )


def _finite_positive(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def check_rest(
    *,
    cluster: object,
    rank_command: object,
    seed: object,
    max_grad_norm: object,
    heartbeat_timeout: object,
    name: object,
) -> None:
    if cluster is not None and not isinstance(cluster, str | os.PathLike | ClusterSpec):
        raise ConfigError(
            "Trainer(cluster=...) must be a cluster file path or a ClusterSpec; got "
            f"{type(cluster).__name__}"
        )
    if rank_command is not None and (
        isinstance(rank_command, str)
        or not isinstance(rank_command, Sequence)
        or not rank_command
        or not all(isinstance(p, str) and p for p in rank_command)
    ):
        raise ConfigError(
            "Trainer(rank_command=...) must be a list of strings, e.g. [sys.executable, '-m', "
            f"'myapp.rank_entry']; got {rank_command!r}"
        )
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"Trainer(seed=...) must be a whole number of 0 or more; got {seed!r}")
    if max_grad_norm is not None and not _finite_positive(max_grad_norm):
        raise ConfigError(
            "Trainer(max_grad_norm=...) must be a positive number (or None for no clipping); got "
            f"{max_grad_norm!r}"
        )
    if not _finite_positive(heartbeat_timeout):
        raise ConfigError(
            "Trainer(heartbeat_timeout=...) must be a positive number of seconds; got "
            f"{heartbeat_timeout!r}"
        )
    if not isinstance(name, str):
        raise ConfigError(f"Trainer(name=...) must be a string; got {type(name).__name__}")


def max_failure(value: MaxFailure | int | float | None) -> MaxFailure | None:
    if value is None or isinstance(value, MaxFailure):
        return value
    if isinstance(value, bool):
        raise ConfigError(
            "Trainer(max_failure=...) takes a count, a fraction or fa.MaxFailure(...); got "
            f"{value!r}"
        )
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(
                f"Trainer(max_failure={value}) must be at least 1 rank (or None to tolerate any "
                "partial loss)"
            )
        return MaxFailure(absolute=value)
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ConfigError(
                f"Trainer(max_failure={value}) as a fraction must be in (0, 1] of the world size"
            )
        return MaxFailure(percent=value)
    raise ConfigError(
        "Trainer(max_failure=...) takes a count, a fraction or fa.MaxFailure(...); got "
        f"{type(value).__name__}"
    )
