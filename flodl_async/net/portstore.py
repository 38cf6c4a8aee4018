"""The run's TCPStore on the controller's one port: torch's ranks rendezvous through the mux.

Theory of operation. The mux routes a connection that opens with torch's ``VALIDATE``
(:data:`~flodl_async.wire.channels.STORE_PREFIX`) here, those bytes unconsumed, and the
sans-IO :mod:`flodl_async.wire.storeproto` serves it from the controller's own loop: no store
host, no second port, no extra process.

torch's store protocol carries no credential, so the peer's address is the credential: a
connection is served only from the address of a host admitted to the run (the address its
agent's join link came from, and every routable address its agent reported at join, for a
multi-homed host's ranks; loopback is one of them only when the controller's own host runs
ranks, never because a remote agent says so). Any other is closed at once and counted
(``store_not_admitted``). An address is no credential on the controller's own host, where any
user can dial loopback: a connection from this host is served only to the run's own processes
(:mod:`flodl_async.net.storegate`: the controller's tree, and each local agent's from its join),
and one of another user or of no process of the run is refused before a byte of it is read.
Another host's connection is judged the same way by that host's own agent, the one process that
can ask that host's kernel: the store asks it over the agent's authenticated join link
(:data:`OwnerOracle`) and holds the connection's bytes unread until it answers; a connection it
does not vouch for (another user, a process of the run's user that none of its ranks is, a socket
no process holds) is refused as a local one would be, named once with the agent's words.
The mux holds every store connection in admission's store pool
(:class:`~flodl_async.net.admission.Pool`), capped per address and in total and fitted to the
descriptor limit, until it closes: ranks hold theirs for hours, and held store connections
must not take the descriptors status and the framed channels need.

The store's bytes are bounded (:class:`~flodl_async.wire.storeproto.StoreLimits`: 64 MiB in
all, 8 MiB a value, ``APPEND`` included); a client that breaks a bound or the protocol is
refused as :mod:`flodl_async.net.tcpstore` says (``store_limit``, ``store_protocol``), and the
run's other keys stay as they were.

A restart is a new round (:meth:`PortStore.reset`): the keys go and every old connection is
closed, since torch adds no per-attempt prefix under the agent-store contract.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable

from ..host.sockdiag import Endpoint
from ..wire.storeproto import StoreLimits, StoreState
from .admission import AdmissionTicket
from .storegate import Standing, StoreGate
from .tcpstore import StoreClientProtocol, StoreClients

log = logging.getLogger("flodl_async.net.torchstore")

#: Asks the agent of the host a store connection came from who made it: ``(peer, ours)`` → a
#: future of (the agent's :class:`Standing` value, its words for a refused peer, the host's name).
OwnerOracle = Callable[[Endpoint, Endpoint], "asyncio.Future[tuple[str, str, str]]"]
#: Bytes a connection may send while its host's agent is asked (torch's first requests: ~100).
HELD_LIMIT = 64 * 1024


def normalise_host(host: str) -> str:
    """One spelling per address: an IPv4-mapped IPv6 peer (``::ffff:a.b.c.d``) is its IPv4
    address."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


