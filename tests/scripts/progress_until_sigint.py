"""Rank script (no torch): a full line, a partial line, ``\\r`` progress updates held by gate files, then waits for Ctrl-C.

argv: DIR. Every write is flushed at once. In order: ``line one rN on HOST`` (a whole line) and
``err line rN`` on stderr; the partial line ``partial rN``; then for k = 1, 2, 3, once DIR/gate-k
exists, ``\\rprog k/3 rN``; once DIR/gate-4 exists, the newline alone; then ``waiting for SIGINT rN``
and a sleep that only ``KeyboardInterrupt`` ends, printing ``saved on SIGINT rN``.
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
    write(f"\rprog {k}/3 r{rank}")
wait_for("gate-4")
write("\n")  # the finished bar's newline, on its own (as tqdm's close() writes it)
try:
    # inside the try: a Ctrl-C sent the moment this line is read lands in the handler below
    write(f"waiting for SIGINT r{rank}\n")
    while True:
        time.sleep(3600)
except KeyboardInterrupt:
    write(f"saved on SIGINT r{rank}\n")
