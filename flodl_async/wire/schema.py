"""Typed messages: frozen dataclasses with a versioned msgpack schema.

Theory of operation: each message class is registered under a 16-bit kind
and a schema version. Its body is a msgpack array ``[version, field1,
field2, ...]`` in declaration order: positions play the part of protobuf's
field numbers, and an array packs and unpacks in about half the time of a
map with key strings (this runs once per control frame). Evolution is
append-only: a newer peer may add fields *at the end*, with defaults (older
readers ignore trailing values they do not know), a reader fills missing
trailing defaulted fields, and a missing required field or a value of the
wrong type is a :class:`MalformedBody`. Changing or removing a field needs a
new kind. Supported field types: ``str, int, float, bool, bytes``, ``tuple[T, ...]``,
``dict[str, T]``, ``T | None`` and nested message dataclasses.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import msgpack

from ..errors import MalformedBody, UnknownKind


class Message:
    """Base of every wire message; subclasses are frozen dataclasses registered with
    :func:`message`."""

    __slots__ = ()
    KIND: ClassVar[int]
    SCHEMA_VERSION: ClassVar[int]
    #: The body is encrypted on the wire (AES-256-GCM, :mod:`.frame`): messages that can carry
    #: secrets.
    SEALED: ClassVar[bool]


M = TypeVar("M", bound=type[Message])

_REGISTRY: dict[int, type[Message]] = {}
_FIELDS: dict[type[Message], tuple[tuple[str, Any, bool], ...]] = {}


def message(*, kind: int, version: int = 1, sealed: bool = False) -> Callable[[M], M]:
    """Register a message class under ``kind`` (unique, 1..0xFFFF) and schema ``version``.

    ``sealed``: its body can carry secrets (commands, environment values, a user's
    stderr), so the frame codec encrypts it, not only authenticates it.
    """

    def register(cls: M) -> M:
        if not 0 < kind <= 0xFFFF:
            raise ValueError(f"message kind {kind:#x} out of range")
        if kind in _REGISTRY:
            raise ValueError(
                f"message kind {kind:#x} registered twice ({_REGISTRY[kind].__name__}, "
                f"{cls.__name__})"
            )
        cls.KIND = kind
        cls.SCHEMA_VERSION = version
        cls.SEALED = sealed
        _REGISTRY[kind] = cls
        return cls

    return register


def registered_kinds() -> dict[int, type[Message]]:
    """A copy of the kind → class registry (for tests and tooling)."""
    return dict(_REGISTRY)


def sealed_kinds() -> frozenset[int]:
    """The kinds whose bodies travel encrypted."""
    return frozenset(kind for kind, cls in _REGISTRY.items() if cls.SEALED)


def message_class(kind: int) -> type[Message]:
    """The class registered for ``kind``, or :class:`UnknownKind`."""
    try:
        return _REGISTRY[kind]
    except KeyError:
        raise UnknownKind(
            f"unknown message kind {kind:#06x}: the peer runs a newer or foreign protocol"
        ) from None


def _fields(cls: type[Message]) -> tuple[tuple[str, Any, bool], ...]:
    cached = _FIELDS.get(cls)
    if cached is None:
        hints = typing.get_type_hints(cls)
        cached = tuple(
            (
                f.name,
                hints[f.name],
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        )
        _FIELDS[cls] = cached
    return cached


def _to_plain(value: object) -> object:
    if isinstance(value, Message):
        return to_body(value)
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


_PLAIN_TYPES = (str, int, float, bool, bytes, type(None))
_ENCODERS: dict[type[Message], tuple[tuple[str, bool], ...]] = {}


def _is_plain(hint: Any) -> bool:
    if hint in _PLAIN_TYPES:
        return True
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return all(_is_plain(arg) for arg in typing.get_args(hint))
    return False


def to_body(msg: Message) -> list[object]:
    """The msgpack-ready array for ``msg``."""
    cls = type(msg)
    encoder = _ENCODERS.get(cls)
    if encoder is None:
        # Which fields msgpack takes as they are: decided once per class, not per frame.
        encoder = tuple((name, _is_plain(hint)) for name, hint, _required in _fields(cls))
        _ENCODERS[cls] = encoder
    body: list[object] = [msg.SCHEMA_VERSION]
    for name, plain in encoder:
        value = getattr(msg, name)
        body.append(value if plain else _to_plain(value))
    return body


_PACKER_OPTIONS: dict[str, Any] = {"use_bin_type": True}


def pack_message(msg: Message) -> bytes:
    """msgpack bytes of ``msg``'s body."""
    return msgpack.packb(to_body(msg), **_PACKER_OPTIONS)  # type: ignore[no-any-return]


def unpack_message(kind: int, body: bytes | memoryview) -> Message:
    """Decode an *authenticated* body into the message registered for ``kind``."""
    cls = message_class(kind)
    limit = len(body)
    try:
        raw = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            use_list=False,
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=limit,
            max_map_len=limit,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises a dozen unrelated types on bad input
        raise MalformedBody(f"{cls.__name__}: body is not valid msgpack ({exc})") from exc
    return _from_plain(cls, raw, cls.__name__)


