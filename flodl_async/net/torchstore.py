"""The alternative store backend: torch's own ``TCPStore`` in a process, on a socket the agent
bound.

The default backend serves torch's protocol from the agent's loop
(:mod:`flodl_async.net.tcpstore`). ``FLODL_STORE_BACKEND=torch`` selects this
one instead — for a torch release whose store protocol the Python server does
not speak yet. The agent binds and listens *before* it starts this process
and the ranks (``master_listen_fd``), so there is no port race and ranks that
dial early wait in the listen backlog; the price is a second ``import torch``
on the store host while its ranks import theirs (measured: 1.46x the launch
floor instead of 1.10x on 2 cores). The process lives until its stdin closes
or its parent dies.

Run as ``python -m flodl_async.net.torchstore --fd N``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys

from ..host.procs import spawn, stop_processes
from ..verdict import stop_schedule

BACKEND_VARIABLE = "FLODL_STORE_BACKEND"


class TorchStoreProcess:
    """A ``python -m flodl_async.net.torchstore`` child serving one round's store."""

    def __init__(self, proc: asyncio.subprocess.Process, *, stop_grace: float) -> None:
        self._proc = proc
        self._stop_grace = stop_grace

    @classmethod
    async def start(
        cls, listener: socket.socket, *, run_id: str, stop_grace: float
    ) -> TorchStoreProcess:
        """Start the store on ``listener`` (bound and listening); the child inherits it."""
        proc = await spawn(
            [sys.executable, "-m", "flodl_async.net.torchstore", "--fd", str(listener.fileno())],
            env=dict(os.environ, FLODL_RUN_ID=run_id),  # marks it as this run's, like the ranks
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=None,
            pass_fds=(listener.fileno(),),
        )
        listener.close()  # the child holds its own copy
        return cls(proc, stop_grace=stop_grace)

    async def aclose(self) -> None:
        """End the store: close its stdin, then TERM/KILL if it lingers."""
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        await stop_processes([self._proc], schedule=stop_schedule(signal.SIGTERM, self._stop_grace))


def main(argv: list[str] | None = None) -> int:  # runs in the child process
    """Serve the store on the inherited listening socket until stdin closes."""
    parser = argparse.ArgumentParser(prog="python -m flodl_async.net.torchstore")
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
