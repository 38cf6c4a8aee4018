"""This host's own addresses, every one of every interface, for the store's address check.

torch's store protocol carries no credential, so the controller serves a store connection
only from an address of a host admitted to the run. A host's ranks may dial from another
address than its agent's join link (several NICs, a secondary address, IPv6 beside IPv4),
so each agent reports all of its host's addresses at join.

Pure-python and robust without ``ip`` or netifaces: the kernel's own tables of this network
namespace, ``/proc/net/fib_trie`` (every local IPv4 address, secondary ones included; the
``SIOCGIFADDR`` ioctl sees one per interface) and ``/proc/net/if_inet6``. Where /proc is not
there, the resolver's addresses for the hostname are the fallback. The parsers are pure;
:func:`host_addresses` is the thin reader. Loopback, link-local and unspecified addresses are
dropped by :func:`routable` (they name another machine on the controller's side).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Iterable

FIB_TRIE = "/proc/net/fib_trie"
IF_INET6 = "/proc/net/if_inet6"
#: At most this many addresses travel in a join (a host with more is unusual; the rest stay
#: unknown).
MAX_ADDRESSES = 64


def parse_fib_trie(text: str) -> list[str]:
    """The local IPv4 addresses in a ``/proc/net/fib_trie`` dump: each ``|-- A`` followed by ``/32
    host LOCAL``."""
    found: list[str] = []
    last: str | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("|-- "):
            last = stripped[4:].strip()
        elif last is not None and stripped.startswith("/32 host LOCAL") and last not in found:
            found.append(last)
    return found


def parse_if_inet6(text: str) -> list[str]:
    """The IPv6 addresses in ``/proc/net/if_inet6`` (32 hex digits first on each line)."""
    found: list[str] = []
    for line in text.splitlines():
        fields = line.split()
        if not fields or len(fields[0]) != 32:
            continue
        with contextlib.suppress(ValueError):
            address = str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
            if address not in found:
                found.append(address)
    return found


def routable(addresses: Iterable[str]) -> list[str]:
    """Valid addresses that can name this host from another one, normalised, deduplicated, at most
    :data:`MAX_ADDRESSES`."""
    kept: list[str] = []
    for text in addresses:
        try:
            address = ipaddress.ip_address(text)
        except ValueError:
            continue
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if (
            address.is_loopback
            or address.is_link_local
            or address.is_unspecified
            or address.is_multicast
        ):
            continue
        if str(address) not in kept:
            kept.append(str(address))
        if len(kept) == MAX_ADDRESSES:
            break
    return kept


def host_addresses() -> tuple[str, ...]:
    """Every routable address of this host (network namespace), from the kernel's tables; never
    raises."""
    found: list[str] = []
    for path, parse in ((FIB_TRIE, parse_fib_trie), (IF_INET6, parse_if_inet6)):
        with contextlib.suppress(OSError), open(path, encoding="ascii", errors="replace") as table:
            found += parse(table.read())
    if not found:  # no /proc: what the resolver says this host is
        with contextlib.suppress(OSError):
            found = [
                str(info[4][0])
                for info in socket.getaddrinfo(socket.gethostname(), None, proto=socket.IPPROTO_TCP)
            ]
    return tuple(routable(found))
