"""The Trainer end to end: real processes, real torch, gloo on CPU, 2 ranks, one small deterministic model.

Every run uses tests/scripts/trainer_mlp.py. Most run it as the launcher (``--cluster`` a one-host
cluster file: this test's process runs the script, which re-executes itself as the ranks); a few run
it under ``flodl-launch`` (the script is a rank there). Each process writes its TrainedState, epoch
losses and batch shares to the output directory. Nothing of a run may survive it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from flodl_async.verdict import ExitCode

from .launchkit import (
    PY,
    Launcher,
    assert_nothing_left,
    free_port,
    new_run_id,
    processes_of_run,
    run_launch,
)

pytestmark = pytest.mark.e2e

SCRIPT = str(Path(__file__).parent / "scripts" / "trainer_mlp.py")
ENV = {"OMP_NUM_THREADS": "1"}


def cluster_file(tmp_path: Path, ranks: int = 2) -> str:
    path = tmp_path / "cluster.yml"
    path.write_text(
        f"controller:\n  host: 127.0.0.1\n  port: {free_port()}\nworkers:\n  - host: {socket.gethostname()}\n    devices: cpu:{ranks}\n"
    )
    return str(path)


def as_launcher(
    tmp_path: Path,
    *args: str,
    run_id: str,
    timeout: float = 180,
    env: dict[str, str] | None = None,
    ranks: int = 2,
) -> subprocess.CompletedProcess[str]:
    """Run the script with cluster= (the launcher role) to its end; nothing of the run may survive."""
    cmd = [
        PY,
        SCRIPT,
        "--out",
        str(tmp_path / "out"),
        "--cluster",
        cluster_file(tmp_path, ranks),
        *args,
    ]
    try:
        full_env = {**os.environ, **ENV, "FLODL_RUN_ID": run_id, **(env or {})}
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=full_env, check=False
        )
    finally:
        assert_nothing_left(run_id)


def states(tmp_path: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: torch.load(p) for p in sorted((tmp_path / "out").glob("*.pt"))}


def assert_identical(saved: dict[str, dict[str, Any]], names: set[str]) -> None:
    assert set(saved) == names, saved.keys()
    first = next(iter(saved.values()))["state"]
    for name, doc in saved.items():
        assert doc["state"].keys() == first.keys(), name
        for key, tensor in first.items():
            assert torch.equal(doc["state"][key], tensor), (name, key)
    assert sum(doc["primary"] for doc in saved.values()) == 1  # exactly one primary per run


def assert_converged(losses: list[float]) -> None:
    assert losses[-1] < 0.05 * losses[0], losses


ALL = {"launcher--1", "rank-0", "rank-1"}


@pytest.mark.parametrize("policy", ["sync", "cadence", "async"])
def test_cpu_policies_converge_and_every_process_ends_with_the_same_state(
    tmp_path: Path, policy: str
) -> None:
    done = as_launcher(tmp_path, "--policy", policy, "--epochs", "4", run_id=new_run_id())
    assert done.returncode == 0, done.stderr
    saved = states(tmp_path)
    assert_identical(saved, ALL)
    launcher = saved["launcher--1"]
    assert launcher["primary"]
    assert (launcher["world_size"], launcher["epochs_completed"], launcher["interrupted"]) == (
        2,
        4,
        False,
    )
    assert_converged(launcher["losses"])
    assert saved["rank-0"]["losses"] == launcher["losses"]  # ranks hear the same aggregated epochs


def test_three_ranks_fold_on_one_host_and_agree(tmp_path: Path) -> None:
    done = as_launcher(tmp_path, "--epochs", "4", run_id=new_run_id(), ranks=3)
    assert done.returncode == 0, done.stderr
    saved = states(tmp_path)
    assert_identical(saved, {*ALL, "rank-2"})
    assert saved["launcher--1"]["world_size"] == 3
    assert_converged(saved["launcher--1"]["losses"])


@pytest.mark.parametrize("outer", ["slowmo", "diloco"])
def test_outer_optimizers_converge(tmp_path: Path, outer: str) -> None:
    # The counts stay at the anchor (--no-adapt): ElChe grows the anchor when the averaging costs
    # much against the compute, which a loaded machine makes so, and fewer rounds mean fewer outer
    # steps, whose momentum then builds up less in 4 epochs (a DiLoCo run on 2 busy cores once
    # ended at 12 % of its start). Frozen counts make the curve the same on any machine.
    done = as_launcher(
        tmp_path, "--outer", outer, "--anchor", "2", "--no-adapt", "--epochs", "4",
        run_id=new_run_id(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    saved = states(tmp_path)
    assert_identical(saved, ALL)
    assert_converged(saved["launcher--1"]["losses"])


def test_collective_cadence_with_the_launcher(tmp_path: Path) -> None:
    done = as_launcher(tmp_path, "--backend", "collective", "--epochs", "4", run_id=new_run_id())
    assert done.returncode == 0, done.stderr
    saved = states(tmp_path)
    assert_identical(saved, ALL)  # the launcher's state is the primary rank's upload
    assert_converged(saved["launcher--1"]["losses"])


def test_collective_sync_under_flodl_launch(tmp_path: Path) -> None:
    """The same script, unchanged, as ranks of flodl-launch: the controller learns the Trainer from the hellos."""
    run_id = new_run_id()
    done = run_launch(
        "--nproc", "2", "--devices", "cpu", "--port", "0", "--", PY, SCRIPT, "--out", str(tmp_path / "out"),
        "--policy", "sync", "--backend", "collective", "--epochs", "4", run_id=run_id, env=ENV, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    saved = states(tmp_path)
    assert_identical(saved, {"rank-0", "rank-1"})
    assert saved["rank-0"]["primary"]
    assert_converged(saved["rank-0"]["losses"])
    assert "training complete: 4 epoch(s) on 2 rank(s)" in done.stderr
    assert "epoch 4/4: loss" in done.stderr  # the controller's per-epoch line


def test_cpu_cadence_under_flodl_launch_with_a_cluster_file(tmp_path: Path) -> None:
    """``flodl-launch cluster.yml -- python train.py``: the same script as ranks, averaged by the controller's reducer."""
    run_id = new_run_id()
    done = run_launch(
        cluster_file(tmp_path), "--", PY, SCRIPT, "--out", str(tmp_path / "out"), "--policy", "cadence", "--epochs", "3",
        run_id=run_id, env=ENV, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    saved = states(tmp_path)
    assert_identical(saved, {"rank-0", "rank-1"})
    assert_converged(saved["rank-0"]["losses"])
    assert "training complete: 3 epoch(s) on 2 rank(s)" in done.stderr


def test_a_3x_slower_rank_gets_a_proportional_share_under_cadence(tmp_path: Path) -> None:
    """Sleep models a slower device without CPU contention; the timing ratio belongs to benchmarks/cadence.py."""
    done = as_launcher(
        tmp_path,
        "--epochs",
        "4",
        "--fast-ms",
        "4",
        "--slow-ms",
        "12",
        "--slow-rank",
        "1",
        run_id=new_run_id(),
    )
    assert done.returncode == 0, done.stderr
    shares = states(tmp_path)["launcher--1"]["shares"]
    later = [epoch[0] for epoch in shares[1:]]  # epoch 0 calibrates
    assert all(0.6 <= share <= 0.85 for share in later), (
        shares
    )  # ideal 0.75: rank 0 does 3x the batches of rank 1


def test_the_launcher_runs_on_the_callers_loop_next_to_other_tasks(tmp_path: Path) -> None:
    done = as_launcher(tmp_path, "--epochs", "2", "--ticker", "--fast-ms", "2", run_id=new_run_id())
    assert done.returncode == 0, done.stderr
    ticks = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("TICKS")]
    assert len(ticks) == 1  # the launcher's own line; ranks' lines carry a [host:rN] prefix
    assert ticks[0] > 10  # the program's other task kept running while the launcher coordinated
    assert_identical(states(tmp_path), ALL)


