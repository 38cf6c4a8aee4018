"""The supervisor's vocabulary: what it decides with, the events it takes, the actions it
returns, its phases and the view it shows.

The machine that relates them is :class:`~flodl_async.control.supervisor.Supervisor`. Its
:class:`~flodl_async.control.vocab.Tick`, :class:`~flodl_async.control.vocab.Announce` (at a
:class:`~flodl_async.control.vocab.Level`) and :class:`~flodl_async.control.vocab.Tell` (to a
host, down its join link) are the words it shares with the Trainer's coordinator. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TypeVar

from .._version import __version__
from ..host.hostnames import HostAliases
from ..status.model import PROCESS_STATES, RankStatus
from ..verdict import ExitCode, RunResult
from ..wire import messages as m
from .dispatch import members
from .membership import Formed, JoinConfig, JoinedMember, JoinWindow
from .vocab import Announce, Tell, Tick
from .watch import AbortLinks, CutJoinLink, SendHeartbeat, Woke

# ----- configuration ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SupervisorConfig:
    """What the supervisor decides with, resolved by the launcher (deadlines already scaled)."""

    run_id: str
    join: JoinConfig
    command: tuple[str, ...]
    cluster_env: Mapping[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    stop_grace: float = 10.0
    store_ready_timeout: float = 120.0
    stop_ack_margin: float = 10.0
    #: The store rides the controller's port (the default backend): each round empties it
    #: (:class:`ResetStore`) and starts the ranks at once, each host dialling the controller
    #: the way its agent does. False: a store host serves it and reports :class:`StoreReady`.
    controller_store: bool = False
    #: Hosts whose agent runs inside the controller's process: one of them hosts the store.
    local_hosts: frozenset[str] = frozenset()
    #: The spellings of the controller's machine (localhost, loopback, hostname, FQDN): one host at
    #: join.
    host_aliases: HostAliases | None = None
    protocol_version: int = 1
    #: This controller's flodl_async version: an agent of another version is refused at join.
    version: str = __version__
    #: ``--hang-timeout``: a rank with neither output nor CPU progress this long ends the run (exit
    #: 6); None: off.
    hang_timeout: float | None = None
    #: Hosts whose agent a launcher of this controller runs (in its process, or over ssh): such an
    #: agent that fails closes its join link first, and says why through its launcher a moment
    #: later.
    launched_hosts: frozenset[str] = frozenset()
    #: How long a launched host's closed join link waits for that reason before its own (that the
    #: link closed) is the verdict's.
    agent_reason_wait: float = 2.0
    #: How long a rank's failure, with no restart left while the Trainer's coordinator runs, waits
    #: for the coordinator's own cause before the exit is the verdict: the rank sends that cause
    #: up its relay link and then exits, and its agent reports the exit down another link, so
    #: either may arrive first (:class:`Concluding`).
    training_outcome_wait: float = 2.0
    #: Seconds between the heartbeats down each join link (:mod:`flodl_async.control.watch`).
    heartbeat_interval: float = 2.0
    #: Seconds of a link's silence after which its host is lost.
    heartbeat_silence: float = 10.0


# ----- events ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class JoinRequested:
    """An agent's hello arrived on a join connection."""

    host: str
    devices: tuple[str, ...]
    protocol_version: int
    agent_version: str
    #: ``JoinHello.launch``: the every-node launch digest ("" from any other agent).
    launch: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class JoinUndelivered:
    """The accept for ``host`` could not be sent (its connection died at once)."""

    host: str


@dataclass(frozen=True, slots=True, kw_only=True)
class HostLost:
    """A host's agent is gone: its link closed or broke, or its launcher failed; its control links
    go with it."""

    host: str
    reason: str
    #: Its join link closed or broke (``reason`` says how; the link is watched no more): the
    #: agent's own reason may follow.
    link_closed: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreReady:
    """The store host reported its store for ``round``."""

    round: int
    addr: str
    port: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RankExited:
    """A host reported a rank's exit."""

    report: m.RankExited


