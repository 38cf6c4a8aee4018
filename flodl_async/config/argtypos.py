"""Command-line habits shared by ``flodl-launch``, ``flodl-agent`` and ``flodl``: a mistyped option
gets the closest real one.

torchrun users type ``--max_restarts`` and ``--log_dir`` (torchrun takes both
spellings of every option); :func:`hyphenate` accepts the underscore spelling of
an option we have. Anything else argparse does not know ends in its usual
``unrecognized arguments`` error, and :class:`HintingParser` adds what the user
most likely meant (``--nprc: did you mean --nproc?``), looked up across every
sub-command's options, since argparse reports strays from the top parser.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterator, Sequence
from typing import NoReturn

_UNRECOGNIZED = "unrecognized arguments: "


def _option_strings(parser: argparse.ArgumentParser) -> Iterator[str]:
    """Every ``--long`` option of ``parser`` and of its sub-commands."""
    for action in parser._actions:  # argparse has no public walk of its actions
        yield from (s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _option_strings(sub)


def closest_option(parser: argparse.ArgumentParser, given: str) -> str | None:
    """The option of ``parser`` that ``given`` (``--nprc``, ``--log_dir=x``) most likely meant, or
    None."""
    name = given.split("=", 1)[0]
    if not name.startswith("--"):
        return None
    known = sorted(set(_option_strings(parser)))
    normal = name.replace("_", "-")
    if normal in known:
        return normal
    found = difflib.get_close_matches(normal, known, n=1, cutoff=0.75)
    return found[0] if found else None


def hyphenate(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """torchrun's underscore spellings (``--max_restarts 1``, ``--log_dir=x``) of options ``parser``
    has, in their hyphenated form."""
    known = set(_option_strings(parser))
    out: list[str] = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        spelled = name.replace("_", "-")
        known_spelling = name.startswith("--") and name not in known and spelled in known
        out.append(spelled + eq + value if known_spelling else arg)
    return out


class HintingParser(argparse.ArgumentParser):
    """argparse, with ``did you mean --X?`` after an unrecognized option (sub-parsers made from it
    hint too)."""

    def error(self, message: str) -> NoReturn:
        if message.startswith(_UNRECOGNIZED):
            strays = message[len(_UNRECOGNIZED) :].split()
            hints = [
                f"{stray}: did you mean {hint}?"
                for stray in strays
                if (hint := closest_option(self, stray)) is not None
            ]
            message = "; ".join([message, *hints])
        super().error(message)
