"""How a host session's serving phase ends: which ending stands, and which KILL deadline applies.

Theory of operation. An ending is anything that stops every rank of the host and then ends the
session: the controller's ``Finish`` or ``Abort``, a signal to this process, the controller lost
(the join link broke, the controller went silent, the relay's upstream link went silent), or a
failure of the session's own work (the relay's upstream link would not open, a round command
failed). :class:`Endings` takes each one as an event, with ``now``, and answers with a
:class:`Stop` for the shell to carry out, or None when the event changes nothing:

- **The first ending decides the outcome.** Its result (a :class:`SessionOutcome`, or the
  :class:`~flodl_async.errors.AgentError` the session raises) stands, whatever follows; only it
  is told to the session's observer (:attr:`Stop.stands`).
- **The shortest KILL wins.** A later ending still runs its stop beside the first one, so its
  KILL deadline applies too: the KILL comes at the earliest deadline any ending offered
  (:attr:`Standing.kill_at`). A later, longer one changes nothing of the ranks' fate.
- **A lost controller once an ending stands is no news**: the controller closes the join link
  after its ``Finish``, and stops beating once the run ends, so those signs are dropped; a signal
  while a signal's ending stands is the same signal again (a second one is the shell's force-KILL,
  not an ending).
- **The session is over** when the first stop reports every rank gone (:meth:`Endings.stopped`).

Pure: imports neither ``asyncio`` nor ``socket`` (only the wire messages, the stop schedules and
the error types); the clock is passed in. The session shell (:mod:`flodl_async.agent.session`)
feeds the events and runs the stops.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, replace
from typing import Protocol

from ..errors import AgentError, ControllerLost
from ..verdict import StopStep, rank_signal_for, stop_schedule
from ..wire import messages as m


class Ending(enum.Enum):
    """How a session ended without an error."""

    FINISHED = "finished"  # Finish: the run succeeded
    # Abort: the controller ended the run (a failure elsewhere, or the launcher was stopped)
    ABORTED = "aborted"
    STOPPED = "stopped"  # this process was told to stop (a signal)


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionOutcome:
    """What :meth:`HostSession.run <flodl_async.agent.session.HostSession.run>` returns: how it
    ended, why, and the signal for ``STOPPED``."""

    ending: Ending
    reason: str
    signal: int | None = None
    #: The run's verdict as the controller's ``Abort`` carried it (None: not said).
    exit_code: int | None = None


#: What an ending decides: the outcome returned, or the error raised.
Result = SessionOutcome | AgentError


def stopped_by(sig: int, *, when: str = "") -> SessionOutcome:
    """The outcome of a signal to this process; ``when`` says at which step it came, if not
    while serving."""
    name = signal.Signals(sig).name
    return SessionOutcome(
        ending=Ending.STOPPED, reason=f"stopped by {name}{' ' + when if when else ''}", signal=sig
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Offer:
    """What one ending event brings: its result, and the stop it asks of every rank."""

    result: Result
    schedule: tuple[StopStep, ...]


class EndingEvent(Protocol):
    """Something that ends the session (the events below)."""

    def offer(self, *, host: str, stop_grace: float) -> Offer:
        """The result and stop this ending brings to host ``host``."""
        ...

    def repeats(self, standing: Result) -> bool:
        """Nothing new once ``standing`` decided the outcome: the event is dropped."""
        ...


def _lost(stop_grace: float) -> tuple[StopStep, ...]:
    # TERM first: a rank that saves on TERM still can, with the whole stop grace before the KILL.
    return stop_schedule(signal.SIGTERM, stop_grace)


@dataclass(frozen=True, slots=True, kw_only=True)
class Finished:
    """The controller's ``Finish``: the run succeeded; ranks get TERM, KILL at the stop grace."""

    command: m.Finish

    def offer(self, *, host: str, stop_grace: float) -> Offer:
        """Ends ``FINISHED`` with the command's reason."""
        return Offer(
            result=SessionOutcome(ending=Ending.FINISHED, reason=self.command.reason),
            schedule=stop_schedule(signal.SIGTERM, stop_grace),
        )

    def repeats(self, standing: Result) -> bool:
        """Never: its stop runs even after another ending."""
        return False


@dataclass(frozen=True, slots=True, kw_only=True)
class Aborted:
    """The controller's ``Abort``: its own first signal and grace (0: KILL now)."""

    command: m.Abort

    def offer(self, *, host: str, stop_grace: float) -> Offer:
        """Ends ``ABORTED`` with the command's reason, by the command's schedule."""
        return Offer(
            result=SessionOutcome(
                ending=Ending.ABORTED,
                reason=self.command.reason,
                exit_code=self.command.exit_code,
            ),
            schedule=stop_schedule(self.command.first_signal, self.command.grace_s),
        )

    def repeats(self, standing: Result) -> bool:
        """Never: a later ``Abort`` with a short grace is how the controller hurries a stop."""
        return False


@dataclass(frozen=True, slots=True, kw_only=True)
class Signalled:
    """A signal to this process: ranks get the signal table's first signal (SIGINT for SIGINT,
    else TERM), KILL at the stop grace."""

    sig: int

    def offer(self, *, host: str, stop_grace: float) -> Offer:
        """Ends ``STOPPED`` with the signal."""
        return Offer(
            result=stopped_by(self.sig),
            schedule=stop_schedule(rank_signal_for(self.sig), stop_grace),
        )

    def repeats(self, standing: Result) -> bool:
        """A signal's ending stands already: this is that signal, seen a second way."""
        return isinstance(standing, SessionOutcome) and standing.ending is Ending.STOPPED


