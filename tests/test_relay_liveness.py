"""Heartbeats on the relay's upstream control link: the relay beats, the controller echoes, silence is the controller lost."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from flodl_async.deadlines import Deadlines
from flodl_async.net.mux import PortMux
from flodl_async.net.service import FramedService
from flodl_async.relay.control import Relay
from flodl_async.wire import Channel
from flodl_async.wire.handshake import session_resolver

from .test_relay import RUN, FakeController

#: Beats every 20 ms; the deadline is 100 beats away, so only real silence reaches it.
DEADLINES = Deadlines(heartbeat_interval=0.02, heartbeat_silence=2.0)


@dataclass
class Rig:
    relay: Relay
    controller: FakeController
    lost: asyncio.Future[str]


async def _rig(secret: bytes, *, echo: bool) -> AsyncIterator[Rig]:
    scratch = Path(tempfile.mkdtemp(prefix="fl-relay-live-", dir="/tmp"))
    controller = FakeController(echo_relay_beats=echo)
    mux = PortMux(host="127.0.0.1", port=0)
    lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    try:
        async with asyncio.timeout(30), asyncio.TaskGroup() as tg:
            service = FramedService(
                channel=Channel.CONTROL,
                resolve=session_resolver(secret),
                run_id=RUN,
                handler=controller.handle,
                task_group=tg,
            )
            mux.register(Channel.CONTROL, service.protocol_factory)
            await mux.start()
            relay = Relay(
                socket_path=str(scratch / "relay.sock"),
                data_socket_path=str(scratch / "data.sock"),
                secret=secret,
                run_id=RUN,
                ranks=frozenset({4, 5}),
                controller_host="127.0.0.1",
                controller_port=mux.port,
                task_group=tg,
                deadlines=DEADLINES,
                on_upstream_lost=lambda reason: lost.done() or lost.set_result(reason),
            )
            await relay.start()
            try:
                yield Rig(relay=relay, controller=controller, lost=lost)
            finally:
                await relay.aclose()
                await mux.aclose()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture
async def echoing(secret: bytes) -> AsyncIterator[Rig]:
    async for rig in _rig(secret, echo=True):
        yield rig


@pytest.fixture
async def silent(secret: bytes) -> AsyncIterator[Rig]:
    async for rig in _rig(secret, echo=False):
        yield rig


async def _beats(rig: Rig, count: int) -> None:
    while rig.controller.relay_beats < count:  # noqa: ASYNC110 — the fake only counts; one look per beat interval
        await asyncio.sleep(DEADLINES.heartbeat_interval)


async def test_an_echoing_controller_keeps_the_relay_link_alive(echoing: Rig) -> None:
    await _beats(echoing, 150)  # past the silence deadline's span in beats, every one echoed
    assert not echoing.lost.done()


async def test_a_controller_silent_on_the_relay_link_is_reported_lost(silent: Rig) -> None:
    reason = await silent.lost
    assert reason == "the relay's upstream control link to the controller was silent for 2s"
    beats = silent.controller.relay_beats
    assert beats >= 2  # it did beat, and got nothing back
    await asyncio.sleep(DEADLINES.heartbeat_interval * 5)
    assert silent.controller.relay_beats == beats  # and stopped beating once it gave up
