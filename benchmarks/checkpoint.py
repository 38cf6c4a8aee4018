"""Checkpoint benchmark: the controller's bundle writer against a plain ``torch.save`` of the same
state.

Run: ``python benchmarks/checkpoint.py [--sizes 16,256] [--rounds 5,3] [--dir PATH] [--json
out.json]`` (``--smoke``: one round of 1 MiB, for the test suite)

Per round and size, the same model-shaped state (16 float32 weight matrices and 16 small biases
adding up to the size), variants interleaved (their order alternates every round), each into a
fresh directory under ``--dir`` (default: the system's temporary directory; put it on the disk
your checkpoints go to), whose files are removed between variants:

* ``torch.save``: ``torch.save(state, path)``, the baseline: into the page cache, nothing
  synced, nothing checked;
* ``+fsync``: the same, then the file and its directory fsync'd (what a durable save costs);
* ``bundle``: what the controller does to checkpoint the consensus:
  :class:`~flodl_async.checkpoint.BundleWriter`, :func:`~flodl_async.checkpoint.save_consensus`
  (temporary name, SHA-256 while streaming, fsync, rename) and ``commit`` (the manifest written
  last, the directories fsync'd).

Throughput is the state's bytes over the wall time. The ratio is bundle / ``torch.save`` (the
goal: at least 0.8x), the median of per-round ratios. ``sha256 alone`` is hashlib over the same
bytes in memory, measured in the same run: the bundle hashes every byte on a second thread while
it writes, so on a machine whose hashing is slower than its memory copies the bundle's rate is
bounded by it (a SHA-256 per file is what makes a torn or corrupt bundle detectable); where no
second core is free (the line after the table says), hashing and writing add up instead.
``verify_bundle`` is timed on each bundle written (not part of its write): what a resume pays to
check a bundle before it trusts it.

The other half of issue 18's benchmark, how long each rank is blocked by a checkpoint and how
much a step slows while one is written, needs a Trainer run; its place is
:func:`rank_blocking_and_step_inflation`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flodl_async.checkpoint import (  # after the path: the checkout's own package
    BundleWriter,
    DataParams,
    Manifest,
    Reason,
    bundle_name,
    save_consensus,
    verify_bundle,
)
from flodl_async.training.policy import Backend, Policy
from flodl_async.wire.messages import ModelSchemaWire

VARIANTS = ("torch.save", "+fsync", "bundle")
GOAL = 0.8


def _state(mib: int) -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(mib)
    weights = 16
    numel = (mib << 20) // 4 // weights - 1024  # room for the biases, so the total is ``mib``
    state: dict[str, Any] = {}
    for layer in range(weights):
        state[f"layers.{layer}.weight"] = torch.randn(numel, generator=generator).view(-1, 64)
        state[f"layers.{layer}.bias"] = torch.randn(1024, generator=generator)
    return state


def _nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_save(state: dict[str, Any], where: Path) -> None:
    import torch

    torch.save(state, where / "consensus.pt")


def _torch_save_fsync(state: dict[str, Any], where: Path) -> None:
    _torch_save(state, where)
    _fsync(where / "consensus.pt")
    _fsync(where)


def _bundle(state: dict[str, Any], where: Path) -> None:
    writer = BundleWriter(where, bundle_name(1, Reason.EPOCH))
    save_consensus(writer, state)
    writer.commit(
        Manifest(
            run_id="benchmark",
            reason=Reason.EPOCH,
            round=1,
            epoch=1,
            global_step=1,
            world_size=1,
            policy=Policy.SYNC,
            backend=Backend.CPU,
            spec_digest="",
            data=DataParams(length=1, batch_size=1, seed=0, drop_last=True),
            model_schema=ModelSchemaWire(
                param_names=tuple(state),
                buffer_names=(),
                dtypes=("float32",) * len(state),
                shapes=tuple(tuple(t.shape) for t in state.values()),
                aliases={},
            ),
            elche=None,
            coverage=(),
            outer_kind="avg",
            outer_state_file=None,
            rank_files={},
            written_at=time.time(),
        )
    )


RUNNERS: dict[str, Callable[[dict[str, Any], Path], None]] = {
    "torch.save": _torch_save,
    "+fsync": _torch_save_fsync,
    "bundle": _bundle,
}


def _sha256_rate(state: dict[str, Any]) -> float:
    """MB/s of hashlib's SHA-256 over the state's own memory (no file)."""
    digest = hashlib.sha256()
    started = time.perf_counter()
    for tensor in state.values():
        digest.update(memoryview(tensor.numpy()).cast("B"))
    return _nbytes(state) / 1e6 / (time.perf_counter() - started)


def _second_core(state: dict[str, Any]) -> float:
    """How much faster two SHA-256 threads finish two hashes of the state than one thread does
    (2.0: a second core is free, and the bundle's hash hides behind its write; 1.0: none is)."""
    views = [memoryview(t.numpy()).cast("B") for t in state.values()]

    def hash_all() -> None:
        digest = hashlib.sha256()
        for view in views:
            digest.update(view)

    started = time.perf_counter()
    hash_all()
    hash_all()
    serial = time.perf_counter() - started
    started = time.perf_counter()
    helper = threading.Thread(target=hash_all, name="second-core-probe")
    helper.start()
    hash_all()
    helper.join()
    return serial / (time.perf_counter() - started)


def _measure(mib: int, rounds: int, root: Path) -> dict[str, list[float]]:
    state = _state(mib)
    size = _nbytes(state)
    rates: dict[str, list[float]] = {
        name: [] for name in (*VARIANTS, "verify", "sha256", "second core")
    }
    for round_ in range(-1, rounds):  # round -1 warms up (imports, first allocations): untimed
        order = VARIANTS if round_ % 2 == 0 else tuple(reversed(VARIANTS))
        for name in order:
            where = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=root))
            try:
                started = time.perf_counter()
                RUNNERS[name](state, where)
                elapsed = time.perf_counter() - started
                if name == "bundle" and round_ >= 0:
                    started = time.perf_counter()
                    verify_bundle(where / bundle_name(1, Reason.EPOCH))
                    rates["verify"].append(size / 1e6 / (time.perf_counter() - started))
            finally:
                shutil.rmtree(where)
            if round_ >= 0:
                rates[name].append(size / 1e6 / elapsed)
        if round_ >= 0:
            rates["sha256"].append(_sha256_rate(state))
            rates["second core"].append(_second_core(state))
    return rates


