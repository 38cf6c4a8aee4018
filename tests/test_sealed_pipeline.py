"""Large payloads as a pipeline: sealed chunk by chunk while earlier chunks are written, opened as they arrive.

The codec tests cover chunking with tiny chunks; these use the real ``SEAL_CHUNK`` (payloads of
several chunks, split across tensors) through the asyncio shell's streaming send on loopback TCP,
and check that opening chunks early changes neither what is delivered nor which error is raised.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import uvloop

from flodl_async.errors import AuthenticationFailed
from flodl_async.net.framed import FramedProtocol, open_framed
from flodl_async.net.mux import PortMux
from flodl_async.net.service import FramedService
from flodl_async.wire import Channel, Credential, Direction
from flodl_async.wire import messages as m
from flodl_async.wire.frame import GCM_TAG_LEN, HEADER_LEN, SEAL_CHUNK, FrameLimits, chunk_count
from flodl_async.wire.handshake import session_resolver

from .wirekit import feed_buffered, handshake_keys, sender_and_receiver

# Three tensors whose boundaries fall inside chunks, and a last chunk that is not full.
_PARTS = (SEAL_CHUNK + 3, 2 * SEAL_CHUNK - 7, 1001)
_TOTAL = sum(_PARTS)


def _up(round: int) -> m.Contribution:
    return m.Contribution(round=round, kind="model", rank=0, weight=1.0, steps=1)


def _down(round: int) -> m.Consensus:
    return m.Consensus(round=round, kind="model", mass=1.0)


def test_multi_chunk_payloads_go_both_ways_intact_over_tcp(secret: bytes) -> None:
    """The client's streamed, chunk-sealed frames reach the server whole; the server echoes each back the same way."""
    assert chunk_count(_TOTAL) == 4
    frames = [[os.urandom(n) for n in _PARTS] for _ in range(3)]
    limits = FrameLimits(max_payload=_TOTAL)

    async def echo(link: FramedProtocol) -> None:
        while True:
            frame = await link.recv()
            assert frame.payload is not None
            await link.send_tensors(_down(frame.message.round), [frame.payload])  # type: ignore[attr-defined]

    async def main() -> list[bytes]:
        back: list[bytes] = []
        mux = PortMux(host="127.0.0.1", port=0)
        try:
            async with asyncio.timeout(60):
                async with asyncio.TaskGroup() as tg:
                    service = FramedService(
                        channel=Channel.DATA,
                        resolve=session_resolver(secret),
                        run_id="r",
                        handler=echo,
                        task_group=tg,
                        limits=limits,
                    )
                    mux.register(Channel.DATA, service.protocol_factory)
                    await mux.start()
                    link = await open_framed(
                        "127.0.0.1",
                        mux.port,
                        channel=Channel.DATA,
                        credential=Credential.session(secret),
                        limits=limits,
                    )
                    try:
                        for i, parts in enumerate(frames):
                            await link.send_tensors(_up(i), parts)
                        for _ in frames:
                            frame = await link.recv()
                            back.append(bytes(frame.payload or b""))
                    finally:
                        link.abort()
                    await mux.aclose()
        finally:
            await mux.aclose()
        return back

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        back = runner.run(main())
    assert back == [b"".join(parts) for parts in frames]


def _one_frame(secret: bytes) -> tuple[bytes, bytes, object]:
    keys = handshake_keys(secret, Channel.DATA)
    limits = FrameLimits(max_payload=_TOTAL)
    sender, receiver = sender_and_receiver(keys, Channel.DATA, Direction.TO_CONTROLLER, limits)
    payload = os.urandom(_TOTAL)
    wire = b"".join(bytes(p) for p in sender.send_parts(_up(0), [payload]))
    return wire, payload, receiver


@pytest.mark.parametrize(
    "read",
    [64 * 1024, SEAL_CHUNK + 5, None],
    ids=["small reads", "reads across chunks", "one read"],
)
def test_chunks_opened_as_they_arrive_deliver_the_payload(secret: bytes, read: int | None) -> None:
    wire, payload, receiver = _one_frame(secret)
    (frame,) = feed_buffered(receiver, wire, chunk=read)  # type: ignore[arg-type]
    assert bytes(frame.payload or b"") == payload


def test_a_tampered_chunk_fails_its_gcm_tag_once_the_frame_verified(secret: bytes) -> None:
    """Chunk 2's ciphertext is flipped: the frame's HMAC (over the tags) still verifies, GCM does not."""
    wire, _payload, receiver = _one_frame(secret)
    body_len = int.from_bytes(wire[12:16], "little")
    at = HEADER_LEN + body_len + 2 * (SEAL_CHUNK + GCM_TAG_LEN) + 10
    spoiled = wire[:at] + bytes([wire[at] ^ 1]) + wire[at + 1 :]
    with pytest.raises(AuthenticationFailed, match="payload chunk 2 did not decrypt"):
        feed_buffered(receiver, spoiled, chunk=64 * 1024)  # type: ignore[arg-type]


def test_a_tampered_header_is_still_reported_by_the_frame_tag_first(secret: bytes) -> None:
    """Every chunk fails GCM too (the header is their associated data), but the HMAC check comes first."""
    wire, _payload, receiver = _one_frame(secret)
    seq_byte = (
        4  # the sequence number: same lengths, so the whole frame is read before any check fails
    )
    spoiled = wire[:seq_byte] + bytes([wire[seq_byte] ^ 1]) + wire[seq_byte + 1 :]
    with pytest.raises(AuthenticationFailed, match="frame tag did not verify"):
        feed_buffered(receiver, spoiled, chunk=64 * 1024)  # type: ignore[arg-type]
