"""Bundles on a real filesystem: writing, validity, the latest, retention, the tensor files, and
whether a bundle fits the run that resumes from it."""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_async.checkpoint import (
    CONSENSUS_FILE,
    MANIFEST_FILE,
    OUTER_FILE,
    BundleWriter,
    DataParams,
    Manifest,
    Reason,
    Skipped,
    bundle_name,
    check_resume,
    find_latest,
    list_bundles,
    load_consensus,
    load_outer,
    load_rank_state,
    rank_file,
    restore_rng,
    retain,
    save_consensus,
    save_outer,
    save_rank_state,
    verify_bundle,
)
from flodl_async.errors import CheckpointInvalid
from flodl_async.training.policy import Backend, Policy
from flodl_async.wire.messages import ModelSchemaWire

SCHEMA = ModelSchemaWire(
    param_names=("w",), buffer_names=(), dtypes=("float32",), shapes=((4,),), aliases={}
)
DATA = DataParams(length=100, batch_size=10, seed=3, drop_last=True)


def manifest_for(round_: int, *, world_size: int = 1, **changes: Any) -> Manifest:
    values: dict[str, Any] = {
        "run_id": "run",
        "reason": Reason.EPOCH,
        "round": round_,
        "epoch": round_,
        "global_step": round_ * 10,
        "world_size": world_size,
        "policy": Policy.SYNC,
        "backend": Backend.CPU,
        "spec_digest": "digest",
        "data": DATA,
        "model_schema": SCHEMA,
        "elche": None,
        "coverage": (),
        "outer_kind": "avg",
        "outer_state_file": None,
        "rank_files": {},
        "written_at": time.time(),
        **changes,
    }
    return Manifest(**values)


def payload(data: bytes) -> Callable[[BinaryIO], None]:
    def write(file: BinaryIO) -> None:
        file.write(data)

    return write


def write_bundle(save: Path, round_: int, content: bytes = b"consensus") -> Path:
    writer = BundleWriter(save, bundle_name(round_, Reason.EPOCH))
    writer.write_file(CONSENSUS_FILE, payload(content))
    return writer.commit(manifest_for(round_))


def dead_write(save: Path, round_: int) -> Path:
    """A bundle whose writer died before its commit."""
    writer = BundleWriter(save, bundle_name(round_, Reason.EPOCH))
    writer.write_file(CONSENSUS_FILE, payload(b"half"))
    return writer.path


def temps(path: Path) -> list[str]:
    return sorted(p.name for p in path.rglob(".*.tmp-*"))


# ----- writing and validity ------------------------------------------------------------------


def test_a_committed_bundle_verifies_and_lists_every_file_with_its_hash(tmp_path: Path) -> None:
    import hashlib

    writer = BundleWriter(tmp_path, bundle_name(7, Reason.END))
    sha = writer.write_file(CONSENSUS_FILE, payload(b"abc" * 1000))
    assert sha == hashlib.sha256(b"abc" * 1000).hexdigest()
    path = writer.commit(manifest_for(7))
    assert path == tmp_path / "r00000007-end"
    manifest = verify_bundle(path)
    assert dict(manifest.files) == {CONSENSUS_FILE: sha}
    assert verify_bundle(path / MANIFEST_FILE) == manifest  # the manifest's own path works too
    assert sorted(p.name for p in path.iterdir()) == [CONSENSUS_FILE, MANIFEST_FILE]


def test_large_writes_hash_what_reached_the_file_even_when_the_caller_reuses_its_buffer(
    tmp_path: Path,
) -> None:
    """Large writes are hashed on a helper thread while they are written; ``write`` returns only
    once its bytes are hashed, so a writer that refills its buffer (torch's zip writer does) never
    changes the hash of bytes already written."""
    import hashlib

    buffer = bytearray(3 * (1 << 20) + 12_345)  # several pieces, and a ragged end

    def refills(file: BinaryIO) -> None:
        for fill in range(5):
            buffer[:] = bytes([fill]) * len(buffer)
            file.write(buffer)
            file.write(b"small" * fill)  # small writes take the direct path, in order

    writer = BundleWriter(tmp_path, bundle_name(1, Reason.EPOCH))
    sha = writer.write_file(CONSENSUS_FILE, refills)
    written = (writer.path / CONSENSUS_FILE).read_bytes()
    assert len(written) == 5 * len(buffer) + sum(5 * i for i in range(5))
    assert sha == hashlib.sha256(written).hexdigest()


