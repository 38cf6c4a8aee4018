"""Rank script (no torch): a plain torchrun-contract script that reports scalars with fa.report, says so, then
waits until the file given exists."""

import os
import sys
import time

import flodl_async as fa

rank = int(os.environ["RANK"])
fa.report(loss=1.5 + rank, lr=0.01)
fa.report(loss=0.5 + rank)  # the latest value of each name is what goes up
print(f"reported rank {rank}", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
