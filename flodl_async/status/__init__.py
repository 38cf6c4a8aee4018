"""Run status: the snapshot model, the run's events, the board that serves and streams them, the
metrics and the dashboard page.

``model`` is pure data and its JSON form; ``events`` the typed events of a run and the chronicle
that derives them from snapshots; ``board`` holds the latest encoded snapshot, the event history
and their subscribers; ``metrics`` renders ``/metrics`` (``prometheus_client`` is imported on the
first scrape only); ``page`` loads the dashboard (``/``) from package data. The HTTP endpoints
live in :mod:`flodl_async.net.http`: ``net/`` is the only code that opens a socket. ``flodl
status`` imports this package without asyncio (the board defers it).

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
