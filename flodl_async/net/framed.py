"""An asyncio Protocol around the sans-IO handshake and frame codec, with awaitable receive and flow
control.

Used on both ends: the controller's channel services and a relay's rank socket
get one per accepted connection (server side); agents, relays and ranks dial
with :func:`open_framed` / :func:`open_unix_framed` (client side), which return
once the handshake (:mod:`flodl_async.wire.handshake`) has proved both sides.
Until then no frame is decoded and nothing can be sent. On the server, the
mux's admission ticket learns when the peer authenticated (or why it was
refused), so unauthenticated connections are capped and timed out, and
rejections are counted and summarised instead of logged one by one.

Bad bytes close the connection at once, without a reply; frames
that verified before them in the same read are still delivered, and the
receiver sees the :class:`WireError` after them. A link has one receiver at a
time: a second concurrent :meth:`FramedProtocol.recv` raises :class:`BusyError`
instead of taking the first one's wake-up.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import typing
from collections.abc import Callable, Sequence

from .._version import __version__
from ..errors import BusyError, ConnectionClosed, WireError
from ..wire.channels import CHANNEL_MAGIC, Channel
from ..wire.frame import (
    Buffer,
    Frame,
    FrameConnection,
    FrameLimits,
    SealingFrame,
    Side,
    sealed_length,
)
from ..wire.handshake import (
    ClientHandshake,
    CredentialResolver,
    Established,
    PeerHello,
    ServerHandshake,
)
from ..wire.keys import Credential
from ..wire.schema import Message
from .admission import AdmissionTicket, rejection_reason
from .inbox import FrameInbox
from .sealing import SealingBuffers, seal_streaming

log = logging.getLogger("flodl_async.net")

#: Write-buffer high-water mark on the data channel.
DATA_WRITE_HIGH_WATER = 32 * 1024 * 1024
#: Payloads at least this large are sealed in a worker thread by send_tensors.
_THREAD_SEAL_BYTES = 1024 * 1024


class FramedProtocol(asyncio.BaseProtocol):
    """One framed, authenticated connection (control-sized frames: bytes arrive via
    ``data_received``).

    Derives from ``BaseProtocol`` only; :class:`StreamFramedProtocol` and
    :class:`BulkFramedProtocol` add the read style. A class that were both a ``Protocol``
    and a ``BufferedProtocol`` would be read as a plain ``Protocol`` by uvloop.
    """

    def __init__(
        self,
        *,
        channel: Channel,
        handshake: ClientHandshake | ServerHandshake,
        limits: FrameLimits | None = None,
        peer_label: str = "",
        allocate: Callable[[int], bytearray] = bytearray,
        magic: bytes = b"",
        plain_payloads: bool = False,
    ) -> None:
        """``handshake`` decides the side: a client handshake dials, a server one accepts.
        ``magic`` (client side, on the controller port) is written before the hello.
        ``plain_payloads``: see :class:`~flodl_async.wire.frame.FrameConnection`; refused on
        anything but a unix socket."""
        self._handshake: ClientHandshake | ServerHandshake | None = handshake
        self.side = Side.PEER if isinstance(handshake, ClientHandshake) else Side.CONTROLLER
        self.codec: FrameConnection | None = None
        self.channel = channel
        self.peer_label = peer_label
        #: Who the peer proved to be (its credential's kind and scope) and the run, once
        #: established.
        self.peer: PeerHello | None = None
        self.run_id = ""
        self._limits = limits
        self._allocate = allocate
        self._magic = magic
        self._plain_payloads = plain_payloads
        self._ticket: AdmissionTicket | None = None
        self._established: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._transport: asyncio.Transport | None = None
        self._inbox = FrameInbox(pause=self._pause_reading, resume=self._resume_reading)
        self._closed_by_peer = False
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._lost = asyncio.get_running_loop().create_future()
        self._sealing = asyncio.Lock()
        self._buffers = SealingBuffers()  # every byte written is counted there

    @property
    def sealing_allocations(self) -> int:
        """Sealing buffers this link had to allocate (the rest were reused)."""
        return self._buffers.allocations

    def bind_admission(self, ticket: AdmissionTicket) -> None:
        """Called by the mux before ``connection_made``: the handshake is reported to ``ticket``."""
        self._ticket = ticket

    # ----- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = typing.cast(asyncio.Transport, transport)
        if self.channel is Channel.DATA:
            # Let one whole tensor frame sit in the write buffer while the next one is MAC'd:
            # with the default 64 KiB mark, hashing and sending would take turns instead.
            self._transport.set_write_buffer_limits(high=DATA_WRITE_HIGH_WATER)
        if self._plain_payloads:
            sock = transport.get_extra_info("socket")
            if sock is None or sock.family != socket.AF_UNIX:
                # Unprotected payloads are for a private unix socket only: never on a network link.
                self._fail(
                    ConnectionClosed(
                        f"{self.channel.value} channel: plain payloads on a non-unix socket",
                        by_peer=False,
                    )
                )
                self._transport.abort()
                return
        if not self.peer_label:
            peer = transport.get_extra_info("peername")
            self.peer_label = (
                f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "?")
            )
        if isinstance(self._handshake, ClientHandshake):
            self._write(self._magic + self._handshake.hello())

    def on_established(self, callback: Callable[[FramedProtocol], None]) -> None:
        """Call ``callback(self)`` once the handshake succeeds (never, when it fails)."""

        def done(future: asyncio.Future[None]) -> None:
            if not future.cancelled() and future.exception() is None:
                callback(self)

        self._established.add_done_callback(done)

    async def established(self) -> None:
        """Wait until the handshake proved both sides; raises what failed it (use a timeout)."""
        await asyncio.shield(self._established)

    def _handshake_data(self, data: bytes) -> None:
        assert self._handshake is not None
        try:
            step = self._handshake.receive_data(data)
        except WireError as exc:
            self._reject(exc)
            return
        if step.send and self._transport is not None and not self._transport.is_closing():
            if self._ticket is not None and step.failure is None and step.established is None:
                self._ticket.answer(lambda: self._write(step.send))  # the mux may delay our proof
            else:
                self._write(step.send)
        if step.failure is not None:
            self._report_rejection(step.failure)
            self._fail(step.failure)
            if self._transport is not None:
                self._transport.close()  # flush the refusal (it names the reason), then close
            return
        if step.established is not None:
            self._establish(step.established)

    def _establish(self, done: Established) -> None:
        self._handshake = None
        self.peer, self.run_id = done.peer, done.run_id
        self.codec = FrameConnection(
            channel=self.channel,
            side=self.side,
            keys=done.keys,
            limits=self._limits,
            allocate=self._allocate,
            plain_payloads=self._plain_payloads,
        )
        if self._ticket is not None:
            self._ticket.authenticated()
        if not self._established.done():
            self._established.set_result(None)
        if done.leftover:
            self.codec.receive_data(done.leftover)
            self._collect()

    @property
    def _failure(self) -> BaseException | None:
        return self._inbox.failure

    def _pause_reading(self) -> bool:
        if self._transport is None:
            return False
        self._transport.pause_reading()
        return True

    def _resume_reading(self) -> bool:
        if self._transport is None:
            return False
        self._transport.resume_reading()
        return True

    def _collect(self) -> None:
        assert self.codec is not None
        try:
            self._inbox.put(self.codec.frames())
        except WireError as exc:
            self._reject(exc)
            return
        if self.codec.failure is not None:
            # Frames that verified before the bad one are queued above: the receiver gets them
            # first, then the error (recv raises the failure only once the queue is empty).
            self._reject(self.codec.failure)
            return
        self._inbox.throttle()

    def _report_rejection(self, exc: WireError) -> None:
        if self._ticket is not None:
            # The mux counts it and summarises rejections per interval: a flood cannot flood the
            # log.
            self._ticket.rejected(rejection_reason(exc), str(exc))
            self._ticket = None
        elif self.side is Side.CONTROLLER:
            log.warning(
                "%s channel: dropping connection from %s: %s",
                self.channel.value,
                self.peer_label,
                exc,
            )
        else:
            # the caller reports it
            log.debug(
                "%s channel: dropping connection to %s: %s",
                self.channel.value,
                self.peer_label,
                exc,
            )

    def _reject(self, exc: WireError) -> None:
        self._report_rejection(exc)
        self._fail(exc)
        if self._transport is not None:
            self._transport.abort()

    def eof_received(self) -> bool | None:
        if self._handshake is not None:
            self._handshake_data(b"")  # raises inside: the peer closed mid-handshake
            return None
        assert self.codec is not None
        try:
            self.codec.receive_data(b"")
            # Raises TruncatedFrame when the peer stopped mid-frame; frames before it are still
            # delivered.
            self._inbox.put(self.codec.frames())
        except WireError as exc:
            self._fail(exc)
            return None
        if self.codec.failure is not None:
            self._fail(self.codec.failure)
            return None
        self._closed_by_peer = True
        self._fail(
            ConnectionClosed(f"{self.channel.value} channel to {self.peer_label}", by_peer=True)
        )
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._failure is None:
            self._closed_by_peer = exc is not None
            self._fail(
                ConnectionClosed(
                    f"{self.channel.value} channel to {self.peer_label}", by_peer=exc is not None
                )
            )
        self._can_write.set()
        if not self._lost.done():
            self._lost.set_result(None)

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    # ----- API -----------------------------------------------------------------------------

    def _fail(self, exc: BaseException) -> None:
        self._inbox.fail(exc)
        if not self._established.done():
            self._established.set_exception(exc)
            # marked retrieved: a server-side link has nobody awaiting it
            self._established.exception()

    async def recv(self) -> Frame:
        """The next frame; raises :class:`ConnectionClosed` at the end or :class:`WireError` on bad
        bytes.

        One receiver at a time: a call while another task waits in ``recv`` raises
        :class:`BusyError`.
        """
        if self._inbox.receiving:
            # The one wake-up future belongs to the waiting receiver: replacing it would strand that
            # one, and taking a frame queued for it would reorder the stream between two readers.
            raise BusyError(
                f"{self.channel.value} channel to {self.peer_label}: recv() called while another "
                "task is already "
                "receiving; a link has one receiver at a time — hand its frames to the others "
                "through a queue"
            )
        return await self._inbox.get()

    async def recv_message(self) -> Message:
        """The next frame's message (payload-less channels)."""
        return (await self.recv()).message

    def send(self, msg: Message) -> None:
        """Queue one frame for writing (call :meth:`drain` to honour back-pressure)."""
        self._check_no_sealing()
        self._write(self._require_codec().send(msg))

    def send_parts(self, msg: Message, payload: Sequence[Buffer]) -> None:
        """Queue one frame with a payload, sealed here (small payloads; see
        :meth:`send_tensors`)."""
        self._check_no_sealing()
        sealing = self._require_codec().start_parts(
            msg, payload, buffer=self._sealing_buffer(payload)
        )
        sealing.seal()
        self._write_sealed(sealing.parts(), sealing.buffer)

    async def send_tensors(
        self, msg: Message, payload: Sequence[Buffer], *, borrow: bool = False
    ) -> None:
        """Send a payload frame, encrypting a large payload in a worker thread.

        While the thread seals (GIL released), the loop keeps moving earlier frames' bytes
        to the socket, so encrypting and sending overlap instead of taking turns. Waits for
        write back-pressure first; frames keep their sequence order. The payload buffers
        may change again as soon as this returns (the frame holds their ciphertext).

        ``borrow`` (plain-payload links only, else ignored): write the payload buffers
        themselves, without a copy. The caller then keeps them alive and unchanged until the
        peer has read the frame (e.g. until it answered it).
        """
        async with self._sealing:
            await self.drain()
            codec = self._require_codec()
            if borrow and codec.plain_payloads:
                self._writelines(codec.send_parts_borrowed(msg, payload))
                return
            sealing = self._require_codec().start_parts(
                msg, payload, buffer=self._sealing_buffer(payload)
            )
            if sealing.payload_len >= _THREAD_SEAL_BYTES and not codec.plain_payloads:
                await self._seal_streaming(sealing)
                return
            try:
                if sealing.payload_len >= _THREAD_SEAL_BYTES:
                    await asyncio.get_running_loop().run_in_executor(None, sealing.seal)
                else:
                    sealing.seal()
            except BaseException:
                # The frame took a sequence number and will never be written: the stream is broken.
                # (A cancelled worker thread may still be writing into its buffer: it is dropped,
                # not reused.)
                self.abort()
                raise
            self._write_sealed(sealing.parts(), sealing.buffer)

    async def _seal_streaming(self, sealing: SealingFrame) -> None:
        """Seal a large payload in a worker thread, writing each chunk as soon as it is sealed
        (:func:`~flodl_async.net.sealing.seal_streaming`); the tag goes last.

        The socket (and the peer, which opens chunks as they arrive) works on chunk i while
        the thread seals chunk i+1, instead of waiting for the whole payload.
        """
        view = memoryview(sealing.buffer)

        def write_chunk(start: int, end: int) -> None:
            if self._transport is not None and not self._transport.is_closing():
                self._write_view(view[start:end])

        self._write(sealing.head)
        try:
            tag = await seal_streaming(sealing, write_chunk)
        except BaseException:
            # Part of the frame is written (or never will be): the stream is broken. The buffer is
            # dropped, not reused, since the thread may still be writing into it.
            self.abort()
            raise
        self._write(tag)
        self._buffers.sent(sealing.buffer)

    def _sealing_buffer(self, payload: Sequence[Buffer]) -> bytearray:
        payload_len = sum(memoryview(p).nbytes for p in payload)
        need = (
            self.codec.wire_payload_length(payload_len)
            if self.codec is not None
            else sealed_length(payload_len)
        )
        transport = self._transport
        unflushed = transport.get_write_buffer_size() if transport is not None else None
        return self._buffers.take(need, unflushed=unflushed)

    def _write_sealed(self, parts: list[Buffer], buffer: bytearray) -> None:
        self._writelines(parts)
        self._buffers.sent(buffer)

    def _write(self, data: bytes) -> None:
        self._writable().write(data)
        self._buffers.wrote(len(data))

    def _write_view(self, data: memoryview) -> None:
        self._writable().write(data)
        self._buffers.wrote(data.nbytes)

    def _writelines(self, parts: list[Buffer]) -> None:
        self._writable().writelines(parts)
        self._buffers.wrote(sum(memoryview(p).nbytes for p in parts))

    def _require_codec(self) -> FrameConnection:
        if self.codec is None:
            if self._failure is not None:
                raise ConnectionClosed(
                    f"{self.channel.value} channel to {self.peer_label}",
                    by_peer=self._closed_by_peer,
                )
            raise RuntimeError(
                "the handshake has not finished: await established() (open_framed does) before "
                "sending"
            )
        return self.codec

    def _check_no_sealing(self) -> None:
        if self._sealing.locked():
            raise RuntimeError(
                "a tensor frame is being sealed on this link; await send_tensors() before sending "
                "more"
            )

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its high-water mark."""
        if self._failure is not None and not isinstance(self._failure, ConnectionClosed):
            raise self._failure
        await self._can_write.wait()
        if (self._transport is None or self._transport.is_closing()) and self._lost.done():
            raise ConnectionClosed(
                f"{self.channel.value} channel to {self.peer_label}", by_peer=self._closed_by_peer
            )

    def _writable(self) -> asyncio.Transport:
        if self._transport is None or self._transport.is_closing():
            raise ConnectionClosed(
                f"{self.channel.value} channel to {self.peer_label}", by_peer=self._closed_by_peer
            )
        return self._transport

    @property
    def peer_host(self) -> str:
        """The peer's address without the port ('' for unix sockets)."""
        peer = self._transport.get_extra_info("peername") if self._transport is not None else None
        return str(peer[0]) if isinstance(peer, tuple) else ""

    @property
    def local_host(self) -> str:
        """This end's own address without the port ('' for unix sockets or a closed link)."""
        sock = self._transport.get_extra_info("sockname") if self._transport is not None else None
        return str(sock[0]) if isinstance(sock, tuple) else ""

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
        if self.codec is None:
            self._handshake_data(data)
            return
        try:
            self.codec.receive_data(data)
        except WireError as exc:
            self._reject(exc)
            return
        self._collect()


