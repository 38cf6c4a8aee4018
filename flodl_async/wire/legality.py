"""Which message kinds are legal on which channel, in which direction: one table.

Theory of operation. Frame keys already bind a frame to its channel and
direction, so a peer cannot move a frame between them; this table bounds what
a *keyed* peer may say on a link at all. :class:`~.frame.FrameConnection`
enforces it from its channel and side: a received frame of a kind outside its
row raises :class:`~flodl_async.errors.IllegalKind` once its tag and sequence
number verified (before msgpack sees the body), and sending one raises
``TypeError``, because that is a bug in our own code, not a fault of the peer.

The rows are how the messages are used:

* join — the agent's host link, open for the run: the agent joins and reports
  its ranks' exits, output and activity (``RankStats``); the controller admits, forms the world and
  drives rounds, and asks the agent who made a store connection from its host
  (``StoreOwnerQuery``/``StoreOwnerAnswer``).
* rendezvous — the store host's agent reports where its store listens; nothing
  comes back down.
* control — ranks' hello and heartbeats, and the Trainer's coordinator protocol
  (hello/welcome, plans, window reports, reduces, epoch metrics, deaths, shutdown;
  ``RankGone`` is the relay's own report of a rank it lost). A host's relay terminates its
  ranks' links as the *controller* side of a unix-socket connection and forwards up as the
  *peer* side, so both hops read the same two rows.
* data — the Trainer's averaging, tensors up and the consensus down: a rank's
  ``DataHello``/``Contribution`` to its relay, the relay's ``HostDataHello``/``HostContribution``
  to the controller (a relay is the peer side of both hops, as on control),
  ``DataWelcome``/``Consensus`` back down.

``Heartbeat`` is legal both ways on join and control. A new message is added
to its row here, or it cannot be sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from .channels import Channel
from .keys import Direction
from .messages import (
    Abort,
    Consensus,
    Contribution,
    DataHello,
    DataWelcome,
    DeclareDead,
    EpochAggregated,
    Exiting,
    Finish,
    Heartbeat,
    HostContribution,
    HostDataHello,
    Intent,
    JoinAccept,
    JoinHello,
    JoinReject,
    OpenRound,
    Plan,
    RankExited,
    RankGone,
    RankHello,
    RankOutput,
    RanksStopped,
    RankStateSaved,
    RankStats,
    RankWelcome,
    Reduce,
    ReduceDone,
    RendezvousHello,
    Shutdown,
    SignalRanks,
    StartRanks,
    StopRanks,
    StoreAddress,
    TrainerHello,
    TrainerReject,
    TrainerWelcome,
    WindowDone,
    WorldFormed,
)
from .restarts import Readmitted, RestartRank
from .scalars import Report
from .schema import Message
from .storeowner import StoreOwnerAnswer, StoreOwnerQuery

UP = Direction.TO_CONTROLLER
DOWN = Direction.FROM_CONTROLLER

#: (channel, direction) → the message classes a frame travelling that way may carry.
LEGAL_KINDS: Mapping[tuple[Channel, Direction], frozenset[type[Message]]] = MappingProxyType(
    {
        (Channel.JOIN, UP): frozenset(
            {
                JoinHello,
                RankExited,
                RankOutput,
                RankStats,
                RanksStopped,
                Heartbeat,
                StoreOwnerAnswer,
            }
        ),
        (Channel.JOIN, DOWN): frozenset(
            {
                JoinAccept,
                JoinReject,
                WorldFormed,
                OpenRound,
                StartRanks,
                StopRanks,
                RestartRank,
                Abort,
                Finish,
                SignalRanks,
                Heartbeat,
                StoreOwnerQuery,
            }
        ),
        (Channel.RENDEZVOUS, UP): frozenset({RendezvousHello, StoreAddress}),
        (Channel.RENDEZVOUS, DOWN): frozenset(),
        (Channel.CONTROL, UP): frozenset(
            {
                RankHello,
                Heartbeat,
                TrainerHello,
                WindowDone,
                ReduceDone,
                RankGone,
                Exiting,
                Intent,
                RankStateSaved,
                Report,
            }
        ),
        (Channel.CONTROL, DOWN): frozenset(
            {
                RankWelcome,
                Heartbeat,
                TrainerWelcome,
                TrainerReject,
                Plan,
                Reduce,
                EpochAggregated,
                DeclareDead,
                Readmitted,
                Shutdown,
            }
        ),
        (Channel.DATA, UP): frozenset({DataHello, HostDataHello, Contribution, HostContribution}),
        (Channel.DATA, DOWN): frozenset({DataWelcome, Consensus}),
    }
)


def legal_kinds(channel: Channel, direction: Direction) -> frozenset[int]:
    """The kind numbers legal on ``channel`` travelling ``direction`` (what the codec checks per
    frame)."""
    return frozenset(cls.KIND for cls in LEGAL_KINDS[(channel, direction)])
