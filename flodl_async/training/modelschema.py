"""The model's tensor layout, as every side of a Trainer run agrees on it (pure, no torch import).

Theory of operation. Averaging sends tensors in one fixed order — parameters, then
persistent buffers — and pairs them by position and name (flodl's ``ModelSchema``,
params then buffers). Python adds tied parameters: ``named_parameters()`` lists a
shared tensor once, ``state_dict()`` lists it under every key. The extra keys are
*aliases* of the tensor already listed; they never travel, and a consensus
``state_dict`` fills them in from the tensor they name.

A schema is built in a rank from its model (:meth:`ModelSchema.from_module`), sent
up in ``TrainerHello`` as :class:`~flodl_async.wire.messages.ModelSchemaWire`, and
rebuilt in the controller (:meth:`ModelSchema.from_wire`), which never imports
torch for it: dtypes travel as their wire names (``"float32"``, ``"int64"``...).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from ..errors import ConfigError
from ..wire.messages import ModelSchemaWire
from ..wire.tensor import DTYPE_ITEMSIZE

if TYPE_CHECKING:
    import torch

#: Dtypes the averaging fold treats as floating point (accumulated in f32, or f64 for f64).
FLOAT_DTYPES = frozenset({"float32", "float64", "float16", "bfloat16"})


class _Module(Protocol):
    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]: ...
    def state_dict(self) -> Mapping[str, torch.Tensor]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorMeta:
    """One tensor that travels: its state_dict key, wire dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_ITEMSIZE[self.dtype]


def wire_dtype(tensor: torch.Tensor) -> str:
    """``torch.float32`` → ``"float32"``, refusing dtypes the wire cannot carry."""
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        supported = ", ".join(sorted(DTYPE_ITEMSIZE))
        raise ConfigError(
            f"dtype {name} is not supported by the Trainer's averaging (supported: {supported}); "
            "cast it or make it non-persistent"
        )
    return name