class BulkFramedProtocol(FramedProtocol, asyncio.BufferedProtocol):
    """The data channel's link: the socket writes tensor payloads straight into their frame
    buffers."""

    _handshake_buffer: bytearray | None = None

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.codec is None:
            if self._handshake_buffer is None:
                self._handshake_buffer = bytearray(4096)
            return memoryview(self._handshake_buffer)
        return self.codec.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self._failure is not None:
            return
        if self.codec is None:
            assert self._handshake_buffer is not None
            self._handshake_data(bytes(self._handshake_buffer[:nbytes]))
            return
        try:
            self.codec.buffer_updated(nbytes)
        except WireError as exc:
            self._reject(exc)
            return
        self._collect()


def tcp_endpoints(link: FramedProtocol) -> tuple[tuple[str, int], tuple[str, int]] | None:
    """``(peer, ours)``, each ``(address, port)``, of a TCP link; None for a unix socket or a
    closed link."""
    transport = link._transport
    if transport is None:
        return None
    peer, ours = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
    if not (isinstance(peer, tuple) and isinstance(ours, tuple)):
        return None
    return (str(peer[0]), int(peer[1])), (str(ours[0]), int(ours[1]))


def framed_protocol_class(channel: Channel) -> type[FramedProtocol]:
    """Buffered (zero-copy receive) on the data channel, plain elsewhere."""
    return BulkFramedProtocol if channel is Channel.DATA else StreamFramedProtocol


