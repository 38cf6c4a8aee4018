"""Run status: the snapshot model, the board that serves and streams it, and the dashboard page.

``model`` is pure data and its JSON form; ``board`` holds the latest encoded snapshot and its
subscribers; ``page`` loads the dashboard (``/``) from package data. The HTTP endpoints live in
:mod:`flodl_async.net.http`: ``net/`` is the only code that opens a socket. ``flodl status``
imports this package without asyncio (the board defers it).

May import: errors.
"""

from __future__ import annotations

from .board import (
    COUNTERS_INTERVAL,
    DEFAULT_MAXSIZE,
    BoardStatistics,
    StatusBoard,
    Subscription,
    SubscriptionStatistics,
)
from .model import (
    SCHEMA,
    SCHEMA_FAMILY,
    Counters,
    MemberState,
    MemberStatus,
    Phase,
    RankState,
    RankStatus,
    StatusSnapshot,
)
from .page import dashboard_html

__all__ = [
    "COUNTERS_INTERVAL",
    "DEFAULT_MAXSIZE",
    "SCHEMA",
    "SCHEMA_FAMILY",
    "BoardStatistics",
    "Counters",
    "MemberState",
    "MemberStatus",
    "Phase",
    "RankState",
    "RankStatus",
    "StatusBoard",
    "StatusSnapshot",
    "Subscription",
    "SubscriptionStatistics",
    "dashboard_html",
]
