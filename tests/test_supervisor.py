"""The supervisor, with fake time: every decision of a run from the open window to the verdict."""

from __future__ import annotations

import signal

import pytest

from flodl_async._version import __version__
from flodl_async.control.exits import OOM_HINT, describe_exit, failure_details
from flodl_async.control.membership import JoinConfig
from flodl_async.control.supervision import (
    AcceptJoin,
    Action,
    Concluding,
    Ended,
    EndRun,
    ForceStop,
    Forming,
    HostLost,
    Interrupted,
    JoinRequested,
    JoinUndelivered,
    OrderlyStop,
    RankConnected,
    RankDropped,
    RankExited,
    RanksReported,
    RanksStopped,
    RejectJoin,
    Rendezvous,
    ResetStore,
    Restarting,
    Running,
    StoreReady,
    SupervisorConfig,
    TellCoordinator,
    TrainingEnded,
    TrainingStarted,
)
from flodl_async.control.supervisor import Supervisor
from flodl_async.control.vocab import Announce, Level, Tell, Tick
from flodl_async.control.watch import JoinBound, JoinHeard, Woke
from flodl_async.host.hostnames import HostAliases
from flodl_async.status.model import RankState, RankStatus
from flodl_async.verdict import ExitCode
from flodl_async.wire import messages as m
from flodl_async.wire.restarts import RestartRank

CMD = ("python", "train.py")


def config(**overrides: object) -> SupervisorConfig:
    base: dict[str, object] = {
        "run_id": "run-1",
        "join": JoinConfig(
            min_rank_start=2, join_timeout=10.0, target_ranks=4, max_join_timeout=30.0
        ),
        "command": CMD,
        "cluster_env": {"A": "1"},
        "max_restarts": 0,
        "stop_grace": 5.0,
        "store_ready_timeout": 20.0,
        "stop_ack_margin": 3.0,
        "local_hosts": frozenset({"b"}),
    }
    base.update(overrides)
    return SupervisorConfig(**base)  # type: ignore[arg-type]


def join(host: str, n: int = 2) -> JoinRequested:
    return JoinRequested(
        host=host,
        devices=tuple(f"cpu:{i}" for i in range(n)),
        protocol_version=1,
        agent_version=__version__,
    )


def exited(
    rank: int, host: str, code: int | None = 0, round_: int = 0, sig: int | None = None
) -> RankExited:
    return RankExited(
        report=m.RankExited(
            round=round_, rank=rank, local_rank=rank % 2, host=host, exit_code=code, signal=sig
        )
    )


