"""Whether a bundle fits the run that wants to resume from it (pure).

A different model or different data parameters cannot resume: the consensus would not load, or
the epoch's batches and the coverage of the one in progress would mean other samples. Those are
errors naming the field. A different world, policy, backend or outer optimizer can resume, from
the consensus, but part of the saved state no longer applies: those are warnings, returned for
the caller to print.
"""

from __future__ import annotations

import os
from dataclasses import fields

from ..errors import CheckpointInvalid
from ..training.modelschema import ModelSchema
from ..training.policy import Backend, Policy
from ..wire.messages import ModelSchemaWire
from .manifest import DataParams, Manifest

_REMEDY = (
    "resume with the model and data the checkpoint was saved with, or start a fresh run "
    "(another save_path, no resume_from)"
)


def check_resume(
    manifest: Manifest,
    *,
    bundle: str | os.PathLike[str],
    model_schema: ModelSchemaWire,
    data: DataParams,
    world_size: int,
    policy: Policy,
    backend: Backend,
    outer_kind: str,
) -> tuple[str, ...]:
    """Refuse a bundle this run cannot resume from (:class:`CheckpointInvalid` naming ``bundle``
    and the field: ``model_schema``, ``data.<field>``); return the warnings for what it resumes
    without (ElChe's and the ranks' state in another world size, the outer state of another
    outer optimizer, exactness under another policy or backend)."""
    where = str(bundle)
    difference = ModelSchema.from_wire(manifest.model_schema).first_difference(
        ModelSchema.from_wire(model_schema)
    )
    if difference is not None:
        raise CheckpointInvalid(
            path=where,
            field="model_schema",
            reason=f"the checkpoint's model differs from this run's: {difference}",
            remedy=_REMEDY,
        )
    for item in fields(DataParams):
        saved, now = getattr(manifest.data, item.name), getattr(data, item.name)
        if saved != now:
            raise CheckpointInvalid(
                path=where,
                field=f"data.{item.name}",
                reason=f"saved with {saved!r}, this run has {now!r} (the epochs' batches differ)",
                remedy=_REMEDY,
            )
    warnings = []
    if world_size != manifest.world_size:
        said = f"saved with world size {manifest.world_size}, resuming with {world_size}"
        if manifest.elche is not None:
            warnings.append(f"{said}: ElChe's state is not restored, it calibrates afresh")
        if manifest.rank_files:
            warnings.append(
                f"{said}: the ranks' optimizer and RNG states are not restored, each rank starts "
                "a fresh inner optimizer"
            )
    if outer_kind != manifest.outer_kind and manifest.outer_state_file is not None:
        warnings.append(
            f"saved with outer optimizer {manifest.outer_kind}, resuming with {outer_kind}: its "
            "state (velocity) is not restored"
        )
    for label, saved_mode, now_mode in (
        ("policy", manifest.policy, policy),
        ("backend", manifest.backend, backend),
    ):
        if saved_mode != now_mode:
            warnings.append(
                f"saved under {label} {saved_mode.value}, resuming under {now_mode.value}: the "
                "run continues from the consensus, but not as the saved run would have"
            )
    return tuple(warnings)
