"""A COLLECTIVE rank's process group: opened at the start, re-formed in place after a loss.

Theory of operation. A COLLECTIVE rank averages with ``torch.distributed`` in place (the outer step
replicated on every rank). When a peer dies, the coordinator tells the survivors how to re-form
(:mod:`flodl_async.training.regroup`): each destroys its group and opens a new one on the run's own
store (``MASTER_ADDR``/``MASTER_PORT``, the same the first group used) under a prefix of its
generation, so the first group's keys are neither reused nor erased; its rank there is its place in
the survivors' order.

An all_reduce a peer's death interrupts fails on the dead socket (gloo; NCCL's is aborted from the
link thread, :meth:`ProcessGroup.abort`) and may have finished on some survivors and not on others.
So an elastic rank enters each round with a copy of its state (``base``), and keeps, after it, the
reference its state is measured against (``ref``: the round's consensus once it finished, ``base``
if it failed, the state restored from it). Asked to redo the round, it takes what it trained since
as a delta (state − ``ref``), reduces ``base`` in the new group, and adds the delta back: what every
survivor holds is again one consensus, and no step trained is lost. The price is two copies of the
model, held only when the run can survive a loss.

Only the compute thread calls it, except :meth:`ProcessGroup.abort`.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import TrainingFailed
from ..training.regroup import Regroup
from ..verdict import ExitCode, RunResult

if TYPE_CHECKING:
    import torch

log = logging.getLogger("flodl_async.trainer.collective")

#: How often a re-forming rank looks at the store's count of arrived survivors (and at its inbox).
_ARRIVAL_POLL_S = 0.01
#: Errors a collective raises when a peer dies under it (gloo: the socket; NCCL: the abort).
_PEER_LOST = (RuntimeError,)


@dataclass(slots=True, kw_only=True)
class _Entered:
    """The last round this rank entered: what it brought, and what its state is measured from."""

    round: int
    kind: str
    weight: float
    base: list[torch.Tensor] | None
    ref: list[torch.Tensor] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class OuterHooks:
    """The outer optimizer's step on the reduced parameters, and its rewind to before the last one
    (a redone round steps again from the same state)."""

    step: Callable[[], None]
    rewind: Callable[[], None]


class ProcessGroup:
    """This rank's ``torch.distributed`` group, re-formed in place when the coordinator says so.

    ``elastic``: the run can survive a loss, so each round keeps what a redo needs; ``timeout``
    bounds a collective and a re-form's rendezvous (a re-form that names a rank which died too
    is replaced by the next one well within it).
    """

    def __init__(self, rank: int, device: torch.device, *, elastic: bool, timeout: float) -> None:
        self.rank = rank
        self.generation = 0
        self._backend = "nccl" if device.type == "cuda" else "gloo"
        self.elastic = elastic
        self._timeout = datetime.timedelta(seconds=timeout)
        self._entered: _Entered | None = None

    def open(self) -> None:
        import torch.distributed as dist  # deferred: torch loads only on a COLLECTIVE rank

        if not dist.is_initialized():
            dist.init_process_group(self._backend, timeout=self._timeout)

    def close(self) -> None:
        import torch.distributed as dist  # deferred: torch loads only on a COLLECTIVE rank

        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    def abort(self) -> None:
        """From the link thread, when a peer is declared dead: NCCL's collectives do not fail on
        their own, so the communicator is aborted under them (gloo's fail on the dead socket)."""
        if self._backend != "nccl":
            return
        from torch.distributed import distributed_c10d  # deferred with torch

        with contextlib.suppress(Exception):
            distributed_c10d._abort_process_group()  # torch's own abort path

    # ----- rounds ---------------------------------------------------------------------------------

    def reduce(
        self,
        round_: int,
        kind: str,
        weight: float,
        tensors: Sequence[torch.Tensor],
        outer: OuterHooks,
    ) -> float | None:
        """Round ``round_``'s consensus into ``tensors`` in place; its mass, or None when a peer's
        death interrupted it (elastic runs: the state is as it entered, and a redo will come)."""
        import torch  # deferred: torch loads only where a tensor is touched

        with torch.no_grad():
            base = [t.detach().clone() for t in tensors] if self.elastic else None
            try:
                mass = self._collective(kind, weight, tensors, outer)
            except _PEER_LOST as exc:
                if not self.elastic:
                    raise
                assert base is not None
                for t, b in zip(tensors, base, strict=True):
                    t.copy_(b)
                entered = _Entered(round=round_, kind=kind, weight=weight, base=base, ref=base)
                self._entered = entered
                log.warning(
                    "rank %d: the all_reduce of round %d failed (%s); waiting for the coordinator "
                    "to re-form the group",
                    self.rank,
                    round_,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                )
                return None
            if self.elastic:
                ref = [t.detach().clone() for t in tensors]
                self._entered = _Entered(round=round_, kind=kind, weight=weight, base=base, ref=ref)
        return mass

    def rendezvous(self, regroup: Regroup, *, superseded: Callable[[], bool]) -> bool:
        """Re-form as ``regroup`` says; False when ``superseded()`` said a later re-form replaces it
        before every rank it names arrived (one of them died too). A rendezvous that does not
        complete within the timeout raises :class:`TrainingFailed`.

        The survivors first count themselves in on the store, polling ``superseded`` meanwhile:
        ``init_process_group`` itself cannot be interrupted, and would wait its whole timeout for a
        rank that died after the re-form was planned."""
        import torch.distributed as dist  # deferred: torch loads only on a COLLECTIVE rank
        from torch._C._distributed_c10d import PrefixStore, TCPStore  # deferred with torch

        self.close()
        started = time.monotonic()
        try:
            store = TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=self._timeout,
            )
            prefixed = PrefixStore(f"flodl/regroup/{regroup.generation}/", store)
            prefixed.add("arrived", 1)
            while prefixed.add("arrived", 0) < len(regroup.ranks):
                if superseded():
                    return False
                if time.monotonic() - started > self._timeout.total_seconds():
                    raise RuntimeError("not every rank arrived on the store in time")
                time.sleep(_ARRIVAL_POLL_S)
            dist.init_process_group(
                self._backend,
                store=prefixed,
                rank=regroup.ranks.index(self.rank),
                world_size=len(regroup.ranks),
                timeout=self._timeout,
            )
        except (RuntimeError, ValueError) as exc:  # torch's DistStoreError is a RuntimeError
            raise TrainingFailed(
                RunResult(
                    exit_code=ExitCode.RANK_FAILURE,
                    reason=f"rank {self.rank} could not re-form its process group with ranks "
                    f"{list(regroup.ranks)} (generation {regroup.generation}): {exc}",
                )
            ) from exc
        self.generation = regroup.generation
        return True

    def redo(
        self, regroup: Regroup, tensors: Sequence[torch.Tensor], outer: OuterHooks
    ) -> float | None:
        """After :meth:`rendezvous`: redo ``regroup``'s round if this rank entered it (its mass),
        else None."""
        import torch  # deferred: torch loads only where a tensor is touched

        entered = self._entered
        if regroup.redo < 0 or entered is None or entered.round != regroup.redo:
            return None
        with torch.no_grad():
            if entered.kind == "init":
                return self._collective("init", entered.weight, tensors, outer)
            assert entered.base is not None
            assert entered.ref is not None
            delta = [
                t - r if t.is_floating_point() else None
                for t, r in zip(tensors, entered.ref, strict=True)
            ]
            for t, b in zip(tensors, entered.base, strict=True):
                t.copy_(b)
            outer.rewind()
            mass = self._collective(entered.kind, entered.weight, tensors, outer)
            ref = [t.detach().clone() for t in tensors]
            for t, d in zip(tensors, delta, strict=True):
                if d is not None:
                    t.add_(d)
            entered.ref = ref
        return mass

    def _collective(
        self, kind: str, weight: float, tensors: Sequence[torch.Tensor], outer: OuterHooks
    ) -> float:
        import torch  # deferred: torch loads only where a tensor is touched
        import torch.distributed as dist  # deferred with torch

        if kind == "init":
            for t in tensors:
                dist.broadcast(t, src=0)
            return 1.0
        total = torch.tensor([weight], dtype=torch.float64)
        dist.all_reduce(total)
        mass = float(total.item())
        if mass > 0:
            for t in tensors:
                if t.is_floating_point():
                    t.mul_(weight / mass)
                    dist.all_reduce(t)
                else:
                    acc = t.double().mul_(weight / mass)
                    dist.all_reduce(acc)
                    # round half to even, as the CPU reducer
                    t.copy_(torch.round(acc).to(t.dtype))
            if kind == "model":
                outer.step()
        return mass
