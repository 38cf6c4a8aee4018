"""Shared fixtures: a session secret, and one connection's keys from a real handshake.

Codec pairs and byte feeding live in :mod:`tests.wirekit`.
"""

from __future__ import annotations

import pytest

from flodl_async.wire import new_session_secret

from .wirekit import LinkPair, handshake_keys


@pytest.fixture
def secret() -> bytes:
    return new_session_secret()


@pytest.fixture
def keys(secret: bytes) -> LinkPair:
    return handshake_keys(secret)
