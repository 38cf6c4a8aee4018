"""flodl top / flodl status --watch: the SSE reader whole and a byte at a time, the view's fold, a hostile
server's strings (stripped, never markup) in plain mode and in the rich view, and the live view in a real tmux
terminal against a real Trainer run (drawn in place, Ctrl-C, the verdict ends it)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from flodl_async.cli.eventclient import MAX_SSE_LINE, SseMessage, SseParser, StreamItem
from flodl_async.cli.top import TopView, render
from flodl_async.errors import NotFlodlStatus
from flodl_async.status.model import SCHEMA

from .hostkit import under_ci
from .launchkit import PY, assert_nothing_left, free_port, new_run_id

# ----- the reader and the view, pure --------------------------------------------------------------

STREAM = (
    b"retry: 2000\n"
    b": keepalive\n\n"
    b'event: snapshot\ndata: {"a": 1}\n\n'
    b'id: 7\r\ndata: {"kind":\ndata: "phase"}\n\n'
)


def test_the_parser_reads_a_stream_whole_and_a_byte_at_a_time() -> None:
    want = [
        SseMessage(event="snapshot", id=None, data='{"a": 1}'),
        SseMessage(event="message", id="7", data='{"kind":\n"phase"}'),
    ]
    assert SseParser().feed(STREAM) == want
    parser = SseParser()
    got = [m for i in range(len(STREAM)) for m in parser.feed(STREAM[i : i + 1])]
    assert got == want


def test_a_line_without_end_is_not_a_flodl_stream() -> None:
    parser = SseParser()
    parser.feed(b"x" * MAX_SSE_LINE)  # as long as a line may be
    with pytest.raises(NotFlodlStatus, match="not a flodl stream"):
        parser.feed(b"x")


def _snapshot(**fields: object) -> StreamItem:
    doc: dict[str, object] = {"schema": SCHEMA, "run_id": "r1", "phase": "training", **fields}
    return StreamItem(name="snapshot", doc=doc)


def _event(id: int, kind: str, **fields: object) -> StreamItem:
    return StreamItem(name="event", doc={"id": id, "at": 0.0, "kind": kind, **fields})


def test_the_view_folds_events_once_and_keeps_rounds_off_the_list() -> None:
    view = TopView()
    view.apply(_snapshot(training={"epoch": 1, "epochs": 2, "policy": "sync", "backend": "cpu"}))
    view.apply(_event(1, "host_joined", host="a", ranks=[0, 1], devices=[]))
    view.apply(_event(1, "host_joined", host="a", ranks=[0, 1], devices=[]))  # resumed backlog
    view.apply(_event(2, "round", round=3, round_kind="sync", reduce_s=0.01, batches=4, loss=0.5))
    view.apply(_event(3, "rank_died", rank=1, host="a", reason="signal 9"))
    lines = view.take()
    assert [line.split(" ", 1)[1] for line in lines] == [
        "training 1/2 epochs done, SYNC on cpu",
        "host a joined with ranks 0-1",
        "rank 1 on a died: signal 9",
    ]
    assert view.take() == []
    assert "round 3: loss 0.5000" in view.header()[1]
    assert not view.ended
    view.apply(_event(4, "verdict", exit_code=1, reason="rank 1 failed"))
    assert view.ended
    assert view.verdict == "rank 1 failed (exit 1)"


# ----- a hostile server ------------------------------------------------------------------------------

HOSTILE = "\x1b]0;owned\x07[bold red]PWNED[/]\x1b[2J\u202eevil\x9b31m"


def _hostile_stream() -> bytes:
    snapshot = {
        "schema": SCHEMA,
        "run_id": "run" + HOSTILE,
        "phase": "training",
        "ranks": [
            {"rank": 0, "host": "h" + HOSTILE, "state": "running", "last_line": "loss " + HOSTILE}
        ],
    }
    events = [
        {"id": 1, "at": 0.0, "kind": "host_joined", "host": "h" + HOSTILE, "ranks": [0]},
        {"id": 2, "at": 0.0, "kind": "verdict", "exit_code": 0, "reason": "done" + HOSTILE},
    ]
    body = b"event: snapshot\ndata: " + json.dumps(snapshot).encode() + b"\n\n"
    body += b"".join(b"id: %d\ndata: %s\n\n" % (e["id"], json.dumps(e).encode()) for e in events)
    return body


class StreamServer:
    """One-thread HTTP server: its n-th connection (from 0) is answered ``body(n)`` as an event stream
    (HTTP/1.0, until the close); the requests are kept."""

    def __init__(
        self, body: Callable[[int], bytes], content_type: bytes = b"text/event-stream"
    ) -> None:
        self.body, self.content_type = body, content_type
        self.requests: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self.requests.append(conn.recv(65536))
                head = b"HTTP/1.0 200 OK\r\nContent-Type: %s\r\n\r\n" % self.content_type
                conn.sendall(head + self.body(len(self.requests) - 1))

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)


@pytest.fixture
def hostile() -> Iterator[StreamServer]:
    server = StreamServer(lambda _n: _hostile_stream())
    try:
        yield server
    finally:
        server.close()


#: HOSTILE as it must be shown: what could act on a terminal gone, the rest (markup too) as text.
SHOWN = "]0;owned[bold red]PWNED[/][2Jevil31m"


def _assert_clean(text: str) -> None:
    for bad in ("\x1b]0;", "\x07", "\x1b[2J", "\u202e", "\x9b"):
        assert bad not in text, (bad, text)


@pytest.mark.parametrize("command", [["top"], ["status", "--watch"]])
def test_plain_mode_prints_a_hostile_server_stripped_and_ends_at_the_verdict(
    hostile: StreamServer, command: list[str]
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    done = subprocess.run(
        [PY, "-m", "flodl_async.cli.flodl", *command, "--addr", f"127.0.0.1:{hostile.port}"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    _assert_clean(done.stdout + done.stderr)
    lines = done.stdout.splitlines()
    assert lines[0].endswith(f"host h{SHOWN} joined with ranks 0")
    assert lines[-1] == f"verdict  done{SHOWN} (exit 0)"
    assert "Traceback" not in done.stderr


def test_the_rich_view_shows_a_hostile_string_as_text_not_markup(hostile: StreamServer) -> None:
    from rich.console import Console

    from flodl_async.cli.eventclient import read_events

    view = TopView()
    for item in read_events("127.0.0.1", hostile.port):
        view.apply(item)
    console = Console(record=True, force_terminal=True, width=300, color_system="truecolor")
    console.print(render(view))
    shown = console.export_text()
    _assert_clean(shown)
    assert f"loss {SHOWN}" in shown  # the markup is shown, not obeyed
    assert f"run run{SHOWN}" in shown
    assert f"h{SHOWN}" in shown


def test_a_stream_that_is_not_flodl_is_refused() -> None:
    server = StreamServer(lambda _n: b"<html>", content_type=b"text/html")
    try:
        done = _top(server.port)
    finally:
        server.close()
    assert done.returncode == 1
    assert "not an event stream" in done.stderr
    assert "Traceback" not in done.stderr


def _frames(*events: dict[str, object]) -> bytes:
    snapshot = {"schema": SCHEMA, "run_id": "r", "phase": "training"}
    body = b"event: snapshot\ndata: " + json.dumps(snapshot).encode() + b"\n\n"
    return body + b"".join(
        b"id: %d\ndata: %s\n\n" % (e["id"], json.dumps(e).encode()) for e in events
    )


def _top(port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "flodl_async.cli.flodl", "top", "--addr", f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_stream_cut_before_the_verdict_resumes_after_its_last_event() -> None:
    joined = {"id": 1, "at": 0.0, "kind": "host_joined", "host": "a", "ranks": [0]}
    verdict = {
        "id": 2,
        "at": 0.0,
        "kind": "verdict",
        "exit_code": 0,
        "reason": "all ranks exited 0",
    }
    server = StreamServer(lambda n: _frames(joined) if n == 0 else _frames(verdict))
    try:
        done = _top(server.port)
    finally:
        server.close()
    assert done.returncode == 0, done.stderr
    assert [line.split(" ", 1)[1] for line in done.stdout.splitlines()] == [
        "host a joined with ranks 0",
        "verdict: all ranks exited 0 (exit 0)",
        " all ranks exited 0 (exit 0)",
    ]
    assert b"Last-Event-ID" not in server.requests[0]
    assert b"Last-Event-ID: 1\r\n" in server.requests[1]


def test_a_stream_that_keeps_ending_with_nothing_new_is_given_up() -> None:
    server = StreamServer(lambda _n: _frames())
    try:
        done = _top(server.port)
    finally:
        server.close()
    assert done.returncode == 1
    assert "closed the stream before the run's verdict" in done.stderr
    assert len(server.requests) == 3  # flodl_async.cli.top.RESUME_TRIES


# ----- a real terminal, a real run -------------------------------------------------------------------

TMUX = shutil.which("tmux")


class Tmux:
    """A private tmux server (its own socket) whose windows run one command each."""

    def __init__(self, tmp_path: Path) -> None:
        assert TMUX is not None
        self.socket = str(tmp_path / "tmux.sock")

    def _tmux(self, *args: str) -> str:
        assert TMUX is not None
        return subprocess.run(
            [TMUX, "-S", self.socket, *args], capture_output=True, text=True, timeout=30, check=True
        ).stdout

    def start(self, name: str, command: str) -> None:
        # the pane stays after the command so its exit status can be read; JOURNAL_STREAM unset, so
        # a test run under journald still gets the live view
        shell = f"env -u JOURNAL_STREAM {command}; echo TOP-EXIT=$?; sleep 600"
        self._tmux("new-session", "-d", "-s", name, "-x", "220", "-y", "50", shell)

    def pane(self, name: str) -> str:
        return self._tmux("capture-pane", "-p", "-t", name)

    def keys(self, name: str, *keys: str) -> None:
        self._tmux("send-keys", "-t", name, *keys)

    def wait_for(self, name: str, text: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while True:  # a terminal has no event to wait on: its screen is read until it shows it
            pane = self.pane(name)
            if text in pane:
                return pane
            if time.monotonic() > deadline:
                raise AssertionError(f"tmux {name} never showed {text!r}:\n{pane}")
            time.sleep(0.2)

    def close(self) -> None:
        assert TMUX is not None
        subprocess.run([TMUX, "-S", self.socket, "kill-server"], capture_output=True, check=False)


@pytest.mark.e2e
def test_flodl_top_in_a_real_terminal_follows_a_trainer_run_to_its_verdict(tmp_path: Path) -> None:
    if TMUX is None:
        why = "tmux not installed (apt-get install tmux)"
        if under_ci():
            pytest.fail(f"CI is set, so the flodl top test must run, but {why}", pytrace=False)
        pytest.skip(why)
    from .test_observe_e2e import TrainerRun

    port, run_id, hold = free_port(), new_run_id(), tmp_path / "hold"
    args = ("--epochs", "2", "--policy", "sync", "--lockstep", "--hold-file", str(hold))
    run = TrainerRun(tmp_path, port, *args, "--hold-steps", "12", run_id=run_id)
    tmux = Tmux(tmp_path)
    top = f"{PY} -m flodl_async.cli.flodl top --addr 127.0.0.1:{port}"
    try:
        run.wait_for_stdout("HELD STEP 12", timeout=180)
        tmux.start("top", top)
        pane = tmux.wait_for("top", "epoch 1/2: loss")
        assert "1/2 epochs done, SYNC on cpu" in pane
        assert "LAST LINE" in pane
        host = socket.gethostname()
        rows = [line.split()[:3] for line in pane.splitlines()]
        assert [host, "0", "connected"] in rows, pane  # the host's name on its first rank's row
        assert ["1", "connected"] in [row[:2] for row in rows], pane
        # drawn in place: the header is on the screen once, however many updates came
        assert pane.count("LAST LINE") == 1
        tmux.keys("top", "C-c")
        pane = tmux.wait_for("top", "TOP-EXIT=")
        assert "TOP-EXIT=0" in pane
        assert "Traceback" not in pane

        tmux.start("watch", f"{PY} -m flodl_async.cli.flodl status --watch --addr 127.0.0.1:{port}")
        tmux.wait_for("watch", "epoch 1/2: loss")
        (tmp_path / "hold.1").touch()
        pane = tmux.wait_for("watch", "TOP-EXIT=", timeout=180)
        assert "TOP-EXIT=0" in pane, pane
        assert "epoch 2/2: loss" in pane
        assert re.search(r"^verdict  .+ \(exit 0\)$", pane, re.MULTILINE), pane
        assert pane.count("LAST LINE") == 1
        assert "Traceback" not in pane
        done = run.finish(timeout=120)
        assert done.returncode == 0, done.stderr
    finally:
        (tmp_path / "hold.1").touch()
        tmux.close()
        run.kill()
        assert_nothing_left(run_id)


def test_journald_or_a_pipe_gets_plain_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    from flodl_async.cli import top

    class Tty:
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(top.sys, "stdout", Tty())
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    assert not top.plain_wanted()
    monkeypatch.setenv("JOURNAL_STREAM", "8:12345")
    assert top.plain_wanted()


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--json"], "drop --json"),
        (["--silent-after", "5"], "drop --silent-after"),
        (["--from-log", "logs"], "drop --watch"),
    ],
)
def test_watch_refuses_the_options_it_would_ignore(
    extra: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from flodl_async.cli.flodl import main

    assert main(["status", "--watch", "--addr", "127.0.0.1:1", *extra]) == 2
    assert said in capsys.readouterr().err
