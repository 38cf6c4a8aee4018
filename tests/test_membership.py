"""The join window state machine (pure; time passed in)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flodl_async._version import __version__
from flodl_async.control.membership import (
    MAX_RANKS_PER_JOIN,
    MAX_REJECTED_JOINS,
    Admitted,
    Failed,
    Formed,
    JoinConfig,
    JoinWindow,
    NodeTerms,
    Rejected,
    WindowState,
)
from flodl_async.host.hostnames import HostAliases

OPENED_AT = 100.0
PROTOCOL = 1


def window(
    min_rank_start: int = 2,
    target: int | None = 4,
    join_timeout: float = 10,
    cap: float = 30,
    max_rejected_joins: int = MAX_REJECTED_JOINS,
    host_aliases: HostAliases | None = None,
) -> JoinWindow:
    """Opened at t=100: the join window ends at 110, the hard cap at 130."""
    config = JoinConfig(
        min_rank_start=min_rank_start,
        join_timeout=join_timeout,
        target_ranks=target,
        max_join_timeout=cap,
        max_rejected_joins=max_rejected_joins,
    )
    return JoinWindow(
        config, opened_at=OPENED_AT, protocol_version=PROTOCOL, host_aliases=host_aliases
    )


def join(
    w: JoinWindow,
    host: str,
    devices: tuple[str, ...] = ("cpu:0",),
    now: float = 101,
    *,
    agent_version: str = __version__,
    protocol_version: int = PROTOCOL,
    launch: str = "",
) -> Admitted | Rejected:
    """A join from an agent of this very flodl_async unless told otherwise."""
    return w.request_join(
        host=host,
        devices=devices,
        now=now,
        agent_version=agent_version,
        protocol_version=protocol_version,
        launch=launch,
    )


def test_ranks_are_contiguous_in_admission_order() -> None:
    w = window()
    a = join(w, "a", ("cpu:0", "cpu:1"))
    b = join(w, "b", now=102)
    assert isinstance(a, Admitted)
    assert isinstance(b, Admitted)
    assert a.member.ranks == (0, 1)
    assert b.member.ranks == (2,)


def test_target_reached_forms_at_once() -> None:
    w = window(target=2)
    join(w, "a", ("cpu:0", "cpu:1"))
    verdict = w.poll(101)
    assert isinstance(verdict, Formed)
    assert verdict.reason == "target ranks reached"
    assert verdict.world_size == 2
    assert verdict.elapsed == pytest.approx(1)


def test_quorum_inside_the_window_waits_for_its_end() -> None:
    w = window(min_rank_start=2, target=4)
    join(w, "a", ("cpu:0", "cpu:1"))
    assert w.poll(105) is None
    assert w.next_deadline(105) == 110
    verdict = w.poll(110)
    assert isinstance(verdict, Formed)
    assert verdict.reason == "join window closed with quorum"


def test_quorum_after_the_window_forms_on_the_join() -> None:
    w = window(min_rank_start=2, target=4)
    join(w, "a")
    assert w.poll(110) is None
    assert w.next_deadline(111) == 130
    join(w, "b", now=120)
    verdict = w.poll(120)
    assert isinstance(verdict, Formed)
    assert verdict.reason == "quorum met before the max_join_timeout cap"


def test_no_quorum_by_the_cap_fails_naming_counts_and_timeouts() -> None:
    w = window(min_rank_start=3)
    join(w, "a")
    assert w.poll(129) is None
    verdict = w.poll(130)
    assert isinstance(verdict, Failed)
    assert (
        verdict.reason
        == "quorum not met: 1/3 ranks joined (a) within the join window of 10s and the max_join_timeout hard cap of 30s"
    )
    assert w.state is WindowState.FAILED


def test_agent_lost_before_formation_fails_at_once() -> None:
    w = window()
    join(w, "a")
    verdict = w.member_lost("a", now=103)
    assert isinstance(verdict, Failed)
    assert "agent on host 'a' went away before the world formed" in verdict.reason


@pytest.mark.parametrize(
    ("host", "devices", "reason"),
    [
        ("", ("cpu:0",), "empty host name"),
        ("b", (), "offers no devices"),
        ("b", ("cuda:0", "cuda:0"), "duplicate local device cuda:0"),
        ("a", ("cpu:0",), "already joined this run"),
        ("b", tuple(f"cpu:{i}" for i in range(257)), "at most 256 ranks per host"),
    ],
)
def test_admission_checks(host: str, devices: tuple[str, ...], reason: str) -> None:
    w = window()
    join(w, "a")
    result = join(w, host, devices, now=102)
    assert isinstance(result, Rejected)
    assert reason in result.reason


def test_a_duplicate_device_and_a_duplicate_join_say_what_to_fix() -> None:
    w = window()
    join(w, "a")
    assert join(w, "b", ("cuda:0", "cuda:0")) == Rejected(
        reason="duplicate local device cuda:0 on host 'b' — each rank must pin a distinct device"
    )
    assert join(w, "a") == Rejected(
        reason="host 'a' already joined this run (duplicate join — a stale agent from a previous "
        "launch, or two agents sharing one host name)"
    )


def test_protocol_version_is_checked() -> None:
    result = join(window(), "a", protocol_version=9)
    assert isinstance(result, Rejected)
    assert "protocol v9" in result.reason


def test_rejected_joins_are_capped() -> None:
    w = window(max_rejected_joins=3)
    for _ in range(3):
        join(w, "", ())
    verdict = w.poll(101)
    assert isinstance(verdict, Failed)
    assert "hammered" in verdict.reason


def test_retract_keeps_ranks_hole_free() -> None:
    w = window()
    join(w, "a")
    w.retract("a")
    again = join(w, "b", now=102)
    assert isinstance(again, Admitted)
    assert again.member.ranks == (0,)


def test_no_joins_after_formation() -> None:
    w = window(target=1, min_rank_start=1)
    join(w, "a")
    w.poll(101)
    late = join(w, "b", now=102)
    assert isinstance(late, Rejected)
    assert "formed" in late.reason


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="target_ranks"):
        JoinConfig(min_rank_start=3, join_timeout=1, target_ranks=2, max_join_timeout=2)
    with pytest.raises(ValueError, match="max_join_timeout"):
        JoinConfig(min_rank_start=1, join_timeout=5, target_ranks=None, max_join_timeout=2)


# ----- versions: every host runs the controller's flodl_async and protocol ------------------------


def test_the_constructor_defaults_to_this_packages_version() -> None:
    w = JoinWindow(
        JoinConfig(min_rank_start=1, join_timeout=1, target_ranks=None, max_join_timeout=1),
        opened_at=0,
    )
    assert isinstance(join(w, "a", agent_version=__version__), Admitted)
    assert isinstance(join(w, "b", agent_version=__version__ + ".post1"), Rejected)


def test_another_flodl_version_is_refused_naming_both_versions_and_the_host() -> None:
    w = JoinWindow(
        JoinConfig(min_rank_start=1, join_timeout=1, target_ranks=None, max_join_timeout=1),
        opened_at=0,
        controller_version="0.2.0",
    )
    result = join(w, "gpu7", agent_version="0.1.9")
    assert result == Rejected(
        reason="host 'gpu7' runs flodl_async '0.1.9', this controller 0.2.0; install the same flodl_async version on every host"
    )
    assert w.members == ()
    assert w.rejected_joins == 1


def test_another_protocol_version_is_refused_naming_both_versions_and_the_host() -> None:
    config = JoinConfig(min_rank_start=1, join_timeout=1, target_ranks=None, max_join_timeout=1)
    w = JoinWindow(config, opened_at=0, protocol_version=2, controller_version="0.2.0")
    result = join(w, "gpu7", agent_version="0.1.9", protocol_version=1)
    assert result == Rejected(
        reason="host 'gpu7' speaks protocol v1 (flodl_async '0.1.9'), this controller v2 (flodl_async 0.2.0); "
        "install the same flodl_async version on every host"
    )


def test_the_same_flodl_version_with_another_protocol_is_still_refused() -> None:
    result = join(window(), "a", protocol_version=PROTOCOL + 1)
    assert isinstance(result, Rejected)
    assert "speaks protocol v2" in result.reason


def test_an_agent_too_old_to_report_its_version_is_refused() -> None:
    w = JoinWindow(
        JoinConfig(min_rank_start=1, join_timeout=1, target_ranks=None, max_join_timeout=1),
        opened_at=0,
        controller_version="0.2.0",
    )
    result = join(w, "old", agent_version="")
    assert result == Rejected(
        reason="host 'old' did not report its flodl_async version (an agent too old to send it), this controller runs 0.2.0; "
        "install the same flodl_async version on every host"
    )


def test_an_untrusted_version_string_is_quoted_not_pasted() -> None:
    result = join(window(), "a", agent_version="1.0\nadmitted")
    assert isinstance(result, Rejected)
    assert "\n" not in result.reason
    assert "'1.0\\nadmitted'" in result.reason


def test_membership_imports_neither_asyncio_nor_socket() -> None:
    code = "import sys, flodl_async.control.membership; print('mutmut' in sys.modules, sorted({'asyncio', 'socket'} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    if result.stdout.startswith("True"):
        pytest.skip(
            "under mutmut the mutated module imports mutmut's trampoline, which brings socket along"
        )
    assert result.stdout.strip() == "False []"


# ----- admission: exact reasons and boundaries ------------------------------------------------------


def test_an_empty_host_is_refused_before_anything_else_is_looked_at() -> None:
    assert join(window(), "", (), agent_version="") == Rejected(reason="empty host name")


def test_an_admitted_member_records_what_it_brought() -> None:
    w = window()
    result = join(w, "a", ("cuda:1", "cuda:0"), now=104.5)
    assert result == Admitted(member=w.members[0])
    assert w.members[0].devices == ("cuda:1", "cuda:0")
    assert w.members[0].joined_at == 104.5
    assert w.joined_ranks == 2


def test_exactly_the_per_host_rank_limit_is_admitted() -> None:
    w = window(target=None)
    result = join(w, "big", tuple(f"cpu:{i}" for i in range(MAX_RANKS_PER_JOIN)))
    assert isinstance(result, Admitted)
    assert result.member.ranks == tuple(range(MAX_RANKS_PER_JOIN))


def test_one_rejection_leaves_the_window_open_and_is_counted() -> None:
    w = window()
    assert w.rejected_joins == 0
    assert isinstance(join(w, ""), Rejected)
    assert w.rejected_joins == 1
    assert w.state is WindowState.OPEN
    assert w.poll(101) is None


def test_the_rejection_cap_fails_on_exactly_the_capth_rejection() -> None:
    w = window(max_rejected_joins=3)
    join(w, "")
    join(w, "")
    assert w.state is WindowState.OPEN
    join(w, "")
    assert w.poll(101) == Failed(
        reason="3 joins were rejected — the join port is being hammered by something that is not a flodl agent of this run"
    )


def test_rejections_after_formation_leave_the_verdict_alone() -> None:
    w = window(min_rank_start=1, target=1, max_rejected_joins=1)
    join(w, "a")
    formed = w.poll(101)
    assert isinstance(formed, Formed)
    assert join(w, "b") == Rejected(
        reason="the join window is formed; this run takes no more hosts"
    )
    assert w.state is WindowState.FORMED
    assert w.poll(102) is formed


# ----- retract: only the last admission, only while open ---------------------------------------------


def test_retract_on_an_empty_window_does_nothing() -> None:
    w = window()
    w.retract("a")
    assert w.members == ()
    assert w.joined_ranks == 0


def test_retract_of_another_host_than_the_last_does_nothing() -> None:
    w = window()
    join(w, "a")
    join(w, "b", ("cpu:0", "cpu:1"), now=102)
    w.retract("a")
    w.retract("nobody")
    assert [m.host for m in w.members] == ["a", "b"]
    assert w.joined_ranks == 3


def test_retract_frees_the_host_name_and_the_ranks() -> None:
    w = window()
    join(w, "a")
    join(w, "b", ("cpu:0", "cpu:1"), now=102)
    w.retract("b")
    assert w.joined_ranks == 1
    again = join(w, "b", now=103)
    assert isinstance(again, Admitted)
    assert again.member.ranks == (1,)


def test_retract_after_formation_does_nothing() -> None:
    w = window(min_rank_start=1, target=1)
    join(w, "a")
    formed = w.poll(101)
    w.retract("a")
    assert w.poll(102) is formed
    assert w.joined_ranks == 1
    assert [m.host for m in w.members] == ["a"]


# ----- member_lost and abort -------------------------------------------------------------------------


def test_member_lost_names_the_host_and_the_time_into_the_window() -> None:
    w = window()
    join(w, "a")
    verdict = w.member_lost("a", now=103.4)
    assert verdict == Failed(
        reason="agent on host 'a' went away before the world formed (3.4s into the window)"
    )
    assert w.state is WindowState.FAILED


def test_member_lost_says_why_when_it_is_known() -> None:
    w = window()
    join(w, "a")
    verdict = w.member_lost("a", now=103.4, reason="runtime directory /x: is too deep")
    assert verdict == Failed(
        reason="agent on host 'a' went away before the world formed (3.4s into the window): "
        "runtime directory /x: is too deep"
    )


def test_losing_a_host_that_never_joined_keeps_the_window_open() -> None:
    w = window()
    join(w, "a")
    assert w.member_lost("stranger", now=102) is None
    assert w.state is WindowState.OPEN


def test_losing_a_member_after_formation_keeps_the_world() -> None:
    w = window(min_rank_start=1, target=1)
    join(w, "a")
    formed = w.poll(101)
    assert w.member_lost("a", now=102) is formed
    assert w.state is WindowState.FORMED


def test_abort_fails_an_open_window_with_the_callers_reason() -> None:
    w = window()
    assert w.abort("interrupted") == Failed(reason="interrupted")
    assert w.state is WindowState.FAILED
    assert w.next_deadline(101) is None
    assert w.abort("again") == Failed(reason="interrupted")


def test_abort_after_formation_keeps_the_world() -> None:
    w = window(min_rank_start=1, target=1)
    join(w, "a")
    formed = w.poll(101)
    assert w.abort("too late") is formed
    assert w.state is WindowState.FORMED


# ----- poll and next_deadline at their exact boundaries ----------------------------------------------


def test_formed_verdict_carries_members_size_and_elapsed() -> None:
    w = window(min_rank_start=2, target=4)
    join(w, "a", now=101)
    join(w, "b", ("cpu:0", "cpu:1"), now=104)
    verdict = w.poll(110)
    assert verdict == Formed(
        members=w.members, world_size=3, reason="join window closed with quorum", elapsed=10
    )
    assert w.poll(111) is verdict


def test_the_quorum_counts_ranks_across_hosts() -> None:
    w = window(min_rank_start=2, target=4)
    join(w, "a", now=101)
    join(w, "b", now=105)
    verdict = w.poll(110)
    assert isinstance(verdict, Formed)
    assert verdict.reason == "join window closed with quorum"


def test_a_join_exactly_at_the_window_end_still_counts_as_inside_it() -> None:
    w = window(min_rank_start=2, target=4)
    join(w, "a", now=101)
    join(w, "b", now=110)
    verdict = w.poll(110)
    assert isinstance(verdict, Formed)
    assert verdict.reason == "join window closed with quorum"


def test_a_quorum_after_the_window_forms_with_its_elapsed_time() -> None:
    w = window(min_rank_start=2, target=4)
    join(w, "a", now=101)
    join(w, "b", now=110.5)
    verdict = w.poll(112)
    assert isinstance(verdict, Formed)
    assert verdict.reason == "quorum met before the max_join_timeout cap"
    assert verdict.elapsed == 12


def test_poll_just_before_the_window_end_stays_open_with_a_quorum() -> None:
    w = window(min_rank_start=1, target=4)
    join(w, "a")
    assert w.poll(109.999) is None
    assert isinstance(w.poll(110), Formed)


def test_next_deadline_is_the_window_end_before_it_and_the_cap_from_it_on() -> None:
    w = window(min_rank_start=3)
    assert w.next_deadline(100) == 110
    assert w.next_deadline(109.999) == 110
    assert w.poll(110) is None
    assert w.next_deadline(110) == 130
    assert w.next_deadline(129) == 130


def test_the_failure_names_every_joined_host() -> None:
    w = window(min_rank_start=4, target=None)
    join(w, "a")
    join(w, "b", now=102)
    verdict = w.poll(130)
    assert isinstance(verdict, Failed)
    assert verdict.reason.startswith("quorum not met: 2/4 ranks joined (a, b) within")


def test_the_failure_says_when_no_host_joined() -> None:
    verdict = window().poll(130)
    assert isinstance(verdict, Failed)
    assert verdict.reason.startswith("quorum not met: 0/2 ranks joined (no host) within")


# ----- config ---------------------------------------------------------------------------------------


def test_config_messages_are_exact() -> None:
    with pytest.raises(ValueError, match=r"^min_rank_start must be at least 1$"):
        JoinConfig(min_rank_start=0, join_timeout=1, target_ranks=None, max_join_timeout=2)
    with pytest.raises(ValueError, match=r"^target_ranks must be at least min_rank_start$"):
        JoinConfig(min_rank_start=3, join_timeout=1, target_ranks=2, max_join_timeout=2)
    with pytest.raises(ValueError, match=r"^max_join_timeout must be at least join_timeout$"):
        JoinConfig(min_rank_start=1, join_timeout=5, target_ranks=None, max_join_timeout=4.9)


def test_config_accepts_its_boundaries() -> None:
    config = JoinConfig(min_rank_start=1, join_timeout=5, target_ranks=1, max_join_timeout=5)
    assert (config.min_rank_start, config.target_ranks, config.max_join_timeout) == (1, 1, 5)


# ----- one machine is one host ---------------------------------------------------------------------

VM = HostAliases.of_machine("vm", "vm.example.com")


@pytest.mark.parametrize("first", ["localhost", "vm", "127.0.0.1"])
@pytest.mark.parametrize(
    "second",
    [
        "localhost",
        "LocalHost",
        "vm",
        "VM",
        "vm.",
        "vm.example.com",
        "VM.Example.COM.",
        "127.0.0.1",
        "127.0.0.2",
        "::1",
        "[::1]",
        "::ffff:127.0.0.1",
    ],
)
def test_a_second_spelling_of_the_controllers_machine_is_a_duplicate_naming_both(
    first: str, second: str
) -> None:
    w = window(host_aliases=VM)
    assert isinstance(join(w, first), Admitted)
    result = join(w, second, now=102)
    assert isinstance(result, Rejected)
    if second == first:
        assert result.reason.startswith(f"host {first!r} already joined this run (duplicate join")
    else:
        assert result.reason == (
            f"host {second!r} is the machine that already joined this run as {first!r} ({second!r} and {first!r} both name this machine) "
            "— give a second agent on it a name of its own with --host, or stop the other one"
        )
    assert [m.host for m in w.members] == [first]  # the spelling it joined under stays its name
    assert w.rejected_joins == 1


def test_explicit_names_on_the_controllers_machine_are_distinct_hosts() -> None:
    w = window(host_aliases=VM)
    for i, host in enumerate(["vm", "alpha", "beta", "vm-2", "vm.other.example", "10.0.0.5"]):
        assert isinstance(join(w, host, now=101 + i), Admitted), host
    assert isinstance(
        join(w, "Alpha", now=110), Admitted
    )  # case only matters for this machine's own spellings


def test_a_later_alias_is_compared_with_every_admitted_host_not_only_the_last() -> None:
    w = window(target=None, host_aliases=VM)
    join(w, "alpha")
    join(w, "::1", now=102)
    join(w, "beta", now=103)
    result = join(w, "vm.example.com", now=104)
    assert isinstance(result, Rejected)
    assert "already joined this run as '::1'" in result.reason


def test_without_aliases_names_are_compared_as_given() -> None:
    w = window()
    assert isinstance(join(w, "localhost"), Admitted)
    assert isinstance(join(w, "vm", now=102), Admitted)
    assert isinstance(join(w, "127.0.0.1", now=103), Admitted)


def test_every_node_run_refuses_a_node_started_otherwise_by_name() -> None:
    # flodl-launch --nnodes: the controller node's command digest and ranks per node are the terms
    terms = NodeTerms(ranks_per_node=2, launch="abc")
    config = JoinConfig(
        min_rank_start=4, join_timeout=10, target_ranks=4, max_join_timeout=30, node_terms=terms
    )
    w = JoinWindow(config, opened_at=OPENED_AT, protocol_version=PROTOCOL)
    other = join(w, "box#1", ("cpu:0", "cpu:1"), launch="xyz")
    assert isinstance(other, Rejected)
    assert "'box#1'" in other.reason
    assert "another command" in other.reason
    fewer = join(w, "box#2", ("cpu:0",), launch="abc")
    assert isinstance(fewer, Rejected)
    assert "brings 1 rank(s), every node of this run 2" in fewer.reason
    assert "--nproc-per-node" in fewer.reason
    walk_in = join(w, "stray", ("cpu:0", "cpu:1"))
    assert isinstance(walk_in, Rejected)
    assert "--nnodes" in walk_in.reason
    version = join(w, "box#3", ("cpu:0", "cpu:1"), launch="abc", agent_version="0.0.1")
    assert isinstance(version, Rejected)
    assert "'box#3' runs flodl_async '0.0.1'" in version.reason
    assert isinstance(join(w, "box#1", ("cpu:0", "cpu:1"), launch="abc"), Admitted)
