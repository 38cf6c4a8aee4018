"""Rank script: on a host given a second address, dial the store from that address, then one gloo all_reduce.

argv: the second address, and the host whose ranks switch to it. On that host (root in its
network namespace) the route to the controller's subnet gets ``src <second>`` before the
store is dialed, so the store connection comes from an address the agent's join link did
not; the script prints which source address the kernel picks. ``timeout`` keeps a refused
store from hanging the test for torch's default half hour.
"""

import datetime
import ipaddress
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

second, switching_host = sys.argv[1], sys.argv[2]
master = os.environ["MASTER_ADDR"]
if socket.gethostname() == switching_host:
    subnet = ipaddress.ip_network(f"{master}/24", strict=False)
    subprocess.run(
        ["ip", "route", "replace", str(subnet), "dev", "eth0", "src", second], check=True
    )
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.connect((master, 9))  # a UDP connect sends nothing: it only picks the source address
print(f"{socket.gethostname()} dials the store from {probe.getsockname()[0]}", flush=True)
probe.close()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item():g}", flush=True)
dist.destroy_process_group()
