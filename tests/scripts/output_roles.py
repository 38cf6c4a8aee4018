"""Rank script (no torch) for the rank-output tests; what a rank does depends on its RANK. argv: DIR [FLOOD_MB].

- rank 0: prints ``local ready``, waits for DIR/release, exits 0.
- rank 1: floods stdout with lines of ``a`` (1 KiB each) until it wrote FLOOD_MB MiB *and* DIR/release
  exists, then prints ``flooded N bytes`` and exits 0. It touches DIR/flooding after its first MiB.
- rank 2: prints the partial line ``partial-2`` and holds its newline until DIR/newline exists, then
  finishes the line with ``-done``, prints 2000 lines of ``b`` (3000 each) and exits 0 at once.
"""

import os
import sys
import time
from pathlib import Path

root = Path(sys.argv[1])
flood_mib = int(sys.argv[2]) if len(sys.argv) > 2 else 50
rank = int(os.environ["RANK"])
out = sys.stdout.buffer


def wait_for(name: str) -> None:
    while not (root / name).exists():
        time.sleep(0.02)


if rank == 0:
    out.write(b"local ready\n")
    out.flush()
    wait_for("release")
elif rank == 1:
    block = (b"a" * 1023 + b"\n") * 1024  # 1 MiB of whole lines
    written = 0
    while written < flood_mib * 1024 * 1024 or not (root / "release").exists():
        out.write(block)
        written += len(block)
        if written == len(block):
            out.flush()
            (root / "flooding").touch()
    out.write(f"flooded {written} bytes\n".encode())
    out.flush()
else:
    out.write(b"partial-2")
    out.flush()
    wait_for("newline")
    out.write(b"-done\n")
    for _ in range(2000):
        out.write(b"b" * 3000 + b"\n")
    out.flush()
