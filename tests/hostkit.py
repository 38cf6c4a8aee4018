"""Namespace hosts: K real "machines" on this one, each a network + UTS namespace with its own sshd.

A Linux bridge in the root namespace carries a private /24; the root namespace holds ``.1``
(the controller's address) and host ``i`` holds ``.(i+2)`` on a veth into the bridge. Each
host runs a real OpenSSH ``sshd`` as root, in its own UTS namespace so ``hostname`` there
names the host, with a generated ed25519 host key and one generated user key in a temp dir.
The filesystem is shared, so the same venv and checkout work on every host.

Everything this makes is named with a per-session tag so that parallel sessions on one
machine never collide, and :meth:`HostKit.close` takes it all down: every process of each
namespace (``ip netns pids``) is killed, the namespaces, the bridge and the temp dir removed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from flodl_async.host.runtime import ProcessIdentity

SSHD = "/usr/sbin/sshd"
TOOLS = ("ip", "unshare", "ssh-keygen", "ssh")


def missing_requirements() -> str | None:
    """Why namespace hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "namespace hosts need root (ip netns, a bridge, sshd)"
    if not Path(SSHD).exists():
        return f"{SSHD} is missing (apt-get install openssh-server)"
    for tool in TOOLS:
        if shutil.which(tool) is None:
            return f"{tool} is missing (apt-get install iproute2 util-linux openssh-client)"
    return None


