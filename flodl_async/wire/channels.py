"""Channel-select magics and the pure sniffer that routes a new connection.

Theory of operation: every connection to the controller port opens with four
bytes that name its channel. The binary magics start with 0xF1 0x0D, a byte
pair no HTTP method starts with, so an HTTP request line (``GET ``, ``HEAD``,
``POST``) is told apart from them by the same four bytes and routed to the
status channel. For binary channels the magic is consumed and the bytes after
it are handed on; for HTTP nothing is consumed (the request line is the
request). Routing is unauthenticated on purpose: a spoofed magic only reaches
a channel whose frame authentication rejects it.

torch's TCPStore client cannot be taught a magic, but it opens every connection
the same way: a ``VALIDATE`` query, the byte 0x00 then the u32 0x3C85F7CE
little-endian (captured from torch 2.13's own client: ``00 ce f7 85 3c``). No
binary magic and no HTTP method starts with 0x00, so those five bytes route to
the store channel, and nothing is consumed: they are the store protocol's first
request, which it must see.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

MAGIC_LEN = 4


class Channel(enum.Enum):
    """The services multiplexed on the one controller port."""

    JOIN = "join"
    RENDEZVOUS = "rendezvous"
    DATA = "data"
    CONTROL = "control"
    STATUS = "status"
    STORE = "store"


CHANNEL_MAGIC: dict[Channel, bytes] = {
    Channel.JOIN: b"\xf1\x0dJN",
    Channel.RENDEZVOUS: b"\xf1\x0dRV",
    Channel.DATA: b"\xf1\x0dDT",
    Channel.CONTROL: b"\xf1\x0dCT",
}
_BY_MAGIC = {magic: channel for channel, magic in CHANNEL_MAGIC.items()}
HTTP_PREFIXES = (b"GET ", b"HEAD", b"POST")
#: A torch TCPStore client's first request: VALIDATE (0x00) and the magic 0x3C85F7CE, little-endian.
STORE_PREFIX = b"\x00" + (0x3C85F7CE).to_bytes(4, "little")
#: Channels whose opening bytes are their protocol's own first bytes: handed on, not consumed.
UNCONSUMED: frozenset[Channel] = frozenset({Channel.STATUS, Channel.STORE})


@dataclass(frozen=True, slots=True, kw_only=True)
class NeedMore:
    """Fewer than four bytes so far: keep reading (within the deadline)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Routed:
    """The connection belongs to ``channel``; ``leftover`` is what its handler reads first."""

    channel: Channel
    leftover: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Unrouted:
    """The first bytes name no channel; ``reason`` says what they were."""

    reason: str


SniffResult = NeedMore | Routed | Unrouted


def sniff(prefix: bytes) -> SniffResult:
    """Classify the bytes received so far on a new connection."""
    if prefix[:1] == STORE_PREFIX[:1]:
        # Five bytes, not four: the whole VALIDATE, so a stray 0x00 never reaches the store.
        if prefix[: len(STORE_PREFIX)] == STORE_PREFIX:
            return Routed(channel=Channel.STORE, leftover=prefix)
        if len(prefix) < len(STORE_PREFIX) and STORE_PREFIX.startswith(prefix):
            return NeedMore()
        return Unrouted(reason=f"unknown channel magic {prefix[: len(STORE_PREFIX)].hex()}")
    if len(prefix) < MAGIC_LEN:
        # Reject early when the bytes so far already fit no magic: a peer that
        # sends one garbage byte and waits must not hold a slot until the deadline.
        if prefix and not any(
            candidate.startswith(prefix) for candidate in (*_BY_MAGIC, *HTTP_PREFIXES)
        ):
            return Unrouted(reason=f"unknown channel magic {prefix.hex()}")
        return NeedMore()
    head = prefix[:MAGIC_LEN]
    channel = _BY_MAGIC.get(head)
    if channel is not None:
        return Routed(channel=channel, leftover=prefix[MAGIC_LEN:])
    if head in HTTP_PREFIXES:
        return Routed(channel=Channel.STATUS, leftover=prefix)
    return Unrouted(reason=f"unknown channel magic {head.hex()}")
