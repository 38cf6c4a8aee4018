"""The join window: a pure state machine that admits hosts and decides when the world forms.

Theory of operation. Agents ask to join with their host name and devices; an
admitted host gets the next contiguous block of global ranks (one per
device) in admission order. Time is passed in (``now``, monotonic seconds);
the shell calls :meth:`JoinWindow.poll` whenever something happens and at
the deadline :meth:`JoinWindow.next_deadline` names. The verdict order is the
seed's:

1. ``target_ranks`` reached → form at once ("target ranks reached");
2. inside ``join_timeout`` → stay open (an early quorum does not close it);
3. ``join_timeout`` over and the quorum (``min_rank_start``) met → form;
4. before ``max_join_timeout`` → stay open; the first moment the quorum is met forms;
5. otherwise fail, naming joined and needed ranks and both timeouts.

An agent that dies before formation fails the window at once, naming the host.

A planned host whose capacity is not known before it joins (``devices: all`` on a
host that is not the controller's: its GPUs are counted by its own agent) adds what
its agent reports to a quorum or target that was left to default to the capacity
(``quorum_reported`` / ``target_reported``): until that host has joined, such a
threshold is not known, so it is not met.

Admission refuses, with a reason that goes back to the agent: a window that is
no longer open, an empty host name, an agent of another flodl_async version or
wire protocol version (mixed versions would fail later and obscurely, inside
rendezvous or a collective), no or duplicate devices, and a host that already
joined — by name, or as another spelling of the controller's machine
(``localhost``, a loopback address, its hostname or FQDN: the
:class:`~flodl_async.host.hostnames.HostAliases` the shell passes in are compared by
their canonical name). Every refusal counts; too many of them fail the window,
since the port is then being probed by something that is not an agent of this run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# The package's __init__ holds only the version string, so this keeps the module pure (no asyncio,
# no socket; tests/test_membership.py checks it).
from .._version import __version__
from ..host.hostnames import HostAliases

MAX_RANKS_PER_JOIN = 256
MAX_REJECTED_JOINS = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeTerms:
    """What every node of an every-node run (``flodl-launch --nnodes``) must have been started
    with: the controller node's own ranks per node and launch digest (command and ranks per node,
    :func:`flodl_async.config.everynode.launch_digest`)."""

    ranks_per_node: int
    launch: str


@dataclass(frozen=True, slots=True, kw_only=True)
class JoinConfig:
    """Resolved join knobs (timeouts already scaled)."""

    min_rank_start: int
    join_timeout: float
    target_ranks: int | None
    max_join_timeout: float
    open_admission: bool = False
    max_rejected_joins: int = MAX_REJECTED_JOINS
    #: Hosts whose reported rank count adds to ``min_rank_start`` (a defaulted quorum: capacity
    #: known only at their join).
    quorum_reported: frozenset[str] = frozenset()
    #: Likewise for ``target_ranks``.
    target_reported: frozenset[str] = frozenset()
    #: Every-node mode: a node started with another command or rank count is refused by name.
    node_terms: NodeTerms | None = None

    def __post_init__(self) -> None:
        if self.min_rank_start < (0 if self.quorum_reported else 1):
            raise ValueError("min_rank_start must be at least 1")
        if (
            self.target_ranks is not None
            and self.target_ranks < self.min_rank_start
            and not self.target_reported
        ):
            raise ValueError("target_ranks must be at least min_rank_start")
        if self.max_join_timeout < self.join_timeout:
            raise ValueError("max_join_timeout must be at least join_timeout")


@dataclass(frozen=True, slots=True, kw_only=True)
class JoinedMember:
    """An admitted host and the global ranks it owns."""

    host: str
    devices: tuple[str, ...]
    ranks: tuple[int, ...]
    joined_at: float


class WindowState(enum.Enum):
    """Where the window is."""

    OPEN = "open"
    FORMED = "formed"
    FAILED = "failed"


@dataclass(frozen=True, slots=True, kw_only=True)
class Admitted:
    """A join was accepted."""

    member: JoinedMember


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejected:
    """A join was refused; ``reason`` goes back to the agent."""

    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Formed:
    """The world is frozen."""

    members: tuple[JoinedMember, ...]
    world_size: int
    reason: str
    elapsed: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Failed:
    """The window failed; ``reason`` is the whole story for the operator."""

    reason: str


Verdict = Formed | Failed | None


class JoinWindow:
    """Admission ledger plus formation verdict; pure, ``now`` passed in."""

    def __init__(
        self,
        config: JoinConfig,
        *,
        opened_at: float,
        protocol_version: int = 1,
        controller_version: str = __version__,
        host_aliases: HostAliases | None = None,
    ) -> None:
        """Open the window at ``opened_at``.

        Agents must speak ``protocol_version`` and run ``controller_version`` of flodl_async, which
        defaults to the version installed here. ``host_aliases`` are the spellings of the
        controller's machine: two of them are one host (None: every name is its own host).
        """
        self.config = config
        self.opened_at = opened_at
        self._host_aliases = host_aliases
        self._protocol_version = protocol_version
        self._controller_version = controller_version
        self._members: list[JoinedMember] = []
        self._next_rank = 0
        self._rejected = 0
        self._state = WindowState.OPEN
        self._verdict: Formed | Failed | None = None

    @property
    def state(self) -> WindowState:
        """OPEN, FORMED or FAILED."""
        return self._state

    @property
    def members(self) -> tuple[JoinedMember, ...]:
        """Admitted hosts in admission order."""
        return tuple(self._members)

    @property
    def joined_ranks(self) -> int:
        """How many ranks are in so far."""
        return self._next_rank

    @property
    def rejected_joins(self) -> int:
        """How many joins were refused."""
        return self._rejected

    def _threshold(self, base: int, reported: frozenset[str]) -> int | None:
        """``base`` plus what each host of ``reported`` brought at its join; None while one of them
        is still out."""
        if not reported:
            return base
        brought = {member.host: len(member.ranks) for member in self._members}
        if not reported <= brought.keys():
            return None
        return base + sum(brought[host] for host in reported)

    @property
    def quorum(self) -> int | None:
        """The quorum in ranks; None while a host whose capacity comes at its join has not
        joined."""
        return self._threshold(self.config.min_rank_start, self.config.quorum_reported)

    @property
    def target(self) -> int | None:
        """The target in ranks; None when there is none, or while it waits on a host's report."""
        cfg = self.config
        if cfg.target_ranks is None:
            return None
        target = self._threshold(cfg.target_ranks, cfg.target_reported)
        if target is None or not cfg.target_reported:
            return target
        quorum = self.quorum  # a defaulted target never forms a world below the quorum
        return None if quorum is None else max(target, quorum)

    def describe_target(self) -> str:
        """The target for messages: ``8``, ``none``, or ``2 + what gpu-b reports`` while that is
        still unknown."""
        cfg = self.config
        if cfg.target_ranks is None:
            return "none"
        target = self.target
        return (
            str(target)
            if target is not None
            else describe_threshold(cfg.target_ranks, cfg.target_reported)
        )

    def request_join(
        self,
        *,
        host: str,
        devices: tuple[str, ...],
        now: float,
        agent_version: str,
        protocol_version: int,
        launch: str,
    ) -> Admitted | Rejected:
        """Admit or refuse one agent.

        ``agent_version`` is the flodl_async version the agent reports (``JoinHello.agent_version``;
        empty from an agent too old to send it) and ``protocol_version`` the wire protocol it
        speaks. Both are required: a check with a default would pass whatever the caller forgot.
        ``launch`` is the agent's every-node launch digest (``JoinHello.launch``), checked against
        ``node_terms`` when the run has them.
        """
        reason = self._admission_problem(
            host, devices, agent_version, protocol_version
        ) or self._node_problem(host, devices, launch)
        if reason is not None:
            self._rejected += 1
            if self._rejected >= self.config.max_rejected_joins and self._state is WindowState.OPEN:
                self._fail(
                    f"{self._rejected} joins were rejected — the join port is being hammered by "
                    "something that is not a flodl agent of this run"
                )
            return Rejected(reason=reason)
        ranks = tuple(range(self._next_rank, self._next_rank + len(devices)))
        member = JoinedMember(host=host, devices=devices, ranks=ranks, joined_at=now)
        self._members.append(member)
        self._next_rank += len(devices)
        return Admitted(member=member)

    def _admission_problem(
        self, host: str, devices: tuple[str, ...], agent_version: str, protocol_version: int
    ) -> str | None:
        if self._state is not WindowState.OPEN:
            return f"the join window is {self._state.value}; this run takes no more hosts"
        # The host comes first so that every later reason can name it. The agent's strings are
        # untrusted, hence !r: quotes and escapes keep them from forging the rest of the message.
        if not host:
            return "empty host name"
        ours = self._controller_version
        if not agent_version:
            return (
                f"host {host!r} did not report its flodl_async version (an agent too old to send "
                "it), this controller "
                f"runs {ours}; install the same flodl_async version on every host"
            )
        if protocol_version != self._protocol_version:
            return (
                f"host {host!r} speaks protocol v{protocol_version} (flodl_async "
                f"{agent_version!r}), this controller "
                f"v{self._protocol_version} (flodl_async {ours}); install the same flodl_async "
                "version on every host"
            )
        if agent_version != ours:
            return (
                f"host {host!r} runs flodl_async {agent_version!r}, this controller {ours}; "
                "install the same flodl_async version on every host"
            )
        if not devices:
            return f"host {host!r} offers no devices"
        if len(devices) > MAX_RANKS_PER_JOIN:
            return (
                f"host {host!r} offers {len(devices)} devices; at most {MAX_RANKS_PER_JOIN} "
                "ranks per host"
            )
        seen: set[str] = set()
        for device in devices:
            if device in seen:
                return (
                    f"duplicate local device {device} on host {host!r} — each rank must pin a "
                    "distinct device"
                )
            seen.add(device)
        same = self._same_host(host)
        if same is not None and same.host == host:
            return (
                f"host {host!r} already joined this run (duplicate join — a stale agent from a "
                "previous launch, or two agents sharing one host name)"
            )
        if same is not None:
            return (
                f"host {host!r} is the machine that already joined this run as {same.host!r} "
                f"({host!r} and {same.host!r} both name "
                "this machine) — give a second agent on it a name of its own with --host, or stop "
                "the other one"
            )
        return None

    def _node_problem(self, host: str, devices: tuple[str, ...], launch: str) -> str | None:
        terms = self.config.node_terms
        if terms is None:
            return None
        if not launch:
            return (
                f"host {host!r} is no node of this every-node run (it was not started with "
                "flodl-launch --nnodes); start every node with the same flodl-launch command"
            )
        if len(devices) != terms.ranks_per_node:
            return (
                f"node {host!r} brings {len(devices)} rank(s), every node of this run "
                f"{terms.ranks_per_node}: start every node with the same --nproc-per-node"
            )
        if launch != terms.launch:
            return (
                f"node {host!r} was started with another command than the controller's node: run "
                "the same command after `--` on every node"
            )
        return None

    def _same_host(self, host: str) -> JoinedMember | None:
        """The admitted member that is ``host``: the same name, or another spelling of the
        controller's machine."""
        aliases = self._host_aliases
        key = host if aliases is None else aliases.canonical_name(host)
        for member in self._members:
            if (member.host if aliases is None else aliases.canonical_name(member.host)) == key:
                return member
        return None

    def retract(self, host: str) -> None:
        """Undo the last admission (its accept could not be delivered), keeping ranks hole-free."""
        if self._members and self._members[-1].host == host and self._state is WindowState.OPEN:
            member = self._members.pop()
            self._next_rank -= len(member.ranks)

    def member_lost(self, host: str, *, now: float, reason: str = "") -> Verdict:
        """An admitted agent died before formation: the window fails at once, naming it and, when
        known, why."""
        if self._state is WindowState.OPEN and any(m.host == host for m in self._members):
            self._fail(
                f"agent on host {host!r} went away before the world formed "
                f"({now - self.opened_at:.1f}s into the window){f': {reason}' if reason else ''}"
            )
        return self._verdict

    def abort(self, reason: str) -> Verdict:
        """Fail the window from outside (launcher interrupted, fan-out failed)."""
        if self._state is WindowState.OPEN:
            self._fail(reason)
        return self._verdict

    def _fail(self, reason: str) -> None:
        self._state = WindowState.FAILED
        self._verdict = Failed(reason=reason)

    def poll(self, now: float) -> Verdict:
        """Decide: ``Formed``, ``Failed``, or ``None`` (stay open)."""
        if self._state is not WindowState.OPEN:
            return self._verdict
        cfg = self.config
        elapsed = now - self.opened_at
        joined = self._next_rank
        target, quorum = self.target, self.quorum
        if target is not None and joined >= target:
            return self._form("target ranks reached", elapsed)
        if elapsed < cfg.join_timeout:
            return None
        if quorum is not None and joined >= quorum:
            return self._form(self._quorum_reason(quorum), elapsed)
        if elapsed < cfg.max_join_timeout:
            return None
        needed = (
            str(quorum)
            if quorum is not None
            else describe_threshold(cfg.min_rank_start, cfg.quorum_reported)
        )
        self._fail(
            f"quorum not met: {joined}/{needed} ranks joined "
            f"({', '.join(m.host for m in self._members) or 'no host'}) within the join window of "
            f"{cfg.join_timeout:g}s and the max_join_timeout hard cap of {cfg.max_join_timeout:g}s"
        )
        return self._verdict

    def _form(self, reason: str, elapsed: float) -> Formed:
        self._state = WindowState.FORMED
        verdict = Formed(
            members=tuple(self._members), world_size=self._next_rank, reason=reason, elapsed=elapsed
        )
        self._verdict = verdict
        return verdict

    def _quorum_reason(self, quorum: int) -> str:
        count = 0
        for member in self._members:
            count += len(member.ranks)
            if count >= quorum:
                if member.joined_at <= self.opened_at + self.config.join_timeout:
                    return "join window closed with quorum"
                break
        return "quorum met before the max_join_timeout cap"

    def next_deadline(self, now: float) -> float | None:
        """The next ``now`` at which :meth:`poll` could change its answer without a new join."""
        if self._state is not WindowState.OPEN:
            return None
        window_end = self.opened_at + self.config.join_timeout
        # Before the window ends only its end matters; after it a quorum forms on the join
        # itself, so only the hard cap remains.
        return window_end if now < window_end else self.opened_at + self.config.max_join_timeout


def describe_threshold(base: int, reported: frozenset[str]) -> str:
    """``base`` plus the hosts that report their capacity at join, for messages: ``2 + what gpu-a,
    gpu-b report``."""
    if not reported:
        return str(base)
    hosts = ", ".join(sorted(reported))
    return f"what {hosts} report" if base == 0 else f"{base} + what {hosts} report"
