"""The runs of this machine: every controller registers in the per-user runtime directory while it
runs.

``<runtime>/controllers/<run id>.json`` holds the controller's pid and process
start time, run id, status address and port, and when it started. It is made
whole under a temporary name and renamed into place, removed when the
controller ends, and an entry whose owner died without that chance (SIGKILL)
is swept by the next controller that starts and by every reader
(:func:`local_runs`): a process is judged alive by pid *and* start time, as in
:mod:`flodl_async.host.runtime`, whose choice of root (the short one that
stands in for a root too deep for socket paths included) the controller and
its readers share. This is what lets ``flodl status`` with no
address find the local run, and ``flodl ps`` list them. Nothing here imports
asyncio: ``flodl`` reads it too.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import RuntimeDirError
from .runtime import ProcessIdentity, ensure_root, private_subdir, runtime_root

CONTROLLERS_DIR = "controllers"


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalRun:
    """One registered controller."""

    owner: ProcessIdentity
    run_id: str
    address: str  # where its status answers from this machine
    port: int
    started_at: float

    def to_json(self) -> str:
        doc = {"pid": self.owner.pid, "start_time": self.owner.start_time, "run_id": self.run_id}
        return json.dumps(
            doc | {"address": self.address, "port": self.port, "started_at": self.started_at}
        )

    @classmethod
    def read(cls, path: Path) -> LocalRun | None:
        """The entry at ``path``, or None when it is unreadable (a torn or foreign file)."""
        try:
            doc = json.loads(path.read_text())
            start = doc["start_time"]
            return cls(
                owner=ProcessIdentity(
                    pid=int(doc["pid"]), start_time=None if start is None else int(start)
                ),
                run_id=str(doc["run_id"]),
                address=str(doc["address"]),
                port=int(doc["port"]),
                started_at=float(doc["started_at"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None


class Registration:
    """This controller's entry; :meth:`remove` on every way out (idempotent)."""

    def __init__(self, path: Path, run: LocalRun) -> None:
        self.path = path
        self.run = run

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _file_name(run_id: str) -> str:
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in run_id)[:64]
    return f"{safe}-{os.getpid()}.json"  # the pid keeps two controllers of one run id apart


def register(*, run_id: str, address: str, port: int, root: Path | None = None) -> Registration:
    """Register this process's controller (sweeping the entries of dead ones first)."""
    directory = private_subdir(ensure_root(root), CONTROLLERS_DIR)
    sweep(root)
    run = LocalRun(
        owner=ProcessIdentity.current(),
        run_id=run_id,
        address=address,
        port=port,
        started_at=time.time(),
    )
    final = directory / _file_name(run_id)
    tmp = directory / f".new-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.write_text(run.to_json())
    os.rename(tmp, final)  # whole or not at all
    return Registration(final, run)


def sweep(root: Path | None = None) -> tuple[LocalRun, ...]:
    """Remove the entries of controllers that are gone; returns the live ones, oldest first."""
    if root is None:
        try:
            root = runtime_root()
        except RuntimeDirError:  # too deep, no short one usable: no controller could register
            return ()
    directory = root / CONTROLLERS_DIR
    if not directory.is_dir() or directory.is_symlink():
        return ()
    live: list[LocalRun] = []
    for path in sorted(directory.glob("*.json")):
        run = LocalRun.read(path)
        if run is None or not run.owner.is_alive():
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        live.append(run)
    return tuple(sorted(live, key=lambda r: r.started_at))


def local_runs(root: Path | None = None) -> tuple[LocalRun, ...]:
    """This user's live controllers on this machine, oldest first (dead entries are swept on the
    way)."""
    return sweep(root)