INTERNAL_LINES = ("relay: rank 0 leaves the host fold: ", "training data: host ")


@pytest.mark.parametrize(
    ("flags", "prefix", "shown"),
    [
        ((), "flodl: ", False),
        (("--verbose",), "flodl: ", True),
        (("--app-logging", "--verbose"), "APP flodl_async.", True),
    ],
)
def test_internal_lines_are_verbose_only_and_an_application_s_logging_is_kept(
    tmp_path: Path, flags: tuple[str, ...], prefix: str, shown: bool
) -> None:
    """The relays' and the reducer's closing lines need the Trainer's -v (the flodl_async logger at
    DEBUG); an application that configured logging gets every line through its own handler."""
    done = as_launcher(tmp_path, "--epochs", "1", *flags, run_id=new_run_id())
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert any(line.startswith(prefix) and "training complete" in line for line in lines), (
        done.stderr
    )
    for text in INTERNAL_LINES:
        assert any(line.startswith(prefix) and text in line for line in lines) is shown, done.stderr
    if prefix != "flodl: ":
        assert not [line for line in lines if line.startswith("flodl: ")], done.stderr


# ----- failures: a verdict naming the rank, nothing left behind ------------------------------------


def test_a_rank_that_raises_is_dropped_and_the_run_ends_degraded_naming_it(
    tmp_path: Path,
) -> None:
    done = as_launcher(tmp_path, "--fail-rank", "1", run_id=new_run_id())
    assert done.returncode == ExitCode.OK, done.stderr
    assert "fails on purpose" in done.stderr  # the rank's own traceback, forwarded
    lost = f"1 of 2 ranks lost (rank 1 on host {socket.gethostname()}: it raised "
    assert f"training complete, DEGRADED — {lost}" in done.stderr, done.stderr
    # ... as the traceback of what the user's code raised, not chained to flodl's internals that
    # re-raised it (the run goes on, so the dying rank has its grace to say it)
    assert (
        "flodl: rank 1: training failed: rank 1 raised RuntimeError('rank 1 fails on purpose')"
        in done.stderr
    ), done.stderr
    assert "The above exception was the direct cause" not in done.stderr
    assert_identical(states(tmp_path), {"launcher--1", "rank-0"})


