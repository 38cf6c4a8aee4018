"""Shared fixtures: session keys. Codec pairs and byte feeding live in :mod:`tests.wirekit`."""

from __future__ import annotations

import pytest

from flodl_async.wire import SessionKeys, new_session_secret


@pytest.fixture
def keys() -> SessionKeys:
    return SessionKeys.derive(new_session_secret(), "test-run")
