"""The manifest, pure: JSON round trips, and every refusal naming the file and the field."""

from __future__ import annotations

import itertools
import json
from dataclasses import fields, replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flodl_async.checkpoint import (
    CONSENSUS_FILE,
    SCHEMA_VERSION,
    DataParams,
    Manifest,
    Reason,
    bundle_name,
    coverage_of,
    covered_batches,
    elche_from_json,
    elche_to_json,
    parse_bundle_name,
)
from flodl_async.errors import CheckpointInvalid, ConfigError
from flodl_async.training.elche import ElChePhase, ElCheState
from flodl_async.training.policy import Backend, Policy
from flodl_async.wire.messages import ModelSchemaWire

SHA = "ab" * 32
SCHEMA = ModelSchemaWire(
    param_names=("w", "b"),
    buffer_names=("running_mean",),
    dtypes=("float32", "float32", "float32"),
    shapes=((3, 4), (3,), (3,)),
    aliases={"tied": "w"},
)


def manifest(**changes: Any) -> Manifest:
    base = Manifest(
        run_id="run-1",
        reason=Reason.EPOCH,
        round=42,
        epoch=3,
        global_step=420,
        world_size=2,
        policy=Policy.SYNC,
        backend=Backend.CPU,
        spec_digest="d" * 64,
        data=DataParams(length=1000, batch_size=10, seed=7, drop_last=True),
        model_schema=SCHEMA,
        elche=None,
        coverage=((0, 4), (6, 9)),
        outer_kind="slowmo",
        outer_state_file="outer.pt",
        rank_files={0: "rank0.pt", 1: "rank1.pt"},
        files={CONSENSUS_FILE: SHA, "outer.pt": SHA, "rank0.pt": SHA, "rank1.pt": SHA},
        written_at=1_700_000_000.25,
    )
    return replace(base, **changes)


def body(**changes: Any) -> dict[str, Any]:
    """A valid manifest's JSON object, with ``changes`` applied (a value of ... removes the key)."""
    out: dict[str, Any] = json.loads(manifest().to_json())
    for key, value in changes.items():
        if value is ...:
            del out[key]
        else:
            out[key] = value
    return out


def refused(value: dict[str, Any] | str) -> CheckpointInvalid:
    text = value if isinstance(value, str) else json.dumps(value)
    with pytest.raises(CheckpointInvalid) as caught:
        Manifest.from_json(text, path="/ckpt/r00000042-epoch/manifest.json")
    return caught.value


# ----- round trips ---------------------------------------------------------------------------


def test_a_manifest_round_trips_through_json() -> None:
    m = manifest(elche=elche_to_json(ELCHE))
    again = Manifest.from_json(m.to_json())
    assert again == m
    assert again.to_json() == m.to_json()


_names = st.from_regex(r"[a-z][a-z0-9_.]{0,12}", fullmatch=True)
_shapes = st.lists(st.integers(0, 64), max_size=3).map(tuple)


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    world = draw(st.integers(1, 6))
    ranks = draw(st.sets(st.integers(0, world - 1)))
    rank_files = {r: f"rank{r}.pt" for r in ranks}
    outer = draw(st.sampled_from([None, "outer.pt"]))
    hashes = st.from_regex(r"[0-9a-f]{64}", fullmatch=True)
    files = {CONSENSUS_FILE: draw(hashes)}
    files.update(
        {name: draw(hashes) for name in (*rank_files.values(), *([outer] if outer else []))}
    )
    params = draw(st.lists(_names, max_size=4, unique=True))
    schema = ModelSchemaWire(
        param_names=tuple(params),
        buffer_names=(),
        dtypes=tuple(draw(st.sampled_from(["float32", "bfloat16", "int64"])) for _ in params),
        shapes=tuple(draw(_shapes) for _ in params),
        aliases={},
    )
    return Manifest(
        run_id=draw(st.text(max_size=20)),
        reason=draw(st.sampled_from(Reason)),
        round=draw(st.integers(0, 2**40)),
        epoch=draw(st.integers(0, 10_000)),
        global_step=draw(st.integers(0, 2**40)),
        world_size=world,
        policy=draw(st.sampled_from(Policy)),
        backend=draw(st.sampled_from(Backend)),
        spec_digest=draw(st.text(max_size=64)),
        data=DataParams(
            length=draw(st.integers(1, 2**31)),
            batch_size=draw(st.integers(1, 4096)),
            seed=draw(st.integers(0, 2**64 - 1)),
            drop_last=draw(st.booleans()),
        ),
        model_schema=schema,
        elche=draw(st.sampled_from([None, {"anchor": 3, "nested": [1.5, None, "x"]}])),
        coverage=coverage_of(draw(st.sets(st.integers(0, 300), max_size=40))),
        outer_kind=draw(st.sampled_from(["avg", "slowmo", "diloco"])),
        outer_state_file=outer,
        rank_files=rank_files,
        files=files,
        written_at=draw(st.floats(0, 2e9, allow_nan=False)),
    )


