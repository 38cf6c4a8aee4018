"""Which local processes a store serves: the run's users, and only the processes of the run.

Theory of operation. torch's store client carries no credential, but a connection from this
host says who made it: the kernel names the owner's uid and the inode of the peer's socket
(:mod:`flodl_async.host.sockdiag`), and ``/proc`` names the process that holds that inode
(:mod:`flodl_async.host.proctree`). :meth:`StoreGate.check` judges each new store connection:

- its peer socket is of this host and of a uid that is not the run's: refused
  (``store_foreign_uid``), whatever it would have sent;
- of the run's uid, held by a process of one of the run's trees (the controller or a local
  agent, their ranks and every descendant: torch and the user's code may fork helpers):
  served; held by any other process: refused (``store_not_run``);
- of this host but held by no process any more (it closed before it was judged), or an
  address of this host with no such socket: refused (``store_owner_unknown``): a rank never
  closes a store connection before its first answer;
- not of this host: another machine's, which the caller judges by its host's address
  (:class:`Standing.REMOTE`).

The run's trees are rooted at the process the gate was made in and at each local agent that
joined (:meth:`StoreGate.admit_agent`, from its authenticated join link's own socket), so the
ranks of a later round, of a restart and of a joiner are descendants of a root before they dial.
A root is its pid *and* its start time: a pid the system reuses after the root ended roots
nothing. One check is a sock_diag lookup (about 65 µs) and, for a connection of the run's uid,
a walk of the trees' descriptor tables until the socket is found (ranks first, the roots
last); see ``benchmarks/store.py`` for what it adds to a rendezvous. Where the kernel cannot
say (no netlink), every connection is judged by address alone and one warning says so.
"""

from __future__ import annotations

import contextlib
import enum
import ipaddress
import logging
import os
import pwd
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import SocketOwnerUnknown
from ..host.hostaddrs import host_addresses
from ..host.proctree import (
    all_pids,
    command_name,
    holder_among,
    holder_in_trees,
    holds_socket,
    start_ticks,
)
from ..host.sockdiag import Endpoint, tcp_owner

log = logging.getLogger("flodl_async.net.torchstore")

#: A run's tree is searched up to this many processes: every local rank and its helpers.
RUN_TREE_LIMIT = 4096


class Standing(enum.Enum):
    """What a store connection's peer is to the run; a refusal's value is its counter."""

    SERVED = "served"
    REMOTE = "remote"
    FOREIGN_UID = "store_foreign_uid"
    NOT_OURS = "store_not_run"
    OWNER_UNKNOWN = "store_owner_unknown"


