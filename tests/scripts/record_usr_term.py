"""Rank script (no torch): appends its rank to USR_FILE on each SIGUSR1 (and goes on), and its rank
and SIGTERM to TERM_FILE on SIGTERM (then exits 143).

argv: USR_FILE TERM_FILE. Prints ``ready`` once its handlers are in place, ``got SIGUSR1`` after
recording one.
"""

import os
import signal
import sys

usr_file, term_file = sys.argv[1], sys.argv[2]
rank = os.environ.get("RANK", "?")


def on_usr1(_signum: int, _frame: object) -> None:
    with open(usr_file, "a") as out:
        out.write(f"{rank}\n")
    print("got SIGUSR1", flush=True)


def on_term(_signum: int, _frame: object) -> None:
    with open(term_file, "a") as out:
        out.write(f"{rank} SIGTERM\n")
    sys.exit(143)


signal.signal(signal.SIGUSR1, on_usr1)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    signal.pause()
