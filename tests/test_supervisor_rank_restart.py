"""The supervisor's decision to restart one Trainer rank alone (``--max-restarts``), on a fake
clock: a rank lost to a crash is restarted in place while training runs and restarts are left;
one its agent KILLed once the coordinator declared it dead for its silence (frozen) is too, a liar
is not; the
budget is counted over the run; the world is never restarted for a Trainer run; a plain script's
world restart is unchanged."""

from __future__ import annotations

import signal

from flodl_async.control.supervision import (
    Concluding,
    EndRun,
    RankDropped,
    RankExited,
    Restarting,
    Running,
    TellCoordinator,
    TrainingEnded,
    TrainingStarted,
)
from flodl_async.control.supervisor import Supervisor
from flodl_async.control.vocab import Announce, Level
from flodl_async.training.deathchain import silent
from flodl_async.verdict import ExitCode
from flodl_async.wire import messages as m
from flodl_async.wire.restarts import RestartRank

from .test_supervisor import config, exited, of, running, the_end, told


def _trainer(max_restarts: int) -> Supervisor:
    sup = Supervisor(config(training_outcome_wait=2.0, max_restarts=max_restarts), now=0.0)
    running(sup)
    [said] = sup.handle(TrainingStarted(), 2.5)
    assert said == Announce(text=said.text)  # said plainly, not as a warning
    assert said.text.startswith(f"--max-restarts {max_restarts}: a rank lost to a crash")
    return sup


def _killed_by_agent(rank: int, host: str, reason: str) -> RankExited:
    return RankExited(
        report=m.RankExited(
            round=0,
            rank=rank,
            local_rank=rank % 2,
            host=host,
            signal=int(signal.SIGKILL),
            killed_because=f"declared dead: {reason}",
        )
    )


def test_a_crashed_rank_is_restarted_alone_as_its_next_incarnation() -> None:
    sup = _trainer(2)
    actions = sup.handle(exited(1, "a", code=None, sig=int(signal.SIGKILL)), 3.0)
    [said] = of(actions, Announce)
    assert said.level is Level.WARNING
    assert "restarting rank 1 alone (restart 1 of 2, incarnation 1)" in said.text
    [tell] = of(actions, TellCoordinator)  # its death chain drops the dead incarnation
    assert tell.rank == 1
    assert told(actions, RestartRank) == {"a": RestartRank(round=0, rank=1, incarnation=1)}
    assert told(actions, m.StopRanks) == {}  # the world goes on
    assert isinstance(sup.phase, Running)
    assert sup.rank_restarts.count == 1
    assert sup.next_deadline(3.0) is None  # nothing held: no verdict is waiting


def test_the_budget_is_counted_over_the_run_and_a_rank_lost_after_it_stays_lost() -> None:
    sup = _trainer(2)
    first = sup.handle(exited(1, "a", code=1), 3.0)
    assert told(first, RestartRank)["a"] == RestartRank(round=0, rank=1, incarnation=1)
    again = sup.handle(exited(1, "a", code=1), 10.0)  # its incarnation 1 crashes too
    assert told(again, RestartRank)["a"] == RestartRank(round=0, rank=1, incarnation=2)
    other = sup.handle(exited(2, "b", code=1), 20.0)  # the budget is the run's, not per rank
    assert told(other, RestartRank) == {}
    assert isinstance(sup.phase, Concluding)  # the coordinator's to drop: DEGRADED or its cause
    assert sup.rank_restarts.count == 2
    assert [t.rank for t in of(other, TellCoordinator)] == [2]


def test_a_restarted_rank_lost_again_with_no_restart_left_is_the_coordinators() -> None:
    sup = _trainer(1)
    sup.handle(exited(1, "a", code=1), 3.0)
    again = sup.handle(exited(1, "a", code=None, sig=int(signal.SIGKILL)), 9.0)
    # held as dropped since its restart: no verdict, no world restart, the coordinator is told
    assert of(again, EndRun) == []
    assert told(again, m.StopRanks) == {}
    assert [t.rank for t in of(again, TellCoordinator)] == [1]
    assert isinstance(sup.phase, Running)
    done = "training complete, DEGRADED — 1 of 4 ranks lost"
    sup.handle(TrainingEnded(ok=True, reason=done), 12.0)
    for rank, host in ((0, "a"), (2, "b")):
        assert of(sup.handle(exited(rank, host), 12.1), EndRun) == []
    end = the_end(sup.handle(exited(3, "b"), 12.2))
    assert (end.result.exit_code, end.result.reason) == (ExitCode.OK, done)


def test_a_liar_its_agent_killed_is_not_restarted() -> None:
    sup = _trainer(3)
    sup.handle(RankDropped(rank=2, reason="lied"), 3.0)
    lie = "rank 2 claimed 10^15 steps in a round planned for 8 (round 1)"
    actions = sup.handle(_killed_by_agent(2, "b", lie), 3.1)
    assert told(actions, RestartRank) == {}
    assert of(actions, EndRun) == []
    assert sup.rank_restarts.count == 0


def test_a_frozen_rank_its_agent_killed_is_restarted() -> None:
    sup = _trainer(3)
    sup.handle(RankDropped(rank=2, reason="silent"), 3.0)
    # the coordinator's own words for a death by silence
    actions = sup.handle(_killed_by_agent(2, "b", silent(10.0)), 3.1)
    assert told(actions, RestartRank) == {"b": RestartRank(round=0, rank=2, incarnation=1)}


def test_a_restarted_rank_refused_after_training_ended_ends_nothing() -> None:
    sup = _trainer(1)
    sup.handle(exited(1, "a", code=1), 3.0)
    done = "training complete: 4 epoch(s) on 4 rank(s)"
    sup.handle(TrainingEnded(ok=True, reason=done), 5.0)
    # the coordinator refused it (the run was ending): its exit is neither a verdict nor a restart
    refused = sup.handle(exited(1, "a", code=1), 6.0)
    assert of(refused, EndRun) == []
    assert told(refused, RestartRank) == {}
    assert not isinstance(sup.phase, Restarting)
    for rank, host in ((0, "a"), (2, "b")):
        sup.handle(exited(rank, host), 6.1)
    end = the_end(sup.handle(exited(3, "b"), 6.2))
    assert end.result.exit_code is ExitCode.OK


def test_a_trainer_rank_failing_after_training_ended_never_restarts_the_world() -> None:
    sup = Supervisor(config(training_outcome_wait=2.0, max_restarts=1), now=0.0)
    running(sup)
    sup.handle(TrainingStarted(collective=True), 2.5)
    sup.handle(TrainingEnded(ok=True, reason="training complete"), 3.0)
    actions = sup.handle(exited(1, "a", code=1), 3.5)
    assert told(actions, m.StopRanks) == {}
    assert the_end(actions).result.exit_code is ExitCode.RANK_FAILURE


def test_a_plain_scripts_world_is_still_restarted() -> None:
    sup = Supervisor(config(max_restarts=1), now=0.0)
    running(sup)
    actions = sup.handle(exited(1, "a", code=1), 3.0)
    assert set(told(actions, m.StopRanks)) == {"a", "b"}
    assert told(actions, RestartRank) == {}
    assert isinstance(sup.phase, Restarting)
