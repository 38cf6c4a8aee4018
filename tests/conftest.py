"""Shared fixtures: a session secret, one connection's keys from a real handshake, a private runtime directory, the namespace hosts.

Codec pairs and byte feeding live in :mod:`tests.wirekit`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from flodl_async.wire import new_session_secret

from .hostkit import HostKit, require_namespace_hosts, under_ci
from .slurmkit import SlurmKit, require_slurm
from .wirekit import LinkPair, handshake_keys

# Under CI, Hypothesis draws the same examples on every run: a red CI is then a failure anyone
# can reproduce, never a draw nobody has seen. Locally the default profile keeps exploring new
# draws (and replays the failures it saved in .hypothesis/). Per-test settings built after this
# inherit it and keep their own max_examples. CI writes nothing into the checkout: no example
# database, and Hypothesis' other caches (the constants it reads from the code under test) go to
# a private directory, removed at exit, unless CI names its own.
settings.register_profile("ci", derandomize=True, database=None)
if under_ci():
    settings.load_profile("ci")
    if "HYPOTHESIS_STORAGE_DIRECTORY" not in os.environ:
        _hypothesis_home = tempfile.mkdtemp(prefix="fl-hypothesis-")
        os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = _hypothesis_home
        atexit.register(shutil.rmtree, _hypothesis_home, ignore_errors=True)


@pytest.fixture
def secret() -> bytes:
    return new_session_secret()


@pytest.fixture
def keys(secret: bytes) -> LinkPair:
    return handshake_keys(secret)


@pytest.fixture
def xdg() -> Iterator[Path]:
    """A private, short XDG_RUNTIME_DIR for the processes under test (pytest's tmp_path may be too deep for socket paths)."""
    path = Path(tempfile.mkdtemp(prefix="fl-xdg-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def hostkit_session() -> Iterator[HostKit]:
    """Three namespace hosts with real sshd for the whole session (see :mod:`tests.hostkit`)."""
    require_namespace_hosts()  # skips with the reason, or fails under CI
    kit = HostKit.create(3)
    try:
        yield kit
    finally:
        kit.close()


@pytest.fixture
def hostkit(hostkit_session: HostKit) -> Iterator[HostKit]:
    """The session's namespace hosts; after the test, nothing of ours may be left on any of them."""
    yield hostkit_session
    left = hostkit_session.leftovers()
    hostkit_session.kill_leftovers()
    assert left == {}, f"processes left on namespace hosts after the test: {left}"


@pytest.fixture(scope="session")
def slurm_session() -> Iterator[SlurmKit]:
    """A real SLURM (slurmctld, three slurmd on namespace nodes, munge) for the whole session (see
    :mod:`tests.slurmkit`)."""
    require_slurm()  # skips with the reason, or fails under CI
    kit = SlurmKit.create()
    try:
        yield kit
    finally:
        kit.close()


@pytest.fixture
def slurm(slurm_session: SlurmKit) -> Iterator[SlurmKit]:
    """The session's SLURM; after the test, nothing may be left on any of its nodes."""
    yield slurm_session
    left = slurm_session.leftovers()
    assert left == {}, f"processes left on SLURM nodes after the test: {left}"


@pytest.fixture(scope="session", autouse=True)
def gpu_less_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every test, and every process it starts here, sees a host with no GPU, whatever this machine has.

    Without it a default ``--devices auto`` run (``--nproc 2``) would pick a GPU machine's GPUs, or be
    refused on a one-GPU machine: a test's result would depend on the machine it ran on. GPUs are
    counted from ``FLODL_INTERNAL_DEV_DIR`` (:mod:`flodl_async.host.gpus`), here an empty directory, and
    the caller's ``CUDA_VISIBLE_DEVICES`` is dropped; a test that wants GPUs fakes them itself
    (its own ``FLODL_INTERNAL_DEV_DIR`` with ``nvidiaN`` files, and its own mask).
    """
    from flodl_async.host.gpus import DEV_DIR_VARIABLE, MASK_VARIABLE

    empty = tmp_path_factory.mktemp("no-gpu-dev")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DEV_DIR_VARIABLE, str(empty))
        patch.delenv(MASK_VARIABLE, raising=False)
        yield
