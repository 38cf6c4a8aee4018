"""One host's asyncio shell in a run: its session, rank processes, store, output and CLI.

``session`` (one host, one run: the command table; it pumps ``join``, which dials, joins and
awaits the world, and ``endings``, the pure core that decides how the session ends), ``ranks``
(rank processes: spawn with the torchrun environment, watch, report, stop), ``storehost`` (the
store host's per-round TCPStore), ``output`` and ``outputlines`` (rank output to the console and
logs, or up the join link), ``daemon`` and ``systemd`` (the persistent dial-in agent),
``failures`` (an error's verdict line and exit code), ``cli`` (``flodl-agent``, also ``python -m
flodl_async.agent``). Started over ssh, it imports only its join path first (torch, asyncssh,
the controller never).

May import: _lazy, _version, verdict, errors, wire, deadlines, host, control, net, config, relay.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_names

#: Public name -> its module, loaded on first use (PEP 562): the launcher's early start imports
#: :mod:`.rankargv` alone, not the session and the wire's messages.
_LAZY = {
    "Ending": "endings",
    "SessionOutcome": "endings",
    "SessionConfig": "join",
    "device_labels": "join",
    "RankOutput": "output",
    "HostSession": "session",
}

if TYPE_CHECKING:
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

__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__, globals())
