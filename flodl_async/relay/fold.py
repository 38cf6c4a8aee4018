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

Nothing a rank claims is believed (:mod:`flodl_async.training.plancheck`): each round's plan
comes down with its ``Reduce`` (:meth:`HostFold.note_round`), and a contribution whose kind,
steps, weight or tensors break it — steps past the plan or negative, a weight its steps do not
give, tensors other than its own ``TrainerHello``'s model's (:meth:`HostFold.note_hello`), a
non-finite or overflowing value (checked in the executor, one pass, just before it would be
folded) — is that rank's failure: it is left out of the host frame, the rank leaves the fold
and its data link is closed, and ``on_misbehaved`` reports it up (the relay's ``RankGone``, which
the coordinator's death chain takes). A lone contributor's bytes go up unchecked: the reducer
checks a frame one rank's bytes went into.

Rank links carry plain payloads (the socket is owner-only: same-user peers; see
:class:`~flodl_async.wire.frame.FrameConnection`), so the rank leg costs no AES-GCM. When the
run's reducer lives in this process (the launcher's own host, whose controller hands its reducer
to its agent: :data:`~flodl_async.relay.upstream.LocalReducerSource`), the host's "connection" is
a :class:`~flodl_async.relay.upstream.LocalUplink`: frames change hands in memory, drawn from one
shared buffer pool (the connection either way is :mod:`flodl_async.relay.upstream`'s). The
controller's ``Consensus`` comes down once per host and is sent to every rank
with an open data link (one seal per link, all in worker threads). The latest one
is kept and handed to a rank that connects after it went by (a resumed run's
init consensus can reach the host before every local rank has dialled).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import ConnectionClosed, FlodlError, ProtocolError
from ..net.bufpool import SHARED, BufferPool
from ..net.framed import FramedProtocol
from ..training import foldmath, plancheck
from ..training.foldround import FoldRound
from ..training.roundgate import check_rank_contribution
from ..wire import messages as m
from ..wire.frame import FrameLimits
from .upstream import HostUpstream, LocalReducerSource, LocalUplink

if TYPE_CHECKING:
    import torch

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
#: Round plans kept (newest first): past any round a rank may still contribute to.
_PLANS_KEPT = 4 * ROUNDS_IN_FLIGHT


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
    # the ranks folded so far: their steps and weights
    steps: dict[int, int] = field(default_factory=dict)
    weights: dict[int, float] = field(default_factory=dict)
    # the first contribution with tensors, kept as bytes until a second one arrives
    lone: _Taken | None = None
    acc: list[torch.Tensor] | None = None  # accumulator tensors (created in the executor)
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
        on_misbehaved: Callable[[int, str], None] | None = None,
    ) -> None:
        """``dial()`` opens the host's data connection to the controller (with ``HELLO_LIMITS``, the
        session secret).

        ``local()``, asked when the first rank needs the data connection: the run's reducer when
        it lives in this very process (the launcher's own host, whose agent runs in the
        controller's process); then the host's frames are handed to it in memory — no socket, no
        AES-GCM, no copy — instead of dialling.

        ``on_misbehaved(rank, reason)``: a local rank sent what its round's plan does not allow.
        """
        self._host = host
        self._on_misbehaved = on_misbehaved
        self._host_ranks = ranks
        self._tg = task_group
        self._hello_timeout = hello_timeout
        self.pool = pool or SHARED
        self._executor = executor
        self._up = HostUpstream(
            host=host,
            ranks=ranks,
            dial=dial,
            local=local,
            hello_timeout=hello_timeout,
            task_group=task_group,
            pool=self.pool,
            fan_out=self.fan_out,
            cut_off=self._upstream_gone,
        )
        self._links: dict[int, FramedProtocol] = {}
        # the ranks that ever had a data link (one that dials again is a restarted process)
        self._served: set[int] = set()
        self._dead: set[int] = set()
        self._rounds: dict[int, _HostRound] = {}
        self._finished: set[int] = set()
        # the Reduce of each round opened lately; None until the first plan: no round is checked
        self._plans: dict[int, m.Reduce] | None = None
        # per rank, the tensors its own TrainerHello's model has
        self._layouts: dict[int, tuple[m.TensorSpec, ...]] = {}
        # (model_bytes, digest) of the first hello: every rank must match
        self._model: tuple[int, str] | None = None
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
        self._plans = None
        self._layouts.clear()
        for state in self._rounds.values():
            self._release_round(state)
        self._rounds.clear()

    def rank_gone(self, rank: int, reason: str) -> None:
        """``rank`` left (its link closed, or the controller declared it dead): no round waits for
        it any more."""
        if rank in self._dead or rank not in self._host_ranks:
            return
        self._dead.add(rank)
        log.debug("relay: rank %d leaves the host fold: %s", rank, reason)
        for state in self._rounds.values():
            state.barrier.declare_dead(rank)
        for number in sorted(self._rounds):
            self._tg.create_task(self._advance(number), name=f"relay-fold-{number}")

    def readmit(self, rank: int) -> None:
        """``rank``'s restarted process rejoins the run (``Readmitted``): the host rounds opened
        from now on wait for it again (a host whose last rank had died is back in the fold)."""
        if rank in self._host_ranks:
            self._dead.discard(rank)

    def note_hello(self, hello: m.TrainerHello) -> None:
        """A local rank's ``TrainerHello`` is on its way up: its contributions must carry its
        model's tensors."""
        layout = plancheck.contribution_layout(hello.model)
        if layout is not None:
            self._layouts[hello.rank] = layout

    def note_round(self, reduce: m.Reduce) -> None:
        """The controller opened ``reduce.round`` (its ``Reduce`` is on its way to the ranks): what
        each local rank may contribute to it."""
        if reduce.plan is None:
            return
        plans = self._plans if self._plans is not None else {}
        self._plans = plans
        plans[reduce.round] = reduce
        while len(plans) > _PLANS_KEPT:
            del plans[min(plans)]

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
            await self._up.open(hello)
        except (OSError, FlodlError) as exc:
            log.error("relay: rank %d's data link is closed: %s", rank, exc)
            return
        assert link.codec is not None
        link.codec.limits = FrameLimits(max_payload=self._up.max_payload)
        link.send(m.DataWelcome(max_payload=self._up.max_payload))
        self._links[rank] = link
        # a consensus that went by before this rank dialled (see the module doc); never to a
        # restarted process (a rank that had a data link before): its first round is a later one
        rejoining = rank in self._served
        self._served.add(rank)
        if self._last is not None and not rejoining:
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
                    lie = self._take(msg, frame.payload)
                except ProtocolError as exc:
                    self.pool.release(frame.payload)
                    self._refuse(str(exc))
                    return
                if lie is not None:
                    self.pool.release(frame.payload)
                    self._misbehaved(rank, lie)
                    return
                await self._advance(msg.round)
        finally:
            if self._links.get(rank) is link:
                del self._links[rank]
                self.rank_gone(rank, "its data link closed")

    def _take(self, msg: m.Contribution, payload: memoryview | None) -> str | None:
        """Offer ``msg`` to its host round; returns how it breaks its round's plan instead (the
        rank's failure), and raises :class:`ProtocolError` for a frame no round takes."""
        if msg.round in self._finished:
            raise ProtocolError(
                f"rank {msg.rank} contributed to round {msg.round} after this host's part of it "
                "went up"
            )
        layout = self._layouts.get(msg.rank)
        if layout is not None:
            # judged against its own model before it may set the host round's layout for the others
            lie = plancheck.check_layout(msg, layout, payload.nbytes if payload is not None else 0)
            if lie is not None:
                return lie
        if self._plans is not None:
            # ... and against the Reduce before it may set the host round's kind
            opened = self._plans.get(msg.round)
            if opened is None or opened.plan is None:
                return f"rank {msg.rank} contributed to round {msg.round}, which is not open"
            if opened.from_controller:
                return (
                    f"rank {msg.rank} contributed to round {msg.round}, whose consensus the "
                    "controller sends"
                )
            lie = plancheck.check_contribution(msg, opened.plan, kind=opened.kind)
            if lie is not None:
                return lie
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
        state.layout = check_rank_contribution(
            msg,
            kind=state.kind,
            refusal=state.barrier.refusal([msg.rank]),
            layout=state.layout,
            payload_len=payload.nbytes if payload is not None else 0,
        )
        self._contributions += 1
        state.barrier.offer([msg.rank], _Taken(msg=msg, payload=payload))
        return None

    def _misbehaved(self, rank: int, reason: str) -> None:
        """``rank`` broke its plan: it is reported, leaves the fold (which logs why), and its data
        link closes."""
        if self._on_misbehaved is not None:
            self._on_misbehaved(rank, reason)
        self.rank_gone(rank, reason)
        link = self._links.get(rank)
        if link is not None:
            link.close()

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
                state.steps[taken.msg.rank] = taken.msg.steps
                state.weights[taken.msg.rank] = taken.msg.weight
                if not taken.msg.tensors:
                    continue
                if state.lone is None and state.acc is None:
                    state.lone = taken  # maybe the only one: then it goes up as bytes
                    continue
                try:
                    if state.acc is None:
                        lone, state.lone = state.lone, None
                        assert lone is not None
                        await self._fold_checked(number, state, lone)
                    await self._fold_checked(number, state, taken)
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

    async def _fold_checked(self, number: int, state: _HostRound, taken: _Taken) -> None:
        """Fold ``taken`` (the first one starts the accumulator), unless its tensors are not sound:
        then its rank is left out of the host frame and reported."""
        bad = await self._fold(state, taken, first=state.acc is None)
        self.pool.release(taken.payload)
        taken.payload = None
        if bad is not None:
            rank = taken.msg.rank
            del state.steps[rank], state.weights[rank]
            self._misbehaved(rank, plancheck.tensor_lie(rank, number, bad))

    async def _fold(
        self, state: _HostRound, taken: _Taken, *, first: bool
    ) -> tuple[str, str] | None:
        """Check ``taken``'s tensors and add them, in one executor call; returns what is wrong with
        them instead (the accumulator unchanged)."""
        run = asyncio.get_running_loop().run_in_executor
        msg, payload = taken.msg, taken.payload
        assert payload is not None
        if not first:
            assert state.acc is not None
            return await run(self._executor, _add_checked, state.acc, msg, payload)
        acc_layout, acc_len = foldmath.acc_specs(msg.tensors)
        # Already in accumulator dtypes and packed (a float32 model): the payload becomes the
        # accumulator.
        adopt = acc_layout == tuple(msg.tensors) and payload.nbytes == acc_len
        buffer = payload if adopt else self.pool.acquire(acc_len)
        started = await run(self._executor, _start_checked, acc_layout, msg, payload, buffer)
        if isinstance(started, tuple):
            if not adopt:
                self.pool.release(buffer)
            return started
        state.acc, state.acc_buffer, state.acc_layout = started, buffer, acc_layout
        if adopt:
            taken.payload = None
        return None

    async def _send_up(self, number: int, state: _HostRound) -> None:
        upstream = self._up.link
        if upstream is None or upstream.is_closing:
            log.warning(
                "relay: round %d has no data connection to send on (the controller went away)",
                number,
            )
            return
        ranks = tuple(sorted(state.steps))  # the ranks folded
        steps = tuple(state.steps[r] for r in ranks)
        weight = 0.0
        for r in ranks:  # in rank order, as every fold
            weight += state.weights[r]
        if state.acc is not None:
            assert state.acc_buffer is not None
            msg = m.HostContribution(
                round=number,
                kind=state.kind,
                host=self._host,
                ranks=ranks,
                weight=weight,
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
                weight=weight,
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
                weight=weight,
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
        await self._up.aclose(grace)
        for state in self._rounds.values():
            self._release_round(state)
        self._rounds.clear()


# ----- the executor's side of a fold: check a rank's tensors, then add them --------------------


def _start_checked(
    acc_layout: tuple[m.TensorSpec, ...],
    msg: m.Contribution,
    payload: memoryview,
    buffer: bytearray | memoryview,
) -> tuple[str, str] | list[torch.Tensor]:
    """The accumulator (in ``buffer``) started from ``msg``'s tensors, or what is wrong with them;
    ``buffer is payload``: the payload, already in the accumulator's layout, is scaled in place."""
    terms = foldmath.views(msg.tensors, payload)
    bad = plancheck.first_bad_tensor(msg.tensors, terms, msg.weight)
    if bad is not None:
        return bad
    if buffer is payload:
        if msg.weight != 1.0:
            for t in terms:
                t.mul_(msg.weight)
        return list(terms)
    acc = foldmath.views(acc_layout, buffer)
    foldmath.add_term(acc, terms, msg.weight, first=True)
    return list(acc)


def _add_checked(
    acc: list[torch.Tensor], msg: m.Contribution, payload: memoryview
) -> tuple[str, str] | None:
    """``msg``'s weighted tensors added to ``acc``, or what is wrong with them (``acc`` as it
    was)."""
    terms = foldmath.views(msg.tensors, payload)
    bad = plancheck.first_bad_tensor(msg.tensors, terms, msg.weight)
    if bad is None:
        foldmath.add_term(acc, terms, msg.weight, first=False)
    return bad
