"""The join link as the supervisor sees it: what an agent's messages up it mean, and what an
admitted agent is told.

The shell reads each agent's join link and hands what it reads here to the supervisor as events
(:data:`HOST_EVENTS`); the wire's legality table says which messages may arrive at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..control.supervision import Event, RankExited, RanksReported, RanksStopped
from ..net.framed import FramedProtocol
from ..wire import messages as m
from ..wire.keys import CredentialKind
from ..wire.schema import Message


def _rank_exited(_host: str, msg: Message) -> Event:
    assert isinstance(msg, m.RankExited)
    return RankExited(report=msg)


def _ranks_stopped(host: str, msg: Message) -> Event:
    assert isinstance(msg, m.RanksStopped)
    return RanksStopped(host=host, round=msg.round)


def _ranks_reported(host: str, msg: Message) -> Event:
    assert isinstance(msg, m.RankStats)
    return RanksReported(host=host, report=msg)


#: What an agent's messages up its join link mean to the supervisor (the wire's table says what is
#: legal).
HOST_EVENTS: dict[type[Message], Callable[[str, Message], Event]] = {
    m.RankExited: _rank_exited,
    m.RanksStopped: _ranks_stopped,
    m.RankStats: _ranks_reported,
}


def with_secret_for_token_agent(
    reply: m.JoinAccept, link: FramedProtocol, secret: bytes
) -> m.JoinAccept:
    """An agent that joined with the cluster token (or none, under open admission) learns the
    session secret from its sealed JoinAccept."""
    if link.peer is not None and link.peer.kind in (CredentialKind.TOKEN, CredentialKind.OPEN):
        return dataclasses.replace(reply, session_secret=secret)
    return reply
