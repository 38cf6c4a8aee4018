"""Rank script (torch): what the store shows each round, then a real gloo all-reduce through it.

Attempt 0: rank 0 leaves a key in the store and waits to be stopped; rank 1 fails once it sees
the key. Attempt 1 reports whether the key is still there (a restart must start from an empty
store). With a file argument every rank waits for that file after the all-reduce.
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed import TCPStore

addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
store = TCPStore(addr, port, None, False, timeout=datetime.timedelta(seconds=120))
print(
    f"attempt {restart} rank {rank} store {addr}:{port} leftover {store.check(['leftover'])}",
    flush=True,
)
if restart == 0 and "--fail-once" in sys.argv:
    if rank == 0:
        store.set("leftover", "from attempt 0")
        while True:
            time.sleep(1)  # stopped by the restart
    store.wait(["leftover"])
    print("failing on purpose in attempt 0", file=sys.stderr, flush=True)
    sys.exit(1)
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"attempt {restart} rank {rank} sum {t.item():g}", flush=True)
hold = [a for a in sys.argv[1:] if not a.startswith("--")]
if hold:
    while not os.path.exists(hold[0]):
        time.sleep(0.05)
dist.destroy_process_group()
