"""What a run is asked to do and what it returns, shared by the Trainer and its drivers.

:class:`RunRequest` is what the Trainer hands the driver it chose (rank or launcher): everything
that driver reads of the Trainer, frozen, so no driver needs the Trainer itself.
:class:`TrainedState` is what every driver returns. :func:`on_thread` runs a whole training (the
compute side) on a thread of its own under an awaiting task.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from ..config.cluster import ClusterSpec
from ..training.spec import TrainerSpec, digest
from .worker import ComputeConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..training.modelschema import ModelSchema
    from ..wire.messages import TrainerSpecWire

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainedState:
    """What a run trained: the final consensus, the same in every role."""

    #: Consensus params and persistent buffers on CPU, with ``model.state_dict()`` keys (tied keys
    #: included).
    state_dict: Mapping[str, torch.Tensor] = field(repr=False)
    #: Which keys are parameters.
    param_names: tuple[str, ...]
    epochs_completed: int
    #: Cohort batches completed divided by the world size.
    global_step: int
    world_size: int
    #: Ranks lost on the way (non-empty: a degraded success).
    lost_ranks: tuple[int, ...] = ()
    #: Ended by ``shutdown()`` or a signal, not by finishing the epochs.
    interrupted: bool = False
    #: Exactly one process per run has True: the inline process, the launcher when the script is the
    #: launcher, else rank 0.
    primary: bool = False
    #: The last checkpoint bundle written (a directory under ``Checkpointing.save_path``), if any.
    checkpoint: str | None = None

    def load_into(self, model: nn.Module) -> None:
        """``model.load_state_dict(strict=True)``, copied to the model's device."""
        model.load_state_dict(dict(self.state_dict), strict=True)


def trained_state(fields: Mapping[str, Any], *, primary: bool) -> TrainedState:
    """The :class:`TrainedState` of a schedule's ``finish()`` fields."""
    return TrainedState(
        state_dict=fields["state_dict"],
        param_names=tuple(fields["param_names"]),
        epochs_completed=int(fields["epochs_completed"]),
        global_step=int(fields["global_step"]),
        world_size=int(fields["world_size"]),
        lost_ranks=tuple(fields.get("lost_ranks", ())),
        interrupted=bool(fields.get("interrupted", False)),
        primary=primary,
        checkpoint=fields.get("checkpoint"),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class RunRequest:
    """What a rank or launcher driver runs from: the Trainer's arguments, resolved and frozen."""

    #: The serializable config the coordinator and reducer run from (every rank's must match).
    spec: TrainerSpec
    #: The arguments that make a step, for the compute side.
    compute: ComputeConfig
    #: ``Trainer(cluster=...)``: a cluster file, a spec, or None (the environment decides).
    cluster: ClusterSpec | str | os.PathLike[str] | None
    #: ``Trainer(rank_command=...)``: what the ranks run instead of this program again.
    rank_command: tuple[str, ...] | None
    #: ``Trainer(max_restarts=...)``: the launcher's ``--max-restarts``.
    max_restarts: int = 0

    def spec_wire_and_digest(self, schema: ModelSchema) -> tuple[TrainerSpecWire, str]:
        """What a rank's ``TrainerHello`` carries: the spec on the wire and the run digest of (spec,
        model schema)."""
        return self.spec.to_wire(), digest(self.spec, schema)


async def on_thread(fn: Callable[[], _T], *, name: str, on_cancel: Callable[[], None]) -> _T:
    """Run ``fn`` on a new thread of its own (a whole training would hold a default-executor slot
    for its lifetime).

    Cancelled (the loop is closing), it calls ``on_cancel`` (a stop request) and waits for the
    thread to end.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[_T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if done.done():
            return
        if ok:
            done.set_result(value)
        else:
            done.set_exception(value)

    def body() -> None:
        try:
            outcome: tuple[bool, Any] = (True, fn())
        except BaseException as exc:  # handed to the awaiting task, which re-raises it
            outcome = (False, exc)
        # the loop closed meanwhile: nobody awaits the outcome
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, *outcome)

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        on_cancel()
        with contextlib.suppress(BaseException):
            await asyncio.shield(done)
        raise
    finally:
        # The thread still drops its frames (torch tensors, the model) after handing over the
        # outcome; a daemon thread caught in torch's C++ at interpreter exit aborts the process
        # ("terminate called").
        await loop.run_in_executor(None, thread.join)
