"""Rank script (no torch): a full line, a partial line, ``\\r`` progress updates held by gate files, then waits for Ctrl-C.

argv: DIR. Every write is flushed at once. In order: ``line one rN on HOST`` (a whole line) and
``err line rN`` on stderr; the partial line ``partial rN``; then for k = 1, 2, 3, once DIR/gate-k
exists, ``\\rprog k/3 rN`` (the third one ends the line); then ``waiting for SIGINT rN`` and a
sleep that only ``KeyboardInterrupt`` ends, printing ``saved on SIGINT rN``.
"""

import os
import socket
import sys
import time
from pathlib import Path

root = Path(sys.argv[1])
rank = os.environ["RANK"]
out = sys.stdout.buffer


def write(data: str) -> None:
    out.write(data.encode())
    out.flush()


def wait_for(name: str) -> None:
    while not (root / name).exists():
        time.sleep(0.02)


write(f"line one r{rank} on {socket.gethostname()}\n")
sys.stderr.write(f"err line r{rank}\n")
sys.stderr.flush()
write(f"partial r{rank}")
for k in (1, 2, 3):
    wait_for(f"gate-{k}")
    write(f"\rprog {k}/3 r{rank}" + ("\n" if k == 3 else ""))
write(f"waiting for SIGINT r{rank}\n")
try:
    while True:
        time.sleep(3600)
except KeyboardInterrupt:
    write(f"saved on SIGINT r{rank}\n")
