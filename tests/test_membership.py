"""The join window state machine (pure; time passed in)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flodl_async import __version__
from flodl_async.membership import MAX_REJECTED_JOINS, Admitted, Failed, Formed, JoinConfig, JoinWindow, Rejected, WindowState

OPENED_AT = 100.0
PROTOCOL = 1


def window(
    min_rank_start: int = 2, target: int | None = 4, join_timeout: float = 10, cap: float = 30, max_rejected_joins: int = MAX_REJECTED_JOINS
) -> JoinWindow:
    """Opened at t=100: the join window ends at 110, the hard cap at 130."""
    config = JoinConfig(
        min_rank_start=min_rank_start, join_timeout=join_timeout, target_ranks=target, max_join_timeout=cap, max_rejected_joins=max_rejected_joins
    )
    return JoinWindow(config, opened_at=OPENED_AT, protocol_version=PROTOCOL)


def join(
    w: JoinWindow, host: str, devices: tuple[str, ...] = ("cpu:0",), now: float = 101, *, agent_version: str = __version__, protocol_version: int = PROTOCOL
) -> Admitted | Rejected:
    """A join from an agent of this very flodl_async unless told otherwise."""
    return w.request_join(host=host, devices=devices, now=now, agent_version=agent_version, protocol_version=protocol_version)


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
    assert verdict.reason == "quorum not met: 1/3 ranks joined (a) within the join window of 10s and the max_join_timeout hard cap of 30s"
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
    w = JoinWindow(JoinConfig(min_rank_start=1, join_timeout=1, target_ranks=None, max_join_timeout=1), opened_at=0)
    assert isinstance(join(w, "a", agent_version=__version__), Admitted)
    assert isinstance(join(w, "b", agent_version=__version__ + ".post1"), Rejected)


def test_another_flodl_version_is_refused_naming_both_versions_and_the_host() -> None:
    w = JoinWindow(JoinConfig(min_rank_start=1, join_timeout=1, target_ranks=None, max_join_timeout=1), opened_at=0, controller_version="0.2.0")
    result = join(w, "gpu7", agent_version="0.1.9")
    assert result == Rejected(reason="host 'gpu7' runs flodl_async '0.1.9', this controller 0.2.0; install the same flodl_async version on every host")
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
    w = JoinWindow(JoinConfig(min_rank_start=1, join_timeout=1, target_ranks=None, max_join_timeout=1), opened_at=0, controller_version="0.2.0")
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
    code = "import sys, flodl_async.membership; print(sorted({'asyncio', 'socket'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "[]"
