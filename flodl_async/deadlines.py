"""Every deadline of a run, resolved once at start-up and passed down.

Network deadlines scale with one knob, ``FLODL_NET_TIMEOUT_SCALE`` (a slow or
loaded machine sets 2 or 3); the stop grace is the operator's own seconds and is
not scaled, nor are a Trainer rank's heartbeat cadence and teardown bounds
(``_UNSCALED`` says why). Nothing else in the code base holds a timeout literal: components
take a :class:`Deadlines` (or one of its fields) from whoever built them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import ConfigError

SCALE_VARIABLE = "FLODL_NET_TIMEOUT_SCALE"
#: Seconds between the first stop signal and KILL, unless the operator says otherwise.
DEFAULT_STOP_GRACE = 10.0


def timeout_scale(env: Mapping[str, str] | None = None) -> float:
    """The deadline multiplier from the environment (default 1.0; finite and at least 0.1)."""
    env = os.environ if env is None else env
    raw = env.get(SCALE_VARIABLE, "").strip()
    if not raw:
        return 1.0
    try:
        scale = float(raw)
    except ValueError:
        scale = math.nan
    if not math.isfinite(scale) or scale < 0.1:
        raise ConfigError(
            f"{SCALE_VARIABLE}={raw!r} must be a finite number of at least 0.1 (it multiplies "
            "every network deadline)"
        )
    return scale


#: Fields :meth:`Deadlines.resolve` leaves as they are. The stop grace is the operator's own
#: seconds. A Trainer rank's heartbeat cadence and its teardown bounds have always been plain
#: seconds: the beat only has to come well inside the coordinator's silence window, which is what
#: scales (the Trainer's ``heartbeat_timeout`` times the scale), and the teardown bounds a process
#: already leaving; scaling them would change how a slow machine behaves.
_UNSCALED = frozenset(
    {"scale", "stop_grace", "rank_heartbeat_interval", "rank_farewell", "rank_link_exit"}
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Deadlines:
    """Seconds, already scaled. Build with :meth:`resolve`; the defaults are the unscaled values."""

    scale: float = 1.0
    #: A new connection must send its channel magic within this.
    sniff: float = 5.0
    #: A framed connection must finish its handshake (hello, proofs) within this, on every channel.
    handshake: float = 5.0
    #: A status HTTP request must arrive whole within this.
    http_request: float = 5.0
    #: The controller waits this long for a joining agent's hello.
    join_handshake: float = 10.0
    #: An agent waits this long for the answer to its hello.
    join_reply: float = 30.0
    #: Added to the window's cap while an admitted agent waits for WorldFormed.
    formation_margin: float = 30.0
    #: The store host must report its store within this after OpenRound.
    store_ready: float = 120.0
    #: Added to the stop grace while the controller waits for RanksStopped.
    stop_ack_margin: float = 10.0
    #: Added to the stop grace while teardown waits for agents to leave.
    teardown_margin: float = 5.0
    #: Seconds between heartbeats on an agent's join link, both ways (flodl_async.control.liveness).
    heartbeat_interval: float = 2.0
    #: A join link whose peer sent nothing (no heartbeat, no message) for this long is lost: a
    #: frozen host, a pulled cable.
    heartbeat_silence: float = 10.0
    #: A link's graceful close before it is aborted.
    link_close: float = 1.0
    #: Reading a rank's last output after it exited.
    output_drain: float = 2.0
    #: A partial line (a progress bar before its newline) is forwarded once it waited this long.
    output_idle: float = 0.1
    #: The torch-backend store child gets this after its stdin closes before KILL (it holds no state
    #: worth saving).
    store_stop: float = 2.0
    #: An ssh connection to a worker (TCP, host key, login), and then its agent's hello line, each
    #: within this.
    ssh_connect: float = 15.0
    #: Every rank of the formed world must say TrainerHello within this of the first.
    trainer_hello: float = 120.0
    #: A reduce round in flight longer than this is a stall; a rank waits as long for a round's
    #: consensus before it calls the coordinator lost.
    reduce_stall: float = 120.0
    #: A Trainer rank must be welcomed (and its data link open) within this of dialling its relay:
    #: the coordinator welcomes no rank before every rank said hello, so it exceeds trainer_hello.
    trainer_welcome: float = 150.0
    #: Seconds between a Trainer rank's heartbeats to the coordinator (not scaled, see
    #: ``_UNSCALED``).
    rank_heartbeat_interval: float = 1.0
    #: A Trainer rank's goodbye (``Exiting``) gets this to leave before its links close (not
    #: scaled).
    rank_farewell: float = 2.0
    #: A Trainer rank waits this long for its link thread to end after asking it to close (not
    #: scaled).
    rank_link_exit: float = 10.0
    #: A rank the coordinator declared dead gets this to exit by itself before its agent KILLs it:
    #: a rank that raised is still writing its traceback and last line when its death record
    #: arrives; a frozen or lying one is KILLed once it runs out.
    dead_rank_grace: float = 3.0
    #: Seconds from the first stop signal to KILL (operator's seconds, not scaled).
    stop_grace: float = DEFAULT_STOP_GRACE

    @classmethod
    def resolve(
        cls, *, stop_grace: float = DEFAULT_STOP_GRACE, env: Mapping[str, str] | None = None
    ) -> Deadlines:
        """The defaults scaled by ``FLODL_NET_TIMEOUT_SCALE`` from ``env`` (default:
        ``os.environ``)."""
        scale = timeout_scale(env)
        base = cls()
        scaled = {
            f.name: getattr(base, f.name) * scale
            for f in dataclasses.fields(cls)
            if f.name not in _UNSCALED
        }
        return cls(scale=scale, stop_grace=stop_grace, **scaled)
