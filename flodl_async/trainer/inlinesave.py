"""Checkpoints of a Trainer run inline: one process, so the bundle is written where it trains.

An inline run has no coordinator and no reduce: its "rounds" are its steps. The same
:class:`~flodl_async.training.saves.SaveClock` decides after each step (``every_epochs`` as an epoch
is trained out, ``every_rounds`` steps, ``every_seconds``, a request), and the end writes one
(``end``, or ``shutdown`` on a stop with ``on_shutdown``). A bundle is the model's state as the
consensus, rank 0's optimizer and RNG state, and the manifest, written on the compute thread
between two steps (nothing else trains meanwhile, so nothing waits on it but this process).
Resume verifies and checks the bundle as the controller does, loads the model, restores the
optimizer and RNG state when the bundle was saved inline too (world size 1), and says where the
policy starts. Blocking file I/O on the compute side, never on a loop.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint import (
    BundleWriter,
    Manifest,
    Reason,
    bundle_name,
    check_resume,
    covered_batches,
    load_consensus,
    load_rank_state,
    rank_file,
    restore_rng,
    retain,
    save_consensus,
    save_rank_state,
    verify_bundle,
)
from ..controller.bundles import data_params
from ..controller.resumes import find_bundle
from ..training.modelschema import ModelSchema
from ..training.saves import END, REQUEST, SHUTDOWN, SaveClock
from ..training.spec import TrainerSpec, digest

if TYPE_CHECKING:
    from ..training.schedule import InlinePolicy
    from .worker import Compute

log = logging.getLogger("flodl_async.trainer.inline")


@dataclass(frozen=True, slots=True, kw_only=True)
class InlineStart:
    """Where a resumed inline run starts."""

    epoch: int
    covered: frozenset[int]
    step: int


class InlineCheckpoints:
    """One inline run's bundles (and the one it resumes from)."""

    def __init__(self, spec: TrainerSpec, compute: Compute) -> None:
        self._spec = spec
        self._compute = compute
        self._clock = SaveClock(spec.checkpoint)
        self._clock.started(time.monotonic())
        self._schema = ModelSchema.from_module(compute.model)
        self._requested = threading.Event()  # set from the caller's loop
        self._last_step = -1
        #: The last bundle written (``TrainedState.checkpoint``).
        self.last: str | None = None
        #: Where bundles go (None: this run only resumes).
        self.save_path = spec.checkpoint.save_path

    def resume(self) -> InlineStart | None:
        """Load the bundle ``resume_from`` names into the model (and the optimizer and RNG when it
        was saved inline); None: a fresh start. A bundle that cannot be resumed is a
        ``CheckpointInvalid`` naming the file and the field."""
        spec = self._spec
        path = find_bundle(spec.checkpoint)
        if path is None:
            return None
        manifest = verify_bundle(path)
        for warning in check_resume(
            manifest,
            bundle=path,
            model_schema=self._schema.to_wire(),
            data=data_params(spec),
            world_size=1,
            policy=spec.policy,
            backend=spec.backend,
            outer_kind=spec.outer.to_wire().kind,
        ):
            log.warning("resuming from %s: %s", path, warning)
        compute = self._compute
        compute.model.load_state_dict(load_consensus(path), strict=True)
        rank_state = load_rank_state(path, manifest, 0) if manifest.world_size == 1 else None
        if rank_state is not None:
            compute.optimizer.load_state_dict(dict(rank_state.optimizer))
            restore_rng(rank_state.rng)
        else:
            log.warning("resuming from %s without its optimizer and RNG state", path)
        log.info(
            "resuming from %s: %d epoch(s) done, step %d",
            path,
            manifest.epoch,
            manifest.global_step,
        )
        return InlineStart(
            epoch=manifest.epoch,
            covered=covered_batches(manifest.coverage),
            step=manifest.global_step,
        )

    def request(self) -> None:
        """``run.checkpoint()``: after the current step (thread-safe)."""
        self._requested.set()

    def after_step(self, policy: InlinePolicy) -> None:
        """A step is trained: write a bundle if one is due."""
        if self._requested.is_set():
            self._requested.clear()
            self._clock.request()
        now = time.monotonic()
        reason = self._clock.due(closes_epoch=policy.epoch_closing, now=now)
        if reason is not None:
            self._write(reason, policy)

    def at_end(self, policy: InlinePolicy, *, interrupted: bool) -> None:
        """The run ends: its last bundle (unless the last step's already holds this state)."""
        if not self._clock.enabled:
            return
        reason = SHUTDOWN if interrupted and self._spec.checkpoint.on_shutdown else None
        if not interrupted:
            reason = END
        if self._requested.is_set() or self._clock.requested:
            reason = reason or REQUEST
        if reason is not None and policy.global_step != self._last_step:
            self._write(reason, policy)

    def _write(self, reason: str, policy: InlinePolicy) -> None:
        spec, compute = self._spec, self._compute
        save_path = spec.checkpoint.save_path
        assert save_path is not None  # the clock marks nothing without one
        self._clock.saved(time.monotonic())
        step = policy.global_step
        epoch, coverage = policy.position()
        started = time.monotonic()
        writer = BundleWriter(save_path, bundle_name(step, Reason(reason)))
        save_consensus(writer, compute.state_dict())
        if spec.checkpoint.rank_state:
            save_rank_state(writer, 0, compute.optimizer.state_dict())
        path = writer.commit(
            Manifest(
                run_id="inline",
                reason=Reason(reason),
                round=step,
                epoch=epoch,
                global_step=step,
                world_size=1,
                policy=spec.policy,
                backend=spec.backend,
                spec_digest=digest(spec, self._schema),
                data=data_params(spec),
                model_schema=self._schema.to_wire(),
                elche=None,
                coverage=tuple((first, first + n) for first, n in coverage),
                outer_kind=spec.outer.to_wire().kind,
                outer_state_file=None,
                rank_files={0: rank_file(0)} if spec.checkpoint.rank_state else {},
                written_at=time.time(),
            )
        )
        if spec.checkpoint.keep_last is not None:
            retain(save_path, spec.checkpoint.keep_last)
        self._last_step = step
        self.last = str(Path(path))
        log.info(
            "checkpoint: wrote %s (%s, %d epoch(s), step %d) in %.0f ms",
            path,
            reason,
            epoch,
            step,
            (time.monotonic() - started) * 1e3,
        )
