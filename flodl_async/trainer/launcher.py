"""The Trainer's launcher role: the controller on the caller's event loop, this program re-executed
as the ranks.

Theory of operation. A script whose Trainer has ``cluster=`` (or that sees 2+
GPUs, or runs with ``FLODL_INTERNAL_CLUSTER_SPEC``) becomes the launcher: it
builds a :class:`~flodl_async.config.plan.LaunchPlan` exactly as ``flodl-launch``
would (same cluster file rules, same secret, same join window), with the ranks'
command being this program again (``sys.orig_argv``, or ``rank_command``), and
runs the :class:`~flodl_async.controller.Controller` as a task of the running
loop, next to whatever else the application does. The ranks build the same
Trainer and join the coordinator in the RANK role. The launcher never builds
the model: the model schema comes from the ranks' hellos.

The launcher is the run's primary process (its ranks are told so through
``FLODL_TRAINER_LAUNCHER_PRIMARY``), and its ``run()`` returns the reducer's
final consensus, as every other role returns the state it ends with. A stop
(``shutdown()``, cancelling ``trainer.run()``, SIGTERM, Ctrl-C) asks the
coordinator for an orderly end — a final round, the state returned — before any
signal reaches a rank; a second signal forces.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..agent import RankOutput
from ..cli.launch import (
    PortChoice,
    banner,
    bind_controller,
    cluster_token,
    placement_of,
    port_choice,
    status_host,
    this_machine,
    warn_oversubscribed,
)
from ..config.cluster import (
    ClusterSpec,
    ControllerSpec,
    DeviceSpec,
    JoinKnobs,
    WorkerSpec,
    load_cluster,
)
from ..config.plan import LaunchPlan, PlacedWorker
from ..config.rankenv import RUN_ID_VAR
from ..config.roles import CONTROLLER_VAR
from ..controller import Controller
from ..controller.preemption import preempt_training, preempted_verdict
from ..controller.resumes import preflight, warn_if_spread
from ..controller.training import TrainingResult
from ..deadlines import Deadlines
from ..errors import ConfigError, RuntimeDirError, TrainingFailed
from ..host.gpus import host_visible_gpus
from ..host.runs import Registration, register
from ..net.signals import (
    PREEMPT_SIGNAL_VAR,
    StopSignals,
    add_guest_handler,
    preempt_signal,
)
from ..training.policy import Backend
from ..verdict import ExitCode, RunResult, exit_code_for_signal
from ..wire.keys import new_session_secret
from .entry import LAUNCHER_PRIMARY_VAR, resolve_rank_command
from .state import RunRequest, TrainedState

if TYPE_CHECKING:
    from ..training.metrics import EpochMetrics
    from ..training.spec import TrainerSpec

log = logging.getLogger("flodl_async.cli.launch")


def cluster_of(request: RunRequest, env: dict[str, str] | os._Environ[str]) -> ClusterSpec:
    """The cluster this launcher runs: ``cluster=``, else ``FLODL_INTERNAL_CLUSTER_SPEC``, else one
    host over its visible GPUs."""
    local = this_machine().names
    given = request.cluster
    if isinstance(given, ClusterSpec):
        return given
    # A Trainer knows its backend: launch_plan checks a tunnel against it, not `trainer: cpu`.
    if given is not None:
        return load_cluster(os.fspath(given), local_names=local, backend_known=True)
    path = env.get(CONTROLLER_VAR)
    if path:
        return load_cluster(path, local_names=local, backend_known=True)
    gpus = len(host_visible_gpus(env))
    if gpus < 2:
        raise ConfigError(
            f"auto-promote multi-GPU failed: {gpus} visible GPU(s); pass Trainer(cluster=...) or "
            "Trainer(auto_promote=False)"
        )
    return ClusterSpec(
        controller=_one_host_controller(),
        workers=(
            WorkerSpec(host=socket.gethostname(), devices=DeviceSpec.gpus(tuple(range(gpus)))),
        ),
        source="auto-promote",
    )


def _one_host_controller() -> ControllerSpec:
    return ControllerSpec(host="127.0.0.1", port=0, join=JoinKnobs(join_timeout=60.0))


def launch_plan(
    request: RunRequest,
    spec: ClusterSpec,
    *,
    argv: list[str],
    executable: str,
    run_id: str | None = None,
) -> LaunchPlan:
    """The launch plan of a Trainer launcher: ``flodl-launch``'s, with this program as the ranks'
    command."""
    if request.spec.backend is not Backend.CPU and any(w.tunnel for w in spec.workers):
        raise ConfigError(
            f"{spec.source}: workers with `tunnel: true` need Trainer(backend=fa.Backend.CPU) — a "
            "tunnel carries no rank-to-rank "
            "collective traffic; drop the tunnel or use the CPU backend"
        )
    command = resolve_rank_command(argv, executable, given=request.rank_command)
    deadlines = Deadlines.resolve()
    aliases = this_machine()
    capacity = sum(w.devices.known_count or 0 for w in spec.workers)
    return LaunchPlan(
        run_id=run_id or f"flodl-{secrets.token_hex(4)}",
        secret=new_session_secret(),
        bind_host=spec.bind_host(aliases.names),
        port=spec.controller.port,
        join=spec.controller.join.resolve(capacity, scale=deadlines.scale),
        workers=tuple(
            PlacedWorker(spec=w, placement=placement_of(w, aliases.names)) for w in spec.workers
        ),
        command=command,
        cluster_env={**spec.env, LAUNCHER_PRIMARY_VAR: "1"},
        deadlines=deadlines,
        host_aliases=aliases,
        token=cluster_token(None, spec),
        one_host=spec.source == "auto-promote",
        max_restarts=request.max_restarts,
    )


def _configure_logging() -> None:
    """A script that set up no logging still sees the launcher's lines (as ``flodl-launch`` prints
    them, ``flodl:`` first).

    Like :func:`logging.basicConfig`, it does nothing when the root logger already has a handler:
    an application that configured logging gets the launcher's lines through its own handlers, at
    its own levels. A level the script set on the ``flodl_async`` logger is kept: ``DEBUG`` there
    is the Trainer's ``-v`` (the relays' and the reducer's closing lines), ``WARNING`` its ``-q``.
    """
    root = logging.getLogger("flodl_async")
    if root.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("flodl: %(message)s"))
    root.addHandler(handler)
    if root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    root.propagate = False


class LauncherDriver:
    """Runs the controller for a Trainer on the caller's loop and returns the final consensus."""

    primary = True

    def __init__(self, request: RunRequest) -> None:
        self._reference = request.spec
        spec = cluster_of(request, os.environ)
        # The run-id variable names the run when an outer tool (or a test) wants to find its
        # processes.
        self.plan = launch_plan(
            request,
            spec,
            argv=list(sys.orig_argv),
            executable=sys.executable,
            run_id=os.environ.get(RUN_ID_VAR) or None,
        )
        self.run_id = self.plan.run_id
        #: the one port rule, as flodl-launch's (its advice names the cluster file's port field)
        self._port_choice: PortChoice = port_choice(self.plan, spec, None)
        self._controller: Controller | None = None
        self._stop_requested = False
        #: The run's verdict, once the controller returned (what a cooperative launcher exits with).
        self.result: RunResult | None = None
        self._stop_signal: signal.Signals | None = None
        #: the preemption signal reached the Trainer (the verdict is then preempted_verdict's)
        self._preempted = False

    async def run(self, publish: Callable[[EpochMetrics], None]) -> TrainedState:
        _configure_logging()
        plan = self.plan
        try:
            # before the fan-out: a bundle that is not there, torn, or of other data ends it here
            preflight(self._reference)
            warn_if_spread(self._reference.checkpoint, (w.host for w in plan.workers))
            preempt_sig = preempt_signal(
                os.environ.get(PREEMPT_SIGNAL_VAR), source=PREEMPT_SIGNAL_VAR
            )
        except ConfigError as exc:
            raise TrainingFailed(RunResult(exit_code=ExitCode.USAGE, reason=str(exc))) from None
        output = RankOutput(stdout=sys.stdout.buffer, stderr=sys.stderr.buffer, run_id=plan.run_id)
        try:
            controller = await bind_controller(plan, output, self._port_choice)
        except ConfigError as exc:
            output.close()
            # ends as flodl-launch's does (exit 2, one line, no traceback) unless the script
            # catches it
            raise TrainingFailed(RunResult(exit_code=ExitCode.USAGE, reason=str(exc))) from None
        attachment = attach(controller, reference=self._reference, on_epoch=publish)
        self._controller = controller
        loop = asyncio.get_running_loop()
        # Ctrl-C too: left to asyncio.run, SIGINT cancels the main task, and the loop's shutdown
        # then cancels every task, the controller's own, before any round could end in order.
        stop_signals = StopSignals(self._first_stop_signal, self._later_stop_signal, guest=True)
        stop_signals.install()
        # the preemption signal (FLODL_PREEMPT_SIGNAL, USR1 by default): checkpoint, then stop
        preempt = add_guest_handler(loop, preempt_sig, self._preempt)
        registration: Registration | None = None
        try:
            registration = _announce(plan, controller.port)
            # Not in a TaskGroup: a cancelled run() must keep the controller going until it stops in
            # order
            # (below); this coroutine awaits the task on every path, so it is the task's owner.
            task = loop.create_task(controller.run(), name=f"trainer-controller-{plan.run_id}")
            try:
                result = await asyncio.shield(task)
            except asyncio.CancelledError:
                # The loop is closing (or our task was cancelled): stop in order, wait for the
                # verdict, then go.
                self.request_stop()
                with contextlib.suppress(Exception):
                    await asyncio.shield(task)
                raise
        finally:
            if registration is not None:
                registration.remove()
            stop_signals.restore()
            if preempt is not None:
                loop.remove_signal_handler(preempt[0])
                if preempt[1] is not None:
                    signal.signal(preempt[0], preempt[1])
            await controller.aclose()
            output.close()
        outcome = attachment.outcome()
        stopped = outcome is not None and outcome.interrupted
        if self._stop_signal is not None and result.exit_code is ExitCode.OK and stopped:
            # an orderly stop on a signal ends as flodl-launch's does, 130/143 (with the state)
            result = dataclasses.replace(result, exit_code=exit_code_for_signal(self._stop_signal))
        elif self._preempted:
            result = preempted_verdict(result, outcome)
        self.result = result
        return final_state(attachment, result)

    def request_stop(self) -> None:
        """Ask the coordinator for an orderly end, once: every later request (a cancellation on the
        same path) waits for it."""
        self._stop_in_order("the launcher's TrainingRun.shutdown()", signal.SIGTERM)

    def request_checkpoint(self) -> None:
        """A checkpoint at the next reduce boundary (nothing before the coordinator exists)."""
        controller = self._controller
        if controller is None or not controller.checkpoint_training(
            "the launcher's TrainingRun.checkpoint()"
        ):
            log.warning("TrainingRun.checkpoint(): no training runs yet (or any more); ignored")

    def _stop_in_order(self, why: str, sig: signal.Signals) -> None:
        controller = self._controller
        if controller is None or self._stop_requested:
            return
        self._stop_requested = True
        request_orderly_stop(controller, why, sig)

    def _first_stop_signal(self, sig: signal.Signals) -> None:
        """The first SIGINT or SIGTERM asks for the orderly end (the signal table)."""
        self._stop_signal = sig
        self._stop_in_order(f"the launcher got {sig.name}", sig)

    def _preempt(self, sig: signal.Signals) -> None:
        """The preemption signal: a checkpoint at the next reduce, then an orderly stop (exit 7)."""
        controller = self._controller
        said = None if controller is None else preempt_training(controller.training, int(sig))
        if said is None:
            log.warning("%s: no Trainer trains yet, nothing to checkpoint; ignored", sig.name)
            return
        self._preempted = True
        log.warning("%s", said)

    def _later_stop_signal(self, sig: signal.Signals) -> None:
        """A second one forces it; the controller says so ("second SIGTERM: forcing the stop (KILL
        now)")."""
        self.force_stop()

    def force_stop(self) -> None:
        controller = self._controller
        if controller is not None:
            controller.interrupt(int(signal.SIGTERM))
            controller.interrupt(int(signal.SIGTERM))


