"""The controller's checkpoint bundles: the consensus written in the background, the manifest last.

Theory of operation. The coordinator marks a checkpoint round (:mod:`flodl_async.training.saves`);
the reducer copies that round's consensus and the outer optimizer's state as it makes them, after
the consensus went down to the ranks, so no rank waits for it. When the round commits, the
coordinator's :class:`~flodl_async.training.coordination.SaveCheckpoint` reaches
:meth:`BundleKeeper.save`, which writes the bundle on a thread of its own (one at a time, never on
the event loop, never in the reducer's executor) while training goes on:

1. ``consensus.pt`` and, when the outer optimizer has state, ``outer.pt``
   (:class:`~flodl_async.checkpoint.BundleWriter`: temporary name, fsync, rename);
2. each rank writes ``rank{r}.pt`` into the same bundle directory on its own host after applying
   the round's consensus and reports its hash (``RankStateSaved``); the keeper waits for every
   rank it expects (a rank lost meanwhile is not waited for; a rank that reports an error is left
   out with a warning) or ``rank_wait`` seconds;
3. the manifest, last: the commit record. Then ``keep_last`` retention.

A bundle that fails is logged and leaves the previous valid one as "latest". :meth:`drain` waits
for the writes under way (the run's end waits for its last bundle). Torch is imported only by the
checkpoint package, on the writing thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint import (
    OUTER_FILE,
    BundleWriter,
    DataParams,
    Manifest,
    Reason,
    bundle_name,
    elche_to_json,
    rank_file,
    retain,
    save_consensus,
    save_outer,
)
from ..errors import FlodlError
from ..training.coordination import SaveCheckpoint
from ..training.spec import TrainerSpec
from ..wire import messages as m
from .roundstate import Snapshot

log = logging.getLogger("flodl_async.cli.launch")


@dataclass(slots=True)
class _Bundle:
    """One bundle under way: its name, and the ranks' reports as they come (before or after the
    round commits)."""

    name: str
    reports: dict[int, m.RankStateSaved] = field(default_factory=dict)
    expected: set[int] = field(default_factory=set)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def settle(self) -> None:
        if self.expected <= set(self.reports):
            self.arrived.set()


class BundleKeeper:
    """One run's checkpoint bundles on the controller; see the module docstring."""

    def __init__(
        self,
        *,
        run_id: str,
        spec: TrainerSpec,
        hello: m.TrainerHello,
        task_group: asyncio.TaskGroup,
        rank_wait: float = 120.0,
    ) -> None:
        save_path = spec.checkpoint.save_path
        assert save_path is not None  # only a run with a save_path keeps bundles
        self.save_path = Path(save_path)
        self._run_id = run_id
        self._spec = spec
        self._hello = hello
        self._tg = task_group
        self._rank_wait = rank_wait
        self._bundles: dict[int, _Bundle] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # one writer thread: bundles are written in order, and never hold the reducer's executor
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="flodl-checkpoint"
        )
        #: The last bundle committed (``TrainedState.checkpoint``).
        self.last: Path | None = None

    def mark(self, bundle_round: int, reason: str) -> str:
        """A checkpoint round opens: its bundle's name (the ranks write their files into it)."""
        name = bundle_name(bundle_round, Reason(reason))
        self._bundles.setdefault(bundle_round, _Bundle(name=name))
        return name

    def rank_saved(self, msg: m.RankStateSaved) -> None:
        """A rank wrote (or failed to write) its state file for bundle round ``msg.version``."""
        bundle = self._bundles.get(msg.version)
        if bundle is None:
            log.warning(
                "rank %d reported a state file for checkpoint round %d, which is not being "
                "written; ignoring it",
                msg.rank,
                msg.version,
            )
            return
        if msg.error:
            log.warning(
                "checkpoint %s: rank %d could not write its state (%s); the bundle goes without it",
                bundle.name,
                msg.rank,
                msg.error,
            )
            bundle.expected.discard(msg.rank)
        else:
            bundle.reports[msg.rank] = msg
        bundle.settle()

    def rank_lost(self, rank: int) -> None:
        """No bundle waits for a lost rank's state file."""
        for bundle in self._bundles.values():
            bundle.expected.discard(rank)
            bundle.settle()

    def save(
        self,
        action: SaveCheckpoint,
        snapshot: Snapshot | None,
        copy: Callable[[], Awaitable[Snapshot | None]] | None = None,
    ) -> None:
        """Write the bundle ``action`` describes from ``snapshot`` in the background; ``copy``:
        a failing run's last consensus, copied first (off the loop)."""
        if copy is not None:

            async def last() -> None:
                self.save(action, await copy())

            # drain() waits for it, and then for the bundle it starts
            task = self._tg.create_task(last(), name="checkpoint-last")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        if snapshot is None:
            log.warning(
                "checkpoint of round %d (%s): no consensus to write", action.round, action.reason
            )
            self._bundles.pop(action.bundle_round, None)
            return
        name = self.mark(action.bundle_round, action.reason)
        bundle = self._bundles[action.bundle_round]
        if self._spec.checkpoint.rank_state and not action.last:
            bundle.expected = set(action.ranks)
        bundle.settle()
        task = self._tg.create_task(
            self._write(action, bundle, snapshot), name=f"checkpoint-{name}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, within: float) -> None:
        """Wait (at most ``within`` seconds) for the bundles under way; then stop the writer."""
        deadline = time.monotonic() + within
        while self._tasks:  # a last-consensus copy starts its bundle's task when it is done
            _done, pending = await asyncio.wait(
                list(self._tasks), timeout=max(0.0, deadline - time.monotonic())
            )
            if pending and time.monotonic() >= deadline:
                for task in pending:
                    log.warning("checkpoint: %s not finished in time; abandoned", task.get_name())
                    task.cancel()
                break
        self._pool.shutdown(wait=False)

    async def _write(self, action: SaveCheckpoint, bundle: _Bundle, snapshot: Snapshot) -> None:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        save_path, name = self.save_path, bundle.name
        try:
            writer = await loop.run_in_executor(self._pool, _write_data, save_path, name, snapshot)
            if bundle.expected:
                try:
                    async with asyncio.timeout(self._rank_wait):
                        await bundle.arrived.wait()
                except TimeoutError:
                    missing = sorted(bundle.expected - set(bundle.reports))
                    log.warning(
                        "checkpoint %s: no state file from rank(s) %s within %gs; the bundle "
                        "goes without them",
                        name,
                        missing,
                        self._rank_wait,
                    )
            for rank, report in sorted(bundle.reports.items()):
                writer.add_file_hash(rank_file(rank), report.sha256)
            manifest = self._manifest(action, snapshot, tuple(sorted(bundle.reports)))
            path = await loop.run_in_executor(self._pool, writer.commit, manifest)
            keep = self._spec.checkpoint.keep_last
            if keep is not None:
                await loop.run_in_executor(self._pool, retain, save_path, keep)
        except (FlodlError, OSError, ValueError) as exc:
            log.error("checkpoint %s could not be written: %s", name, exc)
            return
        finally:
            self._bundles.pop(action.bundle_round, None)
        self.last = path
        log.info(
            "checkpoint: wrote %s (%s, round %d, %d epoch(s), step %d) in %.0f ms",
            path,
            action.reason,
            action.bundle_round,
            action.epoch,
            action.global_step,
            (time.monotonic() - started) * 1e3,
        )

    def _manifest(
        self, action: SaveCheckpoint, snapshot: Snapshot, ranks: tuple[int, ...]
    ) -> Manifest:
        spec, hello = self._spec, self._hello
        return Manifest(
            run_id=self._run_id,
            reason=Reason(action.reason),
            round=action.bundle_round,
            epoch=action.epoch,
            global_step=action.global_step,
            world_size=action.world_size,
            policy=spec.policy,
            backend=spec.backend,
            spec_digest=hello.digest,
            data=data_params(spec),
            model_schema=hello.model,
            elche=None if action.elche is None else elche_to_json(action.elche),
            # the coordinator's ranges are (first, count); the manifest's are half-open
            coverage=tuple((first, first + n) for first, n in action.coverage),
            outer_kind=spec.outer.to_wire().kind,
            outer_state_file=OUTER_FILE if snapshot.outer is not None else None,
            rank_files={rank: rank_file(rank) for rank in ranks},
            written_at=time.time(),
        )


def data_params(spec: TrainerSpec) -> DataParams:
    """The data parameters a resume must match, as this run's spec has them."""
    return DataParams(
        length=spec.dataset_len,
        batch_size=spec.batch_size,
        seed=spec.seed,
        drop_last=spec.drop_last,
    )


def _write_data(save_path: Path, name: str, snapshot: Snapshot) -> BundleWriter:
    """The writer thread: the consensus and the outer state, each crash-safe."""
    writer = BundleWriter(save_path, name)
    save_consensus(writer, snapshot.state_dict)
    outer: Mapping[str, object] | None = snapshot.outer
    if outer is not None:
        save_outer(writer, outer)
    return writer
