"""The relay's data socket: a host's ranks folded into one contribution per round.

Theory of operation. Each local rank opens a data link to ``data.sock`` and says
``DataHello`` (its rank, the model's size and the run digest). The first hello
makes the relay dial the controller's data channel — lazily: runs without Trainer
ranks never open it — and introduce the host (``HostDataHello``); the
controller's ``DataWelcome`` names the tensor ceiling, which the relay passes on to
each rank. No tensor frame is accepted on either leg before that (the links start
with a zero payload ceiling).

A round is a barrier over the host's *alive* ranks: every rank this host runs,
except those whose data or control link closed or that were declared dead. Each
sends one ``Contribution(k)``; contributions are taken in ascending rank order (the
round's :class:`~flodl_async.training.foldround.FoldRound` decides which folds next and when
the barrier is met; the reducer keeps the same one over hosts):

* one contributor with tensors (a lone rank, or the root of an init round): its
  frame goes up unchanged as ``HostContribution(prescaled=False)`` — bytes only,
  no torch;
* several: ``acc = Σ w_r·t_r`` in ascending rank order, folded in an executor
  thread into a pooled accumulator (float32, float64 for float64 and integer
  tensors), sent up ``prescaled=True`` *in the accumulator dtype*.

Empty (weight-0) contributions add nothing but are listed in ``ranks``.

Rank links carry plain payloads (the socket is owner-only: same-user peers; see
:class:`~flodl_async.wire.frame.FrameConnection`), so the rank leg costs no AES-GCM. When the
run's reducer lives in this process (the launcher's own host, whose controller hands its reducer
to its agent: :data:`LocalReducerSource`), the host's "connection" is a :class:`LocalUplink`:
frames change hands in memory, drawn from one shared buffer pool. The
controller's ``Consensus`` comes down once per host and is sent to every rank
with an open data link (one seal per link, all in worker threads). The latest one
is kept and handed to a rank that connects after it went by (a resumed run's
init consensus can reach the host before every local rank has dialled).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import ConnectionClosed, FlodlError, ProtocolError, WireError
from ..net.bufpool import SHARED, BufferPool
from ..net.framed import FramedProtocol
from ..training import foldmath
from ..training.foldround import FoldRound, Refused
from ..wire import messages as m
from ..wire.frame import FrameLimits
from ..wire.schema import Message

log = logging.getLogger("flodl_async.relay.control")

#: Tensor frames are refused on a data link until its hello matched (then: the controller's
#: ceiling).
HELLO_LIMITS = FrameLimits(max_payload=0)
#: Rounds one rank may have contributed to that this host has not sent up yet. A rank keeps at most
#: one
#: contribution outstanding (it waits for a round's consensus before the next), so a rank past this
#: is
#: running away, and every such round would hold one of its payloads here.
ROUNDS_IN_FLIGHT = 4


@dataclass(slots=True)
class _Taken:
    msg: m.Contribution
    payload: memoryview | None


@dataclass(slots=True)
class _HostRound:
    """One round's barrier and partial sum on this host."""

    kind: str
    #: the host's ranks, who is dead, the contributions waiting in rank order
    barrier: FoldRound[_Taken]
    weight: float = 0.0
    steps: dict[int, int] = field(default_factory=dict)
    # the first contribution with tensors, kept as bytes until a second one arrives
    lone: _Taken | None = None
    acc: list[object] | None = None  # accumulator tensors (torch, created in the executor)
    acc_buffer: bytearray | memoryview | None = None
    acc_layout: tuple[m.TensorSpec, ...] = ()
    # the first contribution's tensors: every other must match
    layout: tuple[m.TensorSpec, ...] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sent: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class HostFoldStatistics:
    """What the host fold did: frames up (by kind of fold), consensus frames down, refused links."""

    contributions: int
    host_frames: int
    forwarded_raw: int
    folded: int
    consensus_down: int
    delivered_down: int
    refused_links: int


