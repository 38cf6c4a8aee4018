"""A package's public names loaded on first use (PEP 562): ``__getattr__`` and ``__dir__`` for a
package ``__init__`` that maps each name to the submodule defining it, so importing the package
(or one light submodule of it) does not load every heavy one."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_names(
    package: str, names: Mapping[str, str], public: Iterable[str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``names`` maps a public name to its submodule
    (relative); ``namespace`` is the package's ``globals()``, where a loaded name is kept."""
    listed = tuple(public)

    def getattr_(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        # the public names (the lazy ones too, unloaded: tab completion offers them) and the
        # module's dunders, not the helpers the file imports
        return sorted({*listed, *(name for name in namespace if name.startswith("__"))})

    return getattr_, dir_