@given(manifests())
def test_any_manifest_round_trips(m: Manifest) -> None:
    assert Manifest.from_json(m.to_json()) == m


@given(manifests(), st.data())
def test_a_torn_manifest_is_refused_at_every_cut(m: Manifest, data: st.DataObject) -> None:
    """A manifest cut anywhere (a write that never completed, a copy that stopped) never parses
    as a manifest: the closing brace is the last thing written."""
    text = m.to_json().rstrip()
    cut = data.draw(st.integers(0, len(text) - 1))
    error = refused(text[:cut])
    assert error.field in {"manifest", "schema_version"}


@given(st.sets(st.integers(0, 500)))
def test_coverage_holds_exactly_the_batches_it_was_made_of(batches: set[int]) -> None:
    ranges = coverage_of(batches)
    assert covered_batches(ranges) == batches
    assert all(a[1] < b[0] for a, b in itertools.pairwise(ranges))  # merged and apart


def test_coverage_refuses_a_negative_batch() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        coverage_of([3, -1])


@given(st.integers(0, 10**12), st.sampled_from(Reason))
def test_a_bundle_name_says_its_round_and_reason(round_: int, reason: Reason) -> None:
    assert parse_bundle_name(bundle_name(round_, reason)) == (round_, reason)


def test_bundle_names_sort_by_round() -> None:
    names = [bundle_name(r, Reason.EPOCH) for r in (3, 10, 200, 99_999_999)]
    assert sorted(names) == names
    assert bundle_name(42, Reason.MAX_FAILURE_EXCEEDED) == "r00000042-max_failure_exceeded"


@pytest.mark.parametrize(
    "name", ["r42-epoch", "r00000042-bogus", "x00000042-epoch", ".r00000042-epoch", "notes"]
)
def test_other_names_are_not_bundles(name: str) -> None:
    assert parse_bundle_name(name) is None


def test_a_bundle_name_refuses_a_negative_round() -> None:
    with pytest.raises(ValueError, match="round"):
        bundle_name(-1, Reason.END)


ELCHE = ElCheState(
    anchor=5,
    anchor_rank=1,
    smoothed_ms_per_batch=(12.5, None),
    phase=ElChePhase.WARMUP,
    calibration_count=2,
    trend_history=(0.5, 0.25),
    counts=(5, 7),
)


def test_elche_round_trips_through_the_manifest() -> None:
    m = Manifest.from_json(manifest(elche=elche_to_json(ELCHE)).to_json())
    assert m.elche is not None
    assert elche_from_json(m.elche) == ELCHE


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"phase": "warp"}, "elche.phase"),
        ({"counts": [1, "2"]}, "elche.counts[1]"),
        ({"anchor": None}, "elche.anchor"),
        ({"smoothed_ms_per_batch": "fast"}, "elche.smoothed_ms_per_batch"),
    ],
)
def test_a_wrong_elche_object_names_its_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(CheckpointInvalid) as caught:
        elche_from_json({**elche_to_json(ELCHE), **change}, path="m.json")
    assert caught.value.field == field


# ----- refusals ------------------------------------------------------------------------------


def test_the_error_is_a_config_error_naming_the_file_field_and_what_to_do() -> None:
    error = refused(body(round="42"))
    assert isinstance(error, ConfigError)
    assert (error.path, error.field) == ("/ckpt/r00000042-epoch/manifest.json", "round")
    text = str(error)
    assert "/ckpt/r00000042-epoch/manifest.json" in text
    assert "round" in text
    assert "resume_from='latest'" in text


def test_a_newer_schema_is_refused_before_anything_else_is_read() -> None:
    error = refused({"schema_version": SCHEMA_VERSION + 1, "round": "whatever"})
    assert error.field == "schema_version"
    assert "newer" in error.reason
    assert "upgrade flodl_async" in str(error)


