"""HostSession against a small fake controller: the real framed protocol on loopback, real rank processes."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from flodl_async.agent import Ending, HostSession, RankOutput, SessionConfig, SessionOutcome
from flodl_async.config.devices import DeviceSpec
from flodl_async.deadlines import Deadlines
from flodl_async.errors import ControllerLost
from flodl_async.net.framed import FramedProtocol
from flodl_async.net.mux import PortMux
from flodl_async.net.service import FramedService
from flodl_async.wire import Channel, new_session_secret
from flodl_async.wire import messages as m
from flodl_async.wire.handshake import session_resolver
from flodl_async.wire.schema import Message

from .launchkit import PY, new_run_id, processes_of_run, script


class LineSink(io.BytesIO):
    """RankOutput's stdout: every written line is also counted, so a test can wait for ranks to be ready."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = asyncio.Event()

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.changed.set()
        return super().write(data)

    async def wait_for(self, needle: bytes, count: int) -> None:
        while self.getvalue().count(needle) < count:
            self.changed.clear()
            await self.changed.wait()


@dataclass
class FakeController:
    """Admits one host, forms a one-host world running ``command``, and lets the test speak on the join link."""

    secret: bytes
    run_id: str
    command: tuple[str, ...]
    join_link: asyncio.Future[FramedProtocol] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    up: asyncio.Queue[Message] = field(default_factory=asyncio.Queue)

    async def handle_join(self, link: FramedProtocol) -> None:
        hello = await link.recv_message()
        assert isinstance(hello, m.JoinHello)
        link.send(m.JoinAccept(ranks=(0, 1), run_id=self.run_id, formation_wait_s=30.0))
        link.send(
            m.WorldFormed(
                world_size=2,
                ranks=(0, 1),
                group_rank=0,
                group_world_size=1,
                store_host=False,
                command=self.command,
                env={"FLODL_TEST": "1"},
            )
        )
        link.send(m.StartRanks(round=0, restart_count=0, master_addr="127.0.0.1", master_port=1))
        self.join_link.set_result(link)
        while True:
            await self.up.put(await link.recv_message())

    async def handle_control(self, link: FramedProtocol) -> None:
        while True:
            await link.recv_message()

    async def wait_up(self, predicate: Callable[[Message], bool]) -> Message:
        while True:
            msg = await self.up.get()
            if predicate(msg):
                return msg


@dataclass
class Bench:
    controller: FakeController
    session: HostSession
    output: LineSink
    runtime_root: Path
    record: Path

    def entries(self) -> list[Path]:
        runs = self.runtime_root / "runs"
        return sorted(runs.rglob("*")) if runs.exists() else []


@pytest.fixture
async def bench() -> AsyncIterator[Bench]:
    scratch = Path(tempfile.mkdtemp(prefix="fl-sess-", dir="/tmp"))
    secret = new_session_secret()
    run_id = new_run_id()
    record = scratch / "signals"
    controller = FakeController(
        secret=secret,
        run_id=run_id,
        command=(PY, script("record_signals.py"), str(record), "ignore"),
    )
    mux = PortMux(host="127.0.0.1", port=0)
    sink = LineSink()
    try:
        async with asyncio.TaskGroup() as tg:
            for channel, handler in (
                (Channel.JOIN, controller.handle_join),
                (Channel.CONTROL, controller.handle_control),
            ):
                service = FramedService(
                    channel=channel,
                    resolve=session_resolver(secret),
                    run_id=run_id,
                    handler=handler,
                    task_group=tg,
                )
                mux.register(channel, service.protocol_factory)
            await mux.start()
            config = SessionConfig(
                controller_host="127.0.0.1",
                controller_port=mux.port,
                secret=secret,
                host="bench",
                devices=DeviceSpec.cpu(2),
                deadlines=Deadlines.resolve(stop_grace=60.0),
                runtime_root=scratch / "runtime",
            )
            session = HostSession(config, output=RankOutput(stdout=sink, stderr=sink))
            try:
                yield Bench(
                    controller=controller,
                    session=session,
                    output=sink,
                    runtime_root=scratch / "runtime",
                    record=record,
                )
            finally:
                await mux.aclose()
    finally:
        for pid in processes_of_run(
            run_id
        ):  # never leak a stubborn rank, even when the test failed
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(scratch, ignore_errors=True)