@dataclass(frozen=True, slots=True, kw_only=True)
class RanksStopped:
    """A host stopped every rank of ``round``."""

    host: str
    round: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RankConnected:
    """A flodl-aware rank said hello through its relay (status only)."""

    rank: int
    pid: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RanksReported:
    """A host's periodic report of its running ranks (pid, process state, CPU, output, store
    connection)."""

    host: str
    report: m.RankStats


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingEnded:
    """The Trainer's coordinator concluded: in order (the ranks now exit 0) or failed (its cause is
    the run's).

    A coordinator that fails (spec mismatch, hello timeout, a rank lost, a stall) is the root
    cause of the exits that follow it, so the verdict is its ``reason``, given at once. An
    orderly end waits for the ranks' exits, and its code is OK, or the signal's when a launcher
    signal asked for the orderly stop (:class:`OrderlyStop`); ``code`` is a failure's.
    """

    ok: bool
    reason: str
    code: ExitCode = ExitCode.OK
    details: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingStarted:
    """The Trainer's coordinator started (its first rank said hello): from now on a rank's
    failure may be the effect of a cause the coordinator is about to report. ``collective``: its
    backend is COLLECTIVE (no rank is restarted alone)."""

    collective: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RankDropped:
    """The Trainer's coordinator declared ``rank`` dead and trains on without it (an elastic
    run): its failure, before or after this, ends nothing."""

    rank: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Interrupted:
    """The launcher received ``signal`` (SIGINT or SIGTERM)."""

    signal: int


@dataclass(frozen=True, slots=True, kw_only=True)
class OrderlyStop:
    """A launcher ``signal`` asked the Trainer for an orderly stop (a final round, then shutdown)
    instead of reaching the supervisor's signal table; a training that then ends in order keeps
    the signal's exit code."""

    signal: int


Event = (
    JoinRequested
    | JoinUndelivered
    | HostLost
    | StoreReady
    | RankExited
    | RanksStopped
    | RankConnected
    | RanksReported
    | TrainingStarted
    | RankDropped
    | TrainingEnded
    | Interrupted
    | OrderlyStop
    | Tick
    | Woke
)


# ----- actions -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AcceptJoin:
    """Answer the pending join of ``host``: admitted with ``ranks``."""

    host: str
    reply: m.JoinAccept


