"""Which checkpoint bundle a run resumes from, verified before any rank trains.

``Checkpointing(resume_from=PATH)`` names a bundle directory; ``resume_from="latest"`` the newest
valid bundle under ``save_path`` (the requeue case: the same command run again), skipping torn
ones with a warning naming each, or a fresh start, said so, when there is none yet. The bundle's
manifest and every file's SHA-256 are checked, then what the run must share with it (the model's
schema, the data parameters): anything wrong is a
:class:`~flodl_async.errors.CheckpointInvalid` (a ``ConfigError``) naming the file and the field,
never a silent fresh start. The launcher checks what it can before the fan-out
(:func:`preflight`: it never builds the model); the controller checks everything at the first
``TrainerHello`` (:func:`resolve_resume`), and loads the consensus and the outer optimizer's
state its reducer starts from.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint import (
    Manifest,
    check_resume,
    elche_from_json,
    find_latest,
    load_consensus,
    load_outer,
    verify_bundle,
)
from ..errors import CheckpointInvalid
from ..training.saves import ResumePoint
from ..training.spec import LATEST, Checkpointing, TrainerSpec
from ..wire import messages as m
from .bundles import data_params

if TYPE_CHECKING:
    import torch

log = logging.getLogger("flodl_async.cli.launch")


@dataclass(frozen=True, slots=True, kw_only=True)
class Resume:
    """A verified bundle a run resumes from: where the coordinator starts, what the reducer
    holds."""

    path: Path
    manifest: Manifest
    point: ResumePoint
    state_dict: Mapping[str, torch.Tensor]
    #: The outer optimizer's saved state (None: none saved, or another outer optimizer).
    outer: Mapping[str, object] | None


def find_bundle(checkpoint: Checkpointing) -> Path | None:
    """The bundle ``checkpoint.resume_from`` names (None: no resume, or ``latest`` with no valid
    bundle yet); a named path that is not a directory is a :class:`CheckpointInvalid`."""
    resume_from = checkpoint.resume_from
    if resume_from is None:
        return None
    if resume_from == LATEST:
        save_path = checkpoint.save_path
        assert save_path is not None  # Checkpointing checks it
        latest, skipped = find_latest(save_path)
        for bundle in skipped:
            log.warning("resume_from='latest': skipping torn or invalid bundle %s", bundle)
        if latest is None:
            log.warning(
                "resume_from='latest': no checkpoint under %s yet; starting fresh", save_path
            )
        return latest
    path = Path(resume_from)
    if not path.is_dir():
        raise CheckpointInvalid(
            path=str(path),
            field="resume_from",
            reason="no such bundle directory",
            remedy="give the path of a bundle (a directory under the save_path), or "
            "resume_from='latest' with the save_path",
        )
    return path


def preflight(spec: TrainerSpec) -> Path | None:
    """The launcher's check before the fan-out: the bundle is there and intact, and was saved from
    the same data (the model's schema waits for the first rank's hello)."""
    path = find_bundle(spec.checkpoint)
    if path is None:
        return None
    manifest = verify_bundle(path)
    for item in dataclasses.fields(manifest.data):
        saved, now = getattr(manifest.data, item.name), getattr(data_params(spec), item.name)
        if saved != now:
            raise CheckpointInvalid(
                path=str(path),
                field=f"data.{item.name}",
                reason=f"saved with {saved!r}, this run has {now!r} (the epochs' batches differ)",
                remedy="resume with the data the checkpoint was saved with, or start a fresh run",
            )
    return path


def warn_if_spread(checkpoint: Checkpointing, hosts: Iterable[str]) -> None:
    """A save path of a run on several hosts must be storage they all share: said once, before
    any rank trains (the launcher: before the fan-out)."""
    spread = sorted(set(hosts))
    if checkpoint.save_path is not None and len(spread) > 1:
        log.warning(
            "Checkpointing(save_path=%r) on %d hosts (%s): the path must resolve to shared "
            "storage visible to every host (each rank writes its state file there, the "
            "controller the consensus and the manifest)",
            checkpoint.save_path,
            len(spread),
            ", ".join(spread),
        )


def resolve_resume(
    hello: m.TrainerHello, *, world_size: int, hosts: Iterable[str] = ()
) -> Resume | None:
    """The first hello's run resumes from this bundle (None: it starts fresh); verified against
    the hello's model and spec, and loaded. ``hosts``: the run's, for :func:`warn_if_spread`
    (empty: the launcher said it already)."""
    spec = TrainerSpec.from_wire(hello.spec)
    warn_if_spread(spec.checkpoint, hosts)
    path = find_bundle(spec.checkpoint)
    if path is None:
        return None
    manifest = verify_bundle(path)
    outer_kind = spec.outer.to_wire().kind
    warnings = check_resume(
        manifest,
        bundle=path,
        model_schema=hello.model,
        data=data_params(spec),
        world_size=world_size,
        policy=spec.policy,
        backend=spec.backend,
        outer_kind=outer_kind,
    )
    for warning in warnings:
        log.warning("resuming from %s: %s", path, warning)
    same_world = manifest.world_size == world_size
    point = ResumePoint(
        bundle=str(path),
        round=manifest.round,
        epoch=manifest.epoch,
        global_step=manifest.global_step,
        # the manifest's ranges are half-open; the coordinator's are (first, count)
        coverage=tuple((start, stop - start) for start, stop in manifest.coverage),
        elche=elche_from_json(manifest.elche, path=str(path))
        if same_world and manifest.elche is not None
        else None,
        rank_state=same_world and bool(manifest.rank_files),
    )
    outer = load_outer(path, manifest) if manifest.outer_kind == outer_kind else None
    log.info(
        "resuming from %s (%s): round %d, %d epoch(s) done, step %d",
        path,
        manifest.reason.value,
        manifest.round,
        manifest.epoch,
        manifest.global_step,
    )
    return Resume(
        path=path,
        manifest=manifest,
        point=point,
        state_dict=load_consensus(path),
        outer=outer,
    )
