"""``flodl-agent --persist``: one host's long-lived dial-in agent, serving run after run.

Theory of operation. The daemon runs one :class:`HostSession` at a time. A
session joins a run's window, serves it and returns (or raises); everything of
that run — its ranks, its runtime entry, its sockets — is gone when it has
returned, because the session's own ``finally`` removes it. Then the daemon
dials again for the next run. While no controller answers (none is up yet, the
last run's controller is closing, a window refused us), it waits out a capped
exponential backoff with jitter (:mod:`flodl_async.control.backoff`) and retries; a run
it joined resets the schedule.

Only a usage problem ends the daemon (exit 2, the one-run agent's code). A
controller whose handshake proof does not verify is not our controller, or holds
another token: the agent cannot tell which, and either may mend (the impostor
goes away, the token is fixed), while exiting would let anyone who can answer at
the controller's address — a local user binding the port between runs, a host on
the path — stop every agent of the fleet for good. So it backs off like any
failure (capped, with jitter: a wrong token is refused at most once per
``--reconnect-max`` seconds once the schedule has grown) and warns each time
(:data:`~flodl_async.agent.failures.PERSIST_RETRY_LEVELS`).

Under systemd (``Type=notify``) the daemon says ``READY=1`` as soon as it is up and
waiting for a controller — before its first dial, not when a controller first
answers — so a unit whose controller is down for a while never hits its start
timeout while the daemon backs off; ``STATUS=`` says whom it waits for and when it
dials again. Each session then reports its own steps as a one-run agent does.

Signals: the first SIGTERM/SIGINT stops the current session as a one-run agent
stops (its ranks by the signal table), or ends the backoff wait at once; the
daemon then exits 143 / 130. A second signal kills the ranks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
from collections.abc import Callable

from ..control.backoff import Backoff, BackoffPolicy
from ..errors import AgentError
from ..net.signals import StopSignals
from ..verdict import ExitCode, exit_code_for_signal
from .endings import Ending
from .failures import failure_line, persist_exit_code, persist_retry_level, session_failure
from .join import SessionConfig
from .lifecycle import SessionObserver, ignore
from .output import RankOutput
from .session import HostSession

log = logging.getLogger("flodl_async.agent")


class PersistentAgent:
    """Serves runs until stopped; :meth:`run` returns the exit code."""

    def __init__(
        self,
        config: SessionConfig,
        *,
        policy: BackoffPolicy,
        output: RankOutput | None = None,
        rng: random.Random | None = None,
        observer: SessionObserver = ignore,
        ready: Callable[[str], object] = lambda status: None,
        status: Callable[[str], object] = lambda status: None,
    ) -> None:
        """``ready`` / ``status``: the daemon's own notifications (systemd's READY=1 and STATUS=,
        under a unit)."""
        self.config = config
        self._ready = ready
        self._status = status
        self._output = output
        self._observer = observer  # every session's (systemd's notifier under a unit)
        self._backoff = Backoff(policy)
        self._rng = rng or random.SystemRandom()
        self._stop = asyncio.Event()
        self._signal: int | None = None
        self._session: HostSession | None = None
        self.runs_served = 0

    def stopping(self) -> bool:
        """A stop signal has arrived."""
        return self._signal is not None

    def request_stop(self, sig: int) -> None:
        """First signal: stop the session (if any) and leave."""
        if self._signal is not None:
            return
        self._signal = sig
        self._stop.set()
        if self._session is not None:
            self._session.request_stop(sig)

    def force_stop(self) -> None:
        """Second signal: kill the current session's ranks now."""
        if self._session is not None:
            self._session.force_stop()

    async def run(self) -> ExitCode:
        """Join, serve, reconnect — until a signal or an error not worth retrying."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        # Up, signal handlers in place, about to dial: ready, whether or not a controller answers.
        self._ready(f"waiting for a controller at {cfg.controller_addr}")
        while not self.stopping():
            session = HostSession(cfg, output=self._output, observer=self._observer)
            self._session = session
            try:
                outcome = await session.run()
            except (Exception, BaseExceptionGroup) as exc:
                failure = session_failure(exc, cfg)
                if failure is None:
                    raise
                if self.stopping():
                    break
                line = failure_line(failure, cfg.controller_addr).removeprefix("flodl-agent: ")
                code = persist_exit_code(failure)
                if code is not None:
                    log.error("%s", line)
                    return code
                assert isinstance(failure, AgentError)
                level = persist_retry_level(failure)
                reason = failure.reason
                # a loud one carries what to check too: each time, so it cannot go unheard
                said = line if level > logging.INFO else f"agent {cfg.host}: {reason}"
            else:
                if outcome.ending is Ending.STOPPED:
                    break
                self.runs_served += 1
                self._backoff.succeeded()
                level = logging.INFO
                reason = f"the run {outcome.ending.value}: {outcome.reason}"
                said = f"agent {cfg.host}: {reason}"
            finally:
                self._session = None
            at = self._backoff.failed(loop.time(), self._rng.random())
            delay = max(0.0, at - loop.time())
            log.log(level, "%s; dialing %s again in %.1fs", said, cfg.controller_addr, delay)
            self._status(
                f"waiting for a controller at {cfg.controller_addr} (dialing again in "
                f"{delay:.1f}s; last: {reason})"
            )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._stop.wait()
        sig = self._signal or signal.SIGTERM
        log.info(
            "agent %s: %s: stopped after serving %d run(s)",
            cfg.host,
            signal.Signals(sig).name,
            self.runs_served,
        )
        return exit_code_for_signal(sig)


async def serve_persistently(agent: PersistentAgent) -> ExitCode:
    """Run ``agent`` with SIGTERM/SIGINT wired: the first stops gracefully, the second forces."""

    def forced(sig: signal.Signals) -> None:
        log.warning("second signal (%s): killing this host's ranks now", sig.name)
        agent.force_stop()

    with StopSignals(agent.request_stop, forced):
        return await agent.run()