def of(actions: tuple[Action, ...], kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def told(actions: tuple[Action, ...], message: type) -> dict[str, m.Message]:
    return {a.to: a.message for a in of(actions, Tell) if isinstance(a.message, message)}


def the_end(actions: tuple[Action, ...]) -> EndRun:
    ends = of(actions, EndRun)
    assert len(ends) == 1, actions
    return ends[0]


def formed(sup: Supervisor, now: float = 1.0) -> tuple[Action, ...]:
    """Two hosts of two ranks each: the target (4) forms the world on the second join."""
    sup.handle(join("a"), now)
    return sup.handle(join("b"), now)


def running(sup: Supervisor, now: float = 2.0) -> tuple[Action, ...]:
    formed(sup)
    return sup.handle(StoreReady(round=0, addr="10.0.0.2", port=4000), now)


# ----- formation ---------------------------------------------------------------------------


def test_a_join_is_accepted_with_contiguous_ranks_and_announced() -> None:
    sup = Supervisor(config(), now=0.0)
    first = sup.handle(join("a"), 1.0)
    accept = of(first, AcceptJoin)
    assert [(a.host, a.reply.ranks, a.reply.run_id, a.reply.formation_wait_s) for a in accept] == [
        ("a", (0, 1), "run-1", 30.0)
    ]
    assert 'host "a" joined with ranks 0-1 (cpu:0-1) — 2 rank(s) in, target 4' in [
        a.text for a in of(first, Announce)
    ]
    assert isinstance(sup.phase, Forming)
    second = sup.handle(join("b"), 2.0)
    assert of(second, AcceptJoin)[0].reply.ranks == (2, 3)


def test_target_reached_forms_the_world_and_opens_round_zero_on_the_local_host() -> None:
    sup = Supervisor(config(), now=0.0)
    actions = formed(sup)
    # The accept goes out before the world is announced to that host.
    kinds = [type(a) for a in actions]
    assert kinds.index(AcceptJoin) < kinds.index(Tell)
    worlds = told(actions, m.WorldFormed)
    assert worlds["a"] == m.WorldFormed(
        world_size=4,
        ranks=(0, 1),
        group_rank=0,
        group_world_size=2,
        store_host=False,
        command=CMD,
        env={"A": "1"},
        max_restarts=0,
    )
    assert worlds["b"].store_host  # the controller's own host holds the store
    assert told(actions, m.OpenRound) == {"b": m.OpenRound(round=0)}
    assert isinstance(sup.phase, Rendezvous)
    assert sup.view().phase == "forming"
    assert any("world formed — 4 ranks across 2 host(s)" in a.text for a in of(actions, Announce))


def test_with_the_store_on_the_controller_port_formation_empties_it_and_starts_ranks_at_once() -> (
    None
):
    sup = Supervisor(config(controller_store=True), now=0.0)
    actions = formed(sup)
    assert not any(
        w.store_host for w in told(actions, m.WorldFormed).values()
    )  # no store host, no election
    assert told(actions, m.OpenRound) == {}
    resets = [i for i, a in enumerate(actions) if isinstance(a, ResetStore)]
    starts = [
        i
        for i, a in enumerate(actions)
        if isinstance(a, Tell) and isinstance(a.message, m.StartRanks)
    ]
    assert [actions[i] for i in resets] == [ResetStore(round=0)]
    assert len(starts) == 2
    assert resets[0] < min(starts)  # emptied before any rank can dial it
    # An empty address: each agent hands its ranks its own way to the controller.
    assert set(told(actions, m.StartRanks).values()) == {
        m.StartRanks(round=0, restart_count=0, master_addr="", master_port=0)
    }
    assert isinstance(sup.phase, Running)
    assert sup.next_deadline(1.0) is None  # no store-ready deadline to wait on


def test_with_the_store_on_the_controller_port_a_restart_empties_it_for_the_next_round() -> None:
    sup = Supervisor(config(controller_store=True, max_restarts=1), now=0.0)
    formed(sup)
    sup.handle(exited(1, "a", code=3), 3.0)
    sup.handle(RanksStopped(host="a", round=0), 4.0)
    reopened = sup.handle(RanksStopped(host="b", round=0), 4.0)
    assert of(reopened, ResetStore) == [ResetStore(round=1)]
    assert reopened.index(ResetStore(round=1)) < min(
        i for i, a in enumerate(reopened) if isinstance(a, Tell)
    )
    assert told(reopened, m.StartRanks)["b"] == m.StartRanks(
        round=1, restart_count=1, master_addr="", master_port=0
    )
    assert (
        sup.handle(StoreReady(round=1, addr="h", port=5), 5.0) == ()
    )  # the exchange is the torch backend's only


def test_without_a_local_host_rank_zeros_host_holds_the_store() -> None:
    sup = Supervisor(config(local_hosts=frozenset()), now=0.0)
    assert told(formed(sup), m.OpenRound) == {"a": m.OpenRound(round=0)}


def test_refused_join_is_answered_and_announced() -> None:
    sup = Supervisor(config(), now=0.0)
    sup.handle(join("a"), 1.0)
    actions = sup.handle(join("a"), 1.5)
    rejects = of(actions, RejectJoin)
    assert len(rejects) == 1
    assert rejects[0].host == "a"
    assert "already joined" in rejects[0].reason
    announced = of(actions, Announce)[0]
    assert announced.level is Level.WARNING
    assert announced.text == f'join refused: host "a": {rejects[0].reason}'
    assert sup.view().rejected_joins == 1


def test_the_controllers_machine_under_a_second_spelling_is_refused_as_a_duplicate() -> None:
    sup = Supervisor(
        config(local_hosts=frozenset({"localhost"}), host_aliases=HostAliases.of_machine("vm")),
        now=0.0,
    )
    sup.handle(join("localhost"), 1.0)
    rejects = of(sup.handle(join("vm"), 1.5), RejectJoin)
    assert [r.host for r in rejects] == ["vm"]
    assert (
        "host 'vm' is the machine that already joined this run as 'localhost'" in rejects[0].reason
    )
    assert [mb.host for mb in sup.view().members] == ["localhost"]
    assert of(
        sup.handle(join("alpha"), 2.0), AcceptJoin
    )  # an explicit name of its own is another host


def test_an_agent_of_another_version_is_refused_naming_both_versions_and_the_host() -> None:
    sup = Supervisor(config(), now=0.0)
    actions = sup.handle(
        JoinRequested(host="gpu7", devices=("cpu:0",), protocol_version=1, agent_version="0.0.1"),
        1.0,
    )
    reason = of(actions, RejectJoin)[0].reason
    assert "'gpu7'" in reason
    assert "'0.0.1'" in reason
    assert __version__ in reason
    assert of(actions, AcceptJoin) == []


def test_the_join_window_checks_the_configured_protocol_and_version() -> None:
    sup = Supervisor(config(protocol_version=2, version="9.9"), now=0.0)
    # This controller's own version, but the configured protocol: refused naming both.
    protocol = of(
        sup.handle(
            JoinRequested(host="a", devices=("cpu:0",), protocol_version=1, agent_version="9.9"),
            1.0,
        ),
        RejectJoin,
    )
    assert "protocol v1" in protocol[0].reason
    assert "v2 (flodl_async 9.9)" in protocol[0].reason
    # The installed version is not this controller's configured one.
    version = of(
        sup.handle(
            JoinRequested(
                host="b", devices=("cpu:0",), protocol_version=2, agent_version=__version__
            ),
            1.0,
        ),
        RejectJoin,
    )
    assert f"runs flodl_async {__version__!r}, this controller 9.9" in version[0].reason
    assert of(
        sup.handle(
            JoinRequested(host="c", devices=("cpu:0",), protocol_version=2, agent_version="9.9"),
            1.0,
        ),
        AcceptJoin,
    )


def test_a_join_without_a_target_says_so_and_the_view_lists_the_members() -> None:
    sup = Supervisor(
        config(
            join=JoinConfig(
                min_rank_start=2, join_timeout=10.0, target_ranks=None, max_join_timeout=30.0
            )
        ),
        now=0.0,
    )
    actions = sup.handle(join("a", 3), 1.0)
    assert 'host "a" joined with ranks 0-2 (cpu:0-2) — 3 rank(s) in, target none' in [
        a.text for a in of(actions, Announce)
    ]
    view = sup.view()
    assert [(mb.host, mb.ranks) for mb in view.members] == [("a", (0, 1, 2))]
    assert (view.phase, view.joined_ranks, view.world_size, view.result) == ("waiting", 3, 0, None)


def test_undelivered_accept_is_retracted_keeping_ranks_contiguous() -> None:
    sup = Supervisor(config(), now=0.0)
    sup.handle(join("a"), 1.0)
    sup.handle(JoinUndelivered(host="a"), 1.1)
    assert sup.view().joined_ranks == 0
    assert of(sup.handle(join("c"), 1.2), AcceptJoin)[0].reply.ranks == (0, 1)


def test_quorum_forms_at_the_end_of_the_window_on_a_tick() -> None:
    sup = Supervisor(config(), now=0.0)
    sup.handle(join("a"), 1.0)
    assert sup.next_deadline(1.0) == 10.0
    assert sup.handle(Tick(), 9.99) == ()
    actions = sup.handle(Tick(), 10.0)
    assert told(actions, m.WorldFormed)["a"].world_size == 2


def test_no_quorum_by_the_cap_fails_formation() -> None:
    sup = Supervisor(config(), now=0.0)
    sup.handle(Tick(), 10.0)
    assert sup.next_deadline(10.0) == 30.0
    end = the_end(sup.handle(Tick(), 30.0))
    assert end.result.exit_code is ExitCode.FORMATION
    assert end.result.reason.startswith("the world did not form: quorum not met: 0/2")
    assert isinstance(end.farewell, m.Abort)


def test_a_member_lost_before_formation_fails_at_once_naming_it() -> None:
    sup = Supervisor(config(), now=0.0)
    sup.handle(join("a"), 1.0)
    end = the_end(sup.handle(HostLost(host="a", reason="link closed"), 2.0))
    assert end.result.exit_code is ExitCode.FORMATION
    assert "'a' went away before the world formed" in end.result.reason


def test_a_planned_agent_failing_before_it_joined_fails_at_once() -> None:
    sup = Supervisor(config(), now=0.0)
    end = the_end(sup.handle(HostLost(host="a", reason="python not found"), 1.0))
    assert end.result.exit_code is ExitCode.FORMATION
    assert "agent on host 'a' failed before joining: python not found" in end.result.reason


# ----- rendezvous and running ------------------------------------------------------------------


def test_store_ready_starts_every_host_and_marks_ranks_running() -> None:
    sup = Supervisor(config(), now=0.0)
    actions = running(sup)
    starts = told(actions, m.StartRanks)
    assert starts == {
        h: m.StartRanks(round=0, restart_count=0, master_addr="10.0.0.2", master_port=4000)
        for h in ("a", "b")
    }
    assert isinstance(sup.phase, Running)
    assert (
        of(actions, Announce)[-1].text
        == "ranks started: round 0, restart 0, store at 10.0.0.2:4000"
    )
    assert [(r.rank, r.host, r.local_rank, r.state) for r in sup.view().ranks] == [
        (0, "a", 0, RankState.RUNNING),
        (1, "a", 1, RankState.RUNNING),
        (2, "b", 0, RankState.RUNNING),
        (3, "b", 1, RankState.RUNNING),
    ]
    assert sup.view().phase == "training"


def test_store_ready_for_another_round_is_ignored() -> None:
    sup = Supervisor(config(), now=0.0)
    formed(sup)
    assert sup.handle(StoreReady(round=7, addr="x", port=1), 2.0) == ()
    assert isinstance(sup.phase, Rendezvous)


def test_store_not_ready_by_its_deadline_fails_formation() -> None:
    sup = Supervisor(config(), now=0.0)
    formed(sup, now=1.0)
    assert sup.next_deadline(1.0) == 21.0
    assert sup.handle(Tick(), 20.9) == ()
    end = the_end(sup.handle(Tick(), 21.0))
    assert end.result.exit_code is ExitCode.FORMATION
    assert end.result.reason == "the store host 'b' did not report its store within 20s"


def test_every_rank_exiting_zero_is_success_with_finish() -> None:
    sup = Supervisor(config(), now=0.0)
    running(sup)
    for rank, host in ((0, "a"), (1, "a"), (2, "b")):
        actions = sup.handle(exited(rank, host), 3.0)
        assert of(actions, EndRun) == []
        assert [a.text for a in of(actions, Announce)] == [
            f"rank {rank} on {host} exited with code 0"
        ]
    end = the_end(sup.handle(exited(3, "b"), 3.0))
    assert end.result.exit_code is ExitCode.OK
    assert end.result.reason == "all 4 ranks exited 0"
    assert isinstance(end.farewell, m.Finish)
    assert sup.view().phase == "done"
    assert {r.state for r in sup.view().ranks} == {RankState.EXITED}


def test_a_rank_exiting_zero_twice_is_counted_once() -> None:
    sup = Supervisor(config(), now=0.0)
    running(sup)
    for _ in range(4):
        assert of(sup.handle(exited(0, "a"), 3.0), EndRun) == []


def test_a_failing_rank_without_restarts_ends_the_run_with_details() -> None:
    sup = Supervisor(config(), now=0.0)
    running(sup)
    report = m.RankExited(
        round=0,
        rank=1,
        local_rank=1,
        host="a",
        exit_code=3,
        error_file="Traceback\n  boom\n",
        stderr_tail=("e1", "e2"),
    )
    actions = sup.handle(RankExited(report=report), 3.0)
    end = the_end(actions)
    assert end.result.exit_code is ExitCode.RANK_FAILURE
    assert end.result.reason == "rank 1 (local rank 1) on host 'a' exited with code 3"
    assert [a.text for a in of(actions, Announce)] == [end.result.reason]
    assert end.result.details == failure_details(report)
    assert "traceback (from the rank's error file):\n  Traceback\n    boom" in end.result.details
    assert "last 2 stderr line(s) of rank 1:\n  e1\n  e2" in end.result.details
    assert end.farewell == m.Abort(
        reason=end.result.reason, grace_s=5.0, first_signal=signal.SIGTERM, exit_code=4
    )
    assert sup.view().phase == "failed"


def test_a_rank_killed_by_a_signal_is_a_failure_named_by_signal() -> None:
    sup = Supervisor(config(), now=0.0)
    running(sup)
    end = the_end(sup.handle(exited(2, "b", code=None, sig=signal.SIGKILL), 3.0))
    assert (
        end.result.reason == f"rank 2 (local rank 0) on host 'b' was killed by SIGKILL ({OOM_HINT})"
    )


def test_exits_of_another_round_do_not_decide() -> None:
    sup = Supervisor(config(), now=0.0)
    running(sup)
    assert of(sup.handle(exited(1, "a", code=9, round_=5), 3.0), EndRun) == []
    assert isinstance(sup.phase, Running)


# ----- restarts -----------------------------------------------------------------------------------


def test_a_failure_with_restarts_left_stops_every_host_then_opens_the_next_round() -> None:
    sup = Supervisor(config(max_restarts=2), now=0.0)
    running(sup)
    actions = sup.handle(exited(1, "a", code=3), 3.0)
    assert of(actions, EndRun) == []
    assert told(actions, m.StopRanks) == {
        h: m.StopRanks(round=0, reason="restarting the world", grace_s=5.0) for h in ("a", "b")
    }
    restarting = of(actions, Announce)[0]
    assert (
        restarting.text
        == "rank 1 (local rank 1) on host 'a' exited with code 3; restarting the world (restart 1 of 2)"
    )
    assert restarting.level is Level.WARNING
    assert isinstance(sup.phase, Restarting)
    assert sup.next_deadline(3.0) == 3.0 + 5.0 + 3.0
    assert sup.handle(RanksStopped(host="a", round=0), 4.0) == ()
    assert (
        sup.handle(RanksStopped(host="a", round=9), 4.0) == ()
    )  # another round's answer counts for nothing
    reopened = sup.handle(RanksStopped(host="b", round=0), 4.0)
    assert told(reopened, m.OpenRound) == {"b": m.OpenRound(round=1)}
    assert sup.restart_count == 1
    started = sup.handle(StoreReady(round=1, addr="h", port=5), 5.0)
    assert told(started, m.StartRanks)["a"] == m.StartRanks(
        round=1, restart_count=1, master_addr="h", master_port=5
    )


def test_a_second_restart_counts_two() -> None:
    sup = Supervisor(config(max_restarts=2), now=0.0)
    running(sup)
    for round_ in (0, 1):
        sup.handle(exited(1, "a", code=3, round_=round_), 3.0)
        sup.handle(RanksStopped(host="a", round=round_), 4.0)
        reopened = sup.handle(RanksStopped(host="b", round=round_), 4.0)
        assert told(reopened, m.OpenRound) == {"b": m.OpenRound(round=round_ + 1)}
        started = sup.handle(StoreReady(round=round_ + 1, addr="h", port=5), 5.0)
    assert sup.restart_count == 2
    assert told(started, m.StartRanks)["a"].restart_count == 2
    end = the_end(sup.handle(exited(0, "a", code=4, round_=2), 6.0))
    assert end.result.reason.endswith("after 2 restarts")


def test_restarts_exhausted_names_how_many() -> None:
    sup = Supervisor(config(max_restarts=1), now=0.0)
    running(sup)
    sup.handle(exited(1, "a", code=3), 3.0)
    sup.handle(RanksStopped(host="a", round=0), 4.0)
    sup.handle(RanksStopped(host="b", round=0), 4.0)
    sup.handle(StoreReady(round=1, addr="h", port=5), 5.0)
    end = the_end(sup.handle(exited(0, "a", code=4, round_=1), 6.0))
    assert (
        end.result.reason == "rank 0 (local rank 0) on host 'a' exited with code 4 after 1 restart"
    )


def test_hosts_that_do_not_stop_their_ranks_in_time_fail_the_run() -> None:
    sup = Supervisor(config(max_restarts=1), now=0.0)
    running(sup)
    sup.handle(exited(1, "a", code=3), 3.0)
    sup.handle(RanksStopped(host="a", round=0), 4.0)
    assert sup.handle(Tick(), 10.9) == ()
    end = the_end(sup.handle(Tick(), 11.0))
    assert end.result.exit_code is ExitCode.RANK_FAILURE
    assert end.result.reason == "host(s) ['b'] did not stop their ranks for the restart"


# ----- lost hosts, signals, finality ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("stage", "words"),
    [
        ("rendezvous", "during rendezvous"),
        ("running", "mid-run"),
        ("restarting", "while restarting"),
    ],
)
def test_a_member_lost_after_formation_ends_the_run_naming_it(stage: str, words: str) -> None:
    sup = Supervisor(config(max_restarts=1), now=0.0)
    formed(sup)
    if stage != "rendezvous":
        sup.handle(StoreReady(round=0, addr="h", port=1), 2.0)
    if stage == "restarting":
        sup.handle(exited(1, "a", code=3), 3.0)
    end = the_end(sup.handle(HostLost(host="b", reason="link reset"), 4.0))
    assert end.result.exit_code is ExitCode.RANK_FAILURE
    assert end.result.reason == f"agent on host 'b' was lost {words}: link reset"


