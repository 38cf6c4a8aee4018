"""The event log in --log-dir (DIR/<run id>/events.jsonl and verdict.json), written on every way out — a verdict or
Ctrl-C — and `flodl status --from-log DIR`, which replays a finished run's summary."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from flodl_async.cli.eventreplay import find_log, read_events, summarize
from flodl_async.errors import ConfigError
from flodl_async.status.events import EpochDone, RoundDone, Stamped, VerdictGiven

from .launchkit import PY, Launcher, free_port, new_run_id, run_flodl, run_launch, script

_flodl = run_flodl


def _kinds(path: Path) -> list[str]:
    return [json.loads(line)["kind"] for line in path.read_text().splitlines()]


@pytest.mark.e2e
def test_a_finished_run_leaves_its_events_and_verdict_and_flodl_status_replays_them(
    tmp_path: Path,
) -> None:
    run_id = new_run_id()
    logs = tmp_path / "logs"
    done = run_launch(
        "--nproc", "2", "--devices", "cpu", "--port", "0", "--log-dir", str(logs),
        "--", PY, script("dump_env.py"), str(tmp_path), run_id=run_id,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    events = logs / run_id / "events.jsonl"
    kinds = _kinds(events)
    assert kinds[0] == "phase"
    assert "host_joined" in kinds
    assert "world_formed" in kinds
    assert kinds[-1] == "verdict"
    ids = [json.loads(line)["id"] for line in events.read_text().splitlines()]
    assert ids == list(range(1, len(ids) + 1))
    verdict = json.loads((logs / run_id / "verdict.json").read_text())
    assert verdict["exit_code"] == 0
    assert verdict["run_id"] == run_id
    replayed = _flodl("status", "--from-log", str(logs))
    assert replayed.returncode == 0, replayed.stderr
    assert f"run      {run_id}" in replayed.stdout
    assert f"verdict  {verdict['verdict']} (exit 0)" in replayed.stdout
    assert "world of 2 rank(s) formed" in replayed.stdout


@pytest.mark.e2e
def test_ctrl_c_still_ends_the_log_with_the_verdict(tmp_path: Path) -> None:
    run_id = new_run_id()
    logs = tmp_path / "logs"
    launcher = Launcher(
        "--nproc", "1", "--devices", "cpu", "--port", "0", "--log-dir", str(logs), "--tee", "3",
        "--", PY, script("wait_for_file.py"), str(tmp_path / "never"), run_id=run_id,
    )  # fmt: skip
    try:
        launcher.wait_for_stdout("ready pid")
        launcher.proc.send_signal(signal.SIGINT)
        done = launcher.finish()
    finally:
        launcher.kill()
    assert done.returncode == 130, done.stderr
    kinds = _kinds(logs / run_id / "events.jsonl")
    assert kinds[-1] == "verdict"
    assert json.loads((logs / run_id / "verdict.json").read_text())["exit_code"] == 130


def _line(stamped: Stamped) -> str:
    return stamped.to_json().decode()


def test_the_replay_tells_the_last_run_of_the_log(tmp_path: Path) -> None:
    run = tmp_path / "logs" / "run-x"
    run.mkdir(parents=True)
    first = Stamped(id=1, at=100.0, event=VerdictGiven(exit_code=1, reason="an earlier attempt"))
    epoch = EpochDone(
        epoch=1, epochs=1, avg_loss=0.25, epoch_s=2.0, batches=8, reduces=2, avg_reduce_s=0.1, anchor=4,
        per_rank=(),
    )  # fmt: skip
    later = [
        Stamped(
            id=1, at=200.0, event=RoundDone(round=1, round_kind="average", reduce_s=0.5, batches=4)
        ),
        Stamped(id=2, at=201.0, event=epoch),
        Stamped(
            id=3, at=230.0, event=VerdictGiven(exit_code=0, reason="training complete\x1b[31m")
        ),
    ]
    (run / "events.jsonl").write_text(
        "\n".join(
            [_line(first), *(_line(s) for s in later), '{"id": 4, "kind": "verd']
        )  # cut mid-line
    )
    assert find_log(tmp_path / "logs") == run / "events.jsonl"
    events = read_events(run / "events.jsonl")
    assert [e["id"] for e in events] == [1, 2, 3]
    text = summarize("run-x", events)
    assert "verdict  training complete[31m (exit 0)" in text  # the escape is stripped
    assert "training 1 epoch(s), 1 round(s), 0.50 s reducing; loss by epoch: 0.25" in text
    assert "(30s)" in text
    assert "an earlier attempt" not in text


def test_from_log_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no event log in"):
        find_log(tmp_path)
    for run in ("run-a", "run-b"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "events.jsonl").write_text("")
    with pytest.raises(ConfigError, match="holds 2 runs"):
        find_log(tmp_path)
    done = _flodl("status", "--from-log", str(tmp_path))
    assert done.returncode == 1
    assert "pass one: --from-log" in done.stderr
    assert _flodl("status", "--from-log", str(tmp_path), "--addr", "127.0.0.1:1").returncode == 2


@pytest.mark.e2e
def test_fa_report_from_a_plain_script_reaches_metrics_and_the_event_log(tmp_path: Path) -> None:
    run_id, port, release = new_run_id(), free_port(), tmp_path / "release"
    logs = tmp_path / "logs"
    launcher = Launcher(
        "--nproc", "2", "--devices", "cpu", "--port", str(port), "--log-dir", str(logs), "--tee", "3",
        "--", PY, script("report_scalars.py"), str(release), run_id=run_id,
    )  # fmt: skip
    try:
        launcher.wait_for_stdout("reported rank", count=2)
        reported = time.monotonic()
        wanted = ('flodl_scalar{name="loss",rank="0"} 0.5', 'flodl_scalar{name="loss",rank="1"} 1.5',
                  'flodl_scalar{name="lr",rank="1"} 0.01')  # fmt: skip
        deadline = reported + 10
        body = ""
        while not all(w in body for w in wanted):
            assert time.monotonic() < deadline, body
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                body = response.read().decode()
        assert (
            time.monotonic() - reported < 5
        )  # "within a second or two", with room for a busy host
        release.touch()
        done = launcher.finish()
    finally:
        release.touch()
        launcher.kill()
    assert done.returncode == 0, done.stderr
    scalars = [
        json.loads(line)
        for line in (logs / run_id / "events.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "scalars"
    ]
    assert {e["rank"] for e in scalars} == {0, 1}
    assert all(e["scalars"]["loss"] in (0.5, 1.5) for e in scalars)


def test_fa_report_outside_a_flodl_run_does_nothing() -> None:
    code = (
        "import threading, flodl_async as fa\n"
        "fa.report(loss=1.0)\nfa.record_scalar('lr', 0.1)\n"
        "print(threading.active_count(), 'flodl_async.relay.ranklink' in __import__('sys').modules)"
    )
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "False"]


def test_fa_report_says_which_value_is_not_a_number() -> None:
    from flodl_async.trainer.worker import report

    with pytest.raises(TypeError, match=r"fa.report: loss='low' is not a number"):
        report(loss="low")  # type: ignore[arg-type]


@pytest.mark.e2e
def test_a_trainer_run_that_loses_a_rank_logs_its_rounds_epochs_death_and_recovery(
    tmp_path: Path,
) -> None:
    """fa.Trainer ranks under flodl-launch, rank 2 SIGKILLed at its 4th batch: training goes on without it."""
    run_id = new_run_id()
    logs = tmp_path / "logs"
    trainer = str(Path(__file__).parent / "scripts" / "trainer_mlp.py")
    done = run_launch(
        "--nproc", "3", "--devices", "cpu", "--port", "0", "--log-dir", str(logs),
        "--", PY, trainer, "--out", str(tmp_path / "out"), "--epochs", "3", "--kill-rank", "2",
        "--kill-batch", "3", "--fast-ms", "3", run_id=run_id, env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    events = read_events(logs / run_id / "events.jsonl")
    kinds = [e["kind"] for e in events]
    assert kinds.count("epoch") == 3
    assert kinds.count("round") >= 3
    died = [e for e in events if e["kind"] == "rank_died"]
    recovered = [e for e in events if e["kind"] == "rank_recovered"]
    assert [e["rank"] for e in died] == [2]
    assert [(e["rank"], e["by"]) for e in recovered] == [(2, "regroup")]
    assert kinds.index("rank_died") < kinds.index("rank_recovered")
    assert recovered[0]["seconds"] >= 0
    last = [e for e in events if e["kind"] == "epoch"][-1]
    assert [r["rank"] for r in last["per_rank"] if r["alive"]] == [0, 1]
    replayed = _flodl("status", "--from-log", str(logs / run_id))
    assert "training 3 epoch(s)" in replayed.stdout
    assert "rank 2 recovered by regroup after" in replayed.stdout


def test_a_relaunch_of_a_run_id_logs_beside_the_earlier_launch_and_is_the_one_replayed(
    tmp_path: Path,
) -> None:
    from flodl_async.controller.eventlog import EventLog

    run = tmp_path / "run-r"
    for reason in ("the first launch", "the resubmitted one"):
        log = EventLog(run)
        log.write(Stamped(id=1, at=1.0, event=VerdictGiven(exit_code=0, reason=reason)))
        log.close(None)
    assert sorted(p.name for p in run.iterdir()) == ["events.1.jsonl", "events.jsonl"]
    assert "the first launch" in (run / "events.jsonl").read_text()  # left as it was
    assert find_log(tmp_path) == run / "events.1.jsonl"
    assert "verdict  the resubmitted one (exit 0)" in summarize("run-r", read_events(find_log(run)))
