"""flodl-launch end to end: real subprocesses, real torch.distributed (gloo), real signals."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from .launchkit import (
    PY,
    Launcher,
    assert_nothing_left,
    free_port,
    launch_cmd,
    new_run_id,
    processes_of_run,
    run_launch,
    script,
)

pytestmark = pytest.mark.e2e

CONTRACT = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
    "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)  # fmt: skip


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_all_reduce_gives_the_right_sum_on_every_rank(nproc: int) -> None:
    run_id = new_run_id()
    done = run_launch(
        "--nproc",
        str(nproc),
        "--devices",
        "cpu",
        "--port",
        "0",
        "--",
        PY,
        script("allreduce.py"),
        run_id=run_id,
    )
    assert done.returncode == 0, done.stderr
    expected = nproc * (nproc + 1) / 2
    for rank in range(nproc):
        assert re.search(
            rf"^\[[^\]]+:r{rank}\] rank {rank} of {nproc} sum {expected:g}$", done.stdout, re.M
        ), done.stdout
    assert (
        f"done — all {nproc} ranks exited 0" if nproc > 1 else "done — the rank exited 0"
    ) in done.stderr


def test_example_training_loss_falls(tmp_path: Path) -> None:
    run_id = new_run_id()
    done = run_launch(
        "--nproc", "2", "--port", "0", "--log-dir", str(tmp_path), "--",
        PY, str(Path(__file__).parent.parent / "examples" / "train.py"), "--epochs", "4",
        run_id=run_id,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    match = re.search(r"first loss ([\d.]+) last loss ([\d.]+)", done.stdout)
    assert match, done.stdout
    first, last = float(match.group(1)), float(match.group(2))
    assert last < first / 2
    # --log-dir: torchrun's layout, one file per rank and stream, holding its bytes without prefixes.
    attempt = tmp_path / run_id / "attempt_0"
    assert "first loss" in (attempt / "0" / "stdout.log").read_text()
    assert (attempt / "1" / "stdout.log").exists()
    assert (attempt / "1" / "stderr.log").exists()


def test_every_rank_gets_the_torchrun_contract(tmp_path: Path) -> None:
    run_id = new_run_id()
    done = run_launch(
        "--nproc",
        "3",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--max-restarts",
        "2",
        "--",
        PY,
        script("dump_env.py"),
        str(tmp_path),
        run_id=run_id,
    )
    assert done.returncode == 0, done.stderr
    envs = [json.loads((tmp_path / f"env-{r}.json").read_text()) for r in range(3)]
    for env in envs:
        missing = [k for k in CONTRACT if k not in env]
        assert not missing, missing
    assert sorted(int(e["RANK"]) for e in envs) == [0, 1, 2]
    assert sorted(int(e["LOCAL_RANK"]) for e in envs) == [0, 1, 2]
    for env in envs:
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "3"
        assert env["ROLE_RANK"] == env["RANK"]
        assert env["GROUP_RANK"] == "0"
        assert env["GROUP_WORLD_SIZE"] == "1"
        assert env["TORCHELASTIC_RUN_ID"] == run_id
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "2"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert env["OMP_NUM_THREADS"] == "1"
        assert "CUDA_VISIBLE_DEVICES" not in env
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert len({e["TORCHELASTIC_ERROR_FILE"] for e in envs}) == 3


def test_rank_failure_names_the_rank_and_its_last_stderr_lines() -> None:
    run_id = new_run_id()
    started = time.monotonic()
    done = run_launch(
        "--nproc",
        "3",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--stop-grace",
        "3",
        "--",
        PY,
        script("fail.py"),
        run_id=run_id,
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 4, done.stderr
    assert "FAILED — rank 1 (local rank 1) on host" in done.stderr
    assert "exited with code 3" in done.stderr
    assert "boom: rank 1 is giving up" in done.stderr
    assert "last 20 stderr line(s) of rank 1" in done.stderr
    assert "Traceback" not in done.stderr
    assert elapsed < 30  # the other ranks were stopped, not waited for (they sleep 600 s)


def test_record_traceback_appears_in_the_verdict() -> None:
    """Hidden from the console (--local-ranks-filter 1), rank 0's traceback is in the verdict, once."""
    run_id = new_run_id()
    args = (
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--stop-grace",
        "3",
        "--local-ranks-filter",
        "1",
    )
    done = run_launch(*args, "--", PY, script("raise_record.py"), run_id=run_id)
    assert done.returncode == 4, done.stderr
    assert "rank 0 (local rank 0)" in done.stderr
    assert "traceback (from the rank's error file):" in done.stderr
    assert done.stderr.count('raise ValueError("deliberate failure for the verdict test")') == 1, (
        done.stderr
    )


