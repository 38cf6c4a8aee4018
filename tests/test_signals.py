"""net/signals: the first stop signal is graceful, every later one forces; the handlers go when the block ends."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

from flodl_async.net.signals import StopSignals


class _Calls:
    """What the handlers were called with, and an event once ``expected`` calls came."""

    def __init__(self, expected: int) -> None:
        self.seen: list[tuple[str, signal.Signals]] = []
        self.all_in = asyncio.Event()
        self._expected = expected

    def recorder(self, name: str) -> Callable[[signal.Signals], None]:
        def record(sig: signal.Signals) -> None:
            self.seen.append((name, sig))
            if len(self.seen) == self._expected:
                self.all_in.set()

        return record


def test_the_first_signal_is_graceful_and_every_later_one_forces() -> None:
    async def main() -> list[tuple[str, signal.Signals]]:
        calls = _Calls(3)
        with StopSignals(calls.recorder("graceful"), calls.recorder("forced")):
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGTERM)
            await asyncio.wait_for(calls.all_in.wait(), timeout=10)  # through the loop's self-pipe
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # off the loop again
        return calls.seen

    assert asyncio.run(main()) == [
        ("graceful", signal.SIGTERM),
        ("forced", signal.SIGINT),
        ("forced", signal.SIGTERM),
    ]


def test_a_guest_leaves_the_applications_handler_and_puts_back_the_python_one() -> None:
    async def main() -> list[tuple[str, signal.Signals]]:
        loop = asyncio.get_running_loop()
        calls = _Calls(2)
        before = signal.getsignal(signal.SIGINT)  # asyncio.run's own SIGINT handler
        loop.add_signal_handler(signal.SIGTERM, calls.recorder("application"), signal.SIGTERM)
        try:
            with StopSignals(calls.recorder("graceful"), calls.recorder("forced"), guest=True):
                signal.raise_signal(signal.SIGTERM)
                signal.raise_signal(signal.SIGINT)
                await asyncio.wait_for(calls.all_in.wait(), timeout=10)
            assert signal.getsignal(signal.SIGINT) is before
            assert signal.SIGTERM in getattr(
                loop, "_signal_handlers", {}
            )  # still the application's
        finally:
            loop.remove_signal_handler(signal.SIGTERM)
        return calls.seen

    assert sorted(asyncio.run(main())) == [
        ("application", signal.SIGTERM),
        ("graceful", signal.SIGINT),
    ]
