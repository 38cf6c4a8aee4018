"""The relay's explicit rank addressing, on real unix and TCP sockets."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from flodl_async.deadlines import Deadlines
from flodl_async.errors import AuthenticationFailed, ConnectionClosed, HandshakeRefused
from flodl_async.net.framed import FramedProtocol, open_framed, open_unix_framed
from flodl_async.net.mux import PortMux
from flodl_async.net.service import FramedService
from flodl_async.relay.control import RANK_ADDRESS, Relay, rank_of
from flodl_async.wire import Channel, Credential
from flodl_async.wire import messages as m
from flodl_async.wire.handshake import session_resolver
from flodl_async.wire.keys import Direction
from flodl_async.wire.legality import LEGAL_KINDS
from flodl_async.wire.schema import Message


def test_the_table_reads_ranks_and_names_no_rank_for_others() -> None:
    assert rank_of(m.RankHello(rank=3, local_rank=0, world_size=4, pid=1)) == 3
    assert rank_of(m.RankWelcome(rank=2, run_id="r")) == 2
    assert rank_of(m.Heartbeat(sent_at=1.0, rank=1)) == 1
    assert rank_of(m.Finish()) is None


@dataclass
class FakeController:
    """The controller's control channel: records what comes up, welcomes every hello."""

    up: asyncio.Queue[Message] = field(default_factory=asyncio.Queue)
    links: list[FramedProtocol] = field(default_factory=list)

    relay_beats: int = 0
    echo_relay_beats: bool = True

    async def handle(self, link: FramedProtocol) -> None:
        self.links.append(link)
        while True:
            msg = await link.recv_message()
            if (
                isinstance(msg, m.Heartbeat) and msg.relay
            ):  # the relay's own liveness, kept apart from what ranks send
                self.relay_beats += 1
                if self.echo_relay_beats:
                    link.send(m.Heartbeat(sent_at=msg.sent_at, rank=msg.rank, relay=True))
                continue
            await self.up.put(msg)
            if isinstance(msg, m.RankHello):
                link.send(m.RankWelcome(rank=msg.rank, run_id="run"))


RUN = "run"
HOST_RANKS = frozenset({0, 1, 2, 3})


@dataclass
class Bench:
    relay: Relay
    controller: FakeController
    secret: bytes
    port: int

    async def rank_link(
        self, rank: int = 0, *, round: int = 0, credential: Credential | None = None
    ) -> FramedProtocol:
        """Dial the relay's socket as a rank does: with its own credential for its round."""
        credential = credential or Credential.for_rank(
            self.secret, run_id=RUN, round=round, rank=rank
        )
        async with asyncio.timeout(5):
            return await open_unix_framed(
                self.relay.socket_path,
                channel=Channel.CONTROL,
                credential=credential,
                peer_label="relay",
            )

    async def hello(self, rank: int) -> FramedProtocol:
        link = await self.rank_link(rank)
        link.send(m.RankHello(rank=rank, local_rank=rank, world_size=4, pid=100 + rank))
        welcome = await link.recv_message()
        assert welcome == m.RankWelcome(rank=rank, run_id="run")
        return link

    def down(self, msg: Message) -> None:
        self.controller.links[0].send(msg)


@pytest.fixture
async def bench(secret: bytes) -> AsyncIterator[Bench]:
    scratch = Path(tempfile.mkdtemp(prefix="fl-relay-", dir="/tmp"))
    controller = FakeController()
    mux = PortMux(host="127.0.0.1", port=0)
    try:
        async with asyncio.timeout(30), asyncio.TaskGroup() as tg:
            service = FramedService(
                channel=Channel.CONTROL,
                resolve=session_resolver(secret),
                run_id=RUN,
                handler=controller.handle,
                task_group=tg,
            )
            mux.register(Channel.CONTROL, service.protocol_factory)
            await mux.start()
            relay = Relay(
                socket_path=str(scratch / "relay.sock"),
                data_socket_path=str(scratch / "data.sock"),
                secret=secret,
                run_id=RUN,
                ranks=HOST_RANKS,
                controller_host="127.0.0.1",
                controller_port=mux.port,
                task_group=tg,
                deadlines=Deadlines(),
            )
            await relay.start()
            relay.open_round(0)
            try:
                yield Bench(relay=relay, controller=controller, secret=secret, port=mux.port)
            finally:
                await relay.aclose()
                await mux.aclose()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


async def _closed(link: FramedProtocol) -> None:
    """The relay closed ``link`` (anything it delivered before that is read and discarded)."""
    try:
        while True:
            await link.recv_message()
    except ConnectionClosed:
        return


async def test_controller_messages_reach_only_the_rank_they_address(bench: Bench) -> None:
    r0, r1 = await bench.hello(0), await bench.hello(1)
    bench.down(m.Heartbeat(sent_at=1.0, rank=1))
    bench.down(m.Heartbeat(sent_at=2.0, rank=0))
    assert await r1.recv_message() == m.Heartbeat(sent_at=1.0, rank=1)
    assert await r0.recv_message() == m.Heartbeat(sent_at=2.0, rank=0)


