"""The status endpoint on the mux port, answered to http.client, curl and `flodl status`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import json
import shutil
import sys
import time
from collections.abc import AsyncIterator

import pytest

from flodl_async.net.http import StatusHttpProtocol
from flodl_async.net.mux import PortMux
from flodl_async.status import (
    SCHEMA,
    MemberStatus,
    Phase,
    StatusBoard,
    StatusSnapshot,
    dashboard_html,
)
from flodl_async.status.model import Counters
from flodl_async.wire import Channel

from .coordkit import training_block_after_a_kill


@pytest.fixture
async def served() -> AsyncIterator[tuple[PortMux, StatusBoard]]:
    board = StatusBoard()
    mux = PortMux(host="127.0.0.1", port=0)
    mux.register(Channel.STATUS, lambda: StatusHttpProtocol(board, request_timeout=2.0))
    await mux.start()
    try:
        yield mux, board
    finally:
        await mux.aclose()


def _get(
    port: int, method: str, path: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path, headers=headers or {})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def _snapshot() -> StatusSnapshot:
    now = time.time()
    return StatusSnapshot(
        run_id="run-7",
        phase=Phase.TRAINING,
        started_at=now,
        updated_at=now,
        world_size=2,
        joined_ranks=2,
        min_rank_start=2,
        target_ranks=2,
        members=(
            MemberStatus(host="node-a", ranks=(0, 1), devices=("cpu:0", "cpu:1"), joined_at=now),
        ),
    )


async def test_503_before_the_first_snapshot_then_200(served: tuple[PortMux, StatusBoard]) -> None:
    mux, board = served
    status, headers, body = await asyncio.to_thread(_get, mux.port, "GET", "/state.json")
    assert status == 503
    assert "no status published yet" in json.loads(body)["error"]
    assert json.loads(body)["schema"] == SCHEMA  # so `flodl status` knows a starting controller
    board.publish(_snapshot())
    status, headers, body = await asyncio.to_thread(_get, mux.port, "GET", "/state.json")
    assert status == 200
    assert headers["content-type"] == "application/json"
    assert headers["cache-control"] == "no-cache"
    assert headers["connection"] == "close"
    assert int(headers["content-length"]) == len(body)
    doc = json.loads(body)
    assert doc["schema"] == SCHEMA
    assert doc["phase"] == "training"
    assert doc["members"][0]["host"] == "node-a"
    assert doc["members"][0]["ranks"] == [0, 1]


async def test_head_has_headers_and_no_body(served: tuple[PortMux, StatusBoard]) -> None:
    mux, board = served
    board.publish(_snapshot())
    status, headers, body = await asyncio.to_thread(_get, mux.port, "HEAD", "/state.json")
    assert status == 200
    assert body == b""
    assert board.encoded is not None
    assert int(headers["content-length"]) == len(board.encoded)


class _Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


async def test_requests_serve_the_cached_encoding() -> None:
    """Two requests, one encode: a request never rebuilds the snapshot; live counters age by the board's clock."""
    clock = _Clock()
    dropped = {"unknown_magic": 0}

    def counters() -> Counters:
        return {"routed": {"status": 1}, "dropped": dict(dropped)}

    board = StatusBoard(counters=counters, clock=clock)
    mux = PortMux(host="127.0.0.1", port=0)
    mux.register(Channel.STATUS, lambda: StatusHttpProtocol(board, request_timeout=2.0))
    await mux.start()
    try:
        board.publish(_snapshot())
        dropped["unknown_magic"] = 1
        bodies = [
            (await asyncio.to_thread(_get, mux.port, "GET", "/state.json"))[2] for _ in range(2)
        ]
        assert bodies[0] == bodies[1] == board.encoded
        assert board.statistics().encodes == 1
        assert json.loads(bodies[0])["connections"]["dropped"] == {"unknown_magic": 0}
        clock.now += 0.5  # the interval passed: the next request sees the counters of now
        _, _, body = await asyncio.to_thread(_get, mux.port, "GET", "/state.json")
        assert json.loads(body)["connections"]["dropped"] == {"unknown_magic": 1}
        assert board.statistics().encodes == 2
    finally:
        await mux.aclose()


async def test_unknown_path_lists_the_endpoints(served: tuple[PortMux, StatusBoard]) -> None:
    mux, _ = served
    status, _, body = await asyncio.to_thread(_get, mux.port, "GET", "/nope")
    assert status == 404
    assert json.loads(body)["endpoints"] == ["/", "/state.json", "/metrics", "/events"]


async def test_dashboard_page(served: tuple[PortMux, StatusBoard]) -> None:
    mux, _ = served
    status, headers, body = await asyncio.to_thread(_get, mux.port, "GET", "/")
    assert status == 200
    assert headers["content-type"].startswith("text/html")
    assert b"/state.json" in body
    assert body == dashboard_html()


async def test_post_is_not_allowed(served: tuple[PortMux, StatusBoard]) -> None:
    mux, _ = served
    status, headers, _ = await asyncio.to_thread(_get, mux.port, "POST", "/state.json")
    assert status == 405
    assert headers["allow"] == "GET, HEAD"


