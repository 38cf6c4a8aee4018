"""A Trainer rank restarted alone under ``max_restarts`` (``--max-restarts``), end to end: real
processes, real torch, gloo-free CPU averaging through the relay. The rank SIGKILLs itself mid-run;
its agent starts it again as incarnation 1 while the others train on; the coordinator readmits it at
a round boundary, it takes the consensus as its warm start and trains what is planned for it. Every
process, the launcher included, ends with one state, and every sample of every epoch is in the
consensus exactly once (the dead incarnation's unfinished work is retrained, nothing else twice).
When the restarts are used up, a rank lost again stays lost and the run ends DEGRADED.

``--await-restart`` keeps the run from ending before the restarted process is back: the others
wait for it to start (an event, a file it writes), then train slowly until it trained its first
batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl_async.verdict import ExitCode

from .launchkit import new_run_id
from .test_elastic_e2e import SAMPLES, usage
from .test_trainer_e2e import as_launcher, assert_identical, states

pytestmark = pytest.mark.e2e


#: enough epochs that the run outlasts a slow restart (the others train slowly only until the
#: restarted process trained its first batch, fast after)
EPOCHS = 8


def test_a_crashed_rank_is_restarted_alone_rejoins_and_every_process_ends_with_one_state(
    tmp_path: Path,
) -> None:
    done = as_launcher(
        tmp_path, "--policy", "cadence", "--epochs", str(EPOCHS), "--kill-rank", "1",
        "--kill-batch", "9", "--usage", "--max-restarts", "1", "--await-restart",
        run_id=new_run_id(), ranks=3,
    )  # fmt: skip
    assert done.returncode == ExitCode.OK, done.stderr
    assert "restarting rank 1 alone (restart 1 of 1, incarnation 1)" in done.stderr
    assert "rank 1 restarted (1 of 1) and rejoined at round " in done.stderr
    verdict = (
        f"training complete: {EPOCHS} epoch(s) on 3 rank(s); 1 restart (rank 1 (incarnation 1)"
    )
    assert verdict in done.stderr, done.stderr
    assert "DEGRADED" not in done.stderr
    saved = states(tmp_path)
    assert_identical(saved, {"launcher--1", "rank-0", "rank-1", "rank-2"})
    assert {doc["world_size"] for doc in saved.values()} == {3}
    # coverage: nothing lost, and only the dead incarnation's unfinished work trained twice
    dead = usage(tmp_path, 1)
    live = usage(tmp_path, 0) + usage(tmp_path, 2) + usage(tmp_path, "1.i1")
    everyone = live + dead
    assert sum(dead.values()) == 9 * 32
    assert sum(usage(tmp_path, "1.i1").values()) > 0  # the restarted process trained
    assert all(everyone[i] >= EPOCHS for i in range(SAMPLES)), everyone
    assert all(live[i] <= EPOCHS for i in range(SAMPLES)), live
    assert 0 <= sum(everyone.values()) - EPOCHS * SAMPLES <= sum(dead.values())


def test_a_rank_lost_again_with_its_restarts_used_up_stays_lost(tmp_path: Path) -> None:
    done = as_launcher(
        tmp_path, "--policy", "cadence", "--epochs", str(EPOCHS), "--kill-rank", "1",
        "--kill-batch", "2", "--kill-again", "--usage", "--max-restarts", "1", "--await-restart",
        run_id=new_run_id(), ranks=3,
    )  # fmt: skip
    assert done.returncode == ExitCode.OK, done.stderr
    assert "restarting rank 1 alone (restart 1 of 1, incarnation 1)" in done.stderr
    verdicts = [line for line in done.stderr.splitlines() if "DEGRADED" in line]
    assert verdicts, done.stderr
    assert "1 of 3 ranks lost (rank 1 on host " in verdicts[-1], verdicts
    assert "1 restart (rank 1 (incarnation 1)" in verdicts[-1], verdicts
    # the second loss restarts nothing
    assert done.stderr.count("restarting rank 1 alone (restart") == 1
    saved = states(tmp_path)
    assert_identical(saved, {"launcher--1", "rank-0", "rank-2"})
    assert saved["launcher--1"]["world_size"] == 2
