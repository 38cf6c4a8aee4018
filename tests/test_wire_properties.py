"""Hypothesis properties of the codec: round trips, robustness to any bytes, tamper evidence."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flodl_async.errors import FrameTooLarge, IllegalKind, WireError
from flodl_async.wire import (
    Channel,
    Direction,
    FrameConnection,
    Side,
    new_session_secret,
    registered_kinds,
)
from flodl_async.wire import frame as frame_module
from flodl_async.wire import messages as m
from flodl_async.wire.frame import HEADER, FrameLimits
from flodl_async.wire.handshake import PROTOCOL_VERSION
from flodl_async.wire.legality import LEGAL_KINDS
from flodl_async.wire.schema import Message, pack_message

from .wirekit import codec_pair, drain, feed, feed_cut, handshake_keys, sealed, sender_and_receiver

SECRET = new_session_secret()
KEYS = handshake_keys(SECRET)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_text = st.text(max_size=20)
_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)


def _strategy_for(hint: typing.Any) -> st.SearchStrategy[typing.Any]:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is tuple:
        return st.lists(_strategy_for(args[0]), max_size=4).map(tuple)
    if origin is dict:
        return st.dictionaries(_text, _strategy_for(args[1]), max_size=4)
    if args and type(None) in args:
        inner = next(a for a in args if a is not type(None))
        return st.none() | _strategy_for(inner)
    if isinstance(hint, type) and issubclass(hint, Message):
        return _message_strategy(hint)
    return {
        str: _text,
        int: _ints,
        float: st.floats(allow_nan=False),
        bool: st.booleans(),
        bytes: st.binary(max_size=32),
    }[hint]


def _message_strategy(cls: type[Message]) -> st.SearchStrategy[Message]:
    hints = typing.get_type_hints(cls)
    fields = {f.name: _strategy_for(hints[f.name]) for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]  # retired positions are not settable
    return st.builds(cls, **fields)


any_message = st.sampled_from(sorted(registered_kinds().items())).flatmap(
    lambda item: _message_strategy(item[1])
)

Route = tuple[Channel, Direction]
#: Every (channel, direction) of the kind table, and those that carry at least one kind.
ROUTES: list[Route] = sorted(LEGAL_KINDS, key=lambda route: (route[0].value, route[1].value))
SPOKEN_ROUTES = [route for route in ROUTES if LEGAL_KINDS[route]]


def _legal_message(route: Route) -> st.SearchStrategy[Message]:
    return st.sampled_from(sorted(LEGAL_KINDS[route], key=lambda cls: cls.KIND)).flatmap(
        _message_strategy
    )


def _routed(min_size: int = 1, max_size: int = 5) -> st.SearchStrategy[tuple[Route, list[Message]]]:
    """A route and messages legal on it (what a correct sender may put on one connection)."""
    return st.sampled_from(SPOKEN_ROUTES).flatmap(
        lambda route: st.tuples(
            st.just(route), st.lists(_legal_message(route), min_size=min_size, max_size=max_size)
        )
    )


def _route_id(route: Route) -> str:
    return f"{route[0].value}-{route[1].value}"


@SETTINGS
@given(routed=_routed(), cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=6))
def test_every_message_type_round_trips_under_any_split(
    routed: tuple[Route, list[Message]], cuts: list[int]
) -> None:
    route, msgs = routed
    sender, receiver = sender_and_receiver(KEYS, *route)
    stream = b"".join(sender.send(msg) for msg in msgs)
    frames = feed_cut(receiver, stream, cuts)
    assert [f.message for f in frames] == msgs


@pytest.mark.parametrize("route", ROUTES, ids=_route_id)
@pytest.mark.parametrize(
    "cls", [cls for _kind, cls in sorted(registered_kinds().items())], ids=lambda cls: cls.__name__
)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_kind_table_is_enforced_on_every_channel_and_side(
    route: Route, cls: type[Message], data: st.DataObject
) -> None:
    """In the table: it round-trips. Not in it: the sender refuses it, and a forged frame is refused after its tag.

    Every (route, kind) pair is a case of its own, so none is left to chance; Hypothesis varies the contents.
    """
    msg = data.draw(_message_strategy(cls))
    sender, receiver = sender_and_receiver(KEYS, *route)
    if type(msg) in LEGAL_KINDS[route]:
        [frame] = feed(receiver, sender.send(msg))
        assert frame.message == msg
        return
    with pytest.raises(TypeError, match="may not be sent"):
        sender.send(msg)
    forged = sealed(KEYS, msg.KIND, pack_message(msg), direction=route[1])
    with pytest.raises(IllegalKind, match=f"{type(msg).__name__} .* not legal"):
        feed(receiver, forged)


@SETTINGS
@given(data=st.binary(max_size=512), eof=st.booleans())
def test_any_bytes_yield_frames_or_a_wire_error(data: bytes, eof: bool) -> None:
    _, controller = codec_pair(KEYS)
    try:
        controller.receive_data(data)
        if eof:
            controller.receive_data(b"")
        drain(controller)
    except WireError:
        pass


@SETTINGS
@given(data=st.binary(min_size=0, max_size=256))
def test_garbage_after_a_valid_header_prefix_is_a_wire_error(data: bytes) -> None:
    _, controller = codec_pair(KEYS)
    header = HEADER.pack(PROTOCOL_VERSION, 0, 0x0108, 0, len(data), 0)
    try:
        controller.receive_data(header + data + bytes(32))
        controller.receive_data(b"")
        drain(controller)
    except WireError:
        return
    raise AssertionError("a frame with a zero tag was accepted")


@SETTINGS
@given(routed=_routed(max_size=1), bit=st.integers(min_value=0))
def test_flipping_any_bit_is_rejected(routed: tuple[Route, list[Message]], bit: int) -> None:
    route, [msg] = routed
    sender, receiver = sender_and_receiver(KEYS, *route)
    frame = bytearray(sender.send(msg))
    position = bit % (len(frame) * 8)
    frame[position // 8] ^= 1 << (position % 8)
    try:
        receiver.receive_data(bytes(frame))
        receiver.receive_data(b"")
        frames = drain(receiver)
    except WireError:
        return
    raise AssertionError(f"tampered frame accepted: {frames}")


@SETTINGS
@given(routed=_routed(min_size=2, max_size=4), data=st.data())
def test_replayed_or_reordered_frames_are_rejected(
    routed: tuple[Route, list[Message]], data: st.DataObject
) -> None:
    route, msgs = routed
    sender, receiver = sender_and_receiver(KEYS, *route)
    frames = [sender.send(msg) for msg in msgs]
    order = data.draw(
        st.permutations(range(len(frames))).filter(lambda p: list(p) != sorted(p)) | st.just([0, 0])
    )
    try:
        for index in order:
            receiver.receive_data(frames[index])
            drain(receiver)
    except WireError:
        return
    raise AssertionError(f"order {order} accepted")


@SETTINGS
@given(channels=st.permutations(list(Channel)[:4]), data=st.data())
def test_cross_channel_and_reflected_frames_are_rejected(
    channels: list[Channel], data: st.DataObject
) -> None:
    msg = data.draw(_legal_message((channels[0], Direction.TO_CONTROLLER)))
    # One secret: the keys of each channel's connection come from that connection's own handshake.
    here, there = handshake_keys(SECRET, channels[0]), handshake_keys(SECRET, channels[1])
    sender = FrameConnection(
        channel=channels[0],
        side=Side.PEER,
        keys=here.peer,
        limits=FrameLimits(max_body=1 << 20, max_payload=0),
    )
    wire = sender.send(msg)
    for receiver in (
        FrameConnection(channel=channels[1], side=Side.CONTROLLER, keys=there.controller),
        FrameConnection(
            channel=channels[0], side=Side.PEER, keys=here.peer
        ),  # reflected back at a peer
    ):
        receiver.receive_data(wire)
        try:
            drain(receiver)
        except WireError:
            continue
        raise AssertionError("frame accepted on the wrong channel or direction")


@SETTINGS
@given(
    body_len=st.integers(min_value=1025, max_value=2**32 - 1),
    payload_len=st.integers(min_value=0, max_value=2**64 - 1),
)
def test_oversized_length_rejected_before_the_body(body_len: int, payload_len: int) -> None:
    controller = FrameConnection(
        channel=Channel.DATA,
        side=Side.CONTROLLER,
        keys=KEYS.controller,
        limits=FrameLimits(max_body=1024, max_payload=4096),
    )
    controller.receive_data(HEADER.pack(PROTOCOL_VERSION, 0, 0x0401, 0, body_len, payload_len))
    try:
        controller.next_frame()
    except FrameTooLarge:
        return
    raise AssertionError("oversized frame header accepted")


def _recording_nonces() -> tuple[list[bytes], typing.Callable[[int, int], bytes]]:
    made: list[bytes] = []
    real = frame_module.seal_nonce

    def recording(seq: int, index: int) -> bytes:
        nonce = real(seq, index)
        made.append(nonce)
        return nonce

    return made, recording


@SETTINGS
@given(
    frames=st.lists(
        st.lists(st.binary(max_size=300), max_size=4), min_size=1, max_size=8
    ),  # each frame's payload parts (tensors)
    chunk=st.integers(min_value=1, max_value=200),
)
def test_a_gcm_nonce_never_repeats_under_one_key(frames: list[list[bytes]], chunk: int) -> None:
    """Every nonce one sender makes (payload chunks, across part boundaries) is new, and all of it decrypts."""
    made, recording = _recording_nonces()
    keys = handshake_keys(SECRET, Channel.DATA)
    limits = FrameLimits(max_payload=1 << 16)
    sender = FrameConnection(
        channel=Channel.DATA, side=Side.PEER, keys=keys.peer, limits=limits, seal_chunk=chunk
    )
    receiver = FrameConnection(
        channel=Channel.DATA,
        side=Side.CONTROLLER,
        keys=keys.controller,
        limits=limits,
        seal_chunk=chunk,
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(frame_module, "seal_nonce", recording)
        stream = b"".join(
            bytes(piece)
            for parts in frames
            for piece in sender.send_parts(
                m.Contribution(round=0, kind="model", rank=0, weight=1.0, steps=1), parts
            )
        )
        sent = list(made)
        received = feed(receiver, stream)
    assert [bytes(f.payload or b"") for f in received] == [b"".join(parts) for parts in frames]
    assert len(sent) == len(set(sent)), "a nonce was used twice under one key"
    assert made[len(sent) :] == sent  # the receiver rebuilt exactly the sender's nonces


@SETTINGS
@given(
    msgs=st.lists(_legal_message((Channel.JOIN, Direction.FROM_CONTROLLER)), min_size=1, max_size=8)
)
def test_sealed_body_nonces_never_repeat_either(msgs: list[Message]) -> None:
    made, recording = _recording_nonces()
    sender, receiver = sender_and_receiver(KEYS, Channel.JOIN, Direction.FROM_CONTROLLER)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(frame_module, "seal_nonce", recording)
        stream = b"".join(sender.send(msg) for msg in msgs)
        sent = list(made)
        assert [f.message for f in feed(receiver, stream)] == msgs
    assert len(sent) == sum(msg.SEALED for msg in msgs) == len(set(sent))


@SETTINGS
@given(routed=_routed(), chunk=st.integers(min_value=1, max_value=64))
def test_sealed_bodies_round_trip_and_hide_their_contents(
    routed: tuple[Route, list[Message]], chunk: int
) -> None:
    route, msgs = routed
    sender, receiver = sender_and_receiver(KEYS, *route)
    for msg in msgs:
        wire = sender.send(msg)
        if msg.SEALED:
            assert pack_message(msg) not in wire  # the msgpack body never travels in clear
        [frame] = feed(receiver, wire)
        assert frame.message == msg
