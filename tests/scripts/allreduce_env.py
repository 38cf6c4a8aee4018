"""Rank script: writes its environment and hostname as JSON into the directory given, then one gloo all_reduce of (rank + 1)."""

import json
import os
import socket
import sys

import torch
import torch.distributed as dist

with open(os.path.join(sys.argv[1], f"env-{os.environ['RANK']}.json"), "w") as out:
    json.dump({"env": dict(os.environ), "hostname": socket.gethostname()}, out)
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item():g}", flush=True)
dist.destroy_process_group()
