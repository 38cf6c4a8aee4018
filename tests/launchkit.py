"""Helpers for end-to-end launcher tests: run flodl-launch for real and prove nothing survives it."""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"
PY = sys.executable


def script(name: str) -> str:
    return str(SCRIPTS / name)


#: Ports free_port() picks from: below the kernel's ephemeral range (32768-60999 here), where no
#: other process's bind(0) or outgoing connection lands between our check and the launcher's bind.
_PORTS = range(20000, 32000)


def free_port() -> int:
    """A port free on every address now, outside the ephemeral range (a busy machine's ranks,
    stores and clients take ephemeral ports all the time)."""
    for _ in range(200):
        port = random.choice(_PORTS)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORTS}")


def new_run_id() -> str:
    return f"test-{secrets.token_hex(4)}"


def processes_of_run(run_id: str) -> list[int]:
    """PIDs whose environment carries this run id (ranks and store processes)."""
    needles = (f"FLODL_RUN_ID={run_id}".encode(), f"TORCHELASTIC_RUN_ID={run_id}".encode())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(n in environ.split(b"\0") for n in needles):
            found.append(int(entry))
    return found


def reap(proc: subprocess.Popen[str] | subprocess.Popen[bytes] | None) -> None:
    """A test's cleanup: kill ``proc`` if it is still running and collect it (None: it never started)."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.communicate()


def assert_nothing_left(run_id: str, *, within: float = 10.0) -> None:
    """Every process of the run is gone (waiting at most ``within`` seconds for asynchronous kills)."""
    deadline = time.monotonic() + within
    left = processes_of_run(run_id)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = processes_of_run(run_id)
    if left:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"processes of run {run_id} survived: {left}")


def wait_status(
    port: int, predicate: Callable[[dict[str, object]], bool], timeout: float = 60
) -> dict[str, object]:
    """Poll the controller's real /state.json until ``predicate(doc)`` holds (the run's own state is the event)."""
    deadline = time.monotonic() + timeout
    last: dict[str, object] | None = None
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(
                f"http://127.0.0.1:{port}/state.json", timeout=2
            ) as response:
                last = json.loads(response.read())
            if last is not None and predicate(last):
                return last
        time.sleep(0.05)
    raise AssertionError(f"status never satisfied the condition; last: {last}")


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str


def run_flodl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The `flodl` command, run to its end (60 s at most)."""
    return subprocess.run(
        [PY, "-m", "flodl_async.cli.flodl", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )


def launch_cmd(*args: str, run_id: str) -> list[str]:
    return [PY, "-m", "flodl_async.cli.launch", "--run-id", run_id, *args]


def run_launch(
    *args: str, run_id: str, timeout: float = 120, env: dict[str, str] | None = None
) -> Finished:
    """Run flodl-launch to completion; always checks that nothing of the run survives."""
    try:
        done = subprocess.run(
            launch_cmd(*args, run_id=run_id),
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
            check=False,
        )
    finally:
        assert_nothing_left(run_id)
    return Finished(done.returncode, done.stdout, done.stderr)


class Launcher:
    """A flodl-launch process running in the background, read line by line."""

    def __init__(self, *args: str, run_id: str, env: dict[str, str] | None = None) -> None:
        self.run_id = run_id
        self.proc = subprocess.Popen(
            launch_cmd(*args, run_id=run_id),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            env={**os.environ, **(env or {})},
        )
        self.stdout_lines: list[str] = []

    def wait_for_stdout(self, predicate: str, count: int = 1, timeout: float = 60) -> None:
        """Read stdout until ``count`` lines contain ``predicate``."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        seen = sum(predicate in line for line in self.stdout_lines)
        while seen < count:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out waiting for {count}x {predicate!r}; got {self.stdout_lines}"
                )
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(
                    f"launcher output ended before {count}x {predicate!r}: {self.stdout_lines}; stderr: {self.proc.stderr.read() if self.proc.stderr else ''}"
                )
            self.stdout_lines.append(line)
            seen += predicate in line

    def finish(self, timeout: float = 60) -> Finished:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise
        finally:
            assert_nothing_left(self.run_id)
        return Finished(self.proc.returncode, "".join(self.stdout_lines) + out, err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()