def test_a_rank_that_raises_at_max_failure_fails_the_run_naming_it(tmp_path: Path) -> None:
    done = as_launcher(tmp_path, "--fail-rank", "1", "--max-failure", "1", run_id=new_run_id())
    assert_launcher_verdict(done, ExitCode.MAX_FAILURE, "rank 1")
    assert "max_failure reached: 1 of 2 ranks lost (the limit is 1)" in done.stderr
    # the verdict carries the rank's traceback (the run's end may stop the dying rank before it
    # prints its own last lines: it sent its death record first)
    assert "RuntimeError: rank 1 fails on purpose" in done.stderr


def assert_launcher_verdict(
    done: subprocess.CompletedProcess[str], code: ExitCode, named: str
) -> None:
    """The script let ``TrainingFailed`` escape: it ends as flodl-launch would, with no launcher traceback."""
    assert done.returncode == code, done.stderr
    verdicts = [line for line in done.stderr.splitlines() if line.startswith("flodl: FAILED — ")]
    assert len(verdicts) == 1, done.stderr
    assert named in verdicts[0], done.stderr
    assert "trainlaunch.py" not in done.stderr, done.stderr  # no frame of the launcher's own code


def _rank_pid(run_id: str, rank: int) -> int:
    for pid in processes_of_run(run_id):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ and b"FLODL_INTERNAL_RANK_SPEC" in b"".join(environ):
            return pid
    raise AssertionError(f"no rank {rank} of run {run_id}")


class ScriptLauncher(Launcher):
    """The Trainer script as a background launcher (launchkit's reader, another command)."""

    def __init__(
        self, tmp_path: Path, *args: str, run_id: str, env: dict[str, str] | None = None
    ) -> None:
        self.run_id = run_id
        cmd = [
            PY,
            SCRIPT,
            "--out",
            str(tmp_path / "out"),
            "--cluster",
            cluster_file(tmp_path),
            *args,
        ]
        full_env = {**os.environ, **ENV, "FLODL_RUN_ID": run_id, **(env or {})}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, env=full_env
        )
        self.stdout_lines = []