@pytest.mark.parametrize("group", [(), ("--process-group",)], ids=["plain", "rank-prefixed"])
def test_record_traceback_shown_live_is_not_repeated_by_the_verdict(group: tuple[str, ...]) -> None:
    """Today's three copies (live, error file, stderr tail) are one: the live one, which the verdict
    points at. Its outer frames (above @record's) and torch's ``[rank0]:`` prefix (a rank in a
    process group) make no second copy under "last N stderr line(s)"."""
    run_id = new_run_id()
    done = run_launch(
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--stop-grace",
        "3",
        "--",
        PY,
        script("raise_record.py"),
        *group,
        run_id=run_id,
    )
    assert done.returncode == 4, done.stderr
    assert done.stderr.count('raise ValueError("deliberate failure for the verdict test")') == 1, (
        done.stderr
    )
    verdict = done.stderr.split("FAILED —", 1)[1]
    assert "stderr line(s)" not in verdict, done.stderr  # nothing but the traceback was on stderr
    assert "main()" not in verdict, done.stderr
    assert re.search(r"^\[[^\]]+:r0\] .*raise ValueError", done.stderr, re.M), (
        done.stderr
    )  # the one copy: rank 0's own, live
    assert "traceback: above, in rank 0's stderr" in done.stderr
    assert (
        "  ValueError: deliberate failure for the verdict test"
        in done.stderr.split("FAILED —", 1)[1]
    )


def test_quiet_keeps_the_verdict_line_and_the_rank_output() -> None:
    run_id = new_run_id()
    done = run_launch(
        "-q",
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--",
        PY,
        script("allreduce.py"),
        run_id=run_id,
    )
    assert done.returncode == 0, done.stderr
    assert "rank 1 of 2 sum 3" in done.stdout
    ours = [
        line
        for line in done.stderr.splitlines()
        if line.startswith("flodl-launch:") and "warning:" not in line
    ]  # a 1-core CI box warns
    assert len(ours) == 1, ours
    assert ours[0].startswith("flodl-launch: done — all 2 ranks exited 0")


def test_an_nproc_run_starts_with_one_banner_line_and_details_under_verbose() -> None:
    run_id = new_run_id()
    done = run_launch(
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--",
        PY,
        script("allreduce.py"),
        run_id=run_id,
    )
    assert done.returncode == 0, done.stderr
    ours = [
        line
        for line in done.stderr.splitlines()
        if line.startswith("flodl-launch:") and "warning:" not in line
    ]
    assert len(ours) == 2, (
        ours
    )  # the banner and the verdict (a 1-core CI box adds the oversubscription warning)
    banner = rf"flodl-launch: run {run_id}: 2 ranks on this host \(CPU\) — .*allreduce.py — status: flodl status --addr 127.0.0.1:(\d+), or http://127.0.0.1:\1/"
    assert re.fullmatch(
        banner, ours[0]
    )  # --port 0 is not the default port: the banner gives the --addr
    verbose = run_launch(
        "-v",
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--",
        PY,
        script("allreduce.py"),
        run_id=new_run_id(),
    )
    assert "window open (quorum 2 ranks" in verbose.stderr
    assert "joined with ranks 0-1 (cpu:0-1)" in verbose.stderr


def test_a_sigkill_we_did_not_send_points_at_the_oom_killer() -> None:
    run_id = new_run_id()
    kill_self = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    done = run_launch("--nproc", "1", "--port", "0", "--", PY, "-c", kill_self, run_id=run_id)
    assert done.returncode == 4, done.stderr
    assert (
        "was killed by SIGKILL (not sent by flodl; the kernel's OOM killer is the usual cause"
        in done.stderr
    )


