"""The cluster file (``cluster.yml``), parsed into frozen specs with errors that point at the line.

Shape (all keys optional unless marked)::

    controller:
      host: 10.0.0.1          # address agents dial (default 127.0.0.1)
      port: 1337              # the one port (strict when given; 0: a free one)
      join: {min_rank_start, join_timeout, target_ranks, max_join_timeout, open_admission}
      token_file: PATH        # cluster token (`flodl token new`): admits dial-in agents
    env: {NAME: value}        # for every rank
    trainer: cpu              # a flodl Trainer CPU-backend job (`tunnel: true` needs it; a
                              # Trainer's own cluster= file does not: the Trainer knows)
    workers:                  # required, non-empty
      - host: node-a          # required; logical id and default ssh target
        devices: all | [0, 1] | 0,1 | cpu:4   # required (flodl_async.config.devices)
        ssh: {target, port, user, identity_file, known_hosts, options: [..]}
        tunnel: false         # reach the controller by an ssh remote forward (`trainer: cpu`)
        env: {NAME: value}    # this host's ranks; overrides the cluster env
        python: /usr/bin/python3
        workdir: /srv/train
        nccl_socket_ifname: eth0
        dial_in: false        # true: it joins itself (flodl-agent --token-file F --persist)

A relative path in the file (``token_file``, ``ssh.identity_file`` and ``ssh.known_hosts``, which
the launcher reads; ``python`` and ``workdir`` of a worker on this machine) is relative to the
file's directory, wherever the launcher is started; a remote worker's ``python`` and ``workdir``
are that host's (relative: to its ssh login directory).

A top-level ``cluster:`` wrapper (flodl's layout) is accepted too. Every
error names the file, line and key, says what was expected, and suggests the
closest valid key for a typo.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..control.membership import JoinConfig
from ..errors import ConfigError
from ..host.hostnames import HostAliases, names_this_machine
from .addr import DEFAULT_PORT
from .devices import EXPECTED as DEVICES_EXPECTED
from .devices import DeviceKind, DeviceSpec, parse_devices, parse_gpu_ids
from .rankenv import TORCHRUN_CONTRACT
from .sshopts import option_error as ssh_option_error
from .yamlnodes import (
    NodeDoc,
    mapping,
    read_bool,
    read_int,
    read_seconds,
    read_str,
    scalar,
    show_node,
)

# The device types live in flodl_async.config.devices and the default port in
# flodl_async.config.addr; re-exported so `from flodl_async.config.cluster import DeviceSpec`
# (or DEFAULT_PORT) keeps working.
__all__ = [
    "DEFAULT_JOIN_TIMEOUT",
    "DEFAULT_MAX_JOIN_TIMEOUT",
    "DEFAULT_PORT",
    "RESERVED_ENV",
    "RESERVED_ENV_PREFIXES",
    "ClusterSpec",
    "ControllerSpec",
    "DeviceKind",
    "DeviceSpec",
    "JoinKnobs",
    "SshSpec",
    "WorkerSpec",
    "is_local_host",
    "load_cluster",
    "local_host_names",
    "parse_cluster",
    "parse_gpu_ids",
]

DEFAULT_JOIN_TIMEOUT = 300.0
DEFAULT_MAX_JOIN_TIMEOUT = 600.0

_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Set by the launcher for every rank (device placement and the torchrun contract); a cluster file
#: may not override them.
RESERVED_ENV = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "GPU_DEVICE_ORDINAL",
        *TORCHRUN_CONTRACT,
    }
    # a tuning knob users may set; the launcher only defaults it
) - {"TORCH_NCCL_ASYNC_ERROR_HANDLING"}
RESERVED_ENV_PREFIXES = ("FLODL_", "TORCHELASTIC_")


@dataclass(frozen=True, slots=True, kw_only=True)
class SshSpec:
    """How to reach a worker over ssh."""

    target: str | None = None
    port: int | None = None
    user: str | None = None
    identity_file: str | None = None
    known_hosts: str | None = None
    options: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class JoinKnobs:
    """The join window knobs as written; unset ones take capacity-derived defaults."""

    min_rank_start: int | None = None
    join_timeout: float | None = None
    target_ranks: int | None = None
    max_join_timeout: float | None = None
    open_admission: bool = False

    def resolve(
        self, capacity: int, *, scale: float = 1.0, reported_hosts: frozenset[str] = frozenset()
    ) -> JoinConfig:
        """Seed defaults: quorum and target default to the configured capacity; the cap covers the
        window.

        ``reported_hosts`` are planned hosts whose capacity only their agent knows (a remote
        ``devices: all``): not in ``capacity``, a defaulted quorum or target adds what each reports
        at join.
        """
        join_timeout = self.join_timeout if self.join_timeout is not None else DEFAULT_JOIN_TIMEOUT
        max_join = (
            self.max_join_timeout
            if self.max_join_timeout is not None
            else max(DEFAULT_MAX_JOIN_TIMEOUT, join_timeout)
        )
        # with a host still to report, capacity may be that host's alone
        floor = 0 if reported_hosts else 1
        min_start = self.min_rank_start if self.min_rank_start is not None else max(capacity, floor)
        quorum_reported = reported_hosts if self.min_rank_start is None else frozenset()
        target_reported = reported_hosts if self.target_ranks is None else frozenset()
        # A reported target is never below the quorum either: the window takes the larger
        # (JoinWindow.target).
        target = (
            self.target_ranks
            if self.target_ranks is not None
            else capacity
            if target_reported
            else max(capacity, min_start)
        )
        return JoinConfig(
            min_rank_start=min_start,
            join_timeout=join_timeout * scale,
            target_ranks=target,
            max_join_timeout=max_join * scale,
            open_admission=self.open_admission,
            quorum_reported=quorum_reported,
            target_reported=target_reported,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ControllerSpec:
    """Where the controller listens and how its join window behaves."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    join: JoinKnobs = field(default_factory=JoinKnobs)
    #: The file names its port (kept strictly); False: the default, which may give way to a free
    #: one when taken (``flodl_async.cli.launch.port_choice``).
    port_explicit: bool = False
    #: The cluster token file that admits dial-in agents (as written in the file; relative to the
    #: cluster file's directory).
    token_file: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSpec:
    """One worker host."""

    host: str
    devices: DeviceSpec
    ssh: SshSpec | None = None
    tunnel: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    python: str | None = None
    workdir: str | None = None
    nccl_socket_ifname: str | None = None
    #: The host joins on its own (a ``flodl-agent --token-file … --persist`` service): the launcher
    #: starts nothing there.
    dial_in: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec:
    """A whole cluster file."""

    controller: ControllerSpec
    workers: tuple[WorkerSpec, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    #: ``trainer: cpu``: the script is a Trainer CPU-backend job, whose ranks talk only to the
    #: controller (so a tunnel carries all of it); None for a plain torchrun-contract script.
    trainer: str | None = None
    source: str = "<cluster>"

    @property
    def capacity(self) -> int | None:
        """Total configured ranks, or None while some host says ``devices: all``."""
        total = 0
        for worker in self.workers:
            count = worker.devices.known_count
            if count is None:
                return None
            total += count
        return total

    def bind_host(self, local_names: frozenset[str] | None = None) -> str:
        """Loopback-only when every worker is local or tunneled; otherwise every interface."""
        names = local_names if local_names is not None else local_host_names()
        if all(w.tunnel or is_local_host(w.host, names) for w in self.workers):
            return "127.0.0.1"
        return "0.0.0.0"


def local_host_names() -> frozenset[str]:
    """Names that mean this machine (no DNS lookups; the launcher adds the FQDN):
    :class:`HostAliases`."""
    # gethostname() without importing socket into this pure module
    return HostAliases.of_machine(os.uname().nodename).names


def is_local_host(host: str, local_names: frozenset[str]) -> bool:
    """True when ``host`` names this machine: one of ``local_names`` (any case) or a loopback
    address."""
    return names_this_machine(host, local_names)


# ----- parsing -----------------------------------------------------------------------------


def _env(doc: NodeDoc, node: yaml.Node, path: str) -> dict[str, str]:
    if isinstance(node, yaml.ScalarNode) and scalar(node) is None:
        return {}
    if not isinstance(node, yaml.MappingNode):
        raise doc.error(node, path, "expected a mapping of variable names to values")
    out: dict[str, str] = {}
    for key_node, value_node in node.value:
        key = scalar(key_node)
        key_path = f"{path}.{key}"
        if not isinstance(key, str) or not _ENV_KEY.match(key):
            raise doc.error(
                key_node, key_path, "environment variable names must match [A-Za-z_][A-Za-z0-9_]*"
            )
        if key in RESERVED_ENV or key.startswith(RESERVED_ENV_PREFIXES):
            raise doc.error(
                key_node,
                key_path,
                f"{key} is reserved: the launcher sets it for every rank (device placement and the "
                "torchrun contract); remove it from env",
            )
        value = scalar(value_node) if isinstance(value_node, yaml.ScalarNode) else None
        if type(value) not in (str, int, float):
            raise doc.error(
                value_node,
                key_path,
                f"expected a string value, got {show_node(value_node)}; quote it",
            )
        out[key] = str(value)
    return out


def _devices(doc: NodeDoc, node: yaml.Node, path: str) -> DeviceSpec:
    if isinstance(node, yaml.SequenceNode):
        ids: list[int] = []
        for i, item in enumerate(node.value):
            gpu = read_int(doc, item, f"{path}[{i}]", minimum=0, maximum=255)
            if gpu in ids:
                raise doc.error(
                    item,
                    f"{path}[{i}]",
                    f"GPU {gpu} listed twice — each rank must pin a distinct GPU",
                )
            ids.append(gpu)
        if not ids:
            raise doc.error(node, path, "expected at least one GPU id")
        return DeviceSpec(kind=DeviceKind.GPU_LIST, gpu_ids=tuple(ids))
    value = scalar(node) if isinstance(node, yaml.ScalarNode) else None
    if type(value) is int:  # `devices: 0` is one GPU id, as `devices: "0"` is
        value = str(value)
    if isinstance(value, str):
        try:
            return parse_devices(value)
        except ConfigError as exc:
            raise doc.error(node, path, str(exc)) from None
    raise doc.error(
        node, path, f"{DEVICES_EXPECTED}, or a list of GPU ids like [0, 1]; got {show_node(node)}"
    )


_TOP_KEYS = ("controller", "workers", "env", "trainer")
#: The values `trainer:` takes (only the CPU backend rides a tunnel).
TRAINERS = ("cpu",)
_CONTROLLER_KEYS = ("host", "port", "join", "token_file")
_JOIN_KEYS = (
    "min_rank_start",
    "join_timeout",
    "target_ranks",
    "max_join_timeout",
    "open_admission",
)
_WORKER_KEYS = (
    "host",
    "devices",
    "ssh",
    "tunnel",
    "env",
    "python",
    "workdir",
    "nccl_socket_ifname",
    "dial_in",
)
_SSH_KEYS = ("target", "port", "user", "identity_file", "known_hosts", "options")


def _join_knobs(doc: NodeDoc, node: yaml.Node, path: str) -> JoinKnobs:
    keys = mapping(doc, node, path, _JOIN_KEYS)
    knobs = JoinKnobs(
        min_rank_start=read_int(doc, keys["min_rank_start"], f"{path}.min_rank_start", minimum=1)
        if "min_rank_start" in keys
        else None,
        join_timeout=read_seconds(doc, keys["join_timeout"], f"{path}.join_timeout")
        if "join_timeout" in keys
        else None,
        target_ranks=read_int(doc, keys["target_ranks"], f"{path}.target_ranks", minimum=1)
        if "target_ranks" in keys
        else None,
        max_join_timeout=read_seconds(doc, keys["max_join_timeout"], f"{path}.max_join_timeout")
        if "max_join_timeout" in keys
        else None,
        open_admission=read_bool(doc, keys["open_admission"], f"{path}.open_admission")
        if "open_admission" in keys
        else False,
    )
    if (
        knobs.min_rank_start is not None
        and knobs.target_ranks is not None
        and knobs.target_ranks < knobs.min_rank_start
    ):
        raise doc.error(
            keys["target_ranks"],
            f"{path}.target_ranks",
            f"must be at least min_rank_start ({knobs.min_rank_start})",
        )
    if (
        knobs.join_timeout is not None
        and knobs.max_join_timeout is not None
        and knobs.max_join_timeout < knobs.join_timeout
    ):
        raise doc.error(
            keys["max_join_timeout"],
            f"{path}.max_join_timeout",
            f"must be at least join_timeout ({knobs.join_timeout:g}s)",
        )
    return knobs


def _ssh(doc: NodeDoc, node: yaml.Node, path: str) -> SshSpec:
    keys = mapping(doc, node, path, _SSH_KEYS)
    options: tuple[str, ...] = ()
    if "options" in keys:
        opt_node = keys["options"]
        if not isinstance(opt_node, yaml.SequenceNode):
            raise doc.error(
                opt_node,
                f"{path}.options",
                "expected a list of ssh options like [ProxyJump=bastion]",
            )
        options = tuple(
            read_str(doc, item, f"{path}.options[{i}]") for i, item in enumerate(opt_node.value)
        )
        for i, (item, option) in enumerate(zip(opt_node.value, options, strict=True)):
            if (problem := ssh_option_error(option)) is not None:
                raise doc.error(item, f"{path}.options[{i}]", problem)

    def optional_str(key: str) -> str | None:
        return read_str(doc, keys[key], f"{path}.{key}") if key in keys else None

    return SshSpec(
        target=optional_str("target"),
        port=read_int(doc, keys["port"], f"{path}.port", minimum=1, maximum=65535)
        if "port" in keys
        else None,
        user=optional_str("user"),
        identity_file=doc.path(optional_str("identity_file")),
        known_hosts=doc.path(optional_str("known_hosts")),
        options=options,
    )


def _worker(doc: NodeDoc, node: yaml.Node, path: str) -> WorkerSpec:
    keys = mapping(doc, node, path, _WORKER_KEYS)
    for required in ("host", "devices"):
        if required not in keys:
            raise doc.error(node, path, f"missing required key {required!r}")

    def optional_str(key: str) -> str | None:
        return read_str(doc, keys[key], f"{path}.{key}") if key in keys else None

    return WorkerSpec(
        host=read_str(doc, keys["host"], f"{path}.host"),
        devices=_devices(doc, keys["devices"], f"{path}.devices"),
        ssh=_ssh(doc, keys["ssh"], f"{path}.ssh") if "ssh" in keys else None,
        tunnel=read_bool(doc, keys["tunnel"], f"{path}.tunnel") if "tunnel" in keys else False,
        env=_env(doc, keys["env"], f"{path}.env") if "env" in keys else {},
        python=optional_str("python"),
        workdir=optional_str("workdir"),
        nccl_socket_ifname=optional_str("nccl_socket_ifname"),
        dial_in=read_bool(doc, keys["dial_in"], f"{path}.dial_in") if "dial_in" in keys else False,
    )


def parse_cluster(
    text: str,
    *,
    source: str = "<cluster>",
    local_names: frozenset[str] | None = None,
    base_dir: Path | None = None,
    backend_known: bool = False,
) -> ClusterSpec:
    """Parse and validate cluster-file text; every problem raises :class:`ConfigError`.

    ``base_dir``: where the file's relative paths start (its directory; None: as written).
    ``backend_known``: the caller is a Trainer launcher, which knows its backend and checks a
    ``tunnel: true`` against it, so the file need not say ``trainer: cpu``.
    """
    doc = NodeDoc(source, base_dir)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}{line}: not valid YAML: {exc.problem or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    if root is None:
        raise ConfigError(f"{source}: the file is empty; it needs at least a `workers:` list")
    if (
        isinstance(root, yaml.MappingNode)
        and len(root.value) == 1
        and scalar(root.value[0][0]) == "cluster"
    ):
        root = root.value[0][1]
    top = mapping(doc, root, "", _TOP_KEYS)
    controller = ControllerSpec()
    if "controller" in top:
        ckeys = mapping(doc, top["controller"], "controller", _CONTROLLER_KEYS)
        controller = ControllerSpec(
            host=read_str(doc, ckeys["host"], "controller.host")
            if "host" in ckeys
            else "127.0.0.1",
            port=read_int(doc, ckeys["port"], "controller.port", minimum=0, maximum=65535)
            if "port" in ckeys
            else DEFAULT_PORT,
            port_explicit="port" in ckeys,
            join=_join_knobs(doc, ckeys["join"], "controller.join")
            if "join" in ckeys
            else JoinKnobs(),
            token_file=doc.path(read_str(doc, ckeys["token_file"], "controller.token_file"))
            if "token_file" in ckeys
            else None,
        )
    if "workers" not in top:
        raise doc.error(root, "", "missing required key 'workers' (a list of worker hosts)")
    workers_node = top["workers"]
    if not isinstance(workers_node, yaml.SequenceNode) or not workers_node.value:
        raise doc.error(workers_node, "workers", "expected a non-empty list of workers")
    names = local_names if local_names is not None else local_host_names()
    workers: list[WorkerSpec] = []
    for i, item in enumerate(workers_node.value):
        worker = _worker(doc, item, f"workers[{i}]")
        if not worker.dial_in and is_local_host(worker.host, names):
            worker = _on_this_machine(doc, worker)
        for j, earlier in enumerate(workers):
            if earlier.host == worker.host:
                raise doc.error(
                    item,
                    f"workers[{i}].host",
                    f"host {worker.host!r} is listed twice; give each host one entry",
                )
            if is_local_host(earlier.host, names) and is_local_host(worker.host, names):
                raise doc.error(
                    item,
                    f"workers[{i}].host",
                    f"host {worker.host!r} is this machine, which workers[{j}] (line "
                    f"{workers_node.value[j].start_mark.line + 1}) already lists "
                    f"as {earlier.host!r}; one machine is one worker — give it one entry with all "
                    "its devices",
                )
        workers.append(worker)
    spec = ClusterSpec(
        controller=controller,
        workers=tuple(workers),
        env=_env(doc, top["env"], "env") if "env" in top else {},
        trainer=_trainer(doc, top["trainer"]) if "trainer" in top else None,
        source=source,
    )
    _validate_topology(doc, spec, workers_node, names, backend_known=backend_known)
    return spec


def _on_this_machine(doc: NodeDoc, worker: WorkerSpec) -> WorkerSpec:
    """A worker on the launcher's machine: its ``python`` (a path, not a name ``PATH`` finds) and
    ``workdir`` are relative to the file, as the launcher's other paths are."""
    python = worker.python
    if python is not None and "/" in python:
        python = doc.path(python)
    return dataclasses.replace(worker, python=python, workdir=doc.path(worker.workdir))


def _trainer(doc: NodeDoc, node: yaml.Node) -> str:
    value = scalar(node) if isinstance(node, yaml.ScalarNode) else None
    if value not in TRAINERS:
        raise doc.error(
            node,
            "trainer",
            f"expected {' or '.join(TRAINERS)} (a flodl Trainer CPU-backend job), got "
            f"{show_node(node)}",
        )
    assert isinstance(value, str)
    return value


def _tunnel_node(node: yaml.Node) -> yaml.Node:
    """The value node of a worker's ``tunnel`` key, for the line an error points at."""
    assert isinstance(node, yaml.MappingNode)
    value: yaml.Node = next(v for k, v in node.value if scalar(k) == "tunnel")
    return value


def _validate_topology(
    doc: NodeDoc,
    spec: ClusterSpec,
    workers_node: yaml.SequenceNode,
    local_names: frozenset[str],
    *,
    backend_known: bool,
) -> None:
    controller_names = local_names | {spec.controller.host}
    for i, worker in enumerate(spec.workers):
        launched_by_us = [
            key
            for key, used in (
                ("ssh", worker.ssh is not None),
                ("tunnel", worker.tunnel),
                ("python", worker.python is not None),
            )
            if used
        ]
        if worker.dial_in and launched_by_us:
            raise doc.error(
                workers_node.value[i],
                f"workers[{i}].dial_in",
                f"worker {worker.host!r} dials in on its own, so {', '.join(launched_by_us)} (how "
                "the launcher would start it) "
                "cannot apply; drop them, or drop `dial_in: true` to have the launcher start it",
            )
        # Nothing carries these to an agent that dials in on its own: refused, not silently dropped.
        agent_side = [
            key
            for key, used in (
                ("env", bool(worker.env)),
                ("workdir", worker.workdir is not None),
                ("nccl_socket_ifname", worker.nccl_socket_ifname is not None),
            )
            if used
        ]
        if worker.dial_in and agent_side:
            raise doc.error(
                workers_node.value[i],
                f"workers[{i}].{agent_side[0]}",
                f"worker {worker.host!r} dials in on its own, so the launcher cannot give its "
                f"agent {', '.join(agent_side)}; "
                "set them where that agent starts: its environment (Environment= in its unit file, "
                "e.g. "
                "GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME for nccl_socket_ifname) and flodl-agent "
                "--workdir, and drop them here",
            )
        if not worker.tunnel:
            continue
        node = workers_node.value[i]
        if is_local_host(worker.host, controller_names):
            raise doc.error(
                node,
                f"workers[{i}].tunnel",
                f"worker {worker.host!r} sets `tunnel: true` but runs on the controller's host — "
                "there is no "
                "ssh session to carry a forward, and loopback already reaches the controller; "
                "remove the flag",
            )
        if worker.devices.is_gpu:
            raise doc.error(
                node,
                f"workers[{i}].tunnel",
                f"worker {worker.host!r} sets `tunnel: true` with GPU devices (NCCL backend); "
                "NCCL's data plane "
                "is peer-to-peer and cannot ride a controller tunnel — use `devices: cpu:N` or "
                "drop the tunnel",
            )
        if spec.trainer != "cpu" and not backend_known:
            # The launcher cannot tell a torchrun-contract script (gloo rank-to-rank traffic,
            # which no tunnel carries) from a Trainer CPU-backend one, so the file must say.
            raise doc.error(
                _tunnel_node(node),
                f"workers[{i}].tunnel",
                f"worker {worker.host!r} sets `tunnel: true`, but a tunnel carries only controller "
                "traffic, not the "
                "rank-to-rank traffic (gloo) of a torchrun-contract script; declare the run a "
                "Trainer CPU-backend job "
                "with a top-level `trainer: cpu`, or drop the tunnel",
            )


def load_cluster(
    path: str | Path, *, local_names: frozenset[str] | None = None, backend_known: bool = False
) -> ClusterSpec:
    """Read and parse a cluster file (``local_names`` and ``backend_known`` as
    :func:`parse_cluster` takes them); its relative paths are relative to its directory."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: cluster file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the cluster file: {exc}") from exc
    return parse_cluster(
        text,
        source=str(path),
        local_names=local_names,
        base_dir=Path(os.path.abspath(path)).parent,
        backend_known=backend_known,
    )
