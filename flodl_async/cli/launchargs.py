"""``flodl-launch``'s command line: its options (torchrun's spellings among them), checked before
anything starts.

Every mistake is a :class:`~flodl_async.errors.ConfigError` (one line, exit 2); argparse's own
usage errors and ``--help`` exit from here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .._version import __version__
from ..config.addr import DEFAULT_PORT
from ..config.argtypos import HintingParser, hyphenate
from ..config.command import launch_command, resolves_python
from ..config.everynode import EveryNode, NodeFlags, resolve_nodes, under_slurm
from ..config.streams import StreamRouting, parse_stream_set
from ..deadlines import DEFAULT_STOP_GRACE
from ..errors import ConfigError
from ..net.signals import DEFAULT_PREEMPT_SIGNAL, PREEMPT_SIGNAL_VAR, preempt_signal
from ..verdict import exit_help

EPILOG = """\
examples:
  flodl-launch --nproc 2 -- python examples/train.py
  CUDA_VISIBLE_DEVICES=2,3 flodl-launch --nproc auto -- python train.py  # a rank on GPU 2 and on 3
  flodl-launch --nproc 2 --devices 0,2 --local-ranks-filter 0 -- python train.py
  flodl-launch --nproc 4 --devices cpu --max-restarts 2 --log-dir logs -- python train.py --epochs 3
  flodl-launch cluster.yml -- python train.py
  flodl-launch --nproc-per-node gpu -- -m pkg.train           # python -m pkg.train, a rank per GPU
  flodl-launch --nproc 2 --log-dir logs --redirects 3 --tee 0:3 -- python train.py
  flodl-launch --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29400 --token-file ~/token \
      -- python train.py                                      # the same on node 1, --node-rank 1

""" + exit_help()


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchArgs:
    """``flodl-launch``'s command line, checked."""

    cluster: str | None
    nproc: int | str | None  # a count, or "auto", "gpu", "cpu"
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
    #: --no-python: the command runs as it is (a leading `python` is not resolved per host)
    no_python: bool = False
    #: --redirects/--tee (None: neither given)
    routing: StreamRouting | None = None
    #: --nnodes: one node of an every-node run (None: any other run)
    nodes: EveryNode | None = None
    #: --preempt-signal / FLODL_PREEMPT_SIGNAL: a Trainer run checkpoints and stops on it (exit 7)
    preempt_signal: signal.Signals = DEFAULT_PREEMPT_SIGNAL