def test_more_cpu_ranks_than_cores_is_warned_about() -> None:
    cores = len(os.sched_getaffinity(0))
    done = run_launch(
        "--nproc",
        str(cores + 1),
        "--devices",
        "cpu",
        "--port",
        "0",
        "--",
        PY,
        "-c",
        "pass",
        run_id=new_run_id(),
    )
    assert done.returncode == 0, done.stderr
    assert (
        f"warning: {cores + 1} CPU ranks on this host, which has {cores} core(s) for them"
        in done.stderr
    )
    fits = run_launch(
        "--nproc",
        "1",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--",
        PY,
        "-c",
        "pass",
        run_id=new_run_id(),
    )
    assert "CPU ranks on this host" not in fits.stderr


def test_max_restarts_recovers_from_one_failure() -> None:
    run_id = new_run_id()
    done = run_launch(
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--max-restarts",
        "1",
        "--",
        PY,
        script("flaky.py"),
        run_id=run_id,
    )
    assert done.returncode == 0, done.stderr
    assert "restarting the world (restart 1 of 1)" in done.stderr
    assert "done — all 2 ranks exited 0 after 1 restart (" in done.stderr
    assert re.search(r"r0\] attempt 1 rank 0 sum 2", done.stdout), done.stdout
    assert re.search(r"r1\] attempt 1 rank 1 sum 2", done.stdout), done.stdout


def test_without_restarts_the_same_failure_fails_the_run() -> None:
    run_id = new_run_id()
    done = run_launch(
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--stop-grace",
        "2",
        "--",
        PY,
        script("flaky.py"),
        run_id=run_id,
    )
    assert done.returncode == 4
    assert "failing on purpose in attempt 0" in done.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_the_run_gracefully(sig: signal.Signals, tmp_path: Path) -> None:
    run_id = new_run_id()
    launcher = Launcher(
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--stop-grace",
        "5",
        "--",
        PY,
        script("wait_for_file.py"),
        str(tmp_path / "never"),
        run_id=run_id,
    )
    try:
        launcher.wait_for_stdout("ready pid", count=2)
        assert len(processes_of_run(run_id)) >= 2
        started = time.monotonic()
        launcher.proc.send_signal(sig)
        done = launcher.finish(timeout=30)
    finally:
        launcher.kill()
    assert done.returncode == 128 + sig, done.stderr
    assert f"interrupted by {sig.name}" in done.stderr
    assert f"stopping: ranks got {sig.name}" in done.stderr
    assert time.monotonic() - started < 15


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ranks_get_the_launchers_signal_first(sig: signal.Signals, tmp_path: Path) -> None:
    """The signal table: Ctrl-C reaches plain-script ranks as SIGINT (their KeyboardInterrupt handler runs), SIGTERM as SIGTERM."""
    run_id = new_run_id()
    rank = tmp_path / "save_on_signal.py"
    # Both handlers are in place before `ready` leaves: the SIGTERM one is installed first, and
    # `ready` is printed inside the `try`, so a Ctrl-C sent the moment the line arrives (while the
    # rank is still returning from print) lands in the rank's KeyboardInterrupt handler.
    rank.write_text(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda s, f: (print('saved on SIGTERM', flush=True), sys.exit(0)))\n"
        "try:\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(600)\n"
        "except KeyboardInterrupt:\n"
        "    print('saved on SIGINT', flush=True)\n"
    )
    launcher = Launcher(
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--stop-grace",
        "20",
        "--",
        PY,
        str(rank),
        run_id=run_id,
    )
    try:
        launcher.wait_for_stdout("ready", count=2)
        launcher.proc.send_signal(sig)
        done = launcher.finish(timeout=30)
    finally:
        launcher.kill()
    assert done.returncode == 128 + sig, done.stderr
    assert done.stdout.count(f"saved on {sig.name}") == 2, done.stdout
    again = "Ctrl-C" if sig is signal.SIGINT else "SIGTERM"
    assert f"stopping: ranks got {sig.name}; KILL in 20 s ({again} again to force)" in done.stderr


