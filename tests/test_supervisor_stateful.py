"""The supervisor driven by Hypothesis through random, well-formed event streams on fake time.

The machine feeds joins, undelivered accepts, lost hosts, store reports, rank exits, stop
confirmations, signals and clock ticks, and checks every answer against properties of a run
rather than against a second copy of the rules: one verdict, final; nothing but noise after it;
contiguous ranks; ranks start only on the current round's store; restarts bounded and only
after a failure; no message to a host before its accept; an OK verdict only when every rank of
the round exited 0.
"""

from __future__ import annotations

import signal

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from flodl_async._version import __version__
from flodl_async.control.membership import JoinConfig
from flodl_async.control.supervision import (
    AcceptJoin,
    Action,
    Ended,
    EndRun,
    Event,
    ForceStop,
    Forming,
    HostLost,
    Interrupted,
    JoinRequested,
    JoinUndelivered,
    Phase,
    RankConnected,
    RankExited,
    RanksStopped,
    RejectJoin,
    Rendezvous,
    ResetStore,
    Restarting,
    Running,
    StoreReady,
    SupervisorConfig,
)
from flodl_async.control.supervisor import Supervisor
from flodl_async.control.vocab import Announce, Tell, Tick
from flodl_async.verdict import ExitCode
from flodl_async.wire import messages as m

OPENED_AT = 100.0
HOSTS = ("h0", "h1", "h2", "h3")
STRANGER = "walk-in"
STORE_READY_TIMEOUT = 20.0
STOP_GRACE = 5.0
STOP_ACK_MARGIN = 2.0
#: What may still come out of a supervisor that has given its verdict.
AFTER_VERDICT = (Announce, ForceStop, RejectJoin)
SIGNAL_CODES = {signal.SIGINT: ExitCode.INTERRUPTED, signal.SIGTERM: ExitCode.TERMINATED}


