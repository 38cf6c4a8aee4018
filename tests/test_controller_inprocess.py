"""The controller embedded in an asyncio program: cancellation tears down, joins are version-checked."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import typing
from pathlib import Path

import pytest

from flodl_async.agent import RankOutput
from flodl_async.config.cluster import DeviceSpec, WorkerSpec
from flodl_async.control.membership import JoinConfig
from flodl_async.controller import Controller, ExitCode, LaunchPlan, PlacedWorker, Placement
from flodl_async.net.framed import open_framed
from flodl_async.status import Phase
from flodl_async.wire import Channel, Credential, new_session_secret
from flodl_async.wire import messages as m

from .launchkit import PY, assert_nothing_left, new_run_id, processes_of_run, script

pytestmark = pytest.mark.e2e


class LineSink:
    """A binary stream for RankOutput that lets a test wait for a line."""

    def __init__(self) -> None:
        self.data = bytearray()
        self._changed = asyncio.Event()

    def write(self, chunk: bytes) -> int:
        self.data += chunk
        self._changed.set()
        return len(chunk)

    def flush(self) -> None:
        pass

    async def wait_for(self, needle: bytes, count: int = 1) -> None:
        while self.data.count(needle) < count:
            self._changed.clear()
            await self._changed.wait()


def plan_for(tmp_path: Path, *, ranks: int, target: int, command: tuple[str, ...]) -> LaunchPlan:
    return LaunchPlan(
        run_id=new_run_id(),
        secret=new_session_secret(),
        bind_host="127.0.0.1",
        port=0,
        join=JoinConfig(
            min_rank_start=target, join_timeout=30, target_ranks=target, max_join_timeout=60
        ),
        workers=(
            PlacedWorker(
                spec=WorkerSpec(host="localhost", devices=DeviceSpec.cpu(ranks)),
                placement=Placement.LOCAL,
            ),
        ),
        command=command,
    )


def test_cancelling_a_running_controller_tears_everything_down(tmp_path: Path) -> None:
    """An embedding application cancels the run (Ctrl-C through asyncio.run does the same): ranks die, the port closes."""
    plan = plan_for(
        tmp_path,
        ranks=2,
        target=2,
        command=(PY, script("wait_for_file.py"), str(tmp_path / "never")),
    )

    async def main() -> Controller:
        sink = LineSink()
        controller = Controller(plan, output=RankOutput(stdout=sink, stderr=sink))  # type: ignore[arg-type]
        await controller.bind()
        task = asyncio.get_running_loop().create_task(controller.run(), name="controller")
        async with asyncio.timeout(60):
            await sink.wait_for(b"ready pid", count=2)
        assert len(processes_of_run(plan.run_id)) == 2
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return controller

    controller = asyncio.run(main())
    assert not controller.serving
    snapshot = controller.status_board.snapshot
    assert snapshot is not None
    assert snapshot.phase is Phase.FAILED
    assert snapshot.verdict == "the controller was cancelled"
    assert_nothing_left(
        plan.run_id, within=1.0
    )  # the ranks were stopped by the teardown, not left to the parent-death signal


def test_an_agent_of_another_version_is_refused_at_join_naming_both(tmp_path: Path) -> None:
    plan = plan_for(tmp_path, ranks=1, target=2, command=(PY, "-c", "pass"))

    async def main() -> tuple[m.Message, ExitCode]:
        sink = LineSink()
        controller = Controller(plan, output=RankOutput(stdout=sink, stderr=sink))  # type: ignore[arg-type]
        await controller.bind()
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(controller.run(), name="controller")
            link = await open_framed(
                "127.0.0.1",
                controller.port,
                channel=Channel.JOIN,
                credential=Credential.session(plan.secret),
            )
            try:
                link.send(
                    m.JoinHello(host="gpu7", devices=("cpu:0",), pid=1, agent_version="0.0.1-other")
                )
                async with asyncio.timeout(30):
                    reply = await link.recv_message()
            finally:
                with contextlib.suppress(Exception):
                    await link.aclose()
            controller.interrupt(signal.SIGINT)
            result = await task
        return reply, result.exit_code

    reply, code = asyncio.run(main())
    assert isinstance(reply, m.JoinReject)
    assert "'gpu7'" in reply.reason
    assert "'0.0.1-other'" in reply.reason
    assert "install the same flodl_async version on every host" in reply.reason
    assert code is ExitCode.INTERRUPTED
    assert_nothing_left(plan.run_id)


def test_cancelling_the_controller_still_aborts_a_remote_agent(tmp_path: Path) -> None:
    """A stand-alone flodl-agent (another process, as on another host) is told Abort, not left to notice a dead link."""
    base = plan_for(
        tmp_path,
        ranks=1,
        target=2,
        command=(PY, script("wait_for_file.py"), str(tmp_path / "never")),
    )

    async def main() -> tuple[int, str]:
        sink = LineSink()
        controller = Controller(base, output=RankOutput(stdout=sink, stderr=sink))  # type: ignore[arg-type]
        await controller.bind()
        task = asyncio.get_running_loop().create_task(controller.run(), name="controller")
        agent = await asyncio.create_subprocess_exec(
            PY, "-m", "flodl_async.agent", "--controller", f"127.0.0.1:{controller.port}", "--host", "remote", "--devices", "cpu:1",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert agent.stdin is not None
        assert agent.stdout is not None
        assert agent.stderr is not None
        agent.stdin.write(base.secret.hex().encode() + b"\n")
        agent.stdin.close()
        try:
            async with asyncio.timeout(60):
                await sink.wait_for(b"ready pid", count=2)
                assert (
                    b"[remote:r1] ready pid" in sink.data
                )  # the remote's rank line came up its join link
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            async with asyncio.timeout(30):
                stderr = (await agent.stderr.read()).decode()
                code = await agent.wait()
        finally:
            if agent.returncode is None:
                agent.kill()
                await agent.wait()
        return code, stderr

    code, stderr = asyncio.run(main())
    assert "the controller was cancelled" in stderr, stderr  # the Abort's reason reached the agent
    assert "lost the join link" not in stderr
    assert code == ExitCode.RANK_FAILURE
    assert_nothing_left(base.run_id)


def test_state_json_counts_refused_connections_by_reason(tmp_path: Path) -> None:
    """The port's drop counters and open-connection gauges reach /state.json (``connections``)."""
    plan = plan_for(tmp_path, ranks=1, target=1, command=(PY, "-c", "pass"))

    async def main() -> dict[str, typing.Any]:
        sink = LineSink()
        controller = Controller(plan, output=RankOutput(stdout=sink, stderr=sink))  # type: ignore[arg-type]
        await controller.bind()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", controller.port)
            writer.write(b"\x00 names no channel")
            async with asyncio.timeout(10):
                with contextlib.suppress(ConnectionResetError):
                    assert await reader.read() == b""
            writer.close()
            board = controller.status_board
            assert board.snapshot is not None
            board.publish(
                board.snapshot
            )  # stamps the counters of now (requests see them at most 0.5 s late)
            reader, writer = await asyncio.open_connection("127.0.0.1", controller.port)
            writer.write(b"GET /state.json HTTP/1.1\r\nHost: test\r\n\r\n")
            async with asyncio.timeout(10):
                answer = await reader.read()
            writer.close()
            doc: dict[str, typing.Any] = json.loads(answer.split(b"\r\n\r\n", 1)[1])
            return doc
        finally:
            await controller.aclose()

    connections = asyncio.run(main())["connections"]
    assert connections["dropped"] == {"unknown_magic": 1}
    assert connections["accept_errors"] == {}
    assert set(connections["open"]) == {"total", "unsniffed", "handshaking", "status", "streams", "store"}
