"""The one exception tree of flodl_async.

Every error a user can meet derives from :class:`FlodlError`. Messages are
built from typed fields and end with what to do next; third-party errors are
translated at the boundary with ``raise ... from exc``.

::

    FlodlError
    ├── WireError                 bytes broke their protocol (frames, or torch's TCPStore)
    │   ├── FrameTooLarge
    │   ├── AuthenticationFailed
    │   ├── SequenceError         replayed, dropped or reordered frame
    │   ├── MalformedBody
    │   ├── UnknownKind
    │   ├── IllegalKind           a known kind not legal on this channel in this direction
    │   ├── VersionMismatch       the peer speaks another wire protocol (told before any key)
    │   ├── HandshakeFailed       the handshake did not complete (malformed, closed, cut)
    │   │   ├── HandshakeRefused  the other side said no: a credential it does not take, another run
    │   │   └── HandshakeCut      the server closed before its hello (evicted, shutting down)
    │   ├── ReservedFlags         header flags this build does not know (newer peer, corruption)
    │   ├── TruncatedFrame        the peer closed in the middle of a frame
    │   └── StoreProtocolError    a TCPStore client sent what the store cannot accept
    │       └── StoreLimitExceeded  ... or more than the store's byte budget or value limit
    ├── ConnectionClosed          a link ended (we closed it, or the peer broke it)
    ├── BusyError                 a second task tried to receive on a link (also a RuntimeError)
    ├── ProtocolError             a valid frame out of place
    ├── ConfigError               bad cluster file, arguments or environment
    │   ├── RoleError             inconsistent role variables
    │   ├── CheckpointInvalid     a checkpoint bundle is torn, corrupt, newer, or not this run's
    │   └── NotFlodlStatus        ``flodl status`` was pointed at something else than a controller
    ├── PortInUseError            the controller port is held by a live listener
    ├── SubscriptionClosed        a status subscription was closed
    ├── SocketOwnerUnknown        the kernel did not say who owns a local socket (or cannot, here)
    └── AgentError                one host's session failed (fields: host, reason)
        ├── JoinFailed            the host never got into the run (exit 3)
        │   ├── ControllerUnreachable
        │   ├── ControllerNotProved  its handshake proof failed: not our controller, or another key
        │   ├── ControllerRefused  its handshake refused us: another admission mode, another run
        │   ├── ClosedBeforeJoin  closed before the join was answered (evicted, shutting down)
        │   ├── JoinRejected      the controller said no (JoinReject)
        │   └── FormationAborted  admitted, but the world never formed
        └── ControllerLost        the join link broke mid-run (exit 4)

``RuntimeDirError`` (a ``ConfigError``) says the per-user runtime directory is unusable,
``SecretFileError`` (a ``ConfigError``) that a ``--secret-file`` is not private or not a secret.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .verdict import RunResult


class FlodlError(Exception):
    """Root of every error flodl_async raises on purpose."""


class WireError(FlodlError):
    """A connection carried bytes that break its protocol; the connection must close."""


class FrameTooLarge(WireError):
    """A frame header announced a length above the channel's ceiling."""


class AuthenticationFailed(WireError):
    """A frame's HMAC tag did not verify (wrong secret, tampering, or wrong channel)."""


class WrongToken(AuthenticationFailed):
    """A cluster-token handshake failed its proof: the two sides hold different cluster tokens."""


class SequenceError(WireError):
    """A frame arrived with an unexpected sequence number (replay, drop or reorder)."""


class MalformedBody(WireError):
    """An authenticated frame's body did not decode to its message schema."""


class UnknownKind(WireError):
    """An authenticated frame named a message kind this build does not know."""


class IllegalKind(WireError):
    """An authenticated frame carried a kind the table forbids on its channel in its direction.

    See :data:`flodl_async.wire.legality.LEGAL_KINDS`. Sending such a kind is a bug in our own
    code and raises ``TypeError`` instead: no handler of peer faults should swallow it.
    """