def test_second_signal_forces(tmp_path: Path) -> None:
    run_id = new_run_id()
    trap = tmp_path / "trap_term.py"
    trap.write_text(
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "signal.signal(signal.SIGINT, lambda s, f: print('ignoring SIGINT', flush=True))\n"
        "print('ready', flush=True)\n"
        "while True:\n"
        "    time.sleep(600)\n"
    )
    launcher = Launcher(
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--stop-grace",
        "60",
        "--",
        PY,
        str(trap),
        run_id=run_id,
    )
    try:
        launcher.wait_for_stdout("ready", count=2)
        started = time.monotonic()
        launcher.proc.send_signal(signal.SIGINT)
        launcher.wait_for_stdout(
            "ignoring SIGINT", count=2
        )  # the graceful stop began; the ranks ignore it
        launcher.proc.send_signal(signal.SIGINT)
        done = launcher.finish(timeout=30)
    finally:
        launcher.kill()
    assert done.returncode == 130
    assert "forcing the stop" in done.stderr
    assert time.monotonic() - started < 20  # far below the 60 s grace


def test_sigkill_of_the_launcher_leaves_no_rank(tmp_path: Path) -> None:
    run_id = new_run_id()
    launcher = Launcher(
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--",
        PY,
        script("wait_for_file.py"),
        str(tmp_path / "never"),
        run_id=run_id,
    )
    try:
        launcher.wait_for_stdout("ready pid", count=2)
        assert processes_of_run(run_id)
        launcher.proc.kill()
        launcher.proc.wait(10)
        assert_nothing_left(run_id, within=10)  # parent-death signal, no launcher cleanup involved
    finally:
        launcher.kill()


def test_relay_carries_the_rank_handshake_and_heartbeats() -> None:
    run_id = new_run_id()
    done = run_launch(
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--",
        PY,
        script("relay_client.py"),
        run_id=run_id,
    )
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert re.search(
            rf"r{rank}\] rank {rank} welcomed by run {run_id}; heartbeat rtts ms \[[\d., ]+\]",
            done.stdout,
        ), done.stdout
        assert f"r{rank}] rank {rank} relay socket mode 0o600" in done.stdout


def test_lines_are_never_torn_or_interleaved(tmp_path: Path) -> None:
    chatty = tmp_path / "chatty.py"
    chatty.write_text(
        "import os, sys\nr = os.environ['RANK']\nfor i in range(2000):\n    sys.stdout.write(f'rank {r} line {i} ' + 'x' * 200 + ' end\\n')\n"
    )
    run_id = new_run_id()
    done = run_launch(
        "--nproc", "3", "--devices", "cpu", "--port", "0", "--", PY, str(chatty), run_id=run_id
    )
    assert done.returncode == 0
    lines = [line for line in done.stdout.splitlines() if " line " in line]
    assert len(lines) == 6000
    pattern = re.compile(r"^\[[^\]]+:r(\d)\] rank (\d) line \d+ x{200} end$")
    for line in lines:
        match = pattern.match(line)
        assert match, line[:120]
        assert match.group(1) == match.group(2)


