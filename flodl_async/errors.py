"""The one exception tree of flodl_async.

Every error a user can meet derives from :class:`FlodlError`. Messages are
built from typed fields and end with what to do next; third-party errors are
translated at the boundary with ``raise ... from exc``.

::

    FlodlError
    ├── WireError                 bytes on a connection were not a valid frame
    │   ├── BadMagic
    │   ├── FrameTooLarge
    │   ├── AuthenticationFailed
    │   ├── SequenceError         replayed, dropped or reordered frame
    │   ├── MalformedBody
    │   ├── UnknownKind
    │   ├── VersionMismatch
    │   └── TruncatedFrame        the peer closed in the middle of a frame
    ├── ConnectionClosed          a link ended (we closed it, or the peer broke it)
    ├── ProtocolError             a valid frame out of place
    ├── ConfigError               bad cluster file, arguments or environment
    │   └── RoleError             inconsistent role variables
    ├── PortInUseError            the controller port is held by a live listener
    ├── FormationError            the join window could not form a world
    ├── LaunchError               spawning agents or ranks failed
    ├── RankFailure               a rank exited badly
    ├── BusyResourceError         a second receiver on a stream that has one at a time
    └── SubscriptionClosed        a status subscription was closed
"""

from __future__ import annotations


class FlodlError(Exception):
    """Root of every error flodl_async raises on purpose."""


class WireError(FlodlError):
    """A connection carried bytes that are not a valid frame; the connection must close."""


class BadMagic(WireError):
    """The first bytes of a connection named no known channel."""


class FrameTooLarge(WireError):
    """A frame header announced a length above the channel's ceiling."""


class AuthenticationFailed(WireError):
    """A frame's HMAC tag did not verify (wrong secret, tampering, or wrong channel)."""


class SequenceError(WireError):
    """A frame arrived with an unexpected sequence number (replay, drop or reorder)."""


class MalformedBody(WireError):
    """An authenticated frame's body did not decode to its message schema."""


class UnknownKind(WireError):
    """An authenticated frame named a message kind this build does not know."""


class VersionMismatch(WireError):
    """The peer speaks another wire protocol version."""


class TruncatedFrame(WireError):
    """The stream ended in the middle of a frame."""


class ConnectionClosed(FlodlError):
    """A link ended. ``by_peer`` tells a peer that broke it from our own close."""

    def __init__(self, what: str, *, by_peer: bool) -> None:
        self.by_peer = by_peer
        who = "the peer closed" if by_peer else "we closed"
        super().__init__(f"{what}: {who} the connection")


class ProtocolError(FlodlError):
    """A peer sent a valid frame that makes no sense at this point of the protocol."""


class ConfigError(FlodlError):
    """Bad user input: cluster file, command line or environment."""


class RoleError(ConfigError):
    """The environment names an inconsistent mix of process roles."""


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


class FormationError(FlodlError):
    """The join window closed without forming a world."""


class LaunchError(FlodlError):
    """Starting agents, relays or ranks failed."""


class RankFailure(FlodlError):
    """A rank exited with a non-zero code or a signal."""


class BusyResourceError(FlodlError):
    """A second task tried to receive from a stream that has one receiver at a time (trio's rule)."""


class SubscriptionClosed(FlodlError):
    """A status subscription was closed (unsubscribed); nothing more will arrive on it."""

    def __init__(self) -> None:
        super().__init__("this status subscription is closed; subscribe again to the board for new snapshots")


# ----- one host's session (the agent) and its state on disk ----------------------------------
#
#     FlodlError
#     ├── AgentError                one host's session failed (fields: host, reason)
#     │   ├── JoinFailed            the host never got into the run (exit 3)
#     │   │   ├── ControllerUnreachable
#     │   │   ├── JoinRejected      the controller said no (JoinReject)
#     │   │   └── FormationAborted  admitted, but the world never formed
#     │   └── ControllerLost        the join link broke mid-run (exit 4)
#     └── RuntimeDirError           the per-user runtime directory is unusable (a ConfigError)


class AgentError(FlodlError):
    """One host's session failed. ``host`` and ``reason`` are what the controller reports.

    The message is built from them and ends with what to do (each subclass's ``advice``).
    """

    advice = "see the controller's log for the run's verdict"

    def __init__(self, host: str, reason: str) -> None:
        self.host = host
        self.reason = reason
        super().__init__(f"agent {host}: {reason} — {self.advice}")


class JoinFailed(AgentError):
    """The host never got into the run: the link failed before admission or formation."""

    advice = "check that the controller is running, its address, and that both sides hold the same session secret"


class ControllerUnreachable(JoinFailed):
    """Nothing accepted a connection at the controller address."""

    advice = "check the --controller address and that flodl-launch is running and reachable there"


class JoinRejected(JoinFailed):
    """The controller answered the join with ``JoinReject``."""

    advice = "fix what the controller named (host name, devices, version) and start the agent again"


class FormationAborted(JoinFailed):
    """The host was admitted but the world never formed (the window failed or timed out)."""

    advice = "the run did not start; check the launcher's verdict and start a new run"


class ControllerLost(AgentError):
    """The join link broke mid-run: the controller stopped, crashed or became unreachable."""

    advice = "this host's ranks were stopped; see the launcher's verdict, then start a new run"


class RuntimeDirError(ConfigError):
    """The per-user runtime directory (or an entry in it) cannot be used safely."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(
            f"runtime directory {path}: {problem} — fix or remove it, or point XDG_RUNTIME_DIR at a short private directory (mode 0700, owned by you)"
        )
