"""The controller's reducer: the data channel's service, one averaging round at a time.

Theory of operation. Each host's relay opens one data connection and says
``HostDataHello`` (its ranks, the model's size and the run digest); only when
they match this run's model does the reducer raise that link's tensor ceiling to
``max(2 × model bytes, 64 MiB)`` (at least one accumulator frame) and answer
``DataWelcome``: no tensor frame is accepted before.

The coordinator opens round ``k`` (:meth:`Reducer.open_round`) with the ranks it
expects. Host frames (``HostContribution``) are folded into a pooled accumulator
in a fixed order — ascending host by lowest rank, so that a round's sum does not depend on
which frame came first; a frame that arrives early waits in its receive buffer — by one
driver task whose tensor math runs in executor threads. A round is complete when every
expected rank is covered exactly once (a rank listed twice closes that connection) or was
declared dead since (:meth:`declare_dead` releases a round waiting on it). The order and the
completion are the round's :class:`~flodl_async.training.foldround.FoldRound`'s to decide (the
relay's host fold keeps the same barrier); which round a frame goes to, and whether it may join
it, is the :class:`~flodl_async.training.roundgate.RoundGate`'s; the tensor math is
:class:`~flodl_async.controller.roundmath.RoundMath`'s. The reducer folds and sends. Then, with
``mass = Σ w``:

* ``mass > 0``: divide, round integer buffers half-to-even, cast floats back; a
  ``model`` round's parameters take the outer optimizer's step
  (:mod:`flodl_async.training.outer`);
  the consensus goes down once per host with alive ranks and is kept as
  :attr:`Reducer.last_consensus`;
* ``mass == 0``: ``Consensus(mass=0)`` without payload: ranks keep their state.

Nothing a host frame claims for a rank is believed: a round opened with its
:class:`~flodl_async.wire.messages.RoundPlan` checks each listed rank's steps against it and the
frame's weight against what they give, and a raw frame's tensors (one rank's bytes no relay
folded) are checked before they are folded (:mod:`flodl_async.training.plancheck`). What breaks
the plan is that rank's failure: the frame is left out, and ``on_misbehaved(rank, reason)`` tells
the coordinator's shell, which runs the death chain (with no ``on_misbehaved``, the host's data
connection is closed). A host-level fault — a prescaled frame whose sum no single rank explains —
closes the host's data connection, as any protocol error does.

A ``from_controller`` round takes no contributions: the held consensus (the
previous round's, or :meth:`set_initial`'s on resume) goes down as soon as every
expected rank's host is connected. torch is imported only in executor threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import TYPE_CHECKING

from ..errors import ConnectionClosed, ProtocolError, WireError
from ..net.bufpool import SHARED
from ..net.framed import FramedProtocol
from ..net.service import FramedService
from ..relay.fold import HELLO_LIMITS
from ..relay.upstream import LocalUplink
from ..training import plancheck
from ..training.foldround import FoldRound
from ..training.modelschema import ModelSchema
from ..training.outer import OuterSpec
from ..training.roundgate import RoundGate, Route, check_host_frame
from ..wire import messages as m
from ..wire.channels import Channel
from ..wire.frame import FrameLimits
from ..wire.handshake import CredentialResolver
from ..wire.schema import Message
from ..wire.tensor import tensor_bytes
from .roundmath import RoundMath
from .roundstate import (
    DataHost,
    HeldConsensus,
    LocalDown,
    PendingFrame,
    ReducerStatistics,
    RoundResult,
    RoundState,
    Snapshot,
    UplinkCounts,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger("flodl_async.controller.reducer")
#: The outer optimizer's saved state (``OuterStepper.checkpoint_state()``).
Outer = Mapping[str, object]

#: Rounds a host may run ahead of the newest opened round (its frames wait in their buffers).
_EARLY_ROUNDS = 2


class Reducer:
    """Averages each round's host frames into the consensus; see the module docstring."""

    def __init__(
        self,
        schema: ModelSchema,
        outer: OuterSpec,
        gamma: float,
        executor: Executor | None = None,
        *,
        digest: str | None = None,
        hello_timeout: float = 30.0,
        on_misbehaved: Callable[[int, str], None] | None = None,
    ) -> None:
        """``digest``: the run's TrainerSpec digest, which every host's hello must carry (None: only
        the model size is checked).

        ``on_misbehaved(rank, reason)`` (settable later): a rank's contribution broke its round's
        plan; called on the loop, before the round can complete without it.
        """
        self.on_misbehaved = on_misbehaved
        self.schema = schema
        self.outer = outer
        self.gamma = gamma
        self.digest = digest
        self._hello_timeout = hello_timeout
        self.pool = SHARED  # shared with a relay in this process: buffers change hands in memory
        self._math = RoundMath(schema, outer, executor, self.pool)
        self.max_payload = max(
            FrameLimits.tensor_ceiling_for_model(schema.model_bytes), self._math.acc_len
        )
        self._hosts: list[DataHost] = []
        self._rounds: dict[int, RoundState] = {}
        self._results: dict[int, asyncio.Future[RoundResult]] = {}
        self._gate: RoundGate[PendingFrame] = RoundGate(early_rounds=_EARLY_ROUNDS)
        self._held: HeldConsensus | None = None
        self._wake = asyncio.Event()
        self._closing = False
        self._rounds_done = 0
        self._uplinks = UplinkCounts()

    # ----- wiring into the controller -------------------------------------------------------------

    def attach(
        self,
        *,
        task_group: asyncio.TaskGroup,
        resolve: CredentialResolver,
        run_id: str,
    ) -> FramedService:
        """Start the round driver in ``task_group`` and return the data channel's service for the
        mux.

        A relay in this process reaches the reducer without the port when whoever made both hands
        the reducer to it (:data:`~flodl_async.relay.upstream.LocalReducerSource`: the controller,
        to its in-process agent); every other relay dials the data channel.
        """
        task_group.create_task(self.run(), name="reducer")
        return FramedService(
            channel=Channel.DATA,
            resolve=resolve,
            run_id=run_id,
            handler=self.serve,
            task_group=task_group,
            limits=HELLO_LIMITS,
            allocate=self.pool.acquire,
        )

    # ----- the coordinator's side -----------------------------------------------------------------

    def open_round(
        self,
        round: int,
        kind: str,
        expected_ranks: frozenset[int],
        from_controller: bool = False,
        plan: m.RoundPlan | None = None,
        *,
        snapshot: bool = False,
    ) -> None:
        """Round ``round`` starts now; it completes when every one of ``expected_ranks`` is covered
        or dead. ``plan``: what each rank may claim in it; ``snapshot``: a checkpoint round's
        consensus is copied as it is made (:attr:`RoundResult.snapshot`)."""
        early = self._gate.open(round, expected_ranks)
        loop = asyncio.get_running_loop()
        state = RoundState(
            number=round,
            kind=kind,
            barrier=FoldRound(expected_ranks, dead=self._gate.dead),
            from_controller=from_controller,
            opened_at=time.monotonic(),
            done=loop.create_future(),
            plan=plan,
            snapshot=snapshot,
        )
        self._rounds[round] = state
        self._results[round] = state.done
        for frame in early:
            try:
                self._accept(state, frame)
            except ProtocolError as exc:
                self._close_host(frame, str(exc))
        self._wake.set()

    async def wait_round(self, round: int) -> RoundResult:
        """The result of round ``round`` once it completed (open it first)."""
        done = self._results.get(round)
        if done is None:
            raise ValueError(
                f"round {round} was not opened, or its result was already taken (open_round first; "
                "each result is delivered once)"
            )
        try:
            return await asyncio.shield(done)
        finally:
            if done.done():
                self._results.pop(round, None)

    def declare_dead(self, rank: int) -> None:
        """``rank`` is lost: no round waits for it any more (its frames already folded still
        count)."""
        self._gate.declare_dead(rank)
        for state in self._rounds.values():
            state.barrier.declare_dead(rank)
        self._wake.set()

    @property
    def last_consensus(self) -> dict[str, torch.Tensor] | None:
        """A copy of the latest consensus, as a full state_dict (tied keys included); None before
        the first.

        The copy is made on the calling thread: from the event loop, prefer :meth:`copy_consensus`.
        """
        held = self._held
        return self._math.copy(held) if held is not None else None

    async def copy_consensus(self) -> dict[str, torch.Tensor] | None:
        """:attr:`last_consensus`, copied in an executor thread (tensor math stays off the loop)."""
        held = self._held
        return await self._math.copy_off_loop(held) if held is not None else None

    async def snapshot(self) -> Snapshot | None:
        """:meth:`copy_consensus` with the outer optimizer's state (a failing run's checkpoint)."""
        held = self._held
        return await self._math.snapshot_off_loop(held) if held is not None else None

    def set_initial(self, state: Mapping[str, torch.Tensor], outer: Outer | None = None) -> None:
        """Resume: ``state`` is the consensus and the outer optimizer's previous global; ``outer``
        its saved momentum (None: none)."""
        self._held = self._math.initial(state)
        self._math.load_outer(outer or {})

    # ----- host connections -----------------------------------------------------------------------

    async def serve(self, link: FramedProtocol) -> None:
        """One host's data connection (the data channel's handler); returning closes it."""
        try:
            async with asyncio.timeout(self._hello_timeout):
                hello = await link.recv_message()
        except TimeoutError:
            log.warning(
                "data channel: %s sent no HostDataHello within %gs; closing",
                link.peer_label,
                self._hello_timeout,
            )
            return
        refusal = check_data_hello(hello, self.schema, self.digest, self._hosts)
        if refusal is not None:
            log.error("data channel: refusing %s: %s", link.peer_label, refusal)
            return
        assert isinstance(hello, m.HostDataHello)
        assert link.codec is not None
        link.codec.limits = FrameLimits(max_payload=self.max_payload)
        host = DataHost(name=hello.host or link.peer_label, ranks=frozenset(hello.ranks), link=link)
        self._hosts.append(host)
        link.send(m.DataWelcome(max_payload=self.max_payload))
        self._wake.set()  # a from_controller round may have waited for this host
        try:
            while True:
                frame = await link.recv()
                msg = frame.message
                if not isinstance(msg, m.HostContribution):
                    self.pool.release(frame.payload)
                    log.error(
                        "data channel: host %s sent %s; closing its data connection",
                        host.name,
                        type(msg).__name__,
                    )
                    return
                item = PendingFrame(msg=msg, payload=frame.payload, host=host)
                try:
                    self._offer(item)
                except ProtocolError as exc:
                    self._close_host(item, str(exc))
                    return
        finally:
            self._hosts.remove(host)

    def statistics(self) -> ReducerStatistics:
        """A snapshot for the status board and tests."""
        local = sum(isinstance(h.link, LocalDown) for h in self._hosts)
        return ReducerStatistics(
            hosts=len(self._hosts),
            in_process_hosts=local,
            rounds_completed=self._rounds_done,
            uplinks=self._uplinks.statistics(),
        )

    # ----- a host in this process
    # ------------------------------------------------------------------

    def connect_local(self, hello: m.HostDataHello, uplink: LocalUplink) -> str | None:
        """A relay in this process introduces its host; returns why it is refused, or None."""
        # closed: as a relay dialling the closed port would be, this one is turned away
        refusal = (
            "the reducer has closed"
            if self._closing
            else check_data_hello(hello, self.schema, self.digest, self._hosts)
        )
        if refusal is not None:
            log.error("data channel: refusing this process's relay: %s", refusal)
            return refusal
        uplink.bind(self)
        self._hosts.append(
            DataHost(
                name=hello.host or "local", ranks=frozenset(hello.ranks), link=LocalDown(uplink)
            )
        )
        self._wake.set()
        return None

    def offer_local(
        self, uplink: LocalUplink, msg: m.HostContribution, payload: memoryview | None
    ) -> None:
        """A host frame from this process's relay; its buffer is the reducer's from now on."""
        host = next(
            (h for h in self._hosts if isinstance(h.link, LocalDown) and h.link.uplink is uplink),
            None,
        )
        if host is None:
            self.pool.release(payload)
            raise ConnectionClosed("data channel of this process's relay", by_peer=False)
        item = PendingFrame(msg=msg, payload=payload, host=host)
        try:
            self._offer(item)
        except ProtocolError as exc:
            self._close_host(item, str(exc))

    def disconnect_local(self, uplink: LocalUplink) -> None:
        self._hosts = [
            h
            for h in self._hosts
            if not (isinstance(h.link, LocalDown) and h.link.uplink is uplink)
        ]

    def _close_host(self, frame: PendingFrame, why: str) -> None:
        log.error("data channel: closing host %s's data connection: %s", frame.host.name, why)
        self.pool.release(frame.payload)
        frame.payload = None
        frame.host.link.abort()

    def _offer(self, frame: PendingFrame) -> None:
        msg = frame.msg
        if not set(msg.ranks) <= frame.host.ranks:
            raise ProtocolError(
                f"round {msg.round}: the frame lists ranks "
                f"{sorted(set(msg.ranks) - frame.host.ranks)}, which are not this host's"
            )
        route = self._gate.route(msg.round, msg.ranks, frame.host, frame)
        if route is Route.OPEN:
            self._accept(self._rounds[msg.round], frame)
            self._wake.set()
        elif route is Route.DROPPED:
            self.pool.release(frame.payload)

    def _accept(self, state: RoundState, frame: PendingFrame) -> None:
        msg = frame.msg
        ranks = list(msg.ranks)
        payload_len = frame.payload.nbytes if frame.payload is not None else 0
        what = f"host {frame.host.name}'s frame for round {msg.round}"
        check_host_frame(
            msg,
            what=what,
            kind=state.kind,
            takes_contributions=not state.from_controller,
            refusal=state.barrier.refusal(ranks),
            # with a plan, the plan's weights (below, where a lie has a rank's name)
            gamma=self.gamma if state.plan is None else None,
            specs=self._math.specs,
            acc_specs=self._math.acc_specs,
            payload_len=payload_len,
        )
        lie = None if state.plan is None else plancheck.check_host_claims(msg, state.plan)
        if lie is not None:
            told = self._rank_failed(lie.rank, lie.reason)
            if not told or ranks != [lie.rank]:
                # Other ranks' work is in it too, or nobody to tell: nothing of the frame is kept.
                raise ProtocolError(f"{what} carries a contribution that breaks its plan")
            # left out uncovered: the round waits for the rank's death, as for any lost rank
            self.pool.release(frame.payload)
            frame.payload = None
            return
        self._uplinks.count(frame.host, payload_len)
        state.barrier.offer(ranks, frame)
        state.steps.update(dict.fromkeys(ranks, 0) | dict(zip(msg.ranks, msg.steps, strict=False)))

    def _rank_failed(self, rank: int, reason: str) -> bool:
        """``rank`` broke its plan: logged, and told to ``on_misbehaved``; False when there is
        none."""
        log.error("data channel: %s", reason)
        if self.on_misbehaved is None:
            return False
        self.on_misbehaved(rank, reason)
        return True

    # ----- the driver -----------------------------------------------------------------------------

    async def run(self) -> None:
        """The round driver: folds, completes and fans out rounds as frames, hosts and deaths
        arrive."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._closing:
                    return
                for number in sorted(self._rounds):
                    state = self._rounds.get(number)
                    if state is not None:
                        await self._drive(state)
        finally:
            for state in self._rounds.values():
                self._math.drop(state)
                if not state.done.done():
                    state.done.cancel()

    async def _drive(self, state: RoundState) -> None:
        if state.done.done():
            return
        if state.from_controller:
            await self._send_held(state)
            return
        # The barrier hands frames out in rank order, each once no lower rank can still arrive.
        while (frame := state.barrier.next_to_fold()) is not None:
            try:
                bad = await self._math.fold(state, frame)
            finally:
                self.pool.release(frame.payload)
                frame.payload = None
            if bad is not None:
                owner = plancheck.tensor_owner(frame.msg, root=state.plan.root if state.plan else 0)
                why = f"host {frame.host.name} sent {bad[0]} in round {state.number}"
                if owner is None or not self._rank_failed(
                    owner, plancheck.tensor_lie(owner, state.number, bad)
                ):
                    self._close_host(frame, why)
        if state.barrier.complete:
            await self._finish(state)

    async def _finish(self, state: RoundState) -> None:
        mass = state.mass
        if mass > 0 and state.acc is not None:
            held = await self._math.consensus(state, mass)
            previous, self._held = self._held, held
            state.acc, state.acc_buffer = None, None  # the held consensus owns them now
            if previous is not None:
                self._math.release(previous)
            await self._broadcast(state, mass, held)
            if state.snapshot:  # after the broadcast: no rank waits for the copy
                state.copied = await self._math.snapshot_off_loop(held)
        else:
            if mass > 0:
                why = "no tensors were contributed; sending mass 0 (ranks keep their state)"
                log.warning("round %d: mass %g but %s", state.number, mass, why)
            self._math.drop(state)
            # a resumed run's init: no rank sent its state; every rank takes the bundle's consensus
            resumed = self._held if state.kind == "init" else None
            mass = 1.0 if resumed is not None else 0.0
            await self._broadcast(state, mass, resumed)
        self._complete(state, mass)

    async def _send_held(self, state: RoundState) -> None:
        alive = state.barrier.alive
        connected = {r for h in self._hosts if not h.link.is_closing for r in h.ranks}
        if not alive <= connected:
            return  # wait for every expected rank's host
        held = self._held
        if held is None:
            log.warning(
                "round %d: the controller holds no consensus to send; sending mass 0 (ranks keep "
                "their state)",
                state.number,
            )
        await self._broadcast(state, 1.0 if held is not None else 0.0, held)
        if state.snapshot and held is not None:
            state.copied = await self._math.snapshot_off_loop(held)
        self._complete(state, 1.0 if held is not None else 0.0)

    async def _broadcast(self, state: RoundState, mass: float, held: HeldConsensus | None) -> None:
        alive = state.barrier.alive
        hosts = [h for h in self._hosts if not h.link.is_closing and h.ranks & alive]
        if held is None:
            msg = m.Consensus(round=state.number, kind=state.kind, mass=0.0)
            parts: list[memoryview] = []
        else:
            msg = m.Consensus(
                round=state.number, kind=state.kind, mass=mass, tensors=self._math.specs
            )
            parts = [tensor_bytes(t) for t in held.tensors]
        results = await asyncio.gather(
            *(h.link.send_tensors(msg, parts) for h in hosts), return_exceptions=True
        )
        for host, result in zip(hosts, results, strict=True):
            if isinstance(result, ConnectionClosed | OSError | WireError):
                log.warning(
                    "round %d: the consensus did not reach host %s: %s",
                    state.number,
                    host.name,
                    result,
                )
            elif isinstance(result, BaseException):
                raise result

    def _complete(self, state: RoundState, mass: float) -> None:
        self._rounds.pop(state.number, None)
        self._gate.complete(state.number)
        self._rounds_done += 1
        duration_ms = (time.monotonic() - state.opened_at) * 1000.0
        if not state.done.done():
            state.done.set_result(
                RoundResult(
                    round=state.number,
                    kind=state.kind,
                    mass=mass,
                    duration_ms=duration_ms,
                    folded=dict(state.steps),
                    snapshot=state.copied,
                )
            )

    async def aclose(self) -> None:
        """Stop the round driver (open rounds are cancelled) and close every host's data
        connection."""
        self._closing = True
        self._wake.set()
        for host in list(self._hosts):
            with contextlib.suppress(ConnectionClosed, OSError):
                await host.link.aclose()


def check_data_hello(
    hello: Message, schema: ModelSchema, digest: str | None, hosts: list[DataHost]
) -> str | None:
    """Why a host's data connection is refused (None: it is this run's): the hello, the model's
    size and the run digest must match, and no rank may already have a data connection."""
    if not isinstance(hello, m.HostDataHello):
        return f"it opened with {type(hello).__name__} instead of HostDataHello"
    if hello.model_bytes != schema.model_bytes:
        return (
            f"its ranks average a {hello.model_bytes}-byte model, this run's is "
            f"{schema.model_bytes} bytes: every rank must build the same Trainer"
        )
    if digest is not None and hello.digest != digest:
        return (
            f"its ranks' Trainer digest {hello.digest[:12]} is not this run's "
            f"{digest[:12]}: every rank must build the same Trainer"
        )
    taken = {r for h in hosts if not h.link.is_closing for r in h.ranks}
    twice = sorted(taken & set(hello.ranks))
    if twice:
        return f"ranks {twice} already have a data connection from another host"
    return None
