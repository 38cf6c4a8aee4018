"""Shared fixtures: a session secret, and one connection's keys from a real handshake.

Codec pairs and byte feeding live in :mod:`tests.wirekit`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from flodl_async.wire import new_session_secret

from .hostkit import HostKit, require_namespace_hosts
from .wirekit import LinkPair, handshake_keys


@pytest.fixture
def secret() -> bytes:
    return new_session_secret()


@pytest.fixture
def keys(secret: bytes) -> LinkPair:
    return handshake_keys(secret)


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
