"""A real Trainer run watched from outside: a real Prometheus server scrapes its /metrics and answers PromQL
with the run's values while it trains, `promtool check metrics` passes the exposition, and the dashboard in a
real headless Chromium changes as the run trains, without a reload (two screenshots, one kept as an artifact).

The run is tests/scripts/trainer_mlp.py as the launcher (two CPU ranks on this host); its rank 0 holds at two
steps (``--hold-steps``) so that the run stays in a known state while the watchers look, and goes on when the
test lets it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from .browserkit import CHROMIUM, Chromium, artifact_dir
from .hostkit import under_ci
from .launchkit import PY, Launcher, assert_nothing_left, free_port, new_run_id, wait_status

pytestmark = pytest.mark.e2e

SCRIPT = str(Path(__file__).parent / "scripts" / "trainer_mlp.py")
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


def _require_tools() -> None:
    """Skip with the reason where a tool is missing, but fail under CI (.ci/run installs them)."""
    missing = [
        name
        for name, path in (
            ("prometheus", PROMETHEUS),
            ("promtool", PROMTOOL),
            ("chromium", CHROMIUM),
        )
        if path is None
    ]
    if not missing:
        return
    why = f"{', '.join(missing)} not installed (apt-get install prometheus chromium)"
    if under_ci():
        pytest.fail(f"CI is set, so the observability test must run, but {why}", pytrace=False)
    pytest.skip(why)


class TrainerRun(Launcher):
    """The Trainer script as a background launcher on a known port."""

    def __init__(self, tmp_path: Path, port: int, *args: str, run_id: str) -> None:
        cluster = tmp_path / "cluster.yml"
        cluster.write_text(
            f"controller:\n  host: 127.0.0.1\n  port: {port}\n"
            f"workers:\n  - host: {socket.gethostname()}\n    devices: cpu:2\n"
        )
        self.run_id = run_id
        cmd = [PY, SCRIPT, "--out", str(tmp_path / "out"), "--cluster", str(cluster), *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "FLODL_RUN_ID": run_id}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, env=env
        )
        self.stdout_lines = []


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        return bytes(response.read())


def _until(what: str, check: Callable[[], object], timeout: float = 60) -> object:
    """Poll ``check`` until it returns something truthy (a server's own answer is the event)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except OSError as exc:  # a server still starting
            last = exc
        else:
            if last:
                return last
        time.sleep(0.1)
    raise AssertionError(f"{what} did not happen within {timeout}s; last: {last!r}")


class Prometheus:
    """A real Prometheus server scraping one target every second."""

    def __init__(self, tmp_path: Path, target: str) -> None:
        assert PROMETHEUS is not None
        self.port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"scrape_configs:\n  - job_name: flodl\n    static_configs:\n      - targets: ['{target}']\n"
        )
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _until("prometheus ready", lambda: _get(f"http://127.0.0.1:{self.port}/-/ready"))

    def query(self, promql: str) -> list[dict[str, object]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": promql}
        )
        doc = json.loads(_get(url))
        assert doc["status"] == "success", doc
        return list(doc["data"]["result"])

    def value(self, promql: str) -> float | None:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None  # type: ignore[index]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _exposed(body: bytes, name: str) -> float:
    """The value of an unlabelled sample in an exposition."""
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in the exposition:\n{body.decode()}")


def _training_epoch(port: int) -> int:
    doc = wait_status(port, lambda d: isinstance(d.get("training"), dict))
    training = doc["training"]
    assert isinstance(training, dict)
    return int(training["epoch"])


def test_a_trainer_run_is_seen_by_prometheus_and_the_live_dashboard(tmp_path: Path) -> None:
    _require_tools()
    port, run_id, hold = free_port(), new_run_id(), tmp_path / "hold"
    # SYNC in lockstep: rank 0 trains half of every epoch (8 steps) however long it is held
    args = (
        "--epochs",
        "3",
        "--policy",
        "sync",
        "--lockstep",
        "--hold-file",
        str(hold),
        "--hold-steps",
        "12,20",
    )
    run = TrainerRun(tmp_path, port, *args, run_id=run_id)
    prometheus: Prometheus | None = None
    shots = artifact_dir()
    try:
        run.wait_for_stdout("HELD STEP 12", timeout=180)
        epoch = _training_epoch(port)
        assert epoch >= 1
        metrics_url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(metrics_url, timeout=5) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            body = response.read()
        lint = subprocess.run(
            [PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=60, check=False
        )  # type: ignore[list-item]
        assert lint.returncode == 0, (lint.stdout, lint.stderr, body.decode())

        prometheus = Prometheus(tmp_path, f"127.0.0.1:{port}")
        # the run holds still: Prometheus's answers are the run's own values
        steps = _exposed(body, "flodl_steps_total")
        assert steps > 0
        _until("Prometheus scraped the run", lambda: prometheus.value("flodl_steps_total") == steps)
        assert prometheus.value("flodl_epoch") == epoch
        loss = prometheus.value("flodl_loss")
        assert loss is not None
        assert math.isfinite(loss)
        assert loss > 0
        assert loss == _exposed(body, "flodl_loss")
        assert prometheus.value("sum(flodl_ranks)") == 2
        up = prometheus.query("flodl_rank_up == 1")
        assert sorted(r["metric"]["rank"] for r in up) == ["0", "1"]  # type: ignore[index]
        reduces = prometheus.value("flodl_reduce_seconds_count")
        assert reduces is not None
        assert reduces >= 1
        assert prometheus.value('flodl_recoveries_total{kind="regroup"}') == 0

        with Chromium(tmp_path / "profile") as browser:
            browser.navigate(f"http://127.0.0.1:{port}/")
            browser.wait_for(
                f"document.getElementById('epochlosses').textContent.includes('epoch {epoch}:')"
            )
            first_text = browser.text("epochlosses") + browser.text("trainfacts")
            first = browser.screenshot(shots / "dashboard-held-1.png")
            dom = browser.dom()
            assert "<td>n/a</td>" in dom  # the store column of a CPU-backend Trainer rank
            assert "training: " in browser.text("training")
            (tmp_path / "hold.1").touch()
            run.wait_for_stdout("HELD STEP 20", timeout=120)
            later = _training_epoch(port)
            assert later > epoch
            # the same page, not reloaded, shows the next epoch from /events
            browser.wait_for(
                f"document.getElementById('epochlosses').textContent.includes('epoch {later}:')"
            )
            second_text = browser.text("epochlosses") + browser.text("trainfacts")
            second = browser.screenshot(shots / "dashboard-training.png")
            assert second_text != first_text
            assert second != first
            # while the run trains, Prometheus follows it
            _until(
                "Prometheus saw the next epoch", lambda: prometheus.value("flodl_epoch") == later
            )
            (tmp_path / "hold.2").touch()
            browser.wait_for("document.getElementById('verdict').textContent !== ''", timeout=120)
            assert browser.text("phase") == "done"
        done = run.finish(timeout=120)
        assert done.returncode == 0, done.stderr
    finally:
        for i in (1, 2):
            (tmp_path / f"hold.{i}").touch()
        if prometheus is not None:
            prometheus.close()
        run.kill()
        assert_nothing_left(run_id)
