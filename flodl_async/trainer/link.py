"""A Trainer rank's links to the coordinator, on a thread of their own with their own event loop.

Theory of operation. Networking runs on a **link thread** so that heartbeats flow while a batch
computes: it dials the relay (``RankHello``), says ``TrainerHello`` (spec, model schema, digest),
waits for ``TrainerWelcome``, opens the data link, then only moves messages: control messages from
the coordinator go into the compute side's inbox (a ``queue.Queue``), the compute side's
``WindowDone``/``Exiting`` go up, and its contributions go to the data link, each answered by a
future. A heartbeat goes up every second; no frame from the controller within the heartbeat
deadline, or the relay link closing, is a lost coordinator (a :class:`Lost` in the inbox).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..deadlines import Deadlines
from ..errors import ConnectionClosed, CoordinatorLost, FlodlError, TrainingStopped, WireError
from ..net.loop import loop_factory
from ..relay.datalink import DataLink
from ..relay.ranklink import RankLink
from ..wire import messages as m
from ..wire.schema import Message

if TYPE_CHECKING:
    import torch

    from ..training.modelschema import ModelSchema


@dataclass(frozen=True, slots=True)
class Lost:
    """The link thread's last word: why the coordinator is gone."""

    error: FlodlError


@dataclass(frozen=True, slots=True)
class Woken:
    """An ASYNC contribution's consensus arrived (the compute side blends it at its next step
    boundary)."""


#: What the link thread puts in the compute side's inbox.
Inbound = Message | Lost | Woken


class LinkThread:
    """The rank's links (control and data) on a thread of their own, with their own event loop."""

    def __init__(
        self,
        *,
        hello: m.TrainerHello,
        schema: ModelSchema,
        heartbeat_timeout: float,
        deadlines: Deadlines,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._hello = hello
        self._schema = schema
        self._env = dict(os.environ if env is None else env)
        self._deadlines = deadlines
        self._silence = heartbeat_timeout * deadlines.scale
        self.inbox: queue.Queue[Inbound] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._welcome: m.TrainerWelcome | None = None
        self._failure: BaseException | None = None
        self._link: Any = None
        self._data: Any = None
        self._closing: asyncio.Event | None = None
        self._farewell: m.Exiting | None = None
        self._thread = threading.Thread(target=self._main, name="flodl-link", daemon=True)
        self.rank = hello.rank
        #: Called on this thread as a peer's death is read, before the compute side sees it (a
        #: COLLECTIVE rank aborts what its process group is blocked in).
        self.on_declared_dead: Callable[[], None] | None = None

    # ----- compute side --------------------------------------------------------------------------

    def start(self) -> m.TrainerWelcome:
        """Start the thread and wait for the welcome (or raise why there is none)."""
        self._thread.start()
        self._started.wait()
        # A failure wins over a welcome: the data link can fail after the coordinator welcomed us.
        if self._failure is not None:
            raise self._failure
        assert self._welcome is not None
        return self._welcome

    def send(self, msg: Message) -> None:
        """Send a control message up (thread-safe; dropped once the link is gone)."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._send_now, msg)

    def contribute(
        self,
        round_: int,
        kind: str,
        tensors: dict[str, torch.Tensor] | None,
        steps: int,
        weight: float,
    ) -> concurrent.futures.Future[Any]:
        """Submit a contribution; the future holds the round's ``ConsensusResult``."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(
            self._data.contribute(round_, kind, tensors, steps, weight), self._loop
        )

    def receive(self, round_: int) -> concurrent.futures.Future[Any]:
        """Wait for a round's consensus without contributing (``from_controller`` rounds)."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(self._data.receive(round_), self._loop)

    def close(self, farewell: m.Exiting | None) -> None:
        """Say goodbye (``Exiting``) and close both links; waits for the thread (bounded)."""
        loop, closing = self._loop, self._closing
        if loop is not None and closing is not None:
            self._farewell = farewell
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(closing.set)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self._deadlines.rank_link_exit)

    # ----- link thread ---------------------------------------------------------------------------

    def _main(self) -> None:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            try:
                runner.run(self._serve())
            except BaseException as exc:  # handed over: the compute side raises or reports it
                if not self._started.is_set():
                    self._failure = exc
                else:
                    self.inbox.put(
                        Lost(
                            exc
                            if isinstance(exc, FlodlError)
                            else CoordinatorLost(f"the rank's link thread failed: {exc!r}")
                        )
                    )
            finally:
                self._started.set()

    def _send_now(self, msg: Message) -> None:
        if self._link is not None:
            with contextlib.suppress(ConnectionClosed):
                self._link.send(msg)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._closing = asyncio.Event()
        async with asyncio.timeout(self._deadlines.trainer_welcome):
            self._link = await RankLink.connect(self._env)
            try:
                self._link.send(self._hello)
                welcome = await self._await_welcome()
                self._data = await DataLink.connect(
                    self._link.spec, self.rank, self._schema, self._hello.digest
                )
                self._welcome = welcome  # only once both links are up
            except BaseException:
                await self._link.aclose()
                raise
        self._started.set()
        try:
            async with asyncio.TaskGroup() as tg:
                reader = tg.create_task(self._read(), name="rank-control-reader")
                beat = tg.create_task(self._beat(), name="rank-heartbeat")
                await self._closing.wait()
                if self._farewell is not None:
                    self._send_now(self._farewell)
                    with contextlib.suppress(ConnectionClosed, TimeoutError):
                        async with asyncio.timeout(self._deadlines.rank_farewell):
                            await self._link.drain()
                reader.cancel()
                beat.cancel()
        finally:
            with contextlib.suppress(Exception):
                await self._data.aclose()
            with contextlib.suppress(Exception):
                await self._link.aclose()

    async def _await_welcome(self) -> m.TrainerWelcome:
        while True:
            msg = await self._link.recv()
            if isinstance(msg, m.TrainerWelcome):
                return msg
            if isinstance(msg, m.TrainerReject):
                raise TrainingStopped(f"the coordinator refused rank {self.rank}: {msg.reason}")
            # Heartbeat echoes and the like before the welcome: nothing to do.

    async def _read(self) -> None:
        try:
            while True:
                async with asyncio.timeout(self._silence):
                    msg = await self._link.recv()
                if isinstance(msg, m.Heartbeat):
                    continue  # the echo: a sign of life, and nothing else
                if isinstance(msg, m.DeclareDead) and msg.regroup and self.on_declared_dead:
                    self.on_declared_dead()
                self.inbox.put(msg)
        except TimeoutError:
            self.inbox.put(
                Lost(
                    CoordinatorLost(
                        f"rank {self.rank}: nothing from the coordinator for {self._silence:g}s "
                        "(it is frozen, gone or cut off)"
                    )
                )
            )
        except (ConnectionClosed, WireError) as exc:
            assert self._closing is not None
            if not self._closing.is_set():
                self.inbox.put(
                    Lost(
                        CoordinatorLost(
                            f"rank {self.rank}: the link to the relay closed ({exc}); the agent or "
                            "the controller is gone"
                        )
                    )
                )
        assert self._closing is not None
        await self._closing.wait()

    async def _beat(self) -> None:
        while True:
            self._send_now(m.Heartbeat(sent_at=time.monotonic(), rank=self.rank))
            await asyncio.sleep(self._deadlines.rank_heartbeat_interval)