def client_protocol(
    channel: Channel,
    credential: Credential,
    *,
    limits: FrameLimits | None,
    peer_label: str,
    magic: bytes,
    expect_run_id: str | None,
    allocate: Callable[[int], bytearray] = bytearray,
    plain_payloads: bool = False,
) -> FramedProtocol:
    """A dialling link of the right read style for ``channel``."""
    handshake = ClientHandshake(
        channel=channel, credential=credential, version=__version__, expect_run_id=expect_run_id
    )
    return framed_protocol_class(channel)(
        channel=channel,
        handshake=handshake,
        limits=limits,
        peer_label=peer_label,
        magic=magic,
        allocate=allocate,
        plain_payloads=plain_payloads,
    )


def server_protocol(
    channel: Channel,
    resolve: CredentialResolver,
    *,
    run_id: str,
    limits: FrameLimits | None = None,
    allocate: Callable[[int], bytearray] = bytearray,
    plain_payloads: bool = False,
) -> FramedProtocol:
    """An accepting link of the right read style for ``channel``."""
    handshake = ServerHandshake(
        channel=channel, resolve=resolve, run_id=run_id, version=__version__
    )
    return framed_protocol_class(channel)(
        channel=channel,
        handshake=handshake,
        limits=limits,
        allocate=allocate,
        plain_payloads=plain_payloads,
    )