# A launched agent that fails closes its join link, then its launcher raises its error: the
# error (what went wrong, what to do) is the verdict, not the link's closing.
CLOSED = "join channel to 127.0.0.1:5000: the peer closed the connection"
AGENT_ERROR = (
    "runtime directory /x: is too deep for unix socket paths — point XDG_RUNTIME_DIR at a short one"
)


def link_closed(host: str) -> HostLost:
    return HostLost(host=host, reason=CLOSED, link_closed=True)


def test_a_launched_agents_own_error_wins_over_its_links_closing() -> None:
    sup = Supervisor(config(launched_hosts=frozenset({"a", "b"}), agent_reason_wait=2.0), now=0.0)
    running(sup)
    assert sup.handle(link_closed("b"), 3.0) == ()  # its launcher may say why
    assert sup.next_deadline(3.0) == 5.0
    assert sup.result is None
    end = the_end(sup.handle(HostLost(host="b", reason=AGENT_ERROR), 3.5))
    assert end.result.exit_code is ExitCode.RANK_FAILURE
    assert end.result.reason == f"agent on host 'b' was lost mid-run: {AGENT_ERROR}"
    assert sup.handle(Tick(), 5.0) == ()  # the link's loss was answered: nothing more
    assert sup.next_deadline(5.0) is None


