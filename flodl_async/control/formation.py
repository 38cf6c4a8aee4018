"""What the supervisor says to the world's hosts as it forms and restarts: the answer to each join,
the world's announcement to every member host, and the stop before a restart.

Pure: the join window (:mod:`flodl_async.control.membership`) decides who is in; these turn its
decisions into the supervisor's actions.
"""

from __future__ import annotations

from ..verdict import device_ranges, rank_ranges
from ..wire import messages as m
from .membership import Admitted, Formed, JoinWindow, Rejected
from .supervision import AcceptJoin, Action, RejectJoin, SupervisorConfig
from .vocab import Announce, Level, Tell


def join_answer(
    outcome: Admitted | Rejected, *, host: str, window: JoinWindow, run_id: str
) -> list[Action]:
    """Accept ``host`` with its ranks, or refuse it with why, and say so."""
    if not isinstance(outcome, Admitted):
        return [
            Announce(text=f'join refused: host "{host}": {outcome.reason}', level=Level.WARNING),
            RejectJoin(host=host, reason=outcome.reason),
        ]
    member = outcome.member
    reply = m.JoinAccept(
        ranks=member.ranks, run_id=run_id, formation_wait_s=window.config.max_join_timeout
    )
    return [
        AcceptJoin(host=member.host, reply=reply),
        Announce(
            text=f'host "{member.host}" joined with ranks {rank_ranges(member.ranks)} '
            f"({device_ranges(member.devices)}) — "
            f"{window.joined_ranks} rank(s) in, target {window.describe_target()}"
        ),
    ]


def store_host(world: Formed, local_hosts: frozenset[str]) -> str:
    """The controller's own host when it runs ranks, else the host of global rank 0."""
    for member in world.members:
        if member.host in local_hosts:
            return member.host
    return world.members[0].host


def world_formed(world: Formed, config: SupervisorConfig) -> list[Action]:
    """The announcement, and each member host's ``WorldFormed``."""
    actions: list[Action] = [
        Announce(
            text=f"world formed — {world.world_size} ranks across {len(world.members)} host(s) "
            f"after {world.elapsed:.1f}s ({world.reason})"
        )
    ]
    store = store_host(world, config.local_hosts)
    for index, member in enumerate(world.members):
        actions.append(
            Tell(
                to=member.host,
                message=m.WorldFormed(
                    world_size=world.world_size,
                    ranks=member.ranks,
                    group_rank=index,
                    group_world_size=len(world.members),
                    store_host=not config.controller_store and member.host == store,
                    command=config.command,
                    # the host's own env is applied by its agent
                    env=dict(config.cluster_env),
                    max_restarts=config.max_restarts,
                ),
            )
        )
    return actions


def stop_for_restart(world: Formed, round_: int, grace: float) -> list[Action]:
    """Every member host is told to stop ``round_``'s ranks, so that the world restarts."""
    return [
        Tell(
            to=member.host,
            message=m.StopRanks(round=round_, reason="restarting the world", grace_s=grace),
        )
        for member in world.members
    ]
