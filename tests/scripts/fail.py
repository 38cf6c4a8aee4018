"""Rank script (no torch): rank 1 writes to stderr and exits 3; the others wait to be stopped."""

import os
import sys
import time

print("ready", flush=True)
if os.environ["RANK"] == "1":
    for i in range(30):
        print(f"noise line {i}", file=sys.stderr)
    print("boom: rank 1 is giving up", file=sys.stderr, flush=True)
    sys.exit(3)
time.sleep(600)