_WHY = {
    Standing.FOREIGN_UID: "a process of another user than the run's",
    Standing.NOT_OURS: "a process of the run's user that is none of the run's processes",
    Standing.OWNER_UNKNOWN: "a connection of this host that no process holds any more",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerCheck:
    """The judgement of one connection's peer."""

    standing: Standing
    #: The peer socket's owner (-1: not of this host).
    uid: int = -1
    #: The peer socket's inode (0: none, or not of this host).
    inode: int = 0
    #: The process holding it, when known (a served rank, or the offender once named).
    pid: int = 0

    @property
    def refused(self) -> bool:
        """Whether the connection must be closed unserved."""
        return self.standing not in (Standing.SERVED, Standing.REMOTE)


def user_name(uid: int) -> str:
    """``uid``'s login name, or '' when it has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return ""


def describe_peer(check: PeerCheck) -> str:
    """The refused peer in words: why, its user and, when found, its process."""
    parts = [_WHY.get(check.standing, check.standing.value)]
    if check.uid >= 0:
        name = user_name(check.uid)
        parts.append(f"uid {check.uid}" + (f" ({name})" if name else ""))
    if check.pid:
        command = command_name(check.pid)
        parts.append(f"pid {check.pid}" + (f" ({command})" if command else ""))
    return ", ".join(parts)


class StoreGate:
    """Judges store connections by who made them (see the module docstring)."""

    def __init__(
        self,
        *,
        roots: Iterable[int] = (),
        uids: Iterable[int] = (),
        tree_limit: int = RUN_TREE_LIMIT,
    ) -> None:
        self._uids = set(uids)
        #: uids whose every process is served: a local agent whose process we could not see.
        self._uid_only: set[int] = set()
        self._roots: dict[int, int | None] = {}
        self._tree_limit = tree_limit
        self._local: frozenset[str] | None = None
        self._warned_unknowable = False
        for pid in roots:
            self.admit_tree(pid)

    @classmethod
    def of_this_process(cls) -> StoreGate:
        """Serves this process's user, and this process and its descendants."""
        return cls(roots=(os.getpid(),), uids=(os.geteuid(),))

    def admit_tree(self, pid: int, *, uid: int | None = None) -> None:
        """Serve ``pid`` and its descendants (and ``uid``, the user they run as)."""
        if uid is not None:
            self._uids.add(uid)
        self._roots[pid] = start_ticks(pid)

    def admit_agent(self, peer: Endpoint, ours: Endpoint, pid: int) -> None:
        """A local agent joined over the connection from ``peer`` to ``ours``, saying it is
        ``pid``: its ranks are served. A remote agent's join changes nothing here."""
        try:
            owner = tcp_owner(peer, ours)
        except SocketOwnerUnknown:
            return  # its ranks are judged as a remote host's would be (or refused, if local)
        if owner is None or owner.inode == 0:
            return
        self._uids.add(owner.uid)
        if pid == os.getpid():
            return  # an agent of this process: its ranks are already of this tree
        # the pid it says is checked against its socket: another pid namespace says another one
        holder = (
            pid
            if holds_socket(pid, owner.inode)
            else holder_among(owner.inode, all_pids(owner.uid))
        )
        if holder is not None:
            self.admit_tree(holder)
            return
        self._uid_only.add(owner.uid)
        name = user_name(owner.uid)
        log.warning(
            "store: cannot see the process of the agent that joined from %s:%d (it said pid %d; "
            "another pid namespace?): every process of uid %d%s on this host may use the store",
            peer[0],
            peer[1],
            pid,
            owner.uid,
            f" ({name})" if name else "",
        )

    def check(self, peer: Endpoint, ours: Endpoint) -> PeerCheck:
        """Judge a new connection from ``peer`` accepted on ``ours``."""
        try:
            owner = tcp_owner(peer, ours)
        except SocketOwnerUnknown as exc:
            if not exc.everywhere:  # this one lookup failed: a local peer is refused, as unknown
                owner = None
            else:
                if not self._warned_unknowable:
                    self._warned_unknowable = True
                    log.warning("store: %s", exc)
                return PeerCheck(standing=Standing.REMOTE)
        if owner is None:
            local = self._is_local(peer[0], ours[0])
            return PeerCheck(standing=Standing.OWNER_UNKNOWN if local else Standing.REMOTE)
        if owner.uid not in self._uids:
            return PeerCheck(standing=Standing.FOREIGN_UID, uid=owner.uid, inode=owner.inode)
        if owner.inode == 0:
            return PeerCheck(standing=Standing.OWNER_UNKNOWN, uid=owner.uid)
        if owner.uid in self._uid_only:
            return PeerCheck(standing=Standing.SERVED, uid=owner.uid, inode=owner.inode)
        pid = holder_in_trees(owner.inode, self._live_roots(), self._tree_limit)
        standing = Standing.NOT_OURS if pid is None else Standing.SERVED
        return PeerCheck(standing=standing, uid=owner.uid, inode=owner.inode, pid=pid or 0)

    def named(self, check: PeerCheck) -> str:
        """A refused peer in words, its process looked up (costly: only for a peer logged)."""
        if check.pid == 0 and check.inode:
            with contextlib.suppress(OSError):
                pid = holder_among(check.inode, all_pids(check.uid if check.uid >= 0 else None))
                if pid is not None:
                    check = PeerCheck(
                        standing=check.standing, uid=check.uid, inode=check.inode, pid=pid
                    )
        return describe_peer(check)

    def _live_roots(self) -> list[int]:
        return [pid for pid, started in self._roots.items() if start_ticks(pid) == started]

    def _is_local(self, peer: str, ours: str) -> bool:
        try:
            address = ipaddress.ip_address(peer.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if address.is_loopback or peer == ours:
            return True
        if self._local is None:
            self._local = frozenset(host_addresses())
        return str(address) in self._local
