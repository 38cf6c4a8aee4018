"""The pure liveness tracker: beats due on time, any frame keeps a link alive, silence past the deadline expires it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flodl_async.control.liveness import Liveness, Wake
from flodl_async.deadlines import Deadlines


def test_a_fresh_link_beats_at_once_and_expires_after_the_silence() -> None:
    live = Liveness.start(100.0, interval=2.0, silence=10.0)
    assert live.send_due(100.0)
    live = live.sent(100.0)
    assert not live.send_due(101.9)
    assert live.send_due(102.0)
    assert live.next_deadline() == 102.0
    assert not live.expired(109.9)
    assert live.expired(110.0)
    assert live.silent_for(104.5) == 4.5


def test_hearing_the_peer_pushes_the_expiry_out() -> None:
    live = Liveness.start(0.0, interval=2.0, silence=10.0).heard(8.0)
    assert not live.expired(17.9)
    assert live.expired(18.0)
    assert live.heard(5.0).last_heard == 8.0  # a late-read clock never moves it back


def test_an_interval_not_shorter_than_the_silence_is_refused() -> None:
    with pytest.raises(ValueError, match="shorter than the silence deadline"):
        Liveness.start(0.0, interval=10.0, silence=10.0)


def test_the_documented_defaults_scale_with_the_knob() -> None:
    d = Deadlines.resolve(env={"FLODL_NET_TIMEOUT_SCALE": "0.5"})
    assert (Deadlines().heartbeat_interval, Deadlines().heartbeat_silence) == (2.0, 10.0)
    assert (d.heartbeat_interval, d.heartbeat_silence) == (1.0, 5.0)


@given(st.lists(st.floats(min_value=0.0, max_value=1.9), min_size=1, max_size=50))
def test_a_peer_that_beats_every_interval_never_expires_and_we_always_beat_in_time(
    gaps: list[float],
) -> None:
    """Both ends beating at the interval: the peer is never lost, and our beat is never later than its due time."""
    now = 0.0
    live = Liveness.start(now, interval=2.0, silence=10.0).sent(now)
    for gap in gaps:
        now += gap
        assert not live.expired(now)
        if live.send_due(now):
            live = live.sent(now)
        live = live.heard(now)
        assert live.next_deadline() <= now + 2.0


def test_a_peer_is_excused_for_the_time_we_ourselves_were_frozen() -> None:
    live = Liveness.start(0.0, interval=2.0, silence=10.0)
    assert live.expired(60.0)  # what a shell that slept through a SIGSTOP would conclude
    assert not live.excused(60.0).expired(69.9)


def test_a_waking_loop_beats_when_due_sleeps_otherwise_and_loses_a_silent_peer() -> None:
    live = Liveness.start(0.0, interval=2.0, silence=10.0)
    beaten, due = live.woke(0.0, meant=0.0)
    assert due is Wake.BEAT
    assert beaten == live.sent(0.0)  # kept as sent: the next beat is at 2.0
    assert beaten.woke(1.0, meant=1.0) == (beaten, Wake.SLEEP)
    assert beaten.woke(10.0, meant=10.0) == (beaten, Wake.LOST)  # lost before any beat is due


def test_a_wake_more_than_one_interval_late_excuses_the_peer_and_one_exactly_that_late_does_not() -> (
    None
):
    live = Liveness.start(0.0, interval=2.0, silence=10.0).sent(0.0)
    assert live.woke(12.0, meant=10.0) == (live, Wake.LOST)  # late by the interval: still running
    excused, due = live.woke(12.5, meant=10.0)
    assert due is Wake.BEAT  # a fresh deadline from the wake, and our beat was overdue
    assert excused == live.excused(12.5).sent(12.5)


def test_a_zero_interval_is_refused() -> None:
    # a loop beating every 0 s would spin
    with pytest.raises(ValueError, match="must be positive"):
        Liveness.start(0.0, interval=0.0, silence=10.0)


def test_a_peer_just_heard_or_heard_after_a_late_read_clock_has_been_silent_for_nothing() -> None:
    live = Liveness.start(100.0, interval=2.0, silence=10.0)
    assert live.silent_for(100.0) == 0.0
    assert live.silent_for(99.5) == 0.0
