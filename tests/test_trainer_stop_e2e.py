"""Stopping is the same in every role, end to end: real processes, real torch, gloo on CPU.

``shutdown()`` in one rank stops the whole run in order (every process returns the same state with
``interrupted=True``), Ctrl-C to an inline run returns the state instead of a traceback, and a stop
someone asked for reads ``stopped — …`` (exit 130/143 for a signal), for a Trainer and for a plain
script. Every run uses tests/scripts/trainer_mlp.py (plain: wait_for_file.py); nothing of a run may
survive it.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from .launchkit import PY, Launcher, assert_nothing_left, new_run_id, run_launch, script
from .test_trainer_e2e import (
    ALL,
    ENV,
    SCRIPT,
    ScriptLauncher,
    as_launcher,
    assert_identical,
    states,
)

pytestmark = pytest.mark.e2e

#: Far more epochs than a test waits for: only a stop ends these runs early.
LONG = ("--epochs", "200", "--fast-ms", "3")


def verdict(stderr: str, prog: str = "flodl-launch") -> str:
    """The run's one verdict line."""
    lines = [
        line
        for line in stderr.splitlines()
        if line.startswith((f"{prog}: done — ", f"{prog}: stopped — ", f"{prog}: FAILED — "))
    ]
    assert len(lines) == 1, stderr
    return lines[0]


def assert_stopped_everywhere(tmp_path: Path, names: set[str]) -> None:
    saved = states(tmp_path)
    assert_identical(saved, names)
    assert all(doc["interrupted"] for doc in saved.values()), {
        name: doc["interrupted"] for name, doc in saved.items()
    }
    assert all(1 <= doc["epochs_completed"] < 200 for doc in saved.values()), {
        name: doc["epochs_completed"] for name, doc in saved.items()
    }


# ----- shutdown() from a rank ----------------------------------------------------------------------


def test_shutdown_in_one_rank_under_flodl_launch_stops_every_rank_with_the_same_state(
    tmp_path: Path,
) -> None:
    run_id = new_run_id()
    done = run_launch(
        "--nproc", "2", "--devices", "cpu", "--port", "0", "--",
        PY, SCRIPT, "--out", str(tmp_path / "out"), *LONG, "--shutdown-rank", "1",
        run_id=run_id,
        env=ENV,
        timeout=150,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr  # every rank returned the state and exited 0
    assert "SHUTDOWN rank 1 after epoch 1" in done.stdout, done.stdout
    assert done.stdout.count("interrupted=True") == 2, done.stdout
    assert "stopping training (rank 1 called TrainingRun.shutdown())" in done.stderr
    line = verdict(done.stderr)
    assert line.startswith(
        "flodl-launch: stopped — training stopped (rank 1 called TrainingRun.shutdown()) after "
    ), line
    assert_stopped_everywhere(tmp_path, {"rank-0", "rank-1"})


def test_shutdown_in_a_rank_of_a_trainer_launcher_returns_the_state_in_the_launcher_too(
    tmp_path: Path,
) -> None:
    done = as_launcher(tmp_path, *LONG, "--shutdown-rank", "1", run_id=new_run_id())
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("interrupted=True") == 3, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    assert_stopped_everywhere(tmp_path, ALL)


# ----- Ctrl-C to an inline run ---------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_ctrl_c_to_an_inline_run_returns_the_state_without_a_traceback(
    tmp_path: Path, sig: signal.Signals
) -> None:
    # no cluster, no rank environment, no GPU to promote on: this process trains inline
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    env.update(ENV, CUDA_VISIBLE_DEVICES="")
    cmd = [PY, SCRIPT, "--out", str(tmp_path / "out"), "--epochs", "5000", "--fast-ms", "3"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, env=env
    )
    try:
        assert proc.stdout is not None
        seen: list[str] = []
        while not any(line.startswith("EPOCH 1 ") for line in seen):
            line = proc.stdout.readline()
            assert line, f"the inline run ended before its first epoch: {seen}"
            seen.append(line)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err  # run() returned the state; the script saved it and ended
    assert "Traceback" not in err, err
    assert "KeyboardInterrupt" not in err, err
    assert f"flodl: {sig.name}: stopping after the current batch" in err, err
    assert "TRAINER-DONE entry=inline rank=-1 primary=True" in out, out
    (doc,) = states(tmp_path).values()
    assert doc["interrupted"] is True
    assert 1 <= doc["epochs_completed"] < 5000


# ----- the verdict line of a stop ------------------------------------------------------------------


def test_a_signal_to_flodl_launch_running_a_trainer_reads_stopped_and_exits_143(
    tmp_path: Path,
) -> None:
    launcher = Launcher(
        "--nproc", "2", "--devices", "cpu", "--port", "0", "--",
        PY, SCRIPT, "--out", str(tmp_path / "out"), *LONG,
        run_id=new_run_id(),
        env=ENV,
    )  # fmt: skip
    try:
        launcher.wait_for_stdout("EPOCH 1", timeout=120)
        launcher.proc.send_signal(signal.SIGTERM)
        done = launcher.finish(timeout=120)
    finally:
        launcher.kill()
    assert done.returncode == 143, done.stderr
    line = verdict(done.stderr)
    assert line.startswith("flodl-launch: stopped — training stopped (SIGTERM) after "), line
    assert_stopped_everywhere(tmp_path, {"rank-0", "rank-1"})


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_signal_to_flodl_launch_running_a_plain_script_reads_stopped(
    tmp_path: Path, sig: signal.Signals
) -> None:
    launcher = Launcher(
        "--nproc", "2", "--devices", "cpu", "--port", "0", "--stop-grace", "5", "--",
        PY, script("wait_for_file.py"), str(tmp_path / "never"),
        run_id=new_run_id(),
    )  # fmt: skip
    try:
        launcher.wait_for_stdout("ready pid", count=2)
        launcher.proc.send_signal(sig)
        done = launcher.finish(timeout=30)
    finally:
        launcher.kill()
    assert done.returncode == 128 + sig, done.stderr
    line = verdict(done.stderr)
    assert line.startswith(f"flodl-launch: stopped — interrupted by {sig.name} ("), line


def test_a_signal_to_a_cooperative_trainer_launcher_reads_stopped_and_exits_130(
    tmp_path: Path,
) -> None:
    """``trainer.worker()`` in the launcher runs the launch and exits, as flodl-launch does."""
    run_id = new_run_id()
    launcher = ScriptLauncher(tmp_path, "--cooperative", *LONG, run_id=run_id)
    try:
        assert launcher.proc.stderr is not None
        early: list[str] = []
        while not any("epoch 1/200: loss" in line for line in early):
            line = launcher.proc.stderr.readline()
            assert line, f"the launcher ended before its first epoch: {early}"
            early.append(line)
        launcher.proc.send_signal(signal.SIGINT)
        done = launcher.finish(timeout=120)
    finally:
        launcher.kill()
        assert_nothing_left(run_id)
    stderr = "".join(early) + done.stderr
    assert done.returncode == 130, stderr
    line = verdict(stderr, prog="flodl")
    assert line.startswith("flodl: stopped — training stopped (the launcher got SIGINT) after "), (
        line
    )
    assert "Traceback" not in stderr, stderr
    saved = states(tmp_path)
    assert set(saved) == {"rank-0", "rank-1"}  # the launcher exited inside worker()
    for key, tensor in saved["rank-0"]["state"].items():
        assert torch.equal(saved["rank-1"]["state"][key], tensor), key
    assert all(doc["interrupted"] for doc in saved.values())
