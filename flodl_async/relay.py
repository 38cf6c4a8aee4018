"""The per-host relay: local ranks on a unix socket, one upstream control connection per host.

Ranks connect to a unix socket (mode 0600, in the agent's private directory)
and speak the control channel's framed protocol to it as they would to the
controller. The relay terminates each rank's link, forwards its messages up
its single upstream control connection (they carry their rank), and routes
the controller's answers back down by rank. Upstream connections therefore
scale with hosts, not ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from .errors import ConnectionClosed, WireError
from .net.framed import FramedProtocol, open_framed
from .net.service import FramedService
from .wire import messages as m
from .wire.channels import Channel
from .wire.keys import SessionKeys

log = logging.getLogger("flodl_async.relay")


class Relay:
    """One host's relay; owned by its agent, its tasks by the agent's TaskGroup."""

    def __init__(self, *, socket_path: str, keys: SessionKeys, controller_host: str, controller_port: int, task_group: asyncio.TaskGroup) -> None:
        self.socket_path = socket_path
        self._keys = keys
        self._controller = (controller_host, controller_port)
        self._tg = task_group
        self._ranks: dict[int, FramedProtocol] = {}
        self._upstream: FramedProtocol | None = None
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        """Dial upstream, then listen on the unix socket (owner-only)."""
        self._upstream = await open_framed(*self._controller, channel=Channel.CONTROL, keys=self._keys)
        self._tg.create_task(self._pump_down(self._upstream), name="relay-down")
        service = FramedService(channel=Channel.CONTROL, keys=self._keys, handler=self._serve_rank, task_group=self._tg)
        loop = asyncio.get_running_loop()
        old_umask = os.umask(0o177)  # the socket is created owner-only, with no window before a chmod
        try:
            self._server = await loop.create_unix_server(service.protocol_factory, self.socket_path)
        finally:
            os.umask(old_umask)
        os.chmod(self.socket_path, 0o600)

    async def _serve_rank(self, link: FramedProtocol) -> None:
        hello = await link.recv_message()
        if not isinstance(hello, m.RankHello):
            log.warning("relay: a local connection opened with %s instead of RankHello; closing it", type(hello).__name__)
            return
        self._ranks[hello.rank] = link
        upstream = self._require_upstream()
        try:
            upstream.send(hello)
            while True:
                upstream.send(await link.recv_message())
                await upstream.drain()
        finally:
            if self._ranks.get(hello.rank) is link:
                del self._ranks[hello.rank]

    async def _pump_down(self, upstream: FramedProtocol) -> None:
        while True:
            try:
                msg = await upstream.recv_message()
            except (ConnectionClosed, WireError):
                return  # the controller went away; the agent's join link reports it
            rank = getattr(msg, "rank", None)
            link = self._ranks.get(rank) if isinstance(rank, int) else None
            if link is None or link.is_closing:
                continue  # the rank left: nothing to deliver to
            with contextlib.suppress(ConnectionClosed, OSError):
                link.send(msg)

    def _require_upstream(self) -> FramedProtocol:
        if self._upstream is None:
            raise RuntimeError("relay not started")
        return self._upstream

    async def aclose(self) -> None:
        """Stop listening, close every rank link and the upstream connection."""
        if self._server is not None:
            self._server.close()
        for link in list(self._ranks.values()):
            link.close()
        if self._upstream is not None:
            await self._upstream.aclose(grace=1.0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
