"""Shared fixtures: session keys, codec pairs, and helpers for loopback tests."""

from __future__ import annotations

import pytest

from flodl_async.wire import Channel, FrameConnection, SessionKeys, Side, new_session_secret
from flodl_async.wire.frame import FrameLimits


@pytest.fixture
def keys() -> SessionKeys:
    return SessionKeys.derive(new_session_secret(), "test-run")


def codec_pair(keys: SessionKeys, channel: Channel = Channel.CONTROL, limits: FrameLimits | None = None) -> tuple[FrameConnection, FrameConnection]:
    """(peer side, controller side) codecs of one connection."""
    peer = FrameConnection(channel=channel, side=Side.PEER, keys=keys, limits=limits)
    controller = FrameConnection(channel=channel, side=Side.CONTROLLER, keys=keys, limits=limits)
    return peer, controller
