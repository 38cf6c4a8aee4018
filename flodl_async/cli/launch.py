"""``flodl-launch``: the command line that turns arguments or a cluster file into a run.

Two forms:

    flodl-launch --nproc N [--devices cpu|all|0,1] -- CMD ARGS...   # one host, no file
    flodl-launch cluster.yml -- CMD ARGS...                          # a cluster file

Everything the user can get wrong is checked before anything starts, and is
reported in one line with exit code 2, never with a traceback.
"""

from __future__ import annotations

import argparse
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

from .._version import __version__
from ..agent import RankOutput
from ..config.addr import DEFAULT_PORT
from ..config.argtypos import HintingParser, hyphenate
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
from ..config.devices import parse_devices
from ..config.plan import LaunchPlan, PlacedWorker, Placement
from ..controller import Controller
from ..deadlines import DEFAULT_STOP_GRACE, Deadlines
from ..errors import ConfigError, FlodlError, PortInUseError, RuntimeDirError
from ..host.console import ConsoleWriter
from ..host.gpus import host_visible_gpus, select
from ..host.hostnames import HostAliases
from ..host.runs import Registration, register
from ..host.secretfile import load_or_create_secret, read_token_file
from ..net.loop import run
from ..net.signals import StopSignals
from ..verdict import ExitCode, RunResult, exit_help
from ..wire.keys import new_session_secret
from .verdictline import verdict_line

log = logging.getLogger("flodl_async.cli.launch")

EPILOG = """\
examples:
  flodl-launch --nproc 2 -- python examples/train.py
  CUDA_VISIBLE_DEVICES=2,3 flodl-launch --nproc auto -- python train.py  # a rank on GPU 2 and on 3
  flodl-launch --nproc 2 --devices 0,2 --local-ranks-filter 0 -- python train.py
  flodl-launch --nproc 4 --devices cpu --max-restarts 2 --log-dir logs -- python train.py --epochs 3
  flodl-launch cluster.yml -- python train.py

""" + exit_help()


@dataclass(frozen=True, slots=True, kw_only=True)
class _Args:
    cluster: str | None
    nproc: int | str | None  # a count, or "auto"
    devices: str
    port: int | None
    max_restarts: int
    log_dir: Path | None
    ranks_filter: frozenset[int] | None
    run_id: str | None
    quiet: bool
    verbose: bool
    stop_grace: float
    secret_file: str | None
    command: tuple[str, ...]
    token_file: str | None = None
    hang_timeout: float | None = None


def _parser() -> argparse.ArgumentParser:
    parser = HintingParser(
        prog="flodl-launch",
        usage="flodl-launch [options] (--nproc N | CLUSTER.yml) -- CMD [ARGS ...]",
        description="Launch a distributed PyTorch job: every rank runs CMD with the torchrun "
        "environment.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "cluster", nargs="?", help="cluster file (omit it and give --nproc for one host)"
    )
    parser.add_argument(
        "--nproc",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc",
        help="ranks on this host (the embedded one-host cluster): a number, or auto (the visible "
        "GPUs, else the cores)",
    )
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="accepted for torchrun habits: --nproc runs are always stand-alone",
    )
    parser.add_argument("--version", action="version", version=f"flodl-launch {__version__}")
    parser.add_argument(
        "--devices",
        default="auto",
        help="with --nproc: cpu, all (GPUs), GPU ids like 0,1, or auto (GPUs if present; default)",
    )
    parser.add_argument(
        "--port",
        type=int,
        help=f"the controller port (default {DEFAULT_PORT}, or the cluster file's; 0 picks a free "
        "one)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the whole world up to K times after a rank failure (default 0)",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        help="also write every rank's output, from every host, to "
        "DIR/RUN_ID/attempt_N/RANK/{stdout,stderr}.log (torchrun's layout)",
    )
    parser.add_argument(
        "--local-ranks-filter",
        metavar="RANKS",
        help="show only these ranks' output on the console, e.g. 0,1 (log files still get every "
        "rank)",
    )
    parser.add_argument("--run-id", help="run id (TORCHELASTIC_RUN_ID; default: random)")
    parser.add_argument(
        "--stop-grace",
        type=float,
        default=DEFAULT_STOP_GRACE,
        help="seconds from the first stop signal to KILL when stopping ranks (default "
        f"{DEFAULT_STOP_GRACE:g})",
    )
    parser.add_argument(
        "--secret-file",
        help="read the session secret from this file (it must be yours, mode 0600), or write a new "
        "one there (0600) for flodl-agent",
    )
    parser.add_argument(
        "--token-file",
        help="admit dial-in agents holding this cluster token (`flodl token new PATH`; yours, mode "
        "0600); overrides controller.token_file",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        metavar="S",
        help="end the run (exit 6, naming the rank) when a rank prints nothing and uses no CPU for "
        "S seconds (default: off)",
    )
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="only rank output and the verdict"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug output")
    return parser


