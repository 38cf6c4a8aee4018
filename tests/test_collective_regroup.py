"""A COLLECTIVE rank's process group re-formed in place (flodl_async/trainer/collective.py), with
real gloo processes and torch's own TCPStore as the run's store: an all_reduce a death cuts is
redone by the survivors from the state they entered it with, and one they had finished and trained
on is redone with what they trained kept; either way every survivor ends with one state, and the
next round runs in the new group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "regroup_rank.py"


def run_world(scenario: str) -> dict[int, dict[str, object]]:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported from torch._C

    store = TCPStore(
        "127.0.0.1", 0, None, True, timeout=timedelta(seconds=60), wait_for_workers=False
    )
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": "3",
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the store is the run's, as under flodl
        "PYTHONPATH": str(Path(__file__).parent.parent),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(rank), scenario],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(3)
    ]
    outs: dict[int, dict[str, object]] = {}
    try:
        for rank, proc in enumerate(procs):
            stdout, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 0, (rank, stderr)
            if rank != 2:
                outs[rank] = json.loads(stdout.strip().splitlines()[-1])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outs


@pytest.mark.e2e
@pytest.mark.parametrize("scenario", ["cut", "twice"])
def test_an_all_reduce_a_death_cut_is_redone_by_the_survivors_from_their_entry_state(
    scenario: str,
) -> None:
    """``twice``: the first re-form names a rank that is gone too; it is given up for the next."""
    outs = run_world(scenario)
    for out in outs.values():
        assert out.get("superseded", scenario == "twice") is (scenario == "twice")
        assert out["round1"] == 3.0  # the weights' mass
        assert out["round2"] is None  # cut: rank 2 never came
        # restored as it entered round 2: 2 + 10·(rank+1)
        assert out["state_before_redo"] == [2.0 + 10.0 * (out["rank"] + 1)] * 4  # type: ignore[operator]
        assert out["redo"] == 3.0  # weights 1 and 2
        [floats, ints] = out["after_redo"]  # type: ignore[misc]
        assert floats == pytest.approx([(12.0 * 1 + 22.0 * 2) / 3] * 4)
        assert ints == [10]
        assert out["round3"] == 2.0
        assert out["generation"] == (2 if scenario == "twice" else 1)
        assert out["outer"] == {"step": 3, "rewind": 1}  # round 1, the redo, round 3
    assert outs[0]["after_round3"] == outs[1]["after_round3"]


@pytest.mark.e2e
def test_a_finished_all_reduce_redone_keeps_what_each_survivor_trained_since() -> None:
    outs = run_world("trained_on")
    for out in outs.values():
        assert out["round2"] == 3.0
        assert out["state_before_redo"] == [27.0] * 4  # the consensus 22, then +5 trained
        assert out["redo"] == 2.0
        [floats, ints] = out["after_redo"]  # type: ignore[misc]
        assert floats == pytest.approx([(12.0 + 22.0) / 2 + 5.0] * 4)  # the redo, +5 kept
        assert ints == [10]
        assert out["outer"] == {"step": 4, "rewind": 1}
    assert outs[0]["after_round3"] == outs[1]["after_round3"]
