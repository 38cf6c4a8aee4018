"""Reading a YAML file's nodes with errors that point at the line: the cluster file's building
blocks.

Every reader takes the node, its dotted path in the file (``workers[0].ssh.port``) and the
:class:`NodeDoc` that turns a problem into a :class:`~flodl_async.errors.ConfigError` naming the
file, the line and the key. Pure.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import yaml

from ..errors import ConfigError


class NodeDoc:
    """Error context: the file name for messages; and the directory its relative paths start
    from."""

    def __init__(self, source: str, base_dir: Path | None = None) -> None:
        self.source = source
        self.base_dir = base_dir

    def path(self, text: str | None) -> str | None:
        """A path of the file as the launcher's machine opens it: relative ones from the file's
        directory (``~`` is expanded where it is used)."""
        if text is None or self.base_dir is None or text.startswith("~"):
            return text
        if Path(text).is_absolute():
            return text
        return str(self.base_dir / text)

    def error(self, node: yaml.Node | None, path: str, problem: str) -> ConfigError:
        line = f":{node.start_mark.line + 1}" if node is not None else ""
        where = f" {path}:" if path else ""
        return ConfigError(f"{self.source}{line}:{where} {problem}")


_LOADER_FOR_SCALARS = yaml.SafeLoader("")


def scalar(node: yaml.Node) -> object:
    return _LOADER_FOR_SCALARS.construct_object(node, deep=True)


def mapping(
    doc: NodeDoc, node: yaml.Node, path: str, allowed: tuple[str, ...]
) -> dict[str, yaml.Node]:
    if not isinstance(node, yaml.MappingNode):
        raise doc.error(node, path, f"expected a mapping with keys {', '.join(allowed)}")
    out: dict[str, yaml.Node] = {}
    for key_node, value_node in node.value:
        key = scalar(key_node)
        if not isinstance(key, str):
            raise doc.error(key_node, path, f"keys must be strings, got {key!r}")
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
            hint = (
                f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(allowed)}"
            )
            raise doc.error(key_node, join_path(path, key), f"unknown key {key!r}{hint}")
        if key in out:
            raise doc.error(key_node, join_path(path, key), "key given twice")
        out[key] = value_node
    return out


def join_path(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def read_str(doc: NodeDoc, node: yaml.Node, path: str, *, allow_empty: bool = False) -> str:
    value = scalar(node) if isinstance(node, yaml.ScalarNode) else None
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        raise doc.error(node, path, "expected a non-empty string")
    return value


def read_int(
    doc: NodeDoc, node: yaml.Node, path: str, *, minimum: int, maximum: int | None = None
) -> int:
    value = scalar(node) if isinstance(node, yaml.ScalarNode) else None
    if type(value) is not int or value < minimum or (maximum is not None and value > maximum):
        upper = f" and at most {maximum}" if maximum is not None else ""
        raise doc.error(
            node, path, f"expected an integer of at least {minimum}{upper}, got {show_node(node)}"
        )
    return value


def read_seconds(doc: NodeDoc, node: yaml.Node, path: str) -> float:
    value = scalar(node) if isinstance(node, yaml.ScalarNode) else None
    if type(value) not in (int, float) or not value > 0:  # type: ignore[operator]
        raise doc.error(node, path, f"expected a positive number of seconds, got {show_node(node)}")
    return float(value)  # type: ignore[arg-type]


def read_bool(doc: NodeDoc, node: yaml.Node, path: str) -> bool:
    value = scalar(node) if isinstance(node, yaml.ScalarNode) else None
    if type(value) is not bool:
        raise doc.error(node, path, f"expected true or false, got {show_node(node)}")
    return value


def show_node(node: yaml.Node) -> str:
    if isinstance(node, yaml.ScalarNode):
        return repr(node.value) if node.value != "" else "nothing"
    return "a list" if isinstance(node, yaml.SequenceNode) else "a mapping"