@pytest.mark.parametrize(
    ("how", "backend"), [("kill", "cpu"), ("stop", "cpu"), ("stop", "collective")]
)
def test_a_killed_or_frozen_rank_is_dropped_and_the_survivors_finish(
    tmp_path: Path, how: str, backend: str
) -> None:
    """A frozen COLLECTIVE rank leaves its peers blocked in an all_reduce on its open sockets
    until its agent KILLs it (declared dead): then gloo fails there, and the survivor re-forms."""
    run_id = new_run_id()
    # A frozen rank is noticed by its silence: 10 s x 0.3 = 3 s without a frame; its agent then
    # kills it, or the run would wait on it.
    env = {"FLODL_NET_TIMEOUT_SCALE": "0.3"} if how == "stop" else None
    args = ("--epochs", "40", "--fast-ms", "3", "--backend", backend)
    launcher = ScriptLauncher(tmp_path, *args, run_id=run_id, env=env)
    try:
        launcher.wait_for_stdout("EPOCH 1", timeout=120)
        os.kill(_rank_pid(run_id, 1), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        done = launcher.finish(timeout=120)
    finally:
        launcher.kill()
        assert_nothing_left(run_id)
    assert done.returncode == ExitCode.OK, done.stderr
    verdicts = [line for line in done.stderr.splitlines() if "DEGRADED" in line]
    assert verdicts, done.stderr
    assert "1 of 2 ranks lost (rank 1 on host " in verdicts[-1], verdicts
    if how == "stop":
        assert "heartbeat timeout" in verdicts[-1], verdicts
    assert_identical(states(tmp_path), {"launcher--1", "rank-0"})


def test_ranks_of_a_frozen_launcher_notice_its_silence_and_exit(tmp_path: Path) -> None:
    """Heartbeats the other way: the coordinator (in the launcher) stops answering, and each rank ends by itself."""
    run_id = new_run_id()
    launcher = ScriptLauncher(
        tmp_path,
        "--epochs",
        "200",
        "--fast-ms",
        "3",
        run_id=run_id,
        env={"FLODL_NET_TIMEOUT_SCALE": "0.3"},
    )
    try:
        launcher.wait_for_stdout("EPOCH 1", timeout=120)
        ranks = [_rank_pid(run_id, 0), _rank_pid(run_id, 1)]
        os.kill(
            launcher.proc.pid, signal.SIGSTOP
        )  # the launcher's host freezes: its controller, relay and agent with it
        deadline = time.monotonic() + 60
        while alive := [pid for pid in ranks if pid in processes_of_run(run_id)]:
            assert time.monotonic() < deadline, (
                f"ranks {alive} still run 60 s after their launcher froze"
            )
            time.sleep(0.1)
        os.kill(launcher.proc.pid, signal.SIGCONT)
        launcher.finish(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(launcher.proc.pid, signal.SIGCONT)
        launcher.kill()
        assert_nothing_left(run_id)


# ----- stopping: in order, before any signal reaches a rank ------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_launcher_signal_stops_in_order_and_returns_the_state_everywhere(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """The script uses the handle (``async for m in run.metrics()``, then ``await run.join()``) under ``asyncio.run``.

    Ctrl-C included: left to asyncio.run, SIGINT would cancel the main task and the loop's shutdown every task with it.
    """
    run_id = new_run_id()
    launcher = ScriptLauncher(tmp_path, "--epochs", "200", "--fast-ms", "3", run_id=run_id)
    try:
        launcher.wait_for_stdout("EPOCH 2", timeout=120)
        launcher.proc.send_signal(sig)
        done = launcher.finish(timeout=120)
    finally:
        launcher.kill()
        assert_nothing_left(run_id)
    assert done.returncode == 0, (
        done.stderr
    )  # run.join() returned the state; the script went on and saved it
    assert "a final round, then shutdown" in done.stderr
    assert f"the launcher got {sig.name}" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "rank 0 on" in done.stderr
    assert "exited with code 0" in done.stderr  # no signal reached a rank
    saved = states(tmp_path)
    assert_identical(saved, ALL)
    assert all(doc["interrupted"] for doc in saved.values())
    assert 2 <= saved["launcher--1"]["epochs_completed"] < 200


def test_a_second_signal_during_the_orderly_stop_forces_it(tmp_path: Path) -> None:
    run_id = new_run_id()
    # A slow rank makes the final round long enough to be interrupted.
    launcher = ScriptLauncher(
        tmp_path,
        "--epochs",
        "200",
        "--fast-ms",
        "30",
        "--slow-rank",
        "1",
        "--slow-ms",
        "300",
        run_id=run_id,
    )
    try:
        launcher.wait_for_stdout("EPOCH 1", timeout=120)
        launcher.proc.send_signal(signal.SIGTERM)
        assert launcher.proc.stderr is not None
        early: list[str] = []
        while not any("stopping training (the launcher got SIGTERM)" in line for line in early):
            line = launcher.proc.stderr.readline()
            assert line, f"the launcher ended before its orderly stop began: {early}"
            early.append(line)
        launcher.proc.send_signal(signal.SIGTERM)  # the signal table: a second signal kills at once
        done = launcher.finish(timeout=120)
    finally:
        launcher.kill()
        assert_nothing_left(run_id)
    stderr = "".join(early) + done.stderr
    assert done.returncode == 143, stderr
    assert "second SIGTERM: forcing the stop (KILL now)" in stderr
    assert "flodl: stopped — interrupted by SIGTERM" in stderr
    assert not (tmp_path / "out" / "launcher--1.pt").exists()  # a forced stop returns no state


def test_flodl_launch_sigint_stops_the_trainer_in_order(tmp_path: Path) -> None:
    run_id = new_run_id()
    cmd = [
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--",
        PY,
        SCRIPT,
        "--out",
        str(tmp_path / "out"),
        "--epochs",
        "200",
        "--fast-ms",
        "3",
    ]
    launcher = Launcher(*cmd, run_id=run_id, env=ENV)
    try:
        launcher.wait_for_stdout("EPOCH 2", timeout=120)
        launcher.proc.send_signal(signal.SIGINT)
        done = launcher.finish(timeout=120)
    finally:
        launcher.kill()
    assert done.returncode == 130, done.stderr
    assert "stopping training in order on SIGINT" in done.stderr
    # The ranks got no signal: they finished run() with the state and reached the end of the script.
    assert done.stdout.count("interrupted=True") == 2, done.stdout
    saved = states(tmp_path)
    assert_identical(saved, {"rank-0", "rank-1"})
    assert all(doc["interrupted"] for doc in saved.values())


def test_the_cooperative_worker_under_flodl_launch(tmp_path: Path) -> None:
    run_id = new_run_id()
    done = run_launch(
        "--nproc", "2", "--devices", "cpu", "--port", "0", "--", PY, SCRIPT, "--out", str(tmp_path / "out"), "--cooperative", "--epochs", "4",
        run_id=run_id, env=ENV, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    saved = states(tmp_path)
    assert_identical(saved, {"rank-0", "rank-1"})
    assert_converged(saved["rank-0"]["losses"])


def test_the_cooperative_worker_as_the_launcher_runs_the_launch_and_exits(tmp_path: Path) -> None:
    """The launcher has no cooperative loop to hand back: trainer.worker() launches, reports, exits."""
    done = as_launcher(tmp_path, "--cooperative", "--epochs", "3", run_id=new_run_id())
    assert done.returncode == 0, done.stderr
    saved = states(tmp_path)
    assert set(saved) == {
        "rank-0",
        "rank-1",
    }  # the launcher exited inside worker(): it saves nothing
    for key, tensor in saved["rank-0"]["state"].items():
        assert torch.equal(saved["rank-1"]["state"][key], tensor)
    assert not saved["rank-0"]["primary"]  # the launcher was the primary


def test_an_exception_in_a_cooperative_loop_is_a_death_record_naming_the_rank(
    tmp_path: Path,
) -> None:
    run_id = new_run_id()
    done = run_launch(
        "--nproc", "2", "--devices", "cpu", "--port", "0", "--", PY, SCRIPT, "--out", str(tmp_path / "out"), "--cooperative", "--fail-rank", "1",
        run_id=run_id, env=ENV, timeout=180,
    )  # fmt: skip
    assert done.returncode == ExitCode.OK, done.stderr  # the survivor trained on
    assert "DEGRADED — 1 of 2 ranks lost (rank 1 on host " in done.stderr, done.stderr
    assert "it raised" in done.stderr  # the rank's Exiting(error=...), not a heartbeat deadline
    assert "fails on purpose in its own loop" in done.stderr


# ----- finding the run: `flodl ps` and a bare `flodl status` see a Trainer launcher as they see flodl-launch -----


def _flodl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "flodl_async.cli.flodl", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **env},
        check=False,
    )


def test_a_trainer_launcher_registers_for_flodl_ps_and_status_and_unregisters_at_its_end(
    tmp_path: Path,
) -> None:
    import shutil
    import tempfile

    runtime = Path(
        tempfile.mkdtemp(prefix="fl-xdg-", dir="/tmp")
    )  # this test's own: other runs are not listed
    own = {"XDG_RUNTIME_DIR": str(runtime)}
    release = tmp_path / "release"
    run_id = new_run_id()
    hold = ("--epochs", "1", "--hold-file", str(release), "--hold-host", socket.gethostname())
    launcher = ScriptLauncher(tmp_path, *hold, run_id=run_id, env=own)
    try:
        launcher.wait_for_stdout("HOLDING rank", timeout=120)
        ps = _flodl("ps", env=own)
        assert ps.returncode == 0, ps.stderr
        rows = {line.split()[0]: line.split() for line in ps.stdout.splitlines()[1:]}
        assert set(rows) == {run_id}, ps.stdout
        assert rows[run_id][2] == str(launcher.proc.pid)
        address = rows[run_id][1]
        alone = _flodl("status", env=own)  # no --addr: the one local run
        assert alone.returncode == 0, alone.stderr
        assert f"run      {run_id}" in alone.stdout
        release.touch()
        done = launcher.finish(timeout=120)
    finally:
        release.touch()
        launcher.kill()
        assert_nothing_left(run_id)
    try:
        assert done.returncode == 0, done.stderr
        assert (
            f"status: flodl status --addr {address}, or http://{address}/" in done.stderr
        )  # flodl-launch's banner
        assert (
            os.listdir(runtime / "flodl" / "controllers") == []
        )  # removed by its owner (no reader has swept yet)
        assert "no flodl run on this machine" in _flodl("ps", env=own).stdout
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


# ----- what the review found untested: mixed dtypes, one session per rank ------------------------------


@pytest.mark.parametrize("backend", ["cpu", "collective"])
def test_tied_weights_integer_bool_and_bf16_buffers_average_as_the_spec_says(
    tmp_path: Path, backend: str
) -> None:
    """Integer and bool buffers average in float64 and round half to even, floats keep their dtype,
    tied keys stay tied. Strict lockstep (one step per rank per reduce) makes every value exact and known here."""
    epochs = 2
    done = as_launcher(
        tmp_path,
        "--mixed",
        "--policy",
        "sync",
        "--lockstep",
        "--backend",
        backend,
        "--epochs",
        str(epochs),
        run_id=new_run_id(),
    )
    assert done.returncode == 0, done.stderr
    saved = states(tmp_path)
    assert_identical(saved, ALL)
    state = saved["launcher--1"]["state"]
    steps = (
        epochs * (512 // 32) // 2
    )  # forwards per rank: each epoch's 16 batches split over 2 ranks
    dtypes = {
        "bn.num_batches_tracked": torch.int64,
        "marker": torch.int64,
        "flag": torch.bool,
        "ema": torch.bfloat16,
    }
    assert {key: t.dtype for key, t in state.items() if t.dtype != torch.float32} == dtypes
    assert "a.weight" in state
    assert "b.weight" in state
    assert torch.equal(
        state["a.weight"], state["b.weight"]
    )  # an untied copy would have trained apart
    # Equal counts on every rank: the average is the count (a sum would double it, a float cast would not be int64).
    assert int(state["bn.num_batches_tracked"]) == steps
    assert torch.equal(state["ema"], torch.full((3,), 0.125 * steps, dtype=torch.bfloat16))
    # Per-rank values: marker [5r, 7r] averages to [2.5, 3.5] -> half to even [2, 4]; flag [True, r == 0] -> [True, 0.5 -> False].
    assert state["marker"].tolist() == [2, 4]
    assert state["flag"].tolist() == [True, False]


def test_a_second_trainer_run_in_a_rank_is_a_clear_error(tmp_path: Path) -> None:
    run_id = new_run_id()
    done = run_launch(
        "--nproc", "2", "--devices", "cpu", "--port", "0", "--", PY, SCRIPT, "--out", str(tmp_path / "out"), "--twice", "--epochs", "1",
        run_id=run_id, env=ENV, timeout=180,
    )  # fmt: skip
    assert_nothing_left(run_id)
    assert done.returncode != 0, done.stderr
    assert done.stdout.count("TRAINER-DONE") == 2, (
        done.stdout
    )  # the first session trained to its end in both ranks
    output = done.stdout + done.stderr
    assert "a cluster training session was already run in this process" in output, output
    assert "Run one Trainer per process" in output, output
    assert "exited with code 1" in done.stderr, (
        done.stderr
    )  # the rank's own exit, in the launcher's verdict
