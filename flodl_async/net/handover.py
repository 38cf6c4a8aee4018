"""Handing a sniffed connection to its channel's protocol: the watcher between them, and the
bytes the sniffer already read.

The mux gives a routed transport to the channel's protocol with ``transport.set_protocol`` and a
thin watcher in between, so the hot path runs on plain protocol callbacks with no extra copy or
task while the mux still learns when the connection closes; the watcher reads in the same style
as the protocol it forwards to (plain or buffered).
"""

from __future__ import annotations

import asyncio
import typing
from collections.abc import Callable


class Watch(asyncio.Protocol):
    """Forwards a routed connection's callbacks to its protocol and tells the mux when it closes."""

    def __init__(self, inner: asyncio.Protocol, on_lost: Callable[[], None]) -> None:
        self._inner = inner
        self._on_lost = on_lost

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self._inner.connection_lost(exc)  # first: the protocol may still report a rejection
        finally:
            self._on_lost()


class BufferedWatch(asyncio.BufferedProtocol):
    """:class:`Watch` for a protocol that reads into its own buffers (the data channel)."""

    def __init__(self, inner: asyncio.BufferedProtocol, on_lost: Callable[[], None]) -> None:
        self._inner = inner
        self._on_lost = on_lost

    def get_buffer(self, sizehint: int) -> memoryview:
        return typing.cast(memoryview, self._inner.get_buffer(sizehint))

    def buffer_updated(self, nbytes: int) -> None:
        self._inner.buffer_updated(nbytes)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self._inner.connection_lost(exc)
        finally:
            self._on_lost()


def watch(protocol: asyncio.BaseProtocol, on_lost: Callable[[], None]) -> asyncio.BaseProtocol:
    """A watcher around ``protocol`` that calls ``on_lost`` after its ``connection_lost``."""
    # Same read style as the protocol: a class that were both would be read as a plain Protocol by
    # uvloop.
    if isinstance(protocol, asyncio.BufferedProtocol):
        return BufferedWatch(protocol, on_lost)
    return Watch(typing.cast(asyncio.Protocol, protocol), on_lost)


def feed(protocol: asyncio.BaseProtocol, data: bytes) -> None:
    """Hand bytes the sniffer already read to a protocol, whichever read style it uses."""
    if isinstance(protocol, asyncio.BufferedProtocol):
        view = memoryview(data)
        while view:
            target = memoryview(protocol.get_buffer(len(view)))
            n = min(len(target), len(view))
            target[:n] = view[:n]
            protocol.buffer_updated(n)
            view = view[n:]
    else:
        typing.cast(asyncio.Protocol, protocol).data_received(data)
