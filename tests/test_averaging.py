"""CPU averaging over real sockets: rank DataLinks → relays (host fold) → the reducer → back.

The averaging the system does is compared with a reference the test computes from the same
contributions, replaying the documented arithmetic (flodl_async.training.foldmath): host fold
``accH = 0; accH.add_(t, alpha=w)`` per rank in ascending order (a lone rank goes up raw),
then ``acc = 0; acc.add_(accH)`` / ``acc.add_(t, alpha=w)`` per host by lowest rank,
``acc.div_(Σw)``, round half-to-even for integers, cast back; then the outer step.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from flodl_async.agent import RankOutput
from flodl_async.config.cluster import DeviceSpec, WorkerSpec
from flodl_async.config.rankenv import RankSpec
from flodl_async.control.membership import JoinConfig
from flodl_async.controller import Controller, LaunchPlan, PlacedWorker, Placement
from flodl_async.controller.reducer import Reducer
from flodl_async.deadlines import Deadlines
from flodl_async.errors import ConnectionClosed, WireError
from flodl_async.net.framed import FramedProtocol, open_framed
from flodl_async.net.mux import PortMux
from flodl_async.net.service import FramedService
from flodl_async.relay.control import Relay
from flodl_async.relay.datalink import ConsensusResult, DataLink
from flodl_async.relay.fold import ROUNDS_IN_FLIGHT
from flodl_async.training.modelschema import ModelSchema
from flodl_async.training.outer import DiLoCo, OuterAvg, OuterSpec, SlowMo
from flodl_async.wire import Channel, Credential
from flodl_async.wire import messages as m
from flodl_async.wire.frame import FrameLimits
from flodl_async.wire.handshake import session_resolver
from flodl_async.wire.tensor import tensor_bytes

RUN = "avg-run"
DIGEST = "d" * 64
#: Two hosts: "a" runs ranks 0 and 1 (the relay folds), "b" runs rank 2 alone (forwarded as bytes).
HOSTS = {"a": frozenset({0, 1}), "b": frozenset({2})}


def _state() -> dict[str, torch.Tensor]:
    """A state_dict over the dtype matrix: params of four float dtypes, buffers int64/bool/0-d/empty, one tied key."""
    w32 = torch.zeros(3, 4)
    return {
        "w32": w32,
        "w64": torch.zeros(5, dtype=torch.float64),
        "wbf16": torch.zeros(7, dtype=torch.bfloat16),
        "wf16": torch.zeros(2, 3, dtype=torch.float16),
        "tied": w32,  # the same tensor under a second key
        "count": torch.zeros(4, dtype=torch.int64),
        "flag": torch.zeros(3, dtype=torch.bool),
        "scalar": torch.zeros(()),
        "empty": torch.zeros(0),
    }


SCHEMA = ModelSchema.from_state_dict(_state(), ["w32", "w64", "wbf16", "wf16"])


def _tensors(
    rank: int, *, scale: float = 1.0, schema: ModelSchema = SCHEMA
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    out: dict[str, torch.Tensor] = {}
    for meta in schema.tensors:
        dtype = getattr(torch, meta.dtype)
        if meta.dtype == "int64":
            out[meta.name] = torch.randint(-50, 50, meta.shape, generator=g, dtype=torch.int64)
        elif meta.dtype == "bool":
            out[meta.name] = torch.randint(0, 2, meta.shape, generator=g).to(torch.bool)
        else:
            out[meta.name] = (torch.randn(meta.shape, generator=g, dtype=torch.float64) * scale).to(
                dtype
            )
    return out


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 or not dtype.is_floating_point else torch.float32


def reference(
    contributions: Mapping[int, tuple[dict[str, torch.Tensor] | None, float]],
    schema: ModelSchema = SCHEMA,
) -> tuple[float, dict[str, torch.Tensor] | None]:
    """The documented arithmetic, replayed: (mass, consensus) from each rank's (tensors, weight)."""
    mass, out, _divided = reference_parts(contributions, schema)
    return mass, out


