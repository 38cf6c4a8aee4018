"""A stand-alone flodl-agent evicted by the controller's per-address cap before its handshake
finished: it says so and dials again within ``--connect-timeout``, then joins.

The controller is the real one, in this process, with a low per-address cap on unproven
connections; the agent is a real ``flodl-agent`` process; the flood is real idle connections
from the agent's own address (127.0.0.1). To make the eviction certain rather than likely, the
flood is queued right behind the agent's connection while the controller's loop is held: the
loop then admits the agent's connection first and the flood after it, and each newcomer over
the cap evicts the oldest — the agent's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import os
import socket
import time
from pathlib import Path

import pytest

from flodl_async.agent import RankOutput
from flodl_async.config.cluster import DeviceSpec, WorkerSpec
from flodl_async.control.membership import JoinConfig
from flodl_async.controller import Controller, ExitCode, LaunchPlan, PlacedWorker, Placement, shell
from flodl_async.net.admission import AdmissionLimits
from flodl_async.net.mux import PortMux
from flodl_async.wire import new_session_secret

from .launchkit import PY, assert_nothing_left, new_run_id

pytestmark = pytest.mark.e2e

#: Low, yet room for the run's own concurrent connections from 127.0.0.1 once the flood is gone.
PER_ADDRESS_CAP = 2
FLOOD = 32
EVICTED = "dialing again for up to"
_ESTABLISHED = "01"


async def _line_with(stream: asyncio.StreamReader, needle: str, seen: list[str]) -> str:
    """Read ``stream`` until a line holds ``needle`` (the agent's own output is the event)."""
    while True:
        raw = await stream.readline()
        if not raw:
            raise AssertionError(f"output ended before {needle!r}: {''.join(seen)}")
        line = raw.decode()
        seen.append(line)
        if needle in line:
            return line


def _connected_to(pid: int, port: int) -> bool:
    """``pid`` holds an established TCP connection to ``port`` (the kernel's table, read)."""
    inodes = set()
    with contextlib.suppress(FileNotFoundError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    with open("/proc/net/tcp") as table:
        for row in table.read().splitlines()[1:]:
            fields = row.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if remote_port == port and fields[3] == _ESTABLISHED and fields[9] in inodes:
                return True
    return False


def _flood_behind(pid: int, port: int) -> list[socket.socket]:
    """Blocks (the caller's loop with it) until ``pid`` is connected to ``port``, then queues
    ``FLOOD`` idle connections from 127.0.0.1 behind its connection, in the listen backlog."""
    deadline = time.monotonic() + 60
    while not _connected_to(pid, port):
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} never connected to port {port}")
        time.sleep(0.005)
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(FLOOD)]


def test_an_agent_evicted_before_its_handshake_dials_again_and_joins(
    tmp_path: Path, xdg: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limits = AdmissionLimits(max_unauthenticated_per_peer=PER_ADDRESS_CAP)
    monkeypatch.setattr(shell, "PortMux", functools.partial(PortMux, limits=limits))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    plan = LaunchPlan(
        run_id=new_run_id(),
        secret=new_session_secret(),
        bind_host="127.0.0.1",
        port=0,
        join=JoinConfig(min_rank_start=2, join_timeout=120, target_ranks=2, max_join_timeout=120),
        workers=(
            PlacedWorker(
                spec=WorkerSpec(host="localhost", devices=DeviceSpec.cpu(1)),
                placement=Placement.LOCAL,
            ),
        ),
        command=(PY, "-c", "pass"),
    )

    async def main() -> tuple[ExitCode, int, str, str]:
        sink = io.BytesIO()
        controller = Controller(plan, output=RankOutput(stdout=sink, stderr=sink))
        await controller.bind()
        with controller.status_board.subscribe() as board:
            run = asyncio.get_running_loop().create_task(controller.run(), name="controller")
            # The controller's own host joins over loopback too: in before the flood (launcher-
            # started agents make one try; this test is about flodl-agent's).
            async with asyncio.timeout(60):
                while (await board.next()).joined_ranks < 1:
                    pass
        agent = await asyncio.create_subprocess_exec(
            PY, "-m", "flodl_async.agent", "--controller", f"127.0.0.1:{controller.port}",
            "--host", "remote", "--devices", "cpu:1", "--connect-timeout", "60",
            stdin=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        flood: list[socket.socket] = []
        seen: list[str] = []
        try:
            assert agent.stdin is not None
            assert agent.stderr is not None
            agent.stdin.write(plan.secret.hex().encode() + b"\n")
            await agent.stdin.drain()
            agent.stdin.close()
            # Held here, the loop accepts nothing: the agent's connection and the flood queue up.
            flood = _flood_behind(agent.pid, controller.port)
            async with asyncio.timeout(60):
                evicted = await _line_with(agent.stderr, EVICTED, seen)
            for sock in flood:
                sock.close()
            async with asyncio.timeout(90):
                rest = (await agent.stderr.read()).decode()
                code = await agent.wait()
                result = await run
        finally:
            for sock in flood:
                sock.close()
            if agent.returncode is None:
                agent.kill()
                await agent.wait()
            if not run.done():
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await run
            await controller.aclose()
        return result.exit_code, code, evicted, "".join(seen) + rest

    exit_code, agent_code, evicted, stderr = asyncio.run(main())
    assert agent_code == 0, stderr  # it joined and served the run to its end
    assert exit_code is ExitCode.OK, stderr
    assert "evicted" in evicted  # it says what happened...
    assert "admission cap" in evicted
    assert "session secret" not in stderr  # ...and blames no secret
    assert "Traceback" not in stderr
    assert_nothing_left(plan.run_id)