def test_a_launched_agent_that_says_nothing_is_lost_with_its_links_reason_at_the_wait() -> None:
    sup = Supervisor(config(launched_hosts=frozenset({"b"}), agent_reason_wait=2.0), now=0.0)
    running(sup)
    sup.handle(link_closed("b"), 3.0)
    assert sup.handle(link_closed("b"), 3.5) == ()  # the first closing sets the wait
    assert sup.handle(Tick(), 4.99) == ()
    end = the_end(sup.handle(Tick(), 5.0))
    assert end.result.reason == f"agent on host 'b' was lost mid-run: {CLOSED}"
    assert sup.next_deadline(5.0) is None


def test_a_link_loss_past_its_wait_goes_before_the_next_event() -> None:
    sup = Supervisor(config(launched_hosts=frozenset({"b"}), agent_reason_wait=2.0), now=0.0)
    running(sup)
    sup.handle(link_closed("b"), 3.0)
    actions = sup.handle(exited(0, "a", code=0), 6.0)
    assert the_end(actions).result.reason == f"agent on host 'b' was lost mid-run: {CLOSED}"


def test_the_wait_for_an_agents_reason_comes_before_the_phases_deadline() -> None:
    sup = Supervisor(config(launched_hosts=frozenset({"b"}), agent_reason_wait=2.0), now=0.0)
    formed(sup)  # rendezvous: the store must be ready by 1.0 + 20.0
    assert sup.next_deadline(3.0) == 21.0
    sup.handle(link_closed("b"), 3.0)
    assert sup.next_deadline(3.0) == 5.0


@pytest.mark.parametrize("launched", [frozenset(), frozenset({"a"})])
def test_a_link_closing_of_a_host_no_launcher_runs_is_lost_at_once(
    launched: frozenset[str],
) -> None:
    """A dial-in agent (or a walk-in) has no launcher to explain it: its link's reason is all there is."""
    sup = Supervisor(config(launched_hosts=launched), now=0.0)
    running(sup)
    end = the_end(sup.handle(link_closed("b"), 3.0))
    assert end.result.reason == f"agent on host 'b' was lost mid-run: {CLOSED}"


def test_a_launched_hosts_link_closing_after_the_verdict_waits_for_nothing() -> None:
    sup = Supervisor(config(launched_hosts=frozenset({"b"})), now=0.0)
    running(sup)
    sup.handle(Interrupted(signal=int(signal.SIGTERM)), 3.0)
    assert sup.handle(link_closed("b"), 4.0) == ()
    assert sup.next_deadline(4.0) is None


def test_a_launched_agent_that_fails_before_the_world_forms_says_why() -> None:
    sup = Supervisor(config(launched_hosts=frozenset({"a", "b"})), now=0.0)
    sup.handle(join("a"), 1.0)
    assert sup.handle(link_closed("a"), 2.0) == ()
    end = the_end(sup.handle(HostLost(host="a", reason=AGENT_ERROR), 2.1))
    assert end.result.exit_code is ExitCode.FORMATION
    assert AGENT_ERROR in end.result.reason
    assert CLOSED not in end.result.reason


def test_a_host_outside_the_world_going_away_changes_nothing() -> None:
    sup = Supervisor(config(), now=0.0)
    running(sup)
    actions = sup.handle(HostLost(host="walk-in", reason="gone"), 3.0)
    assert actions == (
        Announce(
            text="agent on host 'walk-in' (not in the world) went away: gone", level=Level.DEBUG
        ),
    )
    assert isinstance(sup.phase, Running)


@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGINT, ExitCode.INTERRUPTED), (signal.SIGTERM, ExitCode.TERMINATED)]
)
def test_first_signal_stops_with_the_signal_table(sig: signal.Signals, code: ExitCode) -> None:
    sup = Supervisor(config(), now=0.0)
    running(sup)
    actions = sup.handle(Interrupted(signal=sig), 3.0)
    end = the_end(actions)
    assert end.result.exit_code is code
    assert end.result.reason == f"interrupted by {sig.name}"
    assert end.result.details == ""
    assert end.farewell == m.Abort(
        reason=end.result.reason, grace_s=5.0, first_signal=int(sig), exit_code=int(code)
    )
    again = "Ctrl-C" if sig is signal.SIGINT else "SIGTERM"
    assert of(actions, Announce) == [
        Announce(
            text=f"stopping: ranks got {sig.name}; KILL in 5 s ({again} again to force)",
            level=Level.WARNING,
        )
    ]
    assert of(actions, ForceStop) == []


def test_a_signal_while_the_window_is_open_says_so() -> None:
    sup = Supervisor(config(), now=0.0)
    end = the_end(sup.handle(Interrupted(signal=signal.SIGINT), 1.0))
    assert end.result.reason == "interrupted by SIGINT while the join window was open"


@pytest.mark.parametrize(
    ("stage", "words"), [("rendezvous", "during rendezvous"), ("restarting", "while restarting")]
)
def test_a_signal_names_the_phase_it_stopped(stage: str, words: str) -> None:
    sup = Supervisor(config(max_restarts=1), now=0.0)
    if stage == "rendezvous":
        formed(sup)
    else:
        running(sup)
        sup.handle(exited(1, "a", code=3), 3.0)
    end = the_end(sup.handle(Interrupted(signal=signal.SIGTERM), 4.0))
    assert end.result.reason == f"interrupted by SIGTERM {words}"


def test_second_signal_forces_and_the_verdict_stays() -> None:
    sup = Supervisor(config(), now=0.0)
    running(sup)
    first = the_end(sup.handle(Interrupted(signal=signal.SIGINT), 3.0))
    second = sup.handle(Interrupted(signal=signal.SIGINT), 3.5)
    assert second == (
        Announce(text="second SIGINT: forcing the stop (KILL now)", level=Level.WARNING),
        ForceStop(),
    )
    assert sup.result == first.result


def test_a_signal_after_a_verdict_forces_the_stop() -> None:
    sup = Supervisor(config(), now=0.0)
    running(sup)
    end = the_end(sup.handle(exited(1, "a", code=3), 3.0))
    actions = sup.handle(Interrupted(signal=signal.SIGTERM), 3.5)
    assert of(actions, ForceStop)
    assert sup.result == end.result