def test_every_control_kind_is_rank_addressed() -> None:
    """The wire's table and the relay's agree: a control-channel kind without an address would have nowhere to go."""
    control = (
        LEGAL_KINDS[(Channel.CONTROL, Direction.TO_CONTROLLER)]
        | LEGAL_KINDS[(Channel.CONTROL, Direction.FROM_CONTROLLER)]
    )
    assert control <= set(RANK_ADDRESS)
    assert rank_of(m.Finish(reason="not a control message")) is None


async def test_a_message_for_a_rank_that_is_not_here_is_dropped_and_counted(bench: Bench) -> None:
    r0 = await bench.hello(0)
    bench.down(m.Heartbeat(sent_at=7.0, rank=5))  # addressed, but rank 5 is not here
    bench.down(m.Heartbeat(sent_at=8.0, rank=0))
    assert await r0.recv_message() == m.Heartbeat(
        sent_at=8.0, rank=0
    )  # in order: the one before it was handled
    stats = bench.relay.statistics()
    assert stats.dropped_unaddressed == 0
    assert stats.dropped_rank_gone == 1
    assert stats.delivered_down == 2  # the welcome and the heartbeat


async def test_a_link_claiming_another_rank_is_closed(bench: Bench) -> None:
    r0 = await bench.hello(0)
    assert isinstance(await bench.controller.up.get(), m.RankHello)
    r0.send(m.Heartbeat(sent_at=1.0, rank=0))
    r0.send(m.Heartbeat(sent_at=2.0, rank=3))  # rank 0's link speaking for rank 3
    await _closed(r0)
    assert await bench.controller.up.get() == m.Heartbeat(sent_at=1.0, rank=0)
    gone = (
        await bench.controller.up.get()
    )  # the forged one never went up; the closed link is reported
    assert gone == m.RankGone(
        rank=0,
        reason="the relay closed its link: the link of rank 0 sent Heartbeat claiming rank 3",
        refused=True,
    )
    stats = bench.relay.statistics()
    assert stats.refused_links == 1
    assert stats.ranks_connected == 0


async def test_a_link_must_open_with_rank_hello(bench: Bench) -> None:
    link = await bench.rank_link()
    link.send(m.Heartbeat(sent_at=1.0, rank=0))
    await _closed(link)
    assert bench.relay.statistics().refused_links == 1
    assert bench.controller.up.empty()


async def test_a_bound_rank_cannot_be_claimed_by_a_second_link(bench: Bench) -> None:
    r0 = await bench.hello(0)
    impostor = await bench.rank_link(
        0
    )  # even with rank 0's own credential (a second process holding it)
    impostor.send(m.RankHello(rank=0, local_rank=0, world_size=4, pid=999))
    await _closed(impostor)
    bench.down(m.Heartbeat(sent_at=3.0, rank=0))
    assert await r0.recv_message() == m.Heartbeat(sent_at=3.0, rank=0)  # the first binding holds
    assert bench.relay.statistics().refused_links == 1


# ----- rank-scoped credentials: what a rank's environment can and cannot do ----------------------------


async def test_a_rank_credential_cannot_speak_for_another_rank(bench: Bench) -> None:
    """Rank 1's credential, claiming rank 0's scope: the relay derives rank 0's key, so the proofs fail."""
    own = Credential.for_rank(bench.secret, run_id=RUN, round=0, rank=1)
    posing = Credential(kind=own.kind, key=own.key, round=0, rank=0)
    with pytest.raises(AuthenticationFailed, match="handshake proof did not verify"):
        await bench.rank_link(credential=posing)
    assert bench.relay.statistics().ranks_connected == 0


async def test_a_rank_hello_must_name_the_rank_its_credential_proved(bench: Bench) -> None:
    link = await bench.rank_link(1)
    link.send(m.RankHello(rank=0, local_rank=0, world_size=4, pid=999))
    await _closed(link)
    assert bench.relay.statistics().refused_links == 1
    assert bench.controller.up.empty()


async def test_a_credential_of_an_earlier_round_is_refused(bench: Bench) -> None:
    bench.relay.open_round(1)  # a restart: round 0's ranks are gone, and so are their credentials
    with pytest.raises(HandshakeRefused, match="credential of round 0, but this host runs round 1"):
        await bench.rank_link(0, round=0)
    link = await bench.rank_link(0, round=1)
    await link.aclose()


async def test_a_rank_of_another_host_is_refused(bench: Bench) -> None:
    with pytest.raises(HandshakeRefused, match="rank 7 does not run on this host"):
        await bench.rank_link(7)


async def test_the_relay_socket_takes_no_session_credential(bench: Bench) -> None:
    with pytest.raises(HandshakeRefused, match="rank credentials only"):
        async with asyncio.timeout(5):
            await open_unix_framed(
                bench.relay.socket_path,
                channel=Channel.CONTROL,
                credential=Credential.session(bench.secret),
                peer_label="relay",
            )


