"""The words both decision cores speak: the supervisor (``control``) and the Trainer's coordinator
(``training``).

Each core takes events and returns actions, and most of each vocabulary is its own. Three words
are shared, so that a shell carries them out the same way whichever core said them: the
:class:`Tick` that wakes a core at its ``next_deadline``, the :class:`Announce` of a line for
the operator at a :class:`Level`, and the :class:`Tell` of a message to one peer. Pure: no
asyncio, no socket, no clock.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from ..wire.schema import Message

#: Whom a :class:`Tell` addresses: a host name for the supervisor, a rank for the coordinator.
Peer = TypeVar("Peer")


@dataclass(frozen=True, slots=True, kw_only=True)
class Tick:
    """The core's ``next_deadline`` has passed (nothing else happened)."""


class Level(enum.Enum):
    """How loud an announcement is."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"


#: The ``logging`` level a shell logs each :class:`Level` at.
LOGGING_LEVELS: Final[Mapping[Level, int]] = {
    Level.DEBUG: logging.DEBUG,
    Level.INFO: logging.INFO,
    Level.WARNING: logging.WARNING,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Announce:
    """One line for the operator."""

    text: str
    level: Level = Level.INFO


@dataclass(frozen=True, slots=True, kw_only=True)
class Tell(Generic[Peer]):
    """Send ``message`` to the peer ``to``; the shell knows which link reaches it.

    The supervisor tells hosts (``Tell[str]``, down a host's join link), the coordinator tells
    ranks (``Tell[int]``, through their relays). Build it unsubscripted, ``Tell(to=..., ...)``:
    a subscripted call such as ``Tell[int](...)`` fails on a frozen slotted dataclass.
    """

    to: Peer
    message: Message
