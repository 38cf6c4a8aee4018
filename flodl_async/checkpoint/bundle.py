"""Bundles on disk: the crash-safe writer, validity, the latest bundle, retention.

Theory of operation. A bundle is written in three steps, and a crash (SIGKILL, power loss) at any
moment leaves every earlier bundle as it was:

1. every file goes to a temporary name in the bundle directory (``.consensus.pt.tmp-<pid>-<rand>``),
   is hashed while it streams out (no second read; on a second core), fsync'd, then renamed;
2. the bundle directory is fsync'd, so the renames are on disk before the commit record;
3. ``manifest.json``, the commit record listing each file's SHA-256, goes through the same temporary
   name, fsync and rename, and the bundle directory and the save path are fsync'd.

A bundle is valid iff its manifest parses and every file it lists hashes to what it says. So a
write killed before step 3 leaves a directory without a manifest (torn: skipped by name, removed
by retention once a newer bundle is valid), and a manifest never names a file that was not
complete. Other processes (a rank on its own host) write their files with the same
:meth:`BundleWriter.write_file` and hand the hash up; the committing writer lists it with
:meth:`BundleWriter.add_file_hash`.

Bundle names sort by round (``r00000042-epoch``), and "latest" is the newest *valid* one: finding
it verifies bundles newest first and reports each one it skipped, with the reason, so the caller
can say by name which write was torn.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import BinaryIO

from ..errors import CheckpointInvalid
from .manifest import CONSENSUS_FILE, Manifest, parse_bundle_name

#: The commit record's name; written last.
MANIFEST_FILE = "manifest.json"
#: The outer optimizer's state (velocity), when it has any.
OUTER_FILE = "outer.pt"

#: Reads and hashes in chunks of this size (one reused buffer: verifying a 256 MiB file allocates
#: 4 MiB, not 256).
_CHUNK = 4 << 20
#: A write this large is hashed on a helper thread while it is written, in pieces of _PIECE.
_PARALLEL_MIN = 256 << 10
_PIECE = 8 << 20
_TEMP = re.compile(r"^\..+\.tmp-\d+-[0-9a-f]+$")
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class _HashingFile:
    """A write-only file that feeds every byte to SHA-256 on its way to the disk.

    What ``torch.save`` and a caller's ``write`` see: ``write`` and ``flush``. Bytes are hashed and
    written from the caller's own buffer (a memoryview), never copied. A large write is cut into
    pieces; each piece is hashed on a helper thread while this one writes it (hashlib and the
    write syscall both release the GIL), so hashing costs no time where a second core is free.
    The helper takes pieces in order (one thread, a FIFO), and ``write`` returns only when the
    last piece is hashed: the caller may reuse its buffer (torch's zip writer passes views of its
    own, short-lived memory).
    """

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._hash = hashlib.sha256()
        self._helper: ThreadPoolExecutor | None = None
        self.written = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        if len(view) < _PARALLEL_MIN:
            self._hash.update(view)
            self._write_all(view)
            return len(view)
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash")
        hashed: Future[None] | None = None
        for start in range(0, len(view), _PIECE):
            piece = view[start : start + _PIECE]
            hashed = self._helper.submit(self._hash.update, piece)
            offset = self.written
            self._write_all(piece)
            _start_writeback(self._raw.fileno(), offset, len(piece))
        assert hashed is not None
        hashed.result()  # the FIFO's last piece: every piece before it is hashed too
        return len(view)

    def _write_all(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            # a raw file may write less than asked (a signal, a full disk's last block)
            n = self._raw.write(view[done:])
            done += n if n is not None else 0
        self.written += done

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        """Stop the hashing thread (idempotent)."""
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` to the disk now, without
    waiting: the fsync at the end then waits for the last piece only, not for the whole file.

    Linux's ``POSIX_FADV_DONTNEED`` starts the writeback of dirty pages (and drops only pages
    already clean, which these are not yet); elsewhere it is a hint that may do nothing.
    """
    with contextlib.suppress(OSError, AttributeError):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_name(name: str) -> None:
    if not _PLAIN_NAME.match(name) or name == MANIFEST_FILE:
        raise ValueError(
            f"{name!r} is not a file a bundle may hold (a plain name in it, not {MANIFEST_FILE})"
        )


