"""SIGKILL during a bundle write, for real: a writer process stopped at each point of the write
and killed there leaves the previous bundle the latest (or, once the manifest is in place, the
new one), the torn one named, and retention clears it once a newer bundle is valid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flodl_async.checkpoint import (
    CONSENSUS_FILE,
    MANIFEST_FILE,
    BundleWriter,
    Reason,
    bundle_name,
    find_latest,
    list_bundles,
    retain,
    verify_bundle,
)

from .test_checkpoint_bundle import manifest_for, payload

ROOT = Path(__file__).resolve().parent.parent
WRITER = Path(__file__).resolve().parent / "scripts" / "checkpoint_writer.py"

#: Where the write is killed, and whether the new bundle is valid after it.
POINTS = {
    "mid-file:0": False,
    "mid-file:524288": False,
    "before-fsync": False,
    "between-files": False,
    "before-commit": False,
    "manifest-unsynced": False,
    "manifest-unrenamed": False,
    "committed": True,
}


def committed_bundle(save: Path, round_: int) -> Path:
    writer = BundleWriter(save, bundle_name(round_, Reason.EPOCH))
    writer.write_file(CONSENSUS_FILE, payload(b"the previous consensus"))
    return writer.commit(manifest_for(round_))


def kill_writer_at(save: Path, round_: int, point: str) -> None:
    """Run the writer until it says it is at ``point``, then SIGKILL it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(WRITER), str(save), str(round_), point],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line != "ready\n":
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"the writer did not stop at {point}: {line!r}\n{err}")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.parametrize("point", sorted(POINTS))
def test_a_write_killed_at_any_point_leaves_the_previous_bundle_loadable(
    tmp_path: Path, point: str
) -> None:
    save = tmp_path.resolve()
    previous = committed_bundle(save, 1)
    kill_writer_at(save, 2, point)
    torn = save / bundle_name(2, Reason.EPOCH)
    latest, skipped = find_latest(save)
    if POINTS[point]:
        assert latest == torn
        assert skipped == ()
        assert verify_bundle(torn).rank_files == {0: "rank0.pt"}
        return
    assert latest == previous
    assert (previous / CONSENSUS_FILE).read_bytes() == b"the previous consensus"
    assert [(s.name, s.field) for s in skipped] == [("r00000002-epoch", MANIFEST_FILE)]
    # the torn write is cleared once a newer bundle is valid, temporary files and all
    newer = committed_bundle(save, 3)
    retain(save, keep_last=2)
    assert list_bundles(save) == (previous, newer)
    assert list(save.rglob(".*.tmp-*")) == []


def test_a_torch_save_killed_mid_file_leaves_the_previous_bundle(tmp_path: Path) -> None:
    save = tmp_path.resolve()
    previous = committed_bundle(save, 1)
    kill_writer_at(save, 2, "torch-mid-consensus")
    torn = save / bundle_name(2, Reason.EPOCH)
    assert [p.name.split(".tmp-")[0] for p in torn.iterdir()] == [".consensus.pt"]
    latest, skipped = find_latest(save)
    assert latest == previous
    assert [s.name for s in skipped] == ["r00000002-epoch"]
