"""Dispatch tables: the type-to-handler table the shells carry actions out with, and the
supervisor's (phase, event) table."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import pytest

from flodl_async.control.dispatch import TypeTable, members
from flodl_async.control.membership import JoinConfig
from flodl_async.control.supervision import Action, Event, Phase, SupervisorConfig
from flodl_async.control.supervisor import Supervisor
from flodl_async.control.vocab import Announce, Tell
from flodl_async.training import coordination


@dataclass(frozen=True)
class _Ping:
    n: int


@dataclass(frozen=True)
class _Pong:
    n: int


@dataclass(frozen=True)
class _LoudPing(_Ping):
    pass


def _table() -> TypeTable[_Ping | _Pong, [int], str]:
    table: TypeTable[_Ping | _Pong, [int], str] = TypeTable("the test's messages")
    table.add(_Ping, lambda item, k: f"ping {item.n * k}")
    table.add(_Pong, lambda item, k: f"pong {item.n + k}")
    return table


def test_an_item_goes_to_the_handler_of_its_own_type_with_the_arguments() -> None:
    table = _table()
    assert table(_Ping(2), 3) == "ping 6"
    assert table(_Pong(2), 3) == "pong 5"
    assert table.kinds == {_Ping, _Pong}


def test_a_type_with_no_handler_is_a_clear_error_not_a_silent_skip() -> None:
    # exact type, not isinstance: a subclass is a type of its own and needs its own entry
    with pytest.raises(TypeError, match=r"the test's messages: no handler for _LoudPing"):
        _table()(_LoudPing(1), 1)


def test_a_type_filed_twice_is_refused() -> None:
    table = _table()
    with pytest.raises(ValueError, match="_Ping already has a handler"):
        table.add(_Ping, lambda item, k: "again")


def test_require_names_what_is_missing_and_what_is_outside_the_union() -> None:
    table = _table()
    table.require(_Ping | _Pong)
    with pytest.raises(TypeError, match=r"no handler for \['_LoudPing'\]"):
        table.require(_Ping | _Pong | _LoudPing)
    with pytest.raises(TypeError, match=r"outside the union: \['_Pong'\]"):
        table.require(_Ping)


def test_members_reads_a_union_with_generic_classes_as_their_classes() -> None:
    assert members(Announce | Tell[str]) == {Announce, Tell}
    assert members(_Ping) == {_Ping}
    assert members(list[int] | None) == {list, type(None)}
    with pytest.raises(TypeError, match="not a class"):
        members(Literal["a"] | int)


def test_both_shells_unions_are_frozen_dataclasses_a_table_can_key_on() -> None:
    # the shells' tables call require(Action) when built, so a new action type fails the shell at
    # once; what the union may hold is a concrete, immutable record (a table keys on its class)
    for union in (Action, coordination.Action):
        kinds = members(union)
        assert kinds
        for kind in kinds:
            assert dataclasses.is_dataclass(kind), kind
            assert kind.__dataclass_params__.frozen, kind  # type: ignore[attr-defined]


def _supervisor() -> Supervisor:
    join = JoinConfig(min_rank_start=1, join_timeout=10.0, target_ranks=2, max_join_timeout=30.0)
    return Supervisor(SupervisorConfig(run_id="r", join=join, command=("true",)), now=0.0)


def test_the_supervisor_files_every_event_in_every_phase_once() -> None:
    pairs = _supervisor()._transitions.pairs
    assert pairs == {(p, e) for p in members(Phase) for e in members(Event)}


def test_the_supervisor_names_an_event_it_has_no_entry_for() -> None:
    with pytest.raises(TypeError, match="the supervisor takes no _Ping in Forming"):
        _supervisor().handle(_Ping(1), 0.0)  # type: ignore[arg-type]
