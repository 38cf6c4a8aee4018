"""The agent-launcher seam: how an agent comes to exist on a host.

The controller asks the launcher of each worker's :class:`~flodl_async.config.plan.Placement`
to run that worker's agent for the whole run; the agent then joins over the
real join protocol like any other. A launcher's failure to bring its agent up
(or the agent's own failure) is raised as a :class:`~flodl_async.errors.FlodlError`
and becomes a ``HostLost`` event naming the host; the lifecycle never knows how
the agent was started. An agent that fails closes its join link before its
launcher can raise, so the supervisor gives a launched host's closed link a
moment (``agent_reason_wait``) for that error, which then is the verdict. In-process
here; ssh fan-out is :mod:`.fanout`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..agent import HostSession, RankOutput, SessionConfig
from ..config.command import PYTHON_VAR
from ..config.plan import PlacedWorker
from ..deadlines import Deadlines
from ..host.ifnames import controller_host_ifname, ranks_env

if TYPE_CHECKING:
    from ..relay.upstream import LocalReducerSource


@dataclass(frozen=True, slots=True, kw_only=True)
class ControllerContact:
    """How an agent reaches this run's controller."""

    host: str
    port: int
    secret: bytes
    deadlines: Deadlines
    #: An every-node run's launch digest, which this node's own agent joins with too.
    launch: str = ""


class AgentLauncher(Protocol):
    """Brings up the agent of one planned worker and runs it until the run ends."""

    async def run_agent(self, worker: PlacedWorker) -> None:
        """Return when the agent has left; raise :class:`~flodl_async.errors.FlodlError` when it
        failed."""
        ...

    def force_stop(self) -> None:
        """A second signal: make every agent of this launcher kill its ranks now."""
        ...


class LocalLauncher:
    """Agents inside the controller's own process, joining over loopback (the controller's host)."""

    def __init__(
        self,
        contact: ControllerContact,
        *,
        output: RankOutput,
        ifname_peer: tuple[str, int] | None = None,
        local_reducer: LocalReducerSource | None = None,
    ) -> None:
        """``ifname_peer``: where this host's ranks must be reachable from
        (:func:`~flodl_async.host.ifnames.controller_host_peer`).

        ``local_reducer``: the controller's reducer, once it serves (asked when a relay needs it):
        these agents' relays hand their frames to it in memory instead of dialling the port.
        """
        self._contact = contact
        self._output = output
        self._ifname_peer = ifname_peer
        self._local_reducer = local_reducer
        self._sessions: list[HostSession] = []

    async def run_agent(self, worker: PlacedWorker) -> None:
        """Run the host's agent in this process until its run ends."""
        spec = worker.spec
        # These agents join over loopback, so the join connection's interface (lo) is no default for
        # them: their ranks take the interface that reaches the other hosts (a name may need the
        # resolver).
        ifname = (
            await asyncio.to_thread(controller_host_ifname, self._ifname_peer)
            if not spec.nccl_socket_ifname
            else None
        )
        session = HostSession(
            SessionConfig(
                controller_host="127.0.0.1",
                controller_port=self._contact.port,
                secret=self._contact.secret,
                host=spec.host,
                devices=spec.devices,
                # a leading `python` here: the worker's python:, else PATH's, else the launcher's
                env={
                    **ranks_env(spec.env, configured_ifname=spec.nccl_socket_ifname),
                    PYTHON_VAR: spec.python or "",
                },
                workdir=spec.workdir,
                deadlines=self._contact.deadlines,
                launch=self._contact.launch,
                default_ifname=ifname or "",
                local_reducer=self._local_reducer,
            ),
            output=self._output,
        )
        self._sessions.append(session)
        await session.run()

    def force_stop(self) -> None:
        """Kill every local agent's ranks now."""
        for session in self._sessions:
            session.force_stop()


class DialInLauncher:
    """Workers that join on their own (``dial_in: true``): nothing to start; the window waits for
    their join."""

    async def run_agent(self, worker: PlacedWorker) -> None:
        """Launch nothing: the host's own agent dials the join channel like a walk-in."""
        del worker

    def force_stop(self) -> None:
        """Nothing of ours runs there: the controller's Abort down the join link stops that agent's
        ranks."""