def test_a_verdict_is_final() -> None:
    sup = Supervisor(config(), now=0.0)
    running(sup)
    end = the_end(sup.handle(exited(1, "a", code=3), 3.0))
    for event in (
        exited(0, "a"),
        exited(2, "b"),
        exited(3, "b"),
        HostLost(host="a", reason="x"),
        StoreReady(round=0, addr="h", port=1),
        Tick(),
    ):
        assert of(sup.handle(event, 4.0), EndRun) == []
    assert isinstance(sup.phase, Ended)
    assert sup.result == end.result
    assert sup.next_deadline(4.0) is None
    assert sup.handle(join("late"), 5.0) == (RejectJoin(host="late", reason="this run has ended"),)


def test_joins_after_formation_are_refused() -> None:
    sup = Supervisor(config(), now=0.0)
    formed(sup)
    refused = of(sup.handle(join("c"), 2.0), RejectJoin)
    assert refused[0].host == "c"
    assert "formed" in refused[0].reason


def test_rank_hello_marks_a_running_rank_connected_with_its_pid() -> None:
    sup = Supervisor(config(), now=0.0)
    sup.handle(RankConnected(rank=0, pid=10), 0.5)  # before the ranks run: nothing to mark
    assert sup.view().ranks == ()
    running(sup)
    sup.handle(RankConnected(rank=2, pid=1234), 3.0)
    rank2 = next(r for r in sup.view().ranks if r.rank == 2)
    assert (rank2.state, rank2.pid) == (RankState.CONNECTED, 1234)
    sup.handle(exited(2, "b", code=1), 3.5)
    rank2 = next(r for r in sup.view().ranks if r.rank == 2)
    assert (rank2.state, rank2.pid, rank2.exit_code) == (RankState.FAILED, 1234, 1)


def test_the_rank_table_shows_how_a_rank_ended() -> None:
    sup = Supervisor(config(), now=0.0)
    formed(sup)
    # A report for a rank that never ran here (a stale round) is shown, without a pid.
    sup.handle(exited(1, "a", code=0, round_=9), 1.5)
    assert sup.view().ranks[0] == RankStatus(
        rank=1, host="a", local_rank=1, state=RankState.EXITED, exit_code=0
    )
    sup.handle(StoreReady(round=0, addr="h", port=1), 2.0)
    sup.handle(exited(3, "b", code=None, sig=signal.SIGKILL), 3.0)
    assert sup.view().ranks[3] == RankStatus(
        rank=3, host="b", local_rank=1, state=RankState.FAILED, signal=signal.SIGKILL
    )


def test_trailing_blank_lines_of_the_error_file_are_dropped() -> None:
    report = m.RankExited(
        round=0,
        rank=0,
        local_rank=0,
        host="a",
        exit_code=1,
        error_file="  File x\nValueError\n\n\n",
    )
    assert (
        failure_details(report)
        == "traceback (from the rank's error file):\n    File x\n  ValueError"
    )


def test_describe_exit_of_an_unknown_signal_number() -> None:
    report = m.RankExited(round=0, rank=0, local_rank=0, host="a", signal=200)
    assert describe_exit(report) == "rank 0 (local rank 0) on host 'a' was killed by signal 200"


def test_an_undelivered_accept_of_the_join_that_formed_the_world_ends_the_run() -> None:
    # The world formed on b's join, so the retraction comes too late; b never learnt it is in the
    # world and its link reports nothing more: without this the run would wait for b's ranks forever.
    sup = Supervisor(config(local_hosts=frozenset()), now=0.0)
    formed(sup)
    end = the_end(sup.handle(JoinUndelivered(host="b"), 1.0))
    assert end.result.exit_code is ExitCode.RANK_FAILURE
    assert (
        end.result.reason
        == "agent on host 'b' was lost during rendezvous: its join accept could not be delivered"
    )


def test_a_host_gone_silent_mid_run_ends_the_run_naming_it_and_aborts_the_rest() -> None:
    """The controller's liveness check reports a silent join link as HostLost: the verdict names the host (exit 4)."""
    sup = Supervisor(config(), now=0.0)
    running(sup)
    end = the_end(
        sup.handle(
            HostLost(host="b", reason="no heartbeat for 10s (the host is frozen, down or cut off)"),
            20.0,
        )
    )
    assert end.result.exit_code is ExitCode.RANK_FAILURE
    assert (
        end.result.reason
        == "agent on host 'b' was lost mid-run: no heartbeat for 10s (the host is frozen, down or cut off)"
    )
    assert isinstance(end.farewell, m.Abort)
    assert (
        sup.handle(HostLost(host="b", reason="link reset"), 21.0) == ()
    )  # the reader's own report after the cut-off changes nothing


def test_the_traceback_is_told_once() -> None:
    """@record writes the error file and Python prints the same traceback to stderr: the tail does not repeat it."""
    traceback = 'Traceback (most recent call last):\n  File "t.py", line 3, in main\n    raise ValueError("x")\nValueError: x'
    tail = ("a warning before it", *traceback.splitlines())
    report = m.RankExited(
        round=0, rank=2, local_rank=0, host="a", exit_code=1, error_file=traceback, stderr_tail=tail
    )
    full = failure_details(report)
    assert full.count("ValueError: x") == 1
    assert "last 1 stderr line(s) of rank 2:\n  a warning before it" in full
    shown = failure_details(report, shown_live=True)
    assert 'File "t.py"' not in shown  # the console showed it already, live
    assert "traceback: above, in rank 2's stderr" in shown
    assert shown.count("ValueError: x") == 1


def test_a_sigkill_flodl_did_not_send_points_at_the_oom_killer() -> None:
    report = m.RankExited(round=0, rank=0, local_rank=0, host="a", signal=signal.SIGKILL)
    assert describe_exit(report).endswith(
        'was killed by SIGKILL (not sent by flodl; the kernel\'s OOM killer is the usual cause: look for "Out of memory" in `dmesg` or `journalctl -k`)'
    )
    assert "OOM" not in describe_exit(
        m.RankExited(round=0, rank=0, local_rank=0, host="a", signal=signal.SIGSEGV)
    )


def test_success_after_restarts_says_how_many() -> None:
    sup = Supervisor(config(max_restarts=2), now=0.0)
    running(sup)
    for round_ in (0, 1):
        sup.handle(exited(1, "a", code=3, round_=round_), 3.0)
        sup.handle(RanksStopped(host="a", round=round_), 4.0)
        sup.handle(RanksStopped(host="b", round=round_), 4.0)
        sup.handle(StoreReady(round=round_ + 1, addr="h", port=5), 5.0)
    ends = [
        a
        for r in range(4)
        for a in sup.handle(exited(r, "a" if r < 2 else "b", code=0, round_=2), 6.0)
        if isinstance(a, EndRun)
    ]
    assert [e.result.reason for e in ends] == ["all 4 ranks exited 0 after 2 restarts"]


# ----- rank activity: hangs you can see ----------------------------------------------------------


def _activity(
    rank: int, *, quiet: float, state: str = "S", line: str = "step 3", connected: bool = False
) -> m.RankActivity:
    return m.RankActivity(
        rank=rank,
        pid=100 + rank,
        uptime_s=50.0,
        state=state,
        cpu_percent=0.0,
        last_line=line,
        output_age_s=quiet,
        quiet_s=quiet,
        store_connected=connected,
    )


