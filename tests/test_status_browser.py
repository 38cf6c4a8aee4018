"""The status page in a real headless Chromium: its script reads /state.json and /events and shows the run."""

from __future__ import annotations

import asyncio
import dataclasses
import html
import json
import time
from pathlib import Path

import pytest

from flodl_async.cli.statusclient import training_line
from flodl_async.net.http import StatusHttpProtocol
from flodl_async.net.mux import PortMux
from flodl_async.status import (
    MemberStatus,
    Phase,
    RankState,
    RankStatus,
    StatusBoard,
    StatusSnapshot,
)
from flodl_async.status.events import RoundDone
from flodl_async.wire import Channel

from .browserkit import CHROMIUM, Chromium
from .coordkit import training_block_after_a_kill

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (CI installs Debian's chromium)"
)


def _load(url: str, profile: Path, screenshot: Path | None = None) -> str:
    """The page's DOM once its script rendered a snapshot (and, if asked, a screenshot of it)."""
    with Chromium(profile) as browser:
        browser.navigate(url)
        browser.wait_for("document.getElementById('run').textContent !== ''")
        if screenshot is not None:
            browser.screenshot(screenshot)
        return browser.dom()


async def _render(url: str, profile: Path, screenshot: Path | None = None) -> str:
    return await asyncio.to_thread(_load, url, profile, screenshot)


async def test_status_page_shows_the_trainers_world_and_its_lost_ranks(tmp_path: Path) -> None:
    # markup in a reason is text on the page, never an element
    training = training_block_after_a_kill(reason="its process was <b>killed</b>")
    board = StatusBoard()
    now = time.time()
    board.publish(
        StatusSnapshot(
            run_id="run-elastic",
            phase=Phase.TRAINING,
            started_at=now,
            updated_at=now,
            world_size=3,
            joined_ranks=3,
            training=training,
        )
    )
    mux = PortMux(host="127.0.0.1", port=0)
    mux.register(Channel.STATUS, lambda: StatusHttpProtocol(board))
    await mux.start()
    try:
        dom = await _render(f"http://127.0.0.1:{mux.port}/", tmp_path / "profile")
    finally:
        await mux.aclose()
    # above the tables, the same line as `flodl status` prints
    said = training_line(json.loads(json.dumps(training)))
    assert said.endswith(
        "2 of 3 ranks alive — lost: rank 2 on host h0: its process was <b>killed</b> at epoch 2"
    )
    line = f'<p id="training">training: {html.escape(said, quote=False)}</p>'
    assert line in dom
    assert dom.index(line) < dom.index('<tbody id="members">')
    assert "<b>killed" not in dom


async def test_status_page_shows_phase_members_and_verdict(tmp_path: Path) -> None:
    board = StatusBoard()
    now = time.time()
    board.publish(
        StatusSnapshot(
            run_id="run-browser",
            phase=Phase.FAILED,
            started_at=now,
            updated_at=now,
            world_size=2,
            joined_ranks=2,
            members=(
                MemberStatus(
                    host="node-a", ranks=(0, 1), devices=("cpu:0", "cpu:1"), joined_at=now
                ),
            ),
            ranks=(
                RankStatus(rank=0, host="node-a", local_rank=0, state=RankState.RUNNING, pid=4242),
                RankStatus(
                    rank=1, host="node-a", local_rank=1, state=RankState.FAILED, exit_code=3
                ),
            ),
            verdict="rank 1 exited with code 3",
        )
    )
    mux = PortMux(host="127.0.0.1", port=0)
    mux.register(Channel.STATUS, lambda: StatusHttpProtocol(board))
    await mux.start()
    try:
        dom = await _render(f"http://127.0.0.1:{mux.port}/", tmp_path / "profile")
        await _render(
            f"http://127.0.0.1:{mux.port}/",
            tmp_path / "profile2",
            screenshot=tmp_path / "status.png",
        )
    finally:
        await mux.aclose()
    assert '<b id="phase">failed</b>' in dom
    assert '<span id="run">run-browser</span>' in dom
    assert "<td>node-a</td><td>0,1</td><td>cpu:0,cpu:1</td><td>joined</td>" in dom
    assert "rank 1 exited with code 3" in dom
    assert "2 joined / 2 in world" in dom
    assert "<td>0</td><td>node-a</td><td>0</td><td>4242</td><td>running</td><td>-</td>" in dom
    assert "<td>1</td><td>node-a</td><td>1</td><td>-</td><td>failed</td><td>3</td>" in dom
    assert (tmp_path / "status.png").stat().st_size > 1000
    assert '<p id="training"></p>' in dom  # a run without Trainer ranks: no training line


def _marks(url: str, profile: Path) -> list[str]:
    with Chromium(profile) as browser:
        browser.navigate(url)
        browser.wait_for("document.querySelectorAll('#timeline .mark').length === 2")
        return [
            str(t)
            for t in browser.evaluate(
                "[...document.querySelectorAll('#timeline .mark')].map(m => m.className + ': ' + m.title)"
            )
        ]  # type: ignore[union-attr]


async def test_a_death_and_its_recovery_are_marks_on_the_timeline(tmp_path: Path) -> None:
    board = StatusBoard()
    now = time.time()
    ranks = (RankStatus(rank=1, host="node-b", local_rank=0, state=RankState.RUNNING),)
    alive = StatusSnapshot(
        run_id="run-marks",
        phase=Phase.TRAINING,
        started_at=now - 10,
        updated_at=now - 5,
        ranks=ranks,
    )
    board.publish(alive)
    lost = {
        "epoch": 1,
        "epochs": 3,
        "policy": "cadence",
        "backend": "cpu",
        "lost": [{"rank": 1, "host": "node-b", "reason": "killed"}],
    }
    board.publish(dataclasses.replace(alive, updated_at=now - 4, training=lost))
    board.emit(
        RoundDone(round=5, round_kind="average", reduce_s=0.01, batches=2, loss=0.3), at=now - 1
    )
    mux = PortMux(host="127.0.0.1", port=0)
    mux.register(Channel.STATUS, lambda: StatusHttpProtocol(board))
    await mux.start()
    try:
        marks = await asyncio.to_thread(
            _marks, f"http://127.0.0.1:{mux.port}/", tmp_path / "profile"
        )
    finally:
        await mux.aclose()
    assert marks == [
        "mark m-rank_died: rank 1 on node-b died: killed",
        "mark m-rank_recovered: rank 1 recovered by regroup after 3 s",
    ]
