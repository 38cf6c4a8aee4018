"""Stopping processes by the signal table: first signal, TERM halfway, KILL at one deadline, force = KILL now."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from flodl_async.host.procs import spawn, stop_processes
from flodl_async.verdict import stop_schedule

from .launchkit import script


async def _stubborn(record: Path, count: int = 2) -> list[asyncio.subprocess.Process]:
    """Processes that record and ignore INT and TERM, each ready once its handlers are in place."""
    procs = [
        await spawn(
            [sys.executable, script("record_signals.py"), str(record), "ignore"],
            env={**os.environ, "RANK": str(i)},
        )
        for i in range(count)
    ]
    for proc in procs:
        assert proc.stdout is not None
        assert (await proc.stdout.readline()).startswith(b"ready pid")
    return procs


async def test_the_schedule_is_followed_and_kill_comes_at_the_one_deadline(tmp_path: Path) -> None:
    record = tmp_path / "signals"
    procs = await _stubborn(record)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await stop_processes(procs, schedule=stop_schedule(signal.SIGINT, 1.0))
    elapsed = loop.time() - started
    assert [p.returncode for p in procs] == [-signal.SIGKILL, -signal.SIGKILL]
    assert 0.9 <= elapsed < 5
    lines = record.read_text().splitlines()
    for rank in ("0", "1"):
        assert [line.split()[1] for line in lines if line.startswith(rank)] == ["SIGINT", "SIGTERM"]


async def test_term_first_is_not_sent_twice(tmp_path: Path) -> None:
    record = tmp_path / "signals"
    procs = await _stubborn(record, count=1)
    await stop_processes(procs, schedule=stop_schedule(signal.SIGTERM, 0.5))
    assert record.read_text().split() == ["0", "SIGTERM"]


async def test_force_kills_now_despite_a_long_grace(tmp_path: Path) -> None:
    procs = await _stubborn(tmp_path / "signals")
    force = asyncio.Event()
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with asyncio.TaskGroup() as tg:
        stopping = tg.create_task(
            stop_processes(procs, schedule=stop_schedule(signal.SIGTERM, 60.0), force=force),
            name="stop",
        )
        await asyncio.sleep(0)  # let the stop begin (TERM sent) before forcing it
        force.set()
    assert stopping.done()
    assert loop.time() - started < 5
    assert [p.returncode for p in procs] == [-signal.SIGKILL, -signal.SIGKILL]


async def test_grace_zero_is_kill_at_once(tmp_path: Path) -> None:
    record = tmp_path / "signals"
    procs = await _stubborn(record, count=1)
    await stop_processes(procs, schedule=stop_schedule(signal.SIGTERM, 0.0))
    assert procs[0].returncode == -signal.SIGKILL
    assert not record.exists()  # no TERM first


async def test_processes_that_leave_on_the_first_signal_end_the_stop_early(tmp_path: Path) -> None:
    record = tmp_path / "signals"
    proc = await spawn(
        [sys.executable, script("record_signals.py"), str(record), "exit"],
        env={**os.environ, "RANK": "0"},
    )
    assert proc.stdout is not None
    await proc.stdout.readline()
    loop = asyncio.get_running_loop()
    started = loop.time()
    await stop_processes([proc], schedule=stop_schedule(signal.SIGINT, 60.0))
    assert loop.time() - started < 5
    assert proc.returncode == 128 + signal.SIGINT
    assert record.read_text().split() == ["0", "SIGINT"]
