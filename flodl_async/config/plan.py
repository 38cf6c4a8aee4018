"""The launch plan: everything a controller needs, resolved from the command line and the cluster
file.

Each worker of the plan carries its :class:`Placement`: how its agent comes to
exist: ``LOCAL`` on the controller's host (its agent runs inside the controller's
process, over the real join protocol on loopback), ``SSH`` on every other host
(started over ssh by :mod:`flodl_async.controller.fanout`), or ``DIAL_IN``
(``dial_in: true``: it joins on its own, with the cluster token).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..control.membership import JoinConfig
from ..deadlines import Deadlines
from ..host.hostnames import HostAliases
from .cluster import WorkerSpec

#: The port a remote worker's sshd listens on when its ``ssh.port`` is unset.
SSH_PORT = 22


class Placement(enum.Enum):
    """How a planned worker's agent comes to exist."""

    #: In the controller's own process (the controller's host).
    LOCAL = "local"
    #: Started over ssh by the launcher (:mod:`flodl_async.controller.fanout`).
    SSH = "ssh"
    #: Joins on its own, e.g. a systemd ``flodl-agent --persist``: the controller launches nothing,
    #: the window waits for it.
    DIAL_IN = "dial-in"


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacedWorker:
    """A worker of the cluster file and where its agent runs."""

    spec: WorkerSpec
    placement: Placement

    @property
    def host(self) -> str:
        """The worker's host name in the run."""
        return self.spec.host


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchPlan:
    """Everything the controller needs for one run."""

    run_id: str
    secret: bytes = field(repr=False)
    bind_host: str
    port: int
    join: JoinConfig
    workers: tuple[PlacedWorker, ...]
    command: tuple[str, ...]
    cluster_env: Mapping[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    log_dir: Path | None = None
    deadlines: Deadlines = field(default_factory=Deadlines)
    #: The spellings of the controller's machine, read once by the launcher (None: names are
    #: compared as given).
    host_aliases: HostAliases | None = None
    #: The cluster token that admits dial-in agents to the join channel (None: token admission is
    #: off).
    token: bytes | None = field(default=None, repr=False)
    #: The embedded one-host cluster of ``--nproc``: one banner line; the join window's progress
    #: only under ``-v``.
    one_host: bool = False
    #: ``--hang-timeout``: a rank with neither output nor CPU progress this long ends the run (None:
    #: off).
    hang_timeout: float | None = None

    @property
    def local_hosts(self) -> frozenset[str]:
        """Hosts whose agent runs in the controller's process."""
        return frozenset(w.host for w in self.workers if w.placement is Placement.LOCAL)


def direct_ssh_targets(workers: Iterable[PlacedWorker]) -> list[tuple[str, int]]:
    """Address and port of each ssh worker the launcher reaches directly (not tunnelled), in
    order (where the controller's own host looks for its ranks' interface:
    :func:`flodl_async.host.ifnames.controller_host_peer`)."""
    return [
        ((w.spec.ssh and w.spec.ssh.target) or w.host, (w.spec.ssh and w.spec.ssh.port) or SSH_PORT)
        for w in workers
        if w.placement is Placement.SSH and not w.spec.tunnel
    ]
