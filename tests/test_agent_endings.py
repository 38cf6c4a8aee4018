"""The pure endings core of a host session, on a fake clock: the first ending decides, the shortest
KILL wins, a lost controller once an ending stands is dropped, the first returned stop ends it."""

from __future__ import annotations

import ast
import signal
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flodl_async.agent import endings
from flodl_async.agent.endings import (
    Aborted,
    ControllerGone,
    Ending,
    EndingEvent,
    Endings,
    Finished,
    RelayFailed,
    RoundFailed,
    SessionOutcome,
    Signalled,
    Stop,
    stopped_by,
)
from flodl_async.errors import AgentError, ControllerLost
from flodl_async.verdict import StopStep, stop_schedule
from flodl_async.wire import messages as m

from .test_layering import PURE

GRACE = 30.0
TERM_THEN_KILL = (
    StopStep(after=0.0, signal=signal.SIGTERM),
    StopStep(after=GRACE, signal=signal.SIGKILL),
)


def fresh() -> Endings:
    return Endings(host="h1", stop_grace=GRACE)


def take(endings: Endings, event: EndingEvent, now: float) -> tuple[Endings, Stop]:
    endings, stop = endings.end(event, now)
    assert stop is not None
    return endings, stop


# ----- each ending on its own: what it decides and the stop it asks --------------------------


def test_nothing_stands_before_the_first_ending() -> None:
    endings = fresh()
    assert not endings.ending
    assert endings.result is None
    assert endings.standing is None


def test_finish_ends_finished_with_term_then_kill_at_the_stop_grace() -> None:
    endings, stop = take(fresh(), Finished(command=m.Finish(reason="done")), 100.0)
    assert endings.ending
    assert endings.result == SessionOutcome(ending=Ending.FINISHED, reason="done")
    assert stop == Stop(
        schedule=TERM_THEN_KILL, stands=True, reason="done", kill_at=130.0, sooner=False
    )


def test_abort_brings_its_own_first_signal_and_grace() -> None:
    abort = m.Abort(reason="rank 3 failed", grace_s=8.0, first_signal=signal.SIGINT)
    endings, stop = take(fresh(), Aborted(command=abort), 10.0)
    assert endings.result == SessionOutcome(ending=Ending.ABORTED, reason="rank 3 failed")
    assert stop.schedule == stop_schedule(signal.SIGINT, 8.0)
    assert stop.schedule[-1] == StopStep(after=8.0, signal=signal.SIGKILL)
    assert (stop.stands, stop.reason, stop.kill_at) == (True, "rank 3 failed", 18.0)


def test_an_abort_with_no_grace_kills_now() -> None:
    endings, stop = take(fresh(), Aborted(command=m.Abort(reason="now", grace_s=0.0)), 5.0)
    assert stop.schedule == (StopStep(after=0.0, signal=signal.SIGKILL),)
    assert stop.kill_at == 5.0
    assert endings.standing is not None
    assert endings.standing.kill_at == 5.0


@pytest.mark.parametrize(
    ("sig", "first"),
    [
        (signal.SIGINT, signal.SIGINT),
        (signal.SIGTERM, signal.SIGTERM),
        (signal.SIGHUP, signal.SIGTERM),
    ],
)
def test_a_signal_ends_stopped_and_the_ranks_get_the_tables_first_signal(
    sig: signal.Signals, first: signal.Signals
) -> None:
    endings, stop = take(fresh(), Signalled(sig=sig), 0.0)
    assert endings.result == SessionOutcome(
        ending=Ending.STOPPED, reason=f"stopped by {sig.name}", signal=sig
    )
    assert stop.schedule == stop_schedule(first, GRACE)
    assert stop.schedule[0].signal is first
    assert stop.kill_at == GRACE


def test_a_lost_join_link_raises_controller_lost_term_first() -> None:
    endings, stop = take(fresh(), ControllerGone.link_lost("the peer closed the connection"), 1.0)
    error = endings.result
    assert isinstance(error, ControllerLost)
    assert error.host == "h1"
    assert error.reason == (
        "lost the join link to the controller (the peer closed the connection); "
        "stopping this host's ranks"
    )
    assert stop == Stop(
        schedule=TERM_THEN_KILL, stands=True, reason=error.reason, kill_at=31.0, sooner=False
    )


def test_a_silent_controller_raises_controller_lost_naming_it_and_the_silence() -> None:
    endings, stop = take(fresh(), ControllerGone.silent("10.0.0.1:29400", 10.0), 0.0)
    error = endings.result
    assert isinstance(error, ControllerLost)
    assert error.reason == (
        "the controller at 10.0.0.1:29400 sent nothing for 10s (frozen, down or cut off); "
        "stopping this host's ranks"
    )
    assert stop.schedule == TERM_THEN_KILL


def test_a_silent_relay_link_raises_controller_lost_with_the_relays_reason() -> None:
    endings, _ = take(fresh(), ControllerGone.relay_silent("the relay's link was silent"), 0.0)
    error = endings.result
    assert isinstance(error, ControllerLost)
    assert error.reason == (
        "the relay's link was silent (frozen, down or cut off); stopping this host's ranks"
    )


