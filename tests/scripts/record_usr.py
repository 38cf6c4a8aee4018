"""Rank script (no torch): records each SIGUSR1/SIGUSR2 it gets in RECORD_FILE and goes on; exits 0
once it had both.

argv: RECORD_FILE. Prints ``ready`` once its handlers are in place, and ``got SIGNAME`` after
recording one.
"""

import os
import signal
import sys

record = sys.argv[1]
seen: set[str] = set()


def on_signal(signum: int, _frame: object) -> None:
    name = signal.Signals(signum).name
    with open(record, "a") as out:
        out.write(f"{os.environ.get('RANK', '?')} {name}\n")
    seen.add(name)
    print(f"got {name}", flush=True)  # after the record: a reader of this line can read the file


signal.signal(signal.SIGUSR1, on_signal)
signal.signal(signal.SIGUSR2, on_signal)
print("ready", flush=True)
while seen != {"SIGUSR1", "SIGUSR2"}:
    signal.pause()
