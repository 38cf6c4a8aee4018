"""``fa.report`` outside a Trainer's step: the scalars go up the rank's relay to the run's status.

Theory of operation. The first report of a flodl rank starts one daemon thread that owns an event
loop and the rank's own control link to its host's relay
(:class:`~flodl_async.relay.ranklink.RankLink`, the rank's credential from the environment the
agent set). Reports only update the latest value of each name, under a lock, and wake the thread;
the thread sends what changed as one ``Report`` at most every :data:`REPORT_INTERVAL`, so a
script may call ``fa.report`` at every step. The controller records each as an event: on the
page, in ``/metrics`` (``flodl_scalar{name,rank}``) and in the event log. Whatever the link's fate
(the relay refuses a second link for a Trainer rank, which has its own; the run ends), the script
is never disturbed: a failure is said once on stderr and later reports are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import threading

from ..errors import FlodlError
from ..relay.ranklink import RankLink
from ..wire.scalars import Report

#: Seconds between two reports sent up (the latest value of each name is what goes).
REPORT_INTERVAL = 0.5
#: Seconds the link has to connect before reports are given up.
CONNECT_TIMEOUT = 30.0


class Reporter:
    """The thread and link of one rank's reports (one per process, made on the first report)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, float] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due: asyncio.Event | None = None
        self._broken = False
        self._thread = threading.Thread(target=self._run, name="flodl-report", daemon=True)
        self._thread.start()

    def offer(self, scalars: dict[str, float]) -> None:
        """Note the latest values; the thread sends them within :data:`REPORT_INTERVAL`."""
        if self._broken:
            return
        with self._lock:
            self._pending.update(
                {str(k): float(v) for k, v in scalars.items() if math.isfinite(float(v))}
            )
            loop, due = self._loop, self._due
        if loop is not None and due is not None:
            with contextlib.suppress(RuntimeError):  # the loop has just closed: dropped
                loop.call_soon_threadsafe(due.set)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except* (FlodlError, OSError, TimeoutError) as group:
            self._broken = True
            if self._loop is None:  # it never connected (a closed link is the run ending: quiet)
                print(
                    f"flodl: fa.report: no link to this host's relay ({group.exceptions[0]}); "
                    "reports are dropped",
                    file=sys.stderr,
                    flush=True,
                )

    async def _serve(self) -> None:
        async with asyncio.timeout(CONNECT_TIMEOUT):
            link = await RankLink.connect()
        async with link, asyncio.TaskGroup() as tg:
            tg.create_task(self._discard(link), name="report-down")
            due = asyncio.Event()
            with self._lock:
                self._loop, self._due = asyncio.get_running_loop(), due
            due.set()  # what was offered while connecting
            while True:
                await due.wait()
                due.clear()
                with self._lock:
                    batch, self._pending = self._pending, {}
                if batch:
                    link.send(Report(rank=link.rank, scalars=batch))
                    await link.drain()
                await asyncio.sleep(REPORT_INTERVAL)  # pacing: at most one report an interval

    async def _discard(self, link: RankLink) -> None:
        """Read what comes down the link (nothing this thread needs), so it never backs up; its
        close ends the reports."""
        while True:
            await link.recv()
