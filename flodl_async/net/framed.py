"""An asyncio Protocol around the sans-IO frame codec, with awaitable receive and flow control.

Used on both ends: the controller's channel services get one from the mux
after routing; agents, relays and ranks get one from :func:`open_framed`.
Bad bytes close the connection at once, without a reply (design §3); frames
that verified before them in the same read are still delivered, and the
receiver sees the :class:`WireError` after them. A link has one receiver at a
time: a second concurrent :meth:`FramedProtocol.recv` raises :class:`BusyError`
instead of taking the first one's wake-up.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import typing
from collections.abc import Callable, Sequence

from ..errors import BusyError, ConnectionClosed, WireError
from ..wire.channels import CHANNEL_MAGIC, Channel
from ..wire.frame import Buffer, Frame, FrameConnection, FrameLimits, Side
from ..wire.keys import SessionKeys
from ..wire.schema import Message

log = logging.getLogger("flodl_async.net")

#: Write-buffer high-water mark on the data channel.
DATA_WRITE_HIGH_WATER = 32 * 1024 * 1024
#: Payloads at least this large are MAC'd in a worker thread by send_tensors.
_THREAD_MAC_BYTES = 1024 * 1024
#: Frames queued for the receiver before we stop reading from the socket.
_RECV_HIGH_WATER = 64


class FramedProtocol(asyncio.BaseProtocol):
    """One framed, authenticated connection (control-sized frames: bytes arrive via ``data_received``).

    Derives from ``BaseProtocol`` only; :class:`StreamFramedProtocol` and
    :class:`BulkFramedProtocol` add the read style. A class that were both a ``Protocol``
    and a ``BufferedProtocol`` would be read as a plain ``Protocol`` by uvloop.
    """

    def __init__(
        self,
        *,
        channel: Channel,
        side: Side,
        keys: SessionKeys,
        limits: FrameLimits | None = None,
        peer_label: str = "",
        allocate: Callable[[int], bytearray] = bytearray,
    ) -> None:
        self.codec = FrameConnection(channel=channel, side=side, keys=keys, limits=limits, allocate=allocate)
        self.channel = channel
        self.peer_label = peer_label
        self._transport: asyncio.Transport | None = None
        self._frames: collections.deque[Frame] = collections.deque()
        self._failure: BaseException | None = None
        self._closed_by_peer = False
        self._wakeup: asyncio.Future[None] | None = None
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._lost = asyncio.get_running_loop().create_future()
        self._reading_paused = False
        self._sealing = asyncio.Lock()

    # ----- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = typing.cast(asyncio.Transport, transport)
        if self.channel is Channel.DATA:
            # Let one whole tensor frame sit in the write buffer while the next one is MAC'd:
            # with the default 64 KiB mark, hashing and sending would take turns instead.
            self._transport.set_write_buffer_limits(high=DATA_WRITE_HIGH_WATER)
        if not self.peer_label:
            peer = transport.get_extra_info("peername")
            self.peer_label = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "?")

    def _collect(self) -> None:
        try:
            self._frames.extend(self.codec.frames())
        except WireError as exc:
            self._reject(exc)
            return
        if self.codec.failure is not None:
            # Frames that verified before the bad one are queued above: the receiver gets them
            # first, then the error (recv raises the failure only once the queue is empty).
            self._reject(self.codec.failure)
            return
        if len(self._frames) >= _RECV_HIGH_WATER and self._transport is not None and not self._reading_paused:
            self._transport.pause_reading()
            self._reading_paused = True
        self._wake()

    def _reject(self, exc: WireError) -> None:
        log.warning("%s channel: dropping connection from %s: %s", self.channel.value, self.peer_label, exc)
        self._fail(exc)
        if self._transport is not None:
            self._transport.abort()

    def eof_received(self) -> bool | None:
        try:
            self.codec.receive_data(b"")
            # Raises TruncatedFrame when the peer stopped mid-frame; frames before it are still delivered.
            self._frames.extend(self.codec.frames())
        except WireError as exc:
            self._fail(exc)
            return None
        if self.codec.failure is not None:
            self._fail(self.codec.failure)
            return None
        self._closed_by_peer = True
        self._fail(ConnectionClosed(f"{self.channel.value} channel to {self.peer_label}", by_peer=True))
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._failure is None:
            self._closed_by_peer = exc is not None
            self._fail(ConnectionClosed(f"{self.channel.value} channel to {self.peer_label}", by_peer=exc is not None))
        self._can_write.set()
        if not self._lost.done():
            self._lost.set_result(None)

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    # ----- API -----------------------------------------------------------------------------

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def recv(self) -> Frame:
        """The next frame; raises :class:`ConnectionClosed` at the end or :class:`WireError` on bad bytes.

        One receiver at a time: a call while another task waits in ``recv`` raises :class:`BusyError`.
        """
        if self._wakeup is not None:
            # The one wake-up future belongs to the waiting receiver: replacing it would strand that
            # one, and taking a frame queued for it would reorder the stream between two readers.
            raise BusyError(
                f"{self.channel.value} channel to {self.peer_label}: recv() called while another task is already "
                "receiving; a link has one receiver at a time — hand its frames to the others through a queue"
            )
        while not self._frames:
            if self._failure is not None:
                raise self._failure
            self._wakeup = asyncio.get_running_loop().create_future()
            try:
                await self._wakeup
            finally:
                self._wakeup = None
        frame = self._frames.popleft()
        if self._reading_paused and len(self._frames) < _RECV_HIGH_WATER // 2 and self._transport is not None:
            self._transport.resume_reading()
            self._reading_paused = False
        return frame

    async def recv_message(self) -> Message:
        """The next frame's message (payload-less channels)."""
        return (await self.recv()).message

    def send(self, msg: Message) -> None:
        """Queue one frame for writing (call :meth:`drain` to honour back-pressure)."""
        self._check_no_sealing()
        self._writable().write(self.codec.send(msg))

    def send_parts(self, msg: Message, payload: Sequence[Buffer]) -> None:
        """Queue one frame with a raw payload, written from the given buffers without copying them."""
        self._check_no_sealing()
        self._writable().writelines(self.codec.send_parts(msg, payload))

    async def send_tensors(self, msg: Message, payload: Sequence[Buffer]) -> None:
        """Send a payload frame, MAC'ing a large payload in a worker thread.

        While the thread hashes (GIL released), the loop keeps moving the previous frame's
        bytes to the socket, so hashing and sending overlap instead of taking turns.
        Waits for write back-pressure first; frames keep their sequence order.
        """
        async with self._sealing:
            await self.drain()
            sealing = self.codec.start_parts(msg, payload)
            if sum(memoryview(p).nbytes for p in payload) >= _THREAD_MAC_BYTES:
                await asyncio.get_running_loop().run_in_executor(None, sealing.mac_payload)
            else:
                sealing.mac_payload()
            self._writable().writelines(sealing.parts())

    def _check_no_sealing(self) -> None:
        if self._sealing.locked():
            raise RuntimeError("a tensor frame is being sealed on this link; await send_tensors() before sending more")

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its high-water mark."""
        if self._failure is not None and not isinstance(self._failure, ConnectionClosed):
            raise self._failure
        await self._can_write.wait()
        if (self._transport is None or self._transport.is_closing()) and self._lost.done():
            raise ConnectionClosed(f"{self.channel.value} channel to {self.peer_label}", by_peer=self._closed_by_peer)

    def _writable(self) -> asyncio.Transport:
        if self._transport is None or self._transport.is_closing():
            raise ConnectionClosed(f"{self.channel.value} channel to {self.peer_label}", by_peer=self._closed_by_peer)
        return self._transport

    @property
    def peer_host(self) -> str:
        """The peer's address without the port ('' for unix sockets)."""
        peer = self._transport.get_extra_info("peername") if self._transport is not None else None
        return str(peer[0]) if isinstance(peer, tuple) else ""

    async def wait_closed(self) -> None:
        """Wait until the connection is gone (either side closed it)."""
        await asyncio.shield(self._lost)

    @property
    def is_closing(self) -> bool:
        """True once the connection is closing or closed."""
        return self._transport is None or self._transport.is_closing()

    def close(self) -> None:
        """Graceful close: flush what was written, then close."""
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Forced close: drop buffered output."""
        if self._transport is not None:
            self._transport.abort()

    async def aclose(self, grace: float = 1.0) -> None:
        """Close gracefully, force after ``grace`` seconds, and wait until the socket is gone."""
        self.close()
        try:
            async with asyncio.timeout(grace):
                await asyncio.shield(self._lost)
        except TimeoutError:
            self.abort()
            await asyncio.shield(self._lost)


class StreamFramedProtocol(FramedProtocol, asyncio.Protocol):
    """Control-sized frames: the loop hands over each chunk it read."""

    def data_received(self, data: bytes) -> None:
        if self._failure is not None:
            return
        try:
            self.codec.receive_data(data)
        except WireError as exc:
            self._reject(exc)
            return
        self._collect()


class BulkFramedProtocol(FramedProtocol, asyncio.BufferedProtocol):
    """The data channel's link: the socket writes tensor payloads straight into their frame buffers."""

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.codec.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self._failure is not None:
            return
        try:
            self.codec.buffer_updated(nbytes)
        except WireError as exc:
            self._reject(exc)
            return
        self._collect()


def framed_protocol_class(channel: Channel) -> type[FramedProtocol]:
    """Buffered (zero-copy receive) on the data channel, plain elsewhere."""
    return BulkFramedProtocol if channel is Channel.DATA else StreamFramedProtocol


async def open_framed(
    host: str,
    port: int,
    *,
    channel: Channel,
    keys: SessionKeys,
    limits: FrameLimits | None = None,
) -> FramedProtocol:
    """Dial the controller port, select ``channel`` with its magic, and return the framed link."""
    loop = asyncio.get_running_loop()
    cls = framed_protocol_class(channel)
    _transport, protocol = await loop.create_connection(
        lambda: cls(channel=channel, side=Side.PEER, keys=keys, limits=limits, peer_label=f"{host}:{port}"),
        host,
        port,
    )
    _transport.write(CHANNEL_MAGIC[channel])
    return protocol
