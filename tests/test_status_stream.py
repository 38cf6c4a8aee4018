"""/events and /metrics on the mux port, real sockets: the snapshot first, then the events; Last-Event-ID resumes;
event streams have their own budget, which a flood of short status requests cannot evict; a client that does not
read is dropped while the board goes on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import pytest

from flodl_async.net import http as status_http
from flodl_async.net.admission import AdmissionLimits
from flodl_async.net.http import StatusHttpProtocol
from flodl_async.net.mux import PortMux
from flodl_async.status import Phase, StatusBoard, StatusSnapshot
from flodl_async.status.events import RoundDone, VerdictGiven
from flodl_async.wire import Channel


def _snapshot(phase: Phase = Phase.TRAINING) -> StatusSnapshot:
    now = time.time()
    return StatusSnapshot(run_id="run-sse", phase=phase, started_at=now, updated_at=now)


async def _served(board: StatusBoard, limits: AdmissionLimits | None = None) -> PortMux:
    mux = PortMux(host="127.0.0.1", port=0, limits=limits)
    mux.register(Channel.STATUS, lambda: StatusHttpProtocol(board, request_timeout=5.0))
    await mux.start()
    return mux


@contextlib.asynccontextmanager
async def _serving(
    board: StatusBoard, limits: AdmissionLimits | None = None
) -> AsyncIterator[PortMux]:
    mux = await _served(board, limits)
    try:
        yield mux
    finally:
        await mux.aclose()


class Stream:
    """A raw /events client (HTTP/1.0: the body is the bytes until the close, no chunking)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int
    ) -> None:
        self.reader, self.writer, self.status = reader, writer, status

    @classmethod
    async def open(cls, port: int, last_id: int | None = None) -> Stream:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        extra = f"Last-Event-ID: {last_id}\r\n" if last_id is not None else ""
        writer.write(f"GET /events HTTP/1.0\r\nHost: x\r\n{extra}\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        status = int(head.split(b" ", 2)[1])
        if status == 200:
            assert b"text/event-stream" in head
        return cls(reader, writer, status)

    async def next(self) -> dict[str, str]:
        """The next SSE message (its fields), skipping comments and the retry line."""
        while True:
            block = await asyncio.wait_for(self.reader.readuntil(b"\n\n"), 10)
            fields: dict[str, str] = {}
            for line in block.decode().splitlines():
                if line and not line.startswith(":"):
                    name, _, value = line.partition(": ")
                    fields[name] = value
            if "data" in fields:
                return fields

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


async def test_the_snapshot_comes_first_then_the_history_then_each_event() -> None:
    board = StatusBoard()
    board.publish(_snapshot())  # records the phase event (id 1)
    board.emit(RoundDone(round=1, round_kind="average", reduce_s=0.01, batches=4, loss=0.5))
    async with _serving(board) as mux:
        stream = await Stream.open(mux.port)
        try:
            first = await stream.next()
            assert first["event"] == "snapshot"
            assert json.loads(first["data"])["run_id"] == "run-sse"
            replay = [await stream.next() for _ in range(2)]
            assert [(m["id"], json.loads(m["data"])["kind"]) for m in replay] == [
                ("1", "phase"),
                ("2", "round"),
            ]
            board.emit(VerdictGiven(exit_code=0, reason="done"))
            live = await stream.next()
            assert live["id"] == "3"
            assert json.loads(live["data"])["reason"] == "done"
            board.publish(_snapshot(Phase.DONE))  # a new snapshot and its phase event
            kinds = {
                (m.get("event"), json.loads(m["data"]).get("kind"))
                for m in [await stream.next(), await stream.next()]
            }
            assert kinds == {(None, "phase"), ("snapshot", None)}
            assert board.statistics().event_subscribers == 1
        finally:
            await stream.close()


async def test_last_event_id_resumes_after_it() -> None:
    board = StatusBoard()
    board.publish(_snapshot())
    for r in range(1, 5):
        board.emit(RoundDone(round=r, round_kind="average", reduce_s=0.01, batches=1))
    async with _serving(board) as mux:
        stream = await Stream.open(mux.port, last_id=3)
        try:
            assert (await stream.next())["event"] == "snapshot"
            assert [(await stream.next())["id"] for _ in range(2)] == ["4", "5"]
        finally:
            await stream.close()


async def test_streams_have_their_own_budget_that_a_status_flood_cannot_evict() -> None:
    board = StatusBoard()
    board.publish(_snapshot())
    limits = AdmissionLimits(
        max_status=4, max_status_per_peer=2, max_streams=3, max_streams_per_peer=2
    )
    async with _serving(board, limits) as mux:
        streams = [await Stream.open(mux.port) for _ in range(2)]
        try:
            refused = await Stream.open(mux.port)  # a third from this address: 503, nobody evicted
            assert refused.status == 503
            body = json.loads(await refused.reader.read())
            assert "no room for another event stream" in body["error"]
            await refused.close()
            # a flood of short requests that never finish: the status pool evicts its own oldest
            flood = []
            for _ in range(20):
                _, writer = await asyncio.open_connection("127.0.0.1", mux.port)
                writer.write(b"GET /state.json HTTP/1.1\r\n")  # a head never finished
                flood.append(writer)
            board.emit(VerdictGiven(exit_code=0, reason="still watching"))
            for stream in streams:
                while json.loads((await stream.next())["data"]).get("reason") != "still watching":
                    pass
            stats = mux.statistics()
            assert stats.streams_now == 2
            assert stats.dropped.get("evicted", 0) >= 1  # the flood churned through its own pool
            assert stats.dropped.get("stream_over_capacity") == 1
            for writer in flood:
                writer.close()
        finally:
            for stream in streams:
                await stream.close()


async def test_a_client_that_does_not_read_is_dropped_and_the_board_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(status_http, "MAX_STREAM_BACKLOG", 64 * 1024)
    board = StatusBoard()
    board.publish(_snapshot())
    async with _serving(board) as mux:
        stuck = await Stream.open(mux.port)  # reads nothing from here on
        try:
            assert board.statistics().event_subscribers == 1
            big = "x" * 8192
            for i in range(20000):  # until the kernel's buffers are full and ours passes the bound
                board.emit(VerdictGiven(exit_code=i, reason=big))
                if i % 50 == 0:
                    await asyncio.sleep(0)  # the loop writes what the stream coalesced
                if board.statistics().event_subscribers == 0:
                    break
            assert board.statistics().event_subscribers == 0
            assert board.statistics().events >= 2
        finally:
            await stuck.close()


async def test_metrics_answer_in_the_text_format() -> None:
    board = StatusBoard()
    board.publish(_snapshot())
    async with _serving(board) as mux:
        reader, writer = await asyncio.open_connection("127.0.0.1", mux.port)
        writer.write(b"GET /metrics HTTP/1.0\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"200" in head.split(b"\r\n")[0]
    assert b"content-type: text/plain; version=0.0.4; charset=utf-8" in head.lower()
    assert b"# TYPE flodl_steps_total counter" in body
    assert b"# TYPE flodl_reduce_seconds histogram" in body


async def test_head_of_events_answers_without_a_stream() -> None:
    board = StatusBoard()
    async with _serving(board) as mux:
        reader, writer = await asyncio.open_connection("127.0.0.1", mux.port)
        writer.write(b"HEAD /events HTTP/1.0\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200")
    assert b"text/event-stream" in answer
    assert mux.statistics().streams_now == 0