@dataclass(frozen=True, slots=True, kw_only=True)
class ControllerGone:
    """The controller is lost (build with :meth:`link_lost`, :meth:`silent` or
    :meth:`relay_silent`): :class:`~flodl_async.errors.ControllerLost`, TERM first."""

    reason: str

    @classmethod
    def link_lost(cls, detail: str) -> ControllerGone:
        """Reading the join link failed (closed by the peer, or a bad frame)."""
        return cls(
            reason=f"lost the join link to the controller ({detail}); stopping this host's ranks"
        )

    @classmethod
    def silent(cls, controller: str, silence: float) -> ControllerGone:
        """The controller sent nothing on the join link for the whole silence deadline (a frozen
        launcher or a pulled cable leaves the link open)."""
        return cls(
            reason=f"the controller at {controller} sent nothing for {silence:g}s (frozen, down "
            "or cut off); stopping this host's ranks"
        )

    @classmethod
    def relay_silent(cls, reason: str) -> ControllerGone:
        """The relay's upstream control link went silent (``reason`` is the relay's)."""
        return cls(reason=f"{reason} (frozen, down or cut off); stopping this host's ranks")

    def offer(self, *, host: str, stop_grace: float) -> Offer:
        """Raises :class:`~flodl_async.errors.ControllerLost`."""
        return Offer(result=ControllerLost(host, self.reason), schedule=_lost(stop_grace))

    def repeats(self, standing: Result) -> bool:
        """Always: once an ending stands, the controller going away is expected."""
        return True


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayFailed:
    """The relay's upstream link to ``controller`` would not open."""

    controller: str
    detail: str

    def offer(self, *, host: str, stop_grace: float) -> Offer:
        """Raises :class:`~flodl_async.errors.ControllerLost`."""
        reason = f"cannot open the relay's upstream link to {self.controller}: {self.detail}"
        return Offer(result=ControllerLost(host, reason), schedule=_lost(stop_grace))

    def repeats(self, standing: Result) -> bool:
        """Never: its stop runs even after another ending."""
        return False


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundFailed:
    """A round command's work (``name``) failed with ``detail``."""

    name: str
    detail: str

    def offer(self, *, host: str, stop_grace: float) -> Offer:
        """Raises :class:`~flodl_async.errors.AgentError`."""
        reason = f"{self.name} failed: {self.detail}"
        return Offer(result=AgentError(host, reason), schedule=_lost(stop_grace))

    def repeats(self, standing: Result) -> bool:
        """Never: its stop runs even after another ending."""
        return False


@dataclass(frozen=True, slots=True, kw_only=True)
class Stop:
    """What the shell does for one ending: stop every rank by ``schedule``, then end the session
    (:meth:`Endings.stopped`)."""

    schedule: tuple[StopStep, ...]
    #: This is the first ending: its result stands; tell the observer (``reason``).
    stands: bool
    #: Why this ending came (its result's reason).
    reason: str
    #: The KILL deadline in force after this ending (on the clock ``now`` was read from).
    kill_at: float
    #: A later ending whose KILL comes before the one in force.
    sooner: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Standing:
    """The ending that decided the outcome, and what the later ones changed."""

    result: Result
    #: The earliest KILL deadline offered by any ending so far.
    kill_at: float
    #: The first stop reported every rank gone: the session is over.
    over: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Endings:
    """One serving session's endings (build with its host and stop grace; advance with
    :meth:`end` and :meth:`stopped`, each returning a new one)."""

    host: str
    #: Seconds from TERM to KILL for endings that carry no grace of their own.
    stop_grace: float
    #: None until the first ending.
    standing: Standing | None = None

    @property
    def ending(self) -> bool:
        """An ending stands: no new round work starts."""
        return self.standing is not None

    @property
    def result(self) -> Result | None:
        """The outcome that stands (an :class:`~flodl_async.errors.AgentError` to raise), if any."""
        return None if self.standing is None else self.standing.result

    def end(self, event: EndingEvent, now: float) -> tuple[Endings, Stop | None]:
        """Take ``event`` at ``now``: the stop to run, or None when it changes nothing."""
        offer = event.offer(host=self.host, stop_grace=self.stop_grace)
        kill_at = now + offer.schedule[-1].after
        standing = self.standing
        if standing is None:
            stop = Stop(
                schedule=offer.schedule,
                stands=True,
                reason=offer.result.reason,
                kill_at=kill_at,
                sooner=False,
            )
            return replace(self, standing=Standing(result=offer.result, kill_at=kill_at)), stop
        if event.repeats(standing.result):
            return self, None
        sooner = kill_at < standing.kill_at
        kept = replace(standing, kill_at=min(kill_at, standing.kill_at))
        stop = Stop(
            schedule=offer.schedule,
            stands=False,
            reason=offer.result.reason,
            kill_at=kept.kill_at,
            sooner=sooner,
        )
        return replace(self, standing=kept), stop

    def stopped(self) -> tuple[Endings, bool]:
        """A stop returned with its ranks gone: whether the session is over only now (the first
        one to return ends it; a stop only runs once an ending stands)."""
        standing = self.standing
        if standing is None or standing.over:
            return self, False
        return replace(self, standing=replace(standing, over=True)), True