def parse_args(argv: Sequence[str]) -> _Args:
    """Parse the command line; usage errors raise :class:`ConfigError`."""
    argv = list(argv)
    parser = _parser()
    if "--" in argv:
        split = argv.index("--")
        ours, command = argv[:split], tuple(argv[split + 1 :])
    else:
        ours, command = argv, ()
    # --help and argparse's own errors exit here (code 2)
    ns, stray = parser.parse_known_args(hyphenate(parser, ours))
    if stray and ns.nproc is not None and ns.cluster is not None and not command:
        # `--nproc 2 python -u train.py`: the command's own options are no typo of ours (the `--`
        # hint below)
        stray = []
    if stray and (ns.cluster is None or stray[0].startswith("-")):
        # a mistyped option of ours, not a command
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if stray or (not command and ns.cluster is not None and ns.nproc is not None):
        # `flodl-launch --nproc 2 python train.py --epochs 3`: the command was taken for our
        # arguments.
        raise ConfigError(
            f"unexpected {(stray or [ns.cluster])[0]!r}: did you forget `--` before the command? "
            "e.g. flodl-launch --nproc 2 -- python train.py"
        )
    if not command:
        raise ConfigError(
            "missing the command to run: put it after `--`, e.g. flodl-launch --nproc 2 -- python "
            "train.py"
        )
    if (ns.cluster is None) == (ns.nproc is None):
        raise ConfigError(
            "give either --nproc N (one host) or a cluster file, not both and not neither"
        )
    nproc = _nproc(ns.nproc)
    if ns.port is not None and not 0 <= ns.port <= 65535:
        raise ConfigError(f"--port must be 0..65535 (got {ns.port})")
    if ns.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be 0 or more (got {ns.max_restarts})")
    if ns.stop_grace < 0:
        raise ConfigError(f"--stop-grace must be 0 or more seconds (got {ns.stop_grace})")
    if ns.hang_timeout is not None and not ns.hang_timeout > 0:
        raise ConfigError(f"--hang-timeout must be more than 0 seconds (got {ns.hang_timeout:g})")
    if ns.quiet and ns.verbose:
        raise ConfigError("--quiet and --verbose contradict each other; pick one")
    ranks_filter = _ranks_filter(ns.local_ranks_filter)
    if "/" not in command[0] and shutil.which(command[0]) is None:
        raise ConfigError(f"command not found: {command[0]!r} (is it on PATH?)")
    return _Args(
        cluster=ns.cluster,
        nproc=nproc,
        devices=ns.devices,
        port=ns.port,
        max_restarts=ns.max_restarts,
        log_dir=ns.log_dir,
        ranks_filter=ranks_filter,
        run_id=ns.run_id,
        quiet=ns.quiet,
        verbose=ns.verbose,
        stop_grace=ns.stop_grace,
        secret_file=ns.secret_file,
        command=command,
        token_file=ns.token_file,
        hang_timeout=ns.hang_timeout,
    )


def _nproc(raw: str | None) -> int | str | None:
    """``--nproc``: a rank count of at least 1, or ``auto`` (resolved by :func:`resolve_nproc` once
    the GPUs are counted)."""
    if raw is None or raw.strip() == "auto":
        return None if raw is None else "auto"
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ConfigError(f"--nproc must be a number of at least 1, or auto (got {raw!r})")
    return int(raw)


def resolve_nproc(nproc: int | str, gpu_count: int) -> int:
    """``auto`` is torchrun's: one rank per visible GPU, else one per core this process may use."""
    if nproc != "auto":
        return int(nproc)
    return gpu_count if gpu_count > 0 else len(os.sched_getaffinity(0))


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


