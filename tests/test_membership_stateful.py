"""The join window driven by Hypothesis through random sequences of joins, clock ticks, losses and polls.

The machine keeps a small model of its own (who was admitted in which order, why the window
might have failed, when the verdict came) and checks the window against properties rather
than against a second copy of its rules: ranks stay contiguous, a verdict is final, and the
window neither forms nor fails earlier than the seed's knobs allow.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from flodl_async._version import __version__
from flodl_async.control.membership import (
    Admitted,
    Failed,
    Formed,
    JoinConfig,
    JoinWindow,
    Rejected,
    WindowState,
)
from flodl_async.host.hostnames import HostAliases

OPENED_AT = 1000.0
PROTOCOL = 1
#: The controller's machine, for windows opened with host aliases.
MACHINE = HostAliases.of_machine("vm", "vm.example.com")
#: The model's own list of that machine's spellings (not the code's): with aliases, any two are one host.
MACHINE_SPELLINGS = ("vm", "VM", "localhost", "127.0.0.1", "::1", "vm.example.com")
HOSTS = ("h0", "h1", "h2", "h3", "h4", *MACHINE_SPELLINGS)
VERSION_ADVICE = "install the same flodl_async version on every host"


@dataclass(frozen=True, slots=True, kw_only=True)
class _Admission:
    host: str
    ranks: int
    at: float


class JoinWindowMachine(RuleBasedStateMachine):
    """Drives one :class:`JoinWindow`; ``now`` only moves forward, as a monotonic clock does."""

    def __init__(self) -> None:
        super().__init__()
        self.window: JoinWindow
        self.config: JoinConfig
        self.now = OPENED_AT
        self.admitted: list[_Admission] = []
        self.rejections = 0
        # Why the window may fail before the cap; a failure with none of these set must be the cap's.
        self.early_failure_cause: str | None = None
        self.verdict: Formed | Failed | None = None
        self.aliases = False

    @initialize(
        min_rank_start=st.integers(1, 4),
        extra_target=st.none() | st.integers(0, 3),
        join_timeout=st.sampled_from([0.0, 1.0, 5.0, 10.0]),
        cap_slack=st.sampled_from([0.0, 2.0, 20.0]),
        max_rejected_joins=st.integers(1, 6),
        aliases=st.booleans(),
    )
    def open_window(
        self,
        min_rank_start: int,
        extra_target: int | None,
        join_timeout: float,
        cap_slack: float,
        max_rejected_joins: int,
        aliases: bool,
    ) -> None:
        self.config = JoinConfig(
            min_rank_start=min_rank_start,
            target_ranks=None if extra_target is None else min_rank_start + extra_target,
            join_timeout=join_timeout,
            max_join_timeout=join_timeout + cap_slack,
            max_rejected_joins=max_rejected_joins,
        )
        self.aliases = aliases
        self.window = JoinWindow(
            self.config,
            opened_at=OPENED_AT,
            protocol_version=PROTOCOL,
            host_aliases=MACHINE if aliases else None,
        )

    # ----- helpers ------------------------------------------------------------------------------

    @property
    def window_end(self) -> float:
        return OPENED_AT + self.config.join_timeout

    @property
    def cap(self) -> float:
        return OPENED_AT + self.config.max_join_timeout

    @property
    def joined(self) -> int:
        return sum(a.ranks for a in self.admitted)

    def same_host(self, a: str, b: str) -> bool:
        """The model's rule: the same name, or (with aliases) two spellings of the controller's machine."""
        return a == b or (self.aliases and a in MACHINE_SPELLINGS and b in MACHINE_SPELLINGS)

    def _join(
        self,
        host: str,
        devices: tuple[str, ...],
        *,
        agent_version: str = __version__,
        protocol_version: int = PROTOCOL,
    ) -> Admitted | Rejected:
        was_open = self.window.state is WindowState.OPEN
        result = self.window.request_join(
            host=host,
            devices=devices,
            now=self.now,
            agent_version=agent_version,
            protocol_version=protocol_version,
            launch="",
        )
        if isinstance(result, Rejected):
            self.rejections += 1
            if was_open and self.rejections >= self.config.max_rejected_joins:
                assert self.window.state is WindowState.FAILED
                self.early_failure_cause = self.early_failure_cause or "too many rejected joins"
        else:
            assert was_open
            self.admitted.append(_Admission(host=host, ranks=len(devices), at=self.now))
        self._note_verdict()
        return result

    def _quorum_reached_at(self) -> float:
        """When the admission that brought the joined ranks up to ``min_rank_start`` came in."""
        count = 0
        for admission in self.admitted:
            count += admission.ranks
            if count >= self.config.min_rank_start:
                return admission.at
        raise AssertionError("no quorum")

    def _note_verdict(self) -> None:
        """Record the verdict the first time the window leaves OPEN."""
        if self.verdict is None and self.window.state is not WindowState.OPEN:
            self.verdict = self.window.poll(self.now)
            assert self.verdict is not None

    def _advance_to(self, t: float) -> None:
        self.now = max(self.now, t)

    # ----- joins --------------------------------------------------------------------------------

    @rule(host=st.sampled_from(HOSTS), n_devices=st.integers(1, 3))
    def join_valid(self, host: str, n_devices: int) -> None:
        duplicate = any(self.same_host(a.host, host) for a in self.admitted)
        was_open = self.window.state is WindowState.OPEN
        result = self._join(host, tuple(f"cuda:{i}" for i in range(n_devices)))
        assert isinstance(result, Admitted) == (was_open and not duplicate)
        if isinstance(result, Admitted):
            assert result.member.ranks == tuple(range(self.joined - n_devices, self.joined))
            assert result.member.joined_at == self.now

    @precondition(lambda self: self.admitted)
    @rule(data=st.data())
    def join_duplicate_host(self, data: st.DataObject) -> None:
        host = data.draw(st.sampled_from([a.host for a in self.admitted]))
        result = self._join(host, ("cuda:0",))
        assert isinstance(result, Rejected)

    @precondition(
        lambda self: self.aliases and any(a.host in MACHINE_SPELLINGS for a in self.admitted)
    )
    @rule(data=st.data())
    def join_as_another_spelling_of_the_admitted_machine(self, data: st.DataObject) -> None:
        admitted = next(a.host for a in self.admitted if a.host in MACHINE_SPELLINGS)
        host = data.draw(st.sampled_from([h for h in MACHINE_SPELLINGS if h != admitted]))
        was_open = self.window.state is WindowState.OPEN
        result = self._join(host, ("cuda:0",))
        assert isinstance(result, Rejected)
        if was_open:
            assert result.reason.startswith(
                f"host {host!r} is the machine that already joined this run as {admitted!r}"
            )

    @rule(
        host=st.sampled_from(HOSTS),
        devices=st.sampled_from([(), ("cuda:0", "cuda:0"), ("cuda:1", "cuda:0", "cuda:1")]),
    )
    def join_bad_devices(self, host: str, devices: tuple[str, ...]) -> None:
        assert isinstance(self._join(host, devices), Rejected)

    @rule(
        host=st.sampled_from(HOSTS),
        version=st.sampled_from(["", "0.0.1", __version__ + ".dev1", __version__]),
        protocol=st.sampled_from([PROTOCOL - 1, PROTOCOL, PROTOCOL + 1]),
    )
    def join_wrong_version(self, host: str, version: str, protocol: int) -> None:
        if version == __version__ and protocol == PROTOCOL:
            version = ""  # the one combination that is not wrong; make it the too-old agent instead
        was_open = self.window.state is WindowState.OPEN
        result = self._join(host, ("cuda:0",), agent_version=version, protocol_version=protocol)
        assert isinstance(result, Rejected)
        if was_open:
            assert f"host {host!r}" in result.reason
            assert __version__ in result.reason
            assert result.reason.endswith(VERSION_ADVICE)

    # ----- the clock ----------------------------------------------------------------------------

    @rule(dt=st.sampled_from([0.0, 0.25, 1.0, 4.0, 15.0]))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule()
    def to_next_deadline(self) -> None:
        deadline = self.window.next_deadline(self.now)
        if deadline is not None:
            self._advance_to(deadline)

    @rule(boundary=st.sampled_from(["window_end", "cap"]), just_before=st.booleans())
    def to_boundary(self, boundary: str, just_before: bool) -> None:
        t = self.window_end if boundary == "window_end" else self.cap
        self._advance_to(t - 1e-6 if just_before else t)

    # ----- losses, aborts, retractions ----------------------------------------------------------

    @rule(host=st.sampled_from(HOSTS))
    def member_lost(self, host: str) -> None:
        was_open = self.window.state is WindowState.OPEN
        member = any(a.host == host for a in self.admitted)
        verdict = self.window.member_lost(host, now=self.now)
        if was_open and member:
            assert isinstance(verdict, Failed)
            assert f"agent on host {host!r} went away" in verdict.reason
            self.early_failure_cause = self.early_failure_cause or "member lost"
        elif was_open:
            assert verdict is None
        self._note_verdict()

    @rule()
    def abort(self) -> None:
        was_open = self.window.state is WindowState.OPEN
        verdict = self.window.abort("launcher interrupted")
        if was_open:
            assert verdict == Failed(reason="launcher interrupted")
            self.early_failure_cause = self.early_failure_cause or "aborted"
        self._note_verdict()

    @rule(host=st.sampled_from(HOSTS))
    def retract(self, host: str) -> None:
        if (
            self.window.state is WindowState.OPEN
            and self.admitted
            and self.admitted[-1].host == host
        ):
            self.admitted.pop()
        self.window.retract(host)

    # ----- the verdict --------------------------------------------------------------------------

    @rule()
    def poll(self) -> None:
        was_open = self.window.state is WindowState.OPEN
        verdict = self.window.poll(self.now)
        elapsed = self.now - OPENED_AT
        target = self.config.target_ranks
        target_reached = target is not None and self.joined >= target
        if not was_open:
            assert verdict is self.verdict
            return
        if target_reached:
            # Target reached ⇒ formed on this poll, whatever the clock says.
            assert isinstance(verdict, Formed)
            assert verdict.reason == "target ranks reached"
        elif isinstance(verdict, Formed):
            # No early formation: before join_timeout only the target forms the world.
            assert elapsed >= self.config.join_timeout
            assert self.joined >= self.config.min_rank_start
            # The reason tells which rule formed it: the quorum was in when the window closed
            # (a join at its very end counts as inside), or it came later, before the cap.
            in_window = self._quorum_reached_at() <= self.window_end
            assert verdict.reason == (
                "join window closed with quorum"
                if in_window
                else "quorum met before the max_join_timeout cap"
            )
        elif isinstance(verdict, Failed):
            assert elapsed >= self.config.max_join_timeout
            assert self.joined < self.config.min_rank_start
            assert verdict.reason.startswith(
                f"quorum not met: {self.joined}/{self.config.min_rank_start} ranks joined"
            )
        else:
            # Staying open is right only while neither a quorum after the window nor the cap applies.
            assert elapsed < self.config.join_timeout or self.joined < self.config.min_rank_start
            assert elapsed < self.config.max_join_timeout
            # Nothing more can happen at `now` itself, so the shell must not be told to wake at it.
            deadline = self.window.next_deadline(self.now)
            assert deadline is not None
            assert deadline > self.now
        if isinstance(verdict, Formed):
            assert verdict.world_size == self.joined
            assert verdict.elapsed == elapsed
            assert [m.host for m in verdict.members] == [a.host for a in self.admitted]
        self._note_verdict()

    # ----- invariants ---------------------------------------------------------------------------

    @invariant()
    def ranks_are_contiguous_in_admission_order(self) -> None:
        members = self.window.members
        assert [(m.host, len(m.ranks), m.joined_at) for m in members] == [
            (a.host, a.ranks, a.at) for a in self.admitted
        ]
        flat = [rank for m in members for rank in m.ranks]
        assert flat == list(range(len(flat)))  # from 0, no holes, no overlaps, in admission order
        assert all(len(m.ranks) == len(m.devices) for m in members)
        assert self.window.joined_ranks == sum(len(m.ranks) for m in members) == self.joined

    @invariant()
    def one_machine_is_at_most_one_member(self) -> None:
        hosts = [m.host for m in self.window.members]
        assert all(not self.same_host(a, b) for i, a in enumerate(hosts) for b in hosts[i + 1 :])

    @invariant()
    def rejections_are_counted(self) -> None:
        assert self.window.rejected_joins == self.rejections

    @invariant()
    def a_verdict_is_final(self) -> None:
        if self.verdict is None:
            assert self.window.state is WindowState.OPEN
            return
        expected = WindowState.FORMED if isinstance(self.verdict, Formed) else WindowState.FAILED
        assert self.window.state is expected
        assert self.window.poll(self.now) is self.verdict
        # Further joins are refused, and a refusal no longer moves the verdict.
        refused = self.window.request_join(
            host="late",
            devices=("cuda:0",),
            now=self.now,
            agent_version=__version__,
            protocol_version=PROTOCOL,
            launch="",
        )
        assert refused == Rejected(
            reason=f"the join window is {expected.value}; this run takes no more hosts"
        )
        self.rejections += 1
        assert self.window.state is expected

    @invariant()
    def failures_before_the_cap_have_a_cause(self) -> None:
        if isinstance(self.verdict, Failed) and self.early_failure_cause is None:
            assert self.now >= self.cap

    @invariant()
    def a_failure_before_formation_ends_the_window(self) -> None:
        # Each cause was recorded only when it hit an open window; it must have closed it.
        if self.early_failure_cause is not None:
            assert isinstance(self.verdict, Failed)

    @invariant()
    def next_deadline_is_a_boundary_exactly_while_open(self) -> None:
        deadline = self.window.next_deadline(self.now)
        if self.window.state is not WindowState.OPEN:
            assert deadline is None
            return
        # The window's end while it runs, then the cap: never an earlier boundary once passed.
        assert deadline == (self.window_end if self.now < self.window_end else self.cap)


JoinWindowMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=25,
    # Shared build hosts: wall-clock deadlines would flake; the size above keeps the file to seconds.
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_join_window_state_machine = JoinWindowMachine.TestCase
