"""The launcher's console behind writer threads: a stdout nobody reads never stalls the loop, and loses no byte."""

from __future__ import annotations

import asyncio
import fcntl
import os
import struct
import subprocess
import tempfile
import termios
import threading
import time
from pathlib import Path

import pytest

from flodl_async.host.console import ConsoleWriter

from .launchkit import (
    PY,
    assert_nothing_left,
    free_port,
    launch_cmd,
    new_run_id,
    script,
    wait_status,
)

#: fcntl's F_GETPIPE_SZ (Linux): a pipe's capacity in bytes.
F_GETPIPE_SZ = 1032
PAGE = 4096


async def test_writes_never_block_and_wait_room_holds_until_the_reader_catches_up() -> None:
    read_fd, write_fd = os.pipe()
    reader = os.fdopen(read_fd, "rb")
    sink = os.fdopen(write_fd, "wb")
    writer = ConsoleWriter(sink, name="pipe", limit=256 * 1024)
    try:
        payload = b"".join(
            b"%08d\n" % i for i in range(200_000)
        )  # 1.8 MB: far more than the pipe (64 KiB) and the limit
        for start in range(0, len(payload), 4096):
            writer.write(payload[start : start + 4096])  # returns at once though nobody reads
        assert writer.backlog > 256 * 1024
        room = asyncio.ensure_future(writer.wait_room())
        await asyncio.sleep(0)
        assert not room.done()  # over the limit with the reader away: the producer waits
        got = bytearray()
        drained = asyncio.get_running_loop().run_in_executor(
            None, lambda: got.extend(reader.read(len(payload)))
        )
        await room  # the reader catching up makes room
        await drained
        assert bytes(got) == payload  # every byte, in order
    finally:
        writer.close()
        sink.close()
        reader.close()


def test_a_failed_stream_retires_and_close_returns() -> None:
    read_fd, write_fd = os.pipe()
    os.close(read_fd)  # the reader is gone before the first write: EPIPE
    sink = os.fdopen(write_fd, "wb")
    writer = ConsoleWriter(sink, name="gone")
    writer.write(b"lost\n")
    writer.close()  # does not hang on a stream that failed
    writer.write(b"after\n")  # dropped, no error
    assert writer.backlog == 0
    sink.close()  # its descriptor now points at /dev/null: closing it flushes nowhere


def _wait_until_full(fd: int, timeout: float = 60) -> None:
    """Until the pipe behind our read end ``fd`` holds its whole capacity (the writer's next write would block)."""
    capacity = fcntl.fcntl(fd, F_GETPIPE_SZ)
    deadline = time.monotonic() + timeout
    while True:
        queued = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        if (
            queued >= capacity - PAGE
        ):  # a page short at most: writes of whole lines do not pack the last page
            return
        assert time.monotonic() < deadline, (
            f"the launcher's stdout pipe never filled ({queued} of {capacity} bytes)"
        )
        time.sleep(0.02)


@pytest.mark.e2e
def test_a_launcher_whose_stdout_is_not_read_serves_status_and_loses_no_output(
    tmp_path: Path,
) -> None:
    lines = 200_000  # 20 MB from the rank: far past the pipe, the console's limit and the rank's own pipe
    done = tmp_path / "done"
    port = free_port()
    run_id = new_run_id()
    xdg = Path(tempfile.mkdtemp(prefix="fl-xdg-", dir="/tmp"))
    err = (tmp_path / "stderr").open("w")
    cmd = launch_cmd(
        "--nproc",
        "1",
        "--devices",
        "cpu",
        "--port",
        str(port),
        "--",
        PY,
        script("flood_stdout.py"),
        str(lines),
        str(done),
        run_id=run_id,
    )
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=err, env={**os.environ, "XDG_RUNTIME_DIR": str(xdg)}
    )
    assert proc.stdout is not None
    try:
        # Nobody reads the launcher's stdout: once its pipe is full, a blocking write there would hang the loop.
        _wait_until_full(proc.stdout.fileno())
        first = wait_status(port, lambda doc: doc["phase"] == "training")
        for _ in range(20):
            doc = wait_status(port, lambda doc: doc["phase"] == "training")
        assert doc["updated_at"] >= first["updated_at"]
        assert (
            not done.exists()
        )  # the rank is held by back-pressure (its pipe is full), not finished
        assert proc.poll() is None
        out = bytearray()
        reader = threading.Thread(
            target=lambda: out.extend(proc.stdout.read() if proc.stdout else b"")
        )
        reader.start()
        code = proc.wait(timeout=120)
        reader.join(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        err.close()
        proc.stdout.close()
        assert_nothing_left(run_id)
        import shutil

        shutil.rmtree(xdg, ignore_errors=True)
    assert code == 0, (tmp_path / "stderr").read_text()
    assert done.exists()
    text = out.decode().splitlines()
    numbered = [
        line
        for line in text
        if line.startswith(f"[{os.uname().nodename}:r0] ") and line.endswith("x" * 89)
    ]
    assert len(numbered) == lines  # not one line lost or torn
    assert [int(line.split()[1]) for line in numbered] == list(range(lines))  # in order
    assert any(line.endswith("flood done") for line in text)
