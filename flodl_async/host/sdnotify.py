"""The systemd notification protocol (``sd_notify``), without libsystemd.

Theory of operation. A service of ``Type=notify`` tells systemd how it is
doing by sending datagrams of ``KEY=value`` lines to the AF_UNIX socket named
in ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace):
``READY=1`` once it is up, ``STATUS=…`` for ``systemctl status``,
``STOPPING=1`` when it begins to stop, ``MAINPID=`` and ``WATCHDOG=1``. With
``WatchdogSec=`` systemd sets ``$WATCHDOG_USEC`` (and ``$WATCHDOG_PID``, the
process it means) and kills a service that goes that long without a
``WATCHDOG=1``; systemd's advice is to ping at half the interval.

The core is pure: :func:`message` builds a datagram, :meth:`NotifyTarget.from_env`
reads the environment. :class:`Notifier` is the thin shell that sends, and it
is a no-op when the process is not under systemd, so callers never ask. Its
:meth:`Notifier.watchdog` ticker is meant to run as a task of the caller's
TaskGroup on the event loop itself: a loop that is stuck (a blocking call, a
busy callback) stops the pings, and systemd restarts the service — which is
the point of sending them from the loop rather than from a thread.

Sending never raises: a notification is advice to the service manager, and a
manager that went away (or a full socket buffer) must not take a run down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

log = logging.getLogger("flodl_async.host.sdnotify")

#: The variables systemd sets for the notification protocol; removed from the environment once read,
#: so the ranks (children of the agent) do not inherit them and cannot speak for the service.
NOTIFY_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

#: STATUS= text longer than this is cut: it is one line in ``systemctl status``, not a log.
MAX_STATUS_CHARS = 200


def message(
    *,
    ready: bool = False,
    stopping: bool = False,
    watchdog: bool = False,
    status: str | None = None,
    mainpid: int | None = None,
) -> bytes:
    """One notification datagram: the given fields as ``KEY=value`` lines, in a fixed order.

    A status is flattened to one line (systemd shows it on one) and cut to :data:`MAX_STATUS_CHARS`.
    """
    lines: list[str] = []
    if ready:
        lines.append("READY=1")
    if stopping:
        lines.append("STOPPING=1")
    if mainpid is not None:
        lines.append(f"MAINPID={mainpid}")
    if status is not None:
        flat = " ".join(status.split())
        lines.append(f"STATUS={flat[:MAX_STATUS_CHARS]}")
    if watchdog:
        lines.append("WATCHDOG=1")
    return "".join(f"{line}\n" for line in lines).encode()


def socket_address(notify_socket: str) -> str | bytes | None:
    """The address to send to for a ``$NOTIFY_SOCKET`` value: a path, abstract bytes for ``@name``,
    or None when unusable."""
    if notify_socket.startswith("@") and len(notify_socket) > 1:
        return b"\0" + notify_socket[1:].encode()
    if notify_socket.startswith("/"):
        return notify_socket
    # empty, relative, or vsock: not ours to speak (systemd's own sd_notify also needs an absolute
    # path)
    return None


def watchdog_interval(env: Mapping[str, str], *, pid: int) -> float | None:
    """Seconds between pings (half of ``$WATCHDOG_USEC``), or None when there is no watchdog for
    ``pid``."""
    raw = env.get("WATCHDOG_USEC", "").strip()
    if not raw.isdigit() or int(raw) == 0:
        return None
    owner = env.get("WATCHDOG_PID", "").strip()
    if owner and (not owner.isdigit() or int(owner) != pid):
        return None  # the watchdog is some other process's (we were started by it, say)
    return int(raw) / 1_000_000 / 2


@dataclass(frozen=True, slots=True, kw_only=True)
class NotifyTarget:
    """Where notifications go and how often the watchdog wants a ping; ``address`` None means not
    under systemd."""

    address: str | bytes | None = None
    watchdog_interval: float | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, pid: int) -> NotifyTarget:
        """Pure: the target that ``env`` describes for process ``pid``."""
        address = socket_address(env.get("NOTIFY_SOCKET", ""))
        if address is None:
            return cls()
        return cls(address=address, watchdog_interval=watchdog_interval(env, pid=pid))


class Notifier:
    """Sends notifications to the service manager; every method is a no-op when not under
    systemd."""

    def __init__(self, target: NotifyTarget) -> None:
        self.target = target
        self._sock: socket.socket | None = None
        if target.address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # a full receive buffer drops a ping; it never stalls the loop
            self._sock.setblocking(False)

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str] | None = None) -> Notifier:
        """The notifier this process's environment describes; the protocol's variables are then
        removed from it."""
        environ = os.environ if environ is None else environ
        target = NotifyTarget.from_env(environ, pid=os.getpid())
        for name in NOTIFY_VARIABLES:
            environ.pop(name, None)
        return cls(target)

    @property
    def enabled(self) -> bool:
        """True when notifications go somewhere."""
        return self._sock is not None

    def send(self, datagram: bytes) -> bool:
        """Send one datagram (see :func:`message`); True when it went out."""
        if self._sock is None or self.target.address is None or not datagram:
            return False
        try:
            self._sock.sendto(datagram, self.target.address)
        except OSError as exc:  # no manager listening, or its buffer is full: advice, not a failure
            log.debug("sd_notify to %r failed: %s", self.target.address, exc)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """``READY=1`` (with the status, when given) and this process as the main pid."""
        return self.send(message(ready=True, status=status, mainpid=os.getpid()))

    def status(self, text: str) -> bool:
        """``STATUS=text``."""
        return self.send(message(status=text))

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``: the service has begun to stop."""
        return self.send(message(stopping=True, status=status))

    async def watchdog(self) -> None:
        """Ping ``WATCHDOG=1`` every interval until cancelled; returns at once when there is no
        watchdog.

        Run it as a named task of the caller's TaskGroup: the pings come from the event loop,
        so a stuck loop is a missed ping.
        """
        interval = self.target.watchdog_interval
        if self._sock is None or interval is None:
            return
        ping = message(watchdog=True)
        while True:
            self.send(ping)
            await asyncio.sleep(interval)

    def close(self) -> None:
        """Release the socket (idempotent)."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
