"""One host's asyncio shell in a run: its session, rank processes, store, output and CLI.

``session`` (one host, one run: the command table; it pumps ``join``, which dials, joins and
awaits the world, and ``endings``, the pure core that decides how the session ends), ``ranks``
(rank processes: spawn with the torchrun environment, watch, report, stop), ``storehost`` (the
store host's per-round TCPStore), ``output`` and ``outputlines`` (rank output to the console and
logs, or up the join link), ``daemon`` and ``systemd`` (the persistent dial-in agent),
``failures`` (an error's verdict line and exit code), ``cli`` (``flodl-agent``, also ``python -m
flodl_async.agent``). Started over ssh, it imports only its join path first (torch, asyncssh,
the controller never).

May import: _version, verdict, errors, wire, deadlines, host, control, net, config, relay.
"""

from .endings import Ending, SessionOutcome
from .join import SessionConfig, device_labels
from .output import RankOutput
from .session import HostSession

__all__ = [
    "Ending",
    "HostSession",
    "RankOutput",
    "SessionConfig",
    "SessionOutcome",
    "device_labels",
]