def test_a_relay_that_cannot_start_raises_controller_lost() -> None:
    event = RelayFailed(controller="ctl:1", detail="connection refused")
    endings, stop = take(fresh(), event, 0.0)
    error = endings.result
    assert isinstance(error, ControllerLost)
    assert (error.host, error.reason) == (
        "h1",
        "cannot open the relay's upstream link to ctl:1: connection refused",
    )
    assert stop.schedule == TERM_THEN_KILL


def test_a_failed_round_command_raises_a_plain_agent_error() -> None:
    endings, stop = take(fresh(), RoundFailed(name="start-ranks-2", detail="no such file"), 0.0)
    error = endings.result
    assert type(error) is AgentError
    assert (error.host, error.reason) == ("h1", "start-ranks-2 failed: no such file")
    assert stop.schedule == TERM_THEN_KILL


# ----- later endings --------------------------------------------------------------------------


def test_the_first_ending_decides_and_a_later_one_only_adds_its_stop() -> None:
    endings, _ = take(fresh(), Finished(command=m.Finish(reason="done")), 0.0)
    endings, stop = take(endings, Aborted(command=m.Abort(reason="late", grace_s=60.0)), 1.0)
    assert endings.result == SessionOutcome(ending=Ending.FINISHED, reason="done")
    assert not stop.stands
    assert stop.reason == "late"
    assert stop.schedule == stop_schedule(signal.SIGTERM, 60.0)  # it still runs its stop


def test_a_later_ending_with_a_shorter_kill_brings_the_deadline_closer() -> None:
    endings, _ = take(fresh(), Aborted(command=m.Abort(reason="stop", grace_s=60.0)), 0.0)
    endings, stop = take(endings, Aborted(command=m.Abort(reason="hurry", grace_s=0.0)), 5.0)
    assert stop.sooner
    assert stop.kill_at == 5.0
    assert endings.standing is not None
    assert endings.standing.kill_at == 5.0
    assert endings.result == SessionOutcome(ending=Ending.ABORTED, reason="stop")


def test_a_later_ending_with_a_longer_kill_leaves_the_deadline() -> None:
    endings, _ = take(fresh(), Aborted(command=m.Abort(reason="stop", grace_s=10.0)), 0.0)
    endings, stop = take(endings, Finished(command=m.Finish()), 1.0)  # KILL at 31 > 10
    assert not stop.sooner
    assert stop.kill_at == 10.0
    assert endings.standing is not None
    assert endings.standing.kill_at == 10.0


def test_a_later_ending_with_the_same_kill_is_not_sooner() -> None:
    endings, _ = take(fresh(), Aborted(command=m.Abort(reason="a", grace_s=10.0)), 0.0)
    endings, stop = take(endings, Aborted(command=m.Abort(reason="b", grace_s=5.0)), 5.0)
    assert not stop.sooner
    assert stop.kill_at == 10.0


@pytest.mark.parametrize(
    "lost",
    [
        ControllerGone.link_lost("closed"),
        ControllerGone.silent("ctl:1", 10.0),
        ControllerGone.relay_silent("quiet"),
    ],
)
def test_a_lost_controller_once_an_ending_stands_is_dropped(lost: ControllerGone) -> None:
    endings, _ = take(fresh(), Finished(command=m.Finish(reason="done")), 0.0)
    later, stop = endings.end(lost, 1.0)
    assert stop is None
    assert later is endings


def test_a_lost_controller_after_another_lost_controller_is_dropped() -> None:
    endings, _ = take(fresh(), ControllerGone.silent("ctl:1", 10.0), 0.0)
    later, stop = endings.end(ControllerGone.link_lost("closed"), 0.0)
    assert (later, stop) == (endings, None)
    assert isinstance(later.result, ControllerLost)
    assert "sent nothing" in later.result.reason


def test_a_failure_after_an_ending_still_runs_its_stop_but_the_first_result_stands() -> None:
    endings, _ = take(fresh(), Aborted(command=m.Abort(reason="stop", grace_s=60.0)), 0.0)
    endings, stop = take(endings, RoundFailed(name="open-round-1", detail="x"), 1.0)
    assert not stop.stands
    assert stop.sooner  # TERM, KILL at 31: before the abort's 60
    assert stop.schedule == TERM_THEN_KILL
    endings, stop = take(endings, RelayFailed(controller="c", detail="y"), 2.0)
    assert not stop.stands
    assert not stop.sooner  # KILL at 32: the 31 stays
    assert stop.kill_at == 31.0
    assert stop.schedule == TERM_THEN_KILL
    assert endings.result == SessionOutcome(ending=Ending.ABORTED, reason="stop")


def test_a_signal_while_a_signals_ending_stands_is_the_same_signal() -> None:
    endings, _ = take(fresh(), Signalled(sig=signal.SIGINT), 0.0)
    later, stop = endings.end(Signalled(sig=signal.SIGTERM), 0.0)
    assert (later, stop) == (endings, None)


