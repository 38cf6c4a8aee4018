"""The status endpoint on the mux port, answered to http.client, curl and `flodl status`."""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
import sys
import time
from collections.abc import AsyncIterator

import pytest

from flodl_async.net.http import StatusHttpProtocol
from flodl_async.net.mux import PortMux
from flodl_async.status import MemberStatus, Phase, StatusBoard, StatusSnapshot
from flodl_async.wire import Channel


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


def _get(port: int, method: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
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
        members=(MemberStatus(host="node-a", ranks=(0, 1), devices=("cpu:0", "cpu:1"), joined_at=now),),
    )


async def test_503_before_the_first_snapshot_then_200(served: tuple[PortMux, StatusBoard]) -> None:
    mux, board = served
    status, headers, body = await asyncio.to_thread(_get, mux.port, "GET", "/state.json")
    assert status == 503
    assert "no status published yet" in json.loads(body)["error"]
    board.publish(_snapshot())
    status, headers, body = await asyncio.to_thread(_get, mux.port, "GET", "/state.json")
    assert status == 200
    assert headers["content-type"] == "application/json"
    assert headers["cache-control"] == "no-cache"
    assert headers["connection"] == "close"
    assert int(headers["content-length"]) == len(body)
    doc = json.loads(body)
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


async def test_unknown_path_lists_the_endpoints(served: tuple[PortMux, StatusBoard]) -> None:
    mux, _ = served
    status, _, body = await asyncio.to_thread(_get, mux.port, "GET", "/nope")
    assert status == 404
    assert json.loads(body)["endpoints"] == ["/", "/state.json"]


async def test_dashboard_page(served: tuple[PortMux, StatusBoard]) -> None:
    mux, _ = served
    status, headers, body = await asyncio.to_thread(_get, mux.port, "GET", "/")
    assert status == 200
    assert headers["content-type"].startswith("text/html")
    assert b"/state.json" in body


async def test_post_is_not_allowed(served: tuple[PortMux, StatusBoard]) -> None:
    mux, _ = served
    status, headers, _ = await asyncio.to_thread(_get, mux.port, "POST", "/state.json")
    assert status == 405
    assert headers["allow"] == "GET, HEAD"


async def test_oversized_request_head_is_refused(served: tuple[PortMux, StatusBoard]) -> None:
    mux, _ = served
    status, _, body = await asyncio.to_thread(_get, mux.port, "GET", "/state.json", {"X-Big": "a" * 20_000})
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
    proc = await asyncio.create_subprocess_exec("curl", "-sS", "--fail", f"http://127.0.0.1:{mux.port}/state.json", stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    assert json.loads(out)["run_id"] == "run-7"


async def _flodl_status(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flodl_async.cli", "status", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
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
