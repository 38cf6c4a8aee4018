"""Which launcher brings up the agents of each placement: in this process, over ssh, or none
(dial-in workers join on their own)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..agent import RankOutput
from ..config.plan import LaunchPlan, Placement, direct_ssh_targets
from ..host.ifnames import controller_host_peer
from .fanout import ssh_launcher
from .launchers import AgentLauncher, ControllerContact, DialInLauncher, LocalLauncher

if TYPE_CHECKING:
    from ..relay.fold import LocalReducerSource


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
        out, err = output.consoles
        launchers[Placement.SSH] = ssh_launcher(
            contact, bind_host=plan.bind_host, run_id=plan.run_id, stdout=out, stderr=err
        )
    return launchers