def test_activity_reports_fill_the_rank_table() -> None:
    sup = Supervisor(config(), now=0.0)
    running(sup)
    assert (
        sup.handle(
            RanksReported(
                host="b",
                report=m.RankStats(
                    round=0, ranks=(_activity(2, quiet=4.0, state="D", connected=True),)
                ),
            ),
            3.0,
        )
        == ()
    )
    row = sup.view().ranks[2]
    assert (
        row.pid,
        row.process,
        row.last_line,
        row.quiet_s,
        row.store_connected,
        row.uptime_s,
    ) == (102, "uninterruptible", "step 3", 4.0, True, 50.0)
    # Another host cannot speak for b's ranks, and a report of another round changes nothing.
    sup.handle(
        RanksReported(
            host="a", report=m.RankStats(round=0, ranks=(_activity(2, quiet=9.0, state="T"),))
        ),
        4.0,
    )
    sup.handle(
        RanksReported(
            host="b", report=m.RankStats(round=7, ranks=(_activity(2, quiet=9.0, state="T"),))
        ),
        4.0,
    )
    assert sup.view().ranks[2].process == "uninterruptible"
    # Without --hang-timeout even a long quiet is only shown.
    assert (
        sup.handle(
            RanksReported(host="b", report=m.RankStats(round=0, ranks=(_activity(3, quiet=1e6),))),
            5.0,
        )
        == ()
    )


def test_hang_timeout_ends_the_run_naming_the_quietest_rank() -> None:
    sup = Supervisor(config(hang_timeout=30.0), now=0.0)
    running(sup)
    assert (
        sup.handle(
            RanksReported(host="a", report=m.RankStats(round=0, ranks=(_activity(0, quiet=29.0),))),
            3.0,
        )
        == ()
    )
    actions = sup.handle(
        RanksReported(
            host="b",
            report=m.RankStats(
                round=0, ranks=(_activity(2, quiet=31.0), _activity(3, quiet=45.0, line=""))
            ),
        ),
        4.0,
    )
    end = the_end(actions)
    assert end.result.exit_code is ExitCode.STALLED
    assert end.result.reason == (
        "rank 3 (local rank 1) on host 'b' hung: no output and no CPU progress for 45 s (--hang-timeout 30); its process 103 is sleeping"
    )
    assert end.result.details == "it never connected to the rendezvous store; it printed nothing"
    assert isinstance(end.farewell, m.Abort)


# ----- the Trainer's coordinator ------------------------------------------------------------


def test_a_failed_coordinator_is_the_verdict_at_once() -> None:
    sup = Supervisor(config(), now=0.0)
    running(sup)
    reason = "rank 1 on host a was lost mid-training: no frame for 30 s (heartbeat timeout: the rank is frozen, stopped or cut off)"
    end = the_end(
        sup.handle(TrainingEnded(ok=False, reason=reason, code=ExitCode.RANK_FAILURE), 3.0)
    )
    assert (end.result.exit_code, end.result.reason) == (ExitCode.RANK_FAILURE, reason)
    assert isinstance(end.farewell, m.Abort)
    # The exits that follow it are consequences: the verdict stays the coordinator's.
    assert of(sup.handle(exited(1, "a", code=1), 4.0), EndRun) == []
    assert sup.result is not None
    assert sup.result.reason == reason


def test_an_orderly_training_end_names_the_verdict_once_the_ranks_exit() -> None:
    sup = Supervisor(config(), now=0.0)
    running(sup)
    assert (
        of(
            sup.handle(
                TrainingEnded(ok=True, reason="training complete: 2 epoch(s) on 4 rank(s)"), 3.0
            ),
            EndRun,
        )
        == []
    )
    for rank, host in ((0, "a"), (1, "a"), (2, "b")):
        sup.handle(exited(rank, host), 3.0)
    end = the_end(sup.handle(exited(3, "b"), 3.0))
    assert (end.result.exit_code, end.result.reason) == (
        ExitCode.OK,
        "training complete: 2 epoch(s) on 4 rank(s)",
    )


@pytest.mark.parametrize(
    ("signum", "code"),
    [(signal.SIGTERM, ExitCode.TERMINATED), (signal.SIGINT, ExitCode.INTERRUPTED)],
)
def test_an_orderly_stop_on_a_signal_keeps_the_signals_code(
    signum: signal.Signals, code: ExitCode
) -> None:
    sup = Supervisor(config(), now=0.0)
    running(sup)
    said = sup.handle(OrderlyStop(signal=int(signum)), 2.0)
    name = signum.name
    assert said == (
        Announce(
            text=f"stopping training in order on {name}: a final round, then shutdown ({name} "
            "again to stop the ranks)",
            level=Level.WARNING,
        ),
    )
    # an orderly end's own code (OK) gives way to the signal's
    sup.handle(
        TrainingEnded(ok=True, reason=f"training stopped ({name}) after 1 of 2 epoch(s)"), 3.0
    )
    for rank, host in ((0, "a"), (1, "a"), (2, "b")):
        sup.handle(exited(rank, host), 3.0)
    end = the_end(sup.handle(exited(3, "b"), 3.0))
    assert end.result.exit_code is code
    assert isinstance(end.farewell, m.Abort)


def test_a_failed_training_keeps_its_own_code_after_an_orderly_stop_was_asked() -> None:
    sup = Supervisor(config(), now=0.0)
    running(sup)
    sup.handle(OrderlyStop(signal=int(signal.SIGTERM)), 2.0)
    end = the_end(sup.handle(TrainingEnded(ok=False, reason="stalled", code=ExitCode.STALLED), 3.0))
    assert end.result.exit_code is ExitCode.STALLED


# ----- a rank's failure while the coordinator runs: dropped, or the cause follows the effect -----


def _trainer_running(**overrides: object) -> Supervisor:
    sup = Supervisor(config(training_outcome_wait=2.0, **overrides), now=0.0)
    running(sup)
    said = sup.handle(TrainingStarted(), 2.5)
    assert len(of(said, Announce)) == len(said)  # what --max-restarts does, or nothing
    return sup


def test_max_restarts_on_a_collective_trainer_run_is_said_loudly_and_restarts_nothing() -> None:
    plain = Supervisor(config(training_outcome_wait=2.0), now=0.0)
    running(plain)
    assert plain.handle(TrainingStarted(collective=True), 2.5) == ()
    sup = Supervisor(config(training_outcome_wait=2.0, max_restarts=2), now=0.0)
    running(sup)
    [said] = sup.handle(TrainingStarted(collective=True), 2.5)
    assert isinstance(said, Announce)
    assert said.level is Level.WARNING
    assert said.text.startswith("--max-restarts 2 restarts no rank of a COLLECTIVE Trainer run")
    sup.handle(exited(1, "a", code=1), 3.0)
    assert isinstance(sup.phase, Concluding)  # the coordinator's to drop, not a restart


