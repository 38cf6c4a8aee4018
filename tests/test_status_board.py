"""The status model and board, pure: JSON form, cached encoding, live counters, bounded subscriptions."""

from __future__ import annotations

import asyncio
import json
import tomllib
from importlib import resources
from pathlib import Path

import pytest

from flodl_async.errors import BusyError, SubscriptionClosed
from flodl_async.status import (
    SCHEMA,
    MemberState,
    MemberStatus,
    Phase,
    RankState,
    RankStatus,
    StatusBoard,
    StatusSnapshot,
    dashboard_html,
)
from flodl_async.status.model import Counters

# The document's keys before the schema marker was added: clients read these, so they stay.
OLD_KEYS = {
    "run_id", "phase", "started_at", "updated_at", "world_size", "joined_ranks", "min_rank_start", "target_ranks",
    "restart_count", "members", "ranks", "verdict", "exit_code", "connections",
}  # fmt: skip


def _snapshot(
    phase: Phase = Phase.TRAINING, *, run_id: str = "run-1", ranks: tuple[RankStatus, ...] = ()
) -> StatusSnapshot:
    return StatusSnapshot(
        run_id=run_id, phase=phase, started_at=100.0, updated_at=101.0, world_size=2, ranks=ranks
    )


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeCounters:
    """A counters provider whose values the test sets, counting how often it is asked."""

    def __init__(self) -> None:
        self.dropped = 0
        self.calls = 0

    def __call__(self) -> Counters:
        self.calls += 1
        return {"routed": {"join": 1}, "dropped": {"unknown_magic": self.dropped}}


# ----- the model --------------------------------------------------------------------------------


def test_states_serialise_to_the_old_strings() -> None:
    ranks = tuple(
        RankStatus(rank=i, host="a", local_rank=i, state=state) for i, state in enumerate(RankState)
    )
    snapshot = StatusSnapshot(
        run_id="r",
        phase=Phase.FAILED,
        started_at=1.0,
        updated_at=2.0,
        members=(MemberStatus(host="a", ranks=(0, 1), devices=("cpu:0",), joined_at=1.5),),
        ranks=ranks,
    )
    doc = json.loads(snapshot.to_json())
    assert doc["phase"] == "failed"
    assert [r["state"] for r in doc["ranks"]] == ["running", "connected", "exited", "failed"]
    assert doc["members"] == [
        {"host": "a", "ranks": [0, 1], "devices": ["cpu:0"], "joined_at": 1.5, "state": "joined"}
    ]
    assert doc["ranks"][0] == {
        "rank": 0, "host": "a", "local_rank": 0, "state": "running", "pid": None, "exit_code": None, "signal": None,
        # the activity an agent reports, null until its first report
        "uptime_s": None, "process": None, "cpu_percent": None, "last_line": "", "output_age_s": None, "quiet_s": None, "store_connected": None,
    }  # fmt: skip
    assert {p.value for p in Phase} == {"waiting", "forming", "training", "done", "failed"}
    assert MemberState.JOINED.value == "joined"


def test_the_document_keeps_its_shape_and_carries_the_schema_marker() -> None:
    doc = json.loads(_snapshot().to_json())
    assert set(doc) == OLD_KEYS | {"schema"}
    assert doc["schema"] == SCHEMA == "flodl-status/1"
    assert doc["members"] == []
    assert doc["ranks"] == []
    assert doc["connections"] == {}


def test_the_page_loads_from_package_data_and_is_declared_for_the_wheel() -> None:
    page = dashboard_html()
    assert page == resources.files("flodl_async.status").joinpath("page.html").read_bytes()
    assert page.startswith(b"<!doctype html>")
    assert b"fetch('/state.json'" in page
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "page.html" in pyproject["tool"]["setuptools"]["package-data"]["flodl_async.status"]


# ----- the board: one encode per publish, counters at most once per interval -----------------------


def test_reads_serve_the_encoding_made_at_publish() -> None:
    board = StatusBoard()
    assert board.encoded is None
    assert board.snapshot is None
    board.publish(_snapshot())
    first = board.encoded
    assert first is not None
    assert board.encoded is first
    assert board.statistics().encodes == 1
    assert board.statistics().published == 1


def test_live_counters_are_re_encoded_at_most_once_per_interval() -> None:
    clock, counters = FakeClock(), FakeCounters()
    board = StatusBoard(counters=counters, counters_interval=0.5, clock=clock)
    board.publish(_snapshot())
    assert counters.calls == 1  # stamped into the published snapshot
    counters.dropped = 3
    for _ in range(3):  # within the interval: the bytes stand, the provider is not even asked
        clock.now += 0.125
        assert json.loads(board.encoded or b"")["connections"]["dropped"] == {"unknown_magic": 0}
    assert (board.statistics().encodes, counters.calls) == (1, 1)
    clock.now += 0.125
    assert json.loads(board.encoded or b"")["connections"]["dropped"] == {"unknown_magic": 3}
    assert board.encoded is board.encoded
    assert (board.statistics().encodes, counters.calls) == (2, 2)
    assert board.snapshot is not None
    assert board.snapshot.connections["dropped"] == {"unknown_magic": 3}


