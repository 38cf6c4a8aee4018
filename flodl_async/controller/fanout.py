"""ssh fan-out: the :class:`~flodl_async.controller.launchers.AgentLauncher` of ``Placement.SSH``
workers.

Every worker's agent is started by its own ``run_agent`` call, and the controller runs
those concurrently, so all hosts are dialled in parallel. Per host: connect with asyncssh
(host keys always checked against the worker's ``known_hosts``, never accepted silently;
only the worker's identity file, no ssh-agent and no ``~/.ssh/config``, so what the cluster
file says is what happens), start ``<python> -m flodl_async.agent --spec-stdin`` in the
worker's ``workdir``, wait for the agent's hello line (its version), then write its spec as
one JSON line on stdin. The secret is never on the remote command line. The ssh session
stays open for the whole run: it is the agent's lifeline (EOF on its stdin stops it).

A ``tunnel: true`` worker (cluster file ``trainer: cpu`` only, see
:mod:`flodl_async.config.cluster`)
reaches the controller through a remote forward on that same ssh session: sshd on the host
listens on its 127.0.0.1:<ephemeral>, each connection there is carried back over ssh to the
controller's port, and the agent's spec names 127.0.0.1:<that port> as its controller. When
every remote worker tunnels the controller binds loopback only, so the tunnel is the one path.

Every failure before the agent is up is a :class:`SshLaunchFailed` (a ``JoinFailed``)
naming the host, the cause and what to do; the controller turns it into ``HostLost``, and a
planned host lost before joining fails the window at once (exit 3).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncssh

from .._version import __version__
from ..agent.output import Console
from ..agent.specline import AgentSpec, devices_text, parse_hello
from ..config.cluster import SshSpec
from ..config.command import PYTHON_VAR
from ..config.plan import PlacedWorker
from ..config.sshopts import parse_option
from ..errors import AgentError, FlodlError, JoinFailed
from .launchers import ControllerContact

log = logging.getLogger("flodl_async.controller.fanout")

DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
DEFAULT_PYTHON = "python3"
#: Exit status of a remote command the shell could not find.
COMMAND_NOT_FOUND = 127
#: Where a tunnel listens on its host (loopback: only that host's agent and ranks reach it).
TUNNEL_HOST = "127.0.0.1"
#: How many of the agent's last stderr lines a failure quotes.
STDERR_TAIL = 5


class SshLaunchFailed(JoinFailed):
    """flodl-launch could not bring a worker's agent up over ssh.

    The class's advice is for the ssh settings; a cause that another fix mends (a python, a
    version, sshd's forwarding) gives its own.
    """

    advice = "fix the worker's ssh settings in the cluster file (or the host) and run again"


SAME_VERSION = "install the same flodl_async version on every host"
ALLOW_FORWARDING = (
    "allow it there (AllowTcpForwarding yes or remote in sshd_config) or drop `tunnel: true`"
)


#: The first stdout line of the remote command, before the agent's own hello: ``PID_PREFIX <pid>``.
PID_PREFIX = "flodl-agent-pid"


def remote_command(python: str, workdir: str | None) -> str:
    """The remote command line: no secret, no spec, just where and what to run.

    The shell says its pid first, which ``exec`` hands on to python: a ``python`` that hangs
    before its hello can then be KILLed over a second channel (sshd delivers no signal
    requests to a root session, and hangs up nothing without a tty).
    """
    run = f"echo {PID_PREFIX} $$ && exec {shlex.quote(python)} -m flodl_async.agent --spec-stdin"
    return run if workdir is None else f"cd {shlex.quote(workdir)} && {run}"


@dataclass(frozen=True, slots=True, kw_only=True)
class SshTarget:
    """Where and as whom one worker is reached, resolved from its ``ssh`` block."""

    host: str
    address: str
    port: int
    user: str | None
    identity_file: Path | None
    known_hosts: Path
    proxy_jump: str | None
    #: Set on a jump host's own target: the address it leads to (for messages).
    jump_of: str | None = None

    @classmethod
    def of(cls, host: str, ssh: SshSpec | None) -> SshTarget:
        ssh = ssh or SshSpec()
        jump = next(
            (value for name, value in map(parse_option, ssh.options) if name == "ProxyJump"), None
        )
        return cls(
            host=host,
            address=ssh.target or host,
            port=ssh.port or 22,
            user=ssh.user,
            identity_file=Path(ssh.identity_file).expanduser() if ssh.identity_file else None,
            known_hosts=Path(ssh.known_hosts or DEFAULT_KNOWN_HOSTS).expanduser(),
            proxy_jump=jump,
        )

    def jump_host(self) -> SshTarget:
        """The ProxyJump host (``[user@]host[:port]``), reached with this worker's key and
        known_hosts."""
        assert self.proxy_jump is not None
        user, _, rest = self.proxy_jump.rpartition("@")
        address, _, port = rest.partition(":")
        return dataclasses.replace(
            self,
            address=address,
            port=int(port) if port.isdigit() else 22,
            user=user or self.user,
            proxy_jump=None,
            jump_of=self.address,
        )

    @property
    def where(self) -> str:
        if self.jump_of is not None:
            return f"{self.address}:{self.port} (the ProxyJump host to {self.jump_of})"
        via = f" via {self.proxy_jump}" if self.proxy_jump else ""
        return f"{self.address}:{self.port}{via}"


class SshLauncher:
    """Agents on other hosts, started over ssh; stdout/stderr lines of each are relayed here."""

    def __init__(
        self, contact: ControllerContact, *, run_id: str, stdout: Console, stderr: Console
    ) -> None:
        self._contact = contact
        self._run_id = run_id
        self._stdout = stdout
        self._stderr = stderr
        self._processes: list[Any] = []
        # Parsed once per file for every host of the run, not once per connection: K hosts
        # sharing one known_hosts and one key cost one parse each, off the per-host path.
        self._known_hosts: dict[Path, Any] = {}
        self._client_keys: dict[Path, Any] = {}

    async def run_agent(self, worker: PlacedWorker) -> None:
        """Connect, start the agent, hand it its spec, relay its output until it exits."""
        spec = worker.spec
        target = SshTarget.of(spec.host, spec.ssh)
        async with contextlib.AsyncExitStack() as stack:
            tunnel = None
            if target.proxy_jump:
                tunnel = await stack.enter_async_context(await self._connect(target.jump_host()))
            conn = await stack.enter_async_context(await self._connect(target, tunnel=tunnel))
            # With a jump host, the address the jump host reached us on is the best guess at ours.
            controller_host, controller_port = (
                self._controller_host_for(tunnel or conn),
                self._contact.port,
            )
            if spec.tunnel:
                controller_host, controller_port = await self._open_tunnel(target, conn)
            command = remote_command(spec.python or DEFAULT_PYTHON, spec.workdir)
            process = await conn.create_process(command, encoding=None)
            self._processes.append(process)
            stderr_tail: list[bytes] = []
            try:
                with _first_error():
                    await self._serve(
                        target,
                        process,
                        worker,
                        (controller_host, controller_port),
                        stderr_tail,
                        conn=conn,
                    )
            except asyncssh.Error as exc:
                # The connection itself went mid-run (the host died, its sshd was killed): name the
                # host, not asyncssh.
                raise AgentError(
                    spec.host,
                    f"the ssh connection to {target.where} was lost: "
                    f"{exc.reason or exc}{_tail(stderr_tail)}",
                ) from None
            completed = process.returncode, process.exit_signal
            if completed != (0, None):
                code, sig = completed
                status = (
                    f"signal {sig[0]}"
                    if sig
                    else f"exit {code}"
                    if code is not None
                    else "its ssh session closing"
                )
                raise AgentError(
                    spec.host,
                    f"the agent on {target.where} ended with {status}{_tail(stderr_tail)}",
                )

    async def _serve(
        self,
        target: SshTarget,
        process: Any,
        worker: PlacedWorker,
        controller: tuple[str, int],
        stderr_tail: list[bytes],
        *,
        conn: Any,
    ) -> None:
        spec = worker.spec
        controller_host, controller_port = controller
        async with asyncio.TaskGroup() as tg:
            stderr_done = tg.create_task(self._relay_stderr(process, stderr_tail))
            await self._await_hello(
                target,
                process,
                stderr_tail,
                stderr_done,
                conn=conn,
                python=spec.python or DEFAULT_PYTHON,
            )
            agent_spec = AgentSpec(
                controller_host=controller_host,
                controller_port=controller_port,
                secret_hex=self._contact.secret.hex(),
                host=spec.host,
                devices=devices_text(spec.devices),
                run_id=self._run_id,
                # a leading `python` there: the worker's python:, else the one its PATH finds
                env={**spec.env, PYTHON_VAR: spec.python or ""},
                workdir=spec.workdir,
                timeout_scale=self._contact.deadlines.scale,
                stop_grace=self._contact.deadlines.stop_grace,
                nccl_socket_ifname=spec.nccl_socket_ifname,
            )
            # stdin stays open: it is the agent's lifeline
            process.stdin.write(agent_spec.to_line())
            tg.create_task(self._relay(process.stdout, self._stdout))
            await process.wait_closed()

    def force_stop(self) -> None:
        """A second signal: kill every remote agent now (its ranks die with it)."""
        for process in self._processes:
            with contextlib.suppress(Exception):  # a channel already gone needs no killing
                process.send_signal("KILL")
            with contextlib.suppress(Exception):
                process.stdin.write_eof()

    def _controller_host_for(self, conn: Any) -> str:
        # A configured controller address wins; else the address the remote host reached us on,
        # which it can route back to.
        if self._contact.host not in ("", "0.0.0.0", "127.0.0.1", "::"):
            return self._contact.host
        sockname = conn.get_extra_info("sockname")
        return str(sockname[0]) if sockname else self._contact.host

    async def _open_tunnel(self, target: SshTarget, conn: Any) -> tuple[str, int]:
        """A remote forward, host's 127.0.0.1:<ephemeral> to the controller's port; closed with
        ``conn``."""
        # The controller listens on its bind address; a wildcard bind is reached on loopback too.
        local = (
            self._contact.host if self._contact.host not in ("", "0.0.0.0", "::") else TUNNEL_HOST
        )
        try:
            async with asyncio.timeout(self._contact.deadlines.ssh_connect):
                listener = await conn.forward_remote_port(TUNNEL_HOST, 0, local, self._contact.port)
        except TimeoutError:
            raise SshLaunchFailed(
                target.host,
                f"sshd on {target.where} did not answer the tunnel's port-forward request within "
                f"{self._contact.deadlines.ssh_connect:g}s",
            ) from None
        # the first is no asyncssh.Error
        except (asyncssh.ChannelListenError, asyncssh.Error) as exc:
            raise SshLaunchFailed(
                target.host,
                f"sshd on {target.where} refused the tunnel's remote port forward ({exc})",
                advice=ALLOW_FORWARDING,
            ) from None
        if listener is None:  # asyncssh's answer to a refused forward on some versions
            raise SshLaunchFailed(
                target.host,
                f"sshd on {target.where} refused the tunnel's remote port forward",
                advice=ALLOW_FORWARDING,
            )
        port = int(listener.get_port())
        log.info(
            "%s: tunnel %s:%d on the host -> %s:%d here",
            target.host,
            TUNNEL_HOST,
            port,
            local,
            self._contact.port,
        )
        return TUNNEL_HOST, port

    async def _connect(self, target: SshTarget, *, tunnel: Any = None) -> Any:
        if not target.known_hosts.is_file():
            raise SshLaunchFailed(
                target.host,
                f"known_hosts file {target.known_hosts} does not exist",
                advice=f"add {target.address}'s host key there (ssh-keyscan -p {target.port} "
                f"{target.address} >> {target.known_hosts}, after checking its fingerprint)",
            )
        if target.identity_file is not None and not target.identity_file.is_file():
            raise SshLaunchFailed(
                target.host, f"identity_file {target.identity_file} does not exist"
            )
        options: dict[str, Any] = {
            "port": target.port,
            "known_hosts": self._parsed_known_hosts(target),
            "config": None,
            "agent_path": None,
            "connect_timeout": self._contact.deadlines.ssh_connect,
            "login_timeout": self._contact.deadlines.ssh_connect,
        }
        if target.user:
            options["username"] = target.user
        if target.identity_file is not None:
            options["client_keys"] = [self._client_key(target, target.identity_file)]
        if tunnel is not None:
            options["tunnel"] = tunnel
        try:
            async with asyncio.timeout(self._contact.deadlines.ssh_connect):
                return await asyncssh.connect(target.address, **options)
        except asyncssh.HostKeyNotVerifiable:
            problem, advice = await self._host_key_problem(target, tunnel)
            raise SshLaunchFailed(target.host, problem, advice=advice) from None
        except asyncssh.PermissionDenied:
            key = target.identity_file or "the default keys (~/.ssh/id_*)"
            who = f"as {target.user}" if target.user else "as the current user"
            raise SshLaunchFailed(
                target.host,
                f"ssh authentication to {target.where} {who} failed with {key}",
                advice="add its public key to the remote authorized_keys, or fix the worker's "
                "ssh: user and identity_file in the cluster file",
            ) from None
        except TimeoutError:
            raise SshLaunchFailed(
                target.host,
                f"ssh to {target.where} did not connect within "
                f"{self._contact.deadlines.ssh_connect:g}s",
                advice="check the worker's address in the cluster file and that sshd runs there",
            ) from None
        except (OSError, asyncssh.Error) as exc:
            raise SshLaunchFailed(
                target.host,
                f"cannot reach {target.where} over ssh: {exc}",
                advice="check the worker's address and ssh: port in the cluster file and that "
                "sshd runs there",
            ) from None

    def _parsed_known_hosts(self, target: SshTarget) -> Any:
        known = self._known_hosts.get(target.known_hosts)
        if known is None:
            try:
                known = self._known_hosts[target.known_hosts] = asyncssh.read_known_hosts(
                    str(target.known_hosts)
                )
            except (OSError, ValueError) as exc:
                raise SshLaunchFailed(
                    target.host,
                    f"cannot read known_hosts file {target.known_hosts}: {exc}",
                    advice="fix or regenerate it",
                ) from None
        return known

    def _client_key(self, target: SshTarget, path: Path) -> Any:
        key = self._client_keys.get(path)
        if key is None:
            try:
                key = self._client_keys[path] = asyncssh.read_private_key(str(path))
            # asyncssh.KeyImportError is a ValueError: a passphrase, a foreign format
            except (OSError, ValueError) as exc:
                raise SshLaunchFailed(
                    target.host,
                    f"cannot load identity_file {path}: {exc}",
                    advice="give the worker's ssh: identity_file an unencrypted OpenSSH/PEM "
                    "private key readable here",
                ) from None
        return key

    async def _host_key_problem(self, target: SshTarget, tunnel: Any) -> tuple[str, str]:
        """Unknown or changed: the key the host offers (fingerprint) and what known_hosts says, and
        what to do about it."""
        offered = "?"
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._contact.deadlines.ssh_connect):
                key = await asyncssh.get_server_host_key(
                    target.address,
                    target.port,
                    tunnel=tunnel if tunnel is not None else (),
                    config=None,
                )
            if key is not None:
                offered = key.get_fingerprint("sha256")
        listed: tuple[Any, ...] = ()
        with contextlib.suppress(Exception):
            known = asyncssh.read_known_hosts(str(target.known_hosts))
            host = target.address if target.port == 22 else f"[{target.address}]:{target.port}"
            listed = tuple(known.match(host, "", target.port)[0])
        if listed:
            return (
                f"the host key of {target.where} CHANGED: it offers {offered}, but "
                f"{target.known_hosts} lists another key for it",
                "if the host was reinstalled, remove the old entry (ssh-keygen -R "
                f"{target.address} -f {target.known_hosts}) and add the new one",
            )
        return (
            f"the host key of {target.where} is unknown: it offers {offered}, which is not in "
            f"{target.known_hosts}",
            f"check the fingerprint, then add it (ssh-keyscan -p {target.port} {target.address} >> "
            f"{target.known_hosts})",
        )

    async def _await_hello(
        self,
        target: SshTarget,
        process: Any,
        stderr_tail: list[bytes],
        stderr_done: asyncio.Task[None],
        *,
        conn: Any,
        python: str,
    ) -> None:
        """The agent's first stdout line (after the shell's pid line) must be a hello of this
        version; else say what is wrong there."""
        pid: int | None = None
        try:
            async with asyncio.timeout(self._contact.deadlines.ssh_connect):
                line = await process.stdout.readline()
                head, _, value = line.decode(errors="replace").strip().partition(" ")
                if head == PID_PREFIX and value.isdigit():
                    pid = int(value)
                    line = await process.stdout.readline()
        except TimeoutError:
            # Whatever runs there as `python` is stuck before its hello: no spec, so no ranks, yet
            # it would
            # outlive the session. KILL it (by the pid its shell said) before the connection closes.
            await self._abandon(conn, process, pid)
            raise SshLaunchFailed(
                target.host,
                f"the agent on {target.where} said nothing within "
                f"{self._contact.deadlines.ssh_connect:g}s",
                advice="check the worker's python: there (it must start "
                "`python -m flodl_async.agent`)",
            ) from None
        except asyncssh.Error as exc:
            # The host died (or its sshd session was killed) before the agent started: a host lost
            # before joining.
            raise SshLaunchFailed(
                target.host,
                f"the ssh connection to {target.where} was lost before the agent said hello "
                f"({exc.reason or exc})",
                advice="check that the host is up, then run again",
            ) from None
        version = parse_hello(line.decode(errors="replace"))
        if version == __version__:
            return
        if version is not None:
            await self._abandon(conn, process, pid)  # another version's agent: it never gets a spec
            raise SshLaunchFailed(
                target.host,
                f"{target.where} has flodl_async {version}, this launcher is {__version__}",
                advice=SAME_VERSION,
            )
        await process.wait_closed()
        # the relay has the agent's last words once stderr ends
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._contact.deadlines.output_drain):
                await asyncio.shield(stderr_done)
        status = process.returncode
        if status == COMMAND_NOT_FOUND:
            raise SshLaunchFailed(
                target.host,
                f"python {python!r} was not found on {target.where} (exit 127)",
                advice="set the worker's python: in the cluster file to its path there",
            )
        tail = b"\n".join(stderr_tail).decode(errors="replace")
        if "No module named" in tail and "flodl_async" in tail:
            raise SshLaunchFailed(
                target.host,
                f"flodl_async is not importable by {python} on {target.where}",
                advice=f"install flodl_async {__version__} there (or set the worker's python: in "
                "the cluster file)",
            )
        if "--spec-stdin" in tail:
            raise SshLaunchFailed(
                target.host,
                f"flodl_async on {target.where} is older than {__version__} (no --spec-stdin)",
                advice=SAME_VERSION,
            )
        raise SshLaunchFailed(
            target.host,
            f"the agent on {target.where} exited with {status} before saying "
            f"hello{_tail(stderr_tail)}",
            advice="its stderr above says why; check the worker's python: and flodl_async there",
        )

    async def _abandon(self, conn: Any, process: Any, pid: int | None) -> None:
        """KILL a remote process that was never handed a spec (so it has no ranks), and end its
        stdin."""
        with contextlib.suppress(Exception):  # a channel already gone has nothing to end
            process.stdin.write_eof()
        # no pid line: a signal request is all there is (sshd honours it for non-root users)
        if pid is None:
            with contextlib.suppress(Exception):
                process.send_signal("KILL")
            return
        # the connection itself going is the session's end anyway
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._contact.deadlines.ssh_connect):
                await conn.run(f"kill -KILL {pid}", check=False)

    async def _relay_stderr(self, process: Any, tail: list[bytes]) -> None:
        async for line in process.stderr:
            # asyncssh's line iterator ends with one b"" at EOF: no blank line per host
            if not line:
                continue
            tail.append(line.rstrip(b"\n"))
            del tail[:-STDERR_TAIL]
            _write(self._stderr, line)

    async def _relay(self, reader: Any, sink: Console) -> None:
        async for line in reader:
            if line:  # as above: the b"" at EOF is not a line
                _write(sink, line)


def _write(sink: Console, line: bytes) -> None:
    with contextlib.suppress(OSError, ValueError):  # a closed terminal loses the line, not the run
        sink.write(line if line.endswith(b"\n") else line + b"\n")
        sink.flush()


def ssh_launcher(
    contact: ControllerContact,
    *,
    bind_host: str,
    run_id: str,
    stdout: Console | None = None,
    stderr: Console | None = None,
) -> SshLauncher:
    """The controller's ssh launcher: agents reach the controller at its bind address (or the ssh
    link's own).

    The agents' own lines go to ``stdout``/``stderr`` (the launcher's console writers, which never
    block
    the loop; default: this process's streams).
    """
    return SshLauncher(
        dataclasses.replace(contact, host=bind_host),
        run_id=run_id,
        stdout=stdout or sys.stdout.buffer,
        stderr=stderr or sys.stderr.buffer,
    )


@contextlib.contextmanager
def _first_error() -> Iterator[None]:
    """Re-raise a task group's first flodl (or asyncssh) error bare, so the controller reads it as
    this host's failure."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaf = _first_leaf(group)
        # run_agent names the host of an asyncssh one
        if isinstance(leaf, (FlodlError, asyncssh.Error)):
            raise leaf from None
        raise


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def _tail(lines: list[bytes]) -> str:
    return f": {lines[-1].decode(errors='replace')}" if lines else ""
