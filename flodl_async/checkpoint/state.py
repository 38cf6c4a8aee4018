"""The tensor files of a bundle: the consensus, the outer optimizer's state, a rank's state.

Each is one ``torch.save`` of plain values and CPU tensors, loaded back with
``torch.load(..., weights_only=True)``: a bundle never runs code from its files, and the consensus
is what a user loads by hand, ``model.load_state_dict(torch.load(path, weights_only=True))``.
torch is imported inside these functions only, for start-up cost: the controller loads this
package to find and verify bundles without it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from ..errors import CheckpointInvalid
from .bundle import OUTER_FILE, BundleWriter
from .manifest import CONSENSUS_FILE, Manifest

if TYPE_CHECKING:
    import os

    import torch


def rank_file(rank: int) -> str:
    """The name of rank ``rank``'s state file in a bundle."""
    return f"rank{rank}.pt"


@dataclass(frozen=True, slots=True, kw_only=True)
class RngState:
    """Every random generator a rank's training draws from: python's, torch's CPU one, each CUDA
    device's (empty without CUDA), numpy's legacy global one (None without numpy)."""

    python: tuple[object, ...]
    torch_cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...]
    numpy: tuple[str, torch.Tensor, int, int, float] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class RankState:
    """What a rank's file holds: its inner optimizer's ``state_dict()`` and its RNG states."""

    optimizer: Mapping[str, object]
    rng: RngState


def capture_rng() -> RngState:
    """The generators' states now."""
    import torch  # deferred: torch start-up cost

    numpy_state: tuple[str, torch.Tensor, int, int, float] | None = None
    try:
        import numpy as np  # optional: only when numpy is installed
    except ImportError:
        pass
    else:
        legacy = np.random.get_state(legacy=True)
        assert isinstance(legacy, tuple)  # legacy=True: ("MT19937", keys, pos, has_gauss, cached)
        name, keys, pos, has_gauss, cached = legacy
        # weights_only loads tensors, not arrays: the 624 words travel as int64
        numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)
    # only a process that already uses CUDA has its generators to save (asking would start CUDA)
    initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # untyped in torch
    cuda = tuple(torch.cuda.get_rng_state_all()) if initialized else ()
    return RngState(
        python=random.getstate(),
        torch_cpu=torch.get_rng_state(),
        cuda=cuda,
        numpy=numpy_state,
    )


def restore_rng(state: RngState) -> None:
    """Set every generator ``state`` names (a CUDA state only when this process has CUDA)."""
    import torch  # deferred: torch start-up cost

    random.setstate(state.python)
    torch.set_rng_state(state.torch_cpu)
    if state.cuda and torch.cuda.is_available():
        # device by device, as many as both runs see (a rank may resume seeing fewer devices)
        for device, cuda_state in enumerate(state.cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)
    if state.numpy is not None:
        try:
            import numpy as np  # optional: only when numpy is installed
        except ImportError:
            return
        name, keys, pos, has_gauss, cached = state.numpy
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def _saver(obj: object) -> Callable[[BinaryIO], None]:
    def write(file: BinaryIO) -> None:
        import torch  # deferred: torch start-up cost

        torch.save(obj, file)

    return write


def _load(path: Path) -> object:
    import torch  # deferred: torch start-up cost

    return torch.load(path, map_location="cpu", weights_only=True)


def save_consensus(writer: BundleWriter, state_dict: Mapping[str, torch.Tensor]) -> str:
    """Write the consensus model (every ``state_dict`` key, tied ones too) as ``consensus.pt``;
    returns its SHA-256. CPU tensors are written from their own memory, without a copy."""
    # detach() is a view and cpu() of a CPU tensor is the tensor itself: no copy of the model
    plain = {name: tensor.detach().cpu() for name, tensor in state_dict.items()}
    return writer.write_file(CONSENSUS_FILE, _saver(plain))


def load_consensus(bundle: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The consensus ``state_dict`` of a bundle (verify it first: :func:`verify_bundle`)."""
    return _load(Path(bundle) / CONSENSUS_FILE)  # type: ignore[return-value]


def save_outer(writer: BundleWriter, state: Mapping[str, object]) -> str:
    """Write the outer optimizer's state (``OuterStepper.checkpoint_state()``) as ``outer.pt``;
    returns its SHA-256 (the manifest's ``outer_state_file`` is then ``OUTER_FILE``)."""
    return writer.write_file(OUTER_FILE, _saver(dict(state)))


def load_outer(bundle: str | os.PathLike[str], manifest: Manifest) -> dict[str, object] | None:
    """The outer optimizer's state of a bundle, or None when it saved none."""
    if manifest.outer_state_file is None:
        return None
    return _load(Path(bundle) / manifest.outer_state_file)  # type: ignore[return-value]


def save_rank_state(
    writer: BundleWriter,
    rank: int,
    optimizer_state: Mapping[str, object],
    *,
    rng: RngState | None = None,
) -> str:
    """Write rank ``rank``'s inner optimizer state and RNG states (``rng``; None captures them
    now) as ``rank{rank}.pt``; returns its SHA-256, which the rank hands to the committing
    writer (:meth:`BundleWriter.add_file_hash`)."""
    state = capture_rng() if rng is None else rng
    body = {
        "optimizer": dict(optimizer_state),
        "rng": {
            "python": state.python,
            "torch_cpu": state.torch_cpu,
            "cuda": list(state.cuda),
            "numpy": state.numpy,
        },
    }
    return writer.write_file(rank_file(rank), _saver(body))


def load_rank_state(
    bundle: str | os.PathLike[str], manifest: Manifest, rank: int
) -> RankState | None:
    """Rank ``rank``'s saved state, or None when the bundle has none for it."""
    name = manifest.rank_files.get(rank)
    if name is None:
        return None
    path = Path(bundle) / name
    body = _load(path)
    if not (isinstance(body, dict) and {"optimizer", "rng"} <= body.keys()):
        raise CheckpointInvalid(
            path=str(path), field=f"rank_files[{rank}]", reason="not a rank state file"
        )
    rng = body["rng"]
    return RankState(
        optimizer=body["optimizer"],
        rng=RngState(
            python=tuple(rng["python"]),
            torch_cpu=rng["torch_cpu"],
            cuda=tuple(rng["cuda"]),
            numpy=None if rng["numpy"] is None else _numpy_state(rng["numpy"]),
        ),
    )


def _numpy_state(saved: object) -> tuple[str, torch.Tensor, int, int, float]:
    assert isinstance(saved, tuple | list)
    assert len(saved) == 5
    name, keys, pos, has_gauss, cached = saved
    return str(name), keys, int(pos), int(has_gauss), float(cached)
