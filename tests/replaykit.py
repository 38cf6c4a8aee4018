"""Tools of the replay-attack tests: a recording TCP proxy, replays of what it recorded, handshakes by hand.

The proxy sits between a real flodl-agent and a real controller and keeps, per
connection and in order, every byte each side sent. The replays send a
recording's client bytes to a controller again on a fresh connection, either all
at once (:func:`replay_burst`) or the way an attacker who reads the answers
would (:func:`replay_paced`: the recorded hello, the server's hello back, then the
rest). :func:`insist` plays a client holding some key that does everything a key
holder can do except check the server's proof, so any refusal it meets is the
server's own. :func:`decode_recording` reads a recording back with the session
secret, to show what the replayed bytes carry.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from flodl_async._version import __version__
from flodl_async.wire import (
    CHANNEL_MAGIC,
    MAGIC_LEN,
    Channel,
    ClientHandshake,
    Credential,
    FrameConnection,
    LinkKeys,
    Routed,
    ServerHandshake,
    Side,
    sniff,
)
from flodl_async.wire.handshake import NONCE_BYTES, PROOF_BYTES, PROTOCOL_VERSION, session_resolver
from flodl_async.wire.schema import Message

from .launchkit import Finished

#: Every handshake message opens with: u8 version, u8 kind/status, u16 length of what follows.
PREAMBLE = struct.Struct("<BBH")
_ACCEPT, _REFUSE = 0, 1


# ----- the recording proxy ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Recorded:
    """One proxied connection as recorded so far: what each side sent, in order."""

    index: int
    client: bytes
    server: bytes
    closed: bool

    @property
    def channel(self) -> Channel | None:
        """The channel its first four bytes selected (None when they select none)."""
        routed = sniff(self.client[:MAGIC_LEN])
        return routed.channel if isinstance(routed, Routed) else None


@dataclass(slots=True)
class _Recording:
    index: int
    client: bytearray = field(default_factory=bytearray)
    server: bytearray = field(default_factory=bytearray)
    open_directions: int = 2


class RecordingProxy:
    """A loopback TCP proxy, in its own thread and event loop, that records every connection it forwards.

    Half-closes are forwarded as such and a reset on one side aborts the other, so
    both ends see what they would have seen without the proxy.
    """

    def __init__(self, upstream_port: int) -> None:
        self._upstream = upstream_port
        self._changed = threading.Condition()
        self._recordings: list[_Recording] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="recording-proxy", daemon=True)
        self.port = 0

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise AssertionError("the recording proxy did not start listening within 10s")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening, cut every forwarded connection and join the thread."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        if self._thread.is_alive():
            raise AssertionError("the recording proxy's thread did not stop")

    def recordings(self) -> list[Recorded]:
        """Every connection so far, in the order they were accepted (a snapshot)."""
        with self._changed:
            return [
                Recorded(
                    index=r.index,
                    client=bytes(r.client),
                    server=bytes(r.server),
                    closed=r.open_directions == 0,
                )
                for r in self._recordings
            ]

    def wait_all_closed(self, timeout: float = 30) -> list[Recorded]:
        """Wait until both directions of every recorded connection ended; returns the recordings."""
        with self._changed:
            if not self._changed.wait_for(
                lambda: all(r.open_directions == 0 for r in self._recordings), timeout
            ):
                raise AssertionError(f"proxied connections still open after {timeout:g}s")
        return self.recordings()

    # ----- the proxy's own loop --------------------------------------------------------------

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to the test thread by __enter__ or close
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        pipes: set[asyncio.Task[None]] = set()
        async with asyncio.TaskGroup() as tg:

            def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                task = tg.create_task(self._pipe(reader, writer), name=f"proxy-conn-{len(pipes)}")
                pipes.add(task)
                task.add_done_callback(pipes.discard)

            server = await asyncio.start_server(accept, "127.0.0.1", 0)
            self.port = int(server.sockets[0].getsockname()[1])
            self._ready.set()
            try:
                await self._stop.wait()
            finally:
                server.close()
                for task in list(pipes):
                    task.cancel()
        await server.wait_closed()

    async def _pipe(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        with self._changed:
            recording = _Recording(index=len(self._recordings))
            self._recordings.append(recording)
        try:
            server_reader, server_writer = await asyncio.open_connection(
                "127.0.0.1", self._upstream
            )
        except OSError:
            client_writer.transport.abort()
            self._ended(recording, 2)
            return
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(
                    self._copy(client_reader, server_writer, recording, recording.client),
                    name=f"proxy-up-{recording.index}",
                )
                tg.create_task(
                    self._copy(server_reader, client_writer, recording, recording.server),
                    name=f"proxy-down-{recording.index}",
                )
        finally:
            client_writer.close()  # flushes what was written: after a reset the transports are closed already
            server_writer.close()

    async def _copy(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        recording: _Recording,
        into: bytearray,
    ) -> None:
        try:
            while chunk := await reader.read(65536):
                with self._changed:
                    into.extend(chunk)
                writer.write(chunk)
                await writer.drain()
            if not writer.transport.is_closing():
                writer.write_eof()
        except OSError:
            writer.transport.abort()  # a reset on one side: the other side is reset too
        finally:
            self._ended(recording, 1)

    def _ended(self, recording: _Recording, directions: int) -> None:
        with self._changed:
            recording.open_directions -= directions
            self._changed.notify_all()


# ----- handshake messages in clear -------------------------------------------------------------


def message_length(data: bytes) -> int | None:
    """The length of the handshake message ``data`` starts with (None while its preamble is incomplete)."""
    if len(data) < PREAMBLE.size:
        return None
    _version, _code, rest = PREAMBLE.unpack_from(data)
    return PREAMBLE.size + int(rest)


def client_hello_end(client_bytes: bytes) -> int:
    """Where the ClientHello that follows the channel magic of a recording ends."""
    length = message_length(client_bytes[MAGIC_LEN:])
    assert length is not None, "the recording holds no whole client hello"
    return MAGIC_LEN + length


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerHello:
    """A server's hello, parsed: an acceptance (nonce, run id, version, proof) or a refusal (its reason)."""

    raw: bytes
    accepted: bool
    nonce: bytes = b""
    run_id: str = ""
    version: str = ""
    reason: str = ""


