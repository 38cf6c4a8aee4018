"""The store host's part of a round: a fresh TCPStore per rendezvous round, its address reported up.

Only for ``FLODL_STORE_BACKEND=torch`` now: by default the store rides the controller's port
(:mod:`flodl_async.net.portstore`) and no host is told ``OpenRound``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

from ..deadlines import Deadlines
from ..net.framed import FramedProtocol, open_framed
from ..net.storegate import StoreGate
from ..net.tcpstore import StoreServer
from ..net.torchstore import BACKEND_VARIABLE, TorchStoreProcess
from ..wire import messages as m
from ..wire.channels import Channel
from ..wire.keys import Credential

log = logging.getLogger("flodl_async.agent")


class StoreHost:
    """Serves one round's store at a time and reports it on the rendezvous channel."""

    def __init__(
        self,
        *,
        controller_host: str,
        controller_port: int,
        credential: Credential,
        run_id: str,
        advertise_addr: str | None,
        deadlines: Deadlines,
    ) -> None:
        self._deadlines = deadlines
        self._controller = (controller_host, controller_port)
        self._credential = credential
        self._run_id = run_id
        self._advertise_addr = advertise_addr
        self._store: StoreServer | TorchStoreProcess | None = None
        self._rendezvous: FramedProtocol | None = None

    async def open_round(self, round_: int) -> None:
        """Serve a fresh TCPStore for this round from our own loop and report its address.

        The store speaks torch's protocol from Python (:mod:`flodl_async.wire.storeproto`), so the
        store host imports no torch and starts no process: the ranks' own ``import torch`` is
        the only one on the critical path. Torch makes a new store for every restart round
        (no key prefix per attempt), hence a new socket and state per round.
        """
        await self._close_store()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("0.0.0.0", 0))
            listener.listen(1024)
            port = listener.getsockname()[1]
            if os.environ.get(BACKEND_VARIABLE, "python") == "torch":
                self._store = await TorchStoreProcess.start(
                    listener, run_id=self._run_id, stop_grace=self._deadlines.store_stop
                )
            else:
                # this host's processes: only this agent's ranks (its descendants)
                self._store = StoreServer(gate=StoreGate.of_this_process())
                await self._store.start(listener)
        except BaseException:
            listener.close()
            raise
        if self._rendezvous is None:
            async with asyncio.timeout(self._deadlines.handshake):
                self._rendezvous = await open_framed(
                    *self._controller,
                    channel=Channel.RENDEZVOUS,
                    credential=self._credential,
                    expect_run_id=self._run_id,
                )
        self._rendezvous.send(
            m.StoreAddress(round=round_, host=self._advertise_addr or "", port=port)
        )
        await self._rendezvous.drain()
        log.debug("store for round %d on port %d", round_, port)

    async def _close_store(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            await store.aclose()

    async def aclose(self) -> None:
        """Stop the store and close the rendezvous link (idempotent)."""
        await self._close_store()
        link, self._rendezvous = self._rendezvous, None
        if link is not None:
            link.close()