def rank_blocking_and_step_inflation(args: argparse.Namespace) -> list[str]:
    """How long each rank is blocked by a checkpoint (issue 18 §4): the lines to print under the
    table.

    On the CPU backend the consensus never touches a rank: the controller copies it after the
    broadcast and writes it on a thread of its own. What a rank does is save its own state after
    applying the checkpoint round (:class:`flodl_async.trainer.rankstate.RankStateWriter`): a copy
    of its optimizer's ``state_dict`` and its RNG states at the boundary, which is what blocks it
    (timed here), then the write on a thread of its own while it trains on (timed too: what a
    synchronous write would have blocked it for). The optimizer is SGD with momentum, whose state
    is one buffer the size of the model (Adam's is two). The step-time inflation while the writes
    run needs a whole Trainer run on this machine's cores and is not measured by this script.
    """
    import torch

    from flodl_async.trainer.rankstate import RankStateWriter

    sizes = [int(s) for s in args.sizes.split(",")]
    rounds = max(int(r) for r in args.rounds.split(","))
    lines = []
    root = Path(tempfile.mkdtemp(prefix="flodl-rank-bench-", dir=args.dir))
    try:
        for mib in sizes:
            params = [torch.nn.Parameter(t) for t in _state(mib).values()]
            optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
            for p in params:
                p.grad = torch.ones_like(p)
            optimizer.step()  # the momentum buffers exist, as after a round of training
            blocked, written = [], []
            reports: list[object] = []
            for round_ in range(-1, rounds):  # round -1 warms up: untimed
                writer = RankStateWriter(0, reports.append)
                started = time.perf_counter()
                writer.save(str(root), bundle_name(round_ + 2, Reason.ROUND), round_ + 2, optimizer)
                copied = time.perf_counter()
                writer.close(wait=True)
                done = time.perf_counter()
                if round_ >= 0:
                    blocked.append((copied - started) * 1e3)
                    written.append((done - copied) * 1e3)
            lines.append(
                f"rank blocked by a checkpoint (CPU backend), {mib} MiB model, SGD momentum: "
                f"{_fmt(blocked).strip()} ms (the copy of its optimizer+RNG state; written in the "
                f"background in {_fmt(written).strip()} ms; 0 ms for the consensus)"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lines.append(
        "step inflation while the writes run: not measured by this script (it needs a Trainer "
        "run on this machine's cores)"
    )
    return lines


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):6.0f} ({min(values):.0f}–{max(values):.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,256", help="MiB of model state; comma separated")
    parser.add_argument("--rounds", default="5,3", help="timed rounds per size")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: the temporary directory)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--smoke", action="store_true", help="one round of 1 MiB")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.rounds = "1", "1"
    sizes = [int(s) for s in args.sizes.split(",")]
    rounds = [int(r) for r in args.rounds.split(",")]
    if len(rounds) != len(sizes):
        parser.error("--rounds needs one count per size")
    root = Path(tempfile.mkdtemp(prefix="flodl-ckpt-bench-", dir=args.dir))
    try:
        results = {mib: _measure(mib, n, root) for mib, n in zip(sizes, rounds, strict=True)}
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(
        f"checkpoint write of a model's state into {args.dir or tempfile.gettempdir()}: "
        "MB/s, median (min–max) of interleaved rounds"
    )
    print(
        f"{'size':>8} | {'rounds':>6} | {'torch.save MB/s':>18} | {'+fsync MB/s':>18} | "
        f"{'bundle MB/s':>18} | ratio bundle / torch.save (median of per-round), / +fsync"
    )
    rows = []
    met = []
    for mib, rates in results.items():
        ratios = [b / t for b, t in zip(rates["bundle"], rates["torch.save"], strict=True)]
        durable = [b / t for b, t in zip(rates["bundle"], rates["+fsync"], strict=True)]
        ratio = statistics.median(ratios)
        met.append(f"{mib} MiB {'met' if ratio >= GOAL else 'NOT met'}")
        print(
            f"{f'{mib} MiB':>8} | {len(ratios):>6} | {_fmt(rates['torch.save']):>18} | "
            f"{_fmt(rates['+fsync']):>18} | {_fmt(rates['bundle']):>18} | "
            f"{ratio:.2f}× ({min(ratios):.2f}–{max(ratios):.2f}), "
            f"{statistics.median(durable):.2f}×"
        )
        rows.append({"size_mib": mib, **rates, "ratio_median": ratio})
    hashing = max(statistics.median(r["sha256"]) for r in results.values())
    second = statistics.median(x for r in results.values() for x in r["second core"])
    print(
        f"sha256 alone: {hashing:.0f} MB/s (hashlib, in memory, same run, best size); two "
        f"threads hashing finish {second:.1f}x as fast as one (2.0 = a free second core: the "
        "bundle hashes on it while it writes)"
    )
    verify = ", ".join(
        f"{mib} MiB {statistics.median(r['verify']):.0f} MB/s" for mib, r in results.items()
    )
    print(f"verify_bundle (read back, every hash checked, what a resume pays): {verify}")
    print(f"goal (bundle >= {GOAL}x torch.save): {', '.join(met)}")
    for line in rank_blocking_and_step_inflation(args):
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps({"benchmark": "checkpoint", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
