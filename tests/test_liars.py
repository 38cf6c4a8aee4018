"""A rank that lies about a round, on real sockets: the relay's host fold and the reducer name it.

Two hosts: "a" runs ranks 0 and 1 (its relay folds them), "b" runs rank 2 alone (its frame goes up
as the rank's own bytes, which the reducer checks). Each rank holds a real control link to its
relay (the round's ``Reduce``, with its plan, reaches it there) and a real data link. A test
controller answers the relays' control links and records what comes up (``RankGone``); the real
reducer reports a rank it catches to ``on_misbehaved``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from flodl_async.config.rankenv import RankSpec
from flodl_async.controller.reducer import Reducer
from flodl_async.deadlines import Deadlines
from flodl_async.errors import ConnectionClosed
from flodl_async.net.framed import FramedProtocol, open_framed, open_unix_framed
from flodl_async.net.mux import PortMux
from flodl_async.net.service import FramedService
from flodl_async.relay.control import Relay
from flodl_async.relay.datalink import DataLink
from flodl_async.training.foldmath import schema_specs
from flodl_async.training.modelschema import ModelSchema
from flodl_async.training.outer import OuterAvg
from flodl_async.wire import Channel, Credential
from flodl_async.wire import messages as m
from flodl_async.wire.frame import FrameLimits
from flodl_async.wire.handshake import session_resolver
from flodl_async.wire.schema import Message
from flodl_async.wire.tensor import tensor_bytes

from .trainerwire import spec_wire

RUN = "liar-run"
DIGEST = "e" * 64
HOSTS = {"a": frozenset({0, 1}), "b": frozenset({2})}
SCHEMA = ModelSchema.from_state_dict(
    {"w": torch.zeros(6), "b": torch.zeros(2, dtype=torch.float64)}, ["w", "b"]
)
PLAN = m.RoundPlan(steps=(4, 4, 4), gamma=1.0)


def tensors(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((6,), value), "b": torch.full((2,), value, dtype=torch.float64)}


@dataclass
class Controller:
    """The controller's side of the relays' control links: records what comes up."""

    up: asyncio.Queue[Message] = field(default_factory=asyncio.Queue)
    links: list[FramedProtocol] = field(default_factory=list)

    async def handle(self, link: FramedProtocol) -> None:
        self.links.append(link)
        while True:
            msg = await link.recv_message()
            if isinstance(msg, m.Heartbeat):
                if msg.relay:
                    link.send(m.Heartbeat(sent_at=msg.sent_at, rank=msg.rank, relay=True))
                continue
            if isinstance(msg, m.RankHello):
                link.send(m.RankWelcome(rank=msg.rank, run_id=RUN))
                continue
            await self.up.put(msg)


@dataclass
class Bench:
    reducer: Reducer
    relays: dict[str, Relay]
    controller: Controller
    secret: bytes
    port: int
    told: list[tuple[int, str]]
    told_event: asyncio.Event
    control: dict[int, FramedProtocol] = field(default_factory=dict)
    data: dict[int, DataLink] = field(default_factory=dict)

    async def connect(self, schemas: dict[int, ModelSchema]) -> None:
        """Every rank's control link (it says RankHello, then TrainerHello with the run's model)
        and data link (with ``schemas[rank]``, else the run's model)."""
        for rank in range(3):
            host = next(h for h, ranks in HOSTS.items() if rank in ranks)
            credential = Credential.for_rank(self.secret, run_id=RUN, round=0, rank=rank)
            link = await open_unix_framed(
                self.relays[host].socket_path,
                channel=Channel.CONTROL,
                credential=credential,
                peer_label="relay",
            )
            link.send(m.RankHello(rank=rank, local_rank=rank, world_size=3, pid=100 + rank))
            assert isinstance(await link.recv_message(), m.RankWelcome)
            link.send(
                m.TrainerHello(
                    rank=rank, spec=spec_wire(), digest=DIGEST, model=SCHEMA.to_wire(),
                    model_bytes=SCHEMA.model_bytes, device="cpu",
                )
            )  # fmt: skip
            hello = await self.controller.up.get()  # the relay noted it on its way up
            assert isinstance(hello, m.TrainerHello)
            self.control[rank] = link
            spec = RankSpec(
                run_id=RUN,
                host=host,
                relay_socket="",
                data_socket=self.relays[host].data_socket_path,
                round=0,
                credential_hex=credential.key.hex(),
            )
            schema = schemas.get(rank, SCHEMA)
            self.data[rank] = await DataLink.connect(spec, rank, schema, DIGEST)

    async def open(self, number: int, plan: m.RoundPlan = PLAN) -> None:
        """Open round ``number`` as the controller's shell does, and wait until each rank's relay
        passed its ``Reduce`` on (the relay reads the plan before it forwards)."""
        self.reducer.open_round(number, "model", frozenset({0, 1, 2}), plan=plan)
        for link in self.controller.links:
            link.send(m.Reduce(round=number, kind="model", plan=plan))
        for link in self.control.values():
            reduce = await link.recv_message()
            assert reduce == m.Reduce(round=number, kind="model")  # the ranks get no plan

    async def rank_gone(self) -> m.RankGone:
        while True:
            msg = await self.controller.up.get()
            if isinstance(msg, m.RankGone):
                return msg


@contextlib.asynccontextmanager
async def _bench(
    secret: bytes, *, local: bool, schemas: dict[int, ModelSchema] | None = None
) -> AsyncIterator[Bench]:
    scratch = Path(tempfile.mkdtemp(prefix="fl-liar-", dir="/tmp"))
    mux = PortMux(host="127.0.0.1", port=0)
    told: list[tuple[int, str]] = []
    told_event = asyncio.Event()

    def on_misbehaved(rank: int, reason: str) -> None:
        told.append((rank, reason))
        told_event.set()

    reducer = Reducer(SCHEMA, OuterAvg(), 1.0, digest=DIGEST, on_misbehaved=on_misbehaved)
    controller = Controller()
    try:
        async with asyncio.timeout(60), asyncio.TaskGroup() as tg:
            service = FramedService(
                channel=Channel.CONTROL,
                resolve=session_resolver(secret),
                run_id=RUN,
                handler=controller.handle,
                task_group=tg,
            )
            mux.register(Channel.CONTROL, service.protocol_factory)
            data = reducer.attach(task_group=tg, resolve=session_resolver(secret), run_id=RUN)
            mux.register(Channel.DATA, data.protocol_factory)
            await mux.start()
            relays = {}
            for host, ranks in HOSTS.items():
                relay = Relay(
                    socket_path=str(scratch / f"{host}.sock"),
                    data_socket_path=str(scratch / f"{host}-data.sock"),
                    secret=secret,
                    run_id=RUN,
                    ranks=ranks,
                    controller_host="127.0.0.1",
                    controller_port=mux.port,
                    task_group=tg,
                    deadlines=Deadlines(),
                    host=host,
                    local_reducer=(lambda: reducer) if local else None,
                )
                await relay.start()
                relay.open_round(0)
                relays[host] = relay
            bench = Bench(
                reducer=reducer,
                relays=relays,
                controller=controller,
                secret=secret,
                port=mux.port,
                told=told,
                told_event=told_event,
            )
            try:
                await bench.connect(schemas or {})
                yield bench
            finally:
                for link in bench.control.values():
                    link.close()
                for relay in relays.values():
                    await relay.aclose()
                await reducer.aclose()
                await mux.aclose()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture(params=["tcp", "in-process"])
async def bench(secret: bytes, request: pytest.FixtureRequest) -> AsyncIterator[Bench]:
    async with _bench(secret, local=request.param == "in-process") as b:
        yield b


def _poisoned() -> dict[str, torch.Tensor]:
    t = tensors(1.0)
    t["w"][3] = math.nan
    return t


#: (liar, its tensors, steps, weight, the reason the relay reports)
LIES = {
    "takeover": (1, tensors(0.123), 10**15, 1e15, "rank 1 claimed 10^15 steps in a round planned for 4 (round 1)"),
    "negative": (1, tensors(0.123), -5, 0.0, "rank 1 claimed -5 steps in round 1 (steps are never negative)"),
    "weight": (1, tensors(0.123), 4, 1e300, "rank 1 weighted its contribution to round 1 1e+300, but its 4 steps give 4.0"),
    "poison": (1, _poisoned(), 4, 4.0, "rank 1 sent non-finite parameters in round 1 (tensor 'w')"),
    # the first rank of a fold is kept as bytes until a second arrives: checked when it is folded
    "poison-first": (0, _poisoned(), 4, 4.0, "rank 0 sent non-finite parameters in round 1 (tensor 'w')"),
}  # fmt: skip


@pytest.mark.parametrize("lie", list(LIES))
async def test_a_liar_is_left_out_of_its_hosts_frame_and_named_by_the_relay(
    bench: Bench, lie: str
) -> None:
    liar, lying, steps, weight, why = LIES[lie]
    honest = next(r for r in HOSTS["a"] if r != liar)
    await bench.open(1)
    async with asyncio.timeout(20):
        await bench.data[liar].send(1, "model", lying, steps, weight)
        waiting = [
            asyncio.ensure_future(bench.data[r].contribute(1, "model", tensors(float(r + 1)), steps=4, weight=4.0))
            for r in (honest, 2)
        ]  # fmt: skip
        gone = await bench.rank_gone()
        assert gone == m.RankGone(rank=liar, reason=why, refused=True)
        # the reducer still waits for the liar's host... until the coordinator declares it dead
        assert not any(w.done() for w in waiting)
        bench.reducer.declare_dead(liar)
        results = await asyncio.gather(*waiting)
        done = await bench.reducer.wait_round(1)
    assert done.mass == 8.0
    want = (honest + 1 + 3) / 2  # the two honest ranks' values, equal weights
    for result in results:
        assert result.tensors is not None
        assert torch.equal(result.tensors["w"], torch.full((6,), want))
    assert bench.told == []  # the reducer saw nothing of the liar's


async def test_a_lone_ranks_poison_is_named_by_the_reducer(bench: Bench) -> None:
    await bench.open(1)
    async with asyncio.timeout(20):
        await bench.data[2].send(1, "model", _poisoned(), 4, 4.0)
        waiting = [
            asyncio.ensure_future(bench.data[r].contribute(1, "model", tensors(2.0), steps=4, weight=4.0))
            for r in (0, 1)
        ]  # fmt: skip
        await bench.told_event.wait()
        assert bench.told == [(2, "rank 2 sent non-finite parameters in round 1 (tensor 'w')")]
        bench.reducer.declare_dead(2)
        results = await asyncio.gather(*waiting)
    for result in results:
        assert result.tensors is not None
        assert torch.equal(result.tensors["w"], torch.full((6,), 2.0))


async def test_tensors_other_than_its_own_models_are_the_senders_lie_even_first(
    secret: bytes,
) -> None:
    # the same bytes in another shape: the relay takes the hello, and the frame is what differs
    other = ModelSchema.from_state_dict(
        {"w": torch.zeros(2, 3), "b": torch.zeros(2, dtype=torch.float64)}, ["w", "b"]
    )
    async with _bench(secret, local=True, schemas={1: other}) as b:
        await b.open(1)
        async with asyncio.timeout(20):
            # the liar contributes first: its layout must not become the host's reference
            await b.data[1].send(1, "model", {"w": torch.ones(2, 3), "b": torch.ones(2, dtype=torch.float64)}, 4, 4.0)  # fmt: skip
            gone = await b.rank_gone()
            assert gone.rank == 1
            assert gone.reason.startswith(
                "rank 1's contribution to round 1: tensor 0 is 'w' (float32, shape (2, 3)) but "
                "the model has 'w' (float32, shape (6,)) there"
            )
            b.reducer.declare_dead(1)
            results = await asyncio.gather(
                *(b.data[r].contribute(1, "model", tensors(2.0), steps=4, weight=4.0) for r in (0, 2))
            )  # fmt: skip
        for result in results:
            assert result.tensors is not None
            assert torch.equal(result.tensors["w"], torch.full((6,), 2.0))


async def test_a_contribution_to_a_round_the_relay_never_saw_open_is_a_lie(bench: Bench) -> None:
    await bench.open(1)
    async with asyncio.timeout(20):
        await bench.data[1].send(2, "model", tensors(1.0), 4, 4.0)
        gone = await bench.rank_gone()
    assert gone == m.RankGone(
        rank=1, reason="rank 1 contributed to round 2, which is not open", refused=True
    )


# ----- a host frame that lies (hand-made relays) ----------------------------------------------


@contextlib.asynccontextmanager
async def _reducer(
    secret: bytes,
) -> AsyncIterator[tuple[Reducer, int, asyncio.Queue[tuple[int, str]]]]:
    told: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    reducer = Reducer(SCHEMA, OuterAvg(), 1.0, digest=DIGEST, on_misbehaved=lambda r, why: told.put_nowait((r, why)))  # fmt: skip
    mux = PortMux(host="127.0.0.1", port=0)
    async with asyncio.timeout(60), asyncio.TaskGroup() as tg:
        data = reducer.attach(task_group=tg, resolve=session_resolver(secret), run_id=RUN)
        mux.register(Channel.DATA, data.protocol_factory)
        await mux.start()
        try:
            yield reducer, mux.port, told
        finally:
            await reducer.aclose()
            await mux.aclose()


async def _closed(link: FramedProtocol) -> None:
    """The peer closes ``link`` (what it sent before is read and dropped)."""
    with contextlib.suppress(ConnectionClosed):
        while True:
            await link.recv()
    assert link.is_closing


async def _host(port: int, secret: bytes, host: str, ranks: tuple[int, ...]) -> FramedProtocol:
    link = await open_framed(
        "127.0.0.1",
        port,
        channel=Channel.DATA,
        credential=Credential.session(secret),
        limits=FrameLimits(max_payload=1 << 20),
    )
    link.send(
        m.HostDataHello(host=host, ranks=ranks, model_bytes=SCHEMA.model_bytes, digest=DIGEST)
    )
    assert isinstance(await link.recv_message(), m.DataWelcome)
    return link


async def test_a_host_frame_that_lies_names_the_rank_not_the_host(secret: bytes) -> None:
    async with _reducer(secret) as (reducer, port, told):
        reducer.open_round(1, "model", frozenset({0, 1, 2}), plan=PLAN)
        a = await _host(port, secret, "a", (0, 1))
        b = await _host(port, secret, "b", (2,))
        raw = schema_specs(SCHEMA.tensors)[0]
        parts = [tensor_bytes(t) for t in tensors(0.123).values()]
        # one rank's own frame claims the takeover: its rank is named, and nothing of it counts
        frame = m.HostContribution(
            round=1, kind="model", host="b", ranks=(2,), weight=1e15, prescaled=False,
            tensors=raw, steps=(10**15,),
        )  # fmt: skip
        await b.send_tensors(frame, parts)
        async with asyncio.timeout(20):
            assert await told.get() == (
                2, "rank 2 claimed 10^15 steps in a round planned for 4 (round 1)"
            )  # fmt: skip
        # a folded frame lists a negative step count: the rank that claimed it is named, not the
        # host's first rank (the misattribution the attack found) ...
        acc = schema_specs(SCHEMA.tensors, accumulated=True)[0]
        folded = m.HostContribution(
            round=1, kind="model", host="a", ranks=(0, 1), weight=4.0, prescaled=True,
            tensors=acc, steps=(4, -3),
        )  # fmt: skip
        await a.send_tensors(folded, [tensor_bytes(t.to(torch.float32) if t.dtype == torch.float32 else t) for t in tensors(1.0).values()])  # fmt: skip
        async with asyncio.timeout(20):
            assert await told.get() == (1, "rank 1 claimed -3 steps in round 1 (steps are never negative)")  # fmt: skip
            # ... and a frame that holds an honest rank's work with the lie cannot be kept: that
            # host's data connection closes, as for any frame it cannot take
            await _closed(a)
        assert not b.is_closing  # the other host keeps its connection
        b.close()
