"""An impostor at a controller's address: answers any join ClientHello with a well-formed ServerHello
and a proof under a random key (the project's own server handshake builds both).

argv: the port to listen on (127.0.0.1). Prints ``listening`` once bound and ``answered N`` for
each hello it answered; runs until killed. A dial-in agent reads the ServerHello, finds the proof
does not verify under its token, and closes, exactly as against a controller holding another
token.
"""

import asyncio
import secrets
import sys

from flodl_async._version import __version__
from flodl_async.errors import WireError
from flodl_async.wire.channels import CHANNEL_MAGIC, Channel
from flodl_async.wire.handshake import PeerHello, ServerHandshake

MAGIC = CHANNEL_MAGIC[Channel.JOIN]


def random_key(_peer: PeerHello) -> bytes:
    return secrets.token_bytes(32)


class Impostor(asyncio.Protocol):
    answered = 0  # hellos answered, over every connection

    def __init__(self) -> None:
        self.buf = b""
        self.handshake: ServerHandshake | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        if self.handshake is None:
            self.buf += data
            if len(self.buf) < len(MAGIC):
                return
            if self.buf[: len(MAGIC)] != MAGIC:
                self.transport.abort()
                return
            data, self.buf = self.buf[len(MAGIC) :], b""
            self.handshake = ServerHandshake(
                channel=Channel.JOIN, resolve=random_key, run_id="impostor", version=__version__
            )
        try:
            step = self.handshake.receive_data(data)
        except WireError:
            self.transport.abort()
            return
        if step.send:
            self.transport.write(step.send)
            Impostor.answered += 1
            print(f"answered {Impostor.answered}", flush=True)


async def main() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Impostor, "127.0.0.1", int(sys.argv[1]), reuse_address=True)
    print("listening", flush=True)
    async with server:
        await server.serve_forever()


asyncio.run(main())