def test_a_file_that_changed_after_the_commit_is_refused(tmp_path: Path) -> None:
    path = write_bundle(tmp_path, 1, b"x" * 10_000)
    with open(path / CONSENSUS_FILE, "r+b") as f:
        f.seek(5000)
        f.write(b"y")
    with pytest.raises(CheckpointInvalid) as caught:
        verify_bundle(path)
    assert caught.value.field == f"files[{CONSENSUS_FILE}]"
    assert "SHA-256" in caught.value.reason


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    path = write_bundle(tmp_path, 1)
    (path / CONSENSUS_FILE).unlink()
    with pytest.raises(CheckpointInvalid) as caught:
        verify_bundle(path)
    assert (caught.value.field, caught.value.reason) == (f"files[{CONSENSUS_FILE}]", "missing")


def test_a_torn_manifest_is_refused(tmp_path: Path) -> None:
    path = write_bundle(tmp_path, 1)
    text = (path / MANIFEST_FILE).read_bytes()
    (path / MANIFEST_FILE).write_bytes(text[: len(text) // 2])
    with pytest.raises(CheckpointInvalid) as caught:
        verify_bundle(path)
    assert caught.value.field == "manifest"
    assert caught.value.path == str(path / MANIFEST_FILE)


def test_a_bundle_without_manifest_is_a_write_that_never_finished(tmp_path: Path) -> None:
    path = dead_write(tmp_path, 1)
    with pytest.raises(CheckpointInvalid) as caught:
        verify_bundle(path)
    assert caught.value.field == MANIFEST_FILE
    assert "never finished" in caught.value.reason


def test_a_missing_path_and_a_save_path_are_told_apart(tmp_path: Path) -> None:
    with pytest.raises(CheckpointInvalid) as caught:
        verify_bundle(tmp_path / "nope")
    assert (caught.value.field, caught.value.reason) == ("path", "does not exist")
    write_bundle(tmp_path, 1)
    with pytest.raises(CheckpointInvalid) as caught:
        verify_bundle(tmp_path)
    assert "save path" in caught.value.reason
    assert "resume_from='latest'" in str(caught.value)


def test_a_failed_write_leaves_no_file_and_no_listing(tmp_path: Path) -> None:
    writer = BundleWriter(tmp_path, bundle_name(1, Reason.EPOCH))

    def fails(file: BinaryIO) -> None:
        file.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        writer.write_file(CONSENSUS_FILE, fails)
    assert list(writer.path.iterdir()) == []
    assert dict(writer.files) == {}


def test_commit_fills_in_the_files_and_refuses_a_manifest_that_has_them(tmp_path: Path) -> None:
    writer = BundleWriter(tmp_path, bundle_name(1, Reason.EPOCH))
    writer.write_file(CONSENSUS_FILE, payload(b"c"))
    with pytest.raises(ValueError, match="fills in"):
        writer.commit(manifest_for(1, files={CONSENSUS_FILE: "0" * 64}))
    writer.commit(manifest_for(1))
    with pytest.raises(ValueError, match="already committed"):
        writer.write_file("late.pt", payload(b"late"))


def test_a_file_another_host_wrote_but_this_one_cannot_see_is_not_committed(
    tmp_path: Path,
) -> None:
    writer = BundleWriter(tmp_path, bundle_name(1, Reason.EPOCH))
    writer.write_file(CONSENSUS_FILE, payload(b"c"))
    writer.add_file_hash(rank_file(1), "0" * 64)
    with pytest.raises(CheckpointInvalid) as caught:
        writer.commit(manifest_for(1, world_size=2, rank_files={1: rank_file(1)}))
    assert caught.value.field == "files[rank1.pt]"
    assert "every host" in str(caught.value)
    assert not (writer.path / MANIFEST_FILE).exists()


def test_a_rank_writes_its_file_and_the_committer_lists_its_hash(tmp_path: Path) -> None:
    name = bundle_name(2, Reason.ROUND)
    rank_writer = BundleWriter(tmp_path, name)  # on the rank's host, same shared directory
    sha = rank_writer.write_file(rank_file(1), payload(b"rank one"))
    writer = BundleWriter(tmp_path, name)
    writer.write_file(CONSENSUS_FILE, payload(b"c"))
    writer.add_file_hash(rank_file(1), sha)
    path = writer.commit(manifest_for(2, world_size=2, rank_files={1: rank_file(1)}))
    assert verify_bundle(path).rank_files == {1: "rank1.pt"}


@pytest.mark.parametrize("name", [MANIFEST_FILE, "../x", ".hidden", "a/b"])
def test_a_bundle_holds_only_plain_files_of_its_own(tmp_path: Path, name: str) -> None:
    writer = BundleWriter(tmp_path, bundle_name(1, Reason.EPOCH))
    with pytest.raises(ValueError, match="not a file a bundle may hold"):
        writer.write_file(name, payload(b""))


def test_a_committed_bundle_being_rewritten_is_invalid_until_its_new_commit(
    tmp_path: Path,
) -> None:
    path = write_bundle(tmp_path, 5, b"old")
    writer = BundleWriter(tmp_path, bundle_name(5, Reason.EPOCH))
    verify_bundle(path)  # a new writer (a rank's, say) touches nothing already there
    writer.write_file(CONSENSUS_FILE, payload(b"new"))
    with pytest.raises(CheckpointInvalid) as caught:
        verify_bundle(path)
    assert caught.value.field == f"files[{CONSENSUS_FILE}]"
    writer.commit(manifest_for(5))
    assert (path / CONSENSUS_FILE).read_bytes() == b"new"
    verify_bundle(path)


# ----- the latest, and retention -------------------------------------------------------------


def test_there_is_no_latest_in_an_empty_or_missing_save_path(tmp_path: Path) -> None:
    assert find_latest(tmp_path / "none") == (None, ())
    assert find_latest(tmp_path) == (None, ())


def test_a_save_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ckpt").write_text("not a directory")
    with pytest.raises(CheckpointInvalid) as caught:
        find_latest(tmp_path / "ckpt")
    assert caught.value.field == "save_path"


def test_the_latest_is_the_newest_valid_and_the_newer_torn_ones_are_named(tmp_path: Path) -> None:
    write_bundle(tmp_path, 1)
    good = write_bundle(tmp_path, 9)
    corrupt = write_bundle(tmp_path, 10)
    (corrupt / CONSENSUS_FILE).write_bytes(b"bitrot")
    dead_write(tmp_path, 11)
    (tmp_path / "notes.txt").write_text("the user's own file")
    (tmp_path / "r12-epoch").mkdir()  # not one of our names: not ours to judge
    latest, skipped = find_latest(tmp_path)
    assert latest == good
    assert [s.name for s in skipped] == ["r00000011-epoch", "r00000010-epoch"]
    assert skipped[0].field == MANIFEST_FILE
    assert skipped[1] == Skipped(
        name="r00000010-epoch",
        field=f"files[{CONSENSUS_FILE}]",
        reason="its SHA-256 differs from the manifest's (corrupt, or from another write)",
    )
    assert str(skipped[1]).startswith("r00000010-epoch (files[consensus.pt]: ")


def test_rounds_past_eight_digits_still_sort_by_round(tmp_path: Path) -> None:
    write_bundle(tmp_path, 99_999_999)
    newest = write_bundle(tmp_path, 100_000_000)
    assert find_latest(tmp_path)[0] == newest
    assert list_bundles(tmp_path)[-1] == newest


def test_retention_keeps_the_newest_valid_and_clears_dead_writes(tmp_path: Path) -> None:
    dead_write(tmp_path, 1)
    for r in (2, 3, 4, 5):
        write_bundle(tmp_path, r)
    dead_write(tmp_path, 6)  # newer than the latest: may still be being written
    latest = tmp_path / bundle_name(5, Reason.EPOCH)
    leftover = latest / ".rank0.pt.tmp-123-abcd"
    leftover.write_bytes(b"a dead write's temporary file")
    removed = retain(tmp_path, keep_last=2)
    assert sorted(p.name for p in list_bundles(tmp_path)) == [
        "r00000004-epoch",
        "r00000005-epoch",
        "r00000006-epoch",
    ]
    assert sorted(p.name for p in removed) == [
        ".rank0.pt.tmp-123-abcd",
        "r00000001-epoch",
        "r00000002-epoch",
        "r00000003-epoch",
    ]
    assert temps(tmp_path) == []
    assert find_latest(tmp_path)[0] == latest


def test_retention_never_removes_the_newest_valid_bundle(tmp_path: Path) -> None:
    oldest = write_bundle(tmp_path, 1)
    newest_valid = write_bundle(tmp_path, 2)
    corrupt = write_bundle(tmp_path, 3)
    (corrupt / CONSENSUS_FILE).write_bytes(b"bitrot")  # looks newest, is not valid
    retain(tmp_path, keep_last=1)
    assert not oldest.exists()
    assert find_latest(tmp_path)[0] == newest_valid
    assert corrupt.exists()  # newer than the latest: left for a person to look at


def test_retention_does_nothing_without_a_valid_bundle(tmp_path: Path) -> None:
    dead = dead_write(tmp_path, 1)
    assert retain(tmp_path, keep_last=1) == ()
    assert dead.exists()


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.sampled_from(["valid", "torn", "corrupt"]), min_size=1, max_size=7),
    st.integers(1, 4),
)
def test_retention_keeps_what_it_says_whatever_the_save_path_holds(
    states: list[str], keep_last: int
) -> None:
    with tempfile.TemporaryDirectory() as where:
        save = Path(where)
        for round_, state in enumerate(states):
            if state == "torn":
                dead_write(save, round_)
            else:
                path = write_bundle(save, round_)
                if state == "corrupt":
                    (path / CONSENSUS_FILE).write_bytes(b"bitrot")
        before = list_bundles(save)
        latest, _ = find_latest(save)
        retain(save, keep_last=keep_last)
        after = list_bundles(save)
        assert find_latest(save)[0] == latest
        if latest is None:
            assert after == before
            return
        at = before.index(latest)
        assert after[after.index(latest) :] == before[at:]  # the latest and newer: untouched
        committed = [b for b, s in zip(before[:at], states, strict=False) if s != "torn"]
        assert after[: after.index(latest)] == tuple(
            committed[max(0, len(committed) - keep_last + 1) :]
        )


