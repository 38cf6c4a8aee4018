"""ModelSchema: params in named_parameters order, persistent buffers, aliases of tied keys, the wire form."""

from __future__ import annotations

import msgpack
import pytest
import torch
from torch import nn

from flodl_async.errors import ConfigError
from flodl_async.training.modelschema import ModelSchema, TensorMeta
from flodl_async.wire import messages as m
from flodl_async.wire.schema import pack_message, unpack_message


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, two state_dict keys
        self.register_buffer("scratch", torch.zeros(3), persistent=False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def test_params_buffers_and_aliases_of_a_tied_module() -> None:
    model = Tied()
    schema = ModelSchema.from_module(model)
    assert schema.param_names == ("embed.weight", "norm.weight", "norm.bias")
    # persistent buffers in state_dict order; the non-persistent one never travels
    assert schema.buffer_names == (
        "steps",
        "norm.running_mean",
        "norm.running_var",
        "norm.num_batches_tracked",
    )  # own buffers first
    assert dict(schema.aliases) == {"head.weight": "embed.weight"}
    assert schema.names == schema.param_names + schema.buffer_names
    assert schema.meta("norm.num_batches_tracked") == TensorMeta(
        name="norm.num_batches_tracked", dtype="int64", shape=()
    )
    sd = model.state_dict()
    assert schema.model_bytes == sum(sd[n].numel() * sd[n].element_size() for n in schema.names)
    full = schema.with_aliases({n: sd[n] for n in schema.names})
    assert set(full) == set(sd)
    model.load_state_dict(full)


def test_from_state_dict_drops_duplicate_param_names_and_rejects_unknown_ones() -> None:
    sd = {"a": torch.zeros(2), "b": torch.ones(2, dtype=torch.float64)}
    schema = ModelSchema.from_state_dict(sd, ["a", "a"])
    assert schema.param_names == ("a",)
    assert schema.buffer_names == ("b",)
    with pytest.raises(ConfigError, match="parameter 'c' is not a state_dict key"):
        ModelSchema.from_state_dict(sd, ["c"])


def test_distinct_empty_tensors_are_not_aliases() -> None:
    sd = {"a": torch.zeros(0), "b": torch.zeros(0)}
    schema = ModelSchema.from_state_dict(sd, ["a", "b"])
    assert schema.param_names == ("a", "b")
    assert not schema.aliases


def test_unsupported_dtype_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="dtype complex64 is not supported"):
        ModelSchema.from_state_dict({"z": torch.zeros(2, dtype=torch.complex64)}, ["z"])


def test_wire_round_trip_and_digest_input() -> None:
    schema = ModelSchema.from_module(Tied())
    wire = schema.to_wire()
    decoded = unpack_message(m.ModelSchemaWire.KIND, pack_message(wire))
    assert isinstance(decoded, m.ModelSchemaWire)
    back = ModelSchema.from_wire(decoded)
    assert back == schema
    assert back.first_difference(schema) is None
    # canonical and msgpack-able, equal for equal schemas
    assert msgpack.packb(back.digest_input()) == msgpack.packb(schema.digest_input())
    other = ModelSchema.from_module(nn.Linear(4, 10))
    assert other.digest_input() != schema.digest_input()
    assert "parameter 'embed.weight'" in (schema.first_difference(other) or "")


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        (
            m.ModelSchemaWire(param_names=("a",), buffer_names=(), dtypes=(), shapes=((1,),)),
            "1 names, 0 dtypes",
        ),
        (
            m.ModelSchemaWire(
                param_names=("a", "a"), buffer_names=(), dtypes=("float32",) * 2, shapes=((1,),) * 2
            ),
            "twice",
        ),
        (
            m.ModelSchemaWire(
                param_names=("a",), buffer_names=(), dtypes=("complex64",), shapes=((1,),)
            ),
            "cannot carry",
        ),
        (
            m.ModelSchemaWire(
                param_names=("a",), buffer_names=(), dtypes=("float32",), shapes=((-1,),)
            ),
            "negative",
        ),
        (
            m.ModelSchemaWire(
                param_names=("a",),
                buffer_names=(),
                dtypes=("float32",),
                shapes=((1,),),
                aliases={"b": "c"},
            ),
            "not a listed tensor",
        ),
        (
            m.ModelSchemaWire(
                param_names=("a",),
                buffer_names=(),
                dtypes=("float32",),
                shapes=((1,),),
                aliases={"a": "a"},
            ),
            "also a listed tensor",
        ),
    ],
)
def test_malformed_wire_schema_is_a_config_error(wire: m.ModelSchemaWire, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ModelSchema.from_wire(wire)
