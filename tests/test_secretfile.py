"""--secret-file: refused unless private (as ssh refuses a loose key); written 0600 from its creation, never over anything."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from flodl_async.errors import ConfigError, SecretFileError
from flodl_async.host.secretfile import (
    MAX_SECRET_FILE_BYTES,
    create_secret_file,
    load_or_create_secret,
    read_secret_file,
    read_token_file,
)
from flodl_async.wire.keys import new_cluster_token, new_session_secret


def _secret_file(
    tmp_path: Path, mode: int = 0o600, secret: bytes | None = None
) -> tuple[Path, bytes]:
    secret = secret or new_session_secret()
    path = tmp_path / "secret"
    path.write_text(secret.hex() + "\n")
    path.chmod(mode)
    return path, secret


@pytest.fixture
def umask_0() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o700], ids=lambda mode: f"{mode:04o}")
def test_a_private_file_is_read(tmp_path: Path, mode: int) -> None:
    path, secret = _secret_file(tmp_path, mode)
    assert read_secret_file(path) == secret
    assert read_secret_file(str(path)) == secret


@pytest.mark.parametrize(
    "mode",
    [0o644, 0o640, 0o604, 0o620, 0o602, 0o610, 0o601, 0o666, 0o777],
    ids=lambda mode: f"{mode:04o}",
)
def test_a_file_group_or_others_can_get_at_is_refused_with_the_fix(
    tmp_path: Path, mode: int
) -> None:
    path, _ = _secret_file(tmp_path, mode)
    with pytest.raises(SecretFileError) as caught:
        read_secret_file(path)
    message = str(caught.value)
    assert message.startswith(
        f"secret file {path}: has mode {mode:04o}, so group or others can get at the session secret"
    )
    assert message.endswith(f"run `chmod 600 {path}`")
    assert "\n" not in message
    assert isinstance(caught.value, ConfigError)  # a usage error for both commands
    assert stat.S_IMODE(path.stat().st_mode) == mode  # refused, not silently tightened


def test_the_fix_quotes_a_path_that_needs_it(tmp_path: Path) -> None:
    path = tmp_path / "my secret; rm -rf"
    path.write_text(new_session_secret().hex())
    path.chmod(0o644)
    with pytest.raises(SecretFileError, match=r"run `chmod 600 '.*my secret; rm -rf'`"):
        read_secret_file(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_file_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    path, _ = _secret_file(tmp_path)
    os.chown(path, 65534, 65534)
    with pytest.raises(SecretFileError, match=r"is owned by uid 65534, not by you \(uid 0\)"):
        read_secret_file(path)


def test_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir(mode=0o700)
    with pytest.raises(SecretFileError, match="is a directory, not a regular file"):
        read_secret_file(tmp_path / "dir")


@pytest.mark.timeout(10)
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(SecretFileError, match="is a FIFO, not a regular file"):
        read_secret_file(fifo)


def test_a_device_is_refused() -> None:
    with pytest.raises(SecretFileError, match="is a character device, not a regular file"):
        read_secret_file("/dev/null")


def test_a_symlink_is_judged_by_the_file_it_names(tmp_path: Path) -> None:
    path, secret = _secret_file(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(path)
    assert read_secret_file(link) == secret
    path.chmod(0o644)
    with pytest.raises(SecretFileError, match="has mode 0644"):
        read_secret_file(link)


def test_a_missing_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(
        SecretFileError, match=r"secret file .*/nope: cannot open it: No such file or directory"
    ):
        read_secret_file(tmp_path / "nope")


def test_what_is_not_a_secret_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("not hex\n")
    path.chmod(0o600)
    with pytest.raises(
        SecretFileError, match=rf"secret file {path}: session secret must be 32 hex characters"
    ):
        read_secret_file(path)


def test_a_huge_file_is_not_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"0" * (50 * MAX_SECRET_FILE_BYTES))
    path.chmod(0o600)
    with pytest.raises(SecretFileError, match=f"is larger than {MAX_SECRET_FILE_BYTES} bytes"):
        read_secret_file(path)


def test_a_new_file_is_0600_from_its_creation_whatever_the_umask(
    tmp_path: Path, umask_0: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_chmod(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("chmod after creation: the file was readable until then")

    for name in ("chmod", "fchmod", "lchmod"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, no_chmod)
    secret = new_session_secret()
    path = tmp_path / "secret"
    create_secret_file(path, secret)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == secret.hex() + "\n"
    assert read_secret_file(path) == secret  # what we write passes our own check


def test_an_existing_file_is_never_overwritten(tmp_path: Path) -> None:
    path, secret = _secret_file(tmp_path)
    with pytest.raises(FileExistsError):
        create_secret_file(path, new_session_secret())
    assert read_secret_file(path) == secret


def test_a_planted_symlink_is_not_followed_when_writing(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    link = tmp_path / "secret"
    link.symlink_to(target)  # dangling: a plain open(O_CREAT) would create `elsewhere`
    with pytest.raises(FileExistsError):
        create_secret_file(link, new_session_secret())
    assert not target.exists()


def test_load_or_create_reads_an_existing_file_and_writes_a_missing_one(tmp_path: Path) -> None:
    path, secret = _secret_file(tmp_path)
    assert load_or_create_secret(path, new_session_secret()) == secret
    fresh = new_session_secret()
    assert load_or_create_secret(tmp_path / "new", fresh) == fresh
    assert read_secret_file(tmp_path / "new") == fresh
    path.chmod(0o644)
    with pytest.raises(SecretFileError, match="has mode 0644"):
        load_or_create_secret(path, new_session_secret())


def test_a_directory_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SecretFileError, match=r"cannot create it: Not a directory"):
        create_secret_file(tmp_path / "a-file" / "secret", new_session_secret())


def test_missing_directories_are_made_private(tmp_path: Path) -> None:
    create_secret_file(tmp_path / "x" / "y" / "secret", new_session_secret())
    assert (tmp_path / "x").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "x" / "y").stat().st_mode & 0o777 == 0o700


# ----- systemd credentials ($CREDENTIALS_DIRECTORY) ------------------------------------------------------


def _credential(directory: Path, *, owner: int, mode: int) -> tuple[Path, bytes]:
    """A token file as systemd's LoadCredential= leaves it: 0400, root-owned, and 0440 once an ACL lets the service user read it."""
    directory.mkdir(exist_ok=True)
    token = new_cluster_token()
    path = directory / "flodl-token"
    path.write_text(token.hex() + "\n")
    os.chown(path, owner, owner)
    path.chmod(mode)
    return path, token


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize("owner", [0, 65534], ids=["root-owned", "owned-by-another-uid"])
def test_a_credential_systemd_wrote_is_read_whatever_its_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, owner: int
) -> None:
    """We run as root: uid 65534 stands in for systemd's root when the service runs as its own user; 0440 is 0400 plus the ACL's mask."""
    creds = tmp_path / "credentials"
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    path, token = _credential(creds, owner=owner, mode=0o440)
    assert read_token_file(path) == token
    assert (
        read_token_file(creds / ".." / "credentials" / "flodl-token") == token
    )  # the path is resolved first


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_the_owner_rule_is_relaxed_only_inside_credentials_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    creds = tmp_path / "credentials"
    path, _ = _credential(creds, owner=65534, mode=0o440)
    # No $CREDENTIALS_DIRECTORY: the same file is someone else's.
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    with pytest.raises(SecretFileError, match=r"is owned by uid 65534, not by you"):
        read_token_file(path)
    # Set, but naming another directory: the same.
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path / "elsewhere"))
    with pytest.raises(SecretFileError, match=r"is owned by uid 65534, not by you"):
        read_token_file(path)
    # A twin of it beside the credentials directory, and a link from inside it to that twin: judged as an ordinary file.
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    twin, _ = _credential(tmp_path / "outside", owner=65534, mode=0o440)
    link = creds / "link"
    link.symlink_to(twin)
    for name in (twin, link, creds / ".." / "outside" / "flodl-token"):
        with pytest.raises(SecretFileError, match=r"is owned by uid 65534, not by you"):
            read_token_file(name)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize(
    "mode", [0o444, 0o404, 0o460, 0o442, 0o666], ids=lambda mode: f"{mode:04o}"
)
def test_a_credential_others_can_read_or_anyone_else_can_change_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    creds = tmp_path / "credentials"
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    path, _ = _credential(creds, owner=0, mode=mode)
    with pytest.raises(SecretFileError) as caught:
        read_token_file(path)
    message = str(caught.value)
    assert message.startswith(f"token file {path}: has mode {mode:04o} in $CREDENTIALS_DIRECTORY")
    assert "systemd writes a credential 0400" in message
    assert "\n" not in message