@pytest.mark.parametrize("keep", [0, -1, True, 1.5])
def test_retention_keeps_at_least_one(tmp_path: Path, keep: Any) -> None:
    with pytest.raises(ValueError, match="keep_last"):
        retain(tmp_path, keep_last=keep)


# ----- the tensor files ----------------------------------------------------------------------


class Tied:
    """A model with a tied weight and buffers: every state_dict key must come back."""

    @staticmethod
    def build() -> Any:
        import torch

        class Net(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = torch.nn.Embedding(11, 6)
                self.norm = torch.nn.BatchNorm1d(6)
                self.head = torch.nn.Linear(6, 11, bias=False)
                self.head.weight = self.embed.weight

        return Net()


def test_the_consensus_loads_into_a_model_with_plain_torch_load(tmp_path: Path) -> None:
    import torch

    torch.manual_seed(0)
    model = Tied.build()
    model.norm.running_mean.add_(3.0)
    writer = BundleWriter(tmp_path, bundle_name(1, Reason.END))
    save_consensus(writer, model.state_dict())
    path = writer.commit(manifest_for(1))
    fresh = Tied.build()
    fresh.load_state_dict(torch.load(path / CONSENSUS_FILE, weights_only=True))
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    assert fresh.head.weight is fresh.embed.weight
    assert load_consensus(path).keys() == model.state_dict().keys()


def test_outer_and_rank_state_round_trip_and_the_rng_replays(tmp_path: Path) -> None:
    import numpy as np
    import torch

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    velocity = {"weight": torch.randn(2, 3)}
    writer = BundleWriter(tmp_path, bundle_name(4, Reason.REQUEST))
    save_consensus(writer, model.state_dict())
    save_outer(writer, {"kind": "slowmo", "lr": 1.0, "momentum": 0.5, "velocity": velocity})
    save_rank_state(writer, 0, optimizer.state_dict())  # the generators as they are now
    draws = (random.random(), torch.rand(3), np.random.rand(2))
    path = writer.commit(manifest_for(4, outer_state_file=OUTER_FILE, rank_files={0: rank_file(0)}))
    manifest = verify_bundle(path)
    outer = load_outer(path, manifest)
    assert outer is not None
    assert outer["kind"] == "slowmo"
    assert torch.equal(outer["velocity"]["weight"], velocity["weight"])  # type: ignore[index]
    state = load_rank_state(path, manifest, 0)
    assert state is not None
    again = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.5, momentum=0.1)
    again.load_state_dict(state.optimizer)  # type: ignore[arg-type]
    assert again.state_dict()["param_groups"][0]["lr"] == 0.1
    restore_rng(state.rng)
    assert random.random() == draws[0]
    assert torch.equal(torch.rand(3), draws[1])
    assert np.array_equal(np.random.rand(2), draws[2])
    assert load_rank_state(path, manifest, 1) is None
    assert load_outer(path, manifest_for(4)) is None