def parse_server_hello(raw: bytes) -> ServerHello:
    """Parse exactly one ServerHello; anything else is an assertion error."""
    version, status, rest = PREAMBLE.unpack_from(raw)
    assert version == PROTOCOL_VERSION, (
        f"not a wire v{PROTOCOL_VERSION} server hello: {raw[:16].hex()}"
    )
    assert len(raw) == PREAMBLE.size + rest, (
        f"{len(raw)} bytes are not one server hello of {PREAMBLE.size + rest}"
    )
    body = raw[PREAMBLE.size :]
    if status == _REFUSE:
        return ServerHello(raw=raw, accepted=False, reason=body.decode())
    assert status == _ACCEPT, f"server hello status {status}"
    pos = NONCE_BYTES
    run_id = body[pos + 1 : pos + 1 + body[pos]].decode()
    pos += 1 + body[pos]
    server_version = body[pos + 1 : pos + 1 + body[pos]].decode()
    pos += 1 + body[pos]
    assert pos + PROOF_BYTES == len(body), "trailing bytes in the server hello"
    return ServerHello(
        raw=raw, accepted=True, nonce=body[:NONCE_BYTES], run_id=run_id, version=server_version
    )


# ----- sockets ---------------------------------------------------------------------------------


def connect(port: int, *, within: float = 10.0, source: str = "127.0.0.1") -> socket.socket:
    """A plain TCP connection to the loopback port, from ``source`` (any of 127/8 on Linux)."""
    return socket.create_connection(("127.0.0.1", port), timeout=within, source_address=(source, 0))


def send_all(sock: socket.socket, data: bytes) -> bool:
    """Send ``data``; False when the server had already cut the connection (a reset or a broken pipe)."""
    try:
        sock.sendall(data)
    except (ConnectionResetError, BrokenPipeError):
        return False
    return True


def read_until_closed(sock: socket.socket, *, within: float = 10.0) -> bytes:
    """Everything the server sends until it closes (a reset counts as a close); fails if it is still open after ``within``."""
    data = bytearray()
    deadline = time.monotonic() + within
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return bytes(data)
        except TimeoutError:
            raise AssertionError(
                f"the server kept the connection open for {within:g}s after sending {len(data)} bytes"
            ) from None
        if not chunk:
            return bytes(data)
        data += chunk


