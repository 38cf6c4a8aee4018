"""The join link's question about a store connection from an agent's host, and its answer.

The controller's port store serves another host's connection only once that host's agent, the
one process that can ask its kernel, has said the run made it
(:mod:`flodl_async.net.portstore`). Kinds are of the join group (:mod:`.messages`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .schema import Message, message


@message(kind=0x0111)
@dataclass(frozen=True, slots=True, kw_only=True)
class StoreOwnerQuery(Message):
    """Who made the TCP connection from ``peer_host:peer_port`` (an address of the agent's host)
    to ``our_host:our_port``, as the controller sees it."""

    query: int
    peer_host: str
    peer_port: int
    our_host: str
    our_port: int


@message(kind=0x0112)
@dataclass(frozen=True, slots=True, kw_only=True)
class StoreOwnerAnswer(Message):
    """The agent's store gate on :class:`StoreOwnerQuery` ``query``: ``standing`` is a
    :class:`~flodl_async.net.storegate.Standing` value (``served``: one of its ranks or their
    children; ``remote``: its kernel does not have that socket, a NAT between; any other: the
    refusal's counter); ``detail``: a refused peer in the agent's words (its user, its process)."""

    query: int
    standing: str
    detail: str = ""
