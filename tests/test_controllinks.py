"""The controller's control links per host and the relays' link liveness (pure)."""

from __future__ import annotations

from flodl_async.control.links import ControlLinks
from flodl_async.control.liveness import Liveness


def _links() -> ControlLinks:
    return ControlLinks(interval=1.0, silence=5.0)


def test_a_lost_host_gives_up_its_links_and_only_its_own() -> None:
    links = _links()
    links.bind("a1", "a")
    links.bind("a2", "a")
    links.bind("b1", "b")
    assert links.drop("a") == {"a1", "a2"}
    assert links.drop("a") == set()  # once
    assert links.drop("b") == {"b1"}


def test_a_relay_silent_past_the_deadline_loses_its_host_once() -> None:
    links = _links()
    links.bind("a1", "a")
    links.heard("a1", "a", now=0.0)
    joined = {
        "a": Liveness.start(0.0, interval=1.0, silence=5.0).heard(5.5)
    }  # its join link is fine
    assert links.silent_hosts(4.9, joined) == []
    assert links.next_deadline() == 5.0
    assert links.silent_hosts(5.5, joined) == ["a"]
    assert links.silent_hosts(6.0, joined) == []  # reported once
    assert links.next_deadline() is None


def test_a_host_silent_on_both_links_is_left_to_its_join_link() -> None:
    links = _links()
    links.bind("a1", "a")
    links.heard("a1", "a", now=0.0)
    joined = {
        "a": Liveness.start(0.0, interval=1.0, silence=5.0).heard(0.5)
    }  # frozen too, heard a little later
    assert links.silent_hosts(5.2, joined) == []  # the join link names it, at 5.5
    assert links.next_deadline() == 5.5  # and this link waits no longer than that: no busy wake-up
    assert links.drop("a") == {"a1"}  # the join link's loss drops it
    assert links.silent_hosts(6.0, joined) == []


def test_beats_keep_a_relay_live_and_a_frozen_controller_excuses_it() -> None:
    links = _links()
    links.heard("a1", "a", now=0.0)
    links.heard("a1", "a", now=4.0)
    assert links.silent_hosts(8.0, {}) == []
    links.excused(20.0)  # we were frozen from 8 to 20
    assert links.silent_hosts(20.5, {}) == []
    links.closed("a1", "a")
    assert links.next_deadline() is None


def test_a_beat_read_late_never_moves_the_deadline_back() -> None:
    links = _links()
    links.heard("a1", "a", now=4.0)
    links.heard("a1", "a", now=3.0)  # a clock read before the last beat's
    assert links.next_deadline() == 9.0
    assert links.silent_hosts(8.5, {}) == []


def test_a_dropped_hosts_relay_link_is_not_watched_any_more() -> None:
    links = _links()
    links.bind("a1", "a")
    links.heard("a1", "a", now=0.0)
    assert links.drop("a") == {"a1"}
    assert links.next_deadline() is None
    assert links.silent_hosts(10.0, {}) == []  # lost already: not a second time


def test_every_silent_relay_is_found_whatever_the_links_before_it() -> None:
    links = _links()
    links.heard("a1", "a", now=0.0)  # a: still beating
    links.heard("c1", "c", now=0.0)  # c: silent on its join link too, left to it
    links.heard("b1", "b", now=0.0)  # b: silent on its relay link alone
    links.heard("a1", "a", now=4.0)
    joined = {"c": Liveness.start(0.0, interval=1.0, silence=5.0)}
    assert links.silent_hosts(5.5, joined) == ["b"]


def test_a_join_link_silent_for_no_more_than_one_beat_leaves_the_loss_to_the_relay() -> None:
    links = _links()
    links.heard("a1", "a", now=0.0)
    joined = {"a": Liveness.start(0.0, interval=1.0, silence=5.0).heard(4.0)}
    assert links.silent_hosts(5.0, joined) == ["a"]  # the join link was heard a beat ago