class HostFold:
    """One host's data socket: rank links, the lazy upstream, the per-round fold and the fan-out."""

    def __init__(
        self,
        *,
        host: str,
        ranks: frozenset[int],
        dial: Callable[[], Awaitable[FramedProtocol]],
        task_group: asyncio.TaskGroup,
        hello_timeout: float,
        pool: BufferPool | None = None,
        executor: Executor | None = None,
        local: LocalReducerSource | None = None,
    ) -> None:
        """``dial()`` opens the host's data connection to the controller (with ``HELLO_LIMITS``, the
        session secret).

        ``local()``, asked when the first rank needs the data connection: the run's reducer when
        it lives in this very process (the launcher's own host, whose agent runs in the
        controller's process); then the host's frames are handed to it in memory — no socket, no
        AES-GCM, no copy — instead of dialling.
        """
        self._host = host
        self._host_ranks = ranks
        self._dial = dial
        self._tg = task_group
        self._hello_timeout = hello_timeout
        self.pool = pool or SHARED
        self._local = local
        self._executor = executor
        self._links: dict[int, FramedProtocol] = {}
        self._dead: set[int] = set()
        self._rounds: dict[int, _HostRound] = {}
        self._finished: set[int] = set()
        # (model_bytes, digest) of the first hello: every rank must match
        self._model: tuple[int, str] | None = None
        self._upstream: FramedProtocol | LocalUplink | None = None
        self._max_payload = 0
        self._dialling = asyncio.Lock()
        self._last: tuple[m.Consensus, list[memoryview], memoryview | None] | None = None
        self._contributions = 0
        self._host_frames = 0
        self._forwarded_raw = 0
        self._folded = 0
        self._consensus_down = 0
        self._delivered_down = 0
        self._refused = 0

    # ----- membership ---------------------------------------------------------------------------

    def open_round(self) -> None:
        """A new rendezvous round: new rank processes, nobody dead, no fold in flight."""
        self._dead.clear()
        self._finished.clear()
        for state in self._rounds.values():
            self._release_round(state)
        self._rounds.clear()

    def rank_gone(self, rank: int, reason: str) -> None:
        """``rank`` left (its link closed, or the controller declared it dead): no round waits for
        it any more."""
        if rank in self._dead or rank not in self._host_ranks:
            return
        self._dead.add(rank)
        log.info("relay: rank %d leaves the host fold: %s", rank, reason)
        for state in self._rounds.values():
            state.barrier.declare_dead(rank)
        for number in sorted(self._rounds):
            self._tg.create_task(self._advance(number), name=f"relay-fold-{number}")

    def statistics(self) -> HostFoldStatistics:
        return HostFoldStatistics(
            contributions=self._contributions,
            host_frames=self._host_frames,
            forwarded_raw=self._forwarded_raw,
            folded=self._folded,
            consensus_down=self._consensus_down,
            delivered_down=self._delivered_down,
            refused_links=self._refused,
        )

    def _refuse(self, why: str) -> None:
        self._refused += 1
        log.warning("relay: closing a local rank's data link: %s", why)

    # ----- rank links -----------------------------------------------------------------------------

    async def serve_rank(self, link: FramedProtocol) -> None:
        """One rank's data link (the data socket's handler); returning closes it."""
        assert link.peer is not None  # the service runs handlers on established links only
        rank = link.peer.rank
        current = self._links.get(rank)
        if current is not None and not current.is_closing:
            self._refuse(f"rank {rank} already has a data link")
            return
        try:
            async with asyncio.timeout(self._hello_timeout):
                hello = await link.recv_message()
        except TimeoutError:
            self._refuse(f"rank {rank} sent no DataHello within {self._hello_timeout:g}s")
            return
        if not isinstance(hello, m.DataHello) or hello.rank != rank:
            self._refuse(
                f"the data link of rank {rank} opened with {hello!r} instead of its DataHello"
            )
            return
        if self._model is not None and self._model != (hello.model_bytes, hello.digest):
            self._refuse(
                f"rank {rank} averages a different model ({hello.model_bytes} bytes, digest "
                f"{hello.digest[:12]}) than this host's "
                f"other ranks ({self._model[0]} bytes, digest {self._model[1][:12]}): every rank "
                "must build the same Trainer"
            )
            return
        self._model = (hello.model_bytes, hello.digest)
        try:
            await self._uplink(hello)
        except (OSError, FlodlError) as exc:
            log.error("relay: rank %d's data link is closed: %s", rank, exc)
            return
        assert link.codec is not None
        link.codec.limits = FrameLimits(max_payload=self._max_payload)
        link.send(m.DataWelcome(max_payload=self._max_payload))
        self._links[rank] = link
        # a consensus that went by before this rank dialled (see the module doc)
        if self._last is not None:
            with contextlib.suppress(ConnectionClosed, OSError):
                await link.send_tensors(self._last[0], self._last[1])
        try:
            while True:
                frame = await link.recv()
                msg = frame.message
                if not isinstance(msg, m.Contribution) or msg.rank != rank:
                    self.pool.release(frame.payload)
                    self._refuse(
                        f"the data link of rank {rank} sent {type(msg).__name__} for rank "
                        f"{getattr(msg, 'rank', '?')}"
                    )
                    return
                try:
                    self._take(msg, frame.payload)
                except ProtocolError as exc:
                    self.pool.release(frame.payload)
                    self._refuse(str(exc))
                    return
                await self._advance(msg.round)
        finally:
            if self._links.get(rank) is link:
                del self._links[rank]
                self.rank_gone(rank, "its data link closed")

    def _take(self, msg: m.Contribution, payload: memoryview | None) -> None:
        if msg.round in self._finished:
            raise ProtocolError(
                f"rank {msg.rank} contributed to round {msg.round} after this host's part of it "
                "went up"
            )
        state = self._rounds.get(msg.round)
        if state is None:
            in_flight = sum(msg.rank in r.barrier.covered for r in self._rounds.values())
            if in_flight >= ROUNDS_IN_FLIGHT:
                raise ProtocolError(
                    f"rank {msg.rank} contributed to round {msg.round} with {in_flight} earlier "
                    "rounds of it still waiting for this host's "
                    f"other ranks (at most {ROUNDS_IN_FLIGHT})"
                )
            state = self._rounds[msg.round] = _HostRound(
                kind=msg.kind, barrier=FoldRound(self._host_ranks, dead=self._dead)
            )
        if msg.kind != state.kind:
            raise ProtocolError(
                f"rank {msg.rank} contributed to round {msg.round} as {msg.kind!r}, the host's "
                f"other ranks as {state.kind!r}"
            )
        refusal = state.barrier.refusal([msg.rank])
        if refusal is not None and refusal.reason is Refused.TWICE:
            raise ProtocolError(f"rank {msg.rank} contributed twice to round {msg.round}")
        if refusal is not None:
            # the rank socket's handshake admits only this host's ranks: not reached from there
            raise ProtocolError(f"rank {msg.rank} does not run on this host")
        if not (math.isfinite(msg.weight) and msg.weight >= 0):
            raise ProtocolError(
                f"rank {msg.rank} contributed to round {msg.round} with weight {msg.weight!r}; "
                "weights are finite and >= 0"
            )
        payload_len = payload.nbytes if payload is not None else 0
        if not msg.tensors:
            if msg.weight != 0 or payload_len:
                raise ProtocolError(
                    f"rank {msg.rank}: an empty contribution to round {msg.round} must have weight "
                    "0 and no payload"
                )
        else:
            # Every contribution of a host describes the same tensors: the first one is the
            # reference.
            reference = (
                state.layout
                if state.layout is not None
                else foldmath.packed_specs(
                    [(s.name, s.dtype, tuple(s.shape)) for s in msg.tensors]
                )[0]
            )
            foldmath.check_specs(
                msg.tensors,
                reference,
                payload_len,
                what=f"rank {msg.rank}'s contribution to round {msg.round}",
            )
            state.layout = reference
        self._contributions += 1
        state.barrier.offer([msg.rank], _Taken(msg=msg, payload=payload))

    # ----- the fold -----------------------------------------------------------------------------

    async def _advance(self, number: int) -> None:
        """Fold what can be folded in rank order; send the host frame once the barrier is met."""
        state = self._rounds.get(number)
        if state is None:
            return
        async with state.lock:
            if state.sent:
                return
            # the barrier hands contributions out in rank order, each once no lower rank can
            # still arrive
            while (taken := state.barrier.next_to_fold()) is not None:
                state.weight += taken.msg.weight
                state.steps[taken.msg.rank] = taken.msg.steps
                if not taken.msg.tensors:
                    continue
                if state.lone is None and state.acc is None:
                    state.lone = taken  # maybe the only one: then it goes up as bytes
                    continue
                try:
                    if state.acc is None:
                        assert state.lone is not None
                        await self._fold(state, state.lone, first=True)
                        state.lone = None
                    await self._fold(state, taken, first=False)
                except Exception:
                    log.exception("relay: folding round %d failed (bug)", number)
                    raise
            if not state.barrier.complete:
                return
            state.sent = True
            try:
                await self._send_up(number, state)
            finally:
                self._release_round(state)
                self._rounds.pop(number, None)
                self._finished.add(number)

    async def _fold(self, state: _HostRound, taken: _Taken, *, first: bool) -> None:
        loop = asyncio.get_running_loop()
        specs = taken.msg.tensors
        weight = taken.msg.weight
        payload = taken.payload
        assert payload is not None
        if first:
            acc_layout, acc_len = foldmath.acc_specs(specs)
            if acc_layout == tuple(specs) and payload.nbytes == acc_len:
                # Already in accumulator dtypes and packed (a float32 model): the payload becomes
                # the accumulator.
                state.acc_buffer, state.acc_layout = payload, acc_layout
                taken.payload = None

                def scale() -> list[object]:
                    acc = foldmath.views(acc_layout, payload)
                    if weight != 1.0:
                        for a in acc:
                            a.mul_(weight)
                    return list(acc)

                state.acc = await loop.run_in_executor(self._executor, scale)
                return
            buffer = self.pool.acquire(acc_len)
            state.acc_buffer, state.acc_layout = buffer, acc_layout

            def start() -> list[object]:
                acc = foldmath.views(acc_layout, buffer)
                foldmath.add_term(acc, foldmath.views(specs, payload), weight, first=True)
                return list(acc)

            state.acc = await loop.run_in_executor(self._executor, start)
        else:
            acc_tensors = state.acc
            assert acc_tensors is not None

            def add() -> None:
                foldmath.add_term(acc_tensors, foldmath.views(specs, payload), weight, first=False)  # type: ignore[arg-type]

            await loop.run_in_executor(self._executor, add)
        self.pool.release(taken.payload)
        taken.payload = None

    async def _send_up(self, number: int, state: _HostRound) -> None:
        upstream = self._upstream
        if upstream is None or upstream.is_closing:
            log.warning(
                "relay: round %d has no data connection to send on (the controller went away)",
                number,
            )
            return
        ranks = tuple(sorted(state.steps))  # the ranks folded
        steps = tuple(state.steps[r] for r in ranks)
        if state.acc is not None:
            assert state.acc_buffer is not None
            msg = m.HostContribution(
                round=number,
                kind=state.kind,
                host=self._host,
                ranks=ranks,
                weight=state.weight,
                prescaled=True,
                tensors=state.acc_layout,
                steps=steps,
            )
            # the tensors go; the buffer is sent whole (its layout is the packed one)
            state.acc = None
            parts: list[bytearray | memoryview] = [state.acc_buffer]
            self._folded += 1
        elif state.lone is not None:
            msg = m.HostContribution(
                round=number,
                kind=state.kind,
                host=self._host,
                ranks=ranks,
                weight=state.weight,
                prescaled=False,
                tensors=state.lone.msg.tensors,
                steps=steps,
            )
            parts = [state.lone.payload] if state.lone.payload is not None else []
            self._forwarded_raw += 1
        else:
            msg = m.HostContribution(
                round=number,
                kind=state.kind,
                host=self._host,
                ranks=ranks,
                weight=state.weight,
                prescaled=False,
                steps=steps,
            )
            parts = []
        try:
            await upstream.send_tensors(msg, parts)
            self._host_frames += 1
            if isinstance(upstream, LocalUplink):
                # Handed over in memory: the reducer owns these buffers now (and gives them back to
                # the pool).
                state.acc_buffer = None
                if state.lone is not None:
                    state.lone.payload = None
        except (ConnectionClosed, OSError) as exc:
            log.warning("relay: round %d could not go up: %s", number, exc)

    def _release_round(self, state: _HostRound) -> None:
        state.acc = None
        self.pool.release(state.acc_buffer)
        state.acc_buffer = None
        if state.lone is not None:
            self.pool.release(state.lone.payload)
            state.lone = None
        for taken in state.barrier.drain():
            self.pool.release(taken.payload)

    # ----- upstream -----------------------------------------------------------------------------

    async def _uplink(self, hello: m.DataHello) -> FramedProtocol | LocalUplink:
        """The host's one data connection, dialled and introduced when the first rank needs it."""
        async with self._dialling:
            if self._upstream is not None and not self._upstream.is_closing:
                return self._upstream
            reducer = self._local() if self._local is not None else None
            if reducer is not None:
                host_hello = m.HostDataHello(
                    host=self._host,
                    ranks=tuple(sorted(self._host_ranks)),
                    model_bytes=hello.model_bytes,
                    digest=hello.digest,
                )
                local = LocalUplink(fold=self)
                refusal = reducer.connect_local(host_hello, local)
                if refusal is not None:
                    raise FlodlError(
                        f"the controller refused this host's data connection: {refusal}"
                    )
                self._max_payload = reducer.max_payload
                self._upstream = local
                return local
            try:
                upstream = await self._dial()
            except (ConnectionClosed, WireError, TimeoutError) as exc:
                raise FlodlError(
                    f"the controller refused this host's data connection ({exc}); it serves the "
                    "data channel only once its "
                    "Trainer coordinator runs — open data links after TrainerWelcome"
                ) from exc
            try:
                upstream.send(
                    m.HostDataHello(
                        host=self._host,
                        ranks=tuple(sorted(self._host_ranks)),
                        model_bytes=hello.model_bytes,
                        digest=hello.digest,
                    )
                )
                async with asyncio.timeout(self._hello_timeout):
                    welcome = await upstream.recv_message()
            except (ConnectionClosed, WireError, TimeoutError) as exc:
                upstream.abort()
                why = str(exc) or "no answer in time"
                raise FlodlError(
                    f"the controller did not welcome this host's data connection ({why}); see the "
                    "controller's log"
                ) from exc
            if not isinstance(welcome, m.DataWelcome):
                upstream.abort()
                raise ProtocolError(
                    f"the controller answered HostDataHello with {type(welcome).__name__}"
                )
            assert upstream.codec is not None
            upstream.codec.limits = FrameLimits(max_payload=welcome.max_payload)
            self._max_payload = welcome.max_payload
            self._upstream = upstream
            self._tg.create_task(self._pump_down(upstream), name="relay-data-down")
            return upstream

    async def _pump_down(self, upstream: FramedProtocol) -> None:
        while True:
            try:
                frame = await upstream.recv()
            except (ConnectionClosed, WireError) as exc:
                log.debug("relay: the data connection to the controller ended: %s", exc)
                self._upstream_gone()
                return
            msg = frame.message
            if not isinstance(msg, m.Consensus):
                self.pool.release(frame.payload)
                continue
            await self.fan_out(
                msg, [frame.payload] if frame.payload is not None else [], frame.payload
            )

    def _upstream_gone(self) -> None:
        for link in list(self._links.values()):
            link.close()  # ranks must not wait for a consensus that cannot come

    async def fan_out(
        self, msg: m.Consensus, parts: list[memoryview], owned: memoryview | None
    ) -> None:
        """Send one consensus to every local rank; ``owned`` (a received payload) is this fold's to
        release later."""
        self._consensus_down += 1
        links = [link for link in self._links.values() if not link.is_closing]
        # Borrowed: the payload stays held (self._last) until the next consensus, which cannot exist
        # before
        # every rank read this one and contributed again.
        results = await asyncio.gather(
            *(link.send_tensors(msg, parts, borrow=True) for link in links), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                if not isinstance(result, ConnectionClosed | OSError):
                    raise result
            else:
                self._delivered_down += 1
        previous, self._last = self._last, (msg, parts, owned)
        if previous is not None:
            self.pool.release(previous[2])

    async def aclose(self, grace: float) -> None:
        """Close every rank's data link and the upstream connection."""
        for link in list(self._links.values()):
            link.close()
        if self._upstream is not None:
            await self._upstream.aclose(grace=grace)
        for state in self._rounds.values():
            self._release_round(state)
        self._rounds.clear()


class LocalReducer(Protocol):
    """What the host fold needs of a reducer in its own process: the in-memory uplink's other end.

    The controller's reducer is one; the relay never imports the controller (it sits below it),
    so the controller hands its reducer down through its in-process agent's session config.
    """

    max_payload: int

    def connect_local(self, hello: m.HostDataHello, uplink: LocalUplink) -> str | None: ...

    def offer_local(
        self, uplink: LocalUplink, msg: m.HostContribution, payload: memoryview | None
    ) -> None: ...

    def disconnect_local(self, uplink: LocalUplink) -> None: ...


#: Asked when the host's first rank needs its data connection: the run's reducer when it runs in
#: this process, else None (the relay dials the controller's port). A callable, not the reducer
#: itself: the controller makes its reducer only once the Trainer's coordinator starts, after its
#: agent (and relay) did.
LocalReducerSource = Callable[[], LocalReducer | None]


class LocalUplink:
    """The host's data connection when the reducer is in this process: frames handed over in memory.

    Up: :meth:`send_tensors` gives the reducer the host frame's buffer itself (no copy; the
    reducer owns it from then on). Down: the reducer calls :meth:`deliver`, which fans the
    consensus out from the reducer's own buffers, which it keeps until its next round completes —
    after every rank read this one.
    """

    def __init__(self, *, fold: HostFold) -> None:
        self._fold = fold
        self._reducer: LocalReducer | None = None
        self._closed = False
        self.peer_label = "the controller (in this process)"

    def bind(self, reducer: LocalReducer) -> None:
        self._reducer = reducer

    @property
    def is_closing(self) -> bool:
        return self._closed

    async def send_tensors(self, msg: Message, payload: list[bytearray | memoryview]) -> None:
        if self._closed or self._reducer is None:
            raise ConnectionClosed("data channel to the controller (in this process)", by_peer=True)
        assert isinstance(msg, m.HostContribution)
        view: memoryview | None = None
        if payload:
            (buffer,) = payload
            view = buffer if isinstance(buffer, memoryview) else memoryview(buffer)
        self._reducer.offer_local(self, msg, view)

    async def deliver(self, msg: m.Consensus, parts: list[memoryview]) -> None:
        """The reducer's consensus for this host's ranks."""
        if not self._closed:
            await self._fold.fan_out(msg, parts, None)

    def abort(self) -> None:
        """The reducer refused a frame: the host's ranks are cut off, as on a socket."""
        if not self._closed:
            self._closed = True
            self._fold._upstream_gone()

    close = abort

    async def aclose(self, grace: float = 0.0) -> None:
        del grace
        reducer, self._reducer = self._reducer, None
        self.abort()
        if reducer is not None:
            reducer.disconnect_local(self)
