"""The supervisor's watch on its hosts' links, on a fake clock: beats on time, silence loses a host
by name, a frozen controller excuses everyone, a lost host's control links go with it."""

from __future__ import annotations

from dataclasses import dataclass

from flodl_async.control.supervision import Action, EndRun, HostLost
from flodl_async.control.supervisor import Supervisor
from flodl_async.control.vocab import Tick
from flodl_async.control.watch import (
    AbortLinks,
    ControlLinkClosed,
    ControlLinkNamed,
    CutJoinLink,
    HostWatch,
    JoinBound,
    JoinHeard,
    Lost,
    RelayBeat,
    SendHeartbeat,
    Woke,
)
from flodl_async.verdict import ExitCode

from .test_supervisor import config, formed, of, running, the_end

JOIN_SILENCE = "no heartbeat for 10s (the host is frozen, down or cut off)"
RELAY_SILENCE = (
    "its relay's control link sent nothing for 10s (the host is frozen, down or cut off)"
)


@dataclass(eq=False)
class FakeLink:
    """A control link: the shell aborts it; here the test only checks which ones."""

    name: str

    def abort(self) -> None:
        raise AssertionError("the core never aborts a link itself")


def watching(now: float = 2.0, **overrides: object) -> Supervisor:
    """A running world of hosts a (ranks 0, 1) and b (ranks 2, 3), both join links bound at
    ``now``."""
    sup = Supervisor(config(**overrides), now=0.0)
    running(sup)
    for host in ("a", "b"):
        assert sup.handle(JoinBound(host=host), now) == ()
    return sup


def wake(sup: Supervisor, now: float, *, meant: float | None = None) -> tuple[Action, ...]:
    """The pump's wake at ``now`` (``meant``: the deadline it slept for; on time by default)."""
    return sup.handle(Woke(late=now - (now if meant is None else meant)), now)


# ----- join links ------------------------------------------------------------------------------


def test_a_bound_join_link_is_beaten_at_once_then_every_interval() -> None:
    sup = watching()
    assert sup.next_deadline(2.0) == 2.0
    assert wake(sup, 2.0) == (
        SendHeartbeat(host="a", sent_at=2.0),
        SendHeartbeat(host="b", sent_at=2.0),
    )
    assert sup.next_deadline(2.0) == 4.0
    assert wake(sup, 3.0) == ()  # nothing due yet
    for host in ("a", "b"):
        sup.handle(JoinHeard(host=host), 3.5)
    assert of(wake(sup, 4.0), SendHeartbeat) == [
        SendHeartbeat(host="a", sent_at=4.0),
        SendHeartbeat(host="b", sent_at=4.0),
    ]


def test_a_host_heard_every_beat_is_never_lost() -> None:
    sup = watching()
    now = 2.0
    for _ in range(50):
        sup.handle(JoinHeard(host="a"), now)
        sup.handle(JoinHeard(host="b"), now)
        assert of(wake(sup, now), EndRun) == []
        now = sup.next_deadline(now) or now
    assert sup.result is None


def test_a_silent_join_link_is_cut_and_its_host_lost_by_name() -> None:
    sup = watching()
    wake(sup, 2.0)
    sup.handle(JoinHeard(host="b"), 11.0)
    actions = wake(sup, 12.0)
    assert actions[0] == CutJoinLink(host="a")
    end = the_end(actions)
    assert end.result.exit_code is ExitCode.RANK_FAILURE
    assert end.result.reason == f"agent on host 'a' was lost mid-run: {JOIN_SILENCE}"
    # b was heard: it is beaten, not lost, and a is watched no more
    assert of(actions, SendHeartbeat) == [SendHeartbeat(host="b", sent_at=12.0)]
    assert of(actions, CutJoinLink) == [CutJoinLink(host="a")]
    assert of(wake(sup, 30.0), CutJoinLink) == [CutJoinLink(host="b")]


def test_a_frozen_controller_excuses_every_host_and_one_exactly_an_interval_late_does_not() -> None:
    sup = watching()
    wake(sup, 2.0)
    # slept for the beat at 4.0 and woke at 40.0: no host could be heard meanwhile
    excused = wake(sup, 40.0, meant=4.0)
    assert of(excused, CutJoinLink) == []
    assert sup.result is None
    assert of(excused, SendHeartbeat) == [
        SendHeartbeat(host="a", sent_at=40.0),
        SendHeartbeat(host="b", sent_at=40.0),
    ]
    # a whole deadline from the wake: late by exactly one interval is a process that ran
    lost = wake(sup, 50.0, meant=48.0)
    assert of(lost, CutJoinLink) == [CutJoinLink(host="a"), CutJoinLink(host="b")]
    assert the_end(lost).result.reason == f"agent on host 'a' was lost mid-run: {JOIN_SILENCE}"


