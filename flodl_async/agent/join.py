"""The way into a run: what a host joins with, and the join handshake up to a formed world.

:class:`Joiner` dials the controller's join channel and sends the join request with this
host's devices, addresses and cores (:meth:`Joiner.enter`), then waits out the join window for
``WorldFormed`` — echoing the controller's heartbeats meanwhile. While nothing listens at the
controller address, or the controller closes the connection before it answers the join (its
admission evicted it, from an address flooding the port), the way in is tried again with the
capped backoff of ``--persist``, up to ``connect_timeout``. Every failure is an
:class:`~flodl_async.errors.AgentError` naming this host; a stop requested meanwhile ends the
wait for the controller (:meth:`Joiner.enter` returns None) or turns the link's closing into
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
from ..control.backoff import BackoffPolicy, BoundedRetry
from ..deadlines import Deadlines
from ..errors import (
    AgentError,
    AuthenticationFailed,
    ClosedBeforeJoin,
    ConnectionClosed,
    ControllerNotProved,
    ControllerRefused,
    ControllerUnreachable,
    FormationAborted,
    HandshakeCut,
    HandshakeRefused,
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
    #: An every-node run's node (``flodl-launch --nnodes``): its launch digest, which the
    #: controller compares with its own node's ("": any other agent).
    launch: str = ""

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


def mends_by_waiting(exc: AgentError) -> bool:
    """Whether another dial may get in where ``exc`` stopped this one (a one-run agent's
    ``--connect-timeout``): nothing listens at the controller address yet, or the controller closed
    the connection before it answered the join (an eviction, a restart). A name that does not
    resolve, a handshake that hung, a proof that failed or a refusal fails the same way again."""
    if isinstance(exc, ClosedBeforeJoin):
        return True
    if not isinstance(exc, ControllerUnreachable):
        return False
    cause = exc.__cause__
    # TimeoutError is an OSError too: a handshake that hung
    return isinstance(cause, OSError) and not isinstance(cause, socket.gaierror | TimeoutError)


class StoppedBeforeServing(Exception):
    """A stop was requested before the session was serving (the join link was closed for it)."""


class Joiner:
    """One session's way in: :meth:`enter` (dial and join), then :meth:`await_formation`."""

    def __init__(self, config: SessionConfig, *, stopping: asyncio.Event) -> None:
        """``stopping``: set when a stop is requested (a signal); the steps then give up."""
        self.config = config
        self._stopping = stopping

    async def enter(
        self, devices: tuple[str, ...], *, connected: Callable[[FramedProtocol], None]
    ) -> tuple[FramedProtocol, m.JoinAccept] | None:
        """Dial the join channel and join: the link and the controller's ``JoinAccept``.

        What may mend by waiting (:func:`mends_by_waiting`: nothing listens there yet, or the
        controller closed the connection before answering) is tried again with the capped
        backoff of ``--persist``, up to ``connect_timeout``, and said once per kind of failure.
        ``connected(link)`` is called once a link is up (it may raise
        :class:`StoppedBeforeServing`); a failed join closes its link. None: a signal stopped the
        wait.
        """
        cfg = self.config
        loop = asyncio.get_running_loop()
        retry = BoundedRetry(cfg.connect_backoff, give_up_at=loop.time() + cfg.connect_timeout)
        said: set[type[AgentError]] = set()
        while True:
            try:
                return await self._attempt(devices, connected)
            except AgentError as exc:
                if not mends_by_waiting(exc):
                    raise
                at = retry.failed(loop.time(), random.random())  # noqa: S311 -- jitter, not a secret
                if at is None:
                    if cfg.connect_timeout <= 0:
                        raise
                    waited = f" (waited {cfg.connect_timeout:g}s, --connect-timeout)"
                    raise type(exc)(exc.host, exc.reason + waited) from exc.__cause__
                if type(exc) not in said:
                    said.add(type(exc))
                    self._say_retrying(exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(at - loop.time(), 0.0)):
                    await self._stopping.wait()
            if self._stopping.is_set():
                return None

    def _say_retrying(self, exc: AgentError) -> None:
        cfg = self.config
        if isinstance(exc, ClosedBeforeJoin):
            log.warning(
                "agent %s: %s; dialing again for up to %gs",
                cfg.host,
                exc.reason,
                cfg.connect_timeout,
            )
            return
        cause = exc.__cause__
        why = cause.strerror if isinstance(cause, OSError) and cause.strerror else cause
        log.warning(
            "agent %s: no controller at %s yet (%s); retrying for up to %gs",
            cfg.host,
            cfg.controller_addr,
            why,
            cfg.connect_timeout,
        )

    async def _attempt(
        self, devices: tuple[str, ...], connected: Callable[[FramedProtocol], None]
    ) -> tuple[FramedProtocol, m.JoinAccept]:
        link = await self._dial_once()
        try:
            connected(link)
            return link, await self.join(link, devices)
        except BaseException:
            await link.aclose(grace=self.config.deadlines.link_close)
            raise

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
            raise ControllerUnreachable(
                cfg.host,
                f"cannot reach the controller at {cfg.controller_addr}: {exc.strerror or exc}",
            ) from exc
        except (HandshakeCut, ConnectionClosed) as exc:
            # Before its hello: a FIN when the controller had read what we sent, a reset when not.
            raise ClosedBeforeJoin(
                cfg.host,
                f"the controller at {cfg.controller_addr} closed the connection before its "
                "handshake finished: it evicted it (more unproven connections from this host's "
                "address than its admission cap holds), or it is shutting down, or it is no flodl "
                "controller of this version",
            ) from exc
        except AuthenticationFailed as exc:  # WrongToken among them
            raise ControllerNotProved(
                cfg.host, f"cannot join the controller at {cfg.controller_addr}: {exc}"
            ) from exc
        except HandshakeRefused as exc:
            raise ControllerRefused(
                cfg.host, f"cannot join the controller at {cfg.controller_addr}: {exc}"
            ) from exc
        except WireError as exc:
            raise JoinFailed(
                cfg.host, f"cannot join the controller at {cfg.controller_addr}: {exc}"
            ) from exc

    async def _recv(
        self,
        link: FramedProtocol,
        doing: str,
        lost: Callable[[str, str], AgentError],
        *,
        closed: Callable[[str], AgentError] | None = None,
    ) -> Message:
        """The next message; ``lost(host, reason)`` for a bad frame, and for the link closing unless
        ``closed(when)`` is given for that."""
        try:
            return await link.recv_message()
        except ConnectionClosed as exc:
            if self._stopping.is_set():
                raise StoppedBeforeServing from exc
            if closed is not None:
                raise closed(f"while {doing}") from exc
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
                launch=cfg.launch,
            )
            link.send(hello)
        except ConnectionClosed as exc:
            raise self._closed_before_reply("before the join request") from exc
        try:
            async with asyncio.timeout(cfg.deadlines.join_reply):
                reply = await self._recv(
                    link, "waiting for the join reply", JoinFailed, closed=self._closed_before_reply
                )
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

    def _closed_before_reply(self, doing: str) -> ClosedBeforeJoin:
        # Our proof was sent but not yet read when the controller evicted the connection: its
        # handshake had not finished there, though ours had.
        cfg = self.config
        return ClosedBeforeJoin(
            cfg.host,
            f"the controller at {cfg.controller_addr} closed the join link {doing}: it evicted "
            "the connection before its handshake finished there (more unproven connections from "
            "this host's address than its admission cap holds), or it is shutting down",
        )

    async def await_formation(self, link: FramedProtocol, accept: m.JoinAccept) -> m.WorldFormed:
        cfg = self.config
        wait = accept.formation_wait_s + cfg.deadlines.formation_margin
        try:
            async with asyncio.timeout(wait):
                formed = await self._recv(link, "waiting for the world to form", FormationAborted)
                # the controller checks we are alive: echo; a signal to pass on finds no rank yet
                while isinstance(formed, m.Heartbeat | m.SignalRanks):
                    if isinstance(formed, m.Heartbeat):
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
