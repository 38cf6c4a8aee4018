"""A lying rank end to end: real processes, real torch, 2 ranks on one host whose relay folds them.

tests/scripts/trainer_liar.py runs trainer_mlp.py as the launcher with rank 1 patched to lie (the
attacks of the elastic issue: a takeover claiming 10**15 steps with every tensor 0.123, a window
report of -10**9 batches, NaN tensors, negative steps). Each run ends with the liar named in the
log and in the verdict, never the honest rank, and the attacker's tensors never become the model:
the liar is dropped like a rank that died, and the honest rank completes the run DEGRADED (exit 0)
without it.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from flodl_async.verdict import ExitCode

from .launchkit import PY, assert_nothing_left, free_port, new_run_id

pytestmark = pytest.mark.e2e

SCRIPT = str(Path(__file__).parent / "scripts" / "trainer_liar.py")


def _run(tmp_path: Path, lie: str) -> subprocess.CompletedProcess[str]:
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"controller:\n  host: 127.0.0.1\n  port: {free_port()}\n"
        f"workers:\n  - host: {socket.gethostname()}\n    devices: cpu:2\n"
    )
    run_id = new_run_id()
    cmd = [PY, SCRIPT, "--lie", lie, "--liar", "1", "--out", str(tmp_path / "out"),
           "--cluster", str(cluster), "--epochs", "2"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLODL_RUN_ID": run_id}
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=180, env=env, check=False
        )
    finally:
        assert_nothing_left(run_id)


@pytest.mark.parametrize(
    ("lie", "why"),
    [
        ("takeover", "rank 1 claimed 10^15 steps in a round planned for "),
        ("stall", "rank 1 reported -10^9 batches for window "),
        ("poison", "rank 1 sent non-finite parameters in round "),
        ("negative", "rank 1 claimed -5 steps in round "),
    ],
)
def test_a_lying_rank_is_named_and_its_lie_never_becomes_the_model(
    tmp_path: Path, lie: str, why: str
) -> None:
    done = _run(tmp_path, lie)
    out = done.stdout + done.stderr
    assert done.returncode == ExitCode.OK, out
    # the log line, from the coordinator's death chain
    assert f"flodl: rank 1 on host {socket.gethostname()} lost: {why}" in done.stderr, out
    verdict = [line for line in done.stderr.splitlines() if "training complete" in line][-1]
    assert "rank 1" in verdict, out
    assert why in verdict, out
    assert "rank 0" not in verdict, out  # the honest rank is never the one blamed
    consensus = [line for line in out.splitlines() if "CONSENSUS" in line]
    assert consensus, out  # the honest ranks did apply consensus rounds ...
    assert not [line for line in consensus if "takeover=True" in line], out  # ... never the lie
    # the survivor continued: the final model is its own, and the liar is among the lost
    assert "DEGRADED — 1 of 2 ranks lost (rank 1 on host" in verdict, out
    saved = torch.load(tmp_path / "out" / "launcher--1.pt")
    assert saved["world_size"] == 1
    for tensor in saved["state"].values():
        assert torch.isfinite(tensor).all()
        assert not torch.all(tensor == 0.123)
