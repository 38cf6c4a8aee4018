"""One rank of tests/test_collective_regroup.py: a real gloo group re-formed in place.

``cut``: rank 2 leaves before round 2, whose all_reduce then fails on the others; they re-form and
redo it without it. ``trained_on``: every rank finishes round 2 and trains on (+5) before rank 2
leaves; the survivors redo round 2 and keep what they trained since. ``twice``: as ``cut``, but
the first re-form still names rank 2 and is superseded by one without it. Either way round 3 then runs in
the new group. Prints the outcome as one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from flodl_async.trainer.collective import OuterHooks, ProcessGroup
from flodl_async.training.regroup import Regroup

rank, scenario = int(sys.argv[1]), sys.argv[2]
group = ProcessGroup(rank, torch.device("cpu"), elastic=True, timeout=60)
group.open()
state = [torch.full((4,), float(rank + 1)), torch.tensor([10 * rank], dtype=torch.int64)]
calls = {"step": 0, "rewind": 0}
hooks = OuterHooks(
    step=lambda: calls.__setitem__("step", calls["step"] + 1),
    rewind=lambda: calls.__setitem__("rewind", calls["rewind"] + 1),
)
out: dict[str, object] = {"rank": rank}
out["round1"] = group.reduce(1, "model", 1.0, state, hooks)  # the mean of 1, 2, 3: 2
state[0].add_(10.0 * (rank + 1))  # round 2's local training: 12, 22, 32
if scenario in ("cut", "twice") and rank == 2:
    os._exit(0)  # gone before round 2: the others' all_reduce fails on its socket
weight = 1.0 if scenario == "trained_on" else float(rank + 1)
out["round2"] = group.reduce(2, "model", weight, state, hooks)
if scenario == "trained_on":
    state[0].add_(5.0)  # trained on after round 2's consensus (22)
    torch.distributed.barrier()  # every rank finished round 2 before rank 2 leaves
    if rank == 2:
        os._exit(0)
out["state_before_redo"] = state[0].tolist()
generation = 1
if scenario == "twice":
    # a re-form that still names rank 2 never completes: the next one (without it) replaces it
    polls = iter(range(50))
    first = Regroup(ranks=(0, 1, 2), generation=1, redo=2)
    out["superseded"] = not group.rendezvous(first, superseded=lambda: next(polls) >= 49)
    generation = 2
regroup = Regroup(ranks=(0, 1), generation=generation, redo=2)
assert group.rendezvous(regroup, superseded=lambda: False)
out["redo"] = group.redo(regroup, state, hooks)
out["after_redo"] = [state[0].tolist(), state[1].tolist()]
out["round3"] = group.reduce(3, "model", 1.0, state, hooks)
out["after_round3"] = state[0].tolist()
out["generation"] = group.generation
out["outer"] = calls
group.close()
print(json.dumps(out), flush=True)
