"""TrainingShell.aclose: the round waiters are cancelled and awaited, a cancellation of aclose itself is kept, the reducer is closed."""

from __future__ import annotations

import asyncio

from flodl_async.controller.training import TrainingShell

from .test_training_loopback import LoopbackRounds


async def test_cancelling_aclose_while_it_awaits_a_round_waiter_propagates() -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()
    released = asyncio.Event()

    async def slow_to_stop() -> None:
        # A round waiter whose cancellation takes a while to finish (its cleanup awaits).
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            await released.wait()
            raise

    async with asyncio.timeout(10), asyncio.TaskGroup() as tg:
        shell = TrainingShell(
            run_id="r", world=lambda: (1, {}), task_group=tg, on_outcome=lambda _outcome: None
        )
        waiter = tg.create_task(slow_to_stop(), name="test-round-waiter")
        shell._tasks.add(waiter)
        rounds = LoopbackRounds()
        shell.reducer = rounds
        await started.wait()
        closer = tg.create_task(shell.aclose(), name="test-aclose")
        await cancelled.wait()  # aclose cancelled the waiter and now awaits it
        closer.cancel()
        await asyncio.wait([closer])
        assert closer.cancelled(), "aclose swallowed its own cancellation"
        assert rounds.closed, "a cancelled aclose still closes the reducer"
        released.set()
        await asyncio.wait([waiter])
    assert waiter.cancelled()
