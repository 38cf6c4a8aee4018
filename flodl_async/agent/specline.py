"""``flodl-agent --spec-stdin``: an agent started by a launcher over ssh.

The launcher writes the agent's whole spec as one JSON line on stdin — never in argv
or the remote command line, where ``ps`` on the remote host would show the session
secret — and then keeps stdin open for the whole run: stdin is the agent's lifeline.
EOF on it means the launcher (or its ssh session) is gone, and the agent stops its
ranks (TERM, then KILL at the stop grace) and exits, so no rank outlives its launcher.

Before reading the spec the agent prints :func:`hello_line` on stdout, so the launcher
can tell "flodl_async is another version here" from every other failure.

The pure parts — the spec's JSON form both ways, the hello line, the interface that
carries an address (:mod:`flodl_async.host.ifnames`) — are functions; :func:`serve_spec_stdin` is
the thin shell.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._version import __version__
from ..config.devices import DeviceKind, DeviceSpec, parse_devices
from ..deadlines import Deadlines
from ..errors import ConfigError
from ..host.ifnames import ranks_env
from ..wire.keys import secret_from_hex
from .endings import SessionOutcome
from .join import SessionConfig
from .session import HostSession

#: The first stdout line of an agent started with --spec-stdin: ``HELLO_PREFIX <version>``.
HELLO_PREFIX = "flodl-agent-hello"


def hello_line(version: str = __version__) -> str:
    """The agent's first stdout line, naming its version."""
    return f"{HELLO_PREFIX} {version}"


def parse_hello(line: str) -> str | None:
    """The version in a hello line, or None when ``line`` is not one."""
    head, _, version = line.strip().partition(" ")
    return version if head == HELLO_PREFIX and version else None


def devices_text(devices: DeviceSpec) -> str:
    """The devices mini-language form of ``devices`` (what :func:`parse_devices` reads back)."""
    if devices.kind is DeviceKind.CPU:
        return f"cpu:{devices.cpu_ranks}"
    if devices.kind is DeviceKind.GPU_LIST:
        return ",".join(str(i) for i in devices.gpu_ids)
    return "all"


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentSpec:
    """What a launcher tells a remote agent, as one JSON line."""

    controller_host: str
    controller_port: int
    secret_hex: str
    host: str
    devices: str
    run_id: str
    env: Mapping[str, str]
    workdir: str | None
    timeout_scale: float
    stop_grace: float
    nccl_socket_ifname: str | None = None

    def to_line(self) -> bytes:
        """The spec as one JSON line (bytes, newline-terminated)."""
        body = {
            "controller_host": self.controller_host,
            "controller_port": self.controller_port,
            "secret": self.secret_hex,
            "host": self.host,
            "devices": self.devices,
            "run_id": self.run_id,
            "env": dict(self.env),
            "workdir": self.workdir,
            "timeout_scale": self.timeout_scale,
            "stop_grace": self.stop_grace,
            "nccl_socket_ifname": self.nccl_socket_ifname,
        }
        return json.dumps(body, separators=(",", ":")).encode() + b"\n"

    @classmethod
    def from_line(cls, line: bytes) -> AgentSpec:
        """Parse a spec line; anything malformed is a :class:`ConfigError` naming the field."""
        try:
            body = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            raise ConfigError(
                "--spec-stdin: the first stdin line is not JSON (it must be the launcher's agent "
                "spec)"
            ) from None
        if not isinstance(body, dict):
            raise ConfigError("--spec-stdin: the spec must be a JSON object")
        env = _field(body, "env", dict)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ConfigError("--spec-stdin: spec field 'env' must map strings to strings")
        workdir = body.get("workdir")
        ifname = body.get("nccl_socket_ifname")
        for name, value in (("workdir", workdir), ("nccl_socket_ifname", ifname)):
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"--spec-stdin: spec field {name!r} must be a string or null")
        port = _field(body, "controller_port", int)
        if not 0 < port < 65536:
            raise ConfigError(
                f"--spec-stdin: spec field 'controller_port' must be a TCP port (got {port})"
            )
        return cls(
            controller_host=_field(body, "controller_host", str),
            controller_port=port,
            secret_hex=_field(body, "secret", str),
            host=_field(body, "host", str),
            devices=_field(body, "devices", str),
            run_id=_field(body, "run_id", str),
            env=env,
            workdir=workdir,
            timeout_scale=float(_field(body, "timeout_scale", (int, float))),
            stop_grace=float(_field(body, "stop_grace", (int, float))),
            nccl_socket_ifname=ifname,
        )


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in body:
        raise ConfigError(
            f"--spec-stdin: the spec lacks field {name!r} (launcher and agent are different "
            "versions?)"
        )
    value = body[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ConfigError(
            f"--spec-stdin: spec field {name!r} has the wrong type ({type(value).__name__})"
        )
    return value


def session_config(spec: AgentSpec) -> SessionConfig:
    """The session config of a parsed spec; bad devices or secret raise :class:`ConfigError`."""
    try:
        devices = parse_devices(spec.devices)
    except ConfigError as exc:
        raise ConfigError(f"--spec-stdin: devices: {exc}") from None
    # The worker's nccl_socket_ifname goes in here; the default (the join connection's interface,
    # when nothing else sets it) is the session's, as for every agent.
    env = ranks_env(spec.env, configured_ifname=spec.nccl_socket_ifname)
    scale_env = {"FLODL_NET_TIMEOUT_SCALE": repr(spec.timeout_scale)}
    return SessionConfig(
        controller_host=spec.controller_host,
        controller_port=spec.controller_port,
        secret=secret_from_hex(spec.secret_hex),
        host=spec.host,
        devices=devices,
        env=env,
        workdir=spec.workdir,
        deadlines=Deadlines.resolve(stop_grace=spec.stop_grace, env=scale_env),
    )


def read_spec() -> SessionConfig:
    """Say hello on stdout, then read and parse the spec line from stdin."""
    print(hello_line(), flush=True)
    line = sys.stdin.buffer.readline()
    if not line:
        raise ConfigError(
            "--spec-stdin: stdin closed before the spec line came (the launcher went away)"
        )
    return session_config(AgentSpec.from_line(line))


async def watch_lifeline(session: HostSession) -> None:
    """Stop the session (TERM, KILL at the grace) when stdin reaches EOF: the launcher is gone."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.read(4096):
        pass  # the launcher sends nothing after the spec; anything more is ignored
    session.request_stop(signal.SIGTERM)


async def serve_spec_stdin(
    session: HostSession, serve: Callable[[HostSession], Awaitable[SessionOutcome]]
) -> SessionOutcome:
    """Run ``serve(session)`` with the stdin lifeline watched beside it."""
    async with asyncio.TaskGroup() as tg:
        watcher = tg.create_task(watch_lifeline(session), name="lifeline")
        outcome = await serve(session)
        watcher.cancel()  # the session is over; stdin no longer matters
    return outcome
