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
import logging
import secrets
import shutil
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .agent import RankOutput, detect_gpu_count
from .cluster import (
    DEFAULT_PORT,
    ClusterSpec,
    ControllerSpec,
    DeviceKind,
    DeviceSpec,
    JoinKnobs,
    WorkerSpec,
    is_local_host,
    load_cluster,
)
from .console import ConsoleWriter
from .controller import Controller
from .deadlines import DEFAULT_STOP_GRACE, Deadlines
from .devices import parse_devices
from .errors import ConfigError, FlodlError, PortInUseError
from .hostnames import HostAliases
from .plan import LaunchPlan, PlacedWorker, Placement
from .secretfile import load_or_create_secret, read_token_file
from .verdict import ExitCode, RunResult, exit_help
from .wire.keys import new_session_secret

log = logging.getLogger("flodl_async.launch")

EPILOG = """\
examples:
  flodl-launch --nproc 2 -- python examples/train.py
  flodl-launch --nproc 4 --devices cpu --max-restarts 2 --log-dir logs -- python train.py --epochs 3
  flodl-launch cluster.yml -- python train.py

""" + exit_help()


@dataclass(frozen=True, slots=True, kw_only=True)
class _Args:
    cluster: str | None
    nproc: int | None
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flodl-launch",
        usage="flodl-launch [options] (--nproc N | CLUSTER.yml) -- CMD [ARGS ...]",
        description="Launch a distributed PyTorch job: every rank runs CMD with the torchrun environment.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("cluster", nargs="?", help="cluster file (omit it and give --nproc for one host)")
    parser.add_argument("--nproc", type=int, help="ranks on this host (the embedded one-host cluster)")
    parser.add_argument("--devices", default="auto", help="with --nproc: cpu, all (GPUs), GPU ids like 0,1, or auto (GPUs if present; default)")
    parser.add_argument("--port", type=int, help=f"the controller port (default {DEFAULT_PORT}, or the cluster file's; 0 picks a free one)")
    parser.add_argument("--max-restarts", type=int, default=0, help="restart the whole world up to K times after a rank failure (default 0)")
    parser.add_argument(
        "--log-dir",
        type=Path,
        help="also write every rank's output, from every host, to DIR/RUN_ID/attempt_N/RANK/{stdout,stderr}.log (torchrun's layout)",
    )
    parser.add_argument(
        "--local-ranks-filter",
        metavar="RANKS",
        help="show only these ranks' output on the console, e.g. 0,1 (log files still get every rank)",
    )
    parser.add_argument("--run-id", help="run id (TORCHELASTIC_RUN_ID; default: random)")
    parser.add_argument(
        "--stop-grace",
        type=float,
        default=DEFAULT_STOP_GRACE,
        help=f"seconds from the first stop signal to KILL when stopping ranks (default {DEFAULT_STOP_GRACE:g})",
    )
    parser.add_argument(
        "--secret-file",
        help="read the session secret from this file (it must be yours, mode 0600), or write a new one there (0600) for flodl-agent",
    )
    parser.add_argument(
        "--token-file",
        help="admit dial-in agents holding this cluster token (`flodl token new PATH`; yours, mode 0600); overrides controller.token_file",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="only rank output and the verdict")
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
    ns = parser.parse_args(ours)  # --help and argparse's own errors exit here (code 2)
    if not command:
        raise ConfigError("missing the command to run: put it after `--`, e.g. flodl-launch --nproc 2 -- python train.py")
    if (ns.cluster is None) == (ns.nproc is None):
        raise ConfigError("give either --nproc N (one host) or a cluster file, not both and not neither")
    if ns.nproc is not None and ns.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1 (got {ns.nproc})")
    if ns.port is not None and not 0 <= ns.port <= 65535:
        raise ConfigError(f"--port must be 0..65535 (got {ns.port})")
    if ns.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be 0 or more (got {ns.max_restarts})")
    if ns.stop_grace < 0:
        raise ConfigError(f"--stop-grace must be 0 or more seconds (got {ns.stop_grace})")
    if ns.quiet and ns.verbose:
        raise ConfigError("--quiet and --verbose contradict each other; pick one")
    ranks_filter = _ranks_filter(ns.local_ranks_filter)
    if "/" not in command[0] and shutil.which(command[0]) is None:
        raise ConfigError(f"command not found: {command[0]!r} (is it on PATH?)")
    return _Args(
        cluster=ns.cluster,
        nproc=ns.nproc,
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
    )


def embedded_devices(nproc: int, devices: str, gpu_count: int) -> DeviceSpec:
    """``--nproc`` with ``--devices`` → the one host's devices (the devices mini-language, plus ``auto``)."""
    choice = devices.strip()
    if choice == "auto":
        choice = "all" if gpu_count > 0 else "cpu"
    try:
        spec = parse_devices(choice, bare_cpu_ranks=nproc)
    except ConfigError as exc:
        raise ConfigError(f"--devices: {exc} (or auto)") from None
    if spec.kind is DeviceKind.ALL_GPUS:
        if gpu_count < nproc:
            raise ConfigError(f"--nproc {nproc} with --devices all needs {nproc} GPUs, this host has {gpu_count}; use --devices cpu")
        return DeviceSpec.gpus(tuple(range(nproc)))
    count = spec.known_count
    if count != nproc:
        raise ConfigError(f"--devices gives {count} rank(s) but --nproc is {nproc}; one rank per device")
    return spec


