"""The pure channel sniffer."""

from __future__ import annotations

import pytest

from flodl_async.wire import CHANNEL_MAGIC, Channel, NeedMore, Routed, Unrouted, sniff


@pytest.mark.parametrize("channel", list(CHANNEL_MAGIC))
def test_binary_magic_is_consumed(channel: Channel) -> None:
    assert sniff(CHANNEL_MAGIC[channel] + b"rest") == Routed(channel=channel, leftover=b"rest")


@pytest.mark.parametrize("line", [b"GET /state.json HTTP/1.1\r\n", b"HEAD / HTTP/1.1\r\n", b"POST /x HTTP/1.1\r\n"])
def test_http_routes_to_status_without_consuming(line: bytes) -> None:
    assert sniff(line) == Routed(channel=Channel.STATUS, leftover=line)


@pytest.mark.parametrize("prefix", [b"", b"\xf1", b"\xf1\x0d", b"\xf1\x0dJ", b"G", b"GE", b"HEA"])
def test_partial_prefix_needs_more(prefix: bytes) -> None:
    assert isinstance(sniff(prefix), NeedMore)


@pytest.mark.parametrize("data", [b"\x00", b"xyz", b"\xf1\x0dZZ", b"PUT /", b"GETX"])
def test_unknown_bytes_are_unrouted_as_soon_as_they_fit_nothing(data: bytes) -> None:
    result = sniff(data)
    assert isinstance(result, Unrouted)
    assert "unknown channel magic" in result.reason


def test_magics_never_collide_with_http() -> None:
    for magic in CHANNEL_MAGIC.values():
        assert not magic.startswith((b"GET", b"HEA", b"POS"))
    assert len(set(CHANNEL_MAGIC.values())) == len(CHANNEL_MAGIC)
