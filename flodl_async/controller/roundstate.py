"""What the reducer keeps per round and per host, and the snapshots it reports.

The records are the reducer's own mutable state (:mod:`flodl_async.controller.reducer` is their
one user); the statistics are frozen snapshots for the status board and the run's log.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..net.framed import FramedProtocol
from ..relay.upstream import LocalUplink
from ..training.foldround import FoldRound
from ..wire import messages as m

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundResult:
    """A completed round: its total mass (0 = nothing realized) and Reduce-opened → last consensus
    written."""

    round: int
    kind: str
    mass: float
    duration_ms: float
    #: The ranks whose contributions the consensus holds, with the steps each brought.
    folded: Mapping[int, int] = field(default_factory=dict)
    #: A checkpoint round's copy of its consensus and of the outer optimizer's state after it.
    snapshot: Snapshot | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """A consensus copied for a checkpoint bundle (CPU tensors nobody else holds): the full
    ``state_dict`` (tied keys included) and the outer optimizer's ``checkpoint_state()`` (None for
    OuterAvg, and before its first real step)."""

    state_dict: Mapping[str, torch.Tensor]
    outer: Mapping[str, object] | None


class LocalDown:
    """The reducer's side of an in-process host: consensus frames go to the relay's fan-out
    directly."""

    def __init__(self, uplink: LocalUplink) -> None:
        self.uplink = uplink
        self.peer_label = "this process's relay"

    @property
    def is_closing(self) -> bool:
        return self.uplink.is_closing

    async def send_tensors(self, msg: m.Consensus, parts: list[memoryview]) -> None:
        await self.uplink.deliver(msg, parts)

    def abort(self) -> None:
        self.uplink.abort()

    async def aclose(self) -> None:
        self.uplink.abort()


@dataclass(frozen=True, slots=True, kw_only=True)
class HostUplinkStatistics:
    """What one host's relay sent up so far (kept after its connection closed): frames and tensor
    bytes accepted."""

    host: str
    ranks: tuple[int, ...]
    #: True for the relay in the controller's process (memory), False for one that dialled the port
    #: (sealed TCP).
    in_process: bool
    frames: int
    payload_bytes: int

    def summary(self) -> str:
        """One line for the run's log: which host's contributions took which path."""
        path = "in this process" if self.in_process else "over the port"
        ranks = ",".join(str(r) for r in self.ranks)
        return (
            f"host {self.host} (ranks {ranks}) sent {self.frames} contribution(s), "
            f"{self.payload_bytes} tensor bytes, {path}"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ReducerStatistics:
    """Hosts connected (over the port, and in this process), rounds completed, and every host's
    uplink since the start."""

    hosts: int
    in_process_hosts: int
    rounds_completed: int
    uplinks: tuple[HostUplinkStatistics, ...] = ()


@dataclass(slots=True)
class DataHost:
    """A host whose data connection (a socket, or this process's relay) the reducer serves."""

    name: str
    ranks: frozenset[int]
    link: FramedProtocol | LocalDown


@dataclass(slots=True)
class UplinkCount:
    """What one host sent so far (cumulative: it outlives the host's connection)."""

    ranks: tuple[int, ...]
    in_process: bool
    frames: int = 0
    payload_bytes: int = 0


class UplinkCounts:
    """What each host sent so far, by name: cumulative, so a host whose link closed still shows
    what it sent."""

    def __init__(self) -> None:
        self._counts: dict[str, UplinkCount] = {}

    def count(self, host: DataHost, payload_len: int) -> None:
        """``host`` sent one more accepted frame, with ``payload_len`` tensor bytes."""
        count = self._counts.setdefault(
            host.name,
            UplinkCount(
                ranks=tuple(sorted(host.ranks)), in_process=isinstance(host.link, LocalDown)
            ),
        )
        count.frames += 1
        count.payload_bytes += payload_len

    def statistics(self) -> tuple[HostUplinkStatistics, ...]:
        """Every host's uplink since the start, by lowest rank."""
        return tuple(
            HostUplinkStatistics(
                host=name,
                ranks=c.ranks,
                in_process=c.in_process,
                frames=c.frames,
                payload_bytes=c.payload_bytes,
            )
            for name, c in sorted(
                self._counts.items(), key=lambda item: min(item[1].ranks, default=0)
            )
        )


@dataclass(slots=True)
class PendingFrame:
    """A host frame taken for a round, not folded yet; its payload is the reducer's to release."""

    msg: m.HostContribution
    payload: memoryview | None
    host: DataHost


@dataclass(slots=True)
class RoundState:
    """An open round: its fold barrier (who is expected, covered and dead; the frames waiting in
    order) and the partial sum."""

    number: int
    kind: str
    barrier: FoldRound[PendingFrame]
    from_controller: bool
    opened_at: float
    done: asyncio.Future[RoundResult]
    #: What each rank may claim in the round (None: claims are checked against gamma only).
    plan: m.RoundPlan | None = None
    mass: float = 0.0
    acc: list[torch.Tensor] | None = None
    acc_buffer: bytearray | memoryview | None = None
    folded: int = 0
    #: rank -> the steps its contribution brought, for every rank a frame taken lists
    steps: dict[int, int] = field(default_factory=dict)
    #: A checkpoint round: its consensus is copied as it is made (:attr:`RoundResult.snapshot`).
    snapshot: bool = False
    copied: Snapshot | None = None


@dataclass(slots=True)
class HeldConsensus:
    """The held consensus: tensors in schema order, in model dtypes, and the pooled buffers behind
    them."""

    tensors: list[torch.Tensor]
    buffers: list[bytearray | memoryview] = field(default_factory=list)
