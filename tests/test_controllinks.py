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