def test_a_rank_failure_goes_to_the_coordinator_and_waits_for_its_cause() -> None:
    sup = _trainer_running()
    report = exited(1, "a", code=1)
    # the exit is said at once and handed to the coordinator; the verdict waits
    assert sup.handle(report, 3.0) == (
        Announce(text=describe_exit(report.report), level=Level.WARNING),
        TellCoordinator(rank=1, reason="its process exited with code 1", refines=True),
    )
    assert isinstance(sup.phase, Concluding)
    assert sup.next_deadline(3.0) == 5.0
    assert sup.view().phase == "training"
    cause = "rank 1: training failed: rank 1 raised RuntimeError('boom')"
    end = the_end(
        sup.handle(TrainingEnded(ok=False, reason=cause, code=ExitCode.RANK_FAILURE), 3.5)
    )
    assert (end.result.exit_code, end.result.reason) == (ExitCode.RANK_FAILURE, cause)


def test_a_rank_the_coordinator_drops_ends_nothing_and_the_training_gives_the_verdict() -> None:
    sup = _trainer_running()
    sup.handle(exited(1, "a", code=None, sig=int(signal.SIGKILL)), 3.0)
    assert sup.handle(RankDropped(rank=1, reason="killed"), 3.1) == ()
    assert isinstance(sup.phase, Running)
    # the deadline is gone with the hold
    assert sup.next_deadline(3.1) is None
    done = "training complete, DEGRADED — 1 of 4 ranks lost"
    sup.handle(TrainingEnded(ok=True, reason=done), 4.0)
    for rank, host in ((0, "a"), (2, "b")):
        assert of(sup.handle(exited(rank, host), 4.1), EndRun) == []
    end = the_end(sup.handle(exited(3, "b"), 4.2))
    assert (end.result.exit_code, end.result.reason) == (ExitCode.OK, done)


def test_a_rank_dropped_before_its_exit_ends_nothing_when_the_exit_comes() -> None:
    sup = _trainer_running()
    sup.handle(RankDropped(rank=2, reason="no frame for 10 s"), 3.0)
    said = sup.handle(exited(2, "b", code=None, sig=int(signal.SIGKILL)), 3.1)
    assert of(said, EndRun) == []
    # handed on all the same: its own end may say more than what dropped it
    [told] = of(said, TellCoordinator)
    assert (told.rank, told.refines) == (2, True)
    assert isinstance(sup.phase, Running)


def test_two_failures_held_wait_until_both_are_dropped() -> None:
    sup = _trainer_running()
    sup.handle(exited(1, "a", code=1), 3.0)
    second = sup.handle(exited(3, "b", code=1), 3.1)
    assert [t.rank for t in of(second, TellCoordinator)] == [3]
    sup.handle(RankDropped(rank=1, reason="x"), 3.2)
    assert isinstance(sup.phase, Concluding)
    # the first failure's deadline still holds for the second
    end = the_end(sup.handle(Woke(late=0.0), 5.0))
    assert end.result.rank == 3


def test_a_rank_failure_with_no_answer_in_time_is_the_verdict_at_the_deadline() -> None:
    sup = _trainer_running()
    report = exited(1, "a", code=1)
    sup.handle(report, 3.0)
    # the other ranks' clean exits and a wake before the deadline decide nothing
    assert of(sup.handle(exited(0, "a"), 3.2), EndRun) == []
    assert of(sup.handle(Woke(late=0.0), 4.9), EndRun) == []
    end = the_end(sup.handle(Woke(late=0.0), 5.0))
    assert (end.result.exit_code, end.result.reason) == (
        ExitCode.RANK_FAILURE,
        describe_exit(report.report),
    )
    assert end.result.rank == 1
    # the table still took the other exit
    assert {r.rank: r.state for r in sup.view().ranks}[0] is RankState.EXITED


def test_every_rank_gone_with_no_conclusion_is_a_failure() -> None:
    sup = _trainer_running()
    for rank, host in ((0, "a"), (1, "a"), (2, "b")):
        sup.handle(exited(rank, host), 3.0)
    sup.handle(exited(3, "b", code=1), 3.1)
    end = the_end(sup.handle(RankDropped(rank=3, reason="x"), 3.2))
    assert end.result.exit_code is ExitCode.RANK_FAILURE
    assert end.result.reason == "every rank exited before training ended (1 dropped)"


def test_a_held_rank_failure_outweighs_an_orderly_end() -> None:
    for later in (TrainingEnded(ok=True, reason="training complete"),):
        sup = _trainer_running()
        report = exited(1, "a", code=1)
        sup.handle(report, 3.0)
        end = the_end(sup.handle(later, 3.1))
        assert (end.result.exit_code, end.result.reason) == (
            ExitCode.RANK_FAILURE,
            describe_exit(report.report),
        )


def test_a_signal_while_a_failure_is_held_is_still_the_signals() -> None:
    sup = _trainer_running()
    sup.handle(exited(1, "a", code=1), 3.0)
    end = the_end(sup.handle(Interrupted(signal=int(signal.SIGINT)), 3.1))
    assert end.result.exit_code is ExitCode.INTERRUPTED


def test_without_a_coordinator_or_after_its_orderly_end_a_rank_failure_is_the_verdict_at_once() -> (
    None
):
    plain = Supervisor(config(training_outcome_wait=2.0), now=0.0)
    running(plain)
    assert plain.handle(RankDropped(rank=1, reason="x"), 2.9) == ()  # no Trainer: means nothing
    assert the_end(plain.handle(exited(2, "b", code=1), 3.0)).result.rank == 2
    # the coordinator already concluded in order: no cause can follow
    done = _trainer_running()
    done.handle(TrainingEnded(ok=True, reason="training complete"), 2.8)
    assert the_end(done.handle(exited(1, "a", code=1), 3.0)).result.rank == 1


def test_a_coordinated_rank_failure_does_not_restart_the_world() -> None:
    sup = _trainer_running(max_restarts=1)
    said = sup.handle(exited(1, "a", code=1), 3.0)
    assert told(said, m.StopRanks) == {}  # the rank alone (tests/test_supervisor_rank_restart.py)
    assert set(told(said, RestartRank)) == {"a"}


def test_a_trainer_hosts_loss_hands_its_ranks_to_the_coordinator_and_the_run_goes_on() -> None:
    sup = _trainer_running()
    said = sup.handle(HostLost(host="b", reason="no heartbeat for 10 s"), 3.0)
    assert of(said, EndRun) == []
    assert of(said, TellCoordinator) == [
        TellCoordinator(rank=r, reason="its host 'b' was lost: no heartbeat for 10 s")
        for r in (2, 3)
    ]
    assert isinstance(sup.phase, Concluding)
    sup.handle(RankDropped(rank=2, reason="x"), 3.1)
    sup.handle(RankDropped(rank=3, reason="x"), 3.1)
    assert isinstance(sup.phase, Running)
    done = "training complete, DEGRADED — 2 of 4 ranks lost"
    sup.handle(TrainingEnded(ok=True, reason=done), 4.0)
    sup.handle(exited(0, "a"), 4.1)
    # b's ranks are gone with it: a's exits end the run
    end = the_end(sup.handle(exited(1, "a"), 4.2))
    assert (end.result.exit_code, end.result.reason) == (ExitCode.OK, done)


