"""Preemption of a Trainer run: the signal a scheduler sends before it kills the job.

The launcher's preemption signal (``--preempt-signal``, default SIGUSR1) asks the Trainer for a
checkpoint at the next reduce (reason ``preempt``) and an orderly stop; the verdict is exit 7 only
once that bundle is written, so a requeue that runs the same command always has one to resume.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..checkpoint import Reason, parse_bundle_name
from ..control.exits import signal_name
from ..verdict import ExitCode, RunResult
from .training import TrainingResult, TrainingShell


def preempted_verdict(result: RunResult, trained: TrainingResult | None) -> RunResult:
    """A run that got the preemption signal: exit 7 once it stopped in order with its ``preempt``
    bundle written (the requeue runs the same command and resumes from it); 143 when it stopped
    with none (no ``save_path``, or the bundle failed: exit 7 must never promise a resume).
    A run that ended otherwise (it finished first, it failed) keeps its verdict."""
    if result.exit_code is not ExitCode.OK or trained is None or not trained.interrupted:
        return result
    last = trained.checkpoint
    bundle = None if last is None else parse_bundle_name(Path(last).name)
    if bundle is not None and bundle[1] is Reason.PREEMPT:
        return dataclasses.replace(
            result,
            exit_code=ExitCode.PREEMPTED,
            reason=f"{result.reason}; preempted, checkpoint {trained.checkpoint} written: run the "
            "same command to resume",
        )
    return dataclasses.replace(
        result,
        exit_code=ExitCode.TERMINATED,
        reason=f"{result.reason}; preempted, but no preempt bundle was written (no save_path, or "
        "the final round's consensus could not be saved: see above)",
    )


def preempt_training(training: TrainingShell | None, signum: int) -> str | None:
    """The preemption signal: a Trainer run checkpoints at the next reduce (``preempt``), then
    stops in order; what to log, or None when no Trainer trains (a plain script's run: the caller
    passes the signal on). The exit code is :func:`preempted_verdict`'s."""
    if training is None or training.coordinator is None:
        return None
    name = signal_name(signum)
    spec = training.coordinator.spec
    if spec is None or spec.checkpoint.save_path is None:
        training.stop(f"{name}: preempted, with no save_path")
        return (
            f"{name}: preempted, but this Trainer has no save_path: NOTHING CAN BE SAVED; "
            "stopping in order (exit 143, the run starts over if run again)"
        )
    if not training.stop(f"{name}: preempted", preempt=True):
        return f"{name}: a stop is already under way (SIGTERM twice forces it)"
    return f"{name}: preempted: a checkpoint at the next reduce, then an orderly stop (exit 7)"
