"""What the status endpoint publishes: a frozen snapshot of the run, serialised to JSON.

The controller builds a new :class:`StatusSnapshot` at every lifecycle event
and publishes it on a :class:`StatusBoard`; the HTTP handler only ever reads
the latest one, already encoded, so serving status costs no work on the
controller's hot path.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable
from dataclasses import dataclass, field


class Phase(enum.Enum):
    """Where a run is in its lifecycle."""

    WAITING = "waiting"
    FORMING = "forming"
    TRAINING = "training"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberStatus:
    """One admitted host."""

    host: str
    ranks: tuple[int, ...]
    devices: tuple[str, ...]
    joined_at: float
    state: str = "joined"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankStatus:
    """One rank process."""

    rank: int
    host: str
    local_rank: int
    state: str
    pid: int | None = None
    exit_code: int | None = None
    signal: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusSnapshot:
    """The run as the controller sees it at ``updated_at`` (wall-clock seconds)."""

    run_id: str
    phase: Phase
    started_at: float
    updated_at: float
    world_size: int = 0
    joined_ranks: int = 0
    min_rank_start: int = 0
    target_ranks: int = 0
    restart_count: int = 0
    members: tuple[MemberStatus, ...] = ()
    ranks: tuple[RankStatus, ...] = ()
    verdict: str = ""
    exit_code: int | None = None
    connections: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_json(self) -> bytes:
        """The JSON document served at ``/state.json``."""

        def plain(value: object) -> object:
            if isinstance(value, enum.Enum):
                return value.value
            if isinstance(value, tuple | list):
                return [plain(v) for v in value]
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            return value

        doc = {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if doc["members"]:
            doc["members"] = [dataclasses.asdict(m) for m in self.members]
        if doc["ranks"]:
            doc["ranks"] = [dataclasses.asdict(r) for r in self.ranks]
        return json.dumps(doc, sort_keys=True).encode()


class StatusBoard:
    """Holds the latest published snapshot, pre-encoded."""

    def __init__(self) -> None:
        self._snapshot: StatusSnapshot | None = None
        self._encoded: bytes | None = None
        self._subscribers: list[Callable[[StatusSnapshot], None]] = []

    def publish(self, snapshot: StatusSnapshot) -> None:
        """Replace the published snapshot and tell the subscribers."""
        self._snapshot = snapshot
        self._encoded = snapshot.to_json()
        for subscriber in self._subscribers:
            subscriber(snapshot)

    def subscribe(self, callback: Callable[[StatusSnapshot], None]) -> None:
        """Call ``callback`` with every snapshot published from now on (the SSE/dashboard hook)."""
        self._subscribers.append(callback)

    @property
    def snapshot(self) -> StatusSnapshot | None:
        """The latest snapshot, or None before the first publish."""
        return self._snapshot

    @property
    def encoded(self) -> bytes | None:
        """The latest snapshot as JSON bytes."""
        return self._encoded
