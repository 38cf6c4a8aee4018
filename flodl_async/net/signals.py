"""Stop signals: the first SIGINT or SIGTERM asks for a graceful stop, a second forces it.

Every long-running command stops this way (``flodl-agent``, ``flodl-agent --persist``,
``flodl-launch``, a Trainer's launcher), so the wiring is written once: :class:`StopSignals`
puts a handler for both signals on the running loop for the length of a ``with`` block (the
shape of uvicorn's ``Server.capture_signals``), counts the signals across both, and calls
``graceful(sig)`` for the first and ``forced(sig)`` for each later one. Leaving the block takes
the handlers off the loop again.

A *guest* on someone else's loop (the Trainer's launcher runs on its caller's) takes only what
is free: a signal the application already handles on the loop keeps the application's handler
(the loop holds one per signal, and taking ours off could not give theirs back), a loop that
cannot take handlers (not the main thread's) is left alone, and the Python-level handler that
was there before (``asyncio.run``'s own SIGINT handler, say) is put back afterwards.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from types import FrameType, TracebackType

from ..errors import ConfigError

#: The signals that stop a command (Ctrl-C and ``kill`` / ``systemctl stop``), in install order.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

#: The signals a launcher passes on to its ranks, the run going on (SLURM's ``--signal=USR1@60``,
#: Lightning's requeue): never a stop.
FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)

#: The signal that tells a Trainer run it is about to be preempted (SLURM's ``--signal=USR1@60``):
#: a checkpoint at the next reduce boundary, then an orderly stop (exit 7). ``--preempt-signal``
#: or this variable names another; it must be set before the launcher starts (its handler exists
#: before any Trainer settings arrive).
PREEMPT_SIGNAL_VAR = "FLODL_PREEMPT_SIGNAL"
DEFAULT_PREEMPT_SIGNAL = signal.SIGUSR1

#: Signals that cannot mean a preemption: they already stop (INT, TERM), cannot be caught (KILL,
#: STOP), or come of ordinary life (CHLD, the terminal's and the pipe's).
_NOT_PREEMPT = frozenset(
    {
        signal.SIGINT,
        signal.SIGTERM,
        signal.SIGKILL,
        signal.SIGSTOP,
        signal.SIGCHLD,
        signal.SIGPIPE,
        signal.SIGTSTP,
        signal.SIGTTIN,
        signal.SIGTTOU,
        signal.SIGWINCH,
        signal.SIGCONT,
        signal.SIGSEGV,
        signal.SIGBUS,
        signal.SIGFPE,
        signal.SIGILL,
    }
)


def preempt_signal(text: str | None, *, source: str = "--preempt-signal") -> signal.Signals:
    """The preemption signal ``text`` names (``USR1``, ``SIGUSR2``, ``10``; None or empty: the
    default); a :class:`ConfigError` naming ``source`` for anything else."""
    if text is None or not text.strip():
        return DEFAULT_PREEMPT_SIGNAL
    name = text.strip().upper()
    try:
        sig = (
            signal.Signals(int(name))
            if name.isdigit()
            else signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
        )
    except (KeyError, ValueError):
        raise ConfigError(
            f"{source}: {text!r} is not a signal; give a name such as USR1 or USR2"
        ) from None
    if sig in _NOT_PREEMPT:
        raise ConfigError(
            f"{source}: {sig.name} cannot mean a preemption (it stops, cannot be caught, or comes "
            "of ordinary life); give USR1, USR2 or HUP"
        )
    return sig


#: What a stop signal calls: the signal that came.
OnSignal = Callable[[signal.Signals], None]
#: What ``signal.getsignal`` answers: a Python handler, SIG_DFL / SIG_IGN, or None (a handler not
#: set from Python).
PythonHandler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


class StopSignals:
    """The first stop signal calls ``graceful(sig)``, every later one ``forced(sig)``.

    ``with StopSignals(graceful, forced):`` on the running loop; or :meth:`install` and
    :meth:`restore` where a ``finally`` already orders the teardown. ``guest``: see the
    module's docstring.
    """

    def __init__(self, graceful: OnSignal, forced: OnSignal, *, guest: bool = False) -> None:
        self._graceful = graceful
        self._forced = forced
        self._guest = guest
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Each signal taken, with the Python-level handler to put back (None: none to put back).
        self._taken: list[tuple[signal.Signals, PythonHandler]] = []
        #: Stop signals received so far, across both.
        self.received = 0

    def install(self) -> None:
        """Take the stop signals on the running loop (as a guest, only the free ones)."""
        loop = self._loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            if not self._guest:
                loop.add_signal_handler(sig, self._on_signal, sig)
                self._taken.append((sig, None))
            elif (taken := add_guest_handler(loop, sig, self._on_signal)) is not None:
                self._taken.append(taken)

    def restore(self) -> None:
        """Take our handlers off the loop, and put back the Python-level ones a guest replaced."""
        loop, taken, self._taken = self._loop, self._taken, []
        if loop is None:
            return
        for sig, before in taken:
            loop.remove_signal_handler(sig)
            # None: a handler not set from Python (or a host that took nothing), which cannot be
            # put back
            if before is not None:
                signal.signal(sig, before)

    def _on_signal(self, sig: signal.Signals) -> None:
        self.received += 1
        if self.received == 1:
            self._graceful(sig)
        else:
            self._forced(sig)

    def __enter__(self) -> StopSignals:
        self.install()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.restore()


def add_guest_handler(
    loop: asyncio.AbstractEventLoop, sig: signal.Signals, callback: OnSignal
) -> tuple[signal.Signals, PythonHandler] | None:
    """Install ``callback(sig)`` for ``sig`` when this loop can (the main thread's loop only) and
    the application has not; returns the signal and the Python-level handler it replaced.

    An application that gave the loop its own handler for ``sig`` keeps it: the loop holds one
    handler per signal, and ours would replace it for good (removing ours cannot give it back).
    Such an application stops the run itself (``run.shutdown()``, or cancelling ``trainer.run()``).
    """
    if sig in getattr(loop, "_signal_handlers", {}):  # asyncio's own loops keep them there
        return None
    before = signal.getsignal(sig)
    try:
        loop.add_signal_handler(sig, callback, sig)
    except (RuntimeError, ValueError, NotImplementedError):
        return None
    return sig, before


class ForwardedSignals:
    """``with ForwardedSignals(forward):`` on the running loop: each SIGUSR1/SIGUSR2 calls
    ``forward(sig)`` (instead of ending this process, their default action)."""

    def __init__(self, forward: OnSignal, *, also: signal.Signals | None = None) -> None:
        self._forward = forward
        #: the preemption signal too, when it is none of the two (``--preempt-signal HUP``)
        self._signals = tuple(dict.fromkeys([*FORWARDED_SIGNALS, *([also] if also else [])]))
        self._loop: asyncio.AbstractEventLoop | None = None

    def __enter__(self) -> ForwardedSignals:
        loop = self._loop = asyncio.get_running_loop()
        for sig in self._signals:
            loop.add_signal_handler(sig, self._forward, sig)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._loop is not None:
            for sig in self._signals:
                self._loop.remove_signal_handler(sig)