class VersionMismatch(WireError):
    """The peer speaks another wire protocol version."""


class HandshakeFailed(WireError):
    """A connection's handshake did not complete: malformed, cut short, or closed by the other
    side."""


class HandshakeRefused(HandshakeFailed):
    """The other side refused the handshake: a credential this endpoint does not take, or another
    run."""


class HandshakeCut(HandshakeFailed):
    """The server closed the connection before its hello: it refused or evicted the connection
    (its admission caps), or it is shutting down."""


class ReservedFlags(WireError):
    """A frame header set flag bits this build reserves: a newer peer, or corrupted bytes."""


class TruncatedFrame(WireError):
    """The stream ended in the middle of a frame."""


class StoreProtocolError(WireError):
    """A TCPStore client sent something the store cannot accept; close its connection."""


class StoreLimitExceeded(StoreProtocolError):
    """A TCPStore client's request would take the store past its byte budget or a value past its
    limit; close its connection (the store's other keys stay as they were)."""


class ConnectionClosed(FlodlError):
    """A link ended. ``by_peer`` tells a peer that broke it from our own close."""

    def __init__(self, what: str, *, by_peer: bool) -> None:
        self.by_peer = by_peer
        who = "the peer closed" if by_peer else "we closed"
        super().__init__(f"{what}: {who} the connection")


class BusyError(FlodlError, RuntimeError):
    """A second task tried to receive on a link that already has a receiver.

    A stream has one receiver at a time (trio's ``BusyResourceError``): two waiters would
    race for frames, and neither could tell which frames the other took. A bug in the
    caller, hence also a ``RuntimeError``, as asyncio's own streams raise for two readers.
    """


class ProtocolError(FlodlError):
    """A peer sent a valid frame that makes no sense at this point of the protocol."""


class ConfigError(FlodlError):
    """Bad user input: cluster file, command line or environment."""


class RoleError(ConfigError):
    """The environment names an inconsistent mix of process roles."""


class NotFlodlStatus(ConfigError):
    """Something answered at the address, but not with a flodl status document."""


class CheckpointInvalid(ConfigError):
    """A checkpoint bundle cannot be used: torn, corrupt, from a newer schema, or not this run's.

    ``path`` is the bundle (or the file in it) at fault, ``field`` the manifest field or file
    that is wrong, ``reason`` what is wrong with it; ``remedy`` overrides the default next step.
    """

    def __init__(self, *, path: str, field: str, reason: str, remedy: str | None = None) -> None:
        self.path = path
        self.field = field
        self.reason = reason
        self.remedy = remedy
        todo = remedy or (
            "resume from another bundle (resume_from='latest' skips torn ones and says which), "
            "or start fresh without resume_from"
        )
        super().__init__(f"checkpoint {path} cannot be used: {field}: {reason}; {todo}")


