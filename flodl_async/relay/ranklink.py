"""The rank side of the relay: a flodl-aware rank's link to its host's relay.

``RankLink.connect()`` reads the rank's spec from the environment the agent set,
dials the relay's unix socket with the rank's own credential (its rank, its
round: never the session secret), and says hello (``RankHello`` up,
``RankWelcome`` back from the controller). ``heartbeat()`` measures a round trip
to the controller and back. The rank's data link is
:class:`~flodl_async.relay.datalink.DataLink`'s (the same rank credential, from the same spec).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from types import TracebackType

from ..config.rankenv import RankSpec
from ..config.roles import LOCAL_RANK_VAR, RANK_VAR, Role, detect_role
from ..errors import ConfigError, ProtocolError
from ..net.framed import FramedProtocol, open_unix_framed
from ..wire import messages as m
from ..wire.channels import Channel
from ..wire.keys import Credential
from ..wire.schema import Message

#: How long a rank waits for its relay's socket to appear, and how often it looks.
RELAY_APPEAR_WAIT = 30.0
RELAY_APPEAR_POLL = 0.02


class RankLink:
    """One rank's framed link to its relay."""

    def __init__(self, link: FramedProtocol, *, rank: int, spec: RankSpec) -> None:
        self._link = link
        self.rank = rank
        self.spec = spec

    @classmethod
    async def connect(cls, env: Mapping[str, str] | None = None) -> RankLink:
        """Dial the relay named in the environment and complete the handshake (wrap in
        ``asyncio.timeout``)."""
        env = os.environ if env is None else env
        if detect_role(env) is not Role.RANK:
            raise ConfigError(
                f"not running as a flodl rank ({RANK_VAR} and {LOCAL_RANK_VAR} are not set); start "
                "it with flodl-launch"
            )
        try:
            spec = RankSpec.from_json(env[RANK_VAR])
            rank = int(env["RANK"])
        except (KeyError, ValueError, TypeError) as exc:
            raise ConfigError(
                f"{RANK_VAR} or RANK in this rank's environment is not what flodl wrote ({exc!r}); "
                "start the rank with flodl-launch"
            ) from None
        credential = Credential.rank_from_hex(spec.credential_hex, round=spec.round, rank=rank)
        loop = asyncio.get_running_loop()
        # A rank the launcher started early (flodl_async.host.early) may get here before its
        # agent's relay listens: the socket appears within moments, or not at all.
        give_up = loop.time() + RELAY_APPEAR_WAIT
        while True:
            try:
                link = await open_unix_framed(
                    spec.relay_socket,
                    channel=Channel.CONTROL,
                    credential=credential,
                    peer_label=f"relay of {spec.host}",
                )
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if loop.time() >= give_up:
                    raise
                await asyncio.sleep(RELAY_APPEAR_POLL)
        link.send(
            m.RankHello(
                rank=rank,
                local_rank=int(env["LOCAL_RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                pid=os.getpid(),
            )
        )
        welcome = await link.recv_message()
        if not isinstance(welcome, m.RankWelcome) or welcome.rank != rank:
            link.close()
            raise ProtocolError(
                f"rank {rank}: expected RankWelcome from the controller, got {welcome!r}"
            )
        return cls(link, rank=rank, spec=spec)

    def send(self, msg: Message) -> None:
        """Send one control message up (the Trainer's link thread is the link's one user)."""
        self._link.send(msg)

    async def recv(self) -> Message:
        """The next control message from the controller (one receiver at a time)."""
        return await self._link.recv_message()

    async def drain(self) -> None:
        """Wait until what was sent is handed to the socket."""
        await self._link.drain()

    async def heartbeat(self) -> float:
        """One heartbeat to the controller and back; returns the round trip in seconds."""
        sent = time.monotonic()
        self._link.send(m.Heartbeat(sent_at=sent, rank=self.rank))
        while True:
            reply = await self._link.recv_message()
            if isinstance(reply, m.Heartbeat) and reply.sent_at == sent:
                return time.monotonic() - sent

    async def aclose(self) -> None:
        """Close the link."""
        await self._link.aclose()

    async def __aenter__(self) -> RankLink:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