def test_a_host_whose_ranks_were_all_dropped_costs_nothing_when_lost_after_training_ended() -> None:
    """The rank heartbeats and the host link of a cut-off host fall silent together: when the
    coordinator dropped its ranks and concluded first, the host's loss only completes the round."""
    sup = _trainer_running()
    for rank in (2, 3):
        sup.handle(RankDropped(rank=rank, reason="no frame for 10 s"), 3.0)
    done = "training complete, DEGRADED — 2 of 4 ranks lost"
    sup.handle(TrainingEnded(ok=True, reason=done), 3.5)
    sup.handle(exited(0, "a"), 3.6)
    assert of(sup.handle(exited(1, "a"), 3.7), EndRun) == []  # b's exits never come
    end = the_end(sup.handle(HostLost(host="b", reason="no heartbeat for 10 s"), 4.0))
    assert (end.result.exit_code, end.result.reason) == (ExitCode.OK, done)


def test_a_host_lost_after_training_ended_with_a_rank_still_in_training_is_the_verdict() -> None:
    sup = _trainer_running()
    sup.handle(RankDropped(rank=2, reason="no frame for 10 s"), 3.0)
    sup.handle(TrainingEnded(ok=True, reason="training complete"), 3.5)
    end = the_end(sup.handle(HostLost(host="b", reason="cut"), 4.0))
    assert (end.result.exit_code, end.result.reason) == (
        ExitCode.RANK_FAILURE,
        "agent on host 'b' was lost mid-run: cut",
    )


def test_a_trainer_hosts_loss_nobody_absorbs_is_the_verdict_at_the_deadline() -> None:
    sup = _trainer_running()
    sup.handle(HostLost(host="b", reason="no heartbeat for 10 s"), 3.0)
    end = the_end(sup.handle(Woke(late=0.0), 5.0))
    assert end.result.reason == "agent on host 'b' was lost mid-run: no heartbeat for 10 s"
    assert end.result.exit_code is ExitCode.RANK_FAILURE


def test_a_host_lost_while_a_failure_is_held_is_held_too() -> None:
    sup = _trainer_running()
    sup.handle(exited(1, "a", code=1), 3.0)
    said = sup.handle(HostLost(host="b", reason="cut"), 3.1)
    assert [t.rank for t in of(said, TellCoordinator)] == [2, 3]
    for rank in (1, 2, 3):
        sup.handle(RankDropped(rank=rank, reason="x"), 3.2)
    assert isinstance(sup.phase, Running)


def test_a_plain_scripts_host_loss_still_ends_the_run() -> None:
    sup = Supervisor(config(), now=0.0)
    running(sup)
    end = the_end(sup.handle(HostLost(host="b", reason="cut"), 3.0))
    assert end.result.reason == "agent on host 'b' was lost mid-run: cut"


# ----- what the console prints of a verdict --------------------------------------------------------


def test_a_failed_ranks_traceback_is_pointed_at_when_the_console_showed_its_stderr() -> None:
    sup = Supervisor(config(), now=0.0)
    running(sup)
    report = m.RankExited(
        round=0,
        rank=1,
        local_rank=1,
        host="a",
        exit_code=3,
        error_file="Traceback\n  boom\nValueError: bad\n",
    )
    result = the_end(sup.handle(RankExited(report=report), 3.0)).result
    assert result.rank == 1
    # the console that showed rank 1 live gets the pointer and the exception, another the traceback
    assert result.details_for(frozenset({1})) == failure_details(report, shown_live=True)
    assert "traceback: above, in rank 1's stderr" in result.details_for(frozenset({1}))
    assert result.details_for(frozenset({0})) == failure_details(report)


def test_a_verdict_that_names_no_rank_prints_its_details_to_every_console() -> None:
    sup = Supervisor(config(), now=0.0)
    running(sup)
    result = the_end(
        sup.handle(
            TrainingEnded(
                ok=False, reason="stalled", code=ExitCode.STALLED, details="round 3 waited"
            ),
            3.0,
        )
    ).result
    assert (result.rank, result.details_if_shown) == (None, "")
    assert result.details_for(None) == "round 3 waited"


@pytest.mark.parametrize(
    ("ranks", "reason"), [(1, "the rank exited 0"), (2, "all 2 ranks exited 0")]
)
def test_success_names_the_rank_or_counts_them(ranks: int, reason: str) -> None:
    join_config = JoinConfig(
        min_rank_start=ranks, join_timeout=10.0, target_ranks=ranks, max_join_timeout=30.0
    )
    sup = Supervisor(config(join=join_config, local_hosts=frozenset({"a"})), now=0.0)
    sup.handle(join("a", ranks), 1.0)
    sup.handle(StoreReady(round=0, addr="10.0.0.2", port=4000), 2.0)
    for rank in range(ranks - 1):
        sup.handle(exited(rank, "a"), 3.0)
    end = the_end(sup.handle(exited(ranks - 1, "a"), 3.0))
    assert (end.result.exit_code, end.result.reason) == (ExitCode.OK, reason)


def test_the_coordinators_conclusion_is_announced() -> None:
    sup = Supervisor(config(), now=0.0)
    running(sup)
    done = "training complete: 2 epoch(s) on 4 rank(s)"
    assert sup.handle(TrainingEnded(ok=True, reason=done), 3.0) == (Announce(text=done),)
    failed = sup.handle(TrainingEnded(ok=False, reason="stalled", code=ExitCode.STALLED), 4.0)
    assert failed[0] == Announce(text="stalled", level=Level.WARNING)


def test_a_hang_names_the_first_of_the_quietest_ranks_at_the_limit_with_what_it_last_did() -> None:
    sup = Supervisor(config(hang_timeout=30.0), now=0.0)
    running(sup)
    actions = sup.handle(
        RanksReported(
            host="b",
            report=m.RankStats(
                round=0,
                ranks=(
                    _activity(0, quiet=99.0),  # a's rank: b cannot speak for it
                    _activity(2, quiet=30.0, state="W", connected=True),
                    _activity(3, quiet=30.0),
                ),
            ),
        ),
        4.0,
    )
    end = the_end(actions)
    reason = (
        "rank 2 (local rank 0) on host 'b' hung: no output and no CPU progress for 30 s "
        "(--hang-timeout 30); its process 102 is W"  # a state it has no word for, as it is
    )
    assert end.result.reason == reason
    assert end.result.details == (
        "it is connected to the rendezvous store; its last output line: step 3"
    )
    assert actions[0] == Announce(text=reason, level=Level.WARNING)


def test_a_wake_past_the_join_windows_end_forms_the_quorum() -> None:
    sup = Supervisor(config(), now=0.0)
    sup.handle(join("a"), 1.0)  # 2 ranks: the quorum, short of the target
    assert sup.next_deadline(1.0) == 10.0
    actions = sup.handle(Woke(late=0.0), 10.0)
    assert set(told(actions, m.WorldFormed)) == {"a"}


def test_a_silent_host_is_lost_while_another_hosts_loss_waits_for_its_reason() -> None:
    sup = Supervisor(config(launched_hosts=frozenset({"b"}), agent_reason_wait=2.0), now=0.0)
    running(sup)
    for host in ("a", "b"):
        sup.handle(JoinBound(host=host), 2.0)
    sup.handle(Woke(late=0.0), 2.0)
    sup.handle(JoinHeard(host="a"), 2.0)
    closed = HostLost(host="b", reason="the peer closed the connection", link_closed=True)
    assert sup.handle(closed, 11.0) == ()  # b's loss waits until 13.0
    end = the_end(sup.handle(Woke(late=0.0), 12.0))  # a silent since 2.0
    assert end.result.reason.startswith("agent on host 'a' was lost mid-run: no heartbeat for 10s")
