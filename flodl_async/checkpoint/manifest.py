"""The manifest: a bundle's commit record, as typed values and as JSON (pure, no torch).

Theory of operation. A bundle is a directory of files and one ``manifest.json``; the manifest is
written last, so its presence says the files before it are complete, and the SHA-256 it lists
per file says they are the files it committed. Everything a resume needs to decide (which
round, which epoch and which of its batches are already in the consensus, which world, which
model, which data) is in the manifest, so a resume decides before it loads a tensor.

Decoding is a table: one entry per field names the JSON type it wants and turns it into the
typed value, so every refusal says the file and the field (``CheckpointInvalid``). A manifest of
a newer schema is refused before any other field is read: its fields may mean something else.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import TypeAlias, TypeVar

from ..errors import CheckpointInvalid
from ..training.elche import ElChePhase, ElCheState
from ..training.policy import Backend, Policy
from ..wire.messages import ModelSchemaWire

#: The manifest layout this build writes, and the newest it reads.
SCHEMA_VERSION: int = 1

JsonValue: TypeAlias = "bool | int | float | str | list[JsonValue] | dict[str, JsonValue] | None"

_T = TypeVar("_T")

#: A file a manifest may name: a plain name inside the bundle, never a path out of it.
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_BUNDLE_NAME = re.compile(r"^r(\d{8,})-([a-z_]+)$")


class Reason(enum.StrEnum):
    """Why a bundle was written (part of its name)."""

    EPOCH = "epoch"
    ROUND = "round"
    TIME = "time"
    END = "end"
    SHUTDOWN = "shutdown"
    REQUEST = "request"
    PREEMPT = "preempt"
    MAX_FAILURE_EXCEEDED = "max_failure_exceeded"
    STALL = "stall"
    ALL_LOST = "all_lost"


def bundle_name(round: int, reason: Reason) -> str:
    """The bundle's directory name, ``r00000042-epoch``: names sort by round (zero-padded to eight
    digits; wider rounds still sort, see :func:`parse_bundle_name`)."""
    if isinstance(round, bool) or not isinstance(round, int) or round < 0:
        raise ValueError(f"a bundle's round must be an integer >= 0, got {round!r}")
    return f"r{round:08d}-{Reason(reason).value}"


def parse_bundle_name(name: str) -> tuple[int, Reason] | None:
    """``(round, reason)`` of a bundle directory's name, or None for anything else in the save
    path (which the bundle functions leave alone)."""
    found = _BUNDLE_NAME.match(name)
    if found is None:
        return None
    try:
        return int(found.group(1)), Reason(found.group(2))
    except ValueError:
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class DataParams:
    """The data parameters a resume must match: they fix each epoch's batches and their order."""

    length: int
    batch_size: int
    seed: int
    drop_last: bool


#: Half-open ranges ``(start, stop)`` of batch indices, sorted and disjoint.
Coverage: TypeAlias = tuple[tuple[int, int], ...]


def coverage_of(batches: Iterable[int]) -> Coverage:
    """The batch indices as sorted, merged half-open ranges (``{0, 1, 2, 5}`` → ``((0, 3), (5,
    6))``): a mid-epoch checkpoint of a long epoch stays a few numbers."""
    ranges: list[tuple[int, int]] = []
    for index in sorted(set(batches)):
        if index < 0:
            raise ValueError(f"a batch index is >= 0, got {index}")
        if ranges and ranges[-1][1] == index:
            ranges[-1] = (ranges[-1][0], index + 1)
        else:
            ranges.append((index, index + 1))
    return tuple(ranges)


def covered_batches(coverage: Coverage) -> frozenset[int]:
    """Every batch index a coverage holds."""
    return frozenset(i for start, stop in coverage for i in range(start, stop))


