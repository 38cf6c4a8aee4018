"""Rank script: rank 1 fails in the first attempt; every rank succeeds on a restart (with gloo)."""

import os
import sys

import torch
import torch.distributed as dist

restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if restart == 0 and os.environ["RANK"] == "1":
    print("failing on purpose in attempt 0", file=sys.stderr, flush=True)
    sys.exit(1)
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"attempt {restart} rank {dist.get_rank()} sum {t.item():g}", flush=True)
dist.destroy_process_group()