@pytest.mark.parametrize("value", [0, "1", None, True, 1.0])
def test_a_schema_version_that_is_not_a_version_is_refused(value: object) -> None:
    assert refused(body(schema_version=value)).field == "schema_version"


@pytest.mark.parametrize("name", [f.name for f in fields(Manifest) if f.name != "schema_version"])
def test_every_missing_field_is_named(name: str) -> None:
    error = refused(body(**{name: ...}))
    assert (error.field, error.reason) == (name, "missing")


#: (field, a wrong value, the field the refusal names)
MISTYPED = [
    ("run_id", 7, "run_id"),
    ("reason", "bored", "reason"),
    ("round", True, "round"),
    ("round", -1, "round"),
    ("epoch", 1.5, "epoch"),
    ("global_step", "9", "global_step"),
    ("world_size", 0, "world_size"),
    ("policy", "SYNC", "policy"),
    ("backend", "nccl", "backend"),
    ("spec_digest", None, "spec_digest"),
    ("data", [], "data"),
    ("data", {"length": 1, "batch_size": 1, "seed": 0}, "data.drop_last"),
    ("data", {"length": 1, "batch_size": 0, "seed": 0, "drop_last": True}, "data.batch_size"),
    ("data", {"length": 1, "batch_size": 1, "seed": 0, "drop_last": 1}, "data.drop_last"),
    ("model_schema", "w,b", "model_schema"),
    (
        "model_schema",
        {"param_names": ["w"], "buffer_names": [], "dtypes": ["float32"], "shapes": [[3, "4"]]},
        "model_schema.aliases",
    ),
    (
        "model_schema",
        {
            "param_names": ["w"],
            "buffer_names": [],
            "dtypes": ["float32"],
            "shapes": [[3, "4"]],
            "aliases": {},
        },
        "model_schema.shapes[0][1]",
    ),
    (
        "model_schema",
        {"param_names": "w", "buffer_names": [], "dtypes": [], "shapes": [], "aliases": {}},
        "model_schema.param_names",
    ),
    ("elche", [1, 2], "elche"),
    ("coverage", [[0, 4], [3, 9]], "coverage[1]"),
    ("coverage", [[4, 4]], "coverage[0]"),
    ("coverage", [[0, 1, 2]], "coverage[0]"),
    ("coverage", {"0": 4}, "coverage"),
    ("outer_kind", "", "outer_kind"),
    ("outer_state_file", "../outer.pt", "outer_state_file"),
    ("rank_files", {"01": "rank0.pt", "1": "rank1.pt"}, "rank_files"),
    ("rank_files", {"0": "/etc/passwd", "1": "rank1.pt"}, "rank_files[0]"),
    ("rank_files", ["rank0.pt"], "rank_files"),
    ("files", {CONSENSUS_FILE: "AB" * 32}, f"files[{CONSENSUS_FILE}]"),
    ("files", {"../consensus.pt": SHA}, "files[../consensus.pt]"),
    ("written_at", "yesterday", "written_at"),
]


@pytest.mark.parametrize(("name", "value", "field"), MISTYPED, ids=[m[2] for m in MISTYPED])
def test_every_mistyped_field_is_named(name: str, value: object, field: str) -> None:
    assert refused(body(**{name: value})).field == field


def test_nan_is_not_a_number_a_manifest_holds() -> None:
    text = manifest().to_json().replace("1700000000.25", "NaN")
    assert refused(text).field == "manifest"


@pytest.mark.parametrize("text", ["", "[1, 2]", "\x00\x00\x00", '{"schema_version": 1'])
def test_what_is_not_a_manifest_object_is_refused(text: str) -> None:
    assert refused(text).field in {"manifest", "schema_version"}


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"files": {"outer.pt": SHA, "rank0.pt": SHA, "rank1.pt": SHA}}, "files"),
        ({"files": {CONSENSUS_FILE: SHA, "rank0.pt": SHA, "rank1.pt": SHA}}, "outer_state_file"),
        ({"files": {CONSENSUS_FILE: SHA, "outer.pt": SHA, "rank0.pt": SHA}}, "rank_files[1]"),
        ({"world_size": 1}, "rank_files[1]"),
    ],
)
def test_a_manifest_points_only_at_files_it_hashes(changes: dict[str, Any], field: str) -> None:
    assert refused(body(**changes)).field == field
