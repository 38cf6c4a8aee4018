"""Dispatch by type: a table from each concrete event or action type to the method that takes it.

The cores and their shells each take a closed set of frozen dataclasses (a union). Looking the
handler up by the item's exact type says in one place which method takes which type, where an
``isinstance`` ladder says it in the order of its tests; :meth:`TypeTable.add` checks that the
method's first parameter accepts the type it is filed under, so the table needs neither a cast nor
an ignore. A type with no handler is a programming error and raises at once (it is never skipped).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Concatenate, Generic, ParamSpec, TypeVar

_T = TypeVar("_T")
_P = ParamSpec("_P")
_R = TypeVar("_R")
_K = TypeVar("_K")


class TypeTable(Generic[_T, _P, _R]):
    """``item -> handler(item, *args)`` by ``type(item)``, for the items of the union ``_T``; each
    type has one handler."""

    __slots__ = ("_by_type", "_what")

    def __init__(self, what: str) -> None:
        # ``what`` names the table in its errors: "the controller's actions"
        self._what = what
        self._by_type: dict[type, Callable[..., _R]] = {}

    def add(self, kind: type[_K], handler: Callable[Concatenate[_K, _P], _R]) -> None:
        """File ``handler`` under ``kind``; a second handler for one type is an error."""
        if kind in self._by_type:
            raise ValueError(f"{self._what}: {kind.__name__} already has a handler")
        self._by_type[kind] = handler

    def __call__(self, item: _T, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        handler = self._by_type.get(type(item))
        if handler is None:
            raise TypeError(f"{self._what}: no handler for {type(item).__name__}")
        return handler(item, *args, **kwargs)

    @property
    def kinds(self) -> frozenset[type]:
        """The types with a handler."""
        return frozenset(self._by_type)

    def require(self, union: object) -> None:
        """Raise unless every class of ``union`` has a handler and nothing else has one: a shell
        checks its table once, when it builds it, not on the first action of a kind."""
        expected = members(union)
        missing = sorted(kind.__name__ for kind in expected - self.kinds)
        extra = sorted(kind.__name__ for kind in self.kinds - expected)
        if missing or extra:
            raise TypeError(
                f"{self._what}: no handler for {missing or 'none'}; handlers for types outside "
                f"the union: {extra or 'none'}"
            )


def members(union: object) -> frozenset[type]:
    """The classes of a union alias such as ``Action`` (``Tell[str]`` counts as ``Tell``), to check
    that a table covers it."""
    is_union = typing.get_origin(union) in (typing.Union, types.UnionType)
    args = typing.get_args(union) if is_union else (union,)
    found: set[type] = set()
    for arg in args:
        origin = typing.get_origin(arg) or arg
        if not isinstance(origin, type):
            raise TypeError(f"{arg!r} is not a class")
        found.add(origin)
    return frozenset(found)