# ----- does the bundle fit the run? ----------------------------------------------------------


def resume_check(saved: Manifest, **changes: Any) -> tuple[str, ...]:
    now: dict[str, Any] = {
        "model_schema": SCHEMA,
        "data": DATA,
        "world_size": saved.world_size,
        "policy": saved.policy,
        "backend": saved.backend,
        "outer_kind": saved.outer_kind,
        **changes,
    }
    return check_resume(saved, bundle="/ckpt/r1", **now)


def test_the_same_run_resumes_without_a_word() -> None:
    assert resume_check(manifest_for(1)) == ()


def test_another_model_cannot_resume() -> None:
    other = ModelSchemaWire(
        param_names=("w",), buffer_names=(), dtypes=("float32",), shapes=((5,),), aliases={}
    )
    with pytest.raises(CheckpointInvalid) as caught:
        resume_check(manifest_for(1), model_schema=other)
    assert (caught.value.path, caught.value.field) == ("/ckpt/r1", "model_schema")
    assert "shape (4,)" in caught.value.reason


@pytest.mark.parametrize(
    "change", [{"length": 99}, {"batch_size": 5}, {"seed": 4}, {"drop_last": False}]
)
def test_other_data_cannot_resume(change: dict[str, Any]) -> None:
    ((name, value),) = change.items()
    data = DataParams(**{**{f: getattr(DATA, f) for f in DATA.__slots__}, name: value})
    with pytest.raises(CheckpointInvalid) as caught:
        resume_check(manifest_for(1), data=data)
    assert caught.value.field == f"data.{name}"
    assert "start a fresh run" in str(caught.value)


def test_another_world_resumes_with_warnings() -> None:
    saved = manifest_for(
        1,
        world_size=2,
        elche={"anchor": 1},
        rank_files={0: rank_file(0), 1: rank_file(1)},
        outer_kind="slowmo",
        outer_state_file=OUTER_FILE,
    )
    warnings = resume_check(
        saved, world_size=3, outer_kind="avg", policy=Policy.CADENCE, backend=Backend.COLLECTIVE
    )
    assert len(warnings) == 5
    assert "ElChe" in warnings[0]
    assert "fresh inner optimizer" in warnings[1]
    assert "velocity" in warnings[2]
    assert "policy sync" in warnings[3]
    assert "backend cpu" in warnings[4]
