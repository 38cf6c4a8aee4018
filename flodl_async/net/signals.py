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

#: The signals that stop a command (Ctrl-C and ``kill`` / ``systemctl stop``), in install order.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

#: The signals a launcher passes on to its ranks, the run going on (SLURM's ``--signal=USR1@60``,
#: Lightning's requeue): never a stop.
FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)

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

    def __init__(self, forward: OnSignal) -> None:
        self._forward = forward
        self._loop: asyncio.AbstractEventLoop | None = None

    def __enter__(self) -> ForwardedSignals:
        loop = self._loop = asyncio.get_running_loop()
        for sig in FORWARDED_SIGNALS:
            loop.add_signal_handler(sig, self._forward, sig)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._loop is not None:
            for sig in FORWARDED_SIGNALS:
                self._loop.remove_signal_handler(sig)
