"""Which network interface a host's ranks bind: the ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``
default.

gloo otherwise resolves the hostname and, when that names loopback (``127.0.1.1`` in many
``/etc/hosts``) or nothing, binds loopback: the other hosts then cannot reach this host's
ranks and a cross-host all_reduce times out. Choosing the NIC the other hosts are known to
reach removes that classic multi-host failure.

The rule (issue 8): a worker's ``nccl_socket_ifname`` sets both variables; else a setting in
the environment (this agent's own, the cluster file's ``env``, the host's ``env``) wins; else
each agent gives its ranks the interface of its own connection to the controller. The pure
choices are functions; the kernel is asked by :func:`local_ipv4_interfaces` and
:func:`interface_towards` only.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Iterable, Mapping

#: The ranks' socket-interface variables an agent fills in when nothing sets them.
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def ranks_env(host_env: Mapping[str, str], *, configured_ifname: str | None) -> dict[str, str]:
    """A host's env for its ranks: ``host_env``, with the worker's ``nccl_socket_ifname`` (when set)
    over both socket variables.

    When it is unset, the session fills in only the variables nothing sets
    (:func:`with_default_ifname`).
    """
    env = dict(host_env)
    if configured_ifname:
        env.update(dict.fromkeys(IFNAME_VARIABLES, configured_ifname))
    return env


def with_default_ifname(env: Mapping[str, str], ifname: str | None) -> dict[str, str]:
    """``env`` plus each of :data:`IFNAME_VARIABLES` it leaves unset, set to ``ifname`` (None:
    nothing added)."""
    out = dict(env)
    if ifname:
        for variable in IFNAME_VARIABLES:
            out.setdefault(variable, ifname)
    return out


def interface_of_address(addr: str, interfaces: Mapping[str, str]) -> str | None:
    """The interface holding IPv4 ``addr`` in ``interfaces`` (name → address), or None."""
    return next((name for name, held in interfaces.items() if held == addr), None)


def local_ipv4_interfaces() -> dict[str, str]:
    """Every interface of this network namespace that has an IPv4 address: name → address."""
    siocgifaddr = 0x8915
    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = array.array("B", struct.pack("256s", name.encode()[:15]))
            with contextlib.suppress(OSError):  # no IPv4 address on this interface
                fcntl.ioctl(s.fileno(), siocgifaddr, request)
                found[name] = socket.inet_ntoa(request.tobytes()[20:24])
    return found


def interface_holding(addr: str) -> str | None:
    """The interface of this namespace that holds local address ``addr`` (a connection's own end),
    or None."""
    return interface_of_address(addr, local_ipv4_interfaces()) if addr else None


def interface_towards(host: str, port: int) -> str | None:
    """The interface this host uses to reach ``host:port`` (a UDP connect sends nothing), or
    None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            local = str(s.getsockname()[0])
    except OSError:
        return None
    return interface_holding(local)


def stand_alone_default_ifname(controller_host: str) -> str | None:
    """A ``flodl-agent --controller HOST`` (dial-in, walk-in, ``--persist``): the default its
    session applies.

    None: the interface of its join connection, as for every other agent. But an agent that
    dials the controller over loopback runs on the controller's own machine, where that
    interface is ``lo`` and its ranks could not be reached from the run's other hosts: it sets
    nothing ("") and leaves gloo and NCCL their own choice, as the controller's host does with
    nothing better to go on.
    """
    return "" if _is_wildcard_or_loopback(controller_host) else None


def _is_wildcard_or_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host in ("", "localhost")
    return address.is_unspecified or address.is_loopback


def controller_host_peer(
    bind_host: str, port: int, remote_targets: Iterable[tuple[str, int]]
) -> tuple[str, int] | None:
    """Where the controller's own host must look to pick its ranks' interface; None: keep gloo's own
    choice.

    The agents inside the controller join over loopback, so "the interface of the connection to
    the controller" would be ``lo``, which the other hosts cannot reach. Their ranks need the
    interface that reaches those hosts instead: the one holding the controller's bind address
    when that is a specific address (the address the remote agents dial; a route to one's own
    address leaves from that address), else the one towards the first remote worker the launcher
    reaches directly (``remote_targets``: ssh target and port of each non-tunnelled ssh worker,
    in cluster-file order: :func:`flodl_async.config.plan.direct_ssh_targets`). With neither —
    a one-host run, or only dial-in workers behind a wildcard bind, whose addresses are unknown
    before they join — nothing is set, and the operator sets ``nccl_socket_ifname`` on the local
    worker.
    """
    if not _is_wildcard_or_loopback(bind_host):
        return (bind_host, port)
    return next(iter(remote_targets), None)


def controller_host_ifname(peer: tuple[str, int] | None) -> str | None:
    """The interface for the controller host's ranks, given :func:`controller_host_peer`'s answer
    (asks the kernel, maybe the resolver)."""
    return interface_towards(*peer) if peer is not None else None