def elche_to_json(state: ElCheState) -> dict[str, JsonValue]:
    """ElChe's snapshot as the manifest's ``elche`` object."""
    return {
        "anchor": state.anchor,
        "anchor_rank": state.anchor_rank,
        "smoothed_ms_per_batch": list(state.smoothed_ms_per_batch),
        "phase": state.phase.name.lower(),
        "calibration_count": state.calibration_count,
        "trend_history": list(state.trend_history),
        "counts": list(state.counts),
    }


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """A bundle's commit record. ``files`` maps every file of the bundle to its SHA-256 (hex);
    :meth:`BundleWriter.commit` fills it in, so a manifest built for a commit leaves it empty."""

    schema_version: int = SCHEMA_VERSION
    run_id: str
    reason: Reason
    round: int
    epoch: int
    global_step: int
    world_size: int
    policy: Policy
    backend: Backend
    spec_digest: str
    data: DataParams
    model_schema: ModelSchemaWire
    elche: Mapping[str, JsonValue] | None
    coverage: Coverage
    outer_kind: str
    outer_state_file: str | None
    rank_files: Mapping[int, str]
    files: Mapping[str, str] = field(default_factory=dict)
    written_at: float

    def to_json(self) -> str:
        """The manifest as JSON text (keys sorted, no NaN: the bytes a hash or a diff can trust)."""
        schema = self.model_schema
        body: dict[str, JsonValue] = {
            "schema_version": self.schema_version,
            "run_id": self.run_id,
            "reason": self.reason.value,
            "round": self.round,
            "epoch": self.epoch,
            "global_step": self.global_step,
            "world_size": self.world_size,
            "policy": self.policy.value,
            "backend": self.backend.value,
            "spec_digest": self.spec_digest,
            "data": {
                "length": self.data.length,
                "batch_size": self.data.batch_size,
                "seed": self.data.seed,
                "drop_last": self.data.drop_last,
            },
            "model_schema": {
                "param_names": list(schema.param_names),
                "buffer_names": list(schema.buffer_names),
                "dtypes": list(schema.dtypes),
                "shapes": [list(shape) for shape in schema.shapes],
                "aliases": dict(schema.aliases),
            },
            "elche": None if self.elche is None else dict(self.elche),
            "coverage": [[start, stop] for start, stop in self.coverage],
            "outer_kind": self.outer_kind,
            "outer_state_file": self.outer_state_file,
            "rank_files": {str(rank): name for rank, name in sorted(self.rank_files.items())},
            "files": dict(sorted(self.files.items())),
            "written_at": self.written_at,
        }
        return json.dumps(body, sort_keys=True, indent=1, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, path: str = "manifest.json") -> Manifest:
        """Parse a committed manifest; anything wrong is a :class:`CheckpointInvalid` naming
        ``path`` and the field: not JSON (a torn write), a newer schema, a missing or mistyped
        field, a file name that leaves the bundle, a file the manifest points at but does not
        hash."""
        try:
            body = json.loads(text, parse_constant=_refuse_constant)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointInvalid(
                path=path, field="manifest", reason=f"not JSON (a torn or foreign file): {exc}"
            ) from exc
        if not isinstance(body, dict):
            raise CheckpointInvalid(path=path, field="manifest", reason="not a JSON object")
        version = body.get("schema_version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise CheckpointInvalid(
                path=path,
                field="schema_version",
                reason=f"missing or not an integer >= 1: {version!r}",
            )
        if version > SCHEMA_VERSION:
            raise CheckpointInvalid(
                path=path,
                field="schema_version",
                reason=f"written by a newer flodl_async (schema {version}; this one reads up to "
                f"{SCHEMA_VERSION})",
                remedy="upgrade flodl_async to resume from it",
            )
        values: dict[str, object] = {}
        for name, decode in _DECODERS.items():
            if name not in body:
                raise CheckpointInvalid(path=path, field=name, reason="missing")
            try:
                values[name] = decode(body[name])
            except _Bad as bad:
                raise CheckpointInvalid(
                    path=path, field=f"{name}{bad.where}", reason=bad.reason
                ) from None
        manifest = cls(**values)  # type: ignore[arg-type]  # the table decodes each field's type
        manifest.check_files(path=path)
        return manifest

    def check_files(self, *, path: str) -> None:
        """The files the manifest points at are files it hashes, and the ranks are in the world."""
        named = dict(self.files)
        if CONSENSUS_FILE not in named:
            raise CheckpointInvalid(path=path, field="files", reason=f"no {CONSENSUS_FILE}")
        if self.outer_state_file is not None and self.outer_state_file not in named:
            raise CheckpointInvalid(
                path=path,
                field="outer_state_file",
                reason=f"{self.outer_state_file} is not among the hashed files",
            )
        for rank, name in self.rank_files.items():
            if not 0 <= rank < self.world_size:
                raise CheckpointInvalid(
                    path=path,
                    field=f"rank_files[{rank}]",
                    reason=f"rank {rank} is outside the world of {self.world_size}",
                )
            if name not in named:
                raise CheckpointInvalid(
                    path=path,
                    field=f"rank_files[{rank}]",
                    reason=f"{name} is not among the hashed files",
                )


