"""The ranks' command: torchrun's spellings of it, and which ``python`` a leading ``python`` is on
each host.

A run's command is one for every host, but the interpreter that has the user's packages is not:
the worker's ``python:`` in the cluster file names it on that host, a dial-in agent brings its
own. So the launcher tells each host's agent, in that host's rank environment, which interpreter
a leading ``python``/``python3`` means there (:data:`PYTHON_VAR`: a path, or empty for ``PATH``'s),
and tells every host, in the run's environment, whether to resolve it at all
(:data:`RESOLVE_VAR`; ``--no-python`` runs the command as it is). An agent that was told nothing
about its host (a dial-in agent) runs its own interpreter. Neither variable reaches a rank.

Pure: the ``PATH`` lookup is the caller's (a ``which`` function).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..errors import ConfigError

#: The words of a command that mean "the Python interpreter".
PYTHON_WORDS = frozenset({"python", "python3"})
#: Host env (set by the launcher that starts the host's agent): the interpreter a leading ``python``
#: means on that host; empty: the one ``PATH`` finds there (else the agent's own).
PYTHON_VAR = "FLODL_INTERNAL_PYTHON"
#: Run env: "1" when the command's leading ``python`` is to be resolved on each host (unset under
#: ``--no-python``, and for a Trainer's own command, which names its interpreter by path).
RESOLVE_VAR = "FLODL_INTERNAL_RESOLVE_PYTHON"
#: The variables of this module, which no rank sees.
INTERNAL_VARS = frozenset({PYTHON_VAR, RESOLVE_VAR})


def launch_command(
    command: tuple[str, ...], *, no_python: bool = False, run_path: bool = False
) -> tuple[str, ...]:
    """The command a run's ranks execute, from what followed ``--`` (torchrun's forms).

    ``-m pkg.mod ARGS`` is ``python -m pkg.mod ARGS``; ``--run-path`` takes the first word as a
    Python file's path (``python PATH ARGS``); ``--no-python`` runs the command as it is, so a
    module cannot be given with it (torchrun refuses the same pair).
    """
    if not command:
        raise ConfigError("missing the command to run")
    if no_python and run_path:
        raise ConfigError(
            "--run-path runs a Python file and --no-python runs the command without Python; "
            "pick one"
        )
    if command[0] == "-m":
        if no_python:
            raise ConfigError(
                "--no-python runs the command as it is, so `-m MODULE` has no interpreter to run "
                "it; drop --no-python (then `-m` runs `python -m MODULE`)"
            )
        if run_path:
            raise ConfigError(
                "--run-path takes a Python file's path, not `-m MODULE`; drop one of them"
            )
        if len(command) < 2 or command[1].startswith("-"):
            raise ConfigError("-m needs a module name, e.g. -- -m pkg.train")
        return ("python", *command)
    if run_path:
        if command[0].startswith("-") or command[0] in PYTHON_WORDS:
            raise ConfigError(
                f"--run-path takes the Python file's path first (got {command[0]!r}), e.g. "
                "flodl-launch --nproc 2 --run-path -- train.py --epochs 3"
            )
        return ("python", *command)
    return command


def resolves_python(command: tuple[str, ...]) -> bool:
    """Whether the command starts with a ``python`` that each host resolves."""
    return bool(command) and command[0] in PYTHON_WORDS


def host_command(
    command: tuple[str, ...],
    *,
    run_env: Mapping[str, str],
    host_env: Mapping[str, str],
    own_python: str,
    which: Callable[[str], str | None],
) -> tuple[str, ...]:
    """The command as this host runs it: a leading ``python`` made this host's interpreter.

    ``host_env``'s :data:`PYTHON_VAR` names it (a path), or is empty for the one ``which`` finds
    (``own_python``, the agent's own, when none); without it, the agent's own interpreter.
    """
    if run_env.get(RESOLVE_VAR) != "1" or not resolves_python(command):
        return command
    given = host_env.get(PYTHON_VAR)
    if given is None:
        interpreter = own_python
    elif given:
        interpreter = given
    else:
        interpreter = which(command[0]) or own_python
    return (interpreter, *command[1:])


def without_internal(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without this module's variables (what a rank's environment is built from)."""
    return {name: value for name, value in env.items() if name not in INTERNAL_VARS}