async def test_abort_during_a_long_stop_ranks_kills_at_once(bench: Bench) -> None:
    """The command loop keeps reading while StopRanks waits: Abort(grace 0) escalates it to KILL now."""
    async with asyncio.timeout(60), asyncio.TaskGroup() as tg:
        running = tg.create_task(bench.session.run(), name="session")
        await bench.output.wait_for(b"ready pid", 2)
        assert bench.entries()  # the session's scratch lives in the runtime directory
        link = await bench.controller.join_link
        link.send(m.StopRanks(round=0, reason="restart", grace_s=60.0))
        await bench.output.wait_for(b"got SIGTERM", 2)  # both ranks got (and ignored) the TERM
        loop = asyncio.get_running_loop()
        aborted_at = loop.time()
        link.send(m.Abort(reason="a rank failed elsewhere", grace_s=0.0))
        outcome = await running
        took = loop.time() - aborted_at
    assert outcome == SessionOutcome(ending=Ending.ABORTED, reason="a rank failed elsewhere")
    # far below the 60 s grace: a bound on a hang, with room for a busy machine's slow reaping
    assert took < 20.0, f"the 60 s stop was not escalated: {took:.1f}s"
    assert not processes_of_run(bench.controller.run_id)
    assert sorted(bench.record.read_text().split()) == ["0", "1", "SIGTERM", "SIGTERM"]
    exits = [msg for msg in _drain(bench.controller.up) if isinstance(msg, m.RankExited)]
    assert sorted((e.rank, e.signal) for e in exits) == [(0, signal.SIGKILL), (1, signal.SIGKILL)]
    assert not bench.entries()


def _drain(queue: asyncio.Queue[Message]) -> list[Message]:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


async def test_stop_ranks_answers_and_the_session_stays(bench: Bench) -> None:
    bench.controller.command = (PY, script("record_signals.py"), str(bench.record), "exit")
    async with asyncio.timeout(60), asyncio.TaskGroup() as tg:
        running = tg.create_task(bench.session.run(), name="session")
        await bench.output.wait_for(b"ready pid", 2)
        link = await bench.controller.join_link
        link.send(m.StopRanks(round=0, reason="restart", grace_s=60.0))
        await bench.controller.wait_up(lambda msg: isinstance(msg, m.RanksStopped))
        assert not running.done()
        link.send(m.Finish())
        outcome = await running
    assert outcome.ending is Ending.FINISHED
    assert not bench.entries()


async def test_a_lost_join_link_stops_the_ranks_and_raises(bench: Bench) -> None:
    bench.controller.command = (PY, script("record_signals.py"), str(bench.record), "exit")
    async with asyncio.timeout(60):
        task = asyncio.get_running_loop().create_task(bench.session.run(), name="session")
        try:
            await bench.output.wait_for(b"ready pid", 2)
            (await bench.controller.join_link).abort()
            with pytest.raises(ControllerLost) as caught:
                await task
        finally:
            task.cancel()
    assert caught.value.host == "bench"
    assert "lost the join link" in caught.value.reason
    assert sorted(bench.record.read_text().split()) == [
        "0",
        "1",
        "SIGTERM",
        "SIGTERM",
    ]  # TERM first, by the table
    assert not processes_of_run(bench.controller.run_id)
    assert not bench.entries()


async def test_cancellation_leaves_nothing(bench: Bench) -> None:
    async with asyncio.timeout(60):
        task = asyncio.get_running_loop().create_task(bench.session.run(), name="session")
        await bench.output.wait_for(b"ready pid", 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert not processes_of_run(bench.controller.run_id)
    assert not bench.entries()


async def test_request_stop_sends_the_signal_first_and_force_kills(bench: Bench) -> None:
    async with asyncio.timeout(60), asyncio.TaskGroup() as tg:
        running = tg.create_task(bench.session.run(), name="session")
        await bench.output.wait_for(b"ready pid", 2)
        bench.session.request_stop(signal.SIGINT)
        await bench.output.wait_for(b"got SIGINT", 2)  # the ranks got SIGINT (and ignore it)
        bench.session.force_stop()  # the second signal
        outcome = await running
    assert outcome.ending is Ending.STOPPED
    assert outcome.signal == signal.SIGINT
    assert sorted(bench.record.read_text().split()) == ["0", "1", "SIGINT", "SIGINT"]
    assert not processes_of_run(bench.controller.run_id)
    assert not bench.entries()
