"""The pure channel sniffer."""

from __future__ import annotations

import pytest

from flodl_async.wire import CHANNEL_MAGIC, Channel, NeedMore, Routed, Unrouted, sniff
from flodl_async.wire.channels import STORE_PREFIX, UNCONSUMED


@pytest.mark.parametrize("channel", list(CHANNEL_MAGIC))
def test_binary_magic_is_consumed(channel: Channel) -> None:
    assert sniff(CHANNEL_MAGIC[channel] + b"rest") == Routed(channel=channel, leftover=b"rest")


@pytest.mark.parametrize(
    "line", [b"GET /state.json HTTP/1.1\r\n", b"HEAD / HTTP/1.1\r\n", b"POST /x HTTP/1.1\r\n"]
)
def test_http_routes_to_status_without_consuming(line: bytes) -> None:
    assert sniff(line) == Routed(channel=Channel.STATUS, leftover=line)


@pytest.mark.parametrize("prefix", [b"", b"\xf1", b"\xf1\x0d", b"\xf1\x0dJ", b"G", b"GE", b"HEA"])
def test_partial_prefix_needs_more(prefix: bytes) -> None:
    assert isinstance(sniff(prefix), NeedMore)


@pytest.mark.parametrize(
    "data",
    [b"\x01", b"\x00\x01", b"\x00\xce\xf7\x85\x3d", b"xyz", b"\xf1\x0dZZ", b"PUT /", b"GETX"],
)
def test_unknown_bytes_are_unrouted_as_soon_as_they_fit_nothing(data: bytes) -> None:
    result = sniff(data)
    assert isinstance(result, Unrouted)
    assert "unknown channel magic" in result.reason


def test_magics_never_collide_with_http() -> None:
    for magic in CHANNEL_MAGIC.values():
        assert not magic.startswith((b"GET", b"HEA", b"POS"))
    assert len(set(CHANNEL_MAGIC.values())) == len(CHANNEL_MAGIC)


def test_torch_store_validate_routes_to_the_store_without_consuming() -> None:
    # torch 2.13's own client opens with exactly these bytes (captured from a real TCPStore client).
    assert bytes.fromhex("00cef7853c") == STORE_PREFIX
    first = STORE_PREFIX + b"\x01rest"  # VALIDATE, then the start of a SET
    assert sniff(first) == Routed(channel=Channel.STORE, leftover=first)
    assert Channel.STORE in UNCONSUMED


@pytest.mark.parametrize("n", range(1, 5))
def test_a_partial_validate_needs_more(n: int) -> None:
    assert isinstance(sniff(STORE_PREFIX[:n]), NeedMore)