def read_server_hello(sock: socket.socket, *, within: float = 10.0) -> tuple[bytes, bytes]:
    """(the server's hello, bytes after it); the hello is ``b""`` when the server closed before sending a whole one."""
    data = bytearray()
    deadline = time.monotonic() + within
    while (length := message_length(bytes(data))) is None or len(data) < length:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        except TimeoutError:
            raise AssertionError(
                f"no whole server hello within {within:g}s (got {len(data)} bytes)"
            ) from None
        if not chunk:
            return b"", bytes(data)
        data += chunk
    return bytes(data[:length]), bytes(data[length:])


# ----- replays ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Answer:
    """What a controller sent back on one replayed connection before it closed it."""

    hello: bytes
    after: bytes

    @property
    def at_most_a_hello(self) -> bool:
        """Nothing but (at most) one well-formed server hello came back."""
        if self.after:
            return False
        if self.hello:
            parse_server_hello(self.hello)  # asserts it is exactly one well-formed hello
        return True


def replay_burst(port: int, client_bytes: bytes, *, within: float = 10.0) -> Answer:
    """Send every recorded client byte at once on a new connection, then read what comes back until the close."""
    with connect(port, within=within) as sock:
        send_all(sock, client_bytes)
        data = read_until_closed(sock, within=within)
    length = message_length(data)
    if length is None or length > len(data):
        return Answer(hello=b"", after=data)
    return Answer(hello=data[:length], after=data[length:])


def replay_paced(port: int, client_bytes: bytes, *, within: float = 10.0) -> Answer:
    """The recorded magic and hello, the server's fresh hello back, then the rest of the recording; read until the close."""
    end = client_hello_end(client_bytes)
    with connect(port, within=within) as sock:
        send_all(sock, client_bytes[:end])
        hello, extra = read_server_hello(sock, within=within)
        if hello:
            send_all(sock, client_bytes[end:])
        after = extra + read_until_closed(sock, within=within)
    return Answer(hello=hello, after=after)


# ----- reading a recording with the secret -----------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Decoded:
    """The messages of one recorded connection: up (client to server) and down."""

    up: list[Message]
    down: list[Message]


def _peer_keys(server_keys: LinkKeys) -> LinkKeys:
    return LinkKeys(
        send_mac=server_keys.recv_mac,
        recv_mac=server_keys.send_mac,
        send_aead=server_keys.recv_aead,
        recv_aead=server_keys.send_aead,
    )


def decode_recording(recording: Recorded, *, secret: bytes, run_id: str) -> Decoded:
    """Read a recorded connection back with the session secret (what only the secret's holder can do).

    A server handshake given the recorded server nonce rebuilds the recorded server hello
    byte for byte (checked), verifies the recorded client proof, and so yields this
    connection's keys; the frames of both directions then decode with them.
    """
    channel = recording.channel
    assert channel is not None
    client = recording.client[MAGIC_LEN:]
    hello_end = client_hello_end(recording.client) - MAGIC_LEN
    server_hello_len = message_length(recording.server)
    assert server_hello_len is not None
    seen = parse_server_hello(recording.server[:server_hello_len])
    assert seen.accepted
    rebuilt = ServerHandshake(
        channel=channel,
        resolve=session_resolver(secret),
        run_id=run_id,
        version=seen.version,
        nonce=seen.nonce,
    )
    assert rebuilt.receive_data(client[:hello_end]).send == seen.raw, (
        "the recorded server hello is not the one the secret gives"
    )
    done = rebuilt.receive_data(client[hello_end:]).established
    assert done is not None
    up_codec = FrameConnection(channel=channel, side=Side.CONTROLLER, keys=done.keys)
    up_codec.receive_data(done.leftover)
    down_codec = FrameConnection(channel=channel, side=Side.PEER, keys=_peer_keys(done.keys))
    down_codec.receive_data(recording.server[server_hello_len:])
    return Decoded(
        up=[f.message for f in up_codec.frames()], down=[f.message for f in down_codec.frames()]
    )


