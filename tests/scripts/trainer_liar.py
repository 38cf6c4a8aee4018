"""trainer_mlp.py with one rank patched to lie, as a rank can with nothing but its own credential.

    python trainer_liar.py --lie takeover|stall|poison|negative [--liar R] <trainer_mlp.py's arguments>

The liar keeps its sending calls' shape (``DataLink.send(round, kind, tensors, steps, weight)``,
``LinkThread.send(msg)``) and changes only what it says:

* ``takeover``: its model contributions claim ``steps = 10**15`` (weighted to match) and every
  tensor set to 0.123;
* ``stall``: its window reports say ``batches = -10**9``;
* ``poison``: its model contributions carry NaN tensors;
* ``negative``: its model contributions claim ``steps = -5``.

Every other rank is honest, and every rank prints ``CONSENSUS rank=R round=K takeover=B`` for each
consensus it applies (``B``: every value is the takeover's 0.123), so a test sees whether the
attacker's tensors ever became the model.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trainer_mlp

from flodl_async.relay.datalink import ConsensusResult, DataLink
from flodl_async.trainer.link import LinkThread
from flodl_async.wire import messages as m

TAKEOVER = 0.123


def patch(lie: str, liar: int) -> None:
    rank = int(os.environ.get("RANK", "-1"))
    receive = DataLink.receive

    async def receive_and_say(self: DataLink, round: int) -> ConsensusResult:
        result = await receive(self, round)
        if result.tensors is not None:
            taken = all(bool(torch.all(t == TAKEOVER)) for t in result.tensors.values())
            print(f"CONSENSUS rank={self.rank} round={round} takeover={taken}", flush=True)
        return result

    DataLink.receive = receive_and_say  # type: ignore[method-assign]
    if rank != liar:
        return
    if lie == "stall":
        send_control = LinkThread.send

        def lying_report(self: LinkThread, msg: m.Message) -> None:
            if isinstance(msg, m.WindowDone):
                msg = dataclasses.replace(msg, batches=-(10**9))
            send_control(self, msg)

        LinkThread.send = lying_report  # type: ignore[method-assign]
        return
    send = DataLink.send

    async def lying_contribution(
        self: DataLink,
        round: int,
        kind: str,
        tensors: Any,
        steps: int,
        weight: float,
        **kw: Any,
    ) -> None:
        if kind == "model" and tensors is not None:
            if lie == "takeover":
                steps, weight = 10**15, 1e15
                tensors = {name: torch.full_like(t, TAKEOVER) for name, t in tensors.items()}
            elif lie == "poison":
                tensors = {name: torch.full_like(t, float("nan")) for name, t in tensors.items()}
            elif lie == "negative":
                steps = -5
        await send(self, round, kind, tensors, steps, weight, **kw)

    DataLink.send = lying_contribution  # type: ignore[method-assign]


if __name__ == "__main__":
    ours = argparse.ArgumentParser()
    ours.add_argument("--lie", required=True, choices=["takeover", "stall", "poison", "negative"])
    ours.add_argument("--liar", type=int, default=1)
    known, rest = ours.parse_known_args(sys.argv[1:])
    patch(known.lie, known.liar)
    asyncio.run(trainer_mlp.managed(trainer_mlp.parse(rest)))