#: The consensus model's file in every bundle (the one file a bundle cannot do without).
CONSENSUS_FILE = "consensus.pt"


# ----- decoding ---------------------------------------------------------------------------------


class _Bad(Exception):
    """A field's value is wrong: ``where`` is the path inside the field (``.batch_size``)."""

    def __init__(self, reason: str, where: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.where = where


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a manifest holds")


def _int(minimum: int) -> Callable[[object], int]:
    def decode(value: object) -> int:
        # bool is an int to Python, never to a manifest
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Bad(f"expected an integer, got {value!r}")
        if value < minimum:
            raise _Bad(f"expected an integer >= {minimum}, got {value}")
        return value

    return decode


def _str(value: object) -> str:
    if not isinstance(value, str):
        raise _Bad(f"expected a string, got {value!r}")
    return value


def _nonempty_str(value: object) -> str:
    text = _str(value)
    if not text:
        raise _Bad("expected a non-empty string")
    return text


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise _Bad(f"expected true or false, got {value!r}")
    return value


def _float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _Bad(f"expected a finite number, got {value!r}")
    return float(value)


def _enum(kind: type[enum.Enum]) -> Callable[[object], enum.Enum]:
    known = ", ".join(str(member.value) for member in kind)

    def decode(value: object) -> enum.Enum:
        try:
            return kind(value)
        except ValueError:
            raise _Bad(f"expected one of {known}, got {value!r}") from None

    return decode


def _list(value: object) -> list[object]:
    if not isinstance(value, list):
        raise _Bad(f"expected a list, got {value!r}")
    return value


def _object(value: object, keys: Iterable[str]) -> dict[str, object]:
    if not isinstance(value, dict):
        raise _Bad(f"expected an object, got {value!r}")
    for key in keys:
        if key not in value:
            raise _Bad("missing", f".{key}")
    return value


def _each(decode: Callable[[object], _T], items: Iterable[object], where: str) -> list[_T]:
    out: list[_T] = []
    for i, item in enumerate(items):
        try:
            out.append(decode(item))
        except _Bad as bad:
            raise _Bad(bad.reason, f"{where}[{i}]{bad.where}") from None
    return out


def _file_name(value: object) -> str:
    name = _str(value)
    if not _FILE_NAME.match(name):
        raise _Bad(f"{name!r} is not a plain file name inside the bundle")
    return name


def _optional_file_name(value: object) -> str | None:
    return None if value is None else _file_name(value)


def _data(value: object) -> DataParams:
    body = _object(value, ("length", "batch_size", "seed", "drop_last"))
    table: dict[str, Callable[[object], object]] = {
        "length": _int(1),
        "batch_size": _int(1),
        "seed": _int(0),
        "drop_last": _bool,
    }
    decoded = {}
    for key, decode in table.items():
        try:
            decoded[key] = decode(body[key])
        except _Bad as bad:
            raise _Bad(bad.reason, f".{key}") from None
    return DataParams(**decoded)  # type: ignore[arg-type]  # decoded by the table above


def _names(value: object, where: str) -> tuple[str, ...]:
    return tuple(_each(_str, _list_at(value, where), where))


def _list_at(value: object, where: str) -> list[object]:
    try:
        return _list(value)
    except _Bad as bad:
        raise _Bad(bad.reason, where) from None


def _shape(value: object) -> tuple[int, ...]:
    return tuple(_each(_int(0), _list(value), ""))


def _model_schema(value: object) -> ModelSchemaWire:
    body = _object(value, ("param_names", "buffer_names", "dtypes", "shapes", "aliases"))
    aliases = body["aliases"]
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise _Bad(f"expected an object of names, got {aliases!r}", ".aliases")
    shapes = _list_at(body["shapes"], ".shapes")
    return ModelSchemaWire(
        param_names=_names(body["param_names"], ".param_names"),
        buffer_names=_names(body["buffer_names"], ".buffer_names"),
        dtypes=_names(body["dtypes"], ".dtypes"),
        shapes=tuple(_each(_shape, shapes, ".shapes")),
        aliases=dict(aliases),
    )


def _elche(value: object) -> Mapping[str, JsonValue] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _Bad(f"expected an object or null, got {value!r}")
    return MappingProxyType(value)


def _range(value: object) -> tuple[int, int]:
    pair = _list(value)
    if len(pair) != 2:
        raise _Bad(f"expected [start, stop], got {pair!r}")
    start, stop = _int(0)(pair[0]), _int(0)(pair[1])
    if start >= stop:
        raise _Bad(f"expected start < stop, got {pair!r}")
    return start, stop


def _coverage(value: object) -> Coverage:
    ranges: Coverage = tuple(_each(_range, _list(value), ""))
    for i, (before, after) in enumerate(itertools.pairwise(ranges)):
        if after[0] <= before[1]:
            raise _Bad(f"ranges {before} and {after} are not sorted and apart", f"[{i + 1}]")
    return ranges


def _rank_files(value: object) -> Mapping[int, str]:
    if not isinstance(value, dict):
        raise _Bad(f"expected an object of rank -> file, got {value!r}")
    out = {}
    for key, name in value.items():
        if not (isinstance(key, str) and key.isdigit() and str(int(key)) == key):
            raise _Bad(f"expected a rank number as key, got {key!r}")
        try:
            out[int(key)] = _file_name(name)
        except _Bad as bad:
            raise _Bad(bad.reason, f"[{key}]") from None
    return MappingProxyType(out)


def _files(value: object) -> Mapping[str, str]:
    if not isinstance(value, dict):
        raise _Bad(f"expected an object of file -> sha256, got {value!r}")
    out = {}
    for name, digest in value.items():
        try:
            out[_file_name(name)] = _sha256(digest)
        except _Bad as bad:
            raise _Bad(bad.reason, f"[{name}]") from None
    return MappingProxyType(out)


def _sha256(value: object) -> str:
    digest = _str(value)
    if not _SHA256_HEX.match(digest):
        raise _Bad(f"expected 64 lowercase hex digits (SHA-256), got {digest!r}")
    return digest


#: How each manifest field is read from JSON, in the order a reader checks them.
_DECODERS: dict[str, Callable[[object], object]] = {
    "schema_version": _int(1),
    "run_id": _str,
    "reason": _enum(Reason),
    "round": _int(0),
    "epoch": _int(0),
    "global_step": _int(0),
    "world_size": _int(1),
    "policy": _enum(Policy),
    "backend": _enum(Backend),
    "spec_digest": _str,
    "data": _data,
    "model_schema": _model_schema,
    "elche": _elche,
    "coverage": _coverage,
    "outer_kind": _nonempty_str,
    "outer_state_file": _optional_file_name,
    "rank_files": _rank_files,
    "files": _files,
    "written_at": _float,
}
assert set(_DECODERS) == {f.name for f in fields(Manifest)}, "every field has a decoder"


def elche_from_json(value: Mapping[str, JsonValue], *, path: str = "manifest.json") -> ElCheState:
    """The manifest's ``elche`` object back as ElChe's snapshot (a :class:`CheckpointInvalid`
    naming ``elche.<field>`` when it is not one)."""
    phases = {phase.name.lower(): phase for phase in ElChePhase}
    try:
        body = _object(
            dict(value),
            (
                "anchor",
                "anchor_rank",
                "smoothed_ms_per_batch",
                "phase",
                "calibration_count",
                "trend_history",
                "counts",
            ),
        )
        phase = body["phase"]
        if phase not in phases:
            raise _Bad(f"expected one of {', '.join(phases)}, got {phase!r}", ".phase")
        anchor_rank = body["anchor_rank"]
        return ElCheState(
            anchor=_at(".anchor", _int(0), body["anchor"]),
            anchor_rank=None if anchor_rank is None else _at(".anchor_rank", _int(0), anchor_rank),
            smoothed_ms_per_batch=tuple(_listed(_optional_float, body, "smoothed_ms_per_batch")),
            phase=phases[str(phase)],
            calibration_count=_at(".calibration_count", _int(0), body["calibration_count"]),
            trend_history=tuple(_listed(_float, body, "trend_history")),
            counts=tuple(_listed(_int(0), body, "counts")),
        )
    except _Bad as bad:
        raise CheckpointInvalid(path=path, field=f"elche{bad.where}", reason=bad.reason) from None


def _optional_float(value: object) -> float | None:
    return None if value is None else _float(value)


def _at(where: str, decode: Callable[[object], int], value: object) -> int:
    try:
        return decode(value)
    except _Bad as bad:
        raise _Bad(bad.reason, where) from None


def _listed(decode: Callable[[object], _T], body: Mapping[str, object], key: str) -> list[_T]:
    return _each(decode, _list_at(body[key], f".{key}"), f".{key}")
