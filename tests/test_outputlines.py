"""The pure rank-output core: the agent's chunker and the launcher's line assembler, whole and a byte at a time."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from flodl_async.agent.outputlines import ConsoleLine, LineAssembler, OutputChunker

# Bytes rich in newlines and carriage returns, cut into pieces, each arriving after a time step.
_text = st.binary(max_size=400).map(lambda b: bytes(c if c % 5 else 10 for c in b))
_no_cr = _text.map(lambda b: b.replace(b"\r", b""))
_pieces = st.lists(st.tuples(_text, st.floats(min_value=0.0, max_value=0.3)), max_size=20)


def _chunks(
    pieces: list[tuple[bytes, float]], *, idle: float = 0.1, limit: int = 64
) -> list[bytes]:
    chunker = OutputChunker(idle=idle, limit=limit)
    now, out = 0.0, []
    for data, step in pieces:
        now += step
        while (chunk := chunker.next_chunk(now)) is not None:
            out.append(chunk)
        chunker.receive_data(data, now)
        while (chunk := chunker.next_chunk(now)) is not None:
            out.append(chunk)
    out.append(chunker.end())
    return [c for c in out if c]


@given(_pieces)
def test_the_chunker_loses_no_byte_and_keeps_every_chunk_within_the_limit(
    pieces: list[tuple[bytes, float]],
) -> None:
    chunks = _chunks(pieces, limit=64)
    assert b"".join(chunks) == b"".join(d for d, _ in pieces)
    assert all(len(c) <= 64 for c in chunks)


def test_whole_lines_go_at_once_and_a_partial_line_only_after_idle() -> None:
    chunker = OutputChunker(idle=0.1)
    chunker.receive_data(b"epoch 1\n 10%|#", now=5.0)
    assert chunker.next_chunk(5.0) == b"epoch 1\n"
    assert chunker.next_chunk(5.05) is None  # the bar waits for its idle time
    assert chunker.next_deadline() == 5.1
    chunker.receive_data(b"#", now=5.08)  # a redraw does not push the deadline back
    assert chunker.next_deadline() == 5.1
    assert chunker.next_chunk(5.1) == b" 10%|##"
    assert chunker.next_deadline() is None
    assert chunker.end() == b""


def test_a_partial_line_left_behind_waits_from_when_its_chunk_was_handed_on() -> None:
    chunker = OutputChunker(idle=0.1)
    chunker.receive_data(b"b" * 10 + b"\n" + b"b" * 4, now=5.0)
    assert chunker.next_chunk(5.0) == b"b" * 10 + b"\n"
    chunker.handed_on(5.5)  # a saturated link held the whole line half a second
    assert chunker.next_chunk(5.5) is None  # the rest of the line may be in the pipe, unread
    assert chunker.next_deadline() == 5.6
    chunker.receive_data(b"b" * 6 + b"\n", now=5.5)
    assert chunker.next_chunk(5.5) == b"b" * 10 + b"\n"  # one whole line, not a half shown first
    chunker.handed_on(5.6)  # nothing left behind: nothing waits
    assert chunker.next_deadline() is None


def test_a_line_longer_than_the_limit_goes_in_pieces() -> None:
    chunker = OutputChunker(idle=10.0, limit=4)
    chunker.receive_data(b"abcdefghij\n", now=0.0)
    assert [chunker.next_chunk(0.0) for _ in range(4)] == [b"abcd", b"efgh", b"ij\n", None]


def _assemble(chunks: list[bytes]) -> list[ConsoleLine]:
    assembler = LineAssembler(limit=10_000)
    lines = [line for c in chunks for line in assembler.receive_data(c)]
    return lines + assembler.end()


@given(_no_cr, st.lists(st.integers(min_value=0, max_value=400), max_size=10))
def test_the_assembler_shows_every_line_once_whole_however_it_was_cut(
    data: bytes, cuts: list[int]
) -> None:
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    chunks = [data[a:b] for a, b in itertools.pairwise(bounds)]
    lines = _assemble(chunks)
    assert all(line.text.endswith(b"\n") and line.text.count(b"\n") == 1 for line in lines)
    whole = [line.text for line in lines if not line.update]
    expected = [line + b"\n" for line in data.split(b"\n")[:-1]]
    assert whole[: len(expected)] == expected
    # Updates show a line as it stood: each is the start of the line that follows it.
    finished = iter(whole)
    pending: list[bytes] = []
    for line in lines:
        if line.update:
            pending.append(line.text[:-1])
        else:
            text = next(finished)
            assert all(text.startswith(p) for p in pending)
            pending.clear()


def test_a_progress_bar_shows_what_the_terminal_would() -> None:
    assembler = LineAssembler()
    assert assembler.receive_data(b"\r 10%|#") == [ConsoleLine(text=b" 10%|#\n", update=True)]
    assert assembler.receive_data(b"\r 50%|#####\r") == [
        ConsoleLine(text=b" 50%|#####\n", update=True)
    ]
    assert assembler.receive_data(b"\r100%|##########|\n") == [
        ConsoleLine(text=b"100%|##########|\n")
    ]
    assert assembler.end() == []


def test_a_finished_bar_is_not_repeated_when_its_newline_comes_after_its_last_update() -> None:
    assembler = LineAssembler()
    assert assembler.receive_data(b"\r 50%|#####") == [
        ConsoleLine(text=b" 50%|#####\n", update=True)
    ]
    assert assembler.receive_data(b"\r100%|##########|") == [
        ConsoleLine(text=b"100%|##########|\n", update=True)
    ]
    assert assembler.receive_data(b"\nnext\n") == [
        ConsoleLine(text=b"next\n")
    ]  # the bar's newline adds nothing
    # A bar that ends other than its last update showed it is shown as it ends.
    assert assembler.receive_data(b"\r 10%|#") == [ConsoleLine(text=b" 10%|#\n", update=True)]
    assert assembler.receive_data(b"\r 20%|##\n") == [ConsoleLine(text=b" 20%|##\n")]
    # A plain partial line (no \r) finished by a lone newline is still shown whole: a line is not a redraw.
    assert assembler.receive_data(b"loading") == [ConsoleLine(text=b"loading\n", update=True)]
    assert assembler.receive_data(b"\n") == [ConsoleLine(text=b"loading\n")]
    assert assembler.end() == []


#: Few symbols, many carriage returns: redrawn lines, their updates, their newlines, cut anywhere.
_redraws = st.lists(st.sampled_from([b"a", b"b", b"\r", b"\n"]), max_size=120).map(b"".join)


@given(_redraws, st.lists(st.integers(min_value=0, max_value=120), max_size=12))
def test_every_line_ends_on_the_console_as_a_terminal_shows_it_and_a_redraw_never_twice(
    data: bytes, cuts: list[int]
) -> None:
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    assembler = LineAssembler(limit=10_000)
    shown: list[ConsoleLine] = []
    unfinished = b""
    for a, b in itertools.pairwise(bounds):
        out = assembler.receive_data(data[a:b])
        finishing = (unfinished + data[a:b]).split(b"\n", 1)[0] if b"\n" in data[a:b] else None
        if finishing is not None and shown and shown[-1].update and out and not out[0].update:
            # A line shown as an update and then again, the same, as a whole line: only a plain (not redrawn) one.
            assert not (out[0].text == shown[-1].text and b"\r" in finishing), (
                finishing,
                shown[-1],
                out[0],
            )
        shown += out
        unfinished = (unfinished + data[a:b]).rsplit(b"\n", 1)[-1]
    shown += assembler.end()
    # Each finished line's final look is on the console, in order: as its whole line, or as the update just before it.
    texts = iter(line.text for line in shown)
    for line in data.split(b"\n")[:-1]:
        want = _visible_text(line) + b"\n"
        assert any(t == want for t in texts), (line, shown)


def _visible_text(line: bytes) -> bytes:
    segments = [s for s in line.split(b"\r") if s]
    return segments[-1] if segments else b""


def test_an_unfinished_line_already_shown_is_not_shown_again_at_the_end() -> None:
    assembler = LineAssembler()
    assert assembler.receive_data(b"waiting") == [ConsoleLine(text=b"waiting\n", update=True)]
    assert assembler.end() == []
    assert assembler.receive_data(b"") == []


@given(_pieces)
def test_chunker_then_assembler_gives_back_the_ranks_lines(
    pieces: list[tuple[bytes, float]],
) -> None:
    data = b"".join(d for d, _ in pieces).replace(b"\r", b"")
    clean = [(d.replace(b"\r", b""), t) for d, t in pieces]
    assembler = LineAssembler(limit=10_000)
    whole = [
        line.text
        for c in _chunks(clean, limit=10_000)
        for line in assembler.receive_data(c)
        if not line.update
    ]
    assert whole == [line + b"\n" for line in data.split(b"\n")[:-1]]
