"""Rank script (no torch): appends every SIGINT/SIGTERM it gets to the file given, then exits or ignores it.

argv: RECORD_FILE [exit|ignore]. Prints ``ready pid N`` once its handlers are in place, and ``got SIGNAME`` after recording one.
"""

import os
import signal
import sys
import time

record, mode = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "exit"


def on_signal(signum: int, _frame: object) -> None:
    with open(record, "a") as out:
        out.write(f"{os.environ.get('RANK', '?')} {signal.Signals(signum).name}\n")
    print(
        f"got {signal.Signals(signum).name}", flush=True
    )  # after the record: a reader of this line can read the file
    if mode == "exit":
        sys.exit(128 + signum)


signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, on_signal)
print(f"ready pid {os.getpid()}", flush=True)
while True:
    time.sleep(3600)
