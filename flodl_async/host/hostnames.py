"""Which names mean this machine, and the one name they stand for (pure: the names are passed in).

``localhost`` (and its usual ``/etc/hosts`` variants), every loopback address
(``127.0.0.0/8``, ``::1``, IPv4-mapped loopback), this machine's hostname, its
short form and its FQDN all name one host. Two agents that join a run under two
of those spellings are one machine joining twice; the join window compares hosts
by :meth:`HostAliases.canonical_name`, which maps every spelling to the machine's
short hostname. Any other name is left as it is: agents on one machine may still
join under distinct explicit names (``alpha``, ``beta``), since host names in a
run are the operator's to give. Matching ignores case and a trailing dot (DNS
names do). The shell reads the names from the system once, at launch.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

#: Names of the loopback host in common ``/etc/hosts`` files.
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


def normalise(host: str) -> str:
    """``host`` as names are compared: lower case, without a trailing dot or IPv6 brackets."""
    name = host.strip().rstrip(".").lower()
    return name[1:-1] if name.startswith("[") and name.endswith("]") else name


def is_loopback_address(host: str) -> bool:
    """True for a literal loopback address (``127.0.0.0/8``, ``::1``, ``::ffff:127.0.0.1``)."""
    try:
        address = ipaddress.ip_address(normalise(host))
    except ValueError:
        return False
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def names_this_machine(host: str, names: Iterable[str]) -> bool:
    """True when ``host`` is one of ``names`` (compared normalised) or a loopback address."""
    return normalise(host) in {normalise(n) for n in names} or is_loopback_address(host)


@dataclass(frozen=True, slots=True, kw_only=True)
class HostAliases:
    """The spellings of this machine and the one name they canonicalise to."""

    #: This machine's short hostname: what every spelling becomes.
    canonical: str
    #: The names (normalised) besides loopback addresses, which always count.
    names: frozenset[str]

    @classmethod
    def of_machine(cls, hostname: str, fqdn: str = "") -> HostAliases:
        """The aliases of a machine called ``hostname`` (as ``gethostname()`` says) with ``fqdn``
        (``getfqdn()``)."""
        short = hostname.partition(".")[0] or "localhost"
        spellings = (*LOOPBACK_NAMES, hostname, short, fqdn)
        return cls(canonical=short, names=frozenset(normalise(n) for n in spellings if n.strip()))

    def names_this_machine(self, host: str) -> bool:
        """True when ``host`` is a spelling of this machine."""
        return names_this_machine(host, self.names)

    def canonical_name(self, host: str) -> str:
        """This machine's short hostname for any of its spellings; any other name unchanged."""
        return self.canonical if self.names_this_machine(host) else host