def build_plan(args: _Args) -> LaunchPlan:
    """Resolve the arguments (and cluster file) into a launch plan, or raise :class:`ConfigError`."""
    deadlines = Deadlines.resolve(stop_grace=args.stop_grace)
    gpu_count = detect_gpu_count()
    aliases = this_machine()
    spec: ClusterSpec
    if args.nproc is not None:
        worker = WorkerSpec(host=socket.gethostname(), devices=embedded_devices(args.nproc, args.devices, gpu_count))
        spec = ClusterSpec(controller=_embedded_controller(), workers=(worker,), source="--nproc")
    else:
        assert args.cluster is not None
        spec = load_cluster(args.cluster, local_names=aliases.names)
    local = aliases.names
    # `devices: all` counts this machine's GPUs only on this machine; another host's agent reports its own at join.
    reported = frozenset(w.host for w in spec.workers if w.devices.known_count is None and placement_of(w, local) is not Placement.LOCAL)
    capacity = sum(w.devices.known_count if w.devices.known_count is not None else 0 if w.host in reported else gpu_count for w in spec.workers)
    join = spec.controller.join.resolve(capacity, scale=deadlines.scale, reported_hosts=reported)
    secret = _session_secret(args.secret_file)
    token = _cluster_token(args.token_file, spec)
    return LaunchPlan(
        run_id=args.run_id or f"flodl-{secrets.token_hex(4)}",
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
    )


def _cluster_token(flag: str | None, spec: ClusterSpec) -> bytes | None:
    """The token of ``--token-file``, else of ``controller.token_file`` (relative to the cluster file), else None."""
    if flag is not None:
        return read_token_file(flag)
    if spec.controller.token_file is None:
        return None
    path = Path(spec.controller.token_file).expanduser()
    if not path.is_absolute():
        path = Path(spec.source).parent / path
    return read_token_file(path)


def placement_of(worker: WorkerSpec, local_names: frozenset[str]) -> Placement:
    """A dial-in worker joins on its own; the controller's own host runs in-process; every other host is started over ssh."""
    if worker.dial_in:
        return Placement.DIAL_IN
    return Placement.LOCAL if is_local_host(worker.host, local_names) else Placement.SSH


def this_machine() -> HostAliases:
    """This machine's spellings: its hostname, and its FQDN as the resolver has it (``/etc/hosts`` first, as a rule)."""
    return HostAliases.of_machine(socket.gethostname(), socket.getfqdn())


def _ranks_filter(raw: str | None) -> frozenset[int] | None:
    """``--local-ranks-filter 0,1`` → {0, 1}; None shows every rank."""
    if raw is None:
        return None
    ranks: set[int] = set()
    for item in raw.split(","):
        number = item.strip()
        if not number.isdigit():
            raise ConfigError(f"--local-ranks-filter takes rank numbers separated by commas, like 0,1 (got {raw!r})")
        ranks.add(int(number))
    return frozenset(ranks)


def _embedded_controller() -> ControllerSpec:
    # One host, no file: the window closes the moment the local agent is in.
    return ControllerSpec(host="127.0.0.1", port=DEFAULT_PORT, join=JoinKnobs(join_timeout=60.0))


def _session_secret(path: str | None) -> bytes:
    """A fresh secret; with ``--secret-file``, the one in that file (refused unless private), or a fresh one written there (0600)."""
    if path is None:
        return new_session_secret()
    return load_or_create_secret(path, new_session_secret())


async def _run(plan: LaunchPlan, *, show_ranks: frozenset[int] | None = None) -> RunResult:
    # Rank output goes through writer threads: a console nobody reads must not stall the loop (heartbeats, status).
    consoles = (ConsoleWriter(sys.stdout.buffer, name="stdout"), ConsoleWriter(sys.stderr.buffer, name="stderr"))
    # Our own log lines go through the same stderr writer: in order with the ranks' stderr, and never blocking either.
    handlers = [h for h in logging.getLogger("flodl_async").handlers if isinstance(h, logging.StreamHandler)]
    previous = [h.setStream(consoles[1].text()) for h in handlers]
    output = RankOutput(stdout=consoles[0], stderr=consoles[1], log_dir=plan.log_dir, run_id=plan.run_id, show_ranks=show_ranks)
    controller = Controller(plan, output=output)
    try:
        await controller.bind()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, controller.interrupt, int(sig))
        try:
            return await controller.run()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
    finally:
        await controller.aclose()
        output.close()
        for console in consoles:  # every byte still queued is written out (off the loop) before the exit code
            await asyncio.to_thread(console.close)
        for handler, stream in zip(handlers, previous, strict=True):
            if stream is not None:
                handler.setStream(stream)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flodl-launch``."""
    from .net.loop import run

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
    root.setLevel(logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO)
    root.propagate = False
    started = time.monotonic()
    try:
        plan = build_plan(args)
        log.info("run %s: %s", plan.run_id, " ".join(plan.command))
        result = run(_run(plan, show_ranks=args.ranks_filter))
    except (ConfigError, PortInUseError) as exc:
        print(f"flodl-launch: error: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    except FlodlError as exc:
        print(f"flodl-launch: FAILED — {exc}", file=sys.stderr)
        return int(ExitCode.INTERNAL)
    elapsed = time.monotonic() - started
    if result.exit_code is ExitCode.OK:
        if not args.quiet:
            print(f"flodl-launch: done — {result.reason} ({elapsed:.1f}s)", file=sys.stderr)
    else:
        print(f"flodl-launch: FAILED — {result.reason} ({elapsed:.1f}s)", file=sys.stderr)
        if result.details:
            print(result.details, file=sys.stderr)
    return int(result.exit_code)


if __name__ == "__main__":
    sys.exit(main())