def reference_parts(
    contributions: Mapping[int, tuple[dict[str, torch.Tensor] | None, float]],
    schema: ModelSchema = SCHEMA,
) -> tuple[float, dict[str, torch.Tensor] | None, dict[str, torch.Tensor]]:
    """(mass, consensus, the divided accumulators before rounding and casting back)."""
    frames: list[
        tuple[str, dict[str, torch.Tensor], float | None]
    ] = []  # (kind, tensors, weight-or-None for prescaled)
    mass = 0.0
    for ranks in sorted(HOSTS.values(), key=min):
        host = sorted(r for r in ranks if r in contributions)
        host_weight = 0.0
        for r in host:
            host_weight += contributions[r][1]
        mass += host_weight
        full = [r for r in host if contributions[r][0] is not None]
        if len(full) == 1:
            tensors = contributions[full[0]][0]
            assert tensors is not None
            frames.append(("raw", tensors, contributions[full[0]][1]))
        elif len(full) > 1:
            folded = {}
            for meta in schema.tensors:
                acc = torch.zeros(meta.shape, dtype=_acc_dtype(getattr(torch, meta.dtype)))
                for r in full:
                    t, w = contributions[r]
                    assert t is not None
                    acc.add_(t[meta.name], alpha=w)
                folded[meta.name] = acc
            frames.append(("prescaled", folded, None))
    if mass == 0:
        return 0.0, None, {}
    out, divided = {}, {}
    for meta in schema.tensors:
        dtype = getattr(torch, meta.dtype)
        acc = torch.zeros(meta.shape, dtype=_acc_dtype(dtype))
        for _kind, tensors, w in frames:
            if w is None:
                acc.add_(tensors[meta.name])
            else:
                acc.add_(tensors[meta.name], alpha=w)
        acc.div_(mass)
        divided[meta.name] = acc.clone()
        if not dtype.is_floating_point:
            acc = acc.round()
        out[meta.name] = (acc != 0) if dtype == torch.bool else acc.to(dtype)
    return mass, out, divided


def outer_reference(
    spec: OuterSpec,
    rounds: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]],
    schema: ModelSchema = SCHEMA,
) -> list[dict[str, torch.Tensor]]:
    """The outer step by hand on each round's (consensus, divided accumulators): the step runs on the divided
    float32 (float64) values, before the cast back; params only, buffers pass through; the
    previous global is what ranks adopt (after the cast)."""
    prev: dict[str, torch.Tensor] | None = None
    velocity: dict[str, torch.Tensor] = {}
    out = []
    for c, divided in rounds:
        new = dict(c)
        if isinstance(spec, OuterAvg):
            out.append(new)
            continue
        for name in schema.param_names:
            cw = divided[name]
            if prev is None:
                new[name] = cw.to(c[name].dtype)
                continue
            p = prev[name]
            g = p - cw
            v = g.clone() if name not in velocity else velocity[name] * spec.momentum + g
            velocity[name] = v
            step = v if isinstance(spec, SlowMo) else spec.momentum * v + g
            new[name] = (p - spec.lr * step).to(c[name].dtype)
        prev = {name: new[name].to(_acc_dtype(new[name].dtype)) for name in schema.param_names}
        out.append(new)
    return out


