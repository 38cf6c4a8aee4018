"""What ``Trainer.run()`` does in this process: a pure function of the environment.

The same script runs as the launcher and as every rank. Which part this
process plays is decided here, from the environment alone, on top of
:func:`flodl_async.config.roles.detect_role`:

- a rank (``FLODL_INTERNAL_RANK_SPEC`` + local rank) joins the coordinator;
- an agent runs the agent (only when a deployment starts the user's script as one);
- the controller role (``FLODL_INTERNAL_CLUSTER_SPEC``), a ``cluster=`` argument, or 2+ visible GPUs
  with ``auto_promote`` make this process the launcher, which re-executes the script as the ranks;
- anything else trains inline, in this process.

Nothing here touches CUDA, a socket or torch: the caller counts the visible GPUs
(:func:`flodl_async.host.gpus.host_visible_gpus`, from the ``/dev/nvidiaN`` nodes
within ``CUDA_VISIBLE_DEVICES``). Which process of a run is its primary is decided
here too (:func:`rank_is_primary`).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Sequence

from ..config.roles import Role, detect_role
from ..errors import ConfigError

log = logging.getLogger("flodl_async.trainer.api")


class Entry(enum.Enum):
    """What ``Trainer.run()`` would do in this process."""

    LAUNCHER = "launcher"
    RANK = "rank"
    INLINE = "inline"
    AGENT = "agent"


_BY_ROLE: dict[Role, Entry] = {
    Role.RANK: Entry.RANK,
    Role.AGENT: Entry.AGENT,
    Role.CONTROLLER: Entry.LAUNCHER,
}


def decide_entry(
    env: Mapping[str, str], *, cluster_given: bool, auto_promote: bool, visible_gpus: int
) -> Entry:
    """The entry for this process (the rules in this module's docstring);
    an inconsistent role environment raises
    ``RoleError``.

    A rank or agent never promotes, whatever else is set: a child re-entering the script must never
    re-promote (its environment would name two roles and the cohort would die at dispatch).
    """
    role = detect_role(env)
    entry = _BY_ROLE.get(role)
    if entry is not None:
        return entry
    if cluster_given or (auto_promote and visible_gpus >= 2):
        return Entry.LAUNCHER
    return Entry.INLINE


#: Set by a Trainer launcher on its ranks: the launcher is the run's primary process, no rank is.
LAUNCHER_PRIMARY_VAR = "FLODL_TRAINER_LAUNCHER_PRIMARY"


def rank_is_primary(env: Mapping[str, str]) -> bool:
    """Rank 0 is primary, unless the script is also the launcher (then the launcher is)."""
    return env.get("RANK") == "0" and env.get(LAUNCHER_PRIMARY_VAR) != "1"


def resolve_rank_command(
    orig_argv: Sequence[str], executable: str, *, given: Sequence[str] | None = None
) -> tuple[str, ...]:
    """What the ranks run: ``given``, else this interpreter re-running what it was started with.

    ``sys.orig_argv`` keeps ``-m pkg.mod`` and ``-X`` flags. A program started from ``-c``, the
    interactive prompt or a notebook cannot be re-executed: that is a :class:`ConfigError` saying
    what to do.
    """
    if given is not None:
        command = tuple(given)
        if not command or not all(isinstance(part, str) and part for part in command):
            raise ConfigError(
                "Trainer(rank_command=...) must be a non-empty list of non-empty strings (got "
                f"{list(given)!r})"
            )
        return command
    args = list(orig_argv[1:])
    what = _started_from(args)
    if what is not None:
        raise ConfigError(
            "promoting to a launcher re-executes this program as the ranks, but it was started "
            f"from {what}; "
            "run it as `python train.py`, pass Trainer(rank_command=[...]), or "
            "Trainer(auto_promote=False) to train on one device"
        )
    return (executable, *args)


#: Interpreter options that take a value in the next argument (so that value is not the script).
_OPTIONS_WITH_VALUE = frozenset({"-W", "-X", "--check-hash-based-pycs"})


def _started_from(args: Sequence[str]) -> str | None:
    """None when ``args`` name a script or ``-m module``; else what the program was started from."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-c" or (arg.startswith("-c") and not arg.startswith("--")):
            return "`python -c`"
        if arg == "-m" or (arg.startswith("-m") and not arg.startswith("--")):
            return None
        if arg == "-":
            return "standard input"
        if arg in _OPTIONS_WITH_VALUE:
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        return None  # the script
    return "the interactive prompt (or a notebook)"


def restarts_setting(value: object) -> int:
    """``Trainer(max_restarts=...)``, checked: the launcher's ``--max-restarts`` — a rank lost to a
    crash is restarted alone and rejoins (CPU backend), this many times over the whole run."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(
            "Trainer(max_restarts=...) must be a whole number of 0 or more (rank restarts over the "
            f"whole run; 0: none); got {value!r}"
        )
    return value


def note_rank_restarts(wanted: int, env: Mapping[str, str]) -> None:
    """In a rank, ``Trainer(max_restarts=...)`` is its launcher's setting: under ``flodl-launch``
    (whose ``--max-restarts`` the agent passes down) a different value is said, not obeyed."""
    given = env.get("TORCHELASTIC_MAX_RESTARTS", "")
    if wanted and given.isdigit() and int(given) != wanted:
        log.warning(
            "Trainer(max_restarts=%d) does not apply under flodl-launch: its --max-restarts %s "
            "decides how many ranks are restarted",
            wanted,
            given,
        )
