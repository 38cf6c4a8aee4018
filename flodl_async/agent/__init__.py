"""The per-host agent: one host's session in a run, its rank processes, store, output and CLI.

==============  ======================================================================
``session``     :class:`HostSession` — join, the command table, endings (one host, one run)
``ranks``       rank processes: spawn with the torchrun environment, watch, report, stop
``storehost``   the store host's per-round TCPStore
``output``      rank output: to the launcher's console and logs, or up the join link
``cli``         ``flodl-agent`` (also ``python -m flodl_async.agent``)
==============  ======================================================================

The controller imports what it needs from here; the name ``Agent`` is kept for the
long-lived dial-in agent that comes next.
"""

from .join import SessionConfig, device_labels
from .output import RankOutput
from .session import Ending, HostSession, SessionOutcome

__all__ = [
    "Ending",
    "HostSession",
    "RankOutput",
    "SessionConfig",
    "SessionOutcome",
    "device_labels",
]
