"""Who owns the other end of a local TCP connection: its uid and socket inode, from the kernel.

A connection between two sockets of this host (this network namespace) has both ends in the
kernel's table of established TCP sockets; ``sock_diag`` (netlink, ``NETLINK_SOCK_DIAG``) looks
one up by its exact four-tuple and answers with its owner's uid and its inode, which
:mod:`flodl_async.host.proctree` maps to the process holding it. An exact lookup is one hash
probe in the kernel (tens of microseconds, whatever the host's connection count), where reading
``/proc/net/tcp`` costs the kernel a line per socket: 18 ms on a host with 6,000 sockets. Any
user may ask; the answer is synchronous, so the read never waits.

The codec is pure (:func:`lookup_request`, :func:`parse_reply`); :func:`tcp_owner` is the thin
reader. Where netlink is missing (not Linux) :func:`tcp_owner` raises
:class:`~flodl_async.errors.SocketOwnerUnknown` (``everywhere``): the caller then cannot tell
local processes apart and says so.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import socket
import struct
from dataclasses import dataclass

from ..errors import SocketOwnerUnknown

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLMSG_ERROR = 2
NLMSG_DONE = 3
IPPROTO_TCP = 6
#: ``INET_DIAG_NOCOOKIE``: the lookup is by four-tuple alone.
_NO_COOKIE = 0xFFFFFFFF
#: Every TCP state: an exact lookup reports the socket in whichever it is.
_ALL_STATES = 0xFFFFFFFF
TCP_ESTABLISHED = 1
TCP_TIME_WAIT = 6
TCP_LISTEN = 10

_HEADER = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_REQUEST = struct.Struct("=BBBBI")  # inet_diag_req_v2 head: family, protocol, ext, pad, states
_PORTS = struct.Struct(">HH")  # inet_diag_sockid ports are in network order
_TAIL = struct.Struct("=III")  # inet_diag_sockid: interface, cookie[2]
_MESSAGE_HEAD = struct.Struct("=BBBB")  # inet_diag_msg: family, state, timer, retrans
_MESSAGE_TAIL = struct.Struct("=IIIII")  # expires, rqueue, wqueue, uid, inode
_SOCKID_LEN = _PORTS.size + 32 + _TAIL.size
_MESSAGE_LEN = _MESSAGE_HEAD.size + _SOCKID_LEN + _MESSAGE_TAIL.size
_RECV_BYTES = 8192

Endpoint = tuple[str, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class SocketOwner:
    """One local TCP socket as the kernel reports it."""

    uid: int
    #: 0 when no process holds it any more (closed, waiting out its FIN or TIME_WAIT).
    inode: int
    state: int


def _address(host: str) -> tuple[int, bytes]:
    """The family and 16 address bytes a sockid carries (an IPv4-mapped address is IPv4)."""
    address = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if isinstance(address, ipaddress.IPv4Address):
        return socket.AF_INET, address.packed.ljust(16, b"\0")
    return socket.AF_INET6, address.packed


def lookup_request(local: Endpoint, remote: Endpoint, *, seq: int = 1) -> bytes:
    """A ``SOCK_DIAG_BY_FAMILY`` request for the one TCP socket bound to ``local`` and connected
    to ``remote`` (raises ``ValueError`` for an address that is not an IP, or mixed families)."""
    family, src = _address(local[0])
    remote_family, dst = _address(remote[0])
    if family != remote_family:
        raise ValueError(f"{local[0]} and {remote[0]} are not of one address family")
    body = (
        _REQUEST.pack(family, IPPROTO_TCP, 0, 0, _ALL_STATES)
        + _PORTS.pack(local[1], remote[1])
        + src
        + dst
        + _TAIL.pack(0, _NO_COOKIE, _NO_COOKIE)
    )
    return _HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0) + body


def parse_reply(data: bytes, *, seq: int = 1) -> SocketOwner | None:
    """The answer to :func:`lookup_request`: the socket, or None when there is none.

    Raises ``ValueError`` for an answer that is not one (truncated, another sequence number, an
    error other than "no such socket").
    """
    if len(data) < _HEADER.size:
        raise ValueError(f"a sock_diag answer of {len(data)} bytes is shorter than its header")
    length, kind, _flags, got_seq, _pid = _HEADER.unpack_from(data)
    if got_seq != seq or length > len(data) or length < _HEADER.size:
        raise ValueError(f"a sock_diag answer with sequence {got_seq}, length {length}")
    body = data[_HEADER.size : length]
    if kind == NLMSG_ERROR:
        if len(body) < 4:
            raise ValueError("a truncated sock_diag error")
        code = -struct.unpack_from("=i", body)[0]
        if code == errno.ENOENT:
            return None
        raise ValueError(f"sock_diag lookup failed: {errno.errorcode.get(code, code)}")
    if kind == NLMSG_DONE:
        return None
    if kind != SOCK_DIAG_BY_FAMILY or len(body) < _MESSAGE_LEN:
        raise ValueError(f"a sock_diag answer of type {kind} and {len(body)} bytes")
    _family, state, _timer, _retrans = _MESSAGE_HEAD.unpack_from(body)
    *_, uid, inode = _MESSAGE_TAIL.unpack_from(body, _MESSAGE_HEAD.size + _SOCKID_LEN)
    return SocketOwner(uid=uid, inode=inode, state=state)


def tcp_owner(local: Endpoint, remote: Endpoint) -> SocketOwner | None:
    """The local TCP socket bound to ``local`` and connected to ``remote``, or None when this host
    (network namespace) has none: the peer of such a connection is on another machine.

    A connection we accepted from ``peer`` on ``ours`` is ``tcp_owner(peer, ours)``. Raises
    :class:`~flodl_async.errors.SocketOwnerUnknown` where netlink cannot answer (``everywhere``
    when it cannot for any socket).
    """
    family = getattr(socket, "AF_NETLINK", None)
    if family is None:
        raise SocketOwnerUnknown("this system has no netlink sock_diag", everywhere=True)
    try:
        request = lookup_request(local, remote)
    except ValueError:
        return None  # not an IP peer (a unix socket): no TCP socket to look up
    try:
        sock = socket.socket(family, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
    except OSError as exc:
        raise SocketOwnerUnknown(
            f"cannot open a sock_diag socket: {exc.strerror or exc}", everywhere=True
        ) from exc
    with contextlib.closing(sock):
        try:
            sock.sendto(request, (0, 0))
            # the kernel queues the answer before sendto returns: this read never waits
            owner = parse_reply(sock.recv(_RECV_BYTES, socket.MSG_DONTWAIT))
        except (OSError, ValueError) as exc:
            raise SocketOwnerUnknown(f"sock_diag did not answer: {exc}", everywhere=False) from exc
    # with no connected socket of that four-tuple the kernel answers with a listener on ``local``
    return None if owner is None or owner.state == TCP_LISTEN else owner