class BundleWriter:
    """Writes one bundle, ``save_path/name``, crash-safely; :meth:`commit` makes it valid.

    One per bundle and process: the controller's writer commits; a rank's writer (on its own
    host, same shared directory) only writes its file and reports the hash, so making a writer
    touches nothing already there. Rewriting a committed bundle (a run resumed from an older
    bundle reaching the same round and reason again) needs no care either: from its first
    replaced file until the new commit, its old manifest's hashes no longer match, so it is
    invalid, never a valid mix (a mix whose every file matches is byte for byte the old bundle).
    """

    def __init__(self, save_path: str | os.PathLike[str], name: str) -> None:
        if parse_bundle_name(name) is None:
            raise ValueError(f"{name!r} is not a bundle name (see bundle_name())")
        self.save_path = Path(save_path)
        self.name = name
        self.path = self.save_path / name
        self._files: dict[str, str] = {}
        self._committed = False
        self.save_path.mkdir(parents=True, exist_ok=True)
        self.path.mkdir(exist_ok=True)

    @property
    def files(self) -> MappingProxyType[str, str]:
        """The files listed so far: name -> SHA-256 hex."""
        return MappingProxyType(self._files)

    def write_file(self, name: str, write: Callable[[BinaryIO], None]) -> str:
        """Write file ``name`` of the bundle through ``write(file)`` and return its SHA-256 (hex).

        ``write`` gets a write-only binary file (``torch.save(obj, file)`` works); the bytes go
        to a temporary name, are hashed as they stream, fsync'd and renamed into place. If
        ``write`` raises, the temporary file is removed and the error propagates.
        """
        _check_name(name)
        self._check_open()
        temp = self.path / f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            # unbuffered: every write goes straight from the caller's buffer to the kernel
            with open(temp, "xb", buffering=0) as raw:
                hashing = _HashingFile(raw)
                try:
                    write(hashing)  # type: ignore[arg-type]  # write + flush is what writers use
                finally:
                    hashing.close()
                os.fsync(raw.fileno())
            os.replace(temp, self.path / name)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        digest = hashing.hexdigest()
        self._files[name] = digest
        return digest

    def add_file_hash(self, name: str, sha256: str) -> None:
        """List a file another process wrote into this bundle (a rank's state on its own host),
        with the SHA-256 that process computed while writing it."""
        _check_name(name)
        self._check_open()
        if not re.fullmatch(r"[0-9a-f]{64}", sha256):
            raise ValueError(f"{sha256!r} is not a SHA-256 hex digest")
        self._files[name] = sha256

    def commit(self, manifest: Manifest) -> Path:
        """Write ``manifest`` with this writer's files as the commit record, last; the bundle is
        valid from here on. ``manifest.files`` must be empty: the writer knows the files.

        Returns the bundle's path. A listed file that is not there (a rank reported a hash for a
        file this host cannot see: the save path is not shared) is a :class:`CheckpointInvalid`,
        and nothing is committed.
        """
        self._check_open()
        if manifest.files:
            raise ValueError("commit() fills in manifest.files; build the manifest without them")
        where = str(self.path)
        complete = replace(manifest, files=MappingProxyType(dict(sorted(self._files.items()))))
        complete.check_files(path=where)
        for name in complete.files:
            if not (self.path / name).is_file():
                raise CheckpointInvalid(
                    path=where,
                    field=f"files[{name}]",
                    reason="listed but not in the bundle directory",
                    remedy="make the save path a directory every host of the run shares",
                )
        # the renames of step 1 reach the disk before the record that names their files (the
        # bundle's own entry in the save path matters only once it is committed: synced below)
        _fsync_dir(self.path)
        text = complete.to_json().encode()
        self._committed = True  # one commit per writer, even if the manifest write fails
        temp = self.path / f".{MANIFEST_FILE}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            with open(temp, "xb", buffering=0) as raw:
                _HashingFile(raw).write(text)
                os.fsync(raw.fileno())
            os.replace(temp, self.path / MANIFEST_FILE)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.path)
        _fsync_dir(self.save_path)
        return self.path

    def _check_open(self) -> None:
        if self._committed:
            raise ValueError(f"bundle {self.path} is already committed; start a new BundleWriter")


# ----- reading ----------------------------------------------------------------------------------


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def _read_manifest(bundle: Path) -> Manifest:
    """The manifest of ``bundle``, parsed (not yet hashed against its files)."""
    where = bundle / MANIFEST_FILE
    if not bundle.exists():
        raise CheckpointInvalid(path=str(bundle), field="path", reason="does not exist")
    if not bundle.is_dir():
        raise CheckpointInvalid(path=str(bundle), field="path", reason="is not a bundle directory")
    if not where.is_file():
        if list_bundles(bundle):
            raise CheckpointInvalid(
                path=str(bundle),
                field="path",
                reason="is a save path holding bundles, not a bundle",
                remedy="name one of its bundles, or pass resume_from='latest' with this save_path",
            )
        raise CheckpointInvalid(
            path=str(bundle),
            field=MANIFEST_FILE,
            reason="missing: the write of this bundle never finished (torn)",
        )
    return Manifest.from_json(where.read_bytes(), path=str(where))