class PortStore:
    """One store per round, served to the admitted hosts' connections on the mux."""

    def __init__(self, *, limits: StoreLimits | None = None, gate: StoreGate | None = None) -> None:
        """``gate``: who on this host may connect (by default this process's user and tree)."""
        self._gate = gate or StoreGate.of_this_process()
        self._clients = StoreClients(limits=limits, subject="port store", gate=self._gate)
        self.round = 0
        self._admitted: set[str] = set()
        #: Who judges another host's connections (None: its address alone, as for a bare store).
        self.owner_oracle: OwnerOracle | None = None
        #: Connections waiting for their host's agent to say who made them.
        self._pending: set[_PortStoreProtocol] = set()

    @property
    def state(self) -> StoreState:
        """This round's keys, queues and waiters."""
        return self._clients.state

    @property
    def limits(self) -> StoreLimits:
        """The store's bounds."""
        return self._clients.state.limits

    def admit_host(self, address: str) -> None:
        """Store connections from ``address`` are served from now on (an admitted host's)."""
        self._admitted.add(normalise_host(address))

    def admit_agent(self, peer: Endpoint, ours: Endpoint, pid: int) -> None:
        """An agent joined over the connection from ``peer`` to ``ours``: when it is of this host,
        its ranks (its descendants, under ``pid``) may connect from this host too."""
        self._gate.admit_agent(peer, ours, pid)

    def is_admitted(self, address: str) -> bool:
        """Whether a store connection from ``address`` is served."""
        return normalise_host(address) in self._admitted

    @property
    def connections(self) -> int:
        """Store connections open now."""
        return self._clients.connections

    def protocol_factory(self) -> _PortStoreProtocol:
        """A protocol for one routed store connection (the mux's handler for the store channel)."""
        return _PortStoreProtocol(self, self._clients)

    def reset(self, round_: int) -> None:
        """Start ``round_`` from an empty store: drop every key, queue and waiter, close every
        client."""
        self.round = round_
        self._clients.renew()
        self._abort_pending()

    def close(self) -> None:
        """Close every client (the run is over)."""
        self._clients.close_all()
        self._abort_pending()

    def _abort_pending(self) -> None:
        pending = list(self._pending)
        self._pending.clear()
        for protocol in pending:
            protocol.abort()


class _PortStoreProtocol(StoreClientProtocol):
    def __init__(self, store: PortStore, clients: StoreClients) -> None:
        super().__init__(clients)
        self._store = store
        self._ticket: AdmissionTicket | None = None
        #: What it sent while its host's agent is asked (None: not asked, or answered).
        self._held: bytearray | None = None

    def bind_admission(self, ticket: AdmissionTicket) -> None:
        self._ticket = ticket

    def accept(self) -> bool:
        if self._store.is_admitted(self.host):
            # and from this host, only the run's own processes
            if not super().accept():
                return False
            return not self._ask_its_agent()
        if self._ticket is not None:
            self._ticket.rejected(
                "store_not_admitted",
                f"store connection from {self.host or 'an unknown address'}, which is no host of "
                "this run",
            )
        if self._transport is not None:
            self._transport.abort()
        return False

    def _ask_its_agent(self) -> bool:
        """Another host's connection: ask its agent who made it, reading nothing meanwhile; True
        while it is asked."""
        oracle = self._store.owner_oracle
        if self.standing is not Standing.REMOTE or oracle is None:
            return False
        assert self._peer is not None
        assert self._ours is not None
        self._held = bytearray()
        self._store._pending.add(self)
        oracle(self._peer, self._ours).add_done_callback(self._judged)
        return True

    def data_received(self, data: bytes) -> None:
        held = self._held
        if held is None:
            super().data_received(data)
            return
        held += data
        if len(held) > HELD_LIMIT:
            self._give_up()
            self.refuse(
                "store_protocol",
                f"sent {len(held)} bytes before its host's agent said who it is",
                at_once=True,
            )

    def _give_up(self) -> None:
        self._held = None
        self._store._pending.discard(self)

    def _judged(self, answer: asyncio.Future[tuple[str, str, str]]) -> None:
        if self._held is None or self._transport is None:
            return  # refused, or closed, meanwhile
        held = self._held
        self._give_up()
        if self._transport.is_closing():
            return
        if answer.cancelled() or answer.exception() is not None:
            unknown = Standing.OWNER_UNKNOWN.value
            standing, detail, host = unknown, "its host's agent did not say", ""
        else:
            standing, detail, host = answer.result()
        if standing in (Standing.SERVED.value, Standing.REMOTE.value):
            self._clients.attach(self)
            if held:
                self.data_received(bytes(held))
            return
        where = f'on host "{host}": ' if host else ""
        # one line per address and kind of offender: each other user there is named too
        self.refuse(standing, where + detail, at_once=True, offender=f"{self.host} ({standing})")

    def connection_lost(self, exc: Exception | None) -> None:
        self._give_up()
        super().connection_lost(exc)

    def refused(self, reason: str, detail: str) -> None:
        if self._ticket is not None:
            self._ticket.rejected(reason, detail)