def _storage_key(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...], str]:
    # Two state_dict entries are the same tensor (tied) when they view the same memory the same way.
    return (
        tensor.data_ptr(),
        int(tensor.storage_offset()),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        str(tensor.dtype),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSchema:
    """Parameters then persistent buffers, in wire order, plus the aliases of tied keys."""

    params: tuple[TensorMeta, ...]
    buffers: tuple[TensorMeta, ...]
    #: alias state_dict key → the listed name whose tensor it shares.
    aliases: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for meta in (*self.params, *self.buffers):
            if meta.name in seen:
                raise ConfigError(
                    f"model schema lists tensor {meta.name!r} twice; every state_dict key must be "
                    "unique"
                )
            if meta.dtype not in DTYPE_ITEMSIZE:
                raise ConfigError(
                    f"model schema: tensor {meta.name!r} has dtype {meta.dtype!r}, which the wire "
                    "cannot carry"
                )
            if any(d < 0 for d in meta.shape):
                raise ConfigError(
                    f"model schema: tensor {meta.name!r} has a negative dimension in {meta.shape}"
                )
            seen.add(meta.name)
        for alias, target in self.aliases.items():
            if alias in seen:
                raise ConfigError(f"model schema: alias {alias!r} is also a listed tensor")
            if target not in seen:
                raise ConfigError(
                    f"model schema: alias {alias!r} names {target!r}, which is not a listed tensor"
                )
        object.__setattr__(self, "aliases", MappingProxyType(dict(self.aliases)))

    # ----- construction -------------------------------------------------------------------

    @classmethod
    def from_module(cls, model: _Module) -> ModelSchema:
        """The schema of an ``nn.Module``: ``named_parameters()`` order, then persistent buffers."""
        param_names = [name for name, _ in model.named_parameters()]
        return cls.from_state_dict(model.state_dict(), param_names)

    @classmethod
    def from_state_dict(
        cls, state_dict: Mapping[str, torch.Tensor], param_names: Sequence[str]
    ) -> ModelSchema:
        """The schema of ``state_dict`` whose parameters are ``param_names`` (duplicates dropped,
        order kept).

        Every other key is a persistent buffer, unless its tensor is the same memory as a key
        already listed: then it is an alias of that key (a tied parameter or buffer).
        """
        ordered = list(dict.fromkeys(param_names))
        missing = [name for name in ordered if name not in state_dict]
        if missing:
            raise ConfigError(
                f"model schema: parameter {missing[0]!r} is not a state_dict key; pass the names "
                "of the module's own parameters"
            )
        listed: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], str], str] = {}
        params: list[TensorMeta] = []
        aliases: dict[str, str] = {}
        for name in ordered:
            tensor = state_dict[name]
            key = _storage_key(tensor)
            if key in listed and tensor.numel() > 0:
                aliases[name] = listed[key]
                continue
            listed.setdefault(key, name)
            params.append(
                TensorMeta(name=name, dtype=wire_dtype(tensor), shape=tuple(tensor.shape))
            )
        param_set = set(ordered)
        buffers: list[TensorMeta] = []
        for name, tensor in state_dict.items():
            if name in param_set:
                continue
            key = _storage_key(tensor)
            if key in listed and tensor.numel() > 0:
                aliases[name] = listed[key]
                continue
            listed.setdefault(key, name)
            buffers.append(
                TensorMeta(name=name, dtype=wire_dtype(tensor), shape=tuple(tensor.shape))
            )
        return cls(params=tuple(params), buffers=tuple(buffers), aliases=aliases)

    # ----- views ----------------------------------------------------------------------------

    @property
    def tensors(self) -> tuple[TensorMeta, ...]:
        """Every tensor that travels, in wire order."""
        return (*self.params, *self.buffers)

    @property
    def names(self) -> tuple[str, ...]:
        """Tensor order on the wire: parameters then buffers."""
        return tuple(meta.name for meta in self.tensors)

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(meta.name for meta in self.params)

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return tuple(meta.name for meta in self.buffers)

    @property
    def model_bytes(self) -> int:
        """Bytes of one full contribution in the model's own dtypes."""
        return sum(meta.nbytes for meta in self.tensors)

    def meta(self, name: str) -> TensorMeta:
        """The listed tensor called ``name`` (``KeyError`` if it is not listed)."""
        for meta in self.tensors:
            if meta.name == name:
                return meta
        raise KeyError(name)

    def with_aliases(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A full state_dict from wire tensors: every alias key maps to the tensor it names."""
        out = dict(tensors)
        for alias, target in self.aliases.items():
            out[alias] = tensors[target]
        return out

    # ----- wire -----------------------------------------------------------------------------

    def to_wire(self) -> ModelSchemaWire:
        tensors = self.tensors
        return ModelSchemaWire(
            param_names=self.param_names,
            buffer_names=self.buffer_names,
            dtypes=tuple(meta.dtype for meta in tensors),
            shapes=tuple(meta.shape for meta in tensors),
            aliases=dict(self.aliases),
        )

    @classmethod
    def from_wire(cls, wire: ModelSchemaWire) -> ModelSchema:
        """Rebuild a schema a rank sent; a malformed one is a :class:`ConfigError` naming what is
        wrong."""
        names = (*wire.param_names, *wire.buffer_names)
        if len(wire.dtypes) != len(names) or len(wire.shapes) != len(names):
            raise ConfigError(
                f"model schema from the rank is inconsistent: {len(names)} names, "
                f"{len(wire.dtypes)} dtypes, {len(wire.shapes)} shapes"
            )
        metas = [
            TensorMeta(name=n, dtype=d, shape=tuple(s))
            for n, d, s in zip(names, wire.dtypes, wire.shapes, strict=True)
        ]
        n_params = len(wire.param_names)
        return cls(
            params=tuple(metas[:n_params]),
            buffers=tuple(metas[n_params:]),
            aliases=dict(wire.aliases),
        )

    def digest_input(self) -> list[object]:
        """A canonical plain value of the whole schema (msgpack-able; aliases sorted) for the run
        digest."""
        return [
            [[m.name, m.dtype, list(m.shape)] for m in self.params],
            [[m.name, m.dtype, list(m.shape)] for m in self.buffers],
            sorted([alias, target] for alias, target in self.aliases.items()),
        ]

    def first_difference(self, other: ModelSchema) -> str | None:
        """What first differs between two schemas, in words (None when equal)."""
        for label, mine, theirs in (
            ("parameter", self.params, other.params),
            ("buffer", self.buffers, other.buffers),
        ):
            for a, b in zip(mine, theirs, strict=False):
                if a != b:
                    return (
                        f"{label} {a.name!r} ({a.dtype}, shape {a.shape}) != {b.name!r} "
                        f"({b.dtype}, shape {b.shape})"
                    )
            if len(mine) != len(theirs):
                return f"{len(mine)} {label}s != {len(theirs)}"
        if dict(self.aliases) != dict(other.aliases):
            return f"aliases {dict(self.aliases)} != {dict(other.aliases)}"
        return None
