"""Stopping is the same in every role, the pure and in-process parts: how a verdict line reads, and
a rank's stop intent reaching the coordinator through the controller's training shell.

The processes themselves (a rank's ``shutdown()`` under flodl-launch, Ctrl-C to an inline run, the
verdict lines of real runs) are in test_trainer_stop_e2e.py.
"""

from __future__ import annotations

import asyncio

import pytest

from flodl_async.cli.verdictline import verdict_line, verdict_word
from flodl_async.controller.training import TrainingOutcome, TrainingShell
from flodl_async.net.framed import FramedProtocol
from flodl_async.training.coordination import CoordPhase
from flodl_async.verdict import ExitCode, RunResult
from flodl_async.wire import messages as m
from flodl_async.wire.schema import Message

from .coordkit import hello
from .test_coordinator import spec
from .test_training_loopback import LoopbackRounds

# ----- the verdict line --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "interrupted", "word"),
    [
        (ExitCode.OK, False, "done"),
        # a Trainer run ended by a shutdown() in one of its processes: every rank exited 0
        (ExitCode.OK, True, "stopped"),
        # a signal's end, plain script or Trainer, in order or forced by a second signal
        (ExitCode.INTERRUPTED, False, "stopped"),
        (ExitCode.TERMINATED, False, "stopped"),
        (ExitCode.TERMINATED, True, "stopped"),
        (ExitCode.RANK_FAILURE, False, "FAILED"),
        # a failure during a stop is still a failure
        (ExitCode.STALLED, True, "FAILED"),
        (ExitCode.MAX_FAILURE, False, "FAILED"),
    ],
)
def test_a_stop_someone_asked_for_reads_stopped_and_only_a_failure_reads_failed(
    code: ExitCode, interrupted: bool, word: str
) -> None:
    result = RunResult(exit_code=code, reason="why")
    assert verdict_word(result, interrupted=interrupted) == word


def test_the_verdict_line_names_the_program_the_word_the_reason_and_the_time() -> None:
    result = RunResult(exit_code=ExitCode.INTERRUPTED, reason="interrupted by SIGINT")
    assert (
        verdict_line("flodl-launch", result, elapsed=3.14)
        == "flodl-launch: stopped — interrupted by SIGINT (3.1s)"
    )
    failed = RunResult(exit_code=ExitCode.RANK_FAILURE, reason="rank 1 failed")
    assert verdict_line("flodl", failed) == "flodl: FAILED — rank 1 failed"


# ----- a rank's stop intent, through the controller's training shell ----------------------------


class RelayLink(FramedProtocol):
    """A relay's link as the shell uses it: what is sent down it, recorded."""

    def __init__(self) -> None:  # no connection behind it
        self.sent: list[Message] = []

    def send(self, msg: Message) -> None:
        self.sent.append(msg)


async def _shell_with_two_ranks(
    tg: asyncio.TaskGroup, outcomes: list[TrainingOutcome], ended: asyncio.Event
) -> tuple[TrainingShell, RelayLink]:
    def concluded(outcome: TrainingOutcome) -> None:
        outcomes.append(outcome)
        ended.set()

    shell = TrainingShell(
        run_id="r",
        world=lambda: (2, {0: "h0", 1: "h1"}),
        task_group=tg,
        on_outcome=concluded,
        round_runner=lambda _spec, _schema, _digest, _misbehaved: LoopbackRounds(),
    )
    link = RelayLink()
    for rank in (0, 1):
        shell.receive(hello(rank, spec()), link)
    return shell, link


async def test_a_ranks_stop_intent_stops_the_whole_run_in_order_and_says_who_asked() -> None:
    outcomes: list[TrainingOutcome] = []
    ended = asyncio.Event()
    async with asyncio.timeout(10), asyncio.TaskGroup() as tg:
        shell, link = await _shell_with_two_ranks(tg, outcomes, ended)
        shell.receive(m.Intent(rank=1, kind=m.Intent.STOP), link)
        coordinator = shell.coordinator
        assert coordinator is not None
        assert coordinator.stop_requested
        await ended.wait()  # round 0, then the final round the stop asks for
    (outcome,) = outcomes
    assert outcome.ok, outcome
    assert outcome.save_reason == "graceful_shutdown"
    assert "rank 1 called TrainingRun.shutdown()" in outcome.reason
    shutdowns = [msg for msg in link.sent if isinstance(msg, m.Shutdown)]
    assert [s.save_reason for s in shutdowns] == ["graceful_shutdown"]  # every rank, once
    result = shell.result()
    assert result is not None
    assert result.interrupted
    assert coordinator.phase is CoordPhase.DONE


async def test_a_second_stop_intent_and_a_checkpoint_intent_change_nothing() -> None:
    outcomes: list[TrainingOutcome] = []
    ended = asyncio.Event()
    async with asyncio.timeout(10), asyncio.TaskGroup() as tg:
        shell, link = await _shell_with_two_ranks(tg, outcomes, ended)
        shell.receive(m.Intent(rank=0, kind="checkpoint"), link)
        coordinator = shell.coordinator
        assert coordinator is not None
        assert not coordinator.stop_requested  # only a sign of life
        shell.receive(m.Intent(rank=0, kind=m.Intent.STOP), link)
        shell.receive(m.Intent(rank=1, kind=m.Intent.STOP), link)
        await ended.wait()
    (outcome,) = outcomes
    assert "rank 0 called TrainingRun.shutdown()" in outcome.reason  # the first asked
