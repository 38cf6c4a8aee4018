"""The run's events: one typed stream that every view (``/events``, ``/metrics``, the page) is fed
from.

Theory of operation
-------------------
Pure: no I/O, no asyncio. An event is a frozen dataclass saying what happened; the board stamps
each with a sequence number (``id``, what ``Last-Event-ID`` resumes from) and the wall-clock time
(:class:`Stamped`). Two sources feed it:

* most events are *derived*: the controller already publishes a snapshot at every lifecycle
  change, so :class:`Chronicle` compares each snapshot with the one before and says what changed
  (a phase, a host that joined, the world formed, a restart, a rank that died, the verdict);
* what a snapshot does not carry is *emitted* directly by the code that sees it: a committed
  round with the loss of the windows it closed, an epoch's metrics (the Trainer's shell), a
  checkpoint (its writer).

:class:`Chronicle` also pairs deaths with what ended them: a rank that died while training goes
on is *recovered* by the first round committed without it (``regroup``), one whose death restarted
the world by the world forming again (``restart``); the time in between is the recovery's
duration.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from .model import Phase, RankState, StatusSnapshot, plain


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseChanged:
    """The run moved to ``phase`` (the timeline's steps)."""

    phase: Phase


@dataclass(frozen=True, slots=True, kw_only=True)
class HostJoined:
    """A host was admitted with its ranks."""

    host: str
    ranks: tuple[int, ...]
    devices: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class WorldFormed:
    """The world formed (again, after a restart: ``restart`` > 0)."""

    world_size: int
    hosts: int
    restart: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundDone:
    """The Trainer committed a round: its reduce took ``reduce_s``; ``loss`` and ``step_s`` are the
    mean loss and step time of the ``batches`` reported since the round before (None: no batch
    reported in between)."""

    round: int
    round_kind: str
    reduce_s: float
    batches: int
    loss: float | None = None
    step_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RankShare:
    """One rank's part of an epoch."""

    rank: int
    batches: int
    batch_share: float
    throughput: float
    avg_loss: float
    alive: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class EpochDone:
    """The Trainer closed an epoch (``epoch`` counts from 1)."""

    epoch: int
    epochs: int
    avg_loss: float
    epoch_s: float
    batches: int
    reduces: int
    avg_reduce_s: float
    anchor: int
    per_rank: tuple[RankShare, ...]
    scalars: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankDied:
    """A rank's process failed, or the Trainer lost it."""

    rank: int
    host: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RankRecovered:
    """The run got over ``rank``'s death, ``seconds`` after it, ``by`` a ``regroup`` (training went
    on without it) or a ``restart`` (the world formed again)."""

    rank: int
    host: str
    by: str
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Restarted:
    """The supervisor restarted the world (``restart``: how many times so far)."""

    restart: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointSaved:
    """A checkpoint was written (emitted by its writer; nothing in this version writes one)."""

    epoch: int
    path: str
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ScalarsReported:
    """A rank reported named scalars (``fa.report``): the latest value of each."""

    rank: int
    scalars: Mapping[str, float]


@dataclass(frozen=True, slots=True, kw_only=True)
class VerdictGiven:
    """The run ended: its exit code and why."""

    exit_code: int
    reason: str


RunEvent = (
    PhaseChanged
    | HostJoined
    | WorldFormed
    | RoundDone
    | EpochDone
    | RankDied
    | RankRecovered
    | Restarted
    | CheckpointSaved
    | ScalarsReported
    | VerdictGiven
)

#: Each event's ``kind`` in its JSON form (what the page and ``flodl`` switch on).
EVENT_KINDS: Mapping[type, str] = {
    PhaseChanged: "phase",
    HostJoined: "host_joined",
    WorldFormed: "world_formed",
    RoundDone: "round",
    EpochDone: "epoch",
    RankDied: "rank_died",
    RankRecovered: "rank_recovered",
    Restarted: "restart",
    CheckpointSaved: "checkpoint",
    ScalarsReported: "scalars",
    VerdictGiven: "verdict",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Stamped:
    """An event as the board recorded it: its sequence number (from 1) and wall-clock time."""

    id: int
    at: float
    event: RunEvent

    @property
    def kind(self) -> str:
        """The event's :data:`EVENT_KINDS` name."""
        return EVENT_KINDS[type(self.event)]

    def to_document(self) -> dict[str, object]:
        """``{"id", "at", "kind", ...the event's fields}`` as plain JSON values (no event has a
        field named like those three)."""
        fields = {
            f.name: plain(getattr(self.event, f.name)) for f in dataclasses.fields(self.event)
        }
        return {"id": self.id, "at": self.at, "kind": self.kind, **fields}

    def to_json(self) -> bytes:
        """One line of JSON (keys sorted)."""
        return json.dumps(self.to_document(), sort_keys=True).encode()


#: Rank states that mean the process is gone for a reason other than finishing.
_DEAD = (RankState.FAILED,)
_FORMED = (Phase.FORMING, Phase.TRAINING)


def _all_up(snapshot: StatusSnapshot) -> bool:
    """Every rank of the world runs again (a restarted world has formed once its ranks run)."""
    up = [r for r in snapshot.ranks if r.state in (RankState.RUNNING, RankState.CONNECTED)]
    return len(up) >= snapshot.world_size


class Chronicle:
    """Derives events from consecutive snapshots, and recoveries from deaths (see the module)."""

    def __init__(self) -> None:
        self._previous: StatusSnapshot | None = None
        self._formed: tuple[int, int] | None = None  # (world size, restart) of the last world
        # (restart, rank): deaths already told; rank -> (host, wall time of death) not recovered yet
        self._told: set[tuple[int, int]] = set()
        self._pending: dict[int, tuple[str, float]] = {}

    def after_snapshot(self, snapshot: StatusSnapshot) -> list[RunEvent]:
        """What changed since the previous snapshot, in the order it happened."""
        before = self._previous
        self._previous = snapshot
        now = snapshot.updated_at
        events: list[RunEvent] = []
        if before is None or before.phase is not snapshot.phase:
            events.append(PhaseChanged(phase=snapshot.phase))
        known = {mb.host for mb in before.members} if before is not None else set()
        events += [
            HostJoined(host=mb.host, ranks=mb.ranks, devices=mb.devices)
            for mb in snapshot.members
            if mb.host not in known
        ]
        if before is not None and snapshot.restart_count > before.restart_count:
            events.append(Restarted(restart=snapshot.restart_count))
        formed = (snapshot.world_size, snapshot.restart_count)
        if (
            snapshot.world_size > 0
            and snapshot.phase in _FORMED
            and formed != self._formed
            and (snapshot.restart_count == 0 or _all_up(snapshot))
        ):
            self._formed = formed
            events.append(
                WorldFormed(
                    world_size=snapshot.world_size,
                    hosts=len(snapshot.members),
                    restart=snapshot.restart_count,
                )
            )
            if snapshot.restart_count > 0:
                events += self._recover("restart", now)
        if before is None or not before.verdict:
            # once the run has its verdict, ranks ending in its teardown are not deaths to tell
            events += self._deaths(snapshot, now)
        if snapshot.verdict and (before is None or not before.verdict):
            events.append(
                VerdictGiven(
                    exit_code=snapshot.exit_code if snapshot.exit_code is not None else -1,
                    reason=snapshot.verdict,
                )
            )
        return events

    def after_event(self, event: RunEvent, now: float) -> list[RunEvent]:
        """Events that ``event`` (emitted, not derived) implies: a round committed after a death
        in training recovers it."""
        if isinstance(event, RoundDone):
            return self._recover("regroup", now)
        return []

    def _deaths(self, snapshot: StatusSnapshot, now: float) -> list[RunEvent]:
        found: dict[int, RankDied] = {}
        generation = snapshot.restart_count
        # A plain script's world stops at its first failure: the ranks stopped with it (SIGTERM
        # from their agent) are not deaths. A Trainer's ranks die one by one, each told.
        stopped_with_the_world = snapshot.training is None and any(
            restart == generation for restart, _ in self._told
        )
        for rank in snapshot.ranks:
            if rank.state in _DEAD and stopped_with_the_world:
                self._told.add((generation, rank.rank))
            elif rank.state in _DEAD:
                how = f"signal {rank.signal}" if rank.signal else f"exit code {rank.exit_code}"
                found[rank.rank] = RankDied(rank=rank.rank, host=rank.host, reason=how)
        lost = (snapshot.training or {}).get("lost")
        if isinstance(lost, list | tuple):
            for entry in lost:
                if isinstance(entry, Mapping) and isinstance(entry.get("rank"), int):
                    rank_no = int(entry["rank"])
                    found[rank_no] = RankDied(
                        rank=rank_no,
                        host=str(entry.get("host", "")),
                        reason=str(entry.get("reason", "")),
                    )
        events: list[RunEvent] = []
        for rank_no, died in sorted(found.items()):
            key = (snapshot.restart_count, rank_no)
            if key in self._told:
                continue
            self._told.add(key)
            events.append(died)
            if snapshot.phase not in (Phase.DONE, Phase.FAILED):
                self._pending[rank_no] = (died.host, now)
        return events

    def _recover(self, by: str, now: float) -> list[RunEvent]:
        events: list[RunEvent] = [
            RankRecovered(rank=rank, host=host, by=by, seconds=max(0.0, now - at))
            for rank, (host, at) in sorted(self._pending.items())
        ]
        self._pending.clear()
        return events
