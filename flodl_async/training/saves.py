"""When the coordinator writes a checkpoint bundle, and where a resumed run starts: pure decisions.

Theory of operation. A bundle holds a consensus, so it can only be taken at a reduce boundary. The
coordinator asks :meth:`SaveClock.due` as it fires each ``model`` round: the round is marked a
checkpoint round (its ``Reduce`` carries ``checkpoint``, so every rank writes its optimizer and RNG
state after applying that round's consensus; the reducer keeps a copy of it) when

* a request is pending (``await run.checkpoint()`` in any process, ``Worker.request_checkpoint()``),
* the round closes the ``every_epochs``-th epoch since the start,
* ``every_rounds`` model rounds fired since the last bundle,
* ``every_seconds`` passed since the last bundle (or since training started),

in that order of precedence for the bundle's reason. The end and the failure paths are the
coordinator's own (``end``, ``shutdown``, ``preempt``, ``max_failure_exceeded``, ``stall``,
``all_lost``); they go through :meth:`SaveClock.saved` too, so the intervals count from the last
bundle of any reason.
A wall-clock interval is fine here (unlike the reduce gate's count-based rule): it only says which
round is marked, never whether a round happens.

:class:`ResumePoint` is what the coordinator starts from when a run resumes: the bundle's round,
epoch, global step, the batches of the interrupted epoch already in the consensus, and ElChe's
state when the world size matches. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .elche import ElCheState
from .partition import Range
from .spec import Checkpointing

#: The bundle reasons the coordinator gives (the values of ``flodl_async.checkpoint.Reason``).
EPOCH, ROUND, TIME, END, SHUTDOWN, REQUEST = "epoch", "round", "time", "end", "shutdown", "request"
PREEMPT = "preempt"
MAX_FAILURE, STALL, ALL_LOST = "max_failure_exceeded", "stall", "all_lost"

#: The ``Intent`` kind of a rank's checkpoint request (``run.checkpoint()``,
#: ``Worker.request_checkpoint()``).
INTENT = "checkpoint"

#: A run that ends on a failure saves its last consensus under this reason (keyed by the
#: ``Shutdown.save_reason`` the death chain and the stall deadline give).
FAILURE_REASONS: Mapping[str, str] = {
    "max_failure_exceeded": MAX_FAILURE,
    "reduce_stall": STALL,
    "all_ranks_lost": ALL_LOST,
}


class SaveClock:
    """Which model round is a checkpoint round; ``now`` passed in."""

    def __init__(self, config: Checkpointing) -> None:
        self.config = config
        self._since: float | None = None
        self._rounds = 0
        self._requested = False

    @property
    def enabled(self) -> bool:
        """Bundles are written at all (a ``save_path``)."""
        return self.config.save_path is not None

    @property
    def requested(self) -> bool:
        """A request waits for the next reduce boundary."""
        return self._requested

    def started(self, now: float) -> None:
        """Training started (``every_seconds`` counts from here until the first bundle)."""
        if self._since is None:
            self._since = now

    def request(self) -> bool:
        """A checkpoint was asked for; False when nothing can be written (no ``save_path``)."""
        if not self.enabled:
            return False
        self._requested = True
        return True

    def due(self, *, closes_epoch: int | None, now: float) -> str | None:
        """A ``model`` round fires now (``closes_epoch``: the epoch it closes, counted from 0, if
        any): the reason to make it a checkpoint round, or None."""
        if not self.enabled:
            return None
        self._rounds += 1
        config = self.config
        reason = None
        if self._requested:
            reason = REQUEST
        elif (
            config.every_epochs is not None
            and closes_epoch is not None
            and (closes_epoch + 1) % config.every_epochs == 0
        ):
            reason = EPOCH
        elif config.every_rounds is not None and self._rounds >= config.every_rounds:
            reason = ROUND
        elif (
            config.every_seconds is not None
            and self._since is not None
            and now - self._since >= config.every_seconds
        ):
            reason = TIME
        if reason is not None:
            self.saved(now)
        return reason

    def saved(self, now: float) -> None:
        """A bundle of any reason was marked: the intervals count from here."""
        self._since = now
        self._rounds = 0
        self._requested = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumePoint:
    """Where a resumed run starts: the bundle's counters, and what of its epoch is trained."""

    #: The bundle's name (the run's ranks restore their own state files from it).
    bundle: str
    #: The round whose consensus the bundle holds; the run's next round is ``round + 1``.
    round: int
    #: Epochs completed: the run goes on with epoch ``epoch`` (counted from 0).
    epoch: int
    global_step: int
    #: Batch ranges of epoch ``epoch`` the consensus already holds (empty at an epoch boundary).
    coverage: tuple[Range, ...] = ()
    #: ElChe's state (None: a different world size, or none was saved).
    elche: ElCheState | None = None
    #: Whether each rank restores its optimizer and RNG state (same world size, saved).
    rank_state: bool = False


@dataclass(slots=True)
class SaveBook:
    """The coordinator's checkpoint bookkeeping: the rounds marked and a resumed run's bases."""

    #: Local round -> the bundle reason of each checkpoint round not committed yet.
    pending: dict[int, str] = field(default_factory=dict)
    #: The last model round committed, and the last round a bundle was marked for (local rounds).
    last_model_round: int = 0
    last_saved_round: int = -1
    #: A resumed run's rounds and steps continue the bundle's (its own rounds still start at 1 on
    #: the wire: the reducer and the relays know only this run).
    round_base: int = 0
    step_base: int = 0
    #: The resumed epoch, and its batches the bundle's consensus already held.
    resume_epoch: int = -1
    resumed_coverage: tuple[Range, ...] = ()
    #: A checkpoint asked for before training started (its first reduce takes it).
    early_request: bool = False

    @classmethod
    def resuming(cls, resume: ResumePoint | None) -> SaveBook:
        """The book of a run started fresh (None) or from ``resume``."""
        if resume is None:
            return cls()
        return cls(
            round_base=resume.round,
            step_base=resume.global_step,
            resume_epoch=resume.epoch,
            resumed_coverage=resume.coverage,
        )
