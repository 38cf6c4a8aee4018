"""Checkpoint and resume end to end: real processes, gloo on CPU, 2 ranks, the e2e tests' small model.

Every run is tests/scripts/trainer_mlp.py as the launcher (a one-host cluster file), SYNC in lockstep
(``max_batch_diff=0``) with deterministic steps and SGD with momentum, so a resumed run can be held
to the uninterrupted one bit for bit. One reference run (4 epochs, a bundle every epoch, and one
asked for by rank 1 mid-epoch) is shared by the tests that compare against it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from flodl_async.checkpoint import Reason, find_latest, parse_bundle_name, verify_bundle
from flodl_async.verdict import ExitCode

from .launchkit import PY, Launcher, assert_nothing_left, new_run_id
from .test_trainer_e2e import ENV, SCRIPT, as_launcher, cluster_file

pytestmark = pytest.mark.e2e

LOCKSTEP = ("--policy", "sync", "--lockstep", "--momentum")


@dataclass(frozen=True)
class Reference:
    """The uninterrupted run: its launcher's output and its bundles."""

    out: dict[str, Any]
    save: Path


def launcher_doc(out: Path) -> dict[str, Any]:
    return torch.load(out / "launcher--1.pt")


def bundles(save: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted(save.iterdir()) if parse_bundle_name(p.name) is not None}


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key, tensor in a.items():
        assert torch.equal(tensor, b[key]), key


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    tmp = tmp_path_factory.mktemp("reference")
    save = tmp / "ckpt"
    done = as_launcher(
        tmp, *LOCKSTEP, "--epochs", "4", "--save-path", str(save), "--every-epochs", "1",
        "--checkpoint-rank", "1", "--checkpoint-epoch", "1",
        run_id=new_run_id(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return Reference(out=launcher_doc(tmp / "out"), save=save)


def test_a_bundle_every_epoch_one_on_request_and_at_the_end_of_the_uninterrupted_run(
    reference: Reference,
) -> None:
    found = bundles(reference.save)
    reasons = [parse_bundle_name(name)[1] for name in found]  # type: ignore[index]
    assert reasons.count(Reason.EPOCH) == 4, found
    assert Reason.REQUEST in reasons, found  # rank 1's run.checkpoint(), mid-epoch 2
    for path in found.values():
        manifest = verify_bundle(path)
        assert sorted(manifest.rank_files) == [0, 1]  # each rank's optimizer and RNG
        assert manifest.world_size == 2
        assert manifest.data.batch_size == 32
    last = max(found.values(), key=lambda p: parse_bundle_name(p.name)[0])  # type: ignore[index]
    assert reference.out["checkpoint"] == str(last)  # TrainedState.checkpoint: the last bundle
    assert verify_bundle(last).epoch == 4
    # the consensus as saved is the launcher's final state, loadable as a plain state_dict
    assert_same_state(torch.load(last / "consensus.pt", weights_only=True), reference.out["state"])


def test_resuming_from_the_epoch_2_bundle_gives_the_state_and_losses_of_the_uninterrupted_run(
    reference: Reference, tmp_path: Path
) -> None:
    epoch2 = next(p for p in bundles(reference.save).values() if verify_bundle(p).epoch == 2)
    assert verify_bundle(epoch2).reason is Reason.EPOCH
    done = as_launcher(
        tmp_path, *LOCKSTEP, "--epochs", "4", "--resume-from", str(epoch2), run_id=new_run_id()
    )
    assert done.returncode == 0, done.stderr
    resumed = launcher_doc(tmp_path / "out")
    assert_same_state(resumed["state"], reference.out["state"])
    assert resumed["losses"] == reference.out["losses"][2:]  # epochs 3 and 4, to the last bit
    assert (resumed["epochs_completed"], resumed["global_step"]) == (4, 32)
    assert "resuming from" in done.stderr


def test_resuming_from_the_mid_epoch_request_bundle_trains_only_what_it_lacks(
    reference: Reference, tmp_path: Path
) -> None:
    (request,) = (p for p in bundles(reference.save).values() if "request" in p.name)
    manifest = verify_bundle(request)
    assert manifest.epoch == 1
    assert manifest.coverage
    done = as_launcher(
        tmp_path, *LOCKSTEP, "--epochs", "4", "--resume-from", str(request), run_id=new_run_id()
    )
    assert done.returncode == 0, done.stderr
    resumed = launcher_doc(tmp_path / "out")
    assert_same_state(resumed["state"], reference.out["state"])
    assert resumed["losses"][1:] == reference.out["losses"][2:]  # the epochs after it, exactly


def _reap(proc: subprocess.Popen[str], run_id: str) -> None:
    """A launcher a test drove by signals: killed if it still runs, its pipe closed, nothing left."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    assert_nothing_left(run_id, within=30)


def test_sigkill_of_the_launcher_then_resume_latest_ends_where_the_uninterrupted_run_ends(
    reference: Reference, tmp_path: Path
) -> None:
    save = tmp_path / "ckpt"
    run_id = new_run_id()
    cmd = [
        PY, SCRIPT, "--out", str(tmp_path / "killed"), "--cluster", cluster_file(tmp_path),
        *LOCKSTEP, "--epochs", "4", "--save-path", str(save), "--every-epochs", "1",
        "--fast-ms", "60",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **ENV, "FLODL_RUN_ID": run_id},
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "checkpoint: wrote" in line and "r00000016-epoch" in line:
                break  # epoch 2's bundle is committed, two epochs are left
        else:
            pytest.fail("the run ended before its epoch-2 bundle")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        _reap(proc, run_id)
    assert not (tmp_path / "killed" / "launcher--1.pt").exists()
    latest, _skipped = find_latest(save)
    assert latest is not None
    assert verify_bundle(latest).epoch >= 2
    (tmp_path / "cluster.yml").unlink()
    done = as_launcher(
        tmp_path, *LOCKSTEP, "--epochs", "4", "--save-path", str(save), "--resume-from", "latest",
        run_id=new_run_id(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert_same_state(launcher_doc(tmp_path / "out")["state"], reference.out["state"])


def test_max_failure_breached_exits_5_with_a_bundle_of_the_last_consensus(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    done = as_launcher(
        tmp_path, *LOCKSTEP, "--epochs", "4", "--save-path", str(save),
        "--kill-rank", "1", "--kill-batch", "12", "--max-failure", "1",
        run_id=new_run_id(),
    )  # fmt: skip
    assert done.returncode == ExitCode.MAX_FAILURE, done.stderr
    latest, _ = find_latest(save)
    assert latest is not None, done.stderr
    manifest = verify_bundle(latest)
    assert manifest.reason is Reason.MAX_FAILURE_EXCEEDED
    assert manifest.epoch == 1
    assert manifest.coverage
    assert manifest.rank_files == {}  # the ranks were ending: the consensus alone


# ----- resume_from errors: one per field, each before any rank trains ---------------------------------


def _refused(tmp_path: Path, *args: str, field: str, where: Path | str) -> None:
    done = as_launcher(tmp_path, *LOCKSTEP, "--epochs", "4", *args, run_id=new_run_id())
    assert done.returncode == ExitCode.USAGE, done.stderr
    assert field in done.stderr, done.stderr
    assert str(where) in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()  # nothing trained


@pytest.fixture
def copied(reference: Reference, tmp_path: Path) -> Path:
    """A copy of the reference's epoch-1 bundle, to break."""
    epoch1 = next(p for p in bundles(reference.save).values() if verify_bundle(p).epoch == 1)
    copy = tmp_path / "ckpt" / epoch1.name
    shutil.copytree(epoch1, copy)
    return copy


def test_resume_from_a_missing_path_names_it(tmp_path: Path) -> None:
    _refused(tmp_path, "--resume-from", str(tmp_path / "nope"), field="resume_from",
             where=tmp_path / "nope")  # fmt: skip


def test_resume_from_a_torn_bundle_names_the_file(copied: Path, tmp_path: Path) -> None:
    data = bytearray((copied / "consensus.pt").read_bytes())
    data[-1] ^= 0xFF
    (copied / "consensus.pt").write_bytes(bytes(data))
    _refused(tmp_path, "--resume-from", str(copied), field="files[consensus.pt]", where=copied)


def test_resume_from_a_newer_schema_names_the_field(copied: Path, tmp_path: Path) -> None:
    manifest = json.loads((copied / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (copied / "manifest.json").write_text(json.dumps(manifest))
    _refused(tmp_path, "--resume-from", str(copied), field="schema_version", where=copied)


def test_resume_with_other_data_names_the_field(copied: Path, tmp_path: Path) -> None:
    manifest = json.loads((copied / "manifest.json").read_text())
    manifest["data"]["seed"] = 7
    (copied / "manifest.json").write_text(json.dumps(manifest))
    # the manifest's own hash is not listed: the edit leaves the bundle valid, only other data
    _refused(tmp_path, "--resume-from", str(copied), field="data.seed", where=copied)


def test_resume_with_another_model_names_the_model_schema(copied: Path, tmp_path: Path) -> None:
    # the launcher never builds the model: the first rank's hello is where it is checked
    started = time.monotonic()
    _refused(tmp_path, "--mixed", "--resume-from", str(copied), field="model_schema", where=copied)
    assert time.monotonic() - started < 120


def test_resume_latest_with_no_bundle_yet_starts_fresh_says_so_and_keeps_the_last_two(
    tmp_path: Path,
) -> None:
    done = as_launcher(
        tmp_path, *LOCKSTEP, "--epochs", "1", "--save-path", str(tmp_path / "ckpt"),
        "--every-rounds", "2", "--keep-last", "2", "--resume-from", "latest", run_id=new_run_id(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "no checkpoint under" in done.stderr
    assert "starting fresh" in done.stderr
    assert done.stderr.count("checkpoint: wrote") == 4  # rounds 2, 4, 6, 8 (8 closes the epoch)
    kept = bundles(tmp_path / "ckpt")  # keep_last=2: the two newest, the requeue's next start
    assert [parse_bundle_name(name)[0] for name in kept] == [6, 8]  # type: ignore[index]


def test_latest_skips_a_torn_newer_bundle_by_name(
    reference: Reference, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from flodl_async.controller.resumes import find_bundle
    from flodl_async.training.spec import Checkpointing

    save = tmp_path / "ckpt"
    newest = max(bundles(reference.save).values(), key=lambda p: parse_bundle_name(p.name)[0])  # type: ignore[index]
    shutil.copytree(newest, save / newest.name)
    torn = save / "r00099999-epoch"  # a newer write cut before its manifest
    shutil.copytree(newest, torn)
    (torn / "manifest.json").unlink()
    with caplog.at_level("WARNING"):
        found = find_bundle(Checkpointing(save_path=str(save), resume_from="latest"))
    assert found == save / newest.name
    assert "r00099999-epoch" in caplog.text


def test_slowmo_resumes_exactly_with_its_momentum(tmp_path: Path) -> None:
    slowmo = (*LOCKSTEP, "--outer", "slowmo", "--epochs", "3")
    save = tmp_path / "ckpt"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    done = as_launcher(
        tmp_path / "a", *slowmo, "--save-path", str(save), "--every-epochs", "1",
        run_id=new_run_id(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    full = launcher_doc(tmp_path / "a" / "out")
    epoch1 = next(p for p in bundles(save).values() if verify_bundle(p).epoch == 1)
    assert verify_bundle(epoch1).outer_state_file == "outer.pt"  # the momentum is in it
    done = as_launcher(tmp_path / "b", *slowmo, "--resume-from", str(epoch1), run_id=new_run_id())
    assert done.returncode == 0, done.stderr
    resumed = launcher_doc(tmp_path / "b" / "out")
    assert_same_state(resumed["state"], full["state"])
    assert resumed["losses"] == full["losses"][1:]


# ----- inline: one process saves and resumes too ------------------------------------------------------


def _inline(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [PY, SCRIPT, "--out", str(tmp_path / "out"), *LOCKSTEP, *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **ENV}, check=False
    )


def test_inline_saves_every_epoch_and_a_resume_continues_exactly(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    done = _inline(tmp_path / "a", "--epochs", "3", "--save-path", str(save), "--every-epochs", "1")
    assert done.returncode == 0, done.stderr
    full = torch.load(tmp_path / "a" / "out" / "inline--1.pt")
    epoch1 = next(p for p in bundles(save).values() if verify_bundle(p).epoch == 1)
    assert full["checkpoint"] is not None
    assert verify_bundle(full["checkpoint"]).epoch == 3
    done = _inline(tmp_path / "b", "--epochs", "3", "--resume-from", str(epoch1))
    assert done.returncode == 0, done.stderr
    resumed = torch.load(tmp_path / "b" / "out" / "inline--1.pt")
    assert_same_state(resumed["state"], full["state"])
    assert resumed["losses"] == full["losses"][1:]
    assert resumed["global_step"] == full["global_step"]


def test_inline_resume_from_a_missing_path_exits_2_without_a_traceback(tmp_path: Path) -> None:
    done = _inline(tmp_path, "--epochs", "1", "--resume-from", str(tmp_path / "nope"))
    assert done.returncode == ExitCode.USAGE, done.stderr
    assert "resume_from" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


# ----- preemption: the signal, a bundle, exit 7, the same command resumes ---------------------------


def _preempt_cmd(out: Path, save: Path | None, *args: str) -> tuple[str, ...]:
    saving = ("--save-path", str(save), "--resume-from", "latest") if save is not None else ()
    return (
        "--nproc", "2", "--devices", "cpu", "--port", "0", "--",
        PY, SCRIPT, "--out", str(out), *LOCKSTEP, *saving, *args,
    )  # fmt: skip


def test_sigusr1_to_flodl_launch_checkpoints_exits_7_and_the_same_command_resumes(
    tmp_path: Path,
) -> None:
    save = tmp_path / "ckpt"
    # the requeued job runs this very command again: resume_from="latest" from the first start
    cmd = _preempt_cmd(tmp_path / "out", save, "--epochs", "4", "--fast-ms", "60")
    launcher = Launcher(*cmd, run_id=new_run_id(), env=ENV)
    try:
        launcher.wait_for_stdout("EPOCH 2", timeout=120)
        launcher.proc.send_signal(signal.SIGUSR1)
        done = launcher.finish(timeout=120)
    finally:
        launcher.kill()
    assert done.returncode == ExitCode.PREEMPTED == 7, done.stderr
    assert "preempted: a checkpoint at the next reduce, then an orderly stop" in done.stderr
    assert "flodl-launch: stopped — training stopped (SIGUSR1: preempted)" in done.stderr
    assert "run the same command to resume" in done.stderr
    latest, _skipped = find_latest(save)
    assert latest is not None
    assert verify_bundle(latest).reason is Reason.PREEMPT, latest
    assert 2 <= verify_bundle(latest).epoch < 4
    again = Launcher(*cmd, run_id=new_run_id(), env=ENV).finish(timeout=180)
    assert again.returncode == 0, again.stderr
    assert "resuming from" in again.stderr
    resumed = torch.load(tmp_path / "out" / "rank-0.pt")
    assert (resumed["epochs_completed"], resumed["global_step"]) == (4, 32)
    # it trains only the epochs the bundle lacks. Not asserted: equality with the uninterrupted
    # run. A stop's final round (SIGTERM's shutdown bundle too, before preemption existed) holds
    # steps past the last model round's quota that its coverage does not count, so the resumed
    # run's state differs from the uninterrupted one; the epoch and request bundles are exact.
    assert len(resumed["losses"]) == 4 - verify_bundle(latest).epoch


def test_sigusr1_to_a_trainer_without_a_save_path_says_so_and_stops_with_143(
    tmp_path: Path,
) -> None:
    cmd = _preempt_cmd(tmp_path / "out", None, "--epochs", "200", "--fast-ms", "3")
    launcher = Launcher(*cmd, run_id=new_run_id(), env=ENV)
    try:
        launcher.wait_for_stdout("EPOCH 1", timeout=120)
        launcher.proc.send_signal(signal.SIGUSR1)
        done = launcher.finish(timeout=120)
    finally:
        launcher.kill()
    assert done.returncode == ExitCode.TERMINATED, done.stderr
    assert "no save_path: NOTHING CAN BE SAVED" in done.stderr
    assert "preempted, but no preempt bundle was written" in done.stderr


def test_a_cooperative_trainer_launcher_takes_the_signal_flodl_preempt_signal_names(
    tmp_path: Path,
) -> None:
    save = tmp_path / "ckpt"
    run_id = new_run_id()
    cmd = [
        PY, SCRIPT, "--out", str(tmp_path / "out"), "--cluster", cluster_file(tmp_path),
        *LOCKSTEP, "--epochs", "200", "--save-path", str(save), "--fast-ms", "3", "--cooperative",
    ]  # fmt: skip
    env = {**os.environ, **ENV, "FLODL_RUN_ID": run_id, "FLODL_PREEMPT_SIGNAL": "usr2"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "epoch 1/200: loss" in line:
                break
        else:
            pytest.fail("the run ended before its first epoch")
        proc.send_signal(signal.SIGUSR2)
        rest = proc.stdout.read()
        proc.wait(timeout=60)
    finally:
        _reap(proc, run_id)
    assert "SIGUSR2: preempted: a checkpoint at the next reduce" in rest, rest
    latest, _skipped = find_latest(save)
    written = latest is not None and verify_bundle(latest).reason is Reason.PREEMPT
    # exit 7 exactly when the preempt bundle is there: a requeue must never start over unawares.
    # (The script as its own launcher holds no final-round consensus yet; flodl-launch does.)
    assert proc.returncode == (ExitCode.PREEMPTED if written else ExitCode.TERMINATED), rest
    assert "Traceback" not in rest, rest
