"""Rank script (no torch): writes argv[1] numbered lines of 100 bytes to stdout, then creates the file argv[2]."""

import sys

count, done = int(sys.argv[1]), sys.argv[2]
out = sys.stdout.buffer
for i in range(count):
    out.write(b"%09d " % i + b"x" * 89 + b"\n")
out.flush()
with open(done, "w"):
    pass
print("flood done", flush=True)
