"""`flodl status` against a hostile HTTP server on loopback.

Whatever answers on the port is untrusted. Every case ends one of two ways: a genuine
flodl status document is printed as cleaned text (no terminal controls, no bidi
overrides, nothing that cannot be encoded) with exit 0; anything else is one line on
stderr, nothing on stdout, and exit 1 — never a traceback, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import unicodedata
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from flodl_async.status import SCHEMA

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

ESC = "\x1b"
# Everything a string from a hostile server could use against a terminal or its reader: CSI
# (clear screen, colour), OSC 0 (window title), OSC 8 (a hyperlink whose text hides its target),
# BEL, CR (overwrite the line), C1 CSI, NUL, NEL, the line and paragraph separators, bidi
# overrides and isolates (text that reads in another order than it is), a zero-width space
# and a lone surrogate (which cannot be printed at all).
HOSTILE = (
    f"{ESC}[2J{ESC}[31mred\x07{ESC}]0;pwned\x07"
    f"{ESC}]8;;https://evil.example/{ESC}\\click{ESC}]8;;{ESC}\\"
    "\rX\x9b1m\x00\x85\u2028\u2029"
    "\u202euoy\u202c\u2066iso\u2069\u200f\u061c\u200b\ud800"
)
#: What is left of HOSTILE once cleaned: printable text only.
CLEANED = "[2J[31mred]0;pwned]8;;https://evil.example/\\click]8;;\\X1muoyiso"
#: Character categories that must never reach the terminal (newline aside).
FORBIDDEN = {"Cc", "Cf", "Cs", "Zl", "Zp"}


def _assert_clean(text: str) -> None:
    bad = sorted(
        {f"U+{ord(ch):04X}" for ch in text if ch != "\n" and unicodedata.category(ch) in FORBIDDEN}
    )
    assert bad == [], f"these reached the terminal: {bad}"


@contextlib.asynccontextmanager
async def _server(handler: Handler) -> AsyncIterator[int]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client gave up on us, as it should
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


def _answer(raw: bytes) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(raw)
        await writer.drain()

    return handler


def _http(
    body: bytes,
    status_line: bytes = b"HTTP/1.1 200 OK",
    headers: bytes = b"Content-Type: application/json\r\n",
) -> bytes:
    return (
        status_line
        + b"\r\n"
        + headers
        + b"Content-Length: "
        + str(len(body)).encode()
        + b"\r\nConnection: close\r\n\r\n"
        + body
    )


def _json(doc: object) -> bytes:
    """Raw controls in the body, not \\u escapes; a lone surrogate can only travel as an escape (raw, it is not UTF-8)."""
    return json.dumps(doc, ensure_ascii=False).replace("\ud800", "\\ud800").encode()


async def _flodl_status(port: int, *args: str) -> tuple[int, str, str, float]:
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flodl_async.cli.flodl", "status", "--addr", f"127.0.0.1:{port}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with asyncio.timeout(30):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return (
        proc.returncode,
        out.decode(errors="strict"),
        err.decode(errors="strict"),
        time.monotonic() - started,
    )


def _genuine(**fields: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "schema": SCHEMA,
        "run_id": "run-7",
        "phase": "training",
        "started_at": 1.0,
        "updated_at": 2.0,
        "world_size": 1,
        "joined_ranks": 1,
        "min_rank_start": 1,
        "target_ranks": 1,
        "restart_count": 0,
        "members": [
            {
                "host": "node-a",
                "ranks": [0],
                "devices": ["cpu:0"],
                "joined_at": 1.0,
                "state": "joined",
            }
        ],
        "ranks": [
            {
                "rank": 0,
                "host": "node-a",
                "local_rank": 0,
                "state": "running",
                "pid": 42,
                "exit_code": None,
                "signal": None,
            }
        ],
        "verdict": "",
        "exit_code": None,
        "connections": {"routed": {"join": 1}, "dropped": {}},
    }
    doc.update(fields)
    return doc


# ----- what is not a flodl status: one line, exit 1 ------------------------------------------------


async def _endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A 200 whose body never ends (no length, no close)."""
    await reader.readuntil(b"\r\n\r\n")
    writer.write(
        b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{"schema": "flodl-status/1", "run_id": "'
    )
    while True:
        writer.write(b"A" * 65536)
        await writer.drain()


async def _drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A byte every 0.2 s: each read is quick, the answer never comes (a slow-loris server)."""
    await reader.readuntil(b"\r\n\r\n")
    for byte in _http(_json(_genuine())):
        writer.write(bytes([byte]))
        await writer.drain()
        await asyncio.sleep(0.2)


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    await asyncio.sleep(30)


async def _hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")


NESTED = 100_000
NOT_STATUS: dict[str, tuple[Handler, str]] = {
    "json without the marker": (
        _answer(_http(_json({"phase": "training", "run_id": f"x{HOSTILE}"}))),
        "lacks the 'flodl-status/1' schema marker",
    ),
    "another schema": (
        _answer(_http(_json({"schema": f"other/1{HOSTILE}"}))),
        "lacks the 'flodl-status/1' schema marker",
    ),
    "a marker that is not a string": (
        _answer(_http(_json({"schema": ["flodl-status/1"]}))),
        "lacks the 'flodl-status/1' schema marker",
    ),
    "html": (_answer(_http(b"<html><title>\x1b]0;pwned\x07</title></html>")), "not with JSON"),
    "binary": (_answer(_http(bytes(range(256)) * 4)), "not with JSON"),
    "invalid utf-8": (
        _answer(_http(b'{"schema": "flodl-status/1", "run_id": "\xff\xfe"}')),
        "not with JSON",
    ),
    "a json array": (_answer(_http(b"[1, 2]")), "not an object"),
    "deep nesting": (_answer(_http(b"[" * NESTED + b"]" * NESTED)), "nested too deeply"),
    "deep nesting behind the marker": (
        _answer(
            _http(b'{"schema": "flodl-status/1", "x": ' + b"[" * NESTED + b"]" * NESTED + b"}")
        ),
        "nested too deeply",
    ),
    "huge body": (
        _answer(
            _http(b'{"schema": "flodl-status/1", "run_id": "' + b"A" * (17 * 1024 * 1024) + b'"}')
        ),
        "more than 16777216 bytes",
    ),
    "endless body": (_endless, "more than 16777216 bytes"),
    "redirect": (
        _answer(
            _http(
                _json(_genuine()),
                b"HTTP/1.1 302 Found",
                f"Location: https://evil.example/{HOSTILE}\r\n".encode("utf-8", "surrogatepass"),
            )
        ),
        "answered HTTP 302, a redirect to https://evil.example/",
    ),
    "permanent redirect without a body": (
        _answer(
            b"HTTP/1.1 301 Moved Permanently\r\nLocation: /elsewhere\r\nContent-Length: 0\r\n\r\n"
        ),
        "answered HTTP 301",
    ),
    "a lost rank that is text": (
        _answer(_http(_json(_genuine(training={"alive": 1, "lost": ["rank 2"]})))),
        "not a flodl status: training.lost[0]",
    ),
    "members is a string": (
        _answer(_http(_json(_genuine(members="node-a")))),
        "not a flodl status: members",
    ),
    "a host that is an object": (
        _answer(
            _http(
                _json(
                    _genuine(
                        members=[{"host": {"a": 1}, "ranks": [0], "devices": [], "state": "joined"}]
                    )
                )
            )
        ),
        "not a flodl status: members[0].host",
    ),
    "ranks that are a number": (
        _answer(
            _http(
                _json(
                    _genuine(members=[{"host": "a", "ranks": 5, "devices": [], "state": "joined"}])
                )
            )
        ),
        "not a flodl status: members[0].ranks",
    ),
    "a rank row that is a list": (
        _answer(_http(_json(_genuine(ranks=[[0, "a"]])))),
        "not a flodl status: ranks[0]",
    ),
    "a count that is text": (
        _answer(_http(_json(_genuine(world_size="2")))),
        "not a flodl status: world_size",
    ),
    "a count that is a boolean": (
        _answer(_http(_json(_genuine(joined_ranks=True)))),
        "not a flodl status: joined_ranks",
    ),
    "a 503 whose error is not text": (
        _answer(
            _http(_json({"schema": SCHEMA, "error": {"x": 1}}), b"HTTP/1.1 503 Service Unavailable")
        ),
        "error",
    ),
    "a bad status line": (
        _answer(f"HTTP/1.1 2{HOSTILE}00 OK\r\n\r\n".encode("utf-8", "surrogatepass")),
        "no flodl controller answers",
    ),
    "too many headers": (
        _answer(b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 500 + b"\r\n{}"),
        "no flodl controller answers",
    ),
    "a header line too long": (
        _answer(b"HTTP/1.1 200 OK\r\nX-A: " + b"b" * 100_000 + b"\r\n\r\n"),
        "no flodl controller answers",
    ),
    "a body shorter than its length": (
        _answer(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{}"),
        "cut short (2 bytes, 998 missing)",
    ),
    "hangs up without answering": (_hang_up, "no flodl controller answers"),
    "drips a byte at a time": (_drip, "did not answer within 1s"),
    "silent": (_silent, "did not answer within 1s"),
}


@pytest.mark.parametrize("case", NOT_STATUS)
@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
async def test_what_is_not_a_flodl_status_is_one_line_and_exit_1(case: str, as_json: bool) -> None:
    handler, message = NOT_STATUS[case]
    async with _server(handler) as port:
        code, out, err, took = await _flodl_status(
            port, "--timeout", "1", *(["--json"] if as_json else [])
        )
    assert code == 1, (out, err)
    assert out == ""
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("flodl status: ")
    assert message in err
    assert f"127.0.0.1:{port}" in err
    _assert_clean(err)
    assert took < 10, f"took {took:.1f}s with --timeout 1"


# ----- a genuine flodl status with hostile strings: cleaned, exit 0 ---------------------------------


def _hostile_everywhere() -> dict[str, object]:
    doc = _genuine(
        run_id=f"run{HOSTILE}",
        phase=f"training{HOSTILE}",
        verdict=f"rank 1 failed{HOSTILE}",
        members=[
            {
                "host": f"node{HOSTILE}",
                "ranks": [0],
                "devices": [f"cpu{HOSTILE}"],
                "joined_at": 1.0,
                "state": f"joined{HOSTILE}",
                f"extra{HOSTILE}": [HOSTILE],
            }
        ],
        ranks=[
            {
                "rank": 0,
                "host": f"node{HOSTILE}",
                "local_rank": 0,
                "state": f"running{HOSTILE}",
                "pid": 42,
                "exit_code": None,
                "signal": None,
            }
        ],
        connections={f"routed{HOSTILE}": {f"join{HOSTILE}": 1}, "dropped": {}},
        training={
            "epoch": 1,
            "epochs": 4,
            "policy": f"cadence{HOSTILE}",
            "backend": f"cpu{HOSTILE}",
            "world_size": 3,
            "alive": 2,
            "lost": [{"rank": 2, "host": f"b{HOSTILE}", "reason": f"killed{HOSTILE} at epoch 2"}],
        },
    )
    doc[f"key{HOSTILE}"] = {f"nested{HOSTILE}": [f"deep{HOSTILE}", {f"deeper{HOSTILE}": HOSTILE}]}
    return doc


async def test_a_genuine_status_with_hostile_strings_is_printed_clean() -> None:
    async with _server(_answer(_http(_json(_hostile_everywhere())))) as port:
        code, out, err, _ = await _flodl_status(port)
    assert code == 0, err
    _assert_clean(out)
    _assert_clean(err)
    assert f"phase    training{CLEANED}\n" in out
    assert f"verdict  rank 1 failed{CLEANED}\n" in out
    assert "node[2J[31mred" in out
    assert "running[2J[31mred" in out
    assert f"lost: rank 2 on host b{CLEANED}: killed{CLEANED} at epoch 2\n" in out


async def test_a_genuine_status_with_hostile_strings_is_printed_clean_as_json() -> None:
    async with _server(_answer(_http(_json(_hostile_everywhere())))) as port:
        code, out, err, _ = await _flodl_status(port, "--json")
    assert code == 0, err
    _assert_clean(out)
    doc = json.loads(out)
    cleaned = CLEANED
    assert doc["run_id"] == f"run{cleaned}"
    assert doc[f"key{cleaned}"] == {
        f"nested{cleaned}": [f"deep{cleaned}", {f"deeper{cleaned}": cleaned}]
    }
    assert doc["members"][0][f"extra{cleaned}"] == [cleaned]
    assert doc["connections"][f"routed{cleaned}"] == {f"join{cleaned}": 1}
    _assert_clean(
        json.dumps(doc, ensure_ascii=False)
    )  # clean as text, not only escaped as \u sequences


async def test_a_starting_controller_with_a_hostile_error_is_printed_clean() -> None:
    body = _json({"schema": SCHEMA, "error": f"no status published yet{HOSTILE}"})
    async with _server(_answer(_http(body, b"HTTP/1.1 503 Service Unavailable"))) as port:
        code, out, err, _ = await _flodl_status(port)
    assert code == 0, err
    assert out.startswith(f"controller at 127.0.0.1:{port} is starting: no status published yet[2J")
    _assert_clean(out)


async def test_a_genuine_status_prints_under_an_ascii_locale() -> None:
    doc = _genuine(run_id="run-\u00e9\u4e2d")
    async with _server(_answer(_http(_json(doc)))) as port:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "flodl_async.cli.flodl", "status", "--addr", f"127.0.0.1:{port}",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONIOENCODING": "ascii"},
        )  # fmt: skip
        out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert "run      run-" in out.decode()
