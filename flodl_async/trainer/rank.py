"""A Trainer rank: its session (model, hello, links, schedule) and the drivers of its two tiers.

Theory of operation. On the compute side, a rank builds its model on its device, says
``TrainerHello`` through the link thread (:mod:`flodl_async.trainer.link`) and waits for the
welcome; from then on the compute side trains what :class:`~.schedule.RankSchedule` gives it: on a
compute thread of its own (:class:`RankDriver`, the managed tier) or on the user's thread
(:func:`rank_worker`, the cooperative tier). Ending, it says ``Exiting`` and closes its links.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..config.rankenv import INCARNATION_VAR, RUN_ID_VAR
from ..deadlines import Deadlines
from ..errors import ConfigError, CoordinatorLost, FlodlError, TrainingFailed, TrainingStopped
from ..net.signals import PREEMPT_SIGNAL_VAR, preempt_signal
from ..training.metrics import EpochMetrics
from ..training.modelschema import ModelSchema
from ..training.policy import Backend, failure_limit
from ..verdict import ExitCode, RunResult
from ..wire import messages as m
from .collective import ProcessGroup
from .entry import rank_is_primary
from .link import LinkThread
from .rankstate import restore_rank_state
from .schedule import RankSchedule
from .state import RunRequest, TrainedState, on_thread, trained_state
from .worker import Compute, Worker, default_device, run_managed

log = logging.getLogger("flodl_async.trainer.rank")


@dataclass(slots=True)
class _Session:
    compute: Compute
    link: LinkThread
    schedule: RankSchedule
    rank: int
    primary: bool
    group: ProcessGroup | None


def _open_session(request: RunRequest, publish: Callable[[EpochMetrics], None]) -> _Session:
    """Build the model on this rank's device, say hello, wait for the welcome (compute side,
    blocking)."""
    env = os.environ
    rank = int(env["RANK"])
    device = default_device(int(env.get("LOCAL_RANK", "0")))
    compute = Compute(request.compute, device)
    schema = ModelSchema.from_module(compute.model)
    spec_wire, digest = request.spec_wire_and_digest(schema)
    incarnation = int(env.get(INCARNATION_VAR, "0"))  # >0: restarted, it rejoins a run under way
    hello = m.TrainerHello(
        incarnation=incarnation,
        rank=rank,
        spec=spec_wire,
        digest=digest,
        model=schema.to_wire(),
        model_bytes=schema.model_bytes,
        device=str(device),
    )
    deadlines = Deadlines.resolve()
    link = LinkThread(
        hello=hello,
        schema=schema,
        heartbeat_timeout=request.spec.heartbeat_timeout,
        deadlines=deadlines,
    )
    welcome = link.start()
    group = None
    if request.spec.backend is Backend.COLLECTIVE:
        group = ProcessGroup(
            rank,
            device,
            elastic=_survives_a_loss(request, welcome.world_size),
            timeout=deadlines.reduce_stall,
        )
        link.on_declared_dead = group.abort
    try:
        if group is not None:
            group.open()
        schedule = RankSchedule(
            compute,
            link,
            welcome=welcome,
            spec=request.spec,
            schema=schema,
            publish=publish,
            reduce_deadline=deadlines.reduce_stall,
            group=group,
            joining=incarnation > 0,
        )
        _restore(welcome, rank, compute)
    except BaseException:
        # the links are up: a failed start must not leave them (and their thread) open
        link.close(None)
        raise
    return _Session(
        compute=compute,
        link=link,
        schedule=schedule,
        rank=rank,
        primary=rank_is_primary(env),
        group=group,
    )


def _restore(welcome: m.TrainerWelcome, rank: int, compute: Compute) -> None:
    """A resumed run: this rank's optimizer and RNG state from the bundle when the world size
    matches it (the model itself comes with the init round's consensus)."""
    if not welcome.resumed:
        return
    if welcome.restore_rank_state and welcome.resume:
        if restore_rank_state(welcome.resume, rank, compute.optimizer):
            log.info("rank %d: optimizer and RNG state restored from %s", rank, welcome.resume)
        return
    log.warning(
        "rank %d: resuming without its saved optimizer and RNG state (another world size, or the "
        "bundle has none): a fresh inner optimizer",
        rank,
    )


def _survives_a_loss(request: RunRequest, world_size: int) -> bool:
    """Whether the run trains on after a rank is lost (so a COLLECTIVE round keeps what its redo
    needs): more than one rank, and a ``max_failure`` that the first loss does not breach."""
    mf = request.spec.max_failure
    limit = failure_limit(
        world_size=world_size,
        absolute=mf.absolute if mf else None,
        percent=mf.percent if mf else None,
    )
    return world_size > 1 and (limit is None or limit > 1)


def _close_session(session: _Session, farewell: m.Exiting | None) -> None:
    session.link.close(farewell)
    if session.group is not None:
        session.group.close()


class RankDriver:
    """The managed tier in a rank: a compute thread trains what the coordinator plans."""

    def __init__(self, request: RunRequest) -> None:
        self._request = request
        self.run_id = os.environ.get(RUN_ID_VAR, "")
        self.primary = rank_is_primary(os.environ)
        # request_stop (the loop's thread) and the session opening (the compute thread) meet here
        self._lock = threading.Lock()
        self._session: _Session | None = None
        self._stop_wanted = False
        self._checkpoint_wanted = False

    async def run(self, publish: Callable[[EpochMetrics], None]) -> TrainedState:
        leave_preemption_to_the_launcher()

        def train() -> tuple[Mapping[str, Any], bool]:
            session = _open_session(self._request, publish)
            with self._lock:
                self._session, wanted = session, self._stop_wanted
                checkpoint = self._checkpoint_wanted
            if checkpoint:
                _ask_checkpoint(session)
            if wanted:  # asked before the coordinator welcomed this rank
                _ask_stop(session)
            try:
                fields = run_managed(session.compute, session.schedule)
            except BaseException:
                _close_session(session, None)  # fail() already said why
                raise
            _close_session(session, m.Exiting(rank=session.rank, reason="done"))
            return fields, session.primary

        try:
            fields, primary = await on_thread(
                train, name="flodl-compute", on_cancel=self.request_stop
            )
        except (ConfigError, TrainingStopped, CoordinatorLost):
            raise
        except FlodlError as exc:
            raise TrainingFailed(
                RunResult(exit_code=ExitCode.RANK_FAILURE, reason=str(exc))
            ) from exc
        except Exception as exc:
            raise TrainingFailed(
                RunResult(
                    exit_code=ExitCode.RANK_FAILURE,
                    reason=f"rank {os.environ.get('RANK')} raised {exc!r}",
                )
            ) from exc
        return trained_state(fields, primary=primary)

    def request_stop(self) -> None:
        """Ask the coordinator for the orderly stop of the whole run (once; sent as soon as the
        link is up): a final round, and every process returns the state with ``interrupted``."""
        with self._lock:
            if self._stop_wanted:
                return
            self._stop_wanted = True
            session = self._session
        if session is not None:
            _ask_stop(session)

    def force_stop(self) -> None:
        """Forcing a rank is the agent's business (TERM, then KILL): a rank waits for the
        coordinator's end."""

    def request_checkpoint(self) -> None:
        """Ask the coordinator for a checkpoint at the next reduce boundary (sent once the link is
        up; asked before, it goes with the session's start)."""
        with self._lock:
            session = self._session
            if session is None:
                self._checkpoint_wanted = True
                return
        _ask_checkpoint(session)


def _ask_checkpoint(session: _Session) -> None:
    session.schedule.request_checkpoint()


def _ask_stop(session: _Session) -> None:
    session.link.send(m.Intent(rank=session.rank, kind=m.Intent.STOP))


def leave_preemption_to_the_launcher() -> None:
    """A scheduler's preemption signal can reach every process of the job, the ranks too (SLURM's
    ``--signal=USR1@60`` without ``B:``; a ``kill`` of the process group): the launcher takes it
    (a checkpoint, then an orderly stop), and a rank that died of the signal's default action
    would first be counted lost. So a Trainer rank ignores SIGUSR1, SIGUSR2 and the run's
    preemption signal, unless the program installed its own handler for one."""
    try:
        preempt = preempt_signal(os.environ.get(PREEMPT_SIGNAL_VAR), source=PREEMPT_SIGNAL_VAR)
    except ConfigError:
        preempt = signal.SIGUSR1  # the launcher refused it already, and said so
    for sig in {signal.SIGUSR1, signal.SIGUSR2, preempt}:
        try:
            if signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, signal.SIG_IGN)
        except ValueError:  # not the main thread: the program's own loop runs elsewhere
            return


def rank_worker(request: RunRequest) -> Worker:
    """The cooperative tier in a rank: the user's thread is the compute side."""
    inbox: collections.deque[EpochMetrics] = collections.deque()
    session = _open_session(request, inbox.append)

    def finish(fields: Mapping[str, Any]) -> TrainedState:
        session.link.close(m.Exiting(rank=session.rank, reason="done"))
        return trained_state(fields, primary=session.primary)

    return Worker(
        session.compute,
        session.schedule,
        primary=session.primary,
        inbox=inbox,
        finish=finish,
        close=lambda: _close_session(session, None),
    )