def test_unchanged_counters_are_not_re_encoded() -> None:
    clock, counters = FakeClock(), FakeCounters()
    board = StatusBoard(counters=counters, clock=clock)
    board.publish(_snapshot())
    before = board.encoded
    clock.now += 10
    assert board.encoded is before
    assert counters.calls == 2
    assert board.statistics().encodes == 1


def test_a_counter_refresh_is_not_offered_to_subscribers() -> None:
    clock, counters = FakeClock(), FakeCounters()
    board = StatusBoard(counters=counters, clock=clock)
    with board.subscribe() as sub:
        board.publish(_snapshot())
        counters.dropped = 1
        clock.now += 1
        assert board.encoded is not None
        got = sub.get_nowait()
        assert got is not None
        assert got.connections["dropped"] == {"unknown_magic": 0}  # as of the lifecycle event
        assert sub.get_nowait() is None


def test_a_full_subscription_drops_the_oldest_and_counts_it() -> None:
    board = StatusBoard()
    sub = board.subscribe(maxsize=2)
    for i in range(5):
        board.publish(_snapshot(run_id=f"run-{i}"))
    assert sub.statistics().dropped == 3
    assert sub.statistics().queued == 2
    got = [sub.get_nowait(), sub.get_nowait(), sub.get_nowait()]
    assert [s.run_id if s else None for s in got] == ["run-3", "run-4", None]
    stats = sub.statistics()
    assert (stats.delivered, stats.dropped, stats.queued, stats.maxsize, stats.closed) == (
        2,
        3,
        0,
        2,
        False,
    )


def test_a_subscription_sees_only_what_is_published_after_it() -> None:
    board = StatusBoard()
    board.publish(_snapshot(run_id="before"))
    sub = board.subscribe()
    assert sub.get_nowait() is None
    board.publish(_snapshot(run_id="after"))
    got = sub.get_nowait()
    assert got is not None
    assert got.run_id == "after"


def test_close_unsubscribes_and_discards_what_is_queued() -> None:
    board = StatusBoard()
    sub = board.subscribe()
    other = board.subscribe()
    board.publish(_snapshot())
    assert board.statistics().subscribers == 2
    sub.close()
    sub.close()  # idempotent
    assert sub.closed
    assert board.statistics().subscribers == 1
    board.publish(_snapshot())
    assert sub.statistics().queued == 0
    with pytest.raises(SubscriptionClosed, match="subscribe again"):
        sub.get_nowait()
    assert other.statistics().queued == 2


def test_leaving_with_unsubscribes() -> None:
    board = StatusBoard()
    with board.subscribe() as sub:
        assert board.statistics().subscribers == 1
    assert sub.closed
    assert board.statistics().subscribers == 0


def test_maxsize_must_hold_at_least_one_snapshot() -> None:
    with pytest.raises(ValueError, match="at least one"):
        StatusBoard().subscribe(maxsize=0)


async def test_next_waits_for_a_publish() -> None:
    board = StatusBoard()
    sub = board.subscribe()
    waiting = asyncio.create_task(sub.next())
    await asyncio.sleep(0)  # one loop turn: the task runs and parks on the empty queue
    assert not waiting.done()
    board.publish(_snapshot(run_id="woken"))
    assert (await waiting).run_id == "woken"


async def test_async_iteration_ends_on_close() -> None:
    board = StatusBoard()
    sub = board.subscribe()
    seen: list[str] = []
    first = asyncio.Event()

    async def consume() -> None:
        async for snapshot in sub:
            seen.append(snapshot.run_id)
            first.set()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(consume(), name="consumer")
        board.publish(_snapshot(run_id="a"))
        await first.wait()
        sub.close()  # wakes the parked consumer; its loop ends
    assert seen == ["a"]
    with pytest.raises(SubscriptionClosed):
        await sub.next()


async def test_async_with_unsubscribes() -> None:
    board = StatusBoard()
    async with board.subscribe(maxsize=1) as sub:
        board.publish(_snapshot(run_id="x"))
        assert (await sub.next()).run_id == "x"
    assert sub.closed


async def test_a_second_receiver_is_refused() -> None:
    board = StatusBoard()
    sub = board.subscribe()
    first = asyncio.create_task(sub.next())
    await asyncio.sleep(0)
    with pytest.raises(BusyError, match="one receiver at a time"):
        await sub.next()
    board.publish(_snapshot())
    await first


async def test_a_cancelled_wait_loses_no_snapshot() -> None:
    board = StatusBoard()
    sub = board.subscribe()
    waiting = asyncio.create_task(sub.next())
    await asyncio.sleep(0)
    board.publish(_snapshot(run_id="kept"))
    waiting.cancel()  # cancelled after the wake-up but before it ran: the snapshot stays queued
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert (await sub.next()).run_id == "kept"
