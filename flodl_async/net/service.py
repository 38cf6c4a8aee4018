"""A channel service: one handler coroutine per routed connection, all owned by one TaskGroup."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from ..errors import ConnectionClosed, WireError
from ..wire.channels import Channel
from ..wire.frame import FrameLimits, Side
from ..wire.keys import SessionKeys
from .framed import FramedProtocol, framed_protocol_class

log = logging.getLogger("flodl_async.net")

Handler = Callable[[FramedProtocol], Awaitable[None]]


class FramedService:
    """Turns routed connections of ``channel`` into ``handler(link)`` tasks.

    A handler that raises a wire or connection error only ends its own connection; any
    other exception is a bug and is logged with its traceback, never allowed to take the
    controller down with it.
    """

    def __init__(
        self,
        *,
        channel: Channel,
        keys: SessionKeys,
        handler: Handler,
        task_group: asyncio.TaskGroup,
        limits: FrameLimits | None = None,
        allocate: Callable[[int], bytearray] = bytearray,
    ) -> None:
        self.channel = channel
        self._allocate = allocate
        self._keys = keys
        self._handler = handler
        self._task_group = task_group
        self._limits = limits
        self._serial = 0

    def protocol_factory(self) -> asyncio.BaseProtocol:
        """Called by the mux for each connection routed to this channel."""
        link = framed_protocol_class(self.channel)(channel=self.channel, side=Side.CONTROLLER, keys=self._keys, limits=self._limits, allocate=self._allocate)
        self._serial += 1
        self._task_group.create_task(self._serve(link), name=f"{self.channel.value}-conn-{self._serial}")
        return link

    async def _serve(self, link: FramedProtocol) -> None:
        try:
            await self._handler(link)
        except (WireError, ConnectionClosed) as exc:
            log.debug("%s channel: connection from %s ended: %s", self.channel.value, link.peer_label, exc)
        except Exception:
            log.exception("%s channel: handler failed on a connection from %s (bug)", self.channel.value, link.peer_label)
        finally:
            link.close()