def under_ci() -> bool:
    """``CI`` is set to a true value, as CI services set it (``CI=true``) and ``.ci/run`` makes sure of."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_namespace_hosts() -> None:
    """Skip the calling test, with the reason, when namespace hosts cannot be made here — but fail it under CI.

    On a developer's machine a missing sshd is a reason to skip. In CI it means the image
    lacks a tool `.ci/run` should have installed, and a skip there would pass every
    multi-host test without running one.
    """
    skip_or_fail(missing_requirements(), "namespace-host")


def skip_or_fail(why: str | None, tests: str) -> None:
    """Nothing when ``why`` is None; else skip the calling test with it, or under CI fail it (its
    ``tests`` tests must run there)."""
    if why is None:
        return
    if under_ci():
        pytest.fail(f"CI is set, so the {tests} tests must run, but {why}", pytrace=False)
    pytest.skip(why)


#: A kit's temp dir is ``<tmp>/flodl-hosts-<tag>-…``; its namespaces are ``fl<tag>h<N>``, its bridge ``flbr<tag>``.
_KIT_PREFIX = "flodl-hosts-"
#: The file in a kit's dir naming the process that made it (pid and start time).
_OWNER = "owner"


def sweep_abandoned_kits() -> list[str]:
    """Take down the kits of test sessions that died without closing them (a SIGKILLed or SIGTERMed pytest).

    Their namespaces, bridge and temp dir outlive them; a kit whose owner still runs (another
    session beside this one) is left alone. Returns the tags taken down.
    """
    swept = []
    namespaces: list[str] | None = None
    for root in Path(tempfile.gettempdir()).glob(f"{_KIT_PREFIX}*-*"):
        tag = root.name[len(_KIT_PREFIX) :].split("-", 1)[0]
        try:
            pid, start = (root / _OWNER).read_text().split()
        except (OSError, ValueError):
            continue  # being made right now, or not a kit of ours
        if ProcessIdentity(
            pid=int(pid), start_time=None if start == "None" else int(start)
        ).is_alive():
            continue
        if namespaces is None:  # listed once, and only when some kit is abandoned
            namespaces = [
                line.split()[0]
                for line in _run("ip", "netns", "list", check=False).stdout.splitlines()
                if line.strip()
            ]
        for ns in (n for n in namespaces if n.startswith(f"fl{tag}h")):
            for p in _run("ip", "netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(p), signal.SIGKILL)
            _run("ip", "netns", "del", ns, check=False)
        _run("ip", "link", "del", f"flbr{tag}", check=False)
        shutil.rmtree(root, ignore_errors=True)
        swept.append(tag)
    return swept


def worker_python(directory: Path, *, repo: Path) -> Path:
    """A ``python:`` for a namespace host's worker: this interpreter, importing ``repo``'s code."""
    wrapper = directory / "python3"
    wrapper.write_text(f'#!/bin/sh\nexport PYTHONPATH={repo}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o700)
    return wrapper


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=60)


@dataclass(frozen=True, slots=True)
class NsHost:
    """One namespace host: its hostname, namespace, address and host key."""

    name: str
    ns: str
    addr: str
    host_key_pub: str  # "ssh-ed25519 AAAA..." as it goes into known_hosts
    port: int = 22


@dataclass
class HostKit:
    """A set of namespace hosts sharing one bridge, user key and known_hosts file."""

    tag: str
    prefix: str  # "10.77.N" — the /24 of this kit
    root: Path
    bridge: str
    user_key: Path
    known_hosts: Path
    hosts: list[NsHost] = field(default_factory=list)
    _sshd: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def controller_addr(self) -> str:
        """The root namespace's address on the bridge: where the hosts reach the controller."""
        return f"{self.prefix}.1"

    @classmethod
    def create(cls, count: int, *, sshd_options: Sequence[str] = ()) -> HostKit:
        """``count`` hosts; ``sshd_options``: extra sshd_config lines for each (e.g. ``AllowTcpForwarding no``)."""
        sweep_abandoned_kits()
        tag = secrets.token_hex(3)
        root = Path(tempfile.mkdtemp(prefix=f"{_KIT_PREFIX}{tag}-"))
        os.chmod(root, 0o700)
        owner = ProcessIdentity.current()
        (root / _OWNER).write_text(f"{owner.pid} {owner.start_time}\n")
        kit = cls(
            tag=tag,
            prefix=f"10.77.{secrets.randbelow(254) + 1}",
            root=root,
            bridge=f"flbr{tag}",
            user_key=root / "id_user",
            known_hosts=root / "known_hosts",
        )
        try:
            _run(
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                "flodl-test-user",
                "-f",
                str(kit.user_key),
            )
            (root / "authorized_keys").write_text(Path(f"{kit.user_key}.pub").read_text())
            kit.known_hosts.write_text("")
            _run("ip", "link", "add", kit.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{kit.controller_addr}/24", "dev", kit.bridge)
            _run("ip", "link", "set", kit.bridge, "up")
            kit.add_hosts(count, sshd_options=sshd_options)
        except BaseException:
            kit.close()
            raise
        return kit

    def add_hosts(self, count: int, *, sshd_options: Sequence[str] = ()) -> list[NsHost]:
        """Bring up ``count`` more hosts (h1, h2, ... in order); return them once each sshd answers."""
        added = [self._add_host(len(self.hosts) + 1, sshd_options) for _ in range(count)]
        for host in added:
            self._wait_sshd(host)
        return added

    def _add_host(self, index: int, sshd_options: Sequence[str]) -> NsHost:
        name = f"h{index}"
        ns = f"fl{self.tag}{name}"
        addr = f"{self.prefix}.{index + 1}"
        hdir = self.root / name
        hdir.mkdir(mode=0o700)
        veth_out, veth_in = f"fv{self.tag}{index}", f"fp{self.tag}{index}"
        _run("ip", "netns", "add", ns)
        # Registered before anything else can fail, so close() takes it down.
        self.hosts.append(NsHost(name=name, ns=ns, addr=addr, host_key_pub=""))
        _run("ip", "link", "add", veth_out, "type", "veth", "peer", "name", veth_in)
        _run("ip", "link", "set", veth_out, "master", self.bridge)
        _run("ip", "link", "set", veth_out, "up")
        _run("ip", "link", "set", veth_in, "netns", ns)
        inside = ("ip", "netns", "exec", ns)
        _run(*inside, "ip", "link", "set", "lo", "up")
        _run(*inside, "ip", "link", "set", veth_in, "name", "eth0")
        _run(*inside, "ip", "addr", "add", f"{addr}/24", "dev", "eth0")
        _run(*inside, "ip", "link", "set", "eth0", "up")
        _run(
            "ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(hdir / "host_key")
        )
        pub = " ".join((hdir / "host_key.pub").read_text().split()[:2])
        host = NsHost(name=name, ns=ns, addr=addr, host_key_pub=pub)
        self.hosts[-1] = host
        with self.known_hosts.open("a") as f:
            f.write(f"{addr} {pub}\n")
        config = hdir / "sshd_config"
        config.write_text(
            "\n".join(
                (
                    f"ListenAddress {addr}",
                    "Port 22",
                    f"HostKey {hdir / 'host_key'}",
                    f"AuthorizedKeysFile {self.root / 'authorized_keys'}",
                    "PidFile none",
                    "UsePAM no",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PermitRootLogin prohibit-password",
                    "StrictModes no",
                    "X11Forwarding no",
                    "PrintMotd no",
                    "LogLevel VERBOSE",
                    *sshd_options,
                    "",
                )
            )
        )
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        self._sshd[ns] = subprocess.Popen(
            [
                *inside,
                "unshare",
                "--uts",
                "--mount",  # private mounts: the host's shells start without this machine's rc files (below)
                "sh",
                "-c",
                # A test host's login shell must not run the developer's rc files: `pyenv init` there runs a
                # rehash that waits forever on a lock left by a process a test killed, so no agent would start.
                f'hostname {name} && for rc in "$HOME/.bashrc" "$HOME/.profile" "$HOME/.bash_profile"; do '
                f'[ -f "$rc" ] && mount --bind /dev/null "$rc"; done; exec {SSHD} -D -f "$1" -E "$2"',
                "sh",
                str(config),
                str(hdir / "sshd.log"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return host

    def _wait_sshd(self, host: NsHost, within: float = 30.0) -> None:
        deadline = time.monotonic() + within
        while True:
            proc = self._sshd[host.ns]
            if proc.poll() is not None:
                log = self.root / host.name / "sshd.log"
                tail = log.read_text()[-2000:] if log.exists() else ""
                raise RuntimeError(f"sshd of {host.name} exited with {proc.returncode}: {tail}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection((host.addr, host.port), timeout=1.0) as s,
            ):
                if s.recv(4) == b"SSH-":
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"sshd of {host.name} at {host.addr}:{host.port} did not answer within {within}s"
                )
            time.sleep(0.05)

    def ssh_argv(self, host: NsHost, *command: str, known_hosts: Path | None = None) -> list[str]:
        """An OpenSSH client command line that reaches ``host`` with this kit's key and known_hosts."""
        return [
            "ssh",
            "-F",
            "/dev/null",
            "-i",
            str(self.user_key),
            "-o",
            f"UserKnownHostsFile={known_hosts or self.known_hosts}",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "IdentitiesOnly=yes",
            "-p",
            str(host.port),
            f"root@{host.addr}",
            *command,
        ]

    def ssh_worker(self, host: NsHost) -> dict[str, str]:
        """A cluster file's ``ssh:`` for ``host``: as root, with this kit's key and known_hosts."""
        return {
            "target": host.addr,
            "user": "root",
            "identity_file": str(self.user_key),
            "known_hosts": str(self.known_hosts),
        }

    def inside_argv(
        self,
        host: NsHost,
        *command: str,
        hostname: str | None = None,
        hosts_file: Path | None = None,
    ) -> list[str]:
        """A command line that runs ``command`` on ``host`` as its own login would: its namespace, its hostname.

        ``hostname``: another than the host's name (a pod's); ``hosts_file``: bind-mounted over
        /etc/hosts in a private mount namespace, so names resolve there as a cluster's DNS would.
        """
        mount = ("--mount",) if hosts_file is not None else ()
        bind = f'mount --bind "{hosts_file}" /etc/hosts && ' if hosts_file is not None else ""
        return [
            "ip",
            "netns",
            "exec",
            host.ns,
            "unshare",
            "--uts",
            *mount,
            "sh",
            "-c",
            bind + 'hostname "$1" && shift && exec "$@"',
            "sh",
            hostname or host.name,
            *command,
        ]

    def host_pids(self, ns: str) -> list[int]:
        """Every process in namespace ``ns`` other than its sshd listener."""
        listener = self._sshd.get(ns)
        pids = [int(p) for p in _run("ip", "netns", "pids", ns, check=False).stdout.split()]
        # `ip netns exec` and `unshare --uts` exec, and sh execs sshd: the listener keeps Popen's pid.
        return [p for p in pids if listener is None or p != listener.pid]

    def leftovers(self, within: float = 10.0) -> dict[str, list[int]]:
        """Processes left on any host after ``within`` seconds of waiting for them to go (empty is clean)."""
        deadline = time.monotonic() + within
        while True:
            left = {h.name: pids for h in self.hosts if (pids := self.host_pids(h.ns))}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def power_off(self, ns: str, within: float = 10.0) -> None:
        """Kill every process in ``ns`` but its sshd listener, sweeping until none is left.

        One pass over a snapshot is not enough: a process may fork between the listing and its
        kill (a shell starting its next command), and the child would outlive the "dead" host.
        """
        deadline = time.monotonic() + within
        while pids := self.host_pids(ns):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)

    def kill_leftovers(self) -> None:
        """Kill everything on every host except its sshd, so one failing test does not poison the next."""
        for host in self.hosts:
            self.power_off(host.ns)

    def close(self) -> None:
        """Kill every process of every namespace, then delete the namespaces, the bridge and the temp dir."""
        for host in self.hosts:
            pids = [
                int(p) for p in _run("ip", "netns", "pids", host.ns, check=False).stdout.split()
            ]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self._sshd.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for host in self.hosts:
            deadline = time.monotonic() + 10
            while (
                _run("ip", "netns", "pids", host.ns, check=False).stdout.split()
                and time.monotonic() < deadline
            ):
                time.sleep(0.05)
            _run(
                "ip", "netns", "del", host.ns, check=False
            )  # takes its veth (and the peer) with it
        _run("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.root, ignore_errors=True)