async def _handshaken(protocol: FramedProtocol) -> FramedProtocol:
    try:
        await protocol.established()
    except BaseException:
        protocol.abort()  # a failed, timed-out or cancelled dial leaves no socket behind
        raise
    return protocol


async def open_framed(
    host: str,
    port: int,
    *,
    channel: Channel,
    credential: Credential,
    limits: FrameLimits | None = None,
    expect_run_id: str | None = None,
    allocate: Callable[[int], bytearray] = bytearray,
    source: str | None = None,
) -> FramedProtocol:
    """Dial the controller port, select ``channel`` with its magic, run the handshake, return the
    link.

    One round trip more than the TCP connect. Wrap in ``asyncio.timeout``: a server that
    accepts and never answers would otherwise be waited on forever. Raises ``OSError`` when
    the port cannot be reached and a :class:`WireError` when the handshake fails. ``source``:
    the local address to dial from (the controller's per-address caps count by it).
    """
    loop = asyncio.get_running_loop()
    _transport, protocol = await loop.create_connection(
        lambda: client_protocol(
            channel,
            credential,
            limits=limits,
            peer_label=f"{host}:{port}",
            magic=CHANNEL_MAGIC[channel],
            expect_run_id=expect_run_id,
            allocate=allocate,
        ),
        host,
        port,
        local_addr=None if source is None else (source, 0),
    )
    return await _handshaken(protocol)


async def open_unix_framed(
    path: str,
    *,
    channel: Channel,
    credential: Credential,
    peer_label: str,
    limits: FrameLimits | None = None,
    allocate: Callable[[int], bytearray] = bytearray,
    plain_payloads: bool = False,
) -> FramedProtocol:
    """Dial a relay's unix socket (no channel magic: each socket serves one channel) and run the
    handshake.

    ``plain_payloads``: tensor payloads unencrypted on this owner-only socket (the relay's data
    socket; see :class:`~flodl_async.wire.frame.FrameConnection`)."""
    loop = asyncio.get_running_loop()
    _transport, protocol = await loop.create_unix_connection(
        lambda: client_protocol(
            channel,
            credential,
            limits=limits,
            peer_label=peer_label,
            magic=b"",
            expect_run_id=None,
            allocate=allocate,
            plain_payloads=plain_payloads,
        ),
        path,
    )
    return await _handshaken(protocol)
