"""Rank script: every rank prints a line; rank 0 then waits in init_process_group for rank 1, which never comes (it sleeps)."""

import datetime
import os
import time

rank = int(os.environ["RANK"])
print(f"rank {rank} loading", flush=True)
if rank == 0:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", timeout=datetime.timedelta(seconds=600)
    )  # connected to the store, waiting for rank 1
else:
    time.sleep(600)