@pytest.mark.parametrize(
    "first",
    [
        Finished(command=m.Finish()),
        Aborted(command=m.Abort(reason="a", grace_s=60.0)),
        RelayFailed(controller="c", detail="refused"),
        ControllerGone.link_lost("closed"),
    ],
)
def test_a_signal_after_another_ending_still_runs_its_stop(first: EndingEvent) -> None:
    endings, _ = take(fresh(), first, 0.0)
    result = endings.result
    endings, stop = take(endings, Signalled(sig=signal.SIGINT), 2.0)
    assert not stop.stands
    assert stop.schedule == stop_schedule(signal.SIGINT, GRACE)
    assert endings.result is result


# ----- the end of the session -----------------------------------------------------------------


def test_the_first_stop_to_return_ends_the_session_once() -> None:
    endings, _ = take(fresh(), Finished(command=m.Finish()), 0.0)
    endings, _ = take(endings, Aborted(command=m.Abort(reason="x", grace_s=0.0)), 1.0)
    assert endings.standing is not None
    assert not endings.standing.over
    endings, over = endings.stopped()
    assert over
    assert endings.standing is not None
    assert endings.standing.over
    again, over = endings.stopped()
    assert not over
    assert again is endings
    assert endings.result == SessionOutcome(ending=Ending.FINISHED, reason="run complete")


def test_no_stop_returns_before_an_ending() -> None:
    endings, over = fresh().stopped()
    assert not over
    assert endings == fresh()


def test_an_ending_after_the_session_is_over_keeps_it_over() -> None:
    endings, _ = take(fresh(), Finished(command=m.Finish()), 0.0)
    endings, _ = endings.stopped()
    endings, stop = take(endings, RoundFailed(name="r", detail="d"), 1.0)
    assert endings.standing is not None
    assert endings.standing.over
    assert not stop.stands
    assert endings.stopped()[1] is False


@pytest.mark.parametrize(
    ("when", "reason"),
    [
        ("", "stopped by SIGINT"),
        ("before the world formed", "stopped by SIGINT before the world formed"),
        ("while waiting for the controller", "stopped by SIGINT while waiting for the controller"),
    ],
)
def test_stopped_by_names_the_signal_and_when(when: str, reason: str) -> None:
    assert stopped_by(signal.SIGINT, when=when) == SessionOutcome(
        ending=Ending.STOPPED, reason=reason, signal=signal.SIGINT
    )


# ----- properties -----------------------------------------------------------------------------


def _events() -> st.SearchStrategy[EndingEvent]:
    reason = st.sampled_from(["a", "b", "c"])
    grace = st.floats(min_value=0.0, max_value=100.0, allow_nan=False)
    sig = st.sampled_from([signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
    return st.one_of(
        st.builds(lambda r: Finished(command=m.Finish(reason=r)), reason),
        st.builds(
            lambda r, g, s: Aborted(command=m.Abort(reason=r, grace_s=g, first_signal=s)),
            reason,
            grace,
            sig,
        ),
        st.builds(lambda s: Signalled(sig=s), sig),
        st.builds(ControllerGone.link_lost, reason),
        st.builds(ControllerGone.silent, reason, grace.filter(lambda g: g > 0)),
        st.builds(lambda r: RoundFailed(name="r", detail=r), reason),
        st.builds(lambda r: RelayFailed(controller="c", detail=r), reason),
    )


@given(
    st.lists(
        st.tuples(_events(), st.floats(min_value=0.0, max_value=50.0, allow_nan=False)),
        min_size=1,
        max_size=8,
    )
)
def test_the_first_result_stands_and_the_kill_is_the_earliest_one_offered(
    steps: list[tuple[EndingEvent, float]],
) -> None:
    endings = fresh()
    now = 0.0
    offered: list[float] = []
    first = None
    for event, gap in steps:
        now += gap
        endings, stop = endings.end(event, now)
        if stop is None:
            continue
        kill = now + stop.schedule[-1].after
        assert stop.sooner == (bool(offered) and kill < min(offered))
        offered.append(kill)
        assert stop.stands == (len(offered) == 1)
        assert stop.kill_at == min(offered)
        if first is None:
            first = endings.result
    assert first is not None  # the very first event always stands
    assert endings.result is first
    assert endings.standing is not None
    assert endings.standing.kill_at == min(offered)


def test_the_core_imports_neither_asyncio_nor_socket() -> None:
    """Its own imports are the standard library's (not asyncio, not socket) and pure packages',
    which the layering test holds free of both at any depth."""
    tree = ast.parse(Path(endings.__file__).read_text())
    stdlib: set[str] = set()
    ours: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            stdlib.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.module == "mutmut.mutation.trampoline":
                continue  # the mutation run's copy of the module, not the module's own import
            if node.level == 0:
                stdlib.add((node.module or "").split(".")[0])
            else:
                assert node.level == 2, "only the packages below agent/, never agent's own shell"
                ours.add((node.module or "").split(".")[0])
    assert not stdlib & {"asyncio", "socket"}
    assert stdlib <= {"__future__", "enum", "signal", "dataclasses", "typing"}
    assert ours <= set(PURE), ours
