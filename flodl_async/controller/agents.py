"""What the controller starts from its plan: the supervisor's config, and which launcher brings
up the agents of each placement (in this process, over ssh, or none: dial-in workers join on
their own)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._version import __version__
from ..agent import RankOutput
from ..config.plan import LaunchPlan, Placement, direct_ssh_targets
from ..control.supervision import SupervisorConfig
from ..deadlines import Deadlines
from ..host.ifnames import controller_host_peer
from ..wire.handshake import PROTOCOL_VERSION
from .launchers import AgentLauncher, ControllerContact, DialInLauncher, LocalLauncher

if TYPE_CHECKING:
    from ..relay.upstream import LocalReducerSource


def agent_launchers(
    plan: LaunchPlan,
    contact: ControllerContact,
    *,
    output: RankOutput,
    local_reducer: LocalReducerSource,
) -> dict[Placement, AgentLauncher]:
    """The launchers of ``plan``'s run; ``local_reducer`` is handed to the in-process agents.

    The ssh launcher exists only when some worker is placed over ssh; it writes the agents' own
    lines to the rank output's consoles (the process's own stdout/stderr).
    """
    # The controller's host's ranks bind the NIC the other hosts reach (flodl_async.host.ifnames).
    peer = controller_host_peer(plan.bind_host, contact.port, direct_ssh_targets(plan.workers))
    local = LocalLauncher(contact, output=output, ifname_peer=peer, local_reducer=local_reducer)
    launchers: dict[Placement, AgentLauncher] = {
        Placement.LOCAL: local,
        Placement.DIAL_IN: DialInLauncher(),
    }
    if any(w.placement is Placement.SSH for w in plan.workers):
        # (a fifth of the launcher's imports: a one-host run spawns its ranks that much sooner)
        from .fanout import ssh_launcher  # deferred: asyncssh only where a host is over ssh

        out, err = output.consoles
        launchers[Placement.SSH] = ssh_launcher(
            contact, bind_host=plan.bind_host, run_id=plan.run_id, stdout=out, stderr=err
        )
    return launchers


def supervisor_config(
    plan: LaunchPlan, deadlines: Deadlines, *, controller_store: bool
) -> SupervisorConfig:
    """The supervisor's config for ``plan``'s run (``controller_store``: the controller serves the
    rendezvous store on its port)."""
    return SupervisorConfig(
        run_id=plan.run_id,
        join=plan.join,
        command=plan.command,
        cluster_env=plan.cluster_env,
        max_restarts=plan.max_restarts,
        stop_grace=deadlines.stop_grace,
        store_ready_timeout=deadlines.store_ready,
        controller_store=controller_store,
        stop_ack_margin=deadlines.stop_ack_margin,
        local_hosts=plan.local_hosts,
        host_aliases=plan.host_aliases,
        protocol_version=PROTOCOL_VERSION,
        version=__version__,
        hang_timeout=plan.hang_timeout,
        launched_hosts=frozenset(
            w.host for w in plan.workers if w.placement is not Placement.DIAL_IN
        ),
        # such an agent closes its link (waiting at most link_close) before it can fail
        agent_reason_wait=2 * deadlines.link_close,
        # a rank's cause crosses one link, its exit another, each within about one link_close
        training_outcome_wait=2 * deadlines.link_close,
        heartbeat_interval=deadlines.heartbeat_interval,
        heartbeat_silence=deadlines.heartbeat_silence,
    )
