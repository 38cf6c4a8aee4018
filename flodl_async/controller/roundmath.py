"""The reducer's tensor math: host frames folded into a round's accumulator, and the consensus.

Every tensor operation runs in an executor thread (torch is imported only there); the loop only
hands buffers over. A round's accumulator is a pooled buffer in the accumulator dtypes
(:mod:`flodl_async.training.foldmath`); the consensus divides it by the round's mass, rounds
integer buffers half-to-even, casts floats back, and lets a ``model`` round's parameters take the
outer optimizer's step (:mod:`flodl_async.training.outer`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from concurrent.futures import Executor
from typing import TYPE_CHECKING

from ..errors import ProtocolError
from ..net.bufpool import BufferPool
from ..training import foldmath, plancheck
from ..training.modelschema import ModelSchema
from ..training.outer import OuterAvg, OuterSpec, OuterStepper
from .roundstate import HeldConsensus, PendingFrame, RoundState, Snapshot

if TYPE_CHECKING:
    import torch


class RoundMath:
    """Folds, finishes and copies the reducer's tensors for one model ``schema``, off the loop."""

    def __init__(
        self, schema: ModelSchema, outer: OuterSpec, executor: Executor | None, pool: BufferPool
    ) -> None:
        self.schema = schema
        self.outer = outer
        self._executor = executor
        self._pool = pool
        self._stepper = OuterStepper(outer)
        self._metas = schema.tensors
        #: The model's layout packed in its own dtypes (a plain frame, the consensus) and in the
        #: accumulator dtypes (a prescaled frame, the accumulator), with their byte lengths.
        self.specs, self._model_len = foldmath.schema_specs(self._metas)
        self.acc_specs, self.acc_len = foldmath.schema_specs(self._metas, accumulated=True)
        self._n_params = len(schema.params)

    async def fold(self, state: RoundState, frame: PendingFrame) -> tuple[str, str] | None:
        """Add ``frame``'s weighted tensors to ``state``'s accumulator (the first one starts it).

        A raw frame's tensors are one rank's bytes that no relay folded, so they are checked in the
        same executor call (:func:`~flodl_async.training.plancheck.first_bad_tensor`): what is
        wrong with them is returned instead, and nothing of the frame counts. A prescaled frame's
        were checked rank by rank by the relay that folded them.
        """
        msg = frame.msg
        if msg.tensors:
            first = state.acc is None
            bad = await (self._start(state, frame) if first else self._add(state, frame))
            if bad is not None:
                return bad
            state.folded += 1
        state.mass += msg.weight
        return None

    @staticmethod
    def _bad(frame: PendingFrame, terms: list[torch.Tensor]) -> tuple[str, str] | None:
        msg = frame.msg
        return None if msg.prescaled else plancheck.first_bad_tensor(msg.tensors, terms, msg.weight)

    async def _start(self, state: RoundState, frame: PendingFrame) -> tuple[str, str] | None:
        msg, payload = frame.msg, frame.payload
        assert payload is not None
        weight = None if msg.prescaled else msg.weight
        specs, acc_specs = msg.tensors, self.acc_specs
        loop = asyncio.get_running_loop()
        if tuple(specs) == acc_specs:
            # Already the accumulator's layout (a prescaled frame, or a float32 model): it becomes
            # the accumulator.

            def adopt() -> tuple[str, str] | list[torch.Tensor]:
                acc = foldmath.views(acc_specs, payload)
                bad = self._bad(frame, acc)
                if bad is not None:
                    return bad
                if weight is not None and weight != 1.0:
                    for a in acc:
                        a.mul_(weight)
                return acc

            adopted = await loop.run_in_executor(self._executor, adopt)
            if isinstance(adopted, tuple):
                return adopted
            frame.payload = None
            state.acc, state.acc_buffer = adopted, payload
            return None
        buffer = self._pool.acquire(self.acc_len)

        def start() -> tuple[str, str] | list[torch.Tensor]:
            terms = foldmath.views(specs, payload)
            bad = self._bad(frame, terms)
            if bad is not None:
                return bad
            acc = foldmath.views(acc_specs, buffer)
            foldmath.add_term(acc, terms, weight, first=True)
            return acc

        started = await loop.run_in_executor(self._executor, start)
        if isinstance(started, tuple):
            self._pool.release(buffer)
            return started
        state.acc, state.acc_buffer = started, buffer
        return None

    async def _add(self, state: RoundState, frame: PendingFrame) -> tuple[str, str] | None:
        msg, payload, acc = frame.msg, frame.payload, state.acc
        assert payload is not None
        assert acc is not None
        weight = None if msg.prescaled else msg.weight

        def add() -> tuple[str, str] | None:
            terms = foldmath.views(msg.tensors, payload)
            bad = self._bad(frame, terms)
            if bad is None:
                foldmath.add_term(acc, terms, weight, first=False)
            return bad

        return await asyncio.get_running_loop().run_in_executor(self._executor, add)

    async def consensus(self, state: RoundState, mass: float) -> HeldConsensus:
        """``state``'s accumulator made the consensus (it owns the accumulator's buffer now)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self._consensus_of, state, mass
        )

    def _consensus_of(self, state: RoundState, mass: float) -> HeldConsensus:
        """Executor thread: divide, round, cast back, outer step; the consensus in model dtypes."""
        import torch

        acc = state.acc
        assert acc is not None
        buffers: list[bytearray | memoryview] = (
            [state.acc_buffer] if state.acc_buffer is not None else []
        )
        needs_cast = [meta.dtype != foldmath.acc_dtype(meta.dtype) for meta in self._metas]
        out_buffer = self._pool.acquire(self._model_len) if any(needs_cast) else None
        out_views = foldmath.views(self.specs, out_buffer) if out_buffer is not None else []
        outs: list[torch.Tensor | None] = [
            out_views[i] if cast else None for i, cast in enumerate(needs_cast)
        ]
        if out_buffer is not None:
            buffers.append(out_buffer)
        stepping = state.kind == "model" and not isinstance(self.outer, OuterAvg)
        if not stepping:
            tensors = foldmath.finish(acc, [meta.dtype for meta in self._metas], mass, outs)
            return HeldConsensus(tensors=tensors, buffers=buffers)
        n = self._n_params
        for a in acc[:n]:
            a.div_(mass)
        params = {meta.name: a for meta, a in zip(self._metas[:n], acc[:n], strict=True)}
        dtypes = {meta.name: getattr(torch, meta.dtype) for meta in self._metas[:n]}
        stepped = self._stepper.step(params, dtypes)
        tensors = [stepped[meta.name].contiguous() for meta in self._metas[:n]]
        tensors += foldmath.finish(
            acc[n:], [meta.dtype for meta in self._metas[n:]], mass, outs[n:]
        )
        return HeldConsensus(tensors=tensors, buffers=buffers)

    def copy(self, held: HeldConsensus) -> dict[str, torch.Tensor]:
        """A copy of ``held`` as a full state_dict (tied keys included), made on this thread."""
        copies = {meta.name: t.clone() for meta, t in zip(self._metas, held.tensors, strict=True)}
        return self.schema.with_aliases(copies)

    async def copy_off_loop(self, held: HeldConsensus) -> dict[str, torch.Tensor]:
        """:meth:`copy`, in an executor thread (tensor math stays off the loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.copy, held)

    def snapshot(self, held: HeldConsensus) -> Snapshot:
        """A checkpoint's copy of ``held`` and of the outer optimizer's state, made on this thread
        (the outer step mutates its velocity in place, so it is cloned too)."""
        outer = self._stepper.checkpoint_state()
        if outer is not None:
            velocity = outer["velocity"]
            assert isinstance(velocity, dict)
            outer = {**outer, "velocity": {k: v.clone() for k, v in velocity.items()}}
        return Snapshot(state_dict=self.copy(held), outer=outer)

    async def snapshot_off_loop(self, held: HeldConsensus) -> Snapshot:
        """:meth:`snapshot`, in an executor thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.snapshot, held)

    def load_outer(self, state: Mapping[str, object]) -> None:
        """Resume: the outer optimizer's momentum of a checkpoint (its previous global is the
        consensus :meth:`initial` took)."""
        velocity = state.get("velocity")
        if isinstance(velocity, Mapping):
            self._stepper.load_velocity(velocity)

    def initial(self, state: Mapping[str, torch.Tensor]) -> HeldConsensus:
        """Resume: ``state`` (a state_dict of this schema) as the consensus, and as the outer
        optimizer's previous global (the point its next step moves from)."""
        tensors = []
        for meta in self._metas:
            if meta.name not in state:
                raise ProtocolError(f"the initial state has no tensor {meta.name!r}")
            t = state[meta.name].detach().to("cpu")
            if str(t.dtype).removeprefix("torch.") != meta.dtype or tuple(t.shape) != meta.shape:
                raise ProtocolError(
                    f"the initial state's {meta.name!r} is {t.dtype} {tuple(t.shape)}, the model's "
                    f"is {meta.dtype} {meta.shape}"
                )
            tensors.append(t.contiguous().clone())
        self._stepper.set_prev_global(
            dict(zip(self.schema.param_names, tensors[: self._n_params], strict=True))
        )
        return HeldConsensus(tensors=tensors)

    def drop(self, state: RoundState) -> None:
        """Give ``state``'s accumulator and waiting frames' buffers back to the pool."""
        state.acc = None
        self._pool.release(state.acc_buffer)
        state.acc_buffer = None
        for frame in state.barrier.drain():
            self._pool.release(frame.payload)
            frame.payload = None

    def release(self, held: HeldConsensus) -> None:
        """Give a consensus that was replaced back to the pool."""
        held.tensors = []
        for buffer in held.buffers:
            self._pool.release(buffer)
