"""A rank's own part of a checkpoint: its optimizer and RNG state, written and restored on its host.

The controller writes the consensus; each rank writes ``rank{r}.pt`` into the same bundle directory
(the save path must be shared by every host) after applying the checkpoint round's consensus, and
reports the file's hash in ``RankStateSaved`` so the manifest can list it. The rank itself pays
only a copy: :class:`RankStateWriter` takes a copy of the optimizer's state and the RNG states at
the boundary and writes them on a thread of its own while the rank trains on (an optimizer's
state is as large as the model for SGD with momentum, twice for Adam: writing it in the step
would stall the rank for as long as the write). On resume, a rank whose world size matches the
bundle's restores its inner optimizer's state and its RNG states before its first step; otherwise
it starts a fresh inner optimizer, with a warning. Called on the compute side, never on a loop.
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint import (
    MANIFEST_FILE,
    BundleWriter,
    Manifest,
    RngState,
    capture_rng,
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


class RankStateWriter:
    """A rank's state files, written one at a time on a thread of their own; each report goes to
    ``send`` (the rank's control link) once its file is written."""

    def __init__(self, rank: int, send: Callable[[m.RankStateSaved], None]) -> None:
        self._rank = rank
        self._send = send
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future[None]] = []

    def save(
        self, save_path: str, name: str, version: int, optimizer: torch.optim.Optimizer
    ) -> None:
        """Copy the optimizer's state and the RNG states now (the rank's only cost), write them in
        the background."""
        state = copy.deepcopy(optimizer.state_dict())  # tensors cloned: training goes on
        rng = capture_rng()
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="flodl-rank-state"
            )

        def write() -> None:
            self._send(write_rank_state(save_path, name, self._rank, version, state, rng=rng))

        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._pool.submit(write))

    def close(self, *, wait: bool) -> None:
        """The rank is ending: ``wait`` for the files under way (a normal end: the last bundle
        waits for them), or leave them (a failure)."""
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=not wait)


def write_rank_state(
    save_path: str,
    name: str,
    rank: int,
    version: int,
    state: Mapping[str, object],
    *,
    rng: RngState | None = None,
) -> m.RankStateSaved:
    """Write ``rank``'s optimizer ``state`` (and ``rng``; None: captured now) into bundle ``name``
    under ``save_path``; the report for the controller (with ``error`` set when it could not be
    written: the bundle goes without it)."""
    try:
        writer = BundleWriter(save_path, name)
        sha = save_rank_state(writer, rank, state, rng=rng)
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