class PortInUseError(FlodlError):
    """The controller port is held by another live listener."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        super().__init__(
            f"port {port} on {host} is already held by a live listener — another flodl run? "
            f"Check with `flodl status --addr 127.0.0.1:{port}`, stop that run, "
            f"or pick another port with --port."
        )


class SubscriptionClosed(FlodlError):
    """A status subscription was closed (unsubscribed); nothing more will arrive on it."""

    def __init__(self) -> None:
        super().__init__(
            "this status subscription is closed; subscribe again to the board for new snapshots"
        )


class SocketOwnerUnknown(FlodlError):
    """The kernel did not say who owns a local TCP socket. ``everywhere``: this system cannot say
    for any socket (no netlink sock_diag), not only for this one."""

    def __init__(self, reason: str, *, everywhere: bool) -> None:
        self.reason = reason
        self.everywhere = everywhere
        super().__init__(
            f"cannot tell who owns a local socket: {reason}"
            + ("; store connections are judged by their address alone" if everywhere else "")
        )


# ----- one host's session (the agent) and its state on disk ----------------------------------


class AgentError(FlodlError):
    """One host's session failed. ``host`` and ``reason`` are what the controller reports.

    The message is built from them and ends with what to do: each subclass's ``advice``, or the
    ``advice`` given for this one cause when the class's would not fit it.
    """

    advice = "see the controller's log for the run's verdict"

    def __init__(self, host: str, reason: str, *, advice: str | None = None) -> None:
        self.host = host
        self.reason = reason
        if advice is not None:
            self.advice = advice
        super().__init__(f"agent {host}: {reason} — {self.advice}")


class JoinFailed(AgentError):
    """The host never got into the run: the link failed before admission or formation."""

    # No word of a session secret: a secret that differs fails the proof (ControllerNotProved).
    advice = (
        "check that flodl-launch is running at that address, with the same flodl_async version "
        "as this host"
    )


class ControllerUnreachable(JoinFailed):
    """Nothing accepted a connection at the controller address."""

    advice = "check the --controller address and that flodl-launch is running and reachable there"


class ControllerNotProved(JoinFailed):
    """The controller's handshake proof did not verify under this agent's credential: whatever
    answered is not our controller, or it holds another token or secret."""

    # no word of a session secret here: a dial-in agent holds none (the reason names the credential)
    advice = (
        "if that address is your flodl-launch, give the agent its credential (the same "
        "--token-file, or its --secret-file); if not, find what else answers there (a process "
        "holding the port, a host on the path)"
    )


class ControllerRefused(JoinFailed):
    """The controller's handshake refused this agent, saying why: a credential of another
    admission mode (a token where it takes none, nothing where it takes one), or another run."""

    advice = (
        "the refusal says what that controller takes: start the agent again with it, or point it "
        "at the controller you meant"
    )


class ClosedBeforeJoin(JoinFailed):
    """The controller closed the join connection before it answered the join: it evicted the
    connection before its handshake finished (an address over its admission cap), or it is shutting
    down. Worth another dial: an honest controller always answers a join it read."""

    advice = (
        "if something on this host floods the controller's port, stop it (the controller evicts "
        "the oldest unproven connections of an address); otherwise check that flodl-launch is "
        "running there"
    )


class JoinRejected(JoinFailed):
    """The controller answered the join with ``JoinReject``."""

    advice = "fix what the controller named (host name, devices, version) and start the agent again"


class FormationAborted(JoinFailed):
    """The host was admitted but the world never formed (the window failed or timed out)."""

    advice = (
        "the run did not start; check the launcher (its verdict, or why it died) and start a "
        "new run"
    )


class ControllerLost(AgentError):
    """The join link broke mid-run: the controller stopped, crashed or became unreachable."""

    advice = (
        "this host's ranks were stopped; check the launcher (its verdict, or why it died), "
        "then start a new run"
    )


class RuntimeDirError(ConfigError):
    """The per-user runtime directory (or an entry in it) cannot be used safely."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(
            f"runtime directory {path}: {problem} — fix or remove it, or point XDG_RUNTIME_DIR at "
            "a short private directory (mode 0700, owned by you)"
        )


class SecretFileError(ConfigError):
    """A ``--secret-file`` that cannot be used safely (:mod:`flodl_async.host.secretfile`):
    ``problem`` says why, ``fix`` what to do."""

    def __init__(self, path: str, problem: str, fix: str, *, what: str = "secret file") -> None:
        self.path = path
        self.problem = problem
        self.fix = fix
        super().__init__(f"{what} {path}: {problem} — {fix}")


# ----- the Trainer ----------------------------------------------------------------------------


class TrainingFailed(FlodlError):
    """A Trainer run ended without a trained state: ``result`` is its verdict (exit code, reason,
    details)."""

    def __init__(self, result: RunResult) -> None:
        self.result = result
        super().__init__(f"training failed: {result.reason}")


class TrainingStopped(FlodlError):
    """The coordinator ended the run on a failure (``Shutdown`` with a failure, ``TrainerReject``):
    this rank stops."""


class CoordinatorLost(FlodlError):
    """This rank lost its coordinator: the relay link closed, or nothing arrived within the
    heartbeat deadline."""