def build_plan(args: _Args) -> LaunchPlan:
    """Resolve the arguments (and cluster file) into a launch plan, or raise
    :class:`ConfigError`."""
    deadlines = Deadlines.resolve(stop_grace=args.stop_grace)
    visible = host_visible_gpus()
    gpu_count = len(visible)
    aliases = this_machine()
    spec: ClusterSpec
    if args.nproc is not None:
        nproc = resolve_nproc(args.nproc, gpu_count)
        worker = WorkerSpec(
            host=socket.gethostname(),
            devices=embedded_devices(nproc, args.devices, gpu_count, visible),
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
    if args.log_dir is not None and (args.log_dir / run_id).exists():
        # torchrun's layout has one directory per run: an earlier run's logs are never appended to.
        raise ConfigError(
            f"--log-dir: {args.log_dir / run_id} already holds the logs of an earlier run with run "
            f"id {run_id!r}; "
            "give another --run-id, or move that directory away"
        )
    return LaunchPlan(
        run_id=run_id,
        secret=secret,
        bind_host=spec.bind_host(local),
        port=args.port if args.port is not None else spec.controller.port,
        join=join,
        workers=tuple(PlacedWorker(spec=w, placement=placement_of(w, local)) for w in spec.workers),
        command=args.command,
        cluster_env=dict(spec.env),
        max_restarts=args.max_restarts,
        log_dir=args.log_dir,
        deadlines=deadlines,
        host_aliases=aliases,
        token=token,
        one_host=args.nproc is not None,
        hang_timeout=args.hang_timeout,
    )


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


def _ranks_filter(raw: str | None) -> frozenset[int] | None:
    """``--local-ranks-filter 0,1`` → {0, 1}; None shows every rank."""
    if raw is None:
        return None
    ranks: set[int] = set()
    for item in raw.split(","):
        number = item.strip()
        if not number.isdigit():
            raise ConfigError(
                "--local-ranks-filter takes rank numbers separated by commas, like 0,1 (got "
                f"{raw!r})"
            )
        ranks.add(int(number))
    return frozenset(ranks)


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
    """The one line a run starts with: what runs where, and where its status is."""
    command = " ".join(plan.command)
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


async def _bind(plan: LaunchPlan, output: RankOutput, *, port_fallback: bool) -> Controller:
    """The controller, bound; with ``port_fallback`` (``--nproc`` with no ``--port``) a taken port
    gives way to a free one, as torchrun --standalone does."""
    controller = Controller(plan, output=output)
    try:
        await controller.bind()
        return controller
    except PortInUseError:
        await controller.aclose()
        if not port_fallback:
            raise  # a port the user or the cluster file named is kept strictly
    controller = Controller(dataclasses.replace(plan, port=0), output=output)
    await controller.bind()
    log.warning(
        "port %d is taken (another run? see `flodl ps`); using free port %d instead",
        plan.port,
        controller.port,
    )
    return controller


async def _run(
    plan: LaunchPlan, *, show_ranks: frozenset[int] | None = None, port_fallback: bool = False
) -> tuple[RunResult, bool]:
    """The run's verdict, and whether its Trainer (if any) ended by a stop."""
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
    )
    controller: Controller | None = None
    registration: Registration | None = None
    try:
        controller = await _bind(plan, output, port_fallback=port_fallback)
        log.info("%s", banner(plan, controller.port))
        try:  # so that `flodl status` (no address) and `flodl ps` find this run
            registration = register(
                run_id=plan.run_id, address=status_host(plan.bind_host), port=controller.port
            )
        except RuntimeDirError as exc:
            log.warning("not registered for `flodl ps` / `flodl status`: %s", exc)
        # Every signal goes to the controller, which counts them itself (its supervisor's signal
        # table: the first stops in order, the next forces).
        interrupt = _interrupter(controller)
        with StopSignals(interrupt, interrupt):
            result = await controller.run()
        trained = controller.training.result() if controller.training is not None else None
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
    try:
        plan = build_plan(args)
        warn_oversubscribed(plan)
        result, interrupted = run(
            _run(
                plan,
                show_ranks=args.ranks_filter,
                port_fallback=args.nproc is not None and args.port is None,
            )
        )
    except (ConfigError, PortInUseError) as exc:
        print(f"flodl-launch: error: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    except FlodlError as exc:
        print(f"flodl-launch: FAILED — {exc}", file=sys.stderr)
        return int(ExitCode.INTERNAL)
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