def _assert_equal(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype, name
        assert torch.equal(g, w), f"{name}: {g} != {w}"


# ----- the bench: a real mux + reducer, two real relays, real rank DataLinks -------------------------


@dataclass
class Bench:
    reducer: Reducer
    relays: dict[str, Relay]
    secret: bytes
    port: int
    scratch: Path
    local: bool
    schema: ModelSchema = SCHEMA

    def spec(self, rank: int) -> RankSpec:
        host = next(h for h, ranks in HOSTS.items() if rank in ranks)
        key = Credential.for_rank(self.secret, run_id=RUN, round=0, rank=rank).key
        return RankSpec(
            run_id=RUN,
            host=host,
            relay_socket="",
            data_socket=self.relays[host].data_socket_path,
            round=0,
            credential_hex=key.hex(),
        )

    async def links(self, ranks: list[int]) -> dict[int, DataLink]:
        async with asyncio.timeout(20):
            made = await asyncio.gather(
                *(DataLink.connect(self.spec(r), r, self.schema, DIGEST) for r in ranks)
            )
        return dict(zip(ranks, made, strict=True))

    async def host_link(self, hello: m.HostDataHello | None = None) -> FramedProtocol:
        """A hand-made relay: the session credential on the data channel (big send limits), optionally introduced."""
        async with asyncio.timeout(10):
            link = await open_framed(
                "127.0.0.1",
                self.port,
                channel=Channel.DATA,
                credential=Credential.session(self.secret),
                limits=FrameLimits(max_payload=1 << 26),
            )
        if hello is not None:
            link.send(hello)
            async with asyncio.timeout(10):
                welcome = await link.recv_message()
            assert isinstance(welcome, m.DataWelcome)
        return link


async def _control(link: FramedProtocol) -> None:
    while True:
        await link.recv_message()  # the relays' control upstream: nothing to answer in these tests


@contextlib.asynccontextmanager
async def _bench(
    secret: bytes,
    outer: OuterSpec | None = None,
    gamma: float = 1.0,
    *,
    local: bool = False,
    schema: ModelSchema = SCHEMA,
) -> AsyncIterator[Bench]:
    """``local``: the relays are handed the reducer in this process and pass frames over in memory (the launcher's
    own host); otherwise they dial its port like a remote host's relay (TCP, sealed payloads)."""
    scratch = Path(tempfile.mkdtemp(prefix="fl-avg-", dir="/tmp"))
    mux = PortMux(host="127.0.0.1", port=0)
    reducer = Reducer(schema, outer or OuterAvg(), gamma, digest=DIGEST)
    try:
        async with asyncio.timeout(90), asyncio.TaskGroup() as tg:
            control = FramedService(
                channel=Channel.CONTROL,
                resolve=session_resolver(secret),
                run_id=RUN,
                handler=_control,
                task_group=tg,
            )
            mux.register(Channel.CONTROL, control.protocol_factory)
            mux.register(
                Channel.DATA,
                reducer.attach(
                    task_group=tg, resolve=session_resolver(secret), run_id=RUN
                ).protocol_factory,
            )
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
            try:
                yield Bench(
                    reducer=reducer,
                    relays=relays,
                    secret=secret,
                    port=mux.port,
                    scratch=scratch,
                    local=local,
                    schema=schema,
                )
            finally:
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


async def _round(
    bench: Bench,
    links: dict[int, DataLink],
    number: int,
    contributions: Mapping[int, tuple[dict[str, torch.Tensor] | None, float]],
    kind: str = "model",
) -> tuple[float, dict[int, ConsensusResult]]:
    bench.reducer.open_round(number, kind, frozenset(contributions))
    async with asyncio.timeout(30):
        results = await asyncio.gather(
            *(
                links[r].contribute(number, kind, t, steps=int(w), weight=w)
                for r, (t, w) in contributions.items()
            ),
        )
        done = await bench.reducer.wait_round(number)
    assert done.round == number
    assert done.kind == kind
    return done.mass, dict(zip(contributions, results, strict=True))


async def _read_until_closed(link: FramedProtocol) -> None:
    while True:
        await link.recv()


# ----- the tests -------------------------------------------------------------------------------------


async def test_a_round_equals_the_reference_for_every_dtype(bench: Bench) -> None:
    links = await bench.links([0, 1, 2])
    contributions = {0: (_tensors(0), 1.0), 1: (_tensors(1), 3.0), 2: (_tensors(2), 2.0)}
    mass, results = await _round(bench, links, 1, contributions)
    want_mass, want = reference(contributions)
    assert want is not None
    assert mass == want_mass == 6.0
    for result in results.values():
        assert result.mass == mass
        assert result.tensors is not None
        _assert_equal(result.tensors, want)
    last = bench.reducer.last_consensus
    assert last is not None
    _assert_equal(last, want)
    assert last["tied"] is last["w32"]  # the full state_dict, aliases included
    copied = await bench.reducer.copy_consensus()
    assert copied is not None
    _assert_equal(copied, last)
    assert copied["w32"].data_ptr() != last["w32"].data_ptr()  # each call is its own copy
    stats = {host: relay.statistics().data for host, relay in bench.relays.items()}
    assert (stats["a"].folded, stats["a"].forwarded_raw) == (
        1,
        0,
    )  # two ranks: folded into one host frame
    assert (stats["b"].folded, stats["b"].forwarded_raw) == (0, 1)  # one rank: its bytes, untouched
    assert stats["a"].delivered_down == 2
    reducer = bench.reducer.statistics()
    assert (reducer.hosts, reducer.in_process_hosts, reducer.rounds_completed) == (
        2,
        2 if bench.local else 0,
        1,
    )
    # Each host's uplink: which path it took, one frame each; b's one rank went up raw, a's fold as its accumulator.
    assert [(u.host, u.ranks, u.in_process, u.frames) for u in reducer.uplinks] == [
        ("a", (0, 1), bench.local, 1),
        ("b", (2,), bench.local, 1),
    ]
    assert reducer.uplinks[1].payload_bytes == bench.reducer.schema.model_bytes
    assert reducer.uplinks[0].payload_bytes > 0
    for link in links.values():
        await link.aclose()


async def test_several_rounds_reuse_pooled_buffers_and_stay_exact(bench: Bench) -> None:
    links = await bench.links([0, 1, 2])
    for number in range(1, 5):
        contributions = {
            r: (_tensors(10 * number + r, scale=number), float(r + number)) for r in range(3)
        }
        _mass, results = await _round(bench, links, number, contributions)
        _m, want = reference(contributions)
        assert want is not None
        for result in results.values():
            assert result.tensors is not None
            _assert_equal(result.tensors, want)
        del results
    assert bench.reducer.pool.statistics().hits > 0  # steady rounds stop allocating
    for link in links.values():
        await link.aclose()


async def test_integer_buffers_round_half_to_even_and_bools_take_the_weighted_majority(
    bench: Bench,
) -> None:
    links = await bench.links([0, 1, 2])
    base = [_tensors(r) for r in range(3)]
    base[0]["count"] = torch.tensor([1, 2, 3, -3])
    base[1]["count"] = torch.tensor([2, 3, 4, -4])
    base[0]["flag"] = torch.tensor([True, True, False])
    base[1]["flag"] = torch.tensor([False, True, False])
    contributions = {0: (base[0], 1.0), 1: (base[1], 1.0), 2: (None, 0.0)}
    _mass, results = await _round(bench, links, 1, contributions)
    got = results[2].tensors
    assert got is not None
    assert got["count"].tolist() == [
        2,
        2,
        4,
        -4,
    ]  # 1.5 → 2, 2.5 → 2, 3.5 → 4, -3.5 → -4: half to even
    assert got["flag"].tolist() == [False, True, False]  # a tie (0.5) rounds to even: False
    for link in links.values():
        await link.aclose()


async def test_an_init_round_is_the_roots_state_exactly(bench: Bench) -> None:
    links = await bench.links([0, 1, 2])
    root = _tensors(7)
    _mass, results = await _round(
        bench, links, 0, {0: (root, 1.0), 1: (None, 0.0), 2: (None, 0.0)}, kind="init"
    )
    for result in results.values():
        assert result.tensors is not None
        _assert_equal(result.tensors, root)
    assert (
        bench.relays["a"].statistics().data.forwarded_raw == 1
    )  # only the root had tensors: no fold, no torch math
    for link in links.values():
        await link.aclose()


async def test_mass_zero_sends_no_payload_and_keeps_the_last_consensus(bench: Bench) -> None:
    links = await bench.links([0, 1, 2])
    contributions = {0: (_tensors(0), 1.0), 1: (_tensors(1), 1.0), 2: (_tensors(2), 1.0)}
    await _round(bench, links, 1, contributions)
    before = bench.reducer.last_consensus
    mass, results = await _round(
        bench, links, 2, {0: (_tensors(3), 0.0), 1: (None, 0.0), 2: (None, 0.0)}
    )
    assert mass == 0.0
    assert all(r.mass == 0.0 and r.tensors is None for r in results.values())
    after = bench.reducer.last_consensus
    assert before is not None
    assert after is not None
    _assert_equal(after, before)
    for link in links.values():
        await link.aclose()


async def test_a_dead_rank_releases_the_round_at_the_relay_and_at_the_reducer(bench: Bench) -> None:
    links = await bench.links([0, 1, 2])
    bench.reducer.open_round(1, "model", frozenset({0, 1, 2}))
    t0, t2 = _tensors(0), _tensors(2)
    async with asyncio.timeout(30):
        await links[0].send(1, "model", t0, steps=2, weight=2.0)
        await links[2].send(1, "model", t2, steps=1, weight=1.0)
        await links[1].aclose()  # rank 1 dies mid-round: its relay no longer waits for it
        bench.reducer.declare_dead(1)
        done = await bench.reducer.wait_round(1)
        r0 = await links[0].receive(1)
        r2 = await links[2].receive(1)
    _mass, want = reference({0: (t0, 2.0), 2: (t2, 1.0)})
    assert done.mass == 3.0
    assert want is not None
    for result in (r0, r2):
        assert result.tensors is not None
        _assert_equal(result.tensors, want)
    await links[0].aclose()
    await links[2].aclose()


async def test_a_rank_that_never_contributes_is_released_by_declare_dead(bench: Bench) -> None:
    links = await bench.links([0, 1])
    bench.reducer.open_round(1, "model", frozenset({0, 1, 2}))
    async with asyncio.timeout(30):
        await asyncio.gather(
            links[0].send(1, "model", _tensors(0), steps=1, weight=1.0),
            links[1].send(1, "model", _tensors(1), steps=1, weight=1.0),
        )
        waiting = asyncio.ensure_future(bench.reducer.wait_round(1))
        await asyncio.sleep(0)
        assert not waiting.done()
        bench.relays["b"].rank_dead(2, "declared dead")
        bench.reducer.declare_dead(2)
        done = await waiting
        result = await links[0].receive(1)
    assert done.mass == 2.0
    _m, want = reference({0: (_tensors(0), 1.0), 1: (_tensors(1), 1.0)})
    assert want is not None
    assert result.tensors is not None
    _assert_equal(result.tensors, want)
    for link in links.values():
        await link.aclose()


async def test_a_rank_listed_twice_closes_that_connection(
    bench: Bench, caplog: pytest.LogCaptureFixture
) -> None:
    links = await bench.links([0, 1])
    bench.reducer.open_round(1, "model", frozenset({0, 1, 2}))
    async with asyncio.timeout(30):
        await asyncio.gather(
            links[0].send(1, "model", _tensors(0), steps=1, weight=1.0),
            links[1].send(1, "model", _tensors(1), steps=1, weight=1.0),
        )
        rogue = await bench.host_link(
            m.HostDataHello(host="rogue", ranks=(2,), model_bytes=SCHEMA.model_bytes, digest=DIGEST)
        )
        rogue.send(
            m.HostContribution(
                round=1,
                kind="model",
                host="rogue",
                ranks=(2, 2),
                weight=0.0,
                prescaled=False,
                steps=(0, 0),
            )
        )
        with pytest.raises(ConnectionClosed):
            await _read_until_closed(rogue)
    assert "lists rank 2, which is already covered in this round" in caplog.text
    # the round still waits for rank 2: nothing of the rogue frame counted
    bench.reducer.declare_dead(2)
    async with asyncio.timeout(10):
        assert (await bench.reducer.wait_round(1)).mass == 2.0
    for link in links.values():
        await link.aclose()


async def test_a_rank_running_rounds_ahead_of_its_host_is_refused(
    bench: Bench, caplog: pytest.LogCaptureFixture
) -> None:
    links = await bench.links(
        [0]
    )  # rank 1 (same host) never contributes: every round of rank 0 waits for it at the relay
    async with asyncio.timeout(30):
        for number in range(1, ROUNDS_IN_FLIGHT + 1):
            await links[0].send(number, "model", _tensors(0), steps=1, weight=1.0)
        await links[0].send(ROUNDS_IN_FLIGHT + 1, "model", _tensors(0), steps=1, weight=1.0)
        with pytest.raises(ConnectionClosed):
            await links[0].receive(1)
    assert (
        f"earlier rounds of it still waiting for this host's other ranks (at most {ROUNDS_IN_FLIGHT})"
        in caplog.text
    )
    assert bench.relays["a"].statistics().data.refused_links == 1
    await links[0].aclose()


@pytest.mark.parametrize(
    ("hello", "said"),
    [
        (
            m.HostDataHello(
                host="x", ranks=(5,), model_bytes=SCHEMA.model_bytes + 1, digest=DIGEST
            ),
            "model, this run's is",
        ),
        (
            m.HostDataHello(host="x", ranks=(5,), model_bytes=SCHEMA.model_bytes, digest="e" * 64),
            "Trainer digest",
        ),
    ],
)
async def test_a_hello_that_does_not_match_the_model_is_refused(
    bench: Bench, caplog: pytest.LogCaptureFixture, hello: m.HostDataHello, said: str
) -> None:
    link = await bench.host_link()
    link.send(hello)
    with pytest.raises(ConnectionClosed):
        async with asyncio.timeout(10):
            await link.recv()
    assert said in caplog.text


async def test_no_tensor_frame_is_taken_before_the_hello(bench: Bench) -> None:
    link = await bench.host_link()
    spec = m.TensorSpec(name="w32", dtype="float32", shape=(3, 4), offset=0, nbytes=48)
    await link.send_tensors(
        m.HostContribution(
            round=1,
            kind="model",
            host="x",
            ranks=(0,),
            weight=1.0,
            prescaled=False,
            tensors=(spec,),
        ),
        [b"\0" * 48],
    )
    with pytest.raises(ConnectionClosed):
        async with asyncio.timeout(10):
            await link.recv()


async def test_tensor_names_are_validated_against_the_schema(
    bench: Bench, caplog: pytest.LogCaptureFixture
) -> None:
    bench.reducer.open_round(1, "model", frozenset({5}))
    link = await bench.host_link(
        m.HostDataHello(host="x", ranks=(5,), model_bytes=SCHEMA.model_bytes, digest=DIGEST)
    )
    t = _tensors(0)
    t["w64x"] = t.pop("w64")
    specs, parts, offset = [], [], 0
    for meta in SCHEMA.tensors:
        name = "w64x" if meta.name == "w64" else meta.name
        view = tensor_bytes(t[name])
        specs.append(
            m.TensorSpec(
                name=name, dtype=meta.dtype, shape=meta.shape, offset=offset, nbytes=view.nbytes
            )
        )
        parts.append(view)
        offset += view.nbytes
    msg = m.HostContribution(
        round=1,
        kind="model",
        host="x",
        ranks=(5,),
        weight=1.0,
        prescaled=False,
        tensors=tuple(specs),
        steps=(1,),
    )
    await link.send_tensors(msg, parts)
    with pytest.raises(ConnectionClosed):
        async with asyncio.timeout(10):
            await link.recv()
    assert "tensor 1 is 'w64x'" in caplog.text


async def test_weights_disagreeing_with_steps_to_the_gamma_are_refused(
    bench: Bench, caplog: pytest.LogCaptureFixture
) -> None:
    links = await bench.links([2])
    bench.reducer.open_round(1, "model", frozenset({0, 1, 2}))
    await links[2].send(1, "model", _tensors(2), steps=4, weight=2.0)  # gamma 1 says 4.0
    with pytest.raises(
        ConnectionClosed
    ):  # the reducer closed host b's connection; its relay closes the rank's link
        async with asyncio.timeout(10):
            await links[2].receive(1)
    assert "gamma 1 give 4.0" in caplog.text
    await links[2].aclose()


async def test_a_from_controller_round_sends_the_held_consensus(bench: Bench) -> None:
    initial = _tensors(11)
    initial["tied"] = initial["w32"]
    bench.reducer.set_initial(initial)
    links = await bench.links([0, 1, 2])
    bench.reducer.open_round(0, "init", frozenset({0, 1, 2}), from_controller=True)
    async with asyncio.timeout(30):
        results = await asyncio.gather(*(link.receive(0) for link in links.values()))
        done = await bench.reducer.wait_round(0)
    assert done.mass == 1.0
    for result in results:
        assert result.tensors is not None
        _assert_equal(result.tensors, {k: v for k, v in initial.items() if k != "tied"})
    for link in links.values():
        await link.aclose()


@pytest.mark.parametrize("local", [False, True], ids=["tcp", "in-process"])
@pytest.mark.parametrize(
    "outer", [SlowMo(lr=0.5, momentum=0.9), DiLoCo(lr=0.7, momentum=0.9)], ids=["slowmo", "diloco"]
)
async def test_outer_steps_through_the_reducer_equal_the_reference(
    secret: bytes, outer: OuterSpec, local: bool
) -> None:
    async with _bench(secret, outer=outer, local=local) as bench:
        links = await bench.links([0, 1, 2])
        plain: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
        got: list[dict[str, torch.Tensor]] = []
        for number in range(1, 5):
            contributions = {
                r: (_tensors(100 * number + r, scale=1.0 / number), float(1 + r)) for r in range(3)
            }
            _mass, results = await _round(bench, links, number, contributions)
            _m, want, divided = reference_parts(contributions)
            assert want is not None
            plain.append((want, divided))
            tensors = results[0].tensors
            assert tensors is not None
            got.append({k: v.clone() for k, v in tensors.items()})
            for other in results.values():
                assert other.tensors is not None
                _assert_equal(other.tensors, got[-1])
            del results
        for number, (g, w) in enumerate(zip(got, outer_reference(outer, plain), strict=True)):
            _assert_equal(g, w)
            if number >= 1:
                assert not torch.equal(
                    g["w32"], plain[number][0]["w32"]
                )  # the outer optimizer did move the params
        for link in links.values():
            await link.aclose()


#: A few MiB over the dtypes that take the fold's math paths (float32 4 MiB, bf16 1 MiB cast, int64 rounded, bool).
BIG_SCHEMA = ModelSchema.from_state_dict(
    {
        "w32": torch.zeros(1 << 20),
        "wbf16": torch.zeros(1 << 19, dtype=torch.bfloat16),
        "count": torch.zeros(1 << 16, dtype=torch.int64),
        "flag": torch.zeros(1 << 12, dtype=torch.bool),
    },
    ["w32", "wbf16"],
)


@pytest.mark.parametrize("local", [False, True], ids=["tcp", "in-process"])
async def test_the_fold_and_average_math_runs_off_the_event_loop_thread(
    secret: bytes, monkeypatch: pytest.MonkeyPatch, local: bool
) -> None:
    """Tensor math stays off the event loop: the relay's fold, the reducer's sums, divide, round, cast and outer step run in executor threads.

    The real functions run (the result equals the reference); the wrappers only note the thread they ran on.
    """
    from flodl_async.training import foldmath
    from flodl_async.training.outer import OuterStepper

    ran_on: dict[str, list[threading.Thread]] = {}

    def recorded(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            ran_on.setdefault(name, []).append(threading.current_thread())
            return real(*args, **kwargs)

        return wrapper

    for name in ("add_term", "torch_mul", "finish"):
        monkeypatch.setattr(foldmath, name, recorded(name, getattr(foldmath, name)))
    monkeypatch.setattr(OuterStepper, "step", recorded("outer step", OuterStepper.step))
    loop_thread = threading.current_thread()  # the event loop's: this coroutine runs on it
    outer = SlowMo(lr=0.5, momentum=0.9)
    async with _bench(secret, outer=outer, local=local, schema=BIG_SCHEMA) as bench:
        links = await bench.links([0, 1, 2])
        plain: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
        got: list[dict[str, torch.Tensor]] = []
        for number in (1, 2):  # the second round is SlowMo's first real step
            contributions = {
                r: (_tensors(7 * number + r, schema=BIG_SCHEMA), float(1 + r)) for r in range(3)
            }
            _mass, results = await _round(bench, links, number, contributions)
            _m, want, divided = reference_parts(contributions, BIG_SCHEMA)
            assert want is not None
            plain.append((want, divided))
            tensors = results[2].tensors
            assert tensors is not None
            got.append({k: v.clone() for k, v in tensors.items()})
            del results
        for link in links.values():
            await link.aclose()
    for g, w in zip(got, outer_reference(outer, plain, BIG_SCHEMA), strict=True):
        _assert_equal(g, w)  # the real math ran
    assert {"add_term", "finish", "outer step"} <= ran_on.keys(), (
        ran_on.keys()
    )  # relay fold + reducer sums, divide/round/cast, outer step
    on_loop = {name for name, threads in ran_on.items() if loop_thread in threads}
    assert not on_loop, f"tensor math on the event loop's thread: {on_loop}"


class _Said(logging.Handler):
    """Sets an event when a log line containing ``needle`` is emitted (same thread as the loop)."""

    def __init__(self, needle: str) -> None:
        super().__init__()
        self.needle = needle
        self.event = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.event.set()


async def test_the_controller_serves_the_data_channel_only_once_a_reducer_is_installed(
    secret: bytes,
) -> None:
    plan = LaunchPlan(
        run_id=RUN,
        secret=secret,
        bind_host="127.0.0.1",
        port=0,
        join=JoinConfig(min_rank_start=1, join_timeout=60, target_ranks=1, max_join_timeout=60),
        workers=(
            PlacedWorker(
                spec=WorkerSpec(host="elsewhere", devices=DeviceSpec.cpu(1)),
                placement=Placement.DIAL_IN,
            ),
        ),
        command=("true",),
        deadlines=Deadlines(stop_grace=1.0, teardown_margin=1.0),
    )
    controller = Controller(plan, output=RankOutput(stdout=io.BytesIO(), stderr=io.BytesIO()))  # type: ignore[arg-type]
    said = _Said("window open")
    launch_log = logging.getLogger("flodl_async.cli.launch")
    level = launch_log.level
    launch_log.setLevel(logging.INFO)
    launch_log.addHandler(said)
    try:
        await controller.bind()
        async with asyncio.timeout(30), asyncio.TaskGroup() as tg:
            run = tg.create_task(controller.run(), name="controller")
            await said.event.wait()
            with pytest.raises(
                (ConnectionClosed, WireError)
            ):  # no data service yet: closed before any handshake
                await open_framed(
                    "127.0.0.1",
                    controller.port,
                    channel=Channel.DATA,
                    credential=Credential.session(secret),
                )
            reducer = Reducer(SCHEMA, OuterAvg(), 1.0, digest=DIGEST)
            controller.install_reducer(reducer)
            link = await open_framed(
                "127.0.0.1",
                controller.port,
                channel=Channel.DATA,
                credential=Credential.session(secret),
            )
            link.send(
                m.HostDataHello(
                    host="elsewhere", ranks=(0,), model_bytes=SCHEMA.model_bytes, digest=DIGEST
                )
            )
            welcome = await link.recv_message()
            assert welcome == m.DataWelcome(max_payload=max(64 << 20, 2 * SCHEMA.model_bytes))
            await link.aclose()
            controller.interrupt(
                signal.SIGTERM
            )  # an orderly end: the controller stops its reducer in its teardown
            result = await run
        assert result.exit_code != 0
        assert reducer.statistics().hosts == 0
    finally:
        launch_log.removeHandler(said)
        launch_log.setLevel(level)
    assert not controller.serving


def test_a_lone_rank_is_forwarded_as_bytes_without_importing_torch() -> None:
    """The relay process of a one-rank host never loads torch: its rank's frame goes up as it came."""
    script = Path(__file__).parent / "scripts" / "relay_lone_rank.py"
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    said = dict(
        item.split("=", 1) for line in result.stdout.split() for item in [line] if "=" in item
    )
    assert said == {
        "up_prescaled": "False",
        "up_ranks": "[0]",
        "up_weight": "2.0",
        "up_same": "True",
        "down_same": "True",
        "down_mass": "2.0",
        "forwarded_raw": "1",
        "folded": "0",
        "torch_imported": "False",
    }
