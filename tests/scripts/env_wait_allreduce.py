"""Rank script: prints its whole environment and ready, waits until the file given exists, then one gloo all_reduce of (rank + 1).

Printing the environment puts whatever a rank was handed into every place its output goes
(the launcher's stdout, ``--log-dir``'s files), where a test can look for a secret.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

for key, value in sorted(os.environ.items()):
    print(f"env {key}={value}", flush=True)
print(f"ready pid {os.getpid()}", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item():g}", flush=True)
dist.destroy_process_group()
