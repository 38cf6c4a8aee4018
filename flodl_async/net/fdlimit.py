"""The process's descriptor limit (RLIMIT_NOFILE): raised to the hard limit at start, read for the
mux's warnings.

Every connection is a descriptor, and the common soft limit (1,024) is a fraction of what the
hard limit allows: an unprivileged process may raise its own soft limit up to the hard one, so
the controller and the stand-alone agent do that once when they start. It never fails a run: a
platform without ``resource`` (Windows) or a refusal leaves the limit as it was, logged at DEBUG.
When accept() does fail for want of descriptors, :func:`accept_advice` says what to do, and
:class:`AcceptFailureHook` takes asyncio's reports of it for the mux.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import typing
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("flodl_async.net")

#: Tried when the hard limit is "unlimited" (macOS), where the kernel refuses RLIM_INFINITY for
#: RLIMIT_NOFILE: a large value first, then OPEN_MAX, which macOS always accepts.
_FALLBACK_SOFT_LIMITS = (1 << 20, 10240)


@dataclass(frozen=True, slots=True, kw_only=True)
class DescriptorLimit:
    """The soft and hard RLIMIT_NOFILE; None means unlimited or unknown."""

    soft: int | None
    hard: int | None

    def describe(self) -> str:
        """E.g. ``soft limit 1024, hard limit 4096``."""
        return f"soft limit {_show(self.soft)}, hard limit {_show(self.hard)}"


def _show(value: int | None) -> str:
    return "unlimited" if value is None else str(value)


def descriptor_limit() -> DescriptorLimit:
    """This process's descriptor limits now."""
    try:
        import resource
    except ImportError:  # Windows: no rlimits
        return DescriptorLimit(soft=None, hard=None)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinity = resource.RLIM_INFINITY
    return DescriptorLimit(
        soft=None if soft == infinity else soft, hard=None if hard == infinity else hard
    )


def raise_descriptor_limit() -> DescriptorLimit:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the limits afterwards. Never
    raises."""
    try:
        import resource
    except ImportError:
        log.debug("descriptor limit: this platform has no rlimits; left as it is")
        return DescriptorLimit(soft=None, hard=None)
    try:
        before = descriptor_limit()
    except (OSError, ValueError) as exc:
        log.debug("descriptor limit: cannot read RLIMIT_NOFILE (%s); left as it is", exc)
        return DescriptorLimit(soft=None, hard=None)
    if before.soft is None or before.soft == before.hard:
        log.debug("descriptor limit: already at the hard limit (%s)", before.describe())
        return before
    targets = (
        (before.hard,)
        if before.hard is not None
        else tuple(t for t in _FALLBACK_SOFT_LIMITS if t > before.soft)
    )
    hard = resource.RLIM_INFINITY if before.hard is None else before.hard
    failure: Exception | None = None
    for target in targets:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            failure = exc
            continue
        after = DescriptorLimit(soft=target, hard=before.hard)
        log.debug(
            "descriptor limit: raised the soft limit from %d to %d (%s)",
            before.soft,
            target,
            after.describe(),
        )
        return after
    log.debug(
        "descriptor limit: could not raise the soft limit above %d (%s): %s",
        before.soft,
        before.describe(),
        failure,
    )
    return before


def accept_advice(code: int, limit: DescriptorLimit) -> str:
    """What accept() failing with ``code`` means, and what to do about it (a summary note)."""
    if code == errno.EMFILE:
        return (
            f"accept() failed: out of file descriptors (EMFILE; {limit.describe()}): raise "
            "`ulimit -n`"
        )
    if code == errno.ENFILE:
        return (
            "accept() failed: the system's file table is full (ENFILE): raise fs.file-max "
            "(sysctl) or close files elsewhere"
        )
    return (
        "accept() failed: the kernel is out of memory for sockets "
        f"({errno.errorcode.get(code, code)})"
    )


#: accept() errors asyncio reports (and retries a second later) when the process or the kernel runs
#: out.
ACCEPT_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

_LoopHandler = Callable[[asyncio.AbstractEventLoop, dict[str, typing.Any]], object]


class AcceptFailureHook:
    """Takes the loop's reports of accept() failing for want of descriptors on one server's
    sockets, and hands each to ``on_failure``; every other report goes where it went before.

    asyncio reports such a failure through the loop's exception handler, once per attempt (up to
    the backlog per retry) at ERROR with a generic message; the mux turns them into one summary
    line that names the limit. (uvloop never reports it: libuv accepts and closes the pending
    connections; the mux's open-connection warning covers it.)
    """

    def __init__(self, on_failure: Callable[[OSError], None]) -> None:
        self._on_failure = on_failure
        self._server: asyncio.Server | None = None
        self._previous: _LoopHandler | None = None
        self._installed = False

    def install(self, loop: asyncio.AbstractEventLoop, server: asyncio.Server) -> None:
        """Take the loop's exception handler for ``server``'s accept failures."""
        self._server = server
        self._previous = loop.get_exception_handler()
        loop.set_exception_handler(self._on_loop_exception)
        self._installed = True

    def uninstall(self, loop: asyncio.AbstractEventLoop) -> None:
        """Give the loop its previous handler back (unless someone replaced ours meanwhile)."""
        if self._installed and loop.get_exception_handler() == self._on_loop_exception:
            loop.set_exception_handler(self._previous)
        self._installed = False
        self._server = None

    def _on_loop_exception(
        self, loop: asyncio.AbstractEventLoop, context: dict[str, typing.Any]
    ) -> None:
        exc = context.get("exception")
        sock = context.get("socket")
        if (
            isinstance(exc, OSError)
            and exc.errno in ACCEPT_RESOURCE_ERRNOS
            and sock is not None
            and self._is_listening_socket(sock)
        ):
            self._on_failure(exc)
        elif self._previous is not None:
            self._previous(loop, context)
        else:
            loop.default_exception_handler(context)

    def _is_listening_socket(self, sock: typing.Any) -> bool:
        try:
            fileno = sock.fileno()
        except (AttributeError, OSError):
            return False
        return self._server is not None and any(s.fileno() == fileno for s in self._server.sockets)
