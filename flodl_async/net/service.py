"""A channel service: one handler coroutine per routed connection, started once its handshake proved
the peer, all owned by one TaskGroup."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from ..errors import ConnectionClosed, WireError
from ..wire.channels import Channel
from ..wire.frame import FrameLimits
from ..wire.handshake import CredentialResolver
from .framed import FramedProtocol, server_protocol

log = logging.getLogger("flodl_async.net")

Handler = Callable[[FramedProtocol], Awaitable[None]]


class FramedService:
    """Turns routed connections of ``channel`` into ``handler(link)`` tasks.

    ``resolve`` says which credential a connecting peer must hold
    (:mod:`flodl_async.wire.handshake`).
    The handler runs only after the handshake: it never sees an unauthenticated peer.
    A handler that raises a wire or connection error only ends its own connection; any
    other exception is a bug and is logged with its traceback, never allowed to take the
    controller down with it.
    """

    def __init__(
        self,
        *,
        channel: Channel,
        resolve: CredentialResolver,
        run_id: str,
        handler: Handler,
        task_group: asyncio.TaskGroup,
        limits: FrameLimits | None = None,
        allocate: Callable[[int], bytearray] = bytearray,
        plain_payloads: bool = False,
    ) -> None:
        """``plain_payloads``: unencrypted tensor payloads (a relay's owner-only unix data socket
        only)."""
        self.channel = channel
        self._allocate = allocate
        self._plain_payloads = plain_payloads
        self._resolve = resolve
        self._run_id = run_id
        self._handler = handler
        self._task_group = task_group
        self._limits = limits
        self._serial = 0

    def protocol_factory(self) -> asyncio.BaseProtocol:
        """Called by the mux for each connection routed to this channel."""
        link = server_protocol(
            self.channel,
            self._resolve,
            run_id=self._run_id,
            limits=self._limits,
            allocate=self._allocate,
            plain_payloads=self._plain_payloads,
        )
        # No task until the peer proved the key: a flood of unauthenticated connections costs no
        # tasks.
        link.on_established(self._start)
        return link

    def _start(self, link: FramedProtocol) -> None:
        self._serial += 1
        self._task_group.create_task(
            self._serve(link), name=f"{self.channel.value}-conn-{self._serial}"
        )

    async def _serve(self, link: FramedProtocol) -> None:
        try:
            await self._handler(link)
        except (WireError, ConnectionClosed) as exc:
            log.debug(
                "%s channel: connection from %s ended: %s", self.channel.value, link.peer_label, exc
            )
        except Exception:
            log.exception(
                "%s channel: handler failed on a connection from %s (bug)",
                self.channel.value,
                link.peer_label,
            )
        finally:
            link.close()
