"""The hosts' links as the controller reads and writes them: each admitted host's join link and
what goes down it, the rendezvous channel, and the control links of its relays.

Theory of operation. The controller registers :meth:`HostLinks.handle_join`,
:meth:`HostLinks.handle_rendezvous` and :meth:`HostLinks.handle_control` as its channel handlers;
each turns what arrives into supervisor events, handed to the controller's dispatch (a join, a
rank's exit, a store address, a host lost) or note (a link bound, heard or closed, for the
supervisor's watch). The supervisor's actions that address a link (tell a host, answer a join,
beat, cut a silent join link, abort a lost host's control links) are carried out here, from the
controller's action table. Nothing here decides anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
from collections.abc import Callable, Collection
from typing import Protocol

from ..agent import RankOutput
from ..config.plan import LaunchPlan
from ..control.supervision import (
    AcceptJoin,
    Event,
    HostLost,
    JoinRequested,
    JoinUndelivered,
    RankConnected,
    RejectJoin,
    StoreReady,
)
from ..control.vocab import Tell
from ..control.watch import (
    AbortLinks,
    ControlLinkClosed,
    ControlLinkNamed,
    CutJoinLink,
    JoinBound,
    JoinHeard,
    LinkEvent,
    RelayBeat,
    SendHeartbeat,
)
from ..errors import ConnectionClosed, WireError
from ..host.cores import oversubscription
from ..host.hostaddrs import routable
from ..host.sockdiag import Endpoint
from ..net.framed import FramedProtocol, tcp_endpoints
from ..net.portstore import PortStore, normalise_host
from ..net.storegate import Standing
from ..wire import messages as m
from ..wire import storeowner as so
from ..wire.handshake import PROTOCOL_VERSION
from ..wire.scalars import Report
from ..wire.schema import Message
from .joinlink import HOST_EVENTS, with_secret_for_token_agent
from .training import TrainingShell

log = logging.getLogger("flodl_async.cli.launch")


class Dispatch(Protocol):
    """The controller's dispatch: one event to the supervisor, its actions carried out now."""

    def __call__(self, event: Event, *, reply_link: FramedProtocol | None = None) -> None:
        """Hand ``event`` over (``reply_link``: the join link a join's answer goes down)."""


