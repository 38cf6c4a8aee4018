"""The per-host relay: local ranks on unix sockets, one upstream connection per channel per host.

Theory of operation. Ranks connect to a unix socket (mode 0600, in the
session's private runtime entry) and speak the control channel's framed
protocol to it as they would to the controller. The relay terminates each
rank's link and forwards its messages up its single upstream control
connection; the controller's answers come back down and are routed by rank.
Upstream connections therefore scale with hosts, not ranks.

The data channel has its own socket, served by :class:`~flodl_async.relay.fold.HostFold`:
the host's ranks' contributions to a round are folded into one host frame that
goes up the host's one data connection (dialled when the first rank says
hello), and the controller's consensus comes down once per host and is sent to
every local rank.

Addressing is explicit, in one table (:data:`RANK_ADDRESS`): which control
messages carry a rank, and how to read it. Both directions are checked
against it in one place (:func:`rank_of`):

- down: a message from the controller goes to the rank it is addressed to,
  ``rank = -1`` to every live local rank (one frame per host for the Trainer's
  broadcasts); one that is addressed to no rank is dropped and counted, never
  guessed at;
- up: a rank's link is bound to the rank its credential proved in the
  handshake. Its ``RankHello`` must name that rank, and a later message on that
  link that claims another rank — or no rank, which the shared upstream
  connection would leave without an origin — is refused: the link is closed
  and counted. A second link for a bound rank is refused too. ``RankGone`` is the
  relay's own: when a bound rank's link closes, the relay says so up the shared
  connection (the controller learns of a dead Trainer rank without waiting for
  its heartbeat deadline or its exit report).

The relay also reads four Trainer messages as they pass: ``DeclareDead`` (a rank
its fold barrier must stop waiting for), ``Readmitted`` (a restarted rank it waits for again), a
rank's ``TrainerHello`` (its model: the tensors its
contributions must carry) and ``Reduce``, whose round plan the fold checks the ranks'
contributions against (the ranks get the ``Reduce`` without it); a rank the fold refuses
for breaking its plan is reported up as ``RankGone`` with the fold's reason. The data socket
learns the model's size and digest from the ranks' own ``DataHello``
(:mod:`flodl_async.relay.fold`).

Credentials. The relay holds the session secret (it is part of its agent) and
speaks upstream with it; ranks never get it. The rank socket takes only rank
credentials (:func:`~flodl_async.wire.keys.rank_credential_key`), only for the
ranks this host runs and only for the round it is running: the relay derives
the key from the scope the rank claims, so a credential proves exactly one
rank of one round and cannot be stretched to another rank, a later round, or
the controller's port.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from ..control.liveness import Liveness, Wake
from ..deadlines import Deadlines
from ..errors import ConnectionClosed, HandshakeRefused, WireError
from ..net.framed import FramedProtocol, open_framed
from ..net.service import FramedService
from ..wire import messages as m
from ..wire.channels import Channel
from ..wire.handshake import PeerHello
from ..wire.keys import Credential, CredentialKind, rank_credential_key
from ..wire.restarts import Readmitted
from ..wire.scalars import Report
from ..wire.schema import Message
from .fold import HELLO_LIMITS, HostFold, HostFoldStatistics
from .upstream import LocalReducerSource

log = logging.getLogger("flodl_async.relay.control")

_M = TypeVar("_M", bound=Message)


def _address(
    cls: type[_M], read: Callable[[_M], int]
) -> tuple[type[Message], Callable[[Message], int]]:
    def address(msg: Message) -> int:
        return read(typing.cast(_M, msg))  # looked up by type(msg), so msg is a cls

    return cls, address


#: Control-channel messages addressed to (down) or sent by (up) one rank, and how to read that rank.
RANK_ADDRESS: Mapping[type[Message], Callable[[Message], int]] = dict(
    [
        _address(m.RankHello, lambda msg: msg.rank),
        _address(m.RankWelcome, lambda msg: msg.rank),
        _address(m.Heartbeat, lambda msg: msg.rank),
        _address(Report, lambda msg: msg.rank),
        # The Trainer's coordinator protocol; down, rank -1 is every local rank.
        *(
            _address(cls, lambda msg: msg.rank)  # type: ignore[attr-defined]
            for cls in (
                m.TrainerHello,
                m.TrainerWelcome,
                m.TrainerReject,
                m.Plan,
                m.WindowDone,
                m.Reduce,
                m.ReduceDone,
                m.EpochAggregated,
                m.DeclareDead,
                Readmitted,
                m.RankGone,
                m.Exiting,
                m.Intent,
                m.RankStateSaved,
                m.Shutdown,
            )
        ),
    ]
)

#: ``rank`` of a down-message that means every local rank of this relay (one frame per host).
EVERY_LOCAL_RANK = -1

#: Up-messages only the relay itself originates: a rank's link that sends one is refused.
RELAY_ONLY: frozenset[type[Message]] = frozenset({m.RankGone})


def rank_of(msg: Message) -> int | None:
    """The rank ``msg`` is addressed to or claims to be from, or None when it names no rank."""
    read = RANK_ADDRESS.get(type(msg))
    return None if read is None else read(msg)


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayStatistics:
    """A snapshot of what the relay has done."""

    ranks_connected: int
    forwarded_up: int
    delivered_down: int
    #: Controller messages addressed to no rank (dropped).
    dropped_unaddressed: int
    #: Controller messages for a rank that is not connected here (dropped).
    dropped_rank_gone: int
    #: Rank links closed: no RankHello first, a bound rank claimed twice, or a message claiming
    #: another rank.
    refused_links: int
    #: The data socket: contributions folded into host frames, consensus fanned out.
    data: HostFoldStatistics
    #: Down-messages for every local rank (``rank = -1``), counted once per frame.
    broadcasts_down: int = 0
    #: ``RankGone`` reports sent up: closed rank links, and ranks the host fold refused.
    ranks_gone: int = 0


class Relay:
    """One host's relay; owned by its session, its tasks by the session's TaskGroup."""

    def __init__(
        self,
        *,
        socket_path: str,
        data_socket_path: str,
        secret: bytes,
        run_id: str,
        ranks: frozenset[int],
        controller_host: str,
        controller_port: int,
        task_group: asyncio.TaskGroup,
        deadlines: Deadlines,
        host: str = "",
        on_upstream_lost: Callable[[str], None] | None = None,
        on_rank_dead: Callable[[int, str], None] | None = None,
        local_reducer: LocalReducerSource | None = None,
    ) -> None:
        """``host`` names this host in its data connection's hello (the controller's log lines).

        ``local_reducer``: where the controller in this process hands its reducer over (the
        launcher's own host); the host's frames then go to it in memory instead of up the port.

        ``on_upstream_lost(reason)``: the upstream control link went silent past the heartbeat
        deadline.

        ``on_rank_dead(rank, reason)``: the controller declared one of this host's ranks dead.
        """
        self._deadlines = deadlines
        self._on_upstream_lost = on_upstream_lost
        self._on_rank_dead = on_rank_dead
        self._upstream_live: Liveness | None = None
        self._beats: asyncio.Task[None] | None = None
        self.socket_path = socket_path
        self.data_socket_path = data_socket_path
        self._secret = secret
        self._run_id = run_id
        self._host_ranks = ranks
        self._round: int | None = None  # no rank credential is good before the first StartRanks
        self._controller = (controller_host, controller_port)
        self._tg = task_group
        self._ranks: dict[int, FramedProtocol] = {}
        self._upstream: FramedProtocol | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._fold = HostFold(
            host=host,
            ranks=ranks,
            dial=self._dial_data,
            task_group=task_group,
            hello_timeout=deadlines.handshake,
            local=local_reducer,
            on_misbehaved=self._misbehaved,
        )
        self._forwarded_up = 0
        self._delivered_down = 0
        self._dropped_unaddressed = 0
        self._dropped_rank_gone = 0
        self._refused_links = 0
        self._warned: set[type[Message]] = set()
        self._broadcasts_down = 0
        self._ranks_gone = 0
        #: Ranks that said TrainerHello: a forwarded SIGUSR1/SIGUSR2 is not theirs
        #: (:meth:`flodl_async.agent.session.HostSession.signal_ranks`).
        self.trainer_ranks: set[int] = set()

    async def start(self) -> None:
        """Dial upstream (with the session secret), then listen on the unix socket (owner-only)."""
        async with asyncio.timeout(self._deadlines.handshake):
            self._upstream = await open_framed(
                *self._controller,
                channel=Channel.CONTROL,
                credential=Credential.session(self._secret),
                expect_run_id=self._run_id,
            )
        self._tg.create_task(self._pump_down(self._upstream), name="relay-down")
        if self._host_ranks:
            self._beats = self._tg.create_task(
                self._beat_upstream(self._upstream), name="relay-heartbeat"
            )
        control = FramedService(
            channel=Channel.CONTROL,
            resolve=self._rank_key,
            run_id=self._run_id,
            handler=self._serve_rank,
            task_group=self._tg,
        )
        data = FramedService(
            channel=Channel.DATA,
            resolve=self._rank_key,
            run_id=self._run_id,
            handler=self._fold.serve_rank,
            task_group=self._tg,
            limits=HELLO_LIMITS,
            allocate=self._fold.pool.acquire,
            # owner-only unix socket: same-user peers (FrameConnection's plain_payloads)
            plain_payloads=True,
        )
        for path, service in ((self.socket_path, control), (self.data_socket_path, data)):
            await self._listen(path, service)

    async def _listen(self, path: str, service: FramedService) -> None:
        loop = asyncio.get_running_loop()
        # the socket is created owner-only, with no window before a chmod
        old_umask = os.umask(0o177)
        try:
            self._servers.append(await loop.create_unix_server(service.protocol_factory, path))
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)

    @property
    def round(self) -> int | None:
        """The round whose rank credentials are taken (None: none yet)."""
        return self._round

    def open_round(self, round_: int) -> None:
        """Ranks of ``round_`` are starting: from now on only their credentials are taken."""
        self._round = round_
        self._fold.open_round()

    def rank_dead(self, rank: int, reason: str) -> None:
        """The controller declared ``rank`` dead (``DeclareDead``): no host fold waits for it, and
        ``on_rank_dead`` (its agent) makes sure it no longer runs."""
        self._fold.rank_gone(rank, reason)
        if self._on_rank_dead is not None and rank in self._host_ranks:
            self._on_rank_dead(rank, reason)

    def _misbehaved(self, rank: int, reason: str) -> None:
        """The host fold refused what ``rank`` sent: the coordinator learns it as its loss."""
        if self._upstream is not None:
            self._report_gone(self._upstream, rank, reason, refused=True)

    def _rank_key(self, peer: PeerHello) -> bytes:
        """The credential resolver of the rank socket: one rank of this host, in the current
        round."""
        if peer.kind is not CredentialKind.RANK:
            raise HandshakeRefused(
                f"a relay takes rank credentials only, not a {peer.kind.name.lower()} credential"
            )
        if peer.rank not in self._host_ranks:
            raise HandshakeRefused(
                f"rank {peer.rank} does not run on this host (its ranks: "
                f"{sorted(self._host_ranks)})"
            )
        if peer.round != self._round:
            raise HandshakeRefused(
                f"a credential of round {peer.round}, but this host runs round {self._round}"
            )
        return rank_credential_key(
            self._secret, run_id=self._run_id, round=peer.round, rank=peer.rank
        )

    def statistics(self) -> RelayStatistics:
        """What the relay has forwarded, delivered, dropped and refused so far."""
        return RelayStatistics(
            ranks_connected=len(self._ranks),
            forwarded_up=self._forwarded_up,
            delivered_down=self._delivered_down,
            dropped_unaddressed=self._dropped_unaddressed,
            dropped_rank_gone=self._dropped_rank_gone,
            refused_links=self._refused_links,
            data=self._fold.statistics(),
            broadcasts_down=self._broadcasts_down,
            ranks_gone=self._ranks_gone,
        )

    def _refuse(self, why: str) -> None:
        self._refused_links += 1
        log.warning("relay: closing a local rank link: %s", why)

    async def _serve_rank(self, link: FramedProtocol) -> None:
        """One rank's link; returning closes it (the service's ``finally``)."""
        assert link.peer is not None  # the service runs handlers on established links only
        bound = link.peer.rank  # what the credential proved, not what a message says
        hello = await link.recv_message()
        if not isinstance(hello, m.RankHello):
            self._refuse(f"rank {bound} opened with {type(hello).__name__} instead of RankHello")
            return
        if hello.rank != bound:
            self._refuse(
                f"the credential of rank {bound} sent a RankHello claiming rank {hello.rank}"
            )
            return
        current = self._ranks.get(bound)
        if current is not None and not current.is_closing:
            self._refuse(f"rank {bound} is already connected on another link")
            return
        self._ranks[bound] = link
        upstream = self._require_upstream()
        gone, refused = "its link to the relay closed", False
        try:
            self._up(upstream, hello)
            while True:
                try:
                    msg = await link.recv_message()
                except ConnectionClosed as exc:
                    # the rank's side went away: its process ended (the agent reports how)
                    if exc.by_peer:
                        gone = (
                            "its link to the relay closed (the rank exited, crashed or was killed)"
                        )
                    raise
                claimed = rank_of(msg)
                if claimed != bound or type(msg) in RELAY_ONLY:
                    claim = "no rank" if claimed is None else f"rank {claimed}"
                    why = f"the link of rank {bound} sent {type(msg).__name__} claiming {claim}"
                    if type(msg) in RELAY_ONLY:
                        why = (
                            f"the link of rank {bound} sent {type(msg).__name__}, which only a "
                            "relay sends"
                        )
                    self._refuse(why)
                    gone, refused = f"the relay closed its link: {why}", True
                    return
                if isinstance(msg, m.TrainerHello):
                    self._fold.note_hello(msg)
                    self.trainer_ranks.add(bound)
                self._up(upstream, msg)
                await upstream.drain()
        finally:
            if self._ranks.get(bound) is link:
                del self._ranks[bound]
                self._fold.rank_gone(bound, "its control link closed")
                self._report_gone(upstream, bound, gone, refused=refused)

    def _report_gone(
        self, upstream: FramedProtocol, rank: int, reason: str, *, refused: bool
    ) -> None:
        """Rule 4 of the coordinator protocol: a bound rank's closed link is reported up as
        ``RankGone``."""
        if upstream.is_closing:
            return
        with contextlib.suppress(ConnectionClosed, OSError):
            upstream.send(m.RankGone(rank=rank, reason=reason, refused=refused))
            self._ranks_gone += 1

    def _up(self, upstream: FramedProtocol, msg: Message) -> None:
        upstream.send(msg)
        self._forwarded_up += 1

    async def _pump_down(self, upstream: FramedProtocol) -> None:
        while True:
            try:
                msg = await upstream.recv_message()
            except (ConnectionClosed, WireError):
                return  # the controller went away; the session's join link reports it
            if self._upstream_live is not None:
                self._upstream_live = self._upstream_live.heard(asyncio.get_running_loop().time())
            if isinstance(msg, m.Heartbeat) and msg.relay:
                continue  # the echo of our own beat: heard, nothing to deliver
            rank = rank_of(msg)
            if isinstance(msg, m.DeclareDead):
                self.rank_dead(msg.dead_rank, msg.reason)
            elif isinstance(msg, Readmitted):
                self._fold.readmit(msg.readmitted)
            elif isinstance(msg, m.Reduce) and msg.plan is not None:
                # the fold knows the round before any rank can contribute to it
                self._fold.note_round(msg)
                msg = dataclasses.replace(msg, plan=None)
            if rank == EVERY_LOCAL_RANK:
                self._broadcasts_down += 1
                for local in list(self._ranks.values()):
                    if not local.is_closing:
                        with contextlib.suppress(ConnectionClosed, OSError):
                            local.send(msg)
                            self._delivered_down += 1
                continue
            if rank is None:
                self._dropped_unaddressed += 1
                # once per kind: a peer could flood the log otherwise
                if type(msg) not in self._warned:
                    self._warned.add(type(msg))
                    log.warning(
                        "relay: dropping %s from the controller: it is addressed to no rank",
                        type(msg).__name__,
                    )
                continue
            link = self._ranks.get(rank)
            if link is None or link.is_closing:
                self._dropped_rank_gone += 1  # the rank left: nothing to deliver to
                continue
            with contextlib.suppress(ConnectionClosed, OSError):
                link.send(msg)
                self._delivered_down += 1

    async def _beat_upstream(self, upstream: FramedProtocol) -> None:
        """Heartbeats on the upstream control link, both ways, like the join link's
        (:mod:`flodl_async.control.liveness`).

        Each beat names this host's first rank, which is how the controller knows whose link it is.
        The controller echoes it; a controller silent on this link past ``heartbeat_silence`` is
        reported to ``on_upstream_lost`` (the session then stops this host's ranks), and the beats
        stop.
        """
        loop = asyncio.get_running_loop()
        d = self._deadlines
        self._upstream_live = Liveness.start(
            loop.time(), interval=d.heartbeat_interval, silence=d.heartbeat_silence
        )
        first_rank = min(self._host_ranks)
        wake = loop.time()
        while not upstream.is_closing:
            now = loop.time()
            # read afresh each wake: the down pump marks the controller heard in between
            live, due = self._upstream_live.woke(now, meant=wake)
            self._upstream_live = live
            if due is Wake.LOST:
                if self._on_upstream_lost is not None:
                    self._on_upstream_lost(
                        "the relay's upstream control link to the controller was silent for "
                        f"{d.heartbeat_silence:g}s"
                    )
                return
            if due is Wake.BEAT:
                with contextlib.suppress(ConnectionClosed):
                    upstream.send(m.Heartbeat(sent_at=now, rank=first_rank, relay=True))
            wake = live.next_deadline()
            await asyncio.sleep(max(wake - loop.time(), 0.0))

    # ----- the data channel ---------------------------------------------------------------

    async def _dial_data(self) -> FramedProtocol:
        """The host's data connection to the controller (the fold introduces it and raises its
        ceiling)."""
        async with asyncio.timeout(self._deadlines.handshake):
            return await open_framed(
                *self._controller,
                channel=Channel.DATA,
                credential=Credential.session(self._secret),
                expect_run_id=self._run_id,
                limits=HELLO_LIMITS,
                allocate=self._fold.pool.acquire,
            )

    def _require_upstream(self) -> FramedProtocol:
        if self._upstream is None:
            raise RuntimeError("relay not started")
        return self._upstream

    async def aclose(self) -> None:
        """Stop listening, close every rank link and the upstream connections."""
        if self._beats is not None:
            # it may be asleep until its next beat: the session's group must not wait for it
            self._beats.cancel()
        for server in self._servers:
            server.close()
        for link in self._ranks.values():
            link.close()
        await self._fold.aclose(grace=self._deadlines.link_close)
        if self._upstream is not None:
            await self._upstream.aclose(grace=self._deadlines.link_close)
        for path in (self.socket_path, self.data_socket_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