def test_a_frame_on_an_unwatched_host_changes_nothing() -> None:
    sup = watching()
    assert sup.handle(JoinHeard(host="z"), 3.0) == ()
    assert sup.next_deadline(3.0) == 2.0


def test_a_join_link_that_closed_is_watched_no_more() -> None:
    sup = watching()
    wake(sup, 2.0)
    end = the_end(sup.handle(HostLost(host="a", reason="closed", link_closed=True), 3.0))
    assert end.result.reason == "agent on host 'a' was lost mid-run: closed"
    assert of(wake(sup, 20.0), CutJoinLink) == [CutJoinLink(host="b")]


# ----- the launched host's own reason ------------------------------------------------------------


def test_a_launched_hosts_closed_link_waits_for_its_launchers_reason() -> None:
    sup = watching(launched_hosts=frozenset({"a"}), agent_reason_wait=2.0)
    wake(sup, 2.0)
    closed = HostLost(host="a", reason="the peer closed the connection", link_closed=True)
    assert sup.handle(closed, 3.0) == ()
    assert sup.next_deadline(3.0) == 4.0  # b's beat, and a's wait ends at 5.0
    wake(sup, 4.0)
    assert sup.next_deadline(4.0) == 5.0
    told = the_end(sup.handle(HostLost(host="a", reason="ranks failed to start"), 4.5))
    assert told.result.reason == "agent on host 'a' was lost mid-run: ranks failed to start"


def test_a_held_loss_is_the_verdict_once_its_wait_ends() -> None:
    sup = watching(launched_hosts=frozenset({"a"}), agent_reason_wait=2.0)
    wake(sup, 2.0)
    sup.handle(HostLost(host="a", reason="link closed", link_closed=True), 3.0)
    assert of(wake(sup, 4.9), EndRun) == []
    end = the_end(wake(sup, 5.0))
    assert end.result.reason == "agent on host 'a' was lost mid-run: link closed"
    assert sup.handle(HostLost(host="a", reason="late", link_closed=True), 6.0) == ()


def test_a_host_not_launched_is_lost_when_its_link_closes() -> None:
    sup = watching(launched_hosts=frozenset({"b"}))
    end = the_end(sup.handle(HostLost(host="a", reason="closed", link_closed=True), 3.0))
    assert end.result.reason == "agent on host 'a' was lost mid-run: closed"


# ----- control links -----------------------------------------------------------------------------


def test_a_lost_host_gives_up_its_control_links_first() -> None:
    sup = watching()
    a1, a2, b1 = FakeLink("a1"), FakeLink("a2"), FakeLink("b1")
    sup.handle(ControlLinkNamed(link=a1, rank=0), 3.0)
    sup.handle(RelayBeat(link=a2, rank=1), 3.0)
    sup.handle(ControlLinkNamed(link=b1, rank=2), 3.0)
    actions = sup.handle(HostLost(host="a", reason="its agent failed"), 4.0)
    assert actions[0] == AbortLinks(host="a", links=frozenset({a1, a2}))
    assert the_end(actions).result.reason == "agent on host 'a' was lost mid-run: its agent failed"
    # once; a host without control links has nothing to abort
    assert of(sup.handle(HostLost(host="a", reason="again"), 5.0), AbortLinks) == []


def test_a_relay_link_silent_past_the_deadline_loses_its_host_by_name() -> None:
    sup = watching()
    link = FakeLink("a1")
    sup.handle(RelayBeat(link=link, rank=1), 3.0)
    now = 2.0
    while now < 13.0:  # the join links stay heard
        for host in ("a", "b"):
            sup.handle(JoinHeard(host=host), now)
        wake(sup, now)
        now += 2.0
    assert sup.result is None
    assert sup.next_deadline(12.5) == 13.0
    actions = wake(sup, 13.0)
    assert actions[0] == AbortLinks(host="a", links=frozenset({link}))
    assert the_end(actions).result.reason == f"agent on host 'a' was lost mid-run: {RELAY_SILENCE}"


def test_a_relay_beat_before_its_host_is_bound_or_of_an_unknown_rank_is_not_watched() -> None:
    sup = Supervisor(config(), now=0.0)
    running(sup)
    sup.handle(RelayBeat(link=FakeLink("a1"), rank=0), 3.0)  # a's join link not bound yet
    sup.handle(RelayBeat(link=FakeLink("x"), rank=99), 3.0)  # no host runs rank 99
    assert sup.next_deadline(3.0) is None


