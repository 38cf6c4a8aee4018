"""The session secret (``--secret-file``) and the cluster token (``--token-file``) on disk: read
only from a private file, written private from its first byte.

Read: as ssh treats a private key, a secret file is refused unless it is a
regular file, owned by the user running us, that neither group nor others can
read or write; the error names the file, what is wrong and the command that
fixes it. The checks are made on the opened descriptor (``fstat``), so the file
checked is the file read. A FIFO is opened without blocking and then refused.
A systemd credential (a file inside ``$CREDENTIALS_DIRECTORY``) is the one
exception to the owner rule: systemd writes it root-owned and lets the service's
user read it by an ACL, so there any owner is taken and only write access for
group or others, or read access for everyone, is refused.

Write: missing parent directories are made mode 0700, then a new file is created with ``O_CREAT |
O_EXCL`` and mode 0600, so it is
private from the moment it exists (no chmod afterwards, hence no window in which
it is readable), and an existing file — or a symlink planted where it should go —
is never followed or overwritten: the caller reads that one instead.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import stat

from ..errors import ConfigError, SecretFileError
from ..wire.keys import new_cluster_token, secret_from_hex, token_from_hex

#: A secret file holds 32 hex characters and a newline; anything much larger is not one (and is not
#: read whole).
MAX_SECRET_FILE_BYTES = 4096

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def read_secret_file(path: str | os.PathLike[str]) -> bytes:
    """The session secret in ``path``, after checking that the file is private; raises
    :class:`SecretFileError`."""
    name = os.fspath(path)
    missing = "flodl-launch --secret-file PATH writes a new one when PATH does not exist"
    raw = _read_private(
        name, flag="--secret-file", what="the session secret", missing=missing, label="secret file"
    )
    try:
        return secret_from_hex(raw.decode("ascii", errors="replace"))
    except ConfigError as exc:
        raise SecretFileError(
            name, str(exc), "write the controller's secret into it (32 hex characters)"
        ) from None


def read_token_file(path: str | os.PathLike[str]) -> bytes:
    """The cluster token in ``path`` (``--token-file``), checked private as a secret file is; raises
    :class:`SecretFileError`."""
    name = os.fspath(path)
    raw = _read_private(
        name,
        flag="--token-file",
        what="the cluster token",
        missing="`flodl token new PATH` writes a new one",
        label="token file",
    )
    try:
        return token_from_hex(raw.decode("ascii", errors="replace"))
    except ConfigError as exc:
        raise SecretFileError(
            name,
            str(exc),
            "use the file `flodl token new` wrote (the same file on every host)",
            what="token file",
        ) from None


def create_token_file(path: str | os.PathLike[str]) -> None:
    """Write a fresh cluster token to a new file at ``path`` (0600 from its creation); never
    overwrites.

    Raises :class:`SecretFileError` when anything is already there, or it cannot be written.
    """
    name = os.fspath(path)
    try:
        create_secret_file(name, new_cluster_token())
    except FileExistsError:
        raise SecretFileError(
            name,
            "already exists (a token file is never overwritten: hosts holding the old token would "
            "be locked out)",
            "pick a new path, or remove it first",
            what="token file",
        ) from None


def _read_private(name: str, *, flag: str, what: str, missing: str, label: str) -> bytes:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise SecretFileError(
            name,
            f"cannot open it: {exc.strerror or exc}",
            f"check the path ({missing})",
            what=label,
        ) from exc
    try:
        _check_private(name, os.fstat(fd), flag=flag, what=what, label=label)
        return _read_bounded(name, fd, label=label)
    finally:
        os.close(fd)


def _check_private(name: str, st: os.stat_result, *, flag: str, what: str, label: str) -> None:
    quoted = shlex.quote(name)
    if not stat.S_ISREG(st.st_mode):
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise SecretFileError(
            name,
            f"is {kind}, not a regular file",
            f"point {flag} at a regular file of yours with mode 0600",
            what=label,
        )
    if _under_credentials_directory(name):
        _check_credential(name, st, flag=flag, what=what, label=label)
        return
    if st.st_uid != os.geteuid():
        raise SecretFileError(
            name,
            f"is owned by uid {st.st_uid}, not by you (uid {os.geteuid()}); a secret must be its "
            "reader's own",
            f"use a copy of your own: `install -m 600 {quoted} NEWFILE`",
            what=label,
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise SecretFileError(
            name,
            f"has mode {mode:04o}, so group or others can get at {what} (refused, as ssh refuses a "
            "loose private key)",
            f"run `chmod 600 {quoted}`",
            what=label,
        )


def _under_credentials_directory(name: str) -> bool:
    """``name`` resolves to a file inside ``$CREDENTIALS_DIRECTORY`` (set by systemd for a unit with
    ``LoadCredential=``)."""
    directory = os.environ.get("CREDENTIALS_DIRECTORY")
    if not directory:
        return False
    root = os.path.realpath(directory)
    path = os.path.realpath(name)
    return path != root and os.path.commonpath((root, path)) == root


def _check_credential(name: str, st: os.stat_result, *, flag: str, what: str, label: str) -> None:
    """A systemd credential: any owner, group bits read-only, nothing for others.

    systemd (``write_credential`` in src/core/exec-credential.c) writes each
    credential 0400 and root-owned into a directory it made and mounts read-only,
    then grants the service's user read access with a POSIX ACL entry, and only
    where the file system has no ACLs chowns the file to that user instead. With
    an ACL, ``stat`` shows the ACL's mask in the group bits, so the file reads
    0440 owned by root although no group can read it: the ownership rule and the
    group-read bit say nothing here, and would refuse every credential of a
    service that does not run as root. Only root can write that directory (the
    reader does not choose its owner), so what is still checked is what systemd
    never makes: a file group or others could write, or that everyone can read.
    """
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o026:
        raise SecretFileError(
            name,
            f"has mode {mode:04o} in $CREDENTIALS_DIRECTORY, so everyone can read {what} or group "
            "or others can change it",
            "systemd writes a credential 0400 (0440 with the ACL that lets the service read it): "
            f"check what put this file there for {flag}",
            what=label,
        )


def _read_bounded(name: str, fd: int, *, label: str) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size <= MAX_SECRET_FILE_BYTES:
        try:
            chunk = os.read(fd, MAX_SECRET_FILE_BYTES + 1 - size)
        except OSError as exc:
            raise SecretFileError(
                name, f"cannot read it: {exc.strerror or exc}", "check the file", what=label
            ) from exc
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
    raise SecretFileError(
        name,
        f"is larger than {MAX_SECRET_FILE_BYTES} bytes, so not a secret or token (hex characters)",
        "check the path",
        what=label,
    )


def create_secret_file(path: str | os.PathLike[str], secret: bytes) -> None:
    """Write ``secret`` (hex) to a new file at ``path``, mode 0600 from its creation.

    Raises ``FileExistsError`` when anything is already there (a file, a directory, a
    symlink, dangling or not): the caller reads that instead. Other failures raise
    :class:`SecretFileError`; a file that could not be written whole is removed.
    """
    name = os.fspath(path)
    _make_parents(name)
    try:
        # O_EXCL: created by this call or not at all, and a symlink at `name` is not followed.
        fd = os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except FileExistsError:
        raise
    except OSError as exc:
        raise SecretFileError(
            name,
            f"cannot create it: {exc.strerror or exc}",
            "pick a path in a directory you can write",
        ) from exc
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(secret.hex().encode() + b"\n")
            out.flush()
            os.fsync(out.fileno())
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise SecretFileError(
            name, f"cannot write it: {exc.strerror or exc}", "check the disk and the path"
        ) from exc


def _make_parents(name: str) -> None:
    """Missing parent directories of a secret file are made mode 0700 (only ours can list them);
    existing ones are left as they are."""
    parent = os.path.dirname(os.path.abspath(name))
    if os.path.isdir(parent):
        return
    missing: list[str] = []
    while not os.path.isdir(parent) and parent not in missing:
        missing.append(parent)
        parent = os.path.dirname(parent)
    try:
        # One by one: os.makedirs gives its mode to the last directory only (the others get the
        # umask's default).
        for directory in reversed(missing):
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, 0o700)  # the umask can only narrow it
    except OSError as exc:
        raise SecretFileError(
            name, f"cannot create its directory: {exc.strerror or exc}", "pick a path you can write"
        ) from exc


def load_or_create_secret(path: str | os.PathLike[str], new_secret: bytes) -> bytes:
    """The secret in ``path`` when it exists (checked by :func:`read_secret_file`), else
    ``new_secret``, written there."""
    try:
        create_secret_file(path, new_secret)
    except FileExistsError:
        return read_secret_file(path)
    return new_secret
