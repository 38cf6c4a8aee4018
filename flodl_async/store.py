"""The rendezvous store process: a ``torch.distributed.TCPStore`` on a socket the agent bound.

The agent binds and listens *before* it starts this process and the ranks, so
the port is known at once (no race) and ranks that dial early wait in the
listen backlog while this process imports torch in parallel with them. The
store lives until its stdin closes (the agent ends the round) or its parent dies.

Run as ``python -m flodl_async.store --fd N``.
"""

from __future__ import annotations

import argparse
import socket
import sys


def main(argv: list[str] | None = None) -> int:
    """Serve the store on the inherited listening socket until stdin closes."""
    parser = argparse.ArgumentParser(prog="python -m flodl_async.store")
    parser.add_argument("--fd", type=int, required=True, help="an inherited, listening TCP socket")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    host, port = sock.getsockname()[:2]
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported from torch._C

    store = TCPStore(host, port, None, True, master_listen_fd=sock.detach(), wait_for_workers=False)
    sys.stdout.write("store ready\n")
    sys.stdout.flush()
    sys.stdin.read()  # EOF: the agent is done with this round
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
