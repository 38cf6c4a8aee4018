"""What a host session's failure means to the operator: the error behind it, its one line, its exit
code.

Shared by the one-run agent (:mod:`flodl_async.agent.cli`) and the persistent one
(:mod:`flodl_async.agent.daemon`): both turn what :meth:`HostSession.run
<flodl_async.agent.session.HostSession.run>` raised into the same user-facing error, or decide
that it is a bug. The one-run agent exits with :data:`ERROR_EXIT_CODES`; the persistent one
dials again on all but a usage problem (:func:`persist_exit_code`), as loudly as
:data:`PERSIST_RETRY_LEVELS` says.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from ..errors import (
    AgentError,
    ClosedBeforeJoin,
    ConfigError,
    ConnectionClosed,
    ControllerLost,
    ControllerNotProved,
    FlodlError,
    JoinFailed,
    WireError,
)
from ..verdict import ExitCode
from .join import SessionConfig

#: The exit code of each error a session ends with, most specific first (the first match wins).
ERROR_EXIT_CODES: tuple[tuple[type[FlodlError], ExitCode], ...] = (
    (ConfigError, ExitCode.USAGE),
    (JoinFailed, ExitCode.FORMATION),
    (AgentError, ExitCode.RANK_FAILURE),
)


#: Under ``--persist``, how loudly each failed session is retried (the first match wins). A failed
#: controller proof is an impostor at the controller's address or another token: the daemon cannot
#: tell them apart, and either may mend (the impostor goes, the token is fixed), so it keeps
#: dialing — warning each time, since an operator must hear of either. A config error is the only
#: failure that ends the daemon (:func:`persist_exit_code`).
PERSIST_RETRY_LEVELS: tuple[tuple[type[AgentError], int], ...] = (
    (ControllerNotProved, logging.WARNING),
    (ClosedBeforeJoin, logging.WARNING),
    (AgentError, logging.INFO),
)


def persist_exit_code(exc: AgentError | ConfigError) -> ExitCode | None:
    """The exit code that ends a persistent agent on ``exc``, or None: dial again.

    Only a usage problem (exit 2) is not worth retrying; a wrong token or an impostor may be gone
    next time, and ending the daemon would let anyone who can answer at the controller's address
    stop every agent of the fleet.
    """
    return ExitCode.USAGE if isinstance(exc, ConfigError) else None


def persist_retry_level(exc: AgentError) -> int:
    """The log level a persistent agent retries ``exc`` at (:data:`PERSIST_RETRY_LEVELS`)."""
    return next(level for cls, level in PERSIST_RETRY_LEVELS if isinstance(exc, cls))


def exit_code_for_error(exc: AgentError | ConfigError) -> ExitCode:
    """The exit code of a session that ended with ``exc`` (:data:`ERROR_EXIT_CODES`)."""
    return next(code for cls, code in ERROR_EXIT_CODES if isinstance(exc, cls))


def session_failure(exc: BaseException, config: SessionConfig) -> AgentError | ConfigError | None:
    """The user-facing error behind what a session raised, or None when it is a bug.

    A session's serving phase runs in a TaskGroup, so its error may come wrapped in an
    ``ExceptionGroup``: the group is unwrapped to its first session or config error. A
    link error that escaped untranslated is the controller going away — before admission
    when it comes bare (the join is outside the group), mid-run when it comes in the
    group. Anything else in a group is a bug, and so is the whole group then.
    """
    if isinstance(exc, AgentError | ConfigError):
        return exc
    if isinstance(exc, ConnectionClosed | WireError):
        return JoinFailed(
            config.host, f"lost the controller at {config.controller_addr} before joining: {exc}"
        )
    if not isinstance(exc, BaseExceptionGroup):
        return None
    leaves = list(_leaves(exc))
    if not all(
        isinstance(leaf, AgentError | ConfigError | ConnectionClosed | WireError) for leaf in leaves
    ):
        return None
    for leaf in leaves:
        if isinstance(leaf, AgentError | ConfigError):
            return leaf
    return ControllerLost(
        config.host, f"lost the controller at {config.controller_addr} mid-run: {leaves[0]}"
    )


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


def failure_line(exc: AgentError | ConfigError, controller: str) -> str:
    """One line for the operator: this host, the controller's address, the cause, what to do
    next."""
    if not isinstance(exc, AgentError):
        return f"flodl-agent: {exc}"
    # The session's reasons name the controller when they know its address; the rest get it here.
    where = "" if controller in exc.reason else f" (controller {controller})"
    return f"flodl-agent: agent {exc.host}: {exc.reason}{where} — {exc.advice}"
