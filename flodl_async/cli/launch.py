"""``flodl-launch``: the command line that turns arguments or a cluster file into a run.

Two forms:

    flodl-launch --nproc N [--devices cpu|all|0,1] -- CMD ARGS...   # one host, no file
    flodl-launch cluster.yml -- CMD ARGS...                          # a cluster file

Everything the user can get wrong is checked before anything starts, and is
reported in one line with exit code 2, never with a traceback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..config.addr import DEFAULT_PORT
from ..config.cluster import (
    ClusterSpec,
    ControllerSpec,
    DeviceKind,
    DeviceSpec,
    JoinKnobs,
    WorkerSpec,
    is_local_host,
    load_cluster,
)
from ..config.command import RESOLVE_VAR, resolves_python
from ..config.devices import parse_devices
from ..config.everynode import EveryNode
from ..config.plan import LaunchPlan, PlacedWorker, Placement
from ..config.streams import StreamRouting
from ..deadlines import Deadlines
from ..errors import ConfigError, FlodlError, PortInUseError, RuntimeDirError
from ..host.console import ConsoleWriter
from ..host.early import discard_all
from ..host.gpus import host_visible_gpus, select
from ..host.hostnames import HostAliases
from ..host.runs import Registration, register
from ..host.secretfile import load_or_create_secret, read_token_file
from ..net.loop import run
from ..net.signals import (
    DEFAULT_PREEMPT_SIGNAL,
    FORWARDED_SIGNALS,
    ForwardedSignals,
    StopSignals,
)
from ..verdict import ExitCode, RunResult
from ..wire.keys import new_session_secret
from .earlyranks import port_gave_way, release, start_local_ranks
from .launchargs import LaunchArgs, nproc_devices, parse_args, resolve_nproc
from .nodes import (
    already_delivered,
    controller_plan,
    forget_job_token,
    is_controller_node,
    node_banner,
    run_agent_node,
)
from .verdictline import verdict_line

if TYPE_CHECKING:
    from ..agent import RankOutput
    from ..controller import Controller

log = logging.getLogger("flodl_async.cli.launch")


@dataclass(frozen=True, slots=True, kw_only=True)
class PortChoice:
    """How a run holds its port: ``fallback`` lets a taken one give way to a free port; ``origin``
    says, when it may not, why that port and what to do (the error's second half)."""

    fallback: bool
    origin: str


def embedded_devices(
    nproc: int, devices: str, gpu_count: int, visible: Sequence[str] | None = None
) -> DeviceSpec:
    """``--nproc`` with ``--devices`` → the one host's devices (the devices mini-language, plus
    ``auto``)."""
    choice = devices.strip()
    if choice == "auto":
        choice = "all" if gpu_count > 0 else "cpu"
    try:
        spec = parse_devices(choice, bare_cpu_ranks=nproc)
    except ConfigError as exc:
        raise ConfigError(f"--devices: {exc} (or auto)") from None
    if spec.kind is DeviceKind.ALL_GPUS:
        if gpu_count == 0:
            raise ConfigError(
                "--devices all: this host has no visible GPU; for CPU ranks use --devices "
                f"cpu:{nproc} (or --devices cpu)"
            )
        if gpu_count < nproc:
            raise ConfigError(
                f"--nproc {nproc} with --devices all needs {nproc} GPUs, this host shows "
                f"{gpu_count}; use --devices cpu:{nproc}"
            )
        return DeviceSpec.gpus(tuple(range(nproc)))
    if spec.kind is DeviceKind.GPU_LIST:
        try:
            select(
                spec.gpu_ids,
                tuple(visible) if visible is not None else tuple(str(i) for i in range(gpu_count)),
            )
        except ConfigError as exc:
            raise ConfigError(f"--devices: {exc}") from None
    count = spec.known_count
    if count != nproc:
        raise ConfigError(
            f"--devices gives {count} rank(s) but --nproc is {nproc}; one rank per device"
        )
    return spec


def build_plan(args: LaunchArgs) -> tuple[LaunchPlan, PortChoice]:
    """Resolve the arguments (and cluster file) into a launch plan and its port rule, or raise
    :class:`ConfigError`."""
    deadlines = Deadlines.resolve(stop_grace=args.stop_grace)
    aliases = this_machine()
    resolve = {} if args.no_python or not resolves_python(args.command) else {RESOLVE_VAR: "1"}
    if args.nodes is not None:
        plan = controller_plan(
            args,
            args.nodes,
            aliases=aliases,
            deadlines=deadlines,
            secret=_session_secret(args.secret_file),
            run_id=args.nodes.run_id or f"flodl-{secrets.token_hex(4)}",
            cluster_env=resolve,
        )
        return plan, PortChoice(
            fallback=False, origin="--rdzv-endpoint names it: every node dials that port"
        )
    visible = host_visible_gpus()
    gpu_count = len(visible)
    spec: ClusterSpec
    if args.nproc is not None:
        nproc = resolve_nproc(args.nproc, gpu_count)
        choice = nproc_devices(args.nproc, args.devices)
        worker = WorkerSpec(
            host=socket.gethostname(), devices=embedded_devices(nproc, choice, gpu_count, visible)
        )
        spec = ClusterSpec(controller=_embedded_controller(), workers=(worker,), source="--nproc")
    else:
        assert args.cluster is not None
        spec = load_cluster(args.cluster, local_names=aliases.names)
    local = aliases.names
    # `devices: all` counts this machine's GPUs only on this machine; another host's agent reports
    # its own at join.
    reported = frozenset(
        w.host
        for w in spec.workers
        if w.devices.known_count is None and placement_of(w, local) is not Placement.LOCAL
    )
    capacity = sum(
        w.devices.known_count
        if w.devices.known_count is not None
        else 0
        if w.host in reported
        else gpu_count
        for w in spec.workers
    )
    join = spec.controller.join.resolve(capacity, scale=deadlines.scale, reported_hosts=reported)
    secret = _session_secret(args.secret_file)
    token = cluster_token(args.token_file, spec)
    run_id = args.run_id or f"flodl-{secrets.token_hex(4)}"
    plan = LaunchPlan(
        run_id=run_id,
        secret=secret,
        bind_host=spec.bind_host(local),
        port=args.port if args.port is not None else spec.controller.port,
        join=join,
        workers=tuple(PlacedWorker(spec=w, placement=placement_of(w, local)) for w in spec.workers),
        command=args.command,
        cluster_env={**spec.env, **resolve},
        max_restarts=args.max_restarts,
        log_dir=args.log_dir,
        deadlines=deadlines,
        host_aliases=aliases,
        token=token,
        one_host=args.nproc is not None,
        hang_timeout=args.hang_timeout,
    )
    return plan, port_choice(plan, spec, args.port)


def port_choice(plan: LaunchPlan, spec: ClusterSpec, flag: int | None) -> PortChoice:
    """The one port rule: a default port that is taken gives way to a free one, unless dial-in
    agents (or a token's) dial it; a port given by ``--port`` or the cluster file is strict."""
    if flag is not None:
        return PortChoice(fallback=False, origin="--port names it: give another, or --port 0")
    if spec.controller.port_explicit:
        return PortChoice(
            fallback=False,
            origin=f"controller.port of {spec.source} names it: set another there, or 0 for a "
            "free one",
        )
    if plan.token is not None or any(w.placement is Placement.DIAL_IN for w in plan.workers):
        return PortChoice(
            fallback=False,
            origin=f"it is the default port, kept because dial-in agents dial it: free it, or set "
            f"controller.port in {spec.source} (and their --controller) to another",
        )
    return PortChoice(fallback=True, origin="")


def port_taken(exc: PortInUseError, choice: PortChoice) -> ConfigError:
    """A strict port that is taken, as the one line that says whose port it is and what to do."""
    return ConfigError(
        f"port {exc.port} on {exc.host} is already held by a live listener — another flodl run? "
        f"(`flodl ps` lists yours); {choice.origin}"
    )


def next_attempt(log_dir: Path | None, run_id: str) -> int:
    """The first attempt number of a run whose id ``log_dir`` already holds (0 for a new one): a
    resubmitted run (``--run-id $SLURM_JOB_ID``) adds attempts, never appends to an earlier one."""
    if log_dir is None:
        return 0
    numbers = [
        int(entry.name.removeprefix("attempt_"))
        for entry in _entries(log_dir / run_id)
        if entry.name.removeprefix("attempt_").isdigit() and entry.name.startswith("attempt_")
    ]
    return max(numbers, default=-1) + 1


def _entries(directory: Path) -> list[Path]:
    try:
        return list(directory.iterdir())
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ConfigError(f"--log-dir: cannot read {directory}: {exc.strerror or exc}") from None


def cluster_token(flag: str | None, spec: ClusterSpec) -> bytes | None:
    """The token of ``--token-file``, else of ``controller.token_file`` (relative to the cluster
    file), else None."""
    if flag is not None:
        return read_token_file(flag)
    if spec.controller.token_file is None:
        return None
    path = Path(spec.controller.token_file).expanduser()
    if not path.is_absolute():
        path = Path(spec.source).parent / path
    return read_token_file(path)


def placement_of(worker: WorkerSpec, local_names: frozenset[str]) -> Placement:
    """A dial-in worker joins on its own; the controller's own host runs in-process; every other
    host is started over ssh."""
    if worker.dial_in:
        return Placement.DIAL_IN
    return Placement.LOCAL if is_local_host(worker.host, local_names) else Placement.SSH


def this_machine() -> HostAliases:
    """This machine's spellings: its hostname, and its FQDN as the resolver has it (``/etc/hosts``
    first, as a rule)."""
    return HostAliases.of_machine(socket.gethostname(), socket.getfqdn())


def _embedded_controller() -> ControllerSpec:
    # One host, no file: the window closes the moment the local agent is in.
    return ControllerSpec(host="127.0.0.1", port=DEFAULT_PORT, join=JoinKnobs(join_timeout=60.0))


def _session_secret(path: str | None) -> bytes:
    """A fresh secret; with ``--secret-file``, the one in that file (refused unless private), or a
    fresh one written there (0600)."""
    if path is None:
        return new_session_secret()
    return load_or_create_secret(path, new_session_secret())


def banner(plan: LaunchPlan, port: int) -> str:
    """The one line a run starts with: what runs where (which python, when each host resolves
    one), and where its status is."""
    command = " ".join(plan.command) + python_note(plan)
    where = status_host(plan.bind_host)
    if plan.one_host:
        devices = plan.workers[0].spec.devices
        count = devices.known_count or 0
        kind = (
            "CPU" if not devices.is_gpu else f"GPU {','.join(_caller_gpu_names(devices.gpu_ids))}"
        )
        ranks = f"{count} rank" if count == 1 else f"{count} ranks"
        # A run moved off the default port is not the one a bare `flodl status` falls back to.
        status = "flodl status" if port == DEFAULT_PORT else f"flodl status --addr {where}:{port}"
        return (
            f"run {plan.run_id}: {ranks} on this host ({kind}) — {command} — status: {status}, "
            f"or http://{where}:{port}/"
        )
    hosts = len(plan.workers)
    return (
        f"run {plan.run_id}: {command} on {hosts} host(s) — status: flodl status --addr "
        f"{where}:{port}, or http://{where}:{port}/"
    )


def python_note(plan: LaunchPlan) -> str:
    """`` (python: …)``: the interpreter each host's leading ``python`` is, or nothing when the
    command has none to resolve."""
    if plan.cluster_env.get(RESOLVE_VAR) != "1":
        return ""
    word = plan.command[0]
    seen = [(w.host, _python_of(w, word)) for w in plan.workers]
    if len({where for _host, where in seen}) == 1:
        return f" (python: {seen[0][1]})"
    return " (python: " + ", ".join(f"{host} {where}" for host, where in seen) + ")"


def _python_of(worker: PlacedWorker, word: str) -> str:
    """What ``word`` runs on ``worker``'s host (:func:`flodl_async.config.command.host_command`)."""
    if worker.placement is Placement.DIAL_IN:
        return "its agent's own"
    if worker.spec.python:
        return worker.spec.python
    if worker.placement is Placement.SSH:
        return f"{word} on its PATH"
    return shutil.which(word) or sys.executable


def _caller_gpu_names(indices: Sequence[int]) -> tuple[str, ...]:
    """The GPUs as the caller's ``CUDA_VISIBLE_DEVICES`` names them (``2,3`` under
    ``CUDA_VISIBLE_DEVICES=2,3``, not ``0,1``)."""
    try:
        return select(indices, host_visible_gpus())
    except ConfigError:  # checked when the plan was built; the indices are still the truth
        return tuple(str(i) for i in indices)


def warn_oversubscribed(plan: LaunchPlan) -> None:
    """More CPU ranks on this machine than cores it lets us use: every rank will run slower than it
    could."""
    cores = len(os.sched_getaffinity(0))
    ranks = sum(
        w.spec.devices.cpu_ranks
        for w in plan.workers
        if w.placement is Placement.LOCAL and not w.spec.devices.is_gpu
    )
    if ranks > cores:
        log.warning(
            "warning: %d CPU ranks on this host, which has %d core(s) for them: they will compete "
            "for the cores (fewer ranks run faster)",
            ranks,
            cores,
        )


def status_host(bind_host: str) -> str:
    """Where this machine reaches the controller's status."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "127.0.0.1", "::", "") else bind_host


async def bind_controller(plan: LaunchPlan, output: RankOutput, choice: PortChoice) -> Controller:
    """The controller, bound by the one port rule (:func:`port_choice`): a taken default port gives
    way to a free one, as torchrun --standalone does; a strict one is a :class:`ConfigError`."""
    from ..controller import Controller  # deferred: loads while early ranks import torch

    controller = Controller(plan, output=output)
    try:
        await controller.bind()
        return controller
    except PortInUseError as exc:
        await controller.aclose()
        if not choice.fallback:
            raise port_taken(exc, choice) from None
    controller = Controller(dataclasses.replace(plan, port=0), output=output)
    await controller.bind()
    port_gave_way(plan.port, controller.port)
    return controller


async def _run(
    plan: LaunchPlan,
    choice: PortChoice,
    *,
    show_ranks: frozenset[int] | None = None,
    routing: StreamRouting | None = None,
    nodes: EveryNode | None = None,
    preempt: signal.Signals = DEFAULT_PREEMPT_SIGNAL,
) -> tuple[RunResult, bool]:
    """The run's verdict, and whether its Trainer (if any) ended by a stop. ``nodes``: the
    controller's node of an every-node run, which prints only its own ranks' lines."""
    from ..agent import RankOutput  # deferred: loads while early ranks import torch

    first_attempt = next_attempt(plan.log_dir, plan.run_id)
    # Rank output goes through writer threads: a console nobody reads must not stall the loop
    # (heartbeats, status).
    consoles = (
        ConsoleWriter(sys.stdout.buffer, name="stdout"),
        ConsoleWriter(sys.stderr.buffer, name="stderr"),
    )
    # Our own log lines go through the same stderr writer: in order with the ranks' stderr, and
    # never blocking either.
    handlers = [
        h for h in logging.getLogger("flodl_async").handlers if isinstance(h, logging.StreamHandler)
    ]
    previous = [h.setStream(consoles[1].text()) for h in handlers]
    output = RankOutput(
        stdout=consoles[0],
        stderr=consoles[1],
        log_dir=plan.log_dir,
        run_id=plan.run_id,
        show_ranks=show_ranks,
        routing=routing,
        first_attempt=first_attempt,
        remote_console=nodes is None,
    )
    if first_attempt:
        log.info(
            "--log-dir: run id %s has earlier attempts in %s; this run's start at attempt_%d",
            plan.run_id,
            plan.log_dir,
            first_attempt,
        )
    controller: Controller | None = None
    registration: Registration | None = None
    try:
        controller = await bind_controller(plan, output, choice)
        log.info(
            "%s",
            banner(plan, controller.port)
            if nodes is None
            else node_banner(plan, nodes, controller.port),
        )
        try:  # so that `flodl status` (no address) and `flodl ps` find this run
            registration = register(
                run_id=plan.run_id, address=status_host(plan.bind_host), port=controller.port
            )
        except RuntimeDirError as exc:
            log.warning("not registered for `flodl ps` / `flodl status`: %s", exc)
        # Every signal goes to the controller, which counts them itself (its supervisor's signal
        # table: the first stops in order, the next forces).
        interrupt = _interrupter(controller)
        # SIGUSR1/SIGUSR2 go on to the ranks; an every-node run's scheduler signals every node's
        # launcher, so each passes them to its own node's ranks only.
        forward = _Forwarder(controller, nodes, preempt)
        with StopSignals(interrupt, interrupt), ForwardedSignals(forward, also=preempt):
            result = await controller.run()
        trained = controller.training.result() if controller.training is not None else None
        if forward.preempted:
            from ..controller.preemption import preempted_verdict  # deferred: off the start path

            result = preempted_verdict(result, trained)
        return result, trained is not None and trained.interrupted
    finally:
        if registration is not None:
            registration.remove()
        if controller is not None:
            await controller.aclose()
        output.close()
        # every byte still queued is written out (off the loop) before the exit code
        for console in consoles:
            await asyncio.to_thread(console.close)
        for handler, stream in zip(handlers, previous, strict=True):
            if stream is not None:
                handler.setStream(stream)


def _interrupter(controller: Controller) -> Callable[[signal.Signals], None]:
    """``controller.interrupt`` as a stop signal calls it (with the signal's number)."""

    def interrupt(sig: signal.Signals) -> None:
        controller.interrupt(int(sig))

    return interrupt


class _Forwarder:
    """What SIGUSR1/SIGUSR2 and the preemption signal call, said in the log: the preemption signal
    to a Trainer run checkpoints and stops it (``controller.preempt``); otherwise a plain
    script's ranks get SIGUSR1/SIGUSR2 passed on (``controller.forward_signal``)."""

    def __init__(
        self, controller: Controller, nodes: EveryNode | None, preempt: signal.Signals
    ) -> None:
        self._controller = controller
        self._nodes = nodes
        self._preempt = preempt
        #: the preemption signal reached a Trainer run (its verdict is then preempted_verdict's)
        self.preempted = False

    def __call__(self, sig: signal.Signals) -> None:
        controller, nodes = self._controller, self._nodes
        if sig == self._preempt:
            from ..controller.preemption import preempt_training  # deferred: off the start path

            said = preempt_training(controller.training, int(sig))
            if said is not None:
                self.preempted = True
                log.warning("%s", said)
                return
        if sig not in FORWARDED_SIGNALS:
            log.info("%s: no Trainer run to checkpoint (yet); ignored", sig.name)
        elif nodes is not None and nodes.signals_reach_ranks:
            log.info("%s", already_delivered(sig))
        else:
            log.info("%s", controller.forward_signal(int(sig), local_only=nodes is not None))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flodl-launch``."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
    except ConfigError as exc:
        print(f"flodl-launch: error: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("flodl-launch: %(message)s"))
    root = logging.getLogger("flodl_async")
    root.handlers[:] = [handler]
    root.setLevel(
        logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    )
    root.propagate = False
    started = time.monotonic()
    nodes = args.nodes
    for note in nodes.notes if nodes is not None else ():
        log.info("note: %s", note)
    try:
        if nodes is not None and not is_controller_node(nodes):
            return run_agent_node(args, nodes)
        plan, choice = build_plan(args)
        warn_oversubscribed(plan)
        # a one-host run's ranks import torch while the controller builds (cli/earlyranks.py)
        plan = start_local_ranks(plan, fallback=choice.fallback)
        result, interrupted = run(
            _run(
                plan,
                choice,
                show_ranks=args.ranks_filter,
                routing=args.routing,
                nodes=nodes,
                preempt=args.preempt_signal,
            )
        )
    except ConfigError as exc:
        print(f"flodl-launch: error: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    except FlodlError as exc:
        print(f"flodl-launch: FAILED — {exc}", file=sys.stderr)
        return int(ExitCode.INTERNAL)
    finally:
        if nodes is not None and is_controller_node(nodes):
            forget_job_token(nodes)
        discard_all()  # early ranks no agent took (the run failed before it could)
        release()
    elapsed = time.monotonic() - started
    # The verdict line is printed under -q too: it is what -q keeps.
    line = verdict_line("flodl-launch", result, interrupted=interrupted, elapsed=elapsed)
    print(line, file=sys.stderr)
    # a traceback the console already showed is not repeated
    details = result.details_for(args.ranks_filter) if result.exit_code is not ExitCode.OK else ""
    if details:
        print(details, file=sys.stderr)
    return int(result.exit_code)


if __name__ == "__main__":
    sys.exit(main())
