"""Rank script (no torch): forks a child that sleeps in the rank's process group, writes its pid to the file given, then waits.

``{rank}`` in the file name is replaced with the rank's RANK (empty outside a run).

The child is what a parent-death signal does not reach (it applies to the rank only): a data-loader
worker or a daemonised helper that outlives a SIGKILLed agent.
"""

import os
import sys
import time

path = sys.argv[1].replace("{rank}", os.environ.get("RANK", ""))
child = os.fork()
if child == 0:
    while True:
        time.sleep(3600)
with open(path + ".tmp", "w") as out:
    out.write(str(child))
os.rename(path + ".tmp", path)
print(f"ready pid {os.getpid()}", flush=True)
while True:
    time.sleep(3600)
