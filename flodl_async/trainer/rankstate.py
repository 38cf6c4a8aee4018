"""A rank's own part of a checkpoint: its optimizer and RNG state, written and restored on its host.

The controller writes the consensus; each rank writes ``rank{r}.pt`` into the same bundle directory
(the save path must be shared by every host) after applying the checkpoint round's consensus, and
reports the file's hash in ``RankStateSaved`` so the manifest can list it. On resume, a rank whose
world size matches the bundle's restores its inner optimizer's state and its RNG states before its
first step; otherwise it starts a fresh inner optimizer, with a warning. Blocking file I/O: called
on the compute side, never on a loop.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint import (
    MANIFEST_FILE,
    BundleWriter,
    Manifest,
    load_rank_state,
    rank_file,
    restore_rng,
    save_rank_state,
)
from ..errors import FlodlError
from ..wire import messages as m

if TYPE_CHECKING:
    import torch

log = logging.getLogger("flodl_async.trainer.rankstate")


def write_rank_state(
    save_path: str, name: str, rank: int, version: int, optimizer: torch.optim.Optimizer
) -> m.RankStateSaved:
    """Write ``rank``'s state into bundle ``name`` under ``save_path``; the report for the
    controller (with ``error`` set when it could not be written: the bundle goes without it)."""
    try:
        writer = BundleWriter(save_path, name)
        sha = save_rank_state(writer, rank, optimizer.state_dict())
    except (OSError, ValueError, FlodlError) as exc:
        log.warning("rank %d: could not write its checkpoint state into %s: %s", rank, name, exc)
        return m.RankStateSaved(rank=rank, version=version, path="", sha256="", error=str(exc))
    return m.RankStateSaved(
        rank=rank, version=version, path=str(writer.path / rank_file(rank)), sha256=sha
    )


def restore_rank_state(bundle: str, rank: int, optimizer: torch.optim.Optimizer) -> bool:
    """Restore ``rank``'s optimizer and RNG states from ``bundle`` (verified by the controller);
    False, with a warning, when the bundle holds none for it."""
    path = Path(bundle)
    manifest = Manifest.from_json((path / MANIFEST_FILE).read_bytes(), path=str(path))
    state = load_rank_state(path, manifest, rank)
    if state is None:
        log.warning(
            "rank %d: %s holds no state for this rank; it starts a fresh inner optimizer",
            rank,
            bundle,
        )
        return False
    optimizer.load_state_dict(dict(state.optimizer))
    restore_rng(state.rng)
    return True