class SupervisorMachine(RuleBasedStateMachine):
    """Drives one :class:`Supervisor`; ``now`` only moves forward, as a monotonic clock does."""

    def __init__(self) -> None:
        super().__init__()
        self.sup: Supervisor
        self.config: SupervisorConfig
        self.now = OPENED_AT
        self.ticked_at: float | None = None  # the last `now` a Tick was fed at
        # Hosts that were sent an AcceptJoin (and not retracted), in admission order, with their device count.
        self.accepted: dict[str, int] = {}
        self.last_accepted: str | None = None
        # The world as the WorldFormed messages describe it: host -> its global ranks.
        self.world: dict[str, tuple[int, ...]] = {}
        self.round = 0
        self.started_round: int | None = None  # the round whose StartRanks went out
        self.succeeded: set[int] = set()  # ranks of the started round that exited 0
        self.store_host = ""
        self.verdict: EndRun | None = None
        # Lost members and signals end any run at once; drawn uniformly they would end nearly every
        # example in the window. `patience` holds them back until the run got that far.
        self.patience = 0

    @initialize(
        min_rank_start=st.integers(1, 4),
        extra_target=st.none() | st.integers(0, 3),
        join_timeout=st.sampled_from([0.0, 2.0, 10.0]),
        cap_slack=st.sampled_from([0.0, 5.0]),
        max_rejected_joins=st.sampled_from([3, 1024]),
        max_restarts=st.integers(0, 3),
        local_hosts=st.sets(st.sampled_from(HOSTS), max_size=2),
        patience=st.integers(0, 2),
        controller_store=st.booleans(),
    )
    def start(
        self,
        min_rank_start: int,
        extra_target: int | None,
        join_timeout: float,
        cap_slack: float,
        max_rejected_joins: int,
        max_restarts: int,
        local_hosts: set[str],
        patience: int,
        controller_store: bool,
    ) -> None:
        join = JoinConfig(
            min_rank_start=min_rank_start,
            target_ranks=None if extra_target is None else min_rank_start + extra_target,
            join_timeout=join_timeout,
            max_join_timeout=join_timeout + cap_slack,
            max_rejected_joins=max_rejected_joins,
        )
        self.config = SupervisorConfig(
            run_id="run-s",
            join=join,
            command=("python", "train.py"),
            max_restarts=max_restarts,
            stop_grace=STOP_GRACE,
            store_ready_timeout=STORE_READY_TIMEOUT,
            stop_ack_margin=STOP_ACK_MARGIN,
            local_hosts=frozenset(local_hosts),
            controller_store=controller_store,
        )
        self.sup = Supervisor(self.config, now=OPENED_AT)
        self.patience = patience

    def _stage(self) -> int:
        """0 while the window is open, 1 once formed, 2 once restarted or ended."""
        phase = self.sup.phase
        if isinstance(phase, Forming):
            return 0
        return 2 if isinstance(phase, Ended) or self.sup.restart_count else 1

    def _may_end_it(self) -> bool:
        return self._stage() >= self.patience

    def _may_move_the_clock(self) -> bool:
        # The clock ends a window without quorum at its cap: that too waits for patience.
        quorum = sum(self.accepted.values()) >= self.config.join.min_rank_start
        return quorum or not isinstance(self.sup.phase, Forming) or self._may_end_it()

    def _may_jump_to_the_deadline(self) -> bool:
        # Past the formation, a deadline reached is a failure (store or stop confirmations late).
        return (
            isinstance(self.sup.phase, Forming) and self._may_move_the_clock()
        ) or self._may_end_it()

    def _ranks_ran(self) -> bool:
        return self.started_round is not None

    def _restarting_or_over(self) -> bool:
        return bool(self.world) and isinstance(self.sup.phase, Restarting | Ended)

    # ----- feeding the machine and checking each answer -------------------------------------------

    def _feed(self, event: Event) -> tuple[Action, ...]:
        before = self.sup.phase
        restarts_before = self.sup.restart_count
        actions = self.sup.handle(event, self.now)
        if isinstance(event, Tick):
            self.ticked_at = self.now
        after = self.sup.phase
        if isinstance(before, Ended):
            assert all(isinstance(a, AFTER_VERDICT) for a in actions), actions
        self._check_transition(before, after, event, restarts_before)
        self._check_actions(before, event, actions)
        return actions

    def _check_transition(
        self, before: Phase, after: Phase, event: Event, restarts_before: int
    ) -> None:
        if isinstance(before, Ended):
            assert after is before
            return
        if isinstance(event, Interrupted):
            assert isinstance(after, Ended)
            assert after.result.exit_code is SIGNAL_CODES[signal.Signals(event.signal)]
        elif isinstance(before, Forming) and isinstance(event, HostLost):
            # A lost host before formation, member or a planned agent that never joined, ends the run.
            assert isinstance(after, Ended)
            assert after.result.exit_code is ExitCode.FORMATION
        elif isinstance(before, Forming) and isinstance(after, Ended):
            # Whatever ends the run while the window is open (the cap, a flood of refusals) is a formation failure.
            assert after.result.exit_code is ExitCode.FORMATION
        if (
            isinstance(before, Forming)
            and isinstance(event, Tick)
            and self.now >= OPENED_AT + self.config.join.max_join_timeout
        ):
            # At the cap the window has decided, one way or the other.
            assert not isinstance(after, Forming)
            if sum(self.accepted.values()) < self.config.join.min_rank_start:
                assert isinstance(after, Ended)
                assert after.result.exit_code is ExitCode.FORMATION
        if isinstance(after, Restarting) and not isinstance(before, Restarting):
            assert isinstance(before, Running)
            assert isinstance(event, RankExited)
            assert event.report.round == before.round
            assert event.report.exit_code != 0 or event.report.signal is not None
            assert restarts_before < self.config.max_restarts
        if isinstance(after, Rendezvous) and not isinstance(before, Rendezvous):
            if isinstance(before, Restarting):
                assert after.round == before.round + 1
                assert self.sup.restart_count == restarts_before + 1
            else:
                assert isinstance(before, Forming)
                assert after.round == 0
        new_round = isinstance(after, Rendezvous) and not isinstance(before, Rendezvous)
        if isinstance(after, Running) and not isinstance(before, Running):
            if self.config.controller_store:
                # The store is the controller's: a round runs as it opens, no StoreReady awaited.
                assert not isinstance(event, StoreReady)
                assert isinstance(before, Forming | Restarting)
                assert after.round == (before.round + 1 if isinstance(before, Restarting) else 0)
                new_round = True
                if isinstance(before, Restarting):
                    assert self.sup.restart_count == restarts_before + 1
            else:
                assert isinstance(before, Rendezvous)
                assert isinstance(event, StoreReady)
                assert event.round == before.round == after.round
        if self.config.controller_store:
            assert not isinstance(after, Rendezvous), "no store host to wait for"
        if not new_round or isinstance(before, Forming):
            assert self.sup.restart_count == restarts_before

    def _check_actions(self, before: Phase, event: Event, actions: tuple[Action, ...]) -> None:
        worlds: list[tuple[str, m.WorldFormed]] = []
        opened: list[tuple[str, int]] = []
        resets: list[int] = []
        for action in actions:
            if isinstance(action, ResetStore):
                assert self.config.controller_store
                resets.append(action.round)
                self.round = action.round
            elif isinstance(action, AcceptJoin):
                assert action.host not in self.accepted
                assert action.reply.run_id == "run-s"
                self.accepted[action.host] = len(action.reply.ranks)
            elif isinstance(action, Tell):
                # Nothing goes down a join link before its accept did.
                assert action.to in self.accepted, action
                message = action.message
                if isinstance(message, m.WorldFormed):
                    worlds.append((action.to, message))
                elif isinstance(message, m.OpenRound):
                    opened.append((action.to, message.round))
                elif isinstance(message, m.StartRanks) and self.config.controller_store:
                    assert resets == [message.round], (
                        "the store is emptied for the round before its ranks start"
                    )
                    assert message.restart_count == self.sup.restart_count
                    assert (message.master_addr, message.master_port) == (
                        "",
                        0,
                    )  # each agent's own controller address
                elif isinstance(message, m.StartRanks):
                    assert isinstance(before, Rendezvous)
                    assert isinstance(event, StoreReady)
                    assert event.round == before.round == message.round
                    assert message.restart_count == self.sup.restart_count
                    assert (message.master_addr, message.master_port) == (event.addr, event.port)
                elif isinstance(message, m.StopRanks):
                    assert isinstance(before, Running)
                    assert message.round == before.round
            elif isinstance(action, EndRun):
                self._check_verdict(action)
        self.last_accepted = next((a.host for a in actions if isinstance(a, AcceptJoin)), None)
        if worlds:
            self._check_world(worlds)
        if opened:
            assert not self.config.controller_store
            assert opened == [(self.store_host, opened[0][1])], "one round opens, on the store host"
            self.round = opened[0][1]
        starts = [a for a in actions if isinstance(a, Tell) and isinstance(a.message, m.StartRanks)]
        if starts:
            assert sorted(a.to for a in starts) == sorted(self.world)
            self.started_round = self.round
            self.succeeded = set()

    def _check_world(self, worlds: list[tuple[str, m.WorldFormed]]) -> None:
        assert not self.world, "the world forms once"
        worlds.sort(key=lambda told: told[1].group_rank)
        assert [w.group_rank for _, w in worlds] == list(range(len(worlds)))
        ranks = [rank for _, w in worlds for rank in w.ranks]
        size = worlds[0][1].world_size
        assert ranks == list(range(size)), "ranks are contiguous across hosts, in admission order"
        assert [host for host, _ in worlds] == list(self.accepted)
        assert [len(w.ranks) for _, w in worlds] == list(self.accepted.values())
        for _, w in worlds:
            assert (w.world_size, w.group_world_size, w.max_restarts) == (
                size,
                len(worlds),
                self.config.max_restarts,
            )
        store_hosts = [host for host, w in worlds if w.store_host]
        self.world = {host: w.ranks for host, w in worlds}
        if self.config.controller_store:
            assert store_hosts == [], "the store rides the controller's port: no store host"
            return
        assert len(store_hosts) == 1
        local = [host for host, _ in worlds if host in self.config.local_hosts]
        assert store_hosts[0] == (local[0] if local else worlds[0][0])
        self.store_host = store_hosts[0]

    def _check_verdict(self, end: EndRun) -> None:
        assert self.verdict is None, "a verdict is given at most once"
        self.verdict = end
        if end.result.exit_code is ExitCode.OK:
            assert isinstance(end.farewell, m.Finish)
            assert self.started_round == self.round
            assert self.succeeded == set(range(sum(len(r) for r in self.world.values())))
        else:
            assert isinstance(end.farewell, m.Abort)
            assert end.farewell.reason == end.result.reason
            assert end.farewell.grace_s == STOP_GRACE

    # ----- joins ---------------------------------------------------------------------------------

    @rule(
        host=st.sampled_from(HOSTS),
        n_devices=st.integers(1, 3),
        version=st.sampled_from([__version__, __version__, __version__, "0.0.1", ""]),
    )
    def join(self, host: str, n_devices: int, version: str) -> None:
        forming = isinstance(self.sup.phase, Forming)
        fresh = host not in self.accepted
        actions = self._feed(
            JoinRequested(
                host=host,
                devices=tuple(f"cuda:{i}" for i in range(n_devices)),
                protocol_version=1,
                agent_version=version,
            )
        )
        accepted = [a for a in actions if isinstance(a, AcceptJoin)]
        rejected = [a for a in actions if isinstance(a, RejectJoin)]
        assert len(accepted) + len(rejected) == 1, "every join is answered once"
        assert bool(accepted) == (forming and fresh and version == __version__)
        if accepted:
            ranks = accepted[0].reply.ranks
            assert ranks == tuple(
                range(sum(self.accepted.values()) - n_devices, sum(self.accepted.values()))
            )

    @precondition(lambda self: self.last_accepted is not None)
    @rule()
    def join_undelivered(self) -> None:
        # The shell reports it right after the accept it could not send.
        host = self.last_accepted
        assert host is not None
        phase = self.sup.phase
        forming = isinstance(phase, Forming)
        if forming:
            del self.accepted[host]
        actions = self._feed(JoinUndelivered(host=host))
        if forming:
            assert sum(self.accepted.values()) == self.sup.view().joined_ranks or not isinstance(
                self.sup.phase, Forming
            )
        elif isinstance(phase, Rendezvous):
            # The world formed on that join: too late to retract, the host is lost and the run ends.
            ends = [a for a in actions if isinstance(a, EndRun)]
            assert ends
            assert ends[0].result.exit_code is ExitCode.RANK_FAILURE

    # ----- hosts and the store -------------------------------------------------------------------

    @precondition(_may_end_it)
    # A link that closed, or one the controller's liveness check found silent past its deadline.
    @rule(
        host=st.sampled_from((*HOSTS, STRANGER)),
        reason=st.sampled_from(
            ["link closed", "no heartbeat for 10s (the host is frozen, down or cut off)"]
        ),
    )
    def host_lost(self, host: str, reason: str) -> None:
        phase = self.sup.phase
        actions = self._feed(HostLost(host=host, reason=reason))
        if isinstance(phase, Rendezvous | Running | Restarting):
            ends = [a for a in actions if isinstance(a, EndRun)]
            assert bool(ends) == (host in self.world)
            if ends:
                assert ends[0].result.exit_code is ExitCode.RANK_FAILURE
                assert f"agent on host {host!r} was lost" in ends[0].result.reason
                assert reason in ends[0].result.reason

    @precondition(lambda self: bool(self.world))
    @rule(right_round=st.sampled_from([True, True, False]))
    def store_ready(self, right_round: bool) -> None:
        self._feed(
            StoreReady(
                round=self.round if right_round else self.round + 7, addr="10.0.0.1", port=29400
            )
        )

    @precondition(_ranks_ran)
    @rule(
        data=st.data(), outcome=st.sampled_from(["ok", "ok", "code", "signal"]), stale=st.booleans()
    )
    def rank_exits(self, data: st.DataObject, outcome: str, stale: bool) -> None:
        rank = data.draw(st.sampled_from(sorted(r for ranks in self.world.values() for r in ranks)))
        self._exit(rank, outcome, stale=stale)

    @precondition(_ranks_ran)
    @rule(outcome=st.sampled_from(["ok", "ok", "code", "signal"]), failing=st.integers(0, 11))
    def every_rank_exits(self, outcome: str, failing: int) -> None:
        ranks = sorted(r for ranks in self.world.values() for r in ranks)
        for rank in ranks:
            self._exit(rank, outcome if rank == failing % len(ranks) else "ok", stale=False)

    def _exit(self, rank: int, outcome: str, *, stale: bool) -> None:
        host = next(h for h, ranks in self.world.items() if rank in ranks)
        round_ = self.round - 1 if stale else self.round
        code, sig = {"ok": (0, None), "code": (3, None), "signal": (None, int(signal.SIGKILL))}[
            outcome
        ]
        report = m.RankExited(
            round=round_,
            rank=rank,
            local_rank=self.world[host].index(rank),
            host=host,
            exit_code=code,
            signal=sig,
        )
        phase = self.sup.phase
        current = isinstance(phase, Running) and not stale
        restarts_left = self.sup.restart_count < self.config.max_restarts
        if current and outcome == "ok":
            self.succeeded.add(rank)
        actions = self._feed(RankExited(report=report))
        if current and outcome != "ok":
            # The first failure of the round decides it: a restart, or the verdict.
            restarted = isinstance(self.sup.phase, Restarting)
            ends = [a for a in actions if isinstance(a, EndRun)]
            assert restarted != bool(ends)
            assert restarted == restarts_left
            if ends:
                assert ends[0].result.exit_code is ExitCode.RANK_FAILURE
                assert ends[0].result.reason.startswith(
                    f"rank {rank} (local rank {report.local_rank}) on host {host!r}"
                )
        elif not isinstance(phase, Ended):
            # Otherwise only the last rank of the round to exit 0 decides (stale and early exits never do).
            decides = current and len(self.succeeded) == sum(len(r) for r in self.world.values())
            assert any(isinstance(a, EndRun) for a in actions) == decides

    @precondition(_restarting_or_over)
    @rule(data=st.data(), stale=st.booleans())
    def ranks_stopped(self, data: st.DataObject, stale: bool) -> None:
        host = data.draw(st.sampled_from(sorted(self.world)))
        self._feed(RanksStopped(host=host, round=self.round - 1 if stale else self.round))

    @precondition(_restarting_or_over)
    @rule()
    def every_host_stops(self) -> None:
        for host in self.world:
            self._feed(RanksStopped(host=host, round=self.round))

    @precondition(lambda self: bool(self.world))
    @rule(rank=st.integers(0, 5))
    def rank_connected(self, rank: int) -> None:
        assert self._feed(RankConnected(rank=rank, pid=4242)) == ()

    # ----- signals and the clock -----------------------------------------------------------------

    @precondition(_may_end_it)
    @rule(sig=st.sampled_from([signal.SIGINT, signal.SIGTERM]))
    def interrupt(self, sig: signal.Signals) -> None:
        ended = isinstance(self.sup.phase, Ended)
        actions = self._feed(Interrupted(signal=int(sig)))
        assert any(isinstance(a, ForceStop) for a in actions) == ended
        ends = [a for a in actions if isinstance(a, EndRun)]
        assert bool(ends) != ended
        if ends:
            assert isinstance(ends[0].farewell, m.Abort)
            assert ends[0].farewell.first_signal == int(sig)

    @precondition(_may_move_the_clock)
    @rule(dt=st.sampled_from([0.0, 0.5, 3.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self._feed(Tick())

    @precondition(_may_jump_to_the_deadline)
    @rule()
    def tick_at_the_deadline(self) -> None:
        deadline = self.sup.next_deadline(self.now)
        if deadline is None:
            return
        self.now = max(self.now, deadline)
        before = self.sup.phase
        self._feed(Tick())
        # A deadline reached is acted upon: the phase moves on, or (only while the window's end
        # passes without quorum) the window names its cap; the invariant checks it is later.
        after = self.sup.phase
        if isinstance(after, Forming):
            assert (
                deadline
                == OPENED_AT + self.config.join.join_timeout
                < OPENED_AT + self.config.join.max_join_timeout
            )
        else:
            assert after is not before
        if isinstance(after, Ended) and isinstance(before, Rendezvous | Restarting):
            # A store that never came up is a formation failure; hosts that did not stop, a rank failure.
            assert after.result.exit_code is (
                ExitCode.FORMATION if isinstance(before, Rendezvous) else ExitCode.RANK_FAILURE
            )

    # ----- the run's natural course ---------------------------------------------------------------

    @rule(data=st.data())
    def the_run_goes_on(self, data: st.DataObject) -> None:
        """What a healthy run does next in this phase; the other rules add the noise around it."""
        phase = self.sup.phase
        if isinstance(phase, Forming):
            fresh = [h for h in HOSTS if h not in self.accepted]
            if fresh:
                self.join(
                    data.draw(st.sampled_from(fresh)), data.draw(st.integers(1, 3)), __version__
                )
            elif self._may_move_the_clock():
                self.tick_at_the_deadline()
        elif isinstance(phase, Rendezvous):
            self.store_ready(right_round=True)
        elif isinstance(phase, Running):
            left = sorted({r for ranks in self.world.values() for r in ranks} - self.succeeded)
            self._exit(
                data.draw(st.sampled_from(left)),
                data.draw(st.sampled_from(["ok", "ok", "ok", "code", "signal"])),
                stale=False,
            )
        elif isinstance(phase, Restarting):
            self.every_host_stops()

    # ----- invariants ----------------------------------------------------------------------------

    @invariant()
    def a_verdict_is_final(self) -> None:
        phase = self.sup.phase
        if self.verdict is None:
            assert not isinstance(phase, Ended)
            assert self.sup.result is None
        else:
            assert isinstance(phase, Ended)
            assert self.sup.result == self.verdict.result
            assert self.sup.view().result == self.verdict.result

    @invariant()
    def restarts_are_bounded(self) -> None:
        assert 0 <= self.sup.restart_count <= self.config.max_restarts
        assert self.sup.view().restart_count == self.sup.restart_count
        if isinstance(self.sup.phase, Rendezvous | Running | Restarting):
            assert self.sup.phase.round == self.sup.restart_count == self.round

    @invariant()
    def deadlines_only_while_waiting(self) -> None:
        deadline = self.sup.next_deadline(self.now)
        phase = self.sup.phase
        if isinstance(phase, Running | Ended):
            assert deadline is None
            return
        if isinstance(phase, Rendezvous | Restarting):
            assert deadline == phase.deadline
        assert deadline is not None
        if self.ticked_at == self.now:
            # A deadline at or before a tick was acted upon: the next one lies ahead (no busy loop).
            assert deadline > self.now

    @invariant()
    def the_view_follows_the_phase(self) -> None:
        view = self.sup.view()
        names = {
            Forming: "waiting",
            Rendezvous: "forming",
            Running: "training",
            Restarting: "training",
        }
        phase = self.sup.phase
        if isinstance(phase, Ended):
            assert view.phase == ("done" if phase.result.exit_code is ExitCode.OK else "failed")
        else:
            assert view.phase == names[type(phase)]
        assert view.world_size == sum(len(r) for r in self.world.values())


SupervisorMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    # Shared build hosts: wall-clock deadlines would flake; the size above keeps the file to seconds.
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_supervisor_state_machine = SupervisorMachine.TestCase