def test_a_closed_control_link_is_neither_watched_nor_aborted() -> None:
    sup = watching()
    link = FakeLink("a1")
    sup.handle(RelayBeat(link=link, rank=0), 3.0)
    sup.handle(ControlLinkClosed(link=link), 4.0)
    sup.handle(ControlLinkClosed(link=FakeLink("never named")), 4.0)
    assert of(sup.handle(HostLost(host="a", reason="gone"), 5.0), AbortLinks) == []


def test_a_link_speaks_for_the_host_of_the_first_rank_it_names() -> None:
    sup = watching()
    link = FakeLink("a1")
    sup.handle(ControlLinkNamed(link=link, rank=0), 3.0)
    sup.handle(RelayBeat(link=link, rank=2), 3.0)  # b's rank: the link stays a's
    assert of(sup.handle(HostLost(host="b", reason="gone"), 4.0), AbortLinks) == []
    assert of(sup.handle(HostLost(host="a", reason="gone"), 4.0), AbortLinks) == [
        AbortLinks(host="a", links=frozenset({link}))
    ]


def test_a_host_silent_on_both_links_is_named_by_its_join_link() -> None:
    watch = HostWatch(interval=2.0, silence=10.0)
    link = FakeLink("a1")
    hosts = {0: "a"}.get
    watch.handle(JoinBound(host="a"), 0.0, hosts)
    watch.handle(RelayBeat(link=link, rank=0), 0.0, hosts)
    watch.woke(0.0, late=0.0)
    assert watch.woke(10.0, late=0.0) == (
        CutJoinLink(host="a"),
        Lost(host="a", reason=JOIN_SILENCE),
    )


# ----- the supervisor's own deadline -------------------------------------------------------------


def test_a_wake_past_the_supervisors_own_deadline_ticks_it_and_one_before_does_not() -> None:
    sup = Supervisor(config(), now=0.0)
    formed(sup)  # the store host has until 21.0 to report its store
    assert sup.next_deadline(2.0) == 21.0
    assert of(wake(sup, 20.0), EndRun) == []
    end = the_end(wake(sup, 21.0))
    assert end.result.exit_code is ExitCode.FORMATION
    assert of(wake(sup, 22.0), EndRun) == []  # the verdict is given once
    assert sup.handle(Tick(), 23.0) == ()


# ----- the watch on its own ----------------------------------------------------------------------


def _watch(**overrides: object) -> HostWatch:
    settings: dict[str, object] = {"interval": 2.0, "silence": 10.0}
    settings.update(overrides)
    return HostWatch(**settings)  # type: ignore[arg-type]


def test_a_closed_relay_link_loses_nobody_when_it_would_have_gone_silent() -> None:
    watch = _watch()
    link = FakeLink("a1")
    hosts = {0: "a"}.get
    watch.handle(JoinBound(host="a"), 0.0, hosts)
    watch.handle(RelayBeat(link=link, rank=0), 0.0, hosts)
    watch.handle(ControlLinkClosed(link=link), 1.0, hosts)
    watch.handle(JoinHeard(host="a"), 9.5, hosts)
    assert watch.woke(10.0, late=0.0) == (SendHeartbeat(host="a", sent_at=10.0),)


def test_the_launchers_reason_cancels_the_held_loss_of_its_link() -> None:
    watch = _watch(launched_hosts=frozenset({"a"}), agent_reason_wait=2.0)
    assert watch.held("a", "link closed", True, 1.0, ended=False)
    assert not watch.held("a", "ranks failed to start", False, 1.5, ended=False)
    assert watch.due_losses(5.0) == ()  # the loss is the launcher's, not a second one
    assert watch.next_deadline() is None


def test_a_frozen_controller_excuses_the_relay_links_too() -> None:
    watch = _watch()
    hosts = {0: "a"}.get
    watch.handle(JoinBound(host="a"), 0.0, hosts)
    watch.handle(RelayBeat(link=FakeLink("a1"), rank=0), 0.0, hosts)
    watch.woke(0.0, late=0.0)
    assert watch.woke(40.0, late=36.0) == (SendHeartbeat(host="a", sent_at=40.0),)
    assert watch.next_deadline() == 42.0


def test_a_relay_beat_of_a_host_whose_join_link_was_cut_is_not_watched() -> None:
    watch = _watch()
    hosts = {0: "a"}.get
    watch.handle(JoinBound(host="a"), 0.0, hosts)
    watch.woke(0.0, late=0.0)
    assert watch.woke(10.0, late=0.0) == (
        CutJoinLink(host="a"),
        Lost(host="a", reason=JOIN_SILENCE),
    )
    # a beat that was under way as the host was lost: its silence must not lose it again
    watch.handle(RelayBeat(link=FakeLink("a1"), rank=0), 11.0, hosts)
    assert watch.next_deadline() is None
