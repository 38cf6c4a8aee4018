"""The launcher's RankOutput: chunks of many ranks in, whole prefixed lines and torchrun's log layout out."""

from __future__ import annotations

import asyncio
import io
import logging
from pathlib import Path

import pytest

from flodl_async.agent import RankOutput
from flodl_async.agent.output import forward_output


def test_chunks_of_two_ranks_cut_mid_line_come_out_as_whole_lines() -> None:
    stdout = io.BytesIO()
    output = RankOutput(stdout=stdout, stderr=io.BytesIO())
    for rank, piece in [
        (0, b"alpha one\nalp"),
        (1, b"beta "),
        (0, b"ha two\n"),
        (1, b"one\nbeta two\n"),
    ]:
        output.chunk("h", 0, rank, "out", piece)
    assert stdout.getvalue().splitlines() == [
        b"[h:r0] alpha one",
        b"[h:r0] alp",  # an update: the line as it stood, a line of its own
        b"[h:r1] beta ",
        b"[h:r0] alpha two",
        b"[h:r1] beta one",
        b"[h:r1] beta two",
    ]


def test_the_filter_hides_ranks_from_the_console_but_not_from_the_files(tmp_path: Path) -> None:
    stdout, stderr = io.BytesIO(), io.BytesIO()
    output = RankOutput(
        stdout=stdout, stderr=stderr, log_dir=tmp_path, run_id="job", show_ranks={1}
    )
    for rank in (0, 1):
        output.rank_started("h", 0, rank)
        output.chunk("h", 0, rank, "out", f"hello {rank}\n".encode())
        output.chunk("h", 0, rank, "err", f"oops {rank}\n".encode())
    output.close()
    assert stdout.getvalue() == b"[h:r1] hello 1\n"
    assert stderr.getvalue() == b"[h:r1] oops 1\n"
    for rank in (0, 1):
        assert (
            tmp_path / "job" / "attempt_0" / str(rank) / "stdout.log"
        ).read_bytes() == f"hello {rank}\n".encode()
        assert (
            tmp_path / "job" / "attempt_0" / str(rank) / "stderr.log"
        ).read_bytes() == f"oops {rank}\n".encode()


def test_each_attempt_has_its_own_files_and_a_silent_rank_has_empty_ones(tmp_path: Path) -> None:
    output = RankOutput(stdout=io.BytesIO(), stderr=io.BytesIO(), log_dir=tmp_path, run_id="job")
    output.rank_started("h", 0, 3)
    output.chunk("h", 0, 3, "out", b"first\n")
    output.chunk("h", 1, 3, "out", b"")  # what a stand-alone agent sends when the rank starts again
    output.chunk("h", 1, 3, "out", b"second\n")
    output.close()
    assert (tmp_path / "job" / "attempt_0" / "3" / "stdout.log").read_bytes() == b"first\n"
    assert (tmp_path / "job" / "attempt_1" / "3" / "stdout.log").read_bytes() == b"second\n"
    assert (tmp_path / "job" / "attempt_0" / "3" / "stderr.log").read_bytes() == b""


def test_an_unknown_stream_is_dropped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    stdout = io.BytesIO()
    with caplog.at_level(logging.WARNING, logger="flodl_async.agent"):
        RankOutput(stdout=stdout, stderr=stdout).chunk("h", 0, 0, "tty", b"x\n")
    assert stdout.getvalue() == b""
    assert [r.getMessage() for r in caplog.records] == [
        "rank output from h for rank 0 names an unknown stream 'tty'; dropped"
    ]


async def test_a_slow_sink_never_makes_the_reader_send_a_line_in_two_pieces() -> None:
    # The reader hands a whole line on while the rank is still writing the next: the sink holds it
    # (a saturated link) far past the idle time, and meanwhile the rank finishes its line. The
    # reader must read that rest before it judges the unfinished line idle.
    idle = 0.05
    stream = asyncio.StreamReader()
    stream.feed_data(b"first line\nsecond ")
    held = asyncio.Event()
    release = asyncio.Event()
    chunks: list[bytes] = []

    async def emit(chunk: bytes) -> None:
        chunks.append(chunk)
        if len(chunks) == 1:
            held.set()
            await release.wait()

    reader = asyncio.create_task(forward_output(stream, idle=idle, emit=emit))
    await held.wait()
    stream.feed_data(b"line\n")  # the rank finished its line while the sink held the first
    await asyncio.sleep(4 * idle)  # the sink is slow: the unfinished line's idle time has passed
    release.set()
    stream.feed_eof()
    await reader
    assert chunks == [b"first line\n", b"second line\n"]
