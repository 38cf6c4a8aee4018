"""The host's one data connection to the controller, opened when the host's first rank needs it.

The relay dials the controller's data channel and introduces the host (``HostDataHello``: its
ranks, and the model's size and digest from the first rank's ``DataHello``); the controller's
``DataWelcome`` names the tensor ceiling. When the run's reducer lives in this very process (the
launcher's own host: :data:`LocalReducerSource`), the connection is a :class:`LocalUplink`
instead: frames change hands in memory, with no socket, no AES-GCM and no copy. Either way each
``Consensus`` that comes down goes to the host fold's fan-out, and a connection that ends cuts the
host's ranks off (they must not wait for a consensus that cannot come).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from ..errors import ConnectionClosed, FlodlError, ProtocolError, WireError
from ..net.bufpool import BufferPool
from ..net.framed import FramedProtocol
from ..wire import messages as m
from ..wire.frame import FrameLimits
from ..wire.schema import Message

log = logging.getLogger("flodl_async.relay.control")

#: The host fold's fan-out: a consensus, its payload parts, and the received buffer (None when the
#: reducer in this process keeps it) that the fold releases once the next consensus replaced it.
FanOut = Callable[[m.Consensus, list[memoryview], memoryview | None], Awaitable[None]]


class HostUpstream:
    """The host's data connection: dialled (or handed over in memory) once, kept until closed."""

    def __init__(
        self,
        *,
        host: str,
        ranks: frozenset[int],
        dial: Callable[[], Awaitable[FramedProtocol]],
        local: LocalReducerSource | None,
        hello_timeout: float,
        task_group: asyncio.TaskGroup,
        pool: BufferPool,
        fan_out: FanOut,
        cut_off: Callable[[], None],
    ) -> None:
        """``fan_out`` takes each consensus that comes down; ``cut_off()`` is called when the
        connection ends (or the reducer in this process refused a frame)."""
        self._host = host
        self._host_ranks = ranks
        self._dial = dial
        self._local = local
        self._hello_timeout = hello_timeout
        self._tg = task_group
        self._pool = pool
        self._fan_out = fan_out
        self._cut_off = cut_off
        self._dialling = asyncio.Lock()
        #: The connection, once opened (it may have closed since: see ``is_closing``).
        self.link: FramedProtocol | LocalUplink | None = None
        #: The tensor ceiling the controller named (0 before the connection is up).
        self.max_payload = 0

    async def open(self, hello: m.DataHello) -> FramedProtocol | LocalUplink:
        """The host's one data connection, dialled and introduced when the first rank needs it."""
        async with self._dialling:
            if self.link is not None and not self.link.is_closing:
                return self.link
            host_hello = m.HostDataHello(
                host=self._host,
                ranks=tuple(sorted(self._host_ranks)),
                model_bytes=hello.model_bytes,
                digest=hello.digest,
            )
            reducer = self._local() if self._local is not None else None
            if reducer is not None:
                local = LocalUplink(deliver=self._fan_out, cut_off=self._cut_off)
                refusal = reducer.connect_local(host_hello, local)
                if refusal is not None:
                    raise FlodlError(
                        f"the controller refused this host's data connection: {refusal}"
                    )
                self.max_payload = reducer.max_payload
                self.link = local
                return local
            try:
                upstream = await self._dial()
            except (ConnectionClosed, WireError, TimeoutError) as exc:
                raise FlodlError(
                    f"the controller refused this host's data connection ({exc}); it serves the "
                    "data channel only once its "
                    "Trainer coordinator runs — open data links after TrainerWelcome"
                ) from exc
            try:
                upstream.send(host_hello)
                async with asyncio.timeout(self._hello_timeout):
                    welcome = await upstream.recv_message()
            except (ConnectionClosed, WireError, TimeoutError) as exc:
                upstream.abort()
                why = str(exc) or "no answer in time"
                raise FlodlError(
                    f"the controller did not welcome this host's data connection ({why}); see the "
                    "controller's log"
                ) from exc
            if not isinstance(welcome, m.DataWelcome):
                upstream.abort()
                raise ProtocolError(
                    f"the controller answered HostDataHello with {type(welcome).__name__}"
                )
            assert upstream.codec is not None
            upstream.codec.limits = FrameLimits(max_payload=welcome.max_payload)
            self.max_payload = welcome.max_payload
            self.link = upstream
            self._tg.create_task(self._pump_down(upstream), name="relay-data-down")
            return upstream

    async def _pump_down(self, upstream: FramedProtocol) -> None:
        while True:
            try:
                frame = await upstream.recv()
            except (ConnectionClosed, WireError) as exc:
                log.debug("relay: the data connection to the controller ended: %s", exc)
                self._cut_off()
                return
            msg = frame.message
            if not isinstance(msg, m.Consensus):
                self._pool.release(frame.payload)
                continue
            await self._fan_out(
                msg, [frame.payload] if frame.payload is not None else [], frame.payload
            )

    async def aclose(self, grace: float) -> None:
        """Close the connection, if it was opened."""
        if self.link is not None:
            await self.link.aclose(grace=grace)