async def test_the_controller_port_takes_no_rank_credential(bench: Bench) -> None:
    """A rank's credential on the controller's control channel: refused, by name, before any frame
    (every channel of a real controller: tests/test_launch_operate.py)."""
    credential = Credential.for_rank(bench.secret, run_id=RUN, round=0, rank=0)
    with pytest.raises(HandshakeRefused, match="controller port takes the session secret only"):
        async with asyncio.timeout(5):
            await open_framed(
                "127.0.0.1", bench.port, channel=Channel.CONTROL, credential=credential
            )


async def test_a_rank_key_presented_as_the_session_secret_fails_the_proof(bench: Bench) -> None:
    """The rank's key bytes, claimed as a session credential: the controller's proof does not verify."""
    key = Credential.for_rank(bench.secret, run_id=RUN, round=0, rank=0).key
    for candidate in (
        key[:16],
        key[16:],
    ):  # every 16-byte secret a rank could cut from its 32-byte key
        with pytest.raises(AuthenticationFailed):
            async with asyncio.timeout(5):
                await open_framed(
                    "127.0.0.1",
                    bench.port,
                    channel=Channel.CONTROL,
                    credential=Credential.session(candidate),
                )


# ----- the data channel (the host fold itself: tests/test_averaging.py) ---------------------------------


async def test_the_data_socket_takes_the_same_rank_scoped_credentials(bench: Bench) -> None:
    credential = Credential.for_rank(bench.secret, run_id=RUN, round=0, rank=7)
    with pytest.raises(HandshakeRefused, match="rank 7 does not run on this host"):
        async with asyncio.timeout(5):
            await open_unix_framed(
                bench.relay.data_socket_path,
                channel=Channel.DATA,
                credential=credential,
                peer_label="relay data",
            )


# ----- the Trainer's control rules (the relay's routing of the coordinator protocol, rules 1-4) -----


async def test_a_broadcast_reaches_every_local_rank_once(bench: Bench) -> None:
    r0, r1 = await bench.hello(0), await bench.hello(1)
    bench.down(
        m.Shutdown(reason="training complete", save_reason="completed")
    )  # rank -1: every local rank
    bench.down(
        m.Plan(rank=1, round=1, epoch=0, ranges=((0, 2),), quota=2, hold_after=2, progress=0.0)
    )
    assert await r0.recv_message() == m.Shutdown(
        reason="training complete", save_reason="completed"
    )
    assert await r1.recv_message() == m.Shutdown(
        reason="training complete", save_reason="completed"
    )
    assert isinstance(await r1.recv_message(), m.Plan)  # addressed: rank 1 only
    stats = bench.relay.statistics()
    assert stats.broadcasts_down == 1
    assert stats.dropped_unaddressed == 0


async def test_a_closed_rank_link_is_reported_up_as_rank_gone(bench: Bench) -> None:
    r1 = await bench.hello(1)
    assert isinstance(await bench.controller.up.get(), m.RankHello)
    await r1.aclose(grace=1.0)
    gone = await bench.controller.up.get()
    assert isinstance(gone, m.RankGone)
    assert gone.rank == 1
    assert gone.reason.startswith("its link to the relay closed")
    assert bench.relay.statistics().ranks_gone == 1


async def test_a_rank_cannot_send_rank_gone(bench: Bench) -> None:
    r0 = await bench.hello(0)
    assert isinstance(await bench.controller.up.get(), m.RankHello)
    r0.send(m.RankGone(rank=0, reason="forged"))
    await _closed(r0)
    gone = await bench.controller.up.get()
    assert gone == m.RankGone(
        rank=0,
        reason="the relay closed its link: the link of rank 0 sent RankGone, which only a relay sends",
        refused=True,
    )
    assert bench.relay.statistics().refused_links == 1


async def test_trainer_frames_are_rank_checked_and_forwarded_both_ways(bench: Bench) -> None:
    from .trainerwire import CONTROL_UP

    r1 = await bench.hello(1)
    assert isinstance(await bench.controller.up.get(), m.RankHello)
    trainer_hello = CONTROL_UP[0]
    assert isinstance(trainer_hello, m.TrainerHello)
    r1.send(trainer_hello)
    assert await bench.controller.up.get() == trainer_hello  # read, and forwarded
    bench.down(m.DeclareDead(dead_rank=3, reason="heartbeat timeout"))
    assert await r1.recv_message() == m.DeclareDead(dead_rank=3, reason="heartbeat timeout")
    r1.send(
        m.WindowDone(
            rank=2,
            round=1,
            epoch=0,
            batches=1,
            samples=1,
            compute_ms=1.0,
            data_ms=0.0,
            loss_sum=0.0,
        )
    )  # for another rank
    await _closed(r1)
    assert bench.relay.statistics().refused_links == 1