def verify_bundle(path: str | os.PathLike[str]) -> Manifest:
    """The manifest of the bundle at ``path`` (its directory, or its ``manifest.json``), after
    checking that it parses and that every file it lists is there and hashes to what it says;
    otherwise a :class:`CheckpointInvalid` naming the bundle and the field or file."""
    bundle = Path(path)
    if bundle.name == MANIFEST_FILE and bundle.is_file():
        bundle = bundle.parent
    manifest = _read_manifest(bundle)
    for name, expected in manifest.files.items():
        file = bundle / name
        if not file.is_file():
            raise CheckpointInvalid(path=str(bundle), field=f"files[{name}]", reason="missing")
        if _sha256_of(file) != expected:
            raise CheckpointInvalid(
                path=str(bundle),
                field=f"files[{name}]",
                reason="its SHA-256 differs from the manifest's (corrupt, or from another write)",
            )
    return manifest


@dataclass(frozen=True, slots=True, kw_only=True)
class Skipped:
    """A bundle :func:`find_latest` passed over: its name, and the field and reason it is not
    valid."""

    name: str
    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.field}: {self.reason})"


def list_bundles(save_path: str | os.PathLike[str]) -> tuple[Path, ...]:
    """The bundle directories under ``save_path``, oldest first (by round, then name); anything
    else there is not ours and left out."""
    root = Path(save_path)
    if not root.is_dir():
        return ()
    found = []
    for entry in root.iterdir():
        parsed = parse_bundle_name(entry.name)
        if parsed is not None and entry.is_dir():
            found.append((parsed[0], entry.name, entry))
    return tuple(entry for _, _, entry in sorted(found))


def find_latest(save_path: str | os.PathLike[str]) -> tuple[Path | None, tuple[Skipped, ...]]:
    """The newest valid bundle under ``save_path`` (None when there is none yet, or no such
    directory), and every newer one skipped on the way, with why. A save path that is a file is
    a :class:`CheckpointInvalid`: "no bundle yet" would hide the mistake."""
    root = Path(save_path)
    if root.exists() and not root.is_dir():
        raise CheckpointInvalid(
            path=str(root),
            field="save_path",
            reason="is not a directory (a save path holds one directory per bundle)",
            remedy="point save_path at a directory (it is made when missing)",
        )
    skipped: list[Skipped] = []
    for bundle in reversed(list_bundles(root)):
        try:
            verify_bundle(bundle)
        except CheckpointInvalid as exc:
            skipped.append(Skipped(name=bundle.name, field=exc.field, reason=exc.reason))
            continue
        return bundle, tuple(skipped)
    return None, tuple(skipped)


def _looks_valid(bundle: Path) -> bool:
    """A cheap validity for retention: the manifest parses and its files are there.

    Hashing every kept bundle at every checkpoint would read keep_last models each time; the
    newest, which retention must never lose, is fully verified instead (:func:`find_latest`).
    """
    try:
        manifest = _read_manifest(bundle)
    except CheckpointInvalid:
        return False
    return all((bundle / name).is_file() for name in manifest.files)


def _temp_files(bundle: Path) -> Iterator[Path]:
    with contextlib.suppress(FileNotFoundError):
        for entry in bundle.iterdir():
            if _TEMP.match(entry.name):
                yield entry


def _remove_bundle(bundle: Path) -> None:
    # the manifest first: a removal cut short leaves a torn bundle, never a valid-looking half
    (bundle / MANIFEST_FILE).unlink(missing_ok=True)
    shutil.rmtree(bundle, ignore_errors=True)


def retain(save_path: str | os.PathLike[str], keep_last: int) -> tuple[Path, ...]:
    """Keep the newest ``keep_last`` valid bundles under ``save_path``; remove older valid ones,
    torn or invalid ones older than the newest valid one (dead writes), and leftover temporary
    files in the bundles kept. Returns what it removed.

    Never removes the newest valid bundle, nor anything newer than it (a write in progress).
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an integer >= 1, got {keep_last!r}")
    latest, _ = find_latest(save_path)
    if latest is None:
        return ()
    bundles = list_bundles(save_path)
    older = bundles[: bundles.index(latest)]
    removed: list[Path] = []
    kept = [latest]
    for bundle in reversed(older):
        if len(kept) < keep_last and _looks_valid(bundle):
            kept.append(bundle)
        else:
            _remove_bundle(bundle)
            removed.append(bundle)
    for bundle in kept:
        for temp in _temp_files(bundle):
            temp.unlink(missing_ok=True)
            removed.append(temp)
    if removed:
        _fsync_dir(Path(save_path))
    return tuple(removed)


__all__ = [
    "CONSENSUS_FILE",
    "MANIFEST_FILE",
    "OUTER_FILE",
    "BundleWriter",
    "Skipped",
    "find_latest",
    "list_bundles",
    "retain",
    "verify_bundle",
]