def test_the_example_runs_unchanged_under_torchrun() -> None:
    done = subprocess.run(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(Path(__file__).parent.parent / "examples" / "train.py"), "--epochs", "2"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    # torchrun's summary is last; what a rank itself printed before it died (a gloo abort's own
    # message) is first
    assert done.returncode == 0, done.stderr[:3000] + "\n...\n" + done.stderr[-1500:]
    assert re.search(r"first loss [\d.]+ last loss [\d.]+", done.stdout), done.stdout


def test_torch_store_backend_with_a_restart() -> None:
    """FLODL_STORE_BACKEND=torch: torch's own TCPStore in a child on the pre-bound socket, one per round."""
    run_id = new_run_id()
    done = run_launch(
        "--nproc", "2", "--devices", "cpu", "--port", "0", "--max-restarts", "1", "--", PY, script("flaky.py"),
        run_id=run_id, env={"FLODL_STORE_BACKEND": "torch"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert re.search(r"r1\] attempt 1 rank 1 sum 2", done.stdout), done.stdout


def test_a_rank_failing_with_huge_stderr_lines_is_a_rank_failure_not_an_agent_crash() -> None:
    """20 stderr lines of 60 KB used to make a RankExited above the join channel's 1 MiB frame ceiling (an ExceptionGroup)."""
    noisy = (
        "import sys\nfor _ in range(25):\n    sys.stderr.write('E' * 60000 + '\\n')\nsys.exit(3)\n"
    )
    done = run_launch(
        "--nproc",
        "1",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--",
        PY,
        "-c",
        noisy,
        run_id=new_run_id(),
    )
    assert done.returncode == 4, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "exited with code 3" in done.stderr
    assert "last 20 stderr line(s) of rank 0" in done.stderr
    assert "(57952 more bytes)" in done.stderr


def _four_gpu_host(tmp_path: Path) -> dict[str, str]:
    """This host made to look like it has four GPUs: only where the device nodes are counted changes."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl", "nvidia-uvm"):
        (dev / name).touch()
    return {"FLODL_INTERNAL_DEV_DIR": str(dev)}


def _rank_gpus(out: Path, nproc: int) -> dict[int, str]:
    """Each rank's GPU as torch would pick it: cuda:LOCAL_RANK within the rank's own CUDA_VISIBLE_DEVICES."""
    envs = [json.loads((out / f"env-{r}.json").read_text()) for r in range(nproc)]
    return {
        int(e["RANK"]): e["CUDA_VISIBLE_DEVICES"].split(",")[int(e["LOCAL_RANK"])] for e in envs
    }


@pytest.mark.parametrize(
    ("mask", "args", "expected"),
    [
        (
            "2,3",
            ["--nproc", "auto"],
            {0: "2", 1: "3"},
        ),  # auto: the visible GPUs, placed within the caller's mask
        ("2,3", ["--nproc", "2", "--devices", "all"], {0: "2", 1: "3"}),
        (
            "1,2,3",
            ["--nproc", "2", "--devices", "0,2"],
            {0: "1", 1: "3"},
        ),  # ids index into the visible set, as cuda:N does
        (None, ["--nproc", "2", "--devices", "1,3"], {0: "1", 1: "3"}),
    ],
)
def test_gpu_ranks_are_placed_within_the_callers_cuda_visible_devices(
    tmp_path: Path, mask: str | None, args: list[str], expected: dict[int, str]
) -> None:
    env = _four_gpu_host(tmp_path)
    if mask is not None:
        env["CUDA_VISIBLE_DEVICES"] = mask
    out = tmp_path / "out"
    out.mkdir()
    done = run_launch(
        *args,
        "--port",
        "0",
        "--",
        PY,
        script("dump_env.py"),
        str(out),
        run_id=new_run_id(),
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert _rank_gpus(out, len(expected)) == expected


def test_a_cluster_files_gpu_ids_index_into_the_callers_cuda_visible_devices(
    tmp_path: Path,
) -> None:
    """``devices: [0, 2]`` in a cluster file is the visible set's 0th and 2nd GPU, as ``--devices 0,2`` is."""
    env = {**_four_gpu_host(tmp_path), "CUDA_VISIBLE_DEVICES": "1,2,3"}
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"controller:\n  host: 127.0.0.1\n  port: {free_port()}\nworkers:\n  - host: {socket.gethostname()}\n    devices: [0, 2]\n"
    )
    out = tmp_path / "out"
    out.mkdir()
    done = run_launch(
        str(cluster), "--", PY, script("dump_env.py"), str(out), run_id=new_run_id(), env=env
    )
    assert done.returncode == 0, done.stderr
    assert _rank_gpus(out, 2) == {0: "1", 1: "3"}


def test_a_gpu_id_outside_the_mask_is_refused_before_anything_starts(tmp_path: Path) -> None:
    env = {**_four_gpu_host(tmp_path), "CUDA_VISIBLE_DEVICES": "2,3"}
    done = run_launch(
        "--nproc",
        "2",
        "--devices",
        "0,2",
        "--port",
        "0",
        "--",
        PY,
        script("dump_env.py"),
        str(tmp_path),
        run_id=new_run_id(),
        env=env,
    )
    assert done.returncode == 2
    assert "GPU 2 is not visible here: this host shows 2 GPU(s) (visible: 2,3)" in done.stderr


def test_one_rank_keeps_every_core_and_nproc_auto_without_gpus_uses_the_cores(
    tmp_path: Path,
) -> None:
    """OMP_NUM_THREADS=1 only when a host runs several ranks (torchrun's rule); auto on a GPU-less host is one rank per core."""
    env = {"FLODL_INTERNAL_DEV_DIR": str(tmp_path / "no-dev")}  # a host with no GPU at all
    env_without_omp = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    one = tmp_path / "one"
    one.mkdir()
    done = subprocess.run(
        [*launch_cmd("--nproc", "1", "--port", "0", "--", PY, script("dump_env.py"), str(one), run_id=(run_id := new_run_id()))],
        capture_output=True, text=True, timeout=120, env={**env_without_omp, **env}, check=False,
    )  # fmt: skip
    assert_nothing_left(run_id)
    assert done.returncode == 0, done.stderr
    assert "OMP_NUM_THREADS" not in json.loads((one / "env-0.json").read_text())
    cores = len(os.sched_getaffinity(0))
    auto = tmp_path / "auto"
    auto.mkdir()
    done = run_launch(
        "--nproc",
        "auto",
        "--port",
        "0",
        "--",
        PY,
        script("dump_env.py"),
        str(auto),
        run_id=new_run_id(),
        env=env,
    )
    assert done.returncode == 0, done.stderr
    envs = [json.loads((auto / f"env-{r}.json").read_text()) for r in range(cores)]
    assert {e["WORLD_SIZE"] for e in envs} == {str(cores)}
    assert all("CUDA_VISIBLE_DEVICES" not in e for e in envs)
    if cores > 1 and "OMP_NUM_THREADS" not in os.environ:
        assert {e["OMP_NUM_THREADS"] for e in envs} == {"1"}


def _left_on_disk(tmp: Path) -> list[str]:
    """What a run left in the temp dir: any flodl-agent-* directory, and any entry in the runtime directory."""
    left = [p.name for p in tmp.iterdir() if p.name.startswith("flodl-agent-")]
    root = tmp / f"flodl-{os.getuid()}"
    for sub in ("runs", "controllers"):
        if (root / sub).is_dir():
            left.extend(f"{sub}/{p.name}" for p in (root / sub).iterdir())
    return left


def test_nothing_of_a_run_outlives_it_on_disk(tmp_path: Path) -> None:
    """Success, failure, and a SIGKILLed launcher (whose leftovers the next start sweeps): the temp dir ends as it began."""
    # short, wherever pytest's own temp dir is: a TMPDIR too deep for socket paths would put the
    # runtime directory elsewhere (test_deep_tmpdir.py covers that)
    tmp = Path(tempfile.mkdtemp(prefix="fl-tmp-", dir="/tmp"))
    try:
        _nothing_outlives_a_run_in(tmp, tmp_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _nothing_outlives_a_run_in(tmp: Path, tmp_path: Path) -> None:
    env = {
        "TMPDIR": str(tmp),
        "XDG_RUNTIME_DIR": "",
    }  # the runtime directory falls back to <tempdir>/flodl-<uid>
    ok = run_launch(
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--",
        PY,
        "-c",
        "pass",
        run_id=new_run_id(),
        env=env,
    )
    assert ok.returncode == 0, ok.stderr
    assert _left_on_disk(tmp) == []
    failed = run_launch(
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--stop-grace",
        "2",
        "--",
        PY,
        script("fail.py"),
        run_id=new_run_id(),
        env=env,
    )
    assert failed.returncode == 4, failed.stderr
    assert _left_on_disk(tmp) == []
    run_id = new_run_id()
    killed = Launcher(
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--",
        PY,
        script("wait_for_file.py"),
        str(tmp_path / "never"),
        run_id=run_id,
        env=env,
    )
    try:
        killed.wait_for_stdout("ready pid", count=2)
        assert _left_on_disk(tmp)  # a live run has its entries
        killed.proc.kill()
        killed.proc.wait(10)
        assert_nothing_left(run_id)
        assert _left_on_disk(
            tmp
        )  # SIGKILL left no chance to clean up: the sweep below is what removes them
    finally:
        killed.kill()
    after = run_launch(
        "--nproc",
        "1",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--",
        PY,
        "-c",
        "pass",
        run_id=new_run_id(),
        env=env,
    )
    assert after.returncode == 0, after.stderr
    assert _left_on_disk(tmp) == []  # the SIGKILLed run's entries were swept by the next start
