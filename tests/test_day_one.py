"""A torchrun user's first day (found in the acceptance of issue 9).

Every command answers --version, a typo gets the real option, the banner names
the caller's GPUs, a reused run id never appends to old logs, status folds rank lists.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from .launchkit import (
    PY,
    Launcher,
    assert_nothing_left,
    new_run_id,
    run_launch,
    script,
    wait_status,
)

pytestmark = pytest.mark.e2e


def _run(
    module: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.mark.parametrize("command", [["ps"], ["status"], ["token"], ["token", "new"]], ids=" ".join)
def test_every_flodl_sub_command_answers_version_and_shows_examples(command: list[str]) -> None:
    from flodl_async._version import __version__

    version = _run("flodl_async.cli.flodl", *command, "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"flodl {__version__}"
    helped = _run("flodl_async.cli.flodl", *command, "--help")
    assert helped.returncode == 0, helped.stderr
    assert "examples:\n  flodl " + command[0] in helped.stdout


def test_flodl_ps_help_states_its_own_exit_codes() -> None:
    helped = _run("flodl_async.cli.flodl", "ps", "--help").stdout
    assert "0    listed (none is no error)" in helped
    assert "a flodl controller answered" not in helped  # that is `flodl status`'s table


@pytest.mark.parametrize(
    ("module", "args", "hint"),
    [
        (
            "flodl_async.cli.launch",
            ["--nprc", "2", "--", PY, "-c", "pass"],
            "--nprc: did you mean --nproc?",
        ),
        (
            "flodl_async.cli.launch",
            ["--nproc", "1", "--log-dri", "x", "--", PY, "-c", "pass"],
            "--log-dri: did you mean --log-dir?",
        ),
        (
            "flodl_async.agent",
            ["--controler", "127.0.0.1:1"],
            "--controler: did you mean --controller?",
        ),
        (
            "flodl_async.cli.flodl",
            ["status", "--adr", "127.0.0.1:1"],
            "--adr: did you mean --addr?",
        ),
    ],
)
def test_a_mistyped_option_is_a_usage_error_naming_the_real_one(
    module: str, args: list[str], hint: str
) -> None:
    done = _run(module, *args)
    assert done.returncode == 2
    assert hint in done.stderr
    assert "Traceback" not in done.stderr


def test_torchrun_underscore_spellings_of_our_options_work(tmp_path: Path) -> None:
    run_id = new_run_id()
    done = run_launch(
        "--nproc", "2", "--devices", "cpu", "--port", "0", "--max_restarts", "1", f"--log_dir={tmp_path}", "--local_ranks_filter", "0",
        "--", PY, "-c", "import os; print('rank', os.environ['RANK'], 'max', os.environ['TORCHELASTIC_MAX_RESTARTS'])",
        run_id=run_id,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "rank 0 max 1" in done.stdout
    assert "rank 1" not in done.stdout  # the filter took
    assert (tmp_path / run_id / "attempt_0" / "1" / "stdout.log").read_text() == "rank 1 max 1\n"
    status = _run(
        "flodl_async.cli.flodl",
        "status",
        "--silent_after",
        "5",
        "--addr",
        "127.0.0.1:1",
        "--timeout",
        "0.5",
    )
    assert status.returncode == 1, (
        status.stderr
    )  # parsed (nothing answers there), not a usage error


@pytest.mark.parametrize(
    "command",
    [["python", "-u", "train.py"], [PY, "-m", "torch.distributed.run"]],
    ids=["python -u", "python -m"],
)
def test_forgetting_the_double_dash_before_a_command_with_options_is_said(
    command: list[str],
) -> None:
    done = _run("flodl_async.cli.launch", "--nproc", "2", *command)
    assert done.returncode == 2
    assert f"unexpected {command[0]!r}: did you forget `--` before the command?" in done.stderr
    assert "unrecognized arguments" not in done.stderr


def _four_gpus(tmp_path: Path) -> dict[str, str]:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl"):
        (dev / name).touch()
    return {"FLODL_INTERNAL_DEV_DIR": str(dev)}


@pytest.mark.parametrize(
    ("mask", "flags", "shown"),
    [
        ("2,3", ["--nproc", "auto"], "GPU 2,3"),
        ("1,2,3", ["--nproc", "2", "--devices", "0,2"], "GPU 1,3"),
        (None, ["--nproc", "2"], "GPU 0,1"),
    ],
)
def test_the_banner_names_the_gpus_in_the_callers_terms(
    tmp_path: Path, mask: str | None, flags: list[str], shown: str
) -> None:
    env = _four_gpus(tmp_path)
    if mask is not None:
        env["CUDA_VISIBLE_DEVICES"] = mask
    elif "CUDA_VISIBLE_DEVICES" in os.environ:
        pytest.skip("the caller's environment sets CUDA_VISIBLE_DEVICES")
    run_id = new_run_id()
    done = run_launch(
        *flags,
        "--port",
        "0",
        "--",
        PY,
        "-c",
        "import os; print('mask', os.environ['CUDA_VISIBLE_DEVICES'])",
        run_id=run_id,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert f"mask {shown.removeprefix('GPU ')}" in done.stdout  # what the ranks got ...
    assert f"2 ranks on this host ({shown})" in done.stderr  # ... is what the banner says


def test_a_reused_run_id_adds_an_attempt_and_never_appends_to_an_earlier_runs_logs(
    tmp_path: Path,
) -> None:
    """The `--rdzv-id=$SLURM_JOB_ID` resubmit habit: a second run of one id in one log dir is the
    next attempt of it (torchrun's layout, read by the same readers), never written into the first."""
    run_id = new_run_id()
    printing = (
        "--",
        PY,
        "-c",
        "import os; print('attempt', os.environ['TORCHELASTIC_RUN_ID'], os.getpid())",
    )
    common = ("--nproc", "1", "--devices", "cpu", "--port", "0", "--log-dir", str(tmp_path))
    first = run_launch(*common, *printing, run_id=run_id)
    assert first.returncode == 0, first.stderr
    log = tmp_path / run_id / "attempt_0" / "0" / "stdout.log"
    before = log.read_text()
    again = run_launch(*common, *printing, run_id=run_id)
    assert again.returncode == 0, again.stderr
    assert (
        f"--log-dir: run id {run_id} has earlier attempts in {tmp_path}; this run's start at "
        "attempt_1" in again.stderr
    )
    assert log.read_text() == before  # the first run's logs are as it left them
    second = (tmp_path / run_id / "attempt_1" / "0" / "stdout.log").read_text()
    assert second.startswith(f"attempt {run_id} ")
    assert second != before
    third = run_launch(*common, "--max-restarts", "1", *printing, run_id=run_id)
    assert third.returncode == 0, third.stderr
    assert sorted(p.name for p in (tmp_path / run_id).iterdir() if p.is_dir()) == [
        "attempt_0",
        "attempt_1",
        "attempt_2",
    ]
    # each launch's own event log and verdict beside them (tests/test_eventlog.py), none appended to
    files = sorted(p.name for p in (tmp_path / run_id).iterdir() if p.is_file())
    assert files == [
        "events.1.jsonl",
        "events.2.jsonl",
        "events.jsonl",
        "verdict.1.json",
        "verdict.2.json",
        "verdict.json",
    ]


def test_flodl_status_folds_a_hosts_rank_and_device_lists(tmp_path: Path) -> None:
    release = tmp_path / "release"
    launcher = Launcher(
        "--nproc",
        "4",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--",
        PY,
        script("wait_for_file.py"),
        str(release),
        run_id=new_run_id(),
    )
    try:
        launcher.wait_for_stdout("ready pid", count=4)
        assert launcher.proc.stderr is not None
        banner = launcher.proc.stderr.readline()
        while (
            "status: flodl status --addr" not in banner
        ):  # the oversubscription warning may come first
            banner = launcher.proc.stderr.readline()
            assert banner, "the launcher ended before its banner"
        found = re.search(r"--addr (127\.0\.0\.1:(\d+))", banner)
        assert found is not None, banner
        wait_status(int(found.group(2)), lambda d: d.get("phase") == "training")
        shown = _run("flodl_async.cli.flodl", "status", "--addr", found.group(1))
        assert shown.returncode == 0, shown.stderr
        host_rows = [line.split() for line in shown.stdout.splitlines() if line.endswith(" joined")]
        assert len(host_rows) == 1, shown.stdout
        assert host_rows[0][1:3] == ["0-3", "cpu:0-3"], shown.stdout
        release.touch()
        assert launcher.finish().returncode == 0
    finally:
        release.touch()
        launcher.kill()


def _on_one_core() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


@pytest.mark.parametrize(("nproc", "warned"), [(1, False), (2, True)])
def test_more_cpu_ranks_than_the_launchers_cores_is_warned_about(nproc: int, warned: bool) -> None:
    run_id = new_run_id()
    try:  # the launcher may use one core (its affinity, as `taskset -c 0` sets it)
        done = subprocess.run(
            [PY, "-m", "flodl_async.cli.launch", "--run-id", run_id, "--nproc", str(nproc), "--devices", "cpu", "--port", "0", "--", PY, "-c", "pass"],
            capture_output=True, text=True, timeout=120, preexec_fn=_on_one_core, check=False,
        )  # fmt: skip
    finally:
        assert_nothing_left(run_id)
    assert done.returncode == 0, done.stderr
    warning = f"warning: {nproc} CPU ranks on this host, which has 1 core(s) for them: they will compete for the cores"
    assert (warning in done.stderr) is warned, done.stderr
