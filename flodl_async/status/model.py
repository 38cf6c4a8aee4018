"""What the status endpoint publishes: a frozen snapshot of the run, serialised to JSON.

The controller builds a new :class:`StatusSnapshot` at every lifecycle event
and publishes it on a :class:`~flodl_async.status.board.StatusBoard`. This
module is the pure half: data and its JSON form, no I/O, no asyncio.

The JSON document (``/state.json``) carries ``"schema": "flodl-status/1"``
(:data:`SCHEMA`) so a client can tell a flodl status from any other JSON that
happens to answer on a port; states are enums here and their lower-case
strings on the wire, which the page and ``flodl status`` read.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

#: The schema marker of every JSON document the status endpoint serves. The
#: major version changes only when a field changes meaning or goes away.
SCHEMA = "flodl-status/1"
#: What every version of the marker starts with (clients accept any minor evolution of /1).
SCHEMA_FAMILY = "flodl-status/"

#: The live counters that ride along with a snapshot (``connections`` in the document):
#: counter group (``routed``, ``dropped``, ``accept_errors``, ``throttle``, ``breaker``, ``open``)
#: → name → count.
Counters = Mapping[str, Mapping[str, int]]


class Phase(enum.Enum):
    """Where a run is in its lifecycle."""

    WAITING = "waiting"
    #: The world formed; its round's store is being opened and no rank runs yet (the supervisor's
    #: ``Rendezvous``).
    FORMING = "forming"
    TRAINING = "training"
    DONE = "done"
    FAILED = "failed"


class MemberState(enum.Enum):
    """Where an admitted host is."""

    JOINED = "joined"


class RankState(enum.Enum):
    """Where a rank process is: started by its agent, connected to the control channel, or gone."""

    RUNNING = "running"
    CONNECTED = "connected"
    EXITED = "exited"
    FAILED = "failed"


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberStatus:
    """One admitted host."""

    host: str
    ranks: tuple[int, ...]
    devices: tuple[str, ...]
    joined_at: float
    state: MemberState = MemberState.JOINED


#: What a ``/proc/<pid>/stat`` state letter means, for people (what agents report of their ranks).
PROCESS_STATES: Mapping[str, str] = {
    "R": "running",
    "S": "sleeping",
    "D": "uninterruptible",
    "T": "stopped",
    "t": "stopped (traced)",
    "Z": "zombie",
    "X": "gone",
    "I": "idle",
    "P": "parked",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class RankStatus:
    """One rank process; the activity fields come from its agent's periodic report (None until the
    first)."""

    rank: int
    host: str
    local_rank: int
    state: RankState
    pid: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    uptime_s: float | None = None
    process: str | None = None  # PROCESS_STATES: running, sleeping, uninterruptible, stopped...
    cpu_percent: float | None = None
    #: The rank's last output line: served only to status clients on the controller's own host.
    last_line: str = ""
    output_age_s: float | None = None  # None: no output yet
    quiet_s: float | None = None  # neither output nor CPU progress for this long
    store_connected: bool | None = None


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
    connections: Counters = field(default_factory=dict)
    #: The Trainer's coordinator (epoch/epochs, policy, backend, anchor, counts, last reduce ms,
    #: per-rank
    #: state, batches and heartbeat age, the last epoch's metrics); None in a run without Trainer
    #: ranks.
    training: Mapping[str, object] | None = None

    def to_document(self) -> dict[str, object]:
        """The document served at ``/state.json``, as plain JSON values (enums as their strings)."""
        doc = {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if self.training is None:
            # additive: a run without Trainer ranks serves the document it always did
            del doc["training"]
        doc["schema"] = SCHEMA
        return doc

    def to_json(self) -> bytes:
        """The JSON bytes served at ``/state.json`` (keys sorted, so equal snapshots encode
        equal)."""
        return json.dumps(self.to_document(), sort_keys=True).encode()

    @property
    def quotes_output(self) -> bool:
        """Whether any rank's last output line is in it (then remote clients get
        :meth:`without_output`)."""
        return any(r.last_line for r in self.ranks)

    def without_output(self) -> StatusSnapshot:
        """This snapshot with the ranks' output lines left out (their ages stay): for clients on
        other hosts."""
        return dataclasses.replace(
            self, ranks=tuple(dataclasses.replace(r, last_line="") for r in self.ranks)
        )


def plain(value: object) -> object:
    """``value`` as JSON-ready data: enums by value, dataclasses as objects, tuples as arrays."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    return value
