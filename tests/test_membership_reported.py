"""The join window with hosts whose capacity comes at their join (a remote `devices: all`): pure."""

from __future__ import annotations

import pytest

from flodl_async._version import __version__
from flodl_async.config.cluster import JoinKnobs
from flodl_async.control.membership import (
    Failed,
    Formed,
    JoinConfig,
    JoinWindow,
    describe_threshold,
)


def _join(window: JoinWindow, host: str, count: int, now: float) -> None:
    window.request_join(
        host=host,
        devices=tuple(f"cuda:{i}" for i in range(count)),
        now=now,
        agent_version=__version__,
        protocol_version=1,
        launch="",
    )


def test_a_defaulted_target_waits_for_the_reporting_host_and_adds_what_it_brings() -> None:
    config = JoinKnobs(join_timeout=10).resolve(1, reported_hosts=frozenset({"gpu-a"}))
    window = JoinWindow(config, opened_at=0.0)
    assert (window.quorum, window.target, window.describe_target()) == (
        None,
        None,
        "1 + what gpu-a report",
    )
    _join(window, "cpu-b", 1, now=1.0)
    assert window.poll(2.0) is None  # the known capacity is in, but gpu-a's is still unknown
    _join(window, "gpu-a", 4, now=3.0)
    verdict = window.poll(3.0)
    assert isinstance(verdict, Formed)
    assert (verdict.world_size, verdict.reason) == (5, "target ranks reached")


def test_a_reporting_host_that_never_comes_fails_the_window_at_the_cap_saying_what_was_needed() -> (
    None
):
    config = JoinKnobs(join_timeout=10, max_join_timeout=20).resolve(
        1, reported_hosts=frozenset({"gpu-a"})
    )
    window = JoinWindow(config, opened_at=0.0)
    _join(window, "cpu-b", 1, now=1.0)
    assert window.poll(15.0) is None
    verdict = window.poll(20.0)
    assert isinstance(verdict, Failed)
    assert "quorum not met: 1/1 + what gpu-a report ranks joined" in verdict.reason


def test_explicit_knobs_are_kept_and_a_reported_target_never_forms_below_the_quorum() -> None:
    explicit = JoinKnobs(min_rank_start=2, target_ranks=3).resolve(
        0, reported_hosts=frozenset({"gpu-a"})
    )
    assert (
        explicit.min_rank_start,
        explicit.target_ranks,
        explicit.quorum_reported,
        explicit.target_reported,
    ) == (2, 3, frozenset(), frozenset())
    quorum_only = JoinKnobs(min_rank_start=4, join_timeout=10).resolve(
        0, reported_hosts=frozenset({"gpu-a"})
    )
    window = JoinWindow(quorum_only, opened_at=0.0)
    _join(window, "gpu-a", 2, now=1.0)
    assert window.target == 4  # gpu-a brought 2, but the explicit quorum is 4
    assert window.poll(1.0) is None
    _join(window, "gpu-c", 2, now=2.0)
    assert isinstance(window.poll(2.0), Formed)


def test_only_a_reporting_host_gives_a_known_zero_base() -> None:
    config = JoinKnobs().resolve(0, reported_hosts=frozenset({"gpu-a"}))
    assert (config.min_rank_start, config.target_ranks) == (0, 0)
    window = JoinWindow(config, opened_at=0.0)
    _join(window, "gpu-a", 2, now=1.0)
    verdict = window.poll(1.0)
    assert isinstance(verdict, Formed)
    assert verdict.world_size == 2


def test_a_reported_quorum_is_its_base_plus_what_the_host_brought_and_a_failure_names_it() -> None:
    config = JoinConfig(
        min_rank_start=3,
        join_timeout=10,
        target_ranks=None,
        max_join_timeout=20,
        quorum_reported=frozenset({"gpu-a"}),
    )
    window = JoinWindow(config, opened_at=0.0)
    _join(window, "gpu-a", 2, now=1.0)
    assert window.quorum == 5
    verdict = window.poll(20.0)
    assert isinstance(verdict, Failed)
    assert verdict.reason.startswith("quorum not met: 2/5 ranks joined (gpu-a) within")


def test_a_reported_target_is_described_by_its_number_once_the_host_joined() -> None:
    config = JoinKnobs(join_timeout=10).resolve(1, reported_hosts=frozenset({"gpu-a"}))
    window = JoinWindow(config, opened_at=0.0)
    _join(window, "gpu-a", 4, now=1.0)
    assert window.describe_target() == "5"


@pytest.mark.parametrize(
    ("base", "reported", "words"),
    [
        (2, frozenset(), "2"),
        (0, frozenset({"gpu-b", "gpu-a"}), "what gpu-a, gpu-b report"),
        (2, frozenset({"gpu-b", "gpu-a"}), "2 + what gpu-a, gpu-b report"),
    ],
)
def test_a_threshold_in_words(base: int, reported: frozenset[str], words: str) -> None:
    assert describe_threshold(base, reported) == words
