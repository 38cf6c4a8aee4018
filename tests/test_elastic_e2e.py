"""The elastic Trainer end to end: real processes, real torch, gloo on CPU. A rank killed with
SIGKILL mid-epoch costs the run its share of one round, not the run: the survivors train on, the
dead rank's work is retrained by them, every surviving process ends with the same state, and the
verdict says DEGRADED and names the rank. Nothing of a run may survive it.

The exact coverage of the consensus (every batch in it exactly once whatever dies when) is the
coordinator's bookkeeping, proven on a fake clock in test_elastic_coordinator.py; here the ranks'
own record of the samples they trained shows the same from outside: nothing is lost, no survivor
trains a sample twice in an epoch's worth, and the only repeats are the dead rank's unfinished work.
"""

from __future__ import annotations

import collections
import signal
from pathlib import Path

import pytest

from flodl_async.verdict import ExitCode

from .launchkit import new_run_id
from .test_trainer_e2e import as_launcher, assert_converged, assert_identical, states

pytestmark = pytest.mark.e2e

EPOCHS = 4
SAMPLES = 512


def usage(tmp_path: Path, rank: int | str) -> collections.Counter[int]:
    """The samples ``rank`` trained (``'1.i1'``: rank 1's restarted process's)."""
    path = tmp_path / "out" / f"used-{rank}.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return collections.Counter(int(i) for line in lines for i in line.split())


@pytest.mark.parametrize(
    ("policy", "backend"),
    [("sync", "cpu"), ("cadence", "cpu"), ("async", "cpu"), ("sync", "collective"),
     ("cadence", "collective")],
)  # fmt: skip
def test_a_rank_killed_mid_epoch_costs_a_round_not_the_run(
    tmp_path: Path, policy: str, backend: str
) -> None:
    """COLLECTIVE (gloo) too: the survivors destroy their process group and open a new one without
    the dead rank, with no process restarted; an all_reduce the death cut is redone by all of them,
    so they end holding one state, the launcher's too."""
    done = as_launcher(
        tmp_path, "--policy", policy, "--backend", backend, "--epochs", str(EPOCHS),
        "--kill-rank", "1", "--kill-batch", "9", "--usage", run_id=new_run_id(), ranks=3,
    )  # fmt: skip
    assert done.returncode == ExitCode.OK, done.stderr
    verdicts = [line for line in done.stderr.splitlines() if "DEGRADED" in line]
    assert verdicts, done.stderr
    assert "1 of 3 ranks lost (rank 1 on host " in verdicts[-1], verdicts
    assert f"killed by {signal.SIGKILL.name}" in verdicts[-1], verdicts
    reformed = "the survivors re-form their process group as ranks [0, 2]" in done.stderr
    assert reformed is (backend == "collective"), done.stderr
    saved = states(tmp_path)
    # the dead rank saved nothing; the survivors and the launcher hold one state
    assert_identical(saved, {"launcher--1", "rank-0", "rank-2"})
    launcher = saved["launcher--1"]
    assert (launcher["world_size"], launcher["epochs_completed"]) == (2, EPOCHS)
    assert_converged(launcher["losses"])
    survivors = usage(tmp_path, 0) + usage(tmp_path, 2)
    dead = usage(tmp_path, 1)
    everyone = survivors + dead
    assert sum(dead.values()) >= 9 * 32  # it trained 9 batches of 32 before it died
    # nothing is lost: every sample trained every epoch, by someone
    assert all(everyone[i] >= EPOCHS for i in range(SAMPLES)), everyone
    # the survivors never train a sample more often than the epochs ask
    assert all(survivors[i] <= EPOCHS for i in range(SAMPLES)), survivors
    # every repeat is work of the dead rank's that no consensus took: retrained by a survivor
    repeats = sum(everyone.values()) - EPOCHS * SAMPLES
    assert 0 <= repeats <= sum(dead.values())
