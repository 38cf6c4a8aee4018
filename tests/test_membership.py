"""The join window state machine (pure; time passed in)."""

from __future__ import annotations

import pytest

from flodl_async.membership import Admitted, Failed, Formed, JoinConfig, JoinWindow, Rejected, WindowState


def window(min_rank_start: int = 2, target: int | None = 4, join_timeout: float = 10, cap: float = 30, **kw: int) -> JoinWindow:
    return JoinWindow(JoinConfig(min_rank_start=min_rank_start, join_timeout=join_timeout, target_ranks=target, max_join_timeout=cap, **kw), opened_at=100.0)


def test_ranks_are_contiguous_in_admission_order() -> None:
    w = window()
    a = w.request_join(host="a", devices=("cpu:0", "cpu:1"), now=101)
    b = w.request_join(host="b", devices=("cpu:0",), now=102)
    assert isinstance(a, Admitted)
    assert isinstance(b, Admitted)
    assert a.member.ranks == (0, 1)
    assert b.member.ranks == (2,)


def test_target_reached_forms_at_once() -> None:
    w = window(target=2)
    w.request_join(host="a", devices=("cpu:0", "cpu:1"), now=101)
    verdict = w.poll(101)
    assert isinstance(verdict, Formed)
    assert verdict.reason == "target ranks reached"
    assert verdict.world_size == 2
    assert verdict.elapsed == pytest.approx(1)


def test_quorum_inside_the_window_waits_for_its_end() -> None:
    w = window(min_rank_start=2, target=4)
    w.request_join(host="a", devices=("cpu:0", "cpu:1"), now=101)
    assert w.poll(105) is None
    assert w.next_deadline(105) == 110
    verdict = w.poll(110)
    assert isinstance(verdict, Formed)
    assert verdict.reason == "join window closed with quorum"


def test_quorum_after_the_window_forms_on_the_join() -> None:
    w = window(min_rank_start=2, target=4)
    w.request_join(host="a", devices=("cpu:0",), now=101)
    assert w.poll(110) is None
    assert w.next_deadline(111) == 130
    w.request_join(host="b", devices=("cpu:0",), now=120)
    verdict = w.poll(120)
    assert isinstance(verdict, Formed)
    assert verdict.reason == "quorum met before the max_join_timeout cap"


def test_no_quorum_by_the_cap_fails_naming_counts_and_timeouts() -> None:
    w = window(min_rank_start=3)
    w.request_join(host="a", devices=("cpu:0",), now=101)
    assert w.poll(129) is None
    verdict = w.poll(130)
    assert isinstance(verdict, Failed)
    assert verdict.reason == "quorum not met: 1/3 ranks joined (a) within the join window of 10s and the max_join_timeout hard cap of 30s"
    assert w.state is WindowState.FAILED


def test_agent_lost_before_formation_fails_at_once() -> None:
    w = window()
    w.request_join(host="a", devices=("cpu:0",), now=101)
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
    w.request_join(host="a", devices=("cpu:0",), now=101)
    result = w.request_join(host=host, devices=devices, now=102)
    assert isinstance(result, Rejected)
    assert reason in result.reason


def test_protocol_version_is_checked() -> None:
    result = window().request_join(host="a", devices=("cpu:0",), now=101, protocol_version=9)
    assert isinstance(result, Rejected)
    assert "protocol v9" in result.reason


def test_rejected_joins_are_capped() -> None:
    w = window(max_rejected_joins=3)
    for _ in range(3):
        w.request_join(host="", devices=(), now=101)
    verdict = w.poll(101)
    assert isinstance(verdict, Failed)
    assert "hammered" in verdict.reason


def test_retract_keeps_ranks_hole_free() -> None:
    w = window()
    w.request_join(host="a", devices=("cpu:0",), now=101)
    w.retract("a")
    again = w.request_join(host="b", devices=("cpu:0",), now=102)
    assert isinstance(again, Admitted)
    assert again.member.ranks == (0,)


def test_no_joins_after_formation() -> None:
    w = window(target=1, min_rank_start=1)
    w.request_join(host="a", devices=("cpu:0",), now=101)
    w.poll(101)
    late = w.request_join(host="b", devices=("cpu:0",), now=102)
    assert isinstance(late, Rejected)
    assert "formed" in late.reason


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="target_ranks"):
        JoinConfig(min_rank_start=3, join_timeout=1, target_ranks=2, max_join_timeout=2)
    with pytest.raises(ValueError, match="max_join_timeout"):
        JoinConfig(min_rank_start=1, join_timeout=5, target_ranks=None, max_join_timeout=2)
