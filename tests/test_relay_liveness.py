"""Heartbeats on the relay's upstream control link: the relay beats, the controller echoes, silence is the controller lost.

The decisions (beat now, lost now, a frozen relay excuses the controller) are the pure
:meth:`Liveness.woke`, driven here on a fake clock exactly as the relay's beat loop drives it: one
look per wake, then sleep until ``next_deadline()``. One real relay checks that the shell asks it.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from flodl_async.control.liveness import Liveness, Wake
from flodl_async.deadlines import Deadlines
from flodl_async.net.mux import PortMux
from flodl_async.net.service import FramedService
from flodl_async.relay.control import Relay
from flodl_async.wire import Channel
from flodl_async.wire.handshake import session_resolver

from .test_relay import RUN, FakeController

INTERVAL = 2.0
SILENCE = 10.0


@dataclass
class Trace:
    """What a simulated beat loop did: when it beat, and when (if) it reported the controller
    lost."""

    beats: list[float] = field(default_factory=list)
    lost_at: float | None = None


def _beat_loop(
    *,
    until: float,
    echo_rtt: float | None,
    stalls: dict[float, float] | None = None,
) -> Trace:
    """The relay's beat loop on a fake clock, against a controller that echoes each beat
    ``echo_rtt`` after it left (None: a silent one).

    ``stalls`` maps a planned wake instant to the instant the loop actually woke (its process
    was frozen in between).
    """
    trace = Trace()
    live = Liveness.start(0.0, interval=INTERVAL, silence=SILENCE)
    echoes: list[float] = []  # when each echo reaches the relay, in order
    wake = 0.0
    while wake <= until:
        if echoes and echoes[0] < wake:
            live = live.heard(echoes.pop(0))  # the down pump reads it while the loop sleeps
            continue
        now = (stalls or {}).get(wake, wake)
        live, due = live.woke(now, meant=wake)
        if due is Wake.LOST:
            trace.lost_at = now
            return trace  # the shell returns: no beat after the loss
        if due is Wake.BEAT:
            trace.beats.append(now)
            if echo_rtt is not None:
                echoes.append(now + echo_rtt)
        wake = live.next_deadline()
    return trace


def test_an_echoing_controller_keeps_the_relay_link_alive_for_150_beats() -> None:
    trace = _beat_loop(until=149 * INTERVAL, echo_rtt=0.003)
    assert trace.lost_at is None
    assert trace.beats == [k * INTERVAL for k in range(150)]  # each on its due time, none skipped


def test_a_controller_silent_on_the_relay_link_is_lost_at_the_deadline_and_the_beats_stop() -> None:
    trace = _beat_loop(until=1000.0, echo_rtt=None)
    assert trace.lost_at == SILENCE  # heard last when the link was made (0.0)
    assert trace.beats == [0.0, 2.0, 4.0, 6.0, 8.0]  # it beat, got nothing back, then stopped


def test_an_echo_slower_than_a_beat_but_inside_the_deadline_keeps_the_link() -> None:
    trace = _beat_loop(until=100.0, echo_rtt=SILENCE - 0.5)
    assert trace.lost_at is None


def test_a_relay_frozen_past_the_deadline_excuses_the_controller_and_beats_at_once() -> None:
    # planned to wake at 2.0 for its second beat, woke at 30.0: the controller could not be heard
    trace = _beat_loop(until=100.0, echo_rtt=None, stalls={2.0: 30.0})
    assert trace.beats[:2] == [0.0, 30.0]
    assert trace.lost_at == 30.0 + SILENCE  # a whole deadline from the wake, then lost


# ----- the shell: one real relay and controller port --------------------------------------


async def test_the_relay_reports_a_silent_upstream_lost_and_says_why(secret: bytes) -> None:
    """The relay's beat loop asks the core: a controller that never echoes is reported lost."""
    # A beat every 0.2 s and a 1 s deadline: the loop must stall 0.2 s to excuse the controller,
    # which a busy machine may do now and then; that only delays the report, which this awaits.
    deadlines = Deadlines(heartbeat_interval=0.2, heartbeat_silence=1.0)
    scratch = Path(tempfile.mkdtemp(prefix="fl-relay-live-", dir="/tmp"))
    controller = FakeController(echo_relay_beats=False)
    mux = PortMux(host="127.0.0.1", port=0)
    lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    try:
        async with asyncio.timeout(60), asyncio.TaskGroup() as tg:  # bounds a hang only
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
                deadlines=deadlines,
                on_upstream_lost=lambda reason: lost.done() or lost.set_result(reason),
            )
            await relay.start()
            try:
                reason = await lost
            finally:
                await relay.aclose()
                await mux.aclose()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert reason == "the relay's upstream control link to the controller was silent for 1s"
    # the first beat left at start, a whole deadline before the loss: the controller read it
    assert controller.relay_beats >= 1