def _parser() -> argparse.ArgumentParser:
    parser = HintingParser(
        prog="flodl-launch",
        usage="flodl-launch [options] (--nproc N | CLUSTER.yml | --nnodes N ...) -- CMD [ARGS ...]",
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
        help="ranks on this host (the embedded one-host cluster): a number, auto (the visible "
        "GPUs, else the cores), gpu (one per visible GPU) or cpu (one CPU rank per core)",
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
        help=f"the controller port, kept strictly (default {DEFAULT_PORT}, or the cluster file's; "
        "a taken default gives way to a free port unless dial-in agents need it; 0 picks a free "
        "one)",
    )
    parser.add_argument(
        "--no-python",
        action="store_true",
        help="run the command as it is: a leading python is not made each host's python:",
    )
    parser.add_argument(
        "--run-path",
        action="store_true",
        help="the command is a Python file's path and its arguments (python PATH ARGS)",
    )
    parser.add_argument(
        "--redirects",
        metavar="STD",
        help="with --log-dir: these streams go to the log files only (torchrun's: 0 none, 1 "
        "stdout, 2 stderr, 3 both, or per rank like 0:3,1:1)",
    )
    parser.add_argument(
        "--tee",
        metavar="STD",
        help="with --log-dir: these streams go to the log files and the console (values as "
        "--redirects); with either, the files hold only the streams they name",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="K restarts, counted over the whole run (default 0: none). A plain script: restart "
        "the whole world after a rank failure. A Trainer run (CPU backend): restart the rank lost "
        "to a crash alone, the others training on, and it rejoins at a round boundary (a frozen "
        "rank, once KILLed, too; a liar not; COLLECTIVE restarts none)",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        help="also write every rank's output, from every host, to "
        "DIR/RUN_ID/attempt_N/RANK/{stdout,stderr}.log (torchrun's layout; a run id used before "
        "adds the next attempt)",
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
    nodes = parser.add_argument_group(
        "every node runs this command (torchrun's multi-node options; PET_* variables fill in "
        "what they leave out)"
    )
    nodes.add_argument(
        "--nnodes", help="nodes in the run: N, or MIN:MAX (wait for MIN, take up to MAX)"
    )
    nodes.add_argument(
        "--node-rank",
        help="this node's rank (0 runs the controller); default: PET_NODE_RANK, "
        "JOB_COMPLETION_INDEX, else the node holding --rdzv-endpoint's address is the controller",
    )
    nodes.add_argument(
        "--rdzv-endpoint", metavar="HOST:PORT", help="node 0's address, where the nodes meet"
    )
    nodes.add_argument("--rdzv-id", help="the run id (TORCHELASTIC_RUN_ID), as --run-id")
    nodes.add_argument(
        "--rdzv-backend", help="accepted and ignored (nodes meet at node 0's controller)"
    )
    nodes.add_argument("--master-addr", help="node 0's address, without --rdzv-endpoint")
    nodes.add_argument("--master-port", help="node 0's port, with --master-addr (default 29500)")
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="only rank output and the verdict"
    )
    parser.add_argument(
        "--preempt-signal",
        metavar="SIG",
        help="the signal that tells a Trainer run it is about to be preempted (SLURM's "
        f"--signal=USR1@60): a checkpoint at the next reduce, an orderly stop, exit 7 (default "
        f"${PREEMPT_SIGNAL_VAR}, else USR1); a plain script's ranks get SIGUSR1/SIGUSR2 passed on",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug output")
    return parser


def parse_args(argv: Sequence[str]) -> LaunchArgs:
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
    nodes = _nodes(ns)
    if nodes is not None and ns.cluster is not None:
        raise ConfigError(
            "--nnodes runs the same command on every node; a cluster file names the hosts "
            "itself: give one of them"
        )
    if ns.nnodes is not None and nodes is None and ns.nproc is None:
        ns.nproc = "1"  # torchrun's `--nnodes 1`: one host, one rank unless told
    if nodes is None and (ns.cluster is None) == (ns.nproc is None):
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
    routing = _routing(ns.redirects, ns.tee, ns.log_dir)
    command = launch_command(command, no_python=ns.no_python, run_path=ns.run_path)
    # A leading python is each host's own (its python:, else its PATH's, else ours): never missing.
    resolved = resolves_python(command) and not ns.no_python
    if not resolved and "/" not in command[0] and shutil.which(command[0]) is None:
        raise ConfigError(f"command not found: {command[0]!r} (is it on PATH?)")
    return LaunchArgs(
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
        no_python=ns.no_python,
        routing=routing,
        nodes=nodes,
        preempt_signal=_preempt_signal(ns.preempt_signal),
    )


def _preempt_signal(flag: str | None) -> signal.Signals:
    """``--preempt-signal``, else ``$FLODL_PREEMPT_SIGNAL``, else USR1 (an error names which)."""
    if flag is not None:
        return preempt_signal(flag)
    return preempt_signal(os.environ.get(PREEMPT_SIGNAL_VAR), source=PREEMPT_SIGNAL_VAR)


def _nodes(ns: argparse.Namespace) -> EveryNode | None:
    """The every-node run the options describe (or, none given, the SLURM step this task is part
    of); None for any other run."""
    nodes = resolve_nodes(
        NodeFlags(
            nnodes=ns.nnodes,
            node_rank=ns.node_rank,
            rdzv_endpoint=ns.rdzv_endpoint,
            rdzv_id=ns.rdzv_id,
            rdzv_backend=ns.rdzv_backend,
            master_addr=ns.master_addr,
            master_port=ns.master_port,
            nproc=ns.nproc,
        ),
        os.environ,
        token_file=ns.token_file,
        run_id=ns.run_id,
    )
    step_nodes = os.environ.get("SLURM_STEP_NUM_NODES", "1")
    several = step_nodes.isdigit() and int(step_nodes) > 1  # --nproc-per-node is then per node
    if (
        nodes is None
        and ns.cluster is None
        and (ns.nproc is None or several)
        and under_slurm(os.environ)
    ):
        # deferred: off the start path of every run not under SLURM (python-hostlist comes with it)
        from ..config.slurm import slurm_nodes

        flags = NodeFlags(nnodes=ns.nnodes, nproc=ns.nproc)
        nodes = slurm_nodes(flags, os.environ, run_id=ns.run_id, token_file=ns.token_file)
    return nodes


def _routing(redirects: str | None, tee: str | None, log_dir: Path | None) -> StreamRouting | None:
    """``--redirects``/``--tee`` → where each rank's streams go; they need ``--log-dir``."""
    if redirects is None and tee is None:
        return None
    if log_dir is None:
        option = "--redirects" if redirects is not None else "--tee"
        raise ConfigError(
            f"{option} sends rank output to log files: give --log-dir DIR too (the files are "
            "DIR/RUN_ID/attempt_N/RANK/{stdout,stderr}.log)"
        )
    return StreamRouting(
        redirects=parse_stream_set("--redirects", redirects or "0"),
        tee=parse_stream_set("--tee", tee or "0"),
    )


#: ``--nproc`` words (torchrun's): resolved by :func:`resolve_nproc` once the GPUs are counted.
NPROC_WORDS = ("auto", "gpu", "cpu")


def _nproc(raw: str | None) -> int | str | None:
    """``--nproc``: a rank count of at least 1, or one of :data:`NPROC_WORDS`."""
    if raw is None or raw.strip() in NPROC_WORDS:
        return None if raw is None else raw.strip()
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ConfigError(
            f"--nproc must be a number of at least 1, or auto, gpu or cpu (got {raw!r})"
        )
    return int(raw)


def resolve_nproc(nproc: int | str, gpu_count: int) -> int:
    """torchrun's words: ``gpu`` one rank per visible GPU (none is an error), ``cpu`` one per core,
    ``auto`` the GPUs if any, else the cores.

    The cores are those this process may use (its affinity; torchrun counts ``os.cpu_count()``,
    which overcounts in a container or under ``taskset``).
    """
    if nproc == "gpu":
        if gpu_count == 0:
            raise ConfigError(
                "--nproc-per-node gpu: this host shows no GPU (CUDA_VISIBLE_DEVICES, nvidia-smi); "
                "use --nproc-per-node cpu or a number"
            )
        return gpu_count
    if nproc == "cpu" or (nproc == "auto" and gpu_count == 0):
        return len(os.sched_getaffinity(0))
    if nproc == "auto":
        return gpu_count
    return int(nproc)


def nproc_devices(nproc: int | str | None, devices: str) -> str:
    """``--devices`` as ``--nproc cpu``/``gpu`` narrow it: ``auto`` becomes their kind, a contrary
    choice is an error."""
    choice = devices.strip()
    if nproc not in ("cpu", "gpu"):
        return choice
    wanted = "cpu" if nproc == "cpu" else "all"
    if choice == "auto":
        return wanted
    if (choice == "cpu" or choice.startswith("cpu:")) != (nproc == "cpu"):
        raise ConfigError(
            f"--nproc-per-node {nproc} with --devices {choice}: pick one kind of device (drop "
            "--devices, or give --nproc a number)"
        )
    return choice


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