# ----- a client that never checks the server's proof -------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Insisted:
    """What a server did with an insistent client: its hello (None: closed before one), frames back, closed or not."""

    hello: ServerHello | None
    frames: list[Message]
    closed: bool


def insist(
    sock: socket.socket,
    *,
    magic: bytes,
    channel: Channel,
    credential: Credential,
    frames: Sequence[Message],
    within: float = 10.0,
) -> Insisted:
    """Handshake with ``credential``, then send its proof and ``frames`` whether or not the server's proof verified.

    The client proof is computed as an honest holder of ``credential.key`` would: a server
    handshake keyed with it and given the real server's nonce, run id and version answers
    our hello with a hello whose clear part is the real one byte for byte (checked), so the
    transcript, and the proof over it, are those of this connection. Returns after the first
    frame that comes back, or at the close.
    """
    client = ClientHandshake(channel=channel, credential=credential, version=__version__)
    hello = client.hello()
    send_all(sock, magic + hello)
    raw, extra = read_server_hello(sock, within=within)
    if not raw:
        assert not extra, f"the server sent {len(extra)} bytes that are not a server hello"
        return Insisted(hello=None, frames=[], closed=True)  # read_server_hello saw the close
    server_hello = parse_server_hello(raw)
    if not server_hello.accepted:
        return Insisted(
            hello=server_hello, frames=[], closed=read_until_closed(sock, within=within) == b""
        )
    mirror = ServerHandshake(
        channel=channel,
        resolve=lambda _peer: credential.key,
        run_id=server_hello.run_id,
        version=server_hello.version,
        nonce=server_hello.nonce,
    )
    forged = mirror.receive_data(hello).send
    assert forged[:-PROOF_BYTES] == raw[:-PROOF_BYTES], (
        "the mirror's hello differs from the server's in clear"
    )
    step = client.receive_data(forged)
    assert step.established is not None
    codec = FrameConnection(channel=channel, side=Side.PEER, keys=step.established.keys)
    send_all(sock, step.send + b"".join(codec.send(msg) for msg in frames))
    data = extra
    deadline = time.monotonic() + within
    while True:
        if data:
            codec.receive_data(data)
            back = [f.message for f in codec.frames()]
            if back:
                return Insisted(hello=server_hello, frames=back, closed=False)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            data = b""
        except TimeoutError:
            raise AssertionError(
                f"the server neither answered nor closed within {within:g}s"
            ) from None
        if not data:
            return Insisted(hello=server_hello, frames=[], closed=True)


def insist_on_port(
    port: int,
    channel: Channel,
    credential: Credential,
    frames: Sequence[Message],
    *,
    source: str = "127.0.0.1",
) -> Insisted:
    """:func:`insist` on a new connection to the controller port (with the channel's magic), from
    ``source``."""
    with connect(port, source=source) as sock:
        return insist(
            sock,
            magic=CHANNEL_MAGIC[channel],
            channel=channel,
            credential=credential,
            frames=frames,
        )


def insist_on_unix(path: str, credential: Credential, frames: Sequence[Message]) -> Insisted:
    """:func:`insist` on a new connection to a relay's unix socket (control channel, no magic)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        return insist(
            sock, magic=b"", channel=Channel.CONTROL, credential=credential, frames=frames
        )


# ----- processes with their output in files ----------------------------------------------------


class Background:
    """A process whose stdout and stderr go to files: a chatty process never blocks on a full pipe."""

    def __init__(
        self, cmd: Sequence[str], *, out_dir: Path, name: str, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.stdout_path = out_dir / f"{name}.stdout"
        self.stderr_path = out_dir / f"{name}.stderr"
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen(
                list(cmd), stdout=out, stderr=err, env={**os.environ, **(env or {})}
            )

    def stderr(self) -> str:
        """What it wrote to stderr so far."""
        return self.stderr_path.read_text(errors="replace")

    def finish(self, timeout: float = 60) -> Finished:
        """Wait for it to exit; its exit status and everything it wrote."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"{self.name} did not exit within {timeout:g}s; stderr: {self.stderr()}"
            ) from None
        return Finished(
            self.proc.returncode, self.stdout_path.read_text(errors="replace"), self.stderr()
        )

    def kill(self) -> None:
        """SIGKILL it if it still runs, and reap it."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        self.proc.wait()
