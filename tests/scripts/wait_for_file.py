"""Rank script (no torch): prints ready, then waits until the file given exists, or until stopped."""

import os
import sys
import time

print(f"ready pid {os.getpid()}", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
print("released", flush=True)