async def test_oversized_request_head_is_refused(served: tuple[PortMux, StatusBoard]) -> None:
    mux, _ = served
    status, _, body = await asyncio.to_thread(
        _get, mux.port, "GET", "/state.json", {"X-Big": "a" * 20_000}
    )
    assert status == 431
    assert "request head above" in json.loads(body)["error"]


async def test_slow_request_is_cut_at_the_time_limit(served: tuple[PortMux, StatusBoard]) -> None:
    mux, _ = served
    reader, writer = await asyncio.open_connection("127.0.0.1", mux.port)
    writer.write(b"GET /state.json HTTP/1.1\r\n")  # never finishes its headers
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed (CI installs it)")
async def test_curl(served: tuple[PortMux, StatusBoard]) -> None:
    mux, board = served
    board.publish(_snapshot())
    proc = await asyncio.create_subprocess_exec(
        "curl",
        "-sS",
        "--fail",
        f"http://127.0.0.1:{mux.port}/state.json",
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    assert json.loads(out)["run_id"] == "run-7"


async def _flodl_status(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "flodl_async.cli.flodl",
        "status",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_flodl_status_prints_a_table_and_json(served: tuple[PortMux, StatusBoard]) -> None:
    mux, board = served
    board.publish(_snapshot())
    code, out, _ = await _flodl_status("--addr", f"127.0.0.1:{mux.port}")
    assert code == 0
    assert "phase    training" in out
    assert "node-a" in out
    code, out, _ = await _flodl_status("--addr", f"127.0.0.1:{mux.port}", "--json")
    assert code == 0
    assert json.loads(out)["world_size"] == 2


#: What ``flodl status`` and the status page say of :func:`training_block_after_a_kill`'s run.
TRAINING_LINE = (
    "1/3 epochs done, CADENCE on cpu, 2 of 3 ranks alive — lost: rank 2 on host h0: killed at "
    "epoch 2"
)


async def test_flodl_status_prints_the_trainers_world_and_its_lost_ranks(
    served: tuple[PortMux, StatusBoard],
) -> None:
    mux, board = served
    board.publish(dataclasses.replace(_snapshot(), training=training_block_after_a_kill()))
    code, out, err = await _flodl_status("--addr", f"127.0.0.1:{mux.port}")
    assert code == 0, err
    assert f"\ntraining {TRAINING_LINE}\n" in out
    board.publish(_snapshot())  # a plain script's run: no training block, no line
    code, out, err = await _flodl_status("--addr", f"127.0.0.1:{mux.port}")
    assert code == 0, err
    assert "\ntraining " not in out


async def test_flodl_status_fails_when_nothing_answers() -> None:
    mux = PortMux(host="127.0.0.1", port=0)
    await mux.start()
    port = mux.port
    await mux.aclose()
    code, out, err = await _flodl_status("--addr", f"127.0.0.1:{port}")
    assert code == 1
    assert out == ""
    assert f"no flodl controller answers at 127.0.0.1:{port}" in err
    assert "Traceback" not in err


async def test_flodl_status_rejects_a_bad_address() -> None:
    code, _, err = await _flodl_status("--addr", "host:notaport")
    assert code == 2
    assert "port must be a number" in err


async def test_flodl_status_on_a_starting_controller(served: tuple[PortMux, StatusBoard]) -> None:
    mux, _ = served
    code, out, _ = await _flodl_status("--addr", f"127.0.0.1:{mux.port}")
    assert code == 0
    assert "is starting: no status published yet" in out


async def test_flodl_status_help_lists_the_exit_codes() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "flodl_async.cli.flodl",
        "status",
        "--help",
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    assert "exit codes:" in out.decode()
    assert (
        "1    nothing answers at that address, or what answers is not a flodl status"
        in out.decode()
    )


# ----- flodl status against a server that is not ours ------------------------------------------------

ESC = "\x1b"
# Terminal escapes and other control characters, C0 and C1: a clear screen, a colour, a bell,
# an OSC title, a carriage return that would overwrite a line, CSI as one C1 character.
HOSTILE = f"{ESC}[2J{ESC}[31mred\x07{ESC}]0;pwned\x07\rX\x9b1m\x00"


@contextlib.asynccontextmanager
async def _canned_server(response: bytes) -> AsyncIterator[int]:
    """A loopback server that answers any request with ``response`` and closes."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(response)
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


def _http(body: bytes, status_line: bytes = b"HTTP/1.1 200 OK") -> bytes:
    return (
        status_line
        + b"\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\nConnection: close\r\n\r\n"
        + body
    )


def _assert_no_controls(text: str) -> None:
    bad = [hex(ord(ch)) for ch in text if (ord(ch) < 0x20 and ch != "\n") or 0x7F <= ord(ch) < 0xA0]
    assert bad == [], f"control characters reached the terminal: {bad}"


async def test_flodl_status_refuses_json_without_the_schema_marker() -> None:
    async with _canned_server(
        _http(json.dumps({"phase": "training", "run_id": "x"}).encode())
    ) as port:
        code, out, err = await _flodl_status("--addr", f"127.0.0.1:{port}")
    assert code == 1
    assert out == ""
    assert "lacks the 'flodl-status/1' schema marker, so not a flodl status" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("body", "message"), [(b"<html>hi</html>", "not with JSON"), (b"[1, 2]", "not an object")]
)
async def test_flodl_status_refuses_what_is_not_a_status_document(
    body: bytes, message: str
) -> None:
    async with _canned_server(_http(body)) as port:
        code, out, err = await _flodl_status("--addr", f"127.0.0.1:{port}")
    assert code == 1
    assert out == ""
    assert message in err


@pytest.mark.parametrize("as_json", [False, True])
async def test_flodl_status_strips_control_characters_from_what_it_prints(as_json: bool) -> None:
    doc = {
        "schema": SCHEMA,
        "run_id": f"run{HOSTILE}",
        "phase": f"training{HOSTILE}",
        "verdict": f"rank 1 failed{HOSTILE}",
        "joined_ranks": 1,
        "world_size": 1,
        "members": [
            {
                "host": f"node{HOSTILE}",
                "ranks": [0],
                "devices": [f"cpu{HOSTILE}"],
                "state": f"joined{HOSTILE}",
            }
        ],
        "ranks": [
            {"rank": 0, "host": f"node{HOSTILE}", "pid": 1, "state": f"running{HOSTILE}"}
        ],  # a pid is a number (text there is not a status)
        f"key{HOSTILE}": "value",
    }
    # ensure_ascii=False: the control characters travel raw in the body, not as \u escapes
    async with _canned_server(_http(json.dumps(doc, ensure_ascii=False).encode())) as port:
        code, out, err = await _flodl_status(
            "--addr", f"127.0.0.1:{port}", *(["--json"] if as_json else [])
        )
    assert code == 0, err
    _assert_no_controls(out)
    _assert_no_controls(err)
    if as_json:
        assert json.loads(out)["run_id"] == "run[2J[31mred]0;pwnedX1m"
    else:
        assert "phase    training[2J[31mred]0;pwnedX1m" in out
        assert "node[2J[31mred]0;pwnedX1m" in out


async def test_flodl_status_strips_control_characters_from_a_bad_status_line() -> None:
    async with _canned_server(f"HTTP/1.1 2{HOSTILE}00 OK\r\n\r\n".encode("latin-1")) as port:
        code, out, err = await _flodl_status("--addr", f"127.0.0.1:{port}")
    assert code == 1
    assert out == ""
    assert f"no flodl controller answers at 127.0.0.1:{port}" in err
    assert len(err.splitlines()) == 1
    _assert_no_controls(err)


async def test_flodl_status_reports_an_unexpected_http_status() -> None:
    body = json.dumps({"schema": SCHEMA, "error": f"no such endpoint{HOSTILE}"}).encode()
    async with _canned_server(_http(body, b"HTTP/1.1 404 Not Found")) as port:
        code, out, err = await _flodl_status("--addr", f"127.0.0.1:{port}")
    assert code == 1
    assert out == ""
    assert "answered HTTP 404: no such endpoint" in err
    _assert_no_controls(err)


def _this_hosts_other_address() -> str | None:
    """A non-loopback address of this machine (a UDP connect sends nothing), or None."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if address.startswith("127.") else address


async def test_rank_output_lines_are_served_to_loopback_clients_only() -> None:
    """A rank's last output line may hold a secret: a client on another host sees only its age."""
    import dataclasses

    from flodl_async.status import RankState, RankStatus

    address = _this_hosts_other_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address")
    board = StatusBoard()
    mux = PortMux(host="0.0.0.0", port=0)  # reached here from another address of this host
    mux.register(Channel.STATUS, lambda: StatusHttpProtocol(board, request_timeout=2.0))
    await mux.start()
    try:
        rank = RankStatus(
            rank=0,
            host="node-a",
            local_rank=0,
            state=RankState.RUNNING,
            pid=7,
            last_line="token=hunter2",
            output_age_s=4.0,
            quiet_s=4.0,
        )
        board.publish(dataclasses.replace(_snapshot(), ranks=(rank,)))

        def get(host: str) -> dict[str, object]:
            conn = http.client.HTTPConnection(host, mux.port, timeout=5)
            try:
                conn.request("GET", "/state.json")
                return dict(json.loads(conn.getresponse().read()))
            finally:
                conn.close()

        local = await asyncio.to_thread(get, "127.0.0.1")
        remote = await asyncio.to_thread(get, address)
    finally:
        await mux.aclose()
    assert local["ranks"][0]["last_line"] == "token=hunter2"  # type: ignore[index]
    assert remote["ranks"][0]["last_line"] == ""  # type: ignore[index]
    assert remote["ranks"][0]["output_age_s"] == 4.0  # type: ignore[index]
    assert b"hunter2" not in json.dumps(remote).encode()