def _announce(plan: LaunchPlan, port: int) -> Registration | None:
    """``flodl-launch``'s banner (where the status answers), and the entry that lets ``flodl ps`` /
    a bare ``flodl status`` find this run."""
    warn_oversubscribed(plan)  # this host's CPU ranks; every other host's are checked at its join
    log.info("%s", banner(plan, port))
    try:
        return register(run_id=plan.run_id, address=status_host(plan.bind_host), port=port)
    except RuntimeDirError as exc:
        log.warning("not registered for `flodl ps` / `flodl status`: %s", exc)
        return None


# ----- the controller's training shell (controller/training.py): what the launcher reads of it
# ---------


def request_orderly_stop(controller: Controller, why: str, sig: signal.Signals) -> None:
    """Ask the coordinator for a stop with a final round (no signal reaches a rank for it); before
    it exists, stop the run with ``sig``."""
    if not request_stop(controller, why):
        controller.interrupt(int(sig))


def final_state(attachment: TrainerAttachment, result: RunResult) -> TrainedState:
    """The launcher's ``TrainedState``: the final consensus the controller kept, or
    ``TrainingFailed`` with the verdict."""
    outcome = attachment.outcome()
    stopped = (
        result.exit_code in (ExitCode.INTERRUPTED, ExitCode.TERMINATED, ExitCode.PREEMPTED)
        and outcome is not None
        and outcome.ok
    )
    if result.exit_code is not ExitCode.OK and not stopped:
        raise TrainingFailed(result)
    if outcome is None or outcome.state_dict is None:
        reason = f"{result.reason}, but the launcher holds no final consensus"
        raise TrainingFailed(
            RunResult(exit_code=ExitCode.INTERNAL, reason=reason, details=result.details)
        )
    return TrainedState(
        state_dict=outcome.state_dict,
        param_names=outcome.param_names,
        epochs_completed=outcome.epochs_completed,
        global_step=outcome.global_step,
        world_size=outcome.world_size,
        lost_ranks=outcome.lost_ranks,
        interrupted=outcome.interrupted,
        primary=True,
        checkpoint=outcome.checkpoint,
    )


# ----- the launcher's hold on the controller's training shell -----------------------------------


class TrainerAttachment:
    """What :func:`attach` gives the launcher: the run's result once the controller returns."""

    def __init__(self, controller: Controller) -> None:
        self._controller = controller

    def outcome(self) -> TrainingResult | None:
        """The final consensus and counters (None when no Trainer rank said hello)."""
        shell = self._controller.training
        return None if shell is None else shell.result()


def attach(
    controller: Controller,
    *,
    reference: TrainerSpec | None = None,
    on_epoch: Callable[[EpochMetrics], None] | None = None,
) -> TrainerAttachment:
    """Before ``controller.run()``: the launcher's own spec is the reference every rank must match;
    epochs go to ``on_epoch``."""
    controller.configure_training(reference=reference, metrics_sink=on_epoch)
    return TrainerAttachment(controller)


def request_stop(controller: Controller, reason: str = "shutdown requested") -> bool:
    """An orderly stop of the training (a final round, then ``Shutdown``); False when nothing
    trains."""
    return controller.stop_training(reason)
