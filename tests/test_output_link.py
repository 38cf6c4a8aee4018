"""Rank output over the agent's join link, end to end: a stand-alone flodl-agent's ranks reach the launcher's console and log files.

Order-based: the ranks wait for files the test creates once it saw what it waits for on the
launcher's console or status page, never for a fixed time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from .launchkit import (
    PY,
    Launcher,
    assert_nothing_left,
    free_port,
    new_run_id,
    reap,
    run_launch,
    script,
    wait_status,
)

pytestmark = pytest.mark.e2e

SCALE = float(os.environ.get("FLODL_NET_TIMEOUT_SCALE", "1") or 1)
WAIT = 120 * SCALE
LINE = re.compile(r"^\[(?P<host>[^\]:]+):r(?P<rank>\d+)\] (?P<text>.*)\n$")


class Console:
    """Reads the launcher's stdout and stderr on threads (a flood must never stall the launcher),
    counting the flood's lines.

    It is the only reader of both pipes: a second reader (``Popen.communicate`` in
    ``Launcher.finish``) would take whatever part of the flood it read first, and the console
    would seem to have lost lines the launcher wrote.
    """

    def __init__(self, launcher: Launcher) -> None:
        assert launcher.proc.stdout is not None
        assert launcher.proc.stderr is not None
        self._stream = launcher.proc.stdout
        self._err = launcher.proc.stderr
        self.lines: list[str] = []  # every line but the flood's
        self.flood_lines = 0
        self.torn: list[str] = []
        self.stderr = ""
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, name="console", daemon=True)
        self._err_thread = threading.Thread(target=self._read_err, name="console-err", daemon=True)
        self._thread.start()
        self._err_thread.start()

    def _read(self) -> None:
        for line in self._stream:
            match = LINE.match(line)
            with self._cond:
                if match is None:
                    self.torn.append(line[:200])
                elif match["rank"] == "1" and match["text"] == "a" * 1023:
                    self.flood_lines += 1
                else:
                    self.lines.append(line)
                self._cond.notify_all()

    def _read_err(self) -> None:
        self.stderr = self._err.read()

    def wait_for(self, what: Callable[[Console], bool], *, timeout: float = WAIT) -> None:
        with self._cond:
            if not self._cond.wait_for(
                lambda: what(self) or not self._thread.is_alive(), timeout=timeout
            ) or not what(self):
                raise AssertionError(
                    f"console never showed it; lines so far: {self.lines[-20:]}, flood lines {self.flood_lines}"
                )

    def has(self, line: str) -> bool:
        return line in self.lines

    def join(self) -> None:
        """Wait until both pipes ended (the launcher exited): every byte it wrote was read."""
        for thread in (self._thread, self._err_thread):
            thread.join(timeout=WAIT)
            assert not thread.is_alive(), f"the launcher's {thread.name} never ended"


def _rank_state(doc: dict[str, object], rank: int) -> str | None:
    ranks = doc.get("ranks")
    assert isinstance(ranks, list)
    return next((str(r["state"]) for r in ranks if r["rank"] == rank), None)


def test_a_walk_in_agents_output_crosses_the_link_whole_prompt_and_complete(
    tmp_path: Path, xdg: Path
) -> None:
    port, run_id = free_port(), new_run_id()
    secret_file, logs, signals = tmp_path / "secret", tmp_path / "logs", tmp_path / "signals"
    signals.mkdir()
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"controller:\n  port: {port}\n  join: {{min_rank_start: 3, target_ranks: 3, join_timeout: 60}}\nworkers:\n  - host: localhost\n    devices: cpu:1\n"
    )
    env = {"XDG_RUNTIME_DIR": str(xdg)}
    launcher = Launcher(
        str(cluster), "--secret-file", str(secret_file), "--log-dir", str(logs), "--", PY, script("output_roles.py"), str(signals), run_id=run_id, env=env
    )  # fmt: skip
    agent = None
    try:
        console = Console(launcher)
        wait_status(port, lambda doc: doc["joined_ranks"] == 1)
        agent = subprocess.Popen(
            [PY, "-m", "flodl_async.agent", "--controller", f"127.0.0.1:{port}", "--host", "walk-in", "--devices", "cpu:2", "--secret-file", str(secret_file)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **env},
        )  # fmt: skip
        # The partial line shows while its rank still holds the newline (it waits for a file we have not made).
        console.wait_for(lambda c: c.has("[walk-in:r2] partial-2\n"))
        assert not any("-done" in line for line in console.lines)
        console.wait_for(lambda c: c.flood_lines > 0)  # the flood is on
        (signals / "newline").touch()
        console.wait_for(lambda c: c.has("[walk-in:r2] partial-2-done\n"))
        # Rank 2's exit reaches the launcher while rank 1 floods without end (it cannot stop before `release`).
        wait_status(port, lambda doc: _rank_state(doc, 2) == "exited", timeout=WAIT)
        assert not any("flooded" in line for line in console.lines)
        (signals / "release").touch()
        agent_out, agent_err = agent.communicate(timeout=WAIT)
        returncode = launcher.proc.wait(timeout=WAIT)
        console.join()
    finally:
        launcher.kill()
        reap(agent)
        assert_nothing_left(run_id)
    assert returncode == 0, console.stderr
    assert agent.returncode == 0, agent_err
    assert b"[walk-in:" not in agent_out  # the output crossed the link, not the agent's own stdout
    assert console.torn == []  # a flood of one rank tore no line of another
    flooded = [line for line in console.lines if "flooded" in line]
    assert len(flooded) == 1, flooded
    total = int(flooded[0].split()[2])
    assert total >= 50 * 1024 * 1024
    assert console.flood_lines * 1024 == total  # not a byte lost on the console
    b_lines = [line for line in console.lines if line.startswith("[walk-in:r2] b")]
    whole = "[walk-in:r2] " + "b" * 3000 + "\n"
    odd = [(i, len(line)) for i, line in enumerate(b_lines) if line != whole]
    assert (len(b_lines), odd[:10]) == (2000, [])  # whole lines, none shown in pieces first
    assert "[localhost:r0] local ready\n" in console.lines
    attempt = logs / run_id / "attempt_0"
    assert (attempt / "1" / "stdout.log").stat().st_size == total + len(
        f"flooded {total} bytes\n"
    )  # the file too
    assert (attempt / "2" / "stdout.log").read_bytes() == b"partial-2-done\n" + (
        b"b" * 3000 + b"\n"
    ) * 2000
    assert (attempt / "0" / "stdout.log").read_bytes() == b"local ready\n"
    assert (attempt / "1" / "stderr.log").read_bytes() == b""


def test_local_ranks_filter_shows_only_those_ranks_and_the_files_keep_all(tmp_path: Path) -> None:
    run_id = new_run_id()
    done = run_launch(
        "--nproc", "3", "--devices", "cpu", "--port", "0", "--log-dir", str(tmp_path), "--local-ranks-filter", "0,2", "--",
        # one write: print()'s pieces, unbuffered, may be apart longer than the partial-line
        # wait on a loaded machine, and a partial line is shown (then redrawn whole) by design
        PY, "-c", "import os, sys; sys.stdout.write(f'hello from {os.environ[\"RANK\"]}\\n')",
        run_id=run_id,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    shown = sorted(line for line in done.stdout.splitlines() if "hello from" in line)
    assert [line.split("] ")[1] for line in shown] == ["hello from 0", "hello from 2"]
    for rank in range(3):
        assert (
            tmp_path / run_id / "attempt_0" / str(rank) / "stdout.log"
        ).read_text() == f"hello from {rank}\n"


def test_a_bad_local_ranks_filter_is_one_clear_line(tmp_path: Path) -> None:
    done = run_launch(
        "--nproc",
        "1",
        "--devices",
        "cpu",
        "--local-ranks-filter",
        "0,x",
        "--",
        PY,
        "-c",
        "pass",
        run_id=new_run_id(),
    )
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == "flodl-launch: error: --local-ranks-filter takes rank numbers separated by commas, like 0,1 (got '0,x')"
    )


def test_the_log_dir_keeps_every_attempt_apart(tmp_path: Path) -> None:
    run_id = new_run_id()
    done = run_launch(
        "--nproc", "2", "--devices", "cpu", "--port", "0", "--max-restarts", "1", "--log-dir", str(tmp_path), "--", PY, script("flaky.py"), run_id=run_id
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    run = tmp_path / run_id
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["attempt_0", "attempt_1"]
    # the run's event log beside them tells the failure, the restart and what it recovered
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds.index("rank_died") < kinds.index("restart") < kinds.index("rank_recovered")
    assert [(e["rank"], e["by"]) for e in events if e["kind"] == "rank_recovered"] == [(1, "restart")]
    assert [e["restart"] for e in events if e["kind"] == "world_formed"] == [0, 1]
    assert "failing on purpose in attempt 0" in (run / "attempt_0" / "1" / "stderr.log").read_text()
    for rank in range(2):
        assert (
            run / "attempt_1" / str(rank) / "stdout.log"
        ).read_text() == f"attempt 1 rank {rank} sum 2\n"
        assert "failing" not in (run / "attempt_1" / str(rank) / "stderr.log").read_text()
