"""The way into a run: what a host joins with, and the join handshake up to a formed world.

:class:`Joiner` dials the controller's join channel (retrying, with the capped backoff of
``--persist``, while nothing listens there, up to ``connect_timeout``), sends the join request
with this host's devices, addresses and cores, and waits out the join window for
``WorldFormed`` — echoing the controller's heartbeats meanwhile. Every failure is an
:class:`~flodl_async.errors.AgentError` naming this host; a stop requested meanwhile ends the
wait for the controller (:meth:`Joiner.dial` returns None) or turns the link's closing into
:class:`StoppedBeforeServing`. :class:`~flodl_async.agent.session.HostSession` runs these
steps, then serves the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .._version import __version__
from ..config.devices import DeviceKind, DeviceSpec
from ..control.backoff import Backoff, BackoffPolicy
from ..deadlines import Deadlines
from ..errors import (
    AgentError,
    ConnectionClosed,
    ControllerUnreachable,
    FormationAborted,
    JoinFailed,
    JoinRejected,
    WireError,
)
from ..host.cores import usable_cores
from ..host.gpus import host_visible_gpus
from ..host.hostaddrs import host_addresses
from ..net.framed import FramedProtocol, open_framed
from ..wire import messages as m
from ..wire.channels import Channel
from ..wire.keys import SECRET_BYTES, Credential
from ..wire.schema import Message

if TYPE_CHECKING:
    from ..relay.upstream import LocalReducerSource

log = logging.getLogger("flodl_async.agent")


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionConfig:
    """Everything one host needs to take part in one run."""

    controller_host: str
    controller_port: int
    #: The session secret; empty when ``token`` is set (the controller then sends the secret,
    #: sealed, on admission).
    secret: bytes = field(repr=False)
    host: str
    devices: DeviceSpec
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str | None = None
    advertise_addr: str | None = None
    #: Every deadline, resolved once (``FLODL_NET_TIMEOUT_SCALE`` applied); ``stop_grace`` is used
    #: for Finish, signals and a lost controller.
    deadlines: Deadlines = field(default_factory=Deadlines.resolve)
    #: The runtime directory (default: :func:`flodl_async.host.runtime.runtime_root`).
    runtime_root: Path | None = None
    #: A dial-in agent's cluster token: it joins with the token instead of the session secret.
    token: bytes | None = field(default=None, repr=False)
    #: Join with no credential at all (a controller running ``join.open_admission``); the secret
    #: comes as with a token.
    open_admission: bool = False
    #: While nothing listens at the controller address, keep dialing this long (0: one try).
    #: ``flodl-agent --connect-timeout``.
    connect_timeout: float = 0.0
    #: The pacing of those dials: the capped backoff of ``--persist``.
    connect_backoff: BackoffPolicy = field(default_factory=BackoffPolicy)
    #: The ranks' GLOO/NCCL_SOCKET_IFNAME where nothing (cluster file, env, this agent's env) sets
    #: them:
    #: None takes the interface of the join connection (an agent on another host: the NIC the other
    #: hosts reach); the controller's own host, which joins over loopback, passes its choice ("":
    #: none).
    default_ifname: str | None = None
    #: The controller's reducer when this agent runs in the controller's own process (its local
    #: launcher passes it): the relay hands the host's frames to it in memory. None: dial the port.
    local_reducer: LocalReducerSource | None = field(default=None, repr=False, compare=False)

    @property
    def controller_addr(self) -> str:
        """``host:port`` of the controller, for messages and the runtime marker."""
        return f"{self.controller_host}:{self.controller_port}"


def device_labels(devices: DeviceSpec) -> tuple[str, ...]:
    """The device labels this host offers when it joins (its GPUs counted only for ``all``)."""
    # each agent counts its own host's GPUs: a remote ``devices: all`` host's capacity, never the
    # controller's count
    gpus = len(host_visible_gpus()) if devices.kind is DeviceKind.ALL_GPUS else 0
    return devices.labels(gpus)


def _join_credential(cfg: SessionConfig) -> Credential:
    if cfg.token is not None:
        return Credential.token(cfg.token)
    if cfg.open_admission:
        return Credential.open_admission()
    return Credential.session(cfg.secret)


def with_session_secret(cfg: SessionConfig, accept: m.JoinAccept) -> SessionConfig:
    """A token agent's config once admitted: the run's session secret, as its sealed JoinAccept
    carried it."""
    if len(accept.session_secret) != SECRET_BYTES:
        raise JoinFailed(
            cfg.host,
            f"the controller at {cfg.controller_addr} admitted this agent without a valid session "
            "secret "
            f"({len(accept.session_secret)} bytes); run the same flodl_async version on every host",
        )
    return dataclasses.replace(cfg, secret=accept.session_secret)


class StoppedBeforeServing(Exception):
    """A stop was requested before the session was serving (the join link was closed for it)."""


class Joiner:
    """One session's way in: dial, join, wait for the world to form (one call each, in order)."""

    def __init__(self, config: SessionConfig, *, stopping: asyncio.Event) -> None:
        """``stopping``: set when a stop is requested (a signal); the steps then give up."""
        self.config = config
        self._stopping = stopping

    async def dial(self) -> FramedProtocol | None:
        """Dial the join channel; while nothing listens there, retry (the capped backoff of
        ``--persist``) up to ``connect_timeout``.

        An agent started before its controller waits instead of failing on the first
        refused connection, and says so once. None: a signal stopped the wait.
        """
        cfg = self.config
        loop = asyncio.get_running_loop()
        give_up = loop.time() + cfg.connect_timeout
        backoff = Backoff(cfg.connect_backoff)
        while True:
            try:
                return await self._dial_once()
            except ControllerUnreachable as exc:
                cause = exc.__cause__
                if (
                    not isinstance(cause, OSError)
                    or isinstance(cause, socket.gaierror | TimeoutError)
                    or loop.time() >= give_up
                ):
                    # a name that does not resolve, or a handshake that hung, will not mend by
                    # waiting
                    raise
                if backoff.failures == 0:
                    why = cause.strerror or cause
                    log.warning(
                        "agent %s: no controller at %s yet (%s); retrying for up to %gs",
                        cfg.host,
                        cfg.controller_addr,
                        why,
                        cfg.connect_timeout,
                    )
                at = min(backoff.failed(loop.time(), random.random()), give_up)  # noqa: S311 -- jitter, not a secret
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(at - loop.time(), 0.0)):
                        await self._stopping.wait()
                if self._stopping.is_set():
                    return None

    async def _dial_once(self) -> FramedProtocol:
        cfg = self.config
        try:
            async with asyncio.timeout(cfg.deadlines.handshake):
                credential = _join_credential(cfg)
                return await open_framed(
                    cfg.controller_host,
                    cfg.controller_port,
                    channel=Channel.JOIN,
                    credential=credential,
                )
        except TimeoutError as exc:
            raise ControllerUnreachable(
                cfg.host,
                f"the controller at {cfg.controller_addr} accepted the connection but did not "
                f"finish the handshake within {cfg.deadlines.handshake:g}s",
            ) from exc
        except OSError as exc:
            waited = (
                f" (waited {cfg.connect_timeout:g}s, --connect-timeout)"
                if cfg.connect_timeout > 0
                else ""
            )
            raise ControllerUnreachable(
                cfg.host,
                f"cannot reach the controller at {cfg.controller_addr}: "
                f"{exc.strerror or exc}{waited}",
            ) from exc
        except WireError as exc:
            raise JoinFailed(
                cfg.host, f"cannot join the controller at {cfg.controller_addr}: {exc}"
            ) from exc

    async def _recv(
        self, link: FramedProtocol, doing: str, lost: Callable[[str, str], AgentError]
    ) -> Message:
        try:
            return await link.recv_message()
        except ConnectionClosed as exc:
            if self._stopping.is_set():
                raise StoppedBeforeServing from exc
            raise lost(
                self.config.host, f"the controller closed the join link while {doing}"
            ) from exc
        except WireError as exc:
            raise lost(
                self.config.host, f"bad frame from the controller while {doing}: {exc}"
            ) from exc

    async def join(self, link: FramedProtocol, devices: tuple[str, ...]) -> m.JoinAccept:
        cfg = self.config
        try:
            hello = m.JoinHello(
                host=cfg.host,
                devices=devices,
                pid=os.getpid(),
                agent_version=__version__,
                addresses=host_addresses(),
                cores=usable_cores(),
            )
            link.send(hello)
        except ConnectionClosed as exc:
            raise JoinFailed(
                cfg.host,
                f"the controller at {cfg.controller_addr} closed the join link before the join "
                "request",
            ) from exc
        try:
            async with asyncio.timeout(cfg.deadlines.join_reply):
                reply = await self._recv(link, "waiting for the join reply", JoinFailed)
        except TimeoutError:
            raise JoinFailed(
                cfg.host, f"no answer to the join request within {cfg.deadlines.join_reply:g}s"
            ) from None
        if isinstance(reply, m.JoinReject):
            raise JoinRejected(cfg.host, f"join rejected by the controller: {reply.reason}")
        if not isinstance(reply, m.JoinAccept):
            raise JoinFailed(cfg.host, f"unexpected {type(reply).__name__} instead of a join reply")
        log.debug(
            "agent %s: admitted to run %s with ranks %s", cfg.host, reply.run_id, list(reply.ranks)
        )
        return reply

    async def await_formation(self, link: FramedProtocol, accept: m.JoinAccept) -> m.WorldFormed:
        cfg = self.config
        wait = accept.formation_wait_s + cfg.deadlines.formation_margin
        try:
            async with asyncio.timeout(wait):
                formed = await self._recv(link, "waiting for the world to form", FormationAborted)
                while isinstance(formed, m.Heartbeat):  # the controller checks we are alive: echo
                    with contextlib.suppress(ConnectionClosed):
                        link.send(m.Heartbeat(sent_at=formed.sent_at))
                    formed = await self._recv(
                        link, "waiting for the world to form", FormationAborted
                    )
        except TimeoutError:
            raise FormationAborted(cfg.host, f"the world did not form within {wait:g}s") from None
        if isinstance(formed, m.Abort):
            raise FormationAborted(
                cfg.host, f"the controller aborted before formation: {formed.reason}"
            )
        if not isinstance(formed, m.WorldFormed):
            raise FormationAborted(
                cfg.host, f"unexpected {type(formed).__name__} instead of WorldFormed"
            )
        return formed
