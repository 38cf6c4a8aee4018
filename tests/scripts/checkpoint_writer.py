"""Writes one checkpoint bundle and stops, at the point named on the command line, to be killed.

``python checkpoint_writer.py SAVE_PATH ROUND POINT``: writes bundle ``ROUND`` (a 1 MiB
consensus, then ``rank0.pt``, then the commit) and, at ``POINT``, prints ``ready`` and blocks
until its stdin closes (the test SIGKILLs it first; a test that dies closes the pipe, so this
never outlives it). Points:

- ``mid-file:N``: N bytes of the consensus written (its temporary file open, not renamed);
- ``before-fsync``: the consensus written in full, not yet fsync'd nor renamed;
- ``between-files``: the consensus renamed into place, the rank file not begun;
- ``before-commit``: every file in place, the manifest not begun;
- ``manifest-unsynced``: the manifest's temporary file written, before its fsync;
- ``manifest-unrenamed``: the manifest's temporary file fsync'd, not renamed;
- ``committed``: the manifest renamed into place, the directories not yet fsync'd again;
- ``torch-mid-consensus``: a real ``torch.save`` of a 4 MiB model, 1 MiB into the file.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import BinaryIO

from flodl_async import checkpoint as ckpt
from flodl_async.checkpoint import bundle as bundle_module
from flodl_async.training.policy import Backend, Policy
from flodl_async.wire.messages import ModelSchemaWire

SIZE = 1 << 20
save_path, round_, point = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]


def stop_here() -> None:
    print("ready", flush=True)
    sys.stdin.read()  # the test kills us; if the test is gone, its pipe closes and we end
    sys.exit(1)


def opened_name(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


real_fsync, real_replace = os.fsync, os.replace


def fsync(fd: int) -> None:
    name = opened_name(fd)
    if point == "before-fsync" and ".consensus.pt.tmp-" in name:
        stop_here()
    if point == "manifest-unsynced" and ".manifest.json.tmp-" in name:
        stop_here()
    bundle = save_path / writer.name
    if point == "committed" and name == str(bundle) and (bundle / ckpt.MANIFEST_FILE).exists():
        stop_here()
    real_fsync(fd)


def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    if point == "manifest-unrenamed" and str(dst).endswith(ckpt.MANIFEST_FILE):
        stop_here()
    real_replace(src, dst)


os.fsync, os.replace = fsync, replace  # type: ignore[assignment]


def consensus(file: BinaryIO) -> None:
    chunk = bytes(range(256)) * 256  # 64 KiB
    for offset in range(0, SIZE, len(chunk)):
        if point == f"mid-file:{offset}":
            stop_here()
        file.write(chunk)


def rank_state(file: BinaryIO) -> None:
    if point == "between-files":
        stop_here()
    file.write(b"rank 0's optimizer" * 100)


writer = ckpt.BundleWriter(save_path, ckpt.bundle_name(round_, ckpt.Reason.EPOCH))
if point == "torch-mid-consensus":
    import torch

    real_write = bundle_module._HashingFile.write

    def slow_write(self: bundle_module._HashingFile, data: bytes) -> int:
        if self.written >= SIZE:
            stop_here()
        return real_write(self, data)

    bundle_module._HashingFile.write = slow_write  # type: ignore[method-assign]
    ckpt.save_consensus(writer, {"w": torch.arange(1 << 20, dtype=torch.float32)})
else:
    writer.write_file(ckpt.CONSENSUS_FILE, consensus)
writer.write_file(ckpt.rank_file(0), rank_state)
if point == "before-commit":
    stop_here()
writer.commit(
    ckpt.Manifest(
        run_id="crash",
        reason=ckpt.Reason.EPOCH,
        round=round_,
        epoch=round_,
        global_step=round_,
        world_size=1,
        policy=Policy.SYNC,
        backend=Backend.CPU,
        spec_digest="digest",
        data=ckpt.DataParams(length=10, batch_size=2, seed=0, drop_last=True),
        model_schema=ModelSchemaWire(
            param_names=(), buffer_names=(), dtypes=(), shapes=(), aliases={}
        ),
        elche=None,
        coverage=(),
        outer_kind="avg",
        outer_state_file=None,
        rank_files={0: ckpt.rank_file(0)},
        written_at=time.time(),
    )
)
print("done", flush=True)
