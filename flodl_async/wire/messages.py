"""Every message that crosses the controller port, by channel.

Messages whose bodies can carry secrets are ``sealed=True``: ``WorldFormed``
(the command and the environment, which often hold tokens), ``RankExited``
(a user's traceback and stderr lines) and ``RankOutput`` (whatever a rank
prints); their bodies are encrypted, not only authenticated. Tensor payloads are always encrypted.

Kinds are grouped by channel in the high byte (0x01xx join, 0x02xx
rendezvous, 0x03xx data, 0x04xx control, 0x05xx relay-local); a new message
takes the next free kind of its group. The grouping is only a numbering: which
kinds may travel on which channel, in which direction, is the table in
:mod:`.legality`, which a new message must join before it can be sent. Schema
evolution rules are in :mod:`.schema`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .schema import Message, message

# ----- join channel: agent <-> controller, kept open for the run as the host link -----------


@message(kind=0x0101)
@dataclass(frozen=True, slots=True, kw_only=True)
class JoinHello(Message):
    """An agent asks to join: who it is and which devices it brings (one rank per device)."""

    host: str
    devices: tuple[str, ...]
    pid: int
    agent_version: str = ""
    #: Every address of the agent's host (:mod:`flodl_async.hostaddrs`): its ranks' store connections may come from any.
    addresses: tuple[str, ...] = ()


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
    """Start this host's ranks for rendezvous ``round`` against the store at ``master_addr:master_port``."""

    round: int
    restart_count: int
    master_addr: str
    master_port: int


@message(kind=0x0106)
@dataclass(frozen=True, slots=True, kw_only=True)
class StopRanks(Message):
    """Stop this host's ranks of ``round`` (TERM, then KILL after ``grace_s``); the agent stays joined."""

    round: int
    reason: str
    grace_s: float


@message(kind=0x0107, sealed=True)
@dataclass(frozen=True, slots=True, kw_only=True)
class RankExited(Message):
    """A rank process ended: exit code (or the signal that killed it) and what it left behind."""

    round: int
    rank: int
    local_rank: int
    host: str
    exit_code: int | None = None
    signal: int | None = None
    error_file: str = ""
    stderr_tail: tuple[str, ...] = ()


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


# ----- rendezvous channel ---------------------------------------------------------------


@message(kind=0x0201)
@dataclass(frozen=True, slots=True, kw_only=True)
class StoreAddress(Message):
    """The store host's agent reports where its TCPStore listens for ``round``."""

    round: int
    host: str
    port: int


@message(kind=0x0202)
@dataclass(frozen=True, slots=True, kw_only=True)
class RendezvousHello(Message):
    """An agent opens its rendezvous link."""

    host: str


# ----- control channel (Heartbeat also travels the join channel) -----------------------------


@message(kind=0x0401)
@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Message):
    """Liveness: ``sent_at`` is the sender's monotonic clock, echoed back by the receiver."""

    sent_at: float
    rank: int = -1
    #: A relay's own beat on its upstream control link (``rank``: one of its host's ranks, which binds the link to the host).
    relay: bool = False


@message(kind=0x0402)
@dataclass(frozen=True, slots=True, kw_only=True)
class RankHello(Message):
    """A flodl-aware rank introduces itself to its relay (forwarded up, rank-tagged)."""

    rank: int
    local_rank: int
    world_size: int
    pid: int


@message(kind=0x0403)
@dataclass(frozen=True, slots=True, kw_only=True)
class RankWelcome(Message):
    """The controller acknowledges a rank's hello (relayed back down)."""

    rank: int
    run_id: str


# ----- data channel ------------------------------------------------------------------------


@message(kind=0x0301)
@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec(Message):
    """Where one tensor lies in a frame's raw payload."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@message(kind=0x0302)
@dataclass(frozen=True, slots=True, kw_only=True)
class TensorBundle(Message):
    """Tensors of one reduce round; their bytes follow the body as the frame's raw payload."""

    round: int
    weight: float
    tensors: tuple[TensorSpec, ...]