class HostLinks:
    """Each admitted host's current join link, and the channel handlers that read the hosts."""

    def __init__(
        self,
        *,
        plan: LaunchPlan,
        output: RankOutput,
        store: PortStore | None,
        dispatch: Dispatch,
        note: Callable[[LinkEvent], None],
        training: Callable[[], TrainingShell | None],
        report: Callable[[Report], None] = lambda msg: None,
    ) -> None:
        self._plan = plan
        self._report = report  # a rank's fa.report scalars: to the run's event stream
        self._output = output
        self._store = store
        self._dispatch = dispatch
        self._note = note
        self._training = training
        #: Each admitted host's join link, from its accept until it is cut for its silence.
        self.links: dict[str, FramedProtocol] = {}
        #: Each admitted host's addresses → its name: whose agent says who made a store connection.
        self._host_at: dict[str, str] = {}
        #: Store-owner questions asked and not yet answered: id → (the host asked, its answer).
        self._asked: dict[int, tuple[str, asyncio.Future[tuple[str, str, str]]]] = {}
        self._ask_ids = itertools.count(1)
        if store is not None:
            store.owner_oracle = self.ask_owner

    def tell(self, action: Tell[str], reply_link: FramedProtocol | None) -> None:
        link = self.links.get(action.to)
        if link is not None:
            # a link that just died: its handler reports HostLost
            with contextlib.suppress(ConnectionClosed):
                link.send(action.message)

    def accept_join(
        self, action: AcceptJoin, reply_link: FramedProtocol | None
    ) -> JoinUndelivered | JoinBound:
        assert reply_link is not None
        try:
            reply_link.send(
                with_secret_for_token_agent(action.reply, reply_link, self._plan.secret)
            )
        except ConnectionClosed:
            return JoinUndelivered(host=action.host)
        self.links[action.host] = reply_link
        if self._store is not None:
            # its ranks dial the store from the same address
            self._store.admit_host(reply_link.peer_host)
            self._host_at[normalise_host(reply_link.peer_host)] = action.host
        return JoinBound(host=action.host)

    def reject_join(self, action: RejectJoin, reply_link: FramedProtocol | None) -> None:
        assert reply_link is not None
        with contextlib.suppress(ConnectionClosed):
            reply_link.send(m.JoinReject(reason=action.reason))

    def send_heartbeat(self, action: SendHeartbeat, reply_link: FramedProtocol | None) -> None:
        link = self.links.get(action.host)
        if link is not None:
            # a link that just died: its reader reports it
            with contextlib.suppress(ConnectionClosed):
                link.send(m.Heartbeat(sent_at=action.sent_at))

    def cut_join_link(self, action: CutJoinLink, reply_link: FramedProtocol | None) -> None:
        link = self.links.pop(action.host, None)
        if link is not None:
            # its reader ends without a second HostLost (the link is no longer the host's)
            link.abort()

    def abort_links(self, action: AbortLinks, reply_link: FramedProtocol | None) -> None:
        for link in action.links:
            link.abort()
        log.info(
            'host "%s" lost: closed its %d control link(s) (relay upstream) with it',
            action.host,
            len(action.links),
        )

    def pass_on_signal(self, signum: int, *, only: Collection[str] | None, trainer: bool) -> str:
        """SIGUSR1/SIGUSR2 to the launcher: to every rank of every joined host (``only``: of these
        hosts: an every-node run's node, whose scheduler signals every node), the run going on;
        returns what was done, for the log.

        Not to Trainer ranks (``trainer``): theirs is the preemption path (a checkpoint, then an
        orderly stop), and a signal they do not handle would end them (SIGUSR1's default action).
        """
        name = signal.Signals(signum).name
        if trainer:
            return f"{name}: not passed on to Trainer ranks (they would die of it); the run goes on"
        hosts = sorted(h for h in self.links if only is None or h in only)
        if not hosts:
            return f"{name}: no host has joined yet; not passed on"
        for host in hosts:
            with contextlib.suppress(ConnectionClosed):  # a link that just died: its reader says so
                self.links[host].send(m.SignalRanks(signal=signum))
        return f"{name}: passed on to the ranks of {', '.join(hosts)}"

    def send_all(self, msg: Message) -> None:
        for link in list(self.links.values()):
            with contextlib.suppress(ConnectionClosed):
                link.send(msg)

    async def handle_join(self, link: FramedProtocol) -> None:
        async with asyncio.timeout(self._plan.deadlines.join_handshake):
            hello = await link.recv_message()
        if not isinstance(hello, m.JoinHello):
            log.warning(
                "join channel: %s opened with %s, not JoinHello; closing",
                link.peer_label,
                type(hello).__name__,
            )
            return
        self._dispatch(
            JoinRequested(
                host=hello.host,
                devices=hello.devices,
                protocol_version=PROTOCOL_VERSION,
                agent_version=hello.agent_version,
                launch=hello.launch,
            ),
            reply_link=link,
        )
        if self.links.get(hello.host) is not link:
            await link.drain()  # refused: the reject is flushed, then the service closes the link
            return
        # this process's own agent: flodl-launch checked it first (launch.warn_oversubscribed)
        crowded = (
            None
            if hello.pid == os.getpid()
            else oversubscription(hello.host, hello.devices, hello.cores)
        )
        if crowded is not None:
            log.warning("%s", crowded)
        # a multi-homed host's ranks may dial the store from any of its addresses
        if self._store is not None:
            for address in routable(hello.addresses):
                self._store.admit_host(address)
                self._host_at.setdefault(normalise_host(address), hello.host)
            # an agent of this host: its ranks are its descendants (before its first StartRanks)
            endpoints = tcp_endpoints(link)
            if endpoints is not None:
                self._store.admit_agent(*endpoints, hello.pid)
        try:
            while True:
                msg = await link.recv_message()
                if self.links.get(hello.host) is link:
                    self._note(JoinHeard(host=hello.host))  # any frame is a sign of life
                if isinstance(msg, m.RankOutput):  # output is I/O, not a supervisor event
                    self._output.receive(hello.host, msg)
                    continue
                if isinstance(msg, so.StoreOwnerAnswer):  # the store's, not the supervisor's
                    self._answered(hello.host, msg)
                    continue
                to_event = HOST_EVENTS.get(type(msg))
                if to_event is not None:
                    self._dispatch(to_event(hello.host, msg))
        except (ConnectionClosed, WireError) as exc:
            # not when the liveness check already cut it off
            if self.links.get(hello.host) is link:
                self._dispatch(HostLost(host=hello.host, reason=str(exc), link_closed=True))

    def ask_owner(self, peer: Endpoint, ours: Endpoint) -> asyncio.Future[tuple[str, str, str]]:
        """Ask the agent of the host ``peer`` is an address of who made the store connection from
        ``peer`` to ``ours`` (the port store's :data:`~flodl_async.net.portstore.OwnerOracle`).

        An address of no linked host, a link that fails, or no answer within the heartbeat
        silence (after which its host is lost anyway) is an unknown owner: refused."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[tuple[str, str, str]] = loop.create_future()
        host = self._host_at.get(normalise_host(peer[0]), "")
        link = self.links.get(host)
        unknown = Standing.OWNER_UNKNOWN.value
        if link is None:
            answer.set_result((unknown, "no agent of that address is linked to the run", host))
            return answer
        query = next(self._ask_ids)
        try:
            link.send(
                so.StoreOwnerQuery(
                    query=query,
                    peer_host=peer[0],
                    peer_port=peer[1],
                    our_host=ours[0],
                    our_port=ours[1],
                )
            )
        except ConnectionClosed:
            answer.set_result((unknown, "its host's agent is gone", host))
            return answer
        self._asked[query] = (host, answer)
        silence = self._plan.deadlines.heartbeat_silence
        timer = loop.call_later(silence, self._unanswered, query)
        answer.add_done_callback(lambda _answer: timer.cancel())
        return answer

    def _answered(self, host: str, msg: so.StoreOwnerAnswer) -> None:
        asked = self._asked.get(msg.query)
        if asked is None or asked[0] != host:
            return  # an agent answers only what its own host was asked
        del self._asked[msg.query]
        if not asked[1].done():
            asked[1].set_result((msg.standing, msg.detail, host))

    def _unanswered(self, query: int) -> None:
        asked = self._asked.pop(query, None)
        if asked is not None and not asked[1].done():
            detail = "its host's agent did not say who made it in time"
            asked[1].set_result((Standing.OWNER_UNKNOWN.value, detail, asked[0]))

    async def handle_rendezvous(self, link: FramedProtocol) -> None:
        while True:
            msg = await link.recv_message()
            if isinstance(msg, m.StoreAddress):
                self._dispatch(
                    StoreReady(round=msg.round, addr=msg.host or link.peer_host, port=msg.port)
                )

    async def handle_control(self, link: FramedProtocol) -> None:
        """A control link: a host's relay upstream (or a rank of its own, under the torch store
        backend).

        Liveness: a relay beats up its link (``Heartbeat(relay=True)``, naming one of its host's
        ranks) and the controller echoes; a relay link silent past ``heartbeat_silence`` loses its
        host, by name, as a silent join link does (:mod:`flodl_async.control.watch`). A link is
        bound to the host of the rank its first beat or RankHello names, and when that host is lost
        for any reason (join link silent or closed, its agent failed) the controller aborts the link
        at once, not at teardown.
        """
        training = self._training()
        assert training is not None
        try:
            while True:
                msg = await link.recv_message()
                if isinstance(msg, m.RankHello):
                    self._note(ControlLinkNamed(link=link, rank=msg.rank))
                    self._dispatch(RankConnected(rank=msg.rank, pid=msg.pid))
                    training.bind_rank(msg.rank, link)
                    link.send(m.RankWelcome(rank=msg.rank, run_id=self._plan.run_id))
                elif isinstance(msg, Report):
                    self._report(msg)
                # the relay's own beat: its link's liveness, no rank's
                elif isinstance(msg, m.Heartbeat) and msg.relay:
                    self._note(RelayBeat(link=link, rank=msg.rank))
                    link.send(m.Heartbeat(sent_at=msg.sent_at, rank=msg.rank, relay=True))
                elif isinstance(msg, m.Heartbeat):
                    link.send(m.Heartbeat(sent_at=msg.sent_at, rank=msg.rank))
                    training.seen(msg.rank)
                else:
                    training.receive(msg, link)  # the Trainer's coordinator protocol
        finally:
            training.link_closed(link)
            self._note(ControlLinkClosed(link=link))
