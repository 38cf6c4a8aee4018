"""The join channel's messages: agent <-> controller, kept open for the run as the host link.

Part of :mod:`.messages` (which re-exports every one of them, so ``messages.JoinHello`` is the
name used everywhere), kept apart for its length; the module docstring there says what is sealed
and how kinds are numbered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .schema import Message, message


@message(kind=0x0101)
@dataclass(frozen=True, slots=True, kw_only=True)
class JoinHello(Message):
    """An agent asks to join: who it is and which devices it brings (one rank per device)."""

    host: str
    devices: tuple[str, ...]
    pid: int
    agent_version: str = ""
    #: Every address of its host (:mod:`flodl_async.host.hostaddrs`): its ranks' store links' too.
    addresses: tuple[str, ...] = ()
    #: The cores it may run its ranks on (:func:`flodl_async.host.cores.usable_cores`); 0: unsaid.
    cores: int = 0
    #: ``flodl-launch --nnodes``: a digest of the node's command, checked against node 0's.
    launch: str = ""


@message(kind=0x0102, sealed=True)
@dataclass(frozen=True, slots=True, kw_only=True)
class JoinAccept(Message):
    """The agent is admitted with these global ranks; formation happens within ``formation_wait_s``.

    Sealed: an agent that joined with the cluster token gets the run's session secret here
    (the argument is in :mod:`.handshake`); one that joined with the secret gets ``b""``.
    """

    ranks: tuple[int, ...]
    run_id: str
    formation_wait_s: float
    session_secret: bytes = field(default=b"", repr=False)


@message(kind=0x0103)
@dataclass(frozen=True, slots=True, kw_only=True)
class JoinReject(Message):
    """The agent was not admitted; the controller closes after sending this."""

    reason: str


@message(kind=0x0104, sealed=True)
@dataclass(frozen=True, slots=True, kw_only=True)
class WorldFormed(Message):
    """The world is frozen: sizes, this host's place in it, and the command its ranks run."""

    world_size: int
    ranks: tuple[int, ...]
    group_rank: int
    group_world_size: int
    store_host: bool
    command: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 0


@message(kind=0x0105)
@dataclass(frozen=True, slots=True, kw_only=True)
class StartRanks(Message):
    """Start this host's ranks for rendezvous ``round`` against the store at
    ``master_addr:master_port``."""

    round: int
    restart_count: int
    master_addr: str
    master_port: int


@message(kind=0x0106)
@dataclass(frozen=True, slots=True, kw_only=True)
class StopRanks(Message):
    """Stop this host's ranks of ``round`` (TERM, then KILL after ``grace_s``); the agent stays
    joined."""

    round: int
    reason: str
    grace_s: float


@message(kind=0x0107, sealed=True)
@dataclass(frozen=True, slots=True, kw_only=True)
class RankExited(Message):
    """A rank process ended: exit code (or the signal that killed it), what it left behind, and
    why its agent killed it itself, if it did (declared dead: not the OOM killer's SIGKILL)."""

    round: int
    rank: int
    local_rank: int
    host: str
    exit_code: int | None = None
    signal: int | None = None
    error_file: str = ""
    stderr_tail: tuple[str, ...] = ()
    killed_because: str = ""


@message(kind=0x0108)
@dataclass(frozen=True, slots=True, kw_only=True)
class Abort(Message):
    """The run is over for this host: stop every rank and leave.

    Ranks get ``first_signal`` (the signal the launcher received: SIGINT for Ctrl-C), then
    TERM, then KILL ``grace_s`` after the first (:func:`flodl_async.verdict.stop_schedule`).
    """

    reason: str
    grace_s: float = 10.0
    first_signal: int = 15
    #: The verdict's exit code, which every node of an every-node run exits with (None: unsaid).
    exit_code: int | None = None


@message(kind=0x0109)
@dataclass(frozen=True, slots=True, kw_only=True)
class Finish(Message):
    """The run ended successfully: no more rounds, the agent may leave."""

    reason: str = "run complete"


@message(kind=0x010A)
@dataclass(frozen=True, slots=True, kw_only=True)
class RanksStopped(Message):
    """Every rank of ``round`` on this host is gone (answer to :class:`StopRanks`)."""

    round: int


@message(kind=0x010B)
@dataclass(frozen=True, slots=True, kw_only=True)
class OpenRound(Message):
    """To the store host: bring up a fresh store for rendezvous ``round`` and report its address."""

    round: int


@message(kind=0x010C, sealed=True)
@dataclass(frozen=True, slots=True, kw_only=True)
class RankOutput(Message):
    """A chunk of one rank's stdout or stderr, up the host link to the launcher.

    ``data`` is whole lines, or the partial line a rank left unfinished for a moment
    (a progress bar before its newline); the launcher assembles lines per rank and
    stream. ``attempt`` is the round's restart count (the log directory's
    ``attempt_<n>``). Sealed: output often carries secrets.
    """

    attempt: int
    rank: int
    stream: str  # "out" | "err"
    data: bytes


@message(kind=0x010D)
@dataclass(frozen=True, slots=True, kw_only=True)
class RankActivity(Message):
    """One rank as its agent sees it (inside :class:`RankStats`): what makes a hang visible.

    ``state`` is the process state letter of ``/proc/<pid>/stat`` (R running, S sleeping,
    D uninterruptible, T stopped...); ages are seconds, -1 for "never".
    """

    rank: int
    pid: int
    uptime_s: float
    state: str
    cpu_percent: float
    last_line: str = ""
    output_age_s: float = -1.0
    #: Seconds with neither output nor CPU progress (what ``--hang-timeout`` measures).
    quiet_s: float = 0.0
    #: The rank has a TCP connection to the rendezvous store (traced to its pid through /proc).
    store_connected: bool = False


@message(kind=0x010F)
@dataclass(frozen=True, slots=True, kw_only=True)
class SignalRanks(Message):
    """Pass ``signal`` (SIGUSR1/SIGUSR2, sent to the launcher) to this host's ranks; the run
    goes on."""

    signal: int


@message(kind=0x010E, sealed=True)
@dataclass(frozen=True, slots=True, kw_only=True)
class RankStats(Message):
    """An agent's periodic report of its running ranks, up the host link. Sealed: it quotes each
    rank's last output line."""

    round: int
    ranks: tuple[RankActivity, ...]