class LocalReducer(Protocol):
    """What the host fold needs of a reducer in its own process: the in-memory uplink's other end.

    The controller's reducer is one; the relay never imports the controller (it sits below it),
    so the controller hands its reducer down through its in-process agent's session config.
    """

    max_payload: int

    def connect_local(self, hello: m.HostDataHello, uplink: LocalUplink) -> str | None: ...

    def offer_local(
        self, uplink: LocalUplink, msg: m.HostContribution, payload: memoryview | None
    ) -> None: ...

    def disconnect_local(self, uplink: LocalUplink) -> None: ...


#: Asked when the host's first rank needs its data connection: the run's reducer when it runs in
#: this process, else None (the relay dials the controller's port). A callable, not the reducer
#: itself: the controller makes its reducer only once the Trainer's coordinator starts, after its
#: agent (and relay) did.
LocalReducerSource = Callable[[], LocalReducer | None]


class LocalUplink:
    """The host's data connection when the reducer is in this process: frames handed over in memory.

    Up: :meth:`send_tensors` gives the reducer the host frame's buffer itself (no copy; the
    reducer owns it from then on). Down: the reducer calls :meth:`deliver`, which fans the
    consensus out from the reducer's own buffers, which it keeps until its next round completes —
    after every rank read this one.
    """

    def __init__(self, *, deliver: FanOut, cut_off: Callable[[], None]) -> None:
        """``deliver``: the host fold's fan-out; ``cut_off()``: the host's ranks lose the link."""
        self._deliver = deliver
        self._cut_off = cut_off
        self._reducer: LocalReducer | None = None
        self._closed = False
        self.peer_label = "the controller (in this process)"

    def bind(self, reducer: LocalReducer) -> None:
        self._reducer = reducer

    @property
    def is_closing(self) -> bool:
        return self._closed

    async def send_tensors(self, msg: Message, payload: list[bytearray | memoryview]) -> None:
        if self._closed or self._reducer is None:
            raise ConnectionClosed("data channel to the controller (in this process)", by_peer=True)
        assert isinstance(msg, m.HostContribution)
        view: memoryview | None = None
        if payload:
            (buffer,) = payload
            view = buffer if isinstance(buffer, memoryview) else memoryview(buffer)
        self._reducer.offer_local(self, msg, view)

    async def deliver(self, msg: m.Consensus, parts: list[memoryview]) -> None:
        """The reducer's consensus for this host's ranks."""
        if not self._closed:
            await self._deliver(msg, parts, None)

    def abort(self) -> None:
        """The reducer refused a frame: the host's ranks are cut off, as on a socket."""
        if not self._closed:
            self._closed = True
            self._cut_off()

    close = abort

    async def aclose(self, grace: float = 0.0) -> None:
        del grace
        reducer, self._reducer = self._reducer, None
        self.abort()
        if reducer is not None:
            reducer.disconnect_local(self)