class _Mismatch(Exception):
    """A value did not fit its field; carries the path below the field for the error message."""

    def __init__(self, problem: str, path: str = "") -> None:
        super().__init__(problem)
        self.problem = problem
        self.path = path


Converter = Callable[[object], object]
Builder = Callable[[tuple[object, ...]], Message]
_BUILDERS: dict[type[Message], Builder] = {}


def _builder(cls: type[Message]) -> Builder:
    """A decoder for ``cls``, compiled once: type hints are inspected at first use, not per frame.

    It fills the instance's slots directly (``object.__new__`` + ``object.__setattr__``), which
    is what the frozen dataclass ``__init__`` does, minus the keyword-argument round trip;
    messages therefore carry no ``__post_init__`` — the schema is their validation.
    """
    cached = _BUILDERS.get(cls)
    if cached is not None:
        return cached
    entries: list[tuple[str, type | None, Converter, Callable[[], object] | None]] = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        hint = typing.get_type_hints(cls)[f.name]
        default: Callable[[], object] | None
        if f.default is not dataclasses.MISSING:
            default = functools.partial(_constant, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory
        else:
            default = None
        exact = hint if hint in (str, int, float, bool, bytes) else None
        entries.append((f.name, exact, _converter(hint), default))
    new, assign = object.__new__, object.__setattr__

    def build(raw: tuple[object, ...]) -> Message:
        obj = new(cls)
        count = len(raw)
        position = 1
        for name, exact, convert, default in entries:
            if position < count:
                value = raw[position]
                if exact is None or type(value) is not exact:
                    try:
                        value = convert(value)
                    except _Mismatch as exc:
                        raise _Mismatch(exc.problem, f".{name}{exc.path}") from None
            elif default is None:
                raise _Mismatch(f"required field {name!r} is missing")
            else:
                value = default()
            assign(obj, name, value)
            position += 1
        return obj

    _BUILDERS[cls] = build
    return build


def _constant(value: object) -> object:
    return value


def _from_plain(cls: type[Message], raw: object, where: str) -> Message:
    try:
        return _build(cls, raw)
    except _Mismatch as exc:
        raise MalformedBody(f"{where}{exc.path}: {exc.problem}") from None


def _build(cls: type[Message], raw: object) -> Message:
    if type(raw) is not tuple:
        raise _Mismatch(f"expected an array, got {type(raw).__name__}")
    if not raw or type(raw[0]) is not int or raw[0] < 1:
        raise _Mismatch("missing or invalid schema version")
    return _builder(cls)(raw)


def _exact(expected: type) -> Converter:
    def convert(value: object) -> object:
        if type(value) is not expected:
            raise _Mismatch(f"expected {expected.__name__}, got {type(value).__name__}")
        return value

    return convert


def _to_float(value: object) -> object:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    raise _Mismatch(f"expected float, got {type(value).__name__}")


def _converter(hint: Any) -> Converter:  # noqa: C901 — one branch per supported type
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        options = [_converter(o) for o in typing.get_args(hint) if o is not type(None)]
        nullable = type(None) in typing.get_args(hint)

        def convert_union(value: object) -> object:
            if value is None and nullable:
                return None
            first: _Mismatch | None = None
            for option in options:
                try:
                    return option(value)
                except _Mismatch as exc:
                    first = first or exc
            raise first or _Mismatch("unexpected None")

        return convert_union
    if origin is tuple:
        item = _converter(typing.get_args(hint)[0])

        def convert_tuple(value: object) -> object:
            if type(value) is not tuple:
                raise _Mismatch(f"expected an array, got {type(value).__name__}")
            out = []
            for i, element in enumerate(value):
                try:
                    out.append(item(element))
                except _Mismatch as exc:
                    raise _Mismatch(exc.problem, f"[{i}]{exc.path}") from None
            return tuple(out)

        return convert_tuple
    if origin is dict:
        entry = _converter(typing.get_args(hint)[1])

        def convert_dict(value: object) -> object:
            if type(value) is not dict:
                raise _Mismatch(f"expected a map, got {type(value).__name__}")
            out = {}
            for key, element in value.items():
                if type(key) is not str:  # msgpack's strict_map_key still lets bytes keys through
                    raise _Mismatch(f"expected a str key, got {type(key).__name__}", f"[{key!r}]")
                try:
                    out[key] = entry(element)
                except _Mismatch as exc:
                    raise _Mismatch(exc.problem, f"[{key!r}]{exc.path}") from None
            return out

        return convert_dict
    if isinstance(hint, type) and issubclass(hint, Message):
        nested = hint

        def convert_nested(value: object) -> object:
            return _build(nested, value)

        return convert_nested
    if hint is float:
        return _to_float
    if hint in (bool, int, str, bytes):
        return _exact(hint)
    raise TypeError(f"unsupported field type {hint!r} in a message schema")