@dataclass(frozen=True, slots=True, kw_only=True)
class RejectJoin:
    """Answer the pending join of ``host``: refused (then close that connection)."""

    host: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ForceStop:
    """A second signal: kill every rank now, on every host."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EndRun:
    """The verdict: tear down, telling every host ``farewell`` (``Finish`` or an ``Abort``)."""

    result: RunResult
    farewell: m.Finish | m.Abort


@dataclass(frozen=True, slots=True, kw_only=True)
class ResetStore:
    """Empty the controller's store and close its connections: ``round`` starts from nothing.

    torch adds no per-attempt key prefix under the agent-store contract, so a restarted
    world reading the last round's keys would rendezvous with ghosts.
    """

    round: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TellCoordinator:
    """Tell the Trainer's coordinator that ``rank`` is lost (its process failed, or its host was
    lost), one source of its death chain: it drops the rank (:class:`RankDropped`) or ends the run
    with its cause. ``refines``: the reason is the process's own end, which says more than a link's
    close the coordinator may have heard first."""

    rank: int
    reason: str
    details: str = ""
    refines: bool = False


Action = (
    TellCoordinator
    | AcceptJoin
    | RejectJoin
    | Tell[str]
    | Announce
    | ForceStop
    | EndRun
    | ResetStore
    | SendHeartbeat
    | CutJoinLink
    | AbortLinks
)


# ----- phases ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Forming:
    """The join window is open."""

    window: JoinWindow


@dataclass(frozen=True, slots=True, kw_only=True)
class Rendezvous:
    """The store host was asked for a store for ``round``; nothing runs yet."""

    world: Formed
    round: int
    deadline: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Running:
    """The ranks of ``round`` run; ``exited`` have exited (with 0, or ``dropped``: declared dead
    by the Trainer's coordinator, which trains on without them)."""

    world: Formed
    round: int
    exited: frozenset[int] = frozenset()
    dropped: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldFailure:
    """A failure of a Trainer run's rank that its coordinator may absorb by dropping the rank; the
    verdict it gives if it does not."""

    rank: int
    reason: str
    details: str = ""
    details_if_shown: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Concluding:
    """Ranks of the running round failed while the Trainer's coordinator runs: until ``deadline``
    the coordinator may drop them (:class:`RankDropped`: the round runs on) or give its cause (a
    rank that raised, a spec mismatch, a limit breached: then that is the verdict); at the
    deadline, or on a host lost first, the first of ``failures`` is.

    ``running``: the round as it stands, exits recorded meanwhile included.
    """

    running: Running
    failures: tuple[HeldFailure, ...]
    deadline: float

    @property
    def world(self) -> Formed:
        """The formed world."""
        return self.running.world

    @property
    def round(self) -> int:
        """The running round."""
        return self.running.round


@dataclass(frozen=True, slots=True, kw_only=True)
class Restarting:
    """Every host was told to stop ``round``; ``waiting`` have not confirmed yet."""

    world: Formed
    round: int
    waiting: frozenset[str]
    deadline: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Ended:
    """The verdict is given; it never changes."""

    result: RunResult
    world: Formed | None


Phase = Forming | Rendezvous | Running | Concluding | Restarting | Ended

_PHASE_NAMES = {
    Forming: "waiting",
    Rendezvous: "forming",
    Running: "training",
    Concluding: "training",
    Restarting: "training",
}


def phase_name(phase: Phase) -> str:
    """The phase as the status endpoint names it."""
    if isinstance(phase, Ended):
        return "done" if phase.result.exit_code is ExitCode.OK else "failed"
    return _PHASE_NAMES[type(phase)]


# ----- the status view -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SupervisorView:
    """A frozen snapshot for the status endpoint."""

    phase: str
    members: tuple[JoinedMember, ...]
    joined_ranks: int
    world_size: int
    restart_count: int
    ranks: tuple[RankStatus, ...]
    result: RunResult | None
    rejected_joins: int


def with_activity(known: RankStatus, activity: m.RankActivity) -> RankStatus:
    """``known`` with what its host's latest activity report says of it."""
    return replace(
        known,
        pid=activity.pid,
        uptime_s=activity.uptime_s,
        process=PROCESS_STATES.get(activity.state, activity.state),
        cpu_percent=activity.cpu_percent,
        last_line=activity.last_line,
        output_age_s=activity.output_age_s if activity.output_age_s >= 0 else None,
        quiet_s=activity.quiet_s,
        store_connected=activity.store_connected,
    )


_PhaseT = TypeVar("_PhaseT", bound=Phase)
_EventT = TypeVar("_EventT", bound=Event)


class Transitions:
    """The supervisor's transition table: ``(phase type, event type) -> handler(phase, event,
    now)``. :meth:`add` checks that the handler's parameters accept every phase and event it is
    filed under, so the table needs neither a cast nor an ignore; a pair is filed once."""

    __slots__ = ("_by_pair",)

    def __init__(self) -> None:
        self._by_pair: dict[tuple[type, type], Callable[..., tuple[Action, ...]]] = {}

    def add(
        self,
        phases: Iterable[type[_PhaseT]],
        events: Iterable[type[_EventT]],
        handler: Callable[[_PhaseT, _EventT, float], tuple[Action, ...]],
    ) -> None:
        """File ``handler`` under every pair of ``phases`` and ``events``."""
        events = tuple(events)
        for phase in phases:
            for event in events:
                if (phase, event) in self._by_pair:
                    raise ValueError(f"{event.__name__} in {phase.__name__} is filed twice")
                self._by_pair[phase, event] = handler

    def ignore(self, phases: Iterable[type[Phase]], events: Iterable[type[Event]]) -> None:
        """File "nothing changes" under every pair of ``phases`` and ``events``."""
        self.add(phases, events, unchanged)

    def __call__(self, phase: Phase, event: Event, now: float) -> tuple[Action, ...]:
        handler = self._by_pair.get((type(phase), type(event)))
        if handler is None:
            raise TypeError(
                f"the supervisor takes no {type(event).__name__} in {type(phase).__name__}"
            )
        return handler(phase, event, now)

    @property
    def pairs(self) -> frozenset[tuple[type, type]]:
        """Every (phase type, event type) filed."""
        return frozenset(self._by_pair)

    def require_every_pair(self) -> None:
        """Raise unless every event is filed in every phase (checked once, when it is built)."""
        expected = {(p, e) for p in members(Phase) for e in members(Event)}
        missing = sorted(f"{e.__name__} in {p.__name__}" for p, e in expected - self.pairs)
        if missing:
            raise TypeError(f"the supervisor's table has no entry for {', '.join(missing)}")


def unchanged(phase: Phase, event: Event, now: float) -> tuple[Action, ...]:
    """An event that means nothing in this phase: an activity report outside a running round, a
    tick with no deadline, a store address outside a rendezvous, a stop outside a restart, and
    after the verdict anything but a signal, a join or a rank's hello or exit."""
    return ()
