"""Hypothesis properties of the codec: round trips, robustness to any bytes, tamper evidence."""

from __future__ import annotations

import dataclasses
import typing

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flodl_async.errors import FrameTooLarge, WireError
from flodl_async.wire import Channel, FrameConnection, SessionKeys, Side, new_session_secret, registered_kinds
from flodl_async.wire.frame import HEADER, PROTOCOL_VERSION, FrameLimits
from flodl_async.wire.schema import Message

from .wirekit import codec_pair, drain, feed_cut

KEYS = SessionKeys.derive(new_session_secret(), "prop-run")
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
    fields = {f.name: _strategy_for(hints[f.name]) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return st.builds(cls, **fields)


any_message = st.sampled_from(sorted(registered_kinds().items())).flatmap(lambda item: _message_strategy(item[1]))


@SETTINGS
@given(msgs=st.lists(any_message, min_size=1, max_size=5), cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=6))
def test_every_message_type_round_trips_under_any_split(msgs: list[Message], cuts: list[int]) -> None:
    peer, controller = codec_pair(KEYS)
    stream = b"".join(peer.send(msg) for msg in msgs)
    frames = feed_cut(controller, stream, cuts)
    assert [f.message for f in frames] == msgs


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
@given(msg=any_message, bit=st.integers(min_value=0))
def test_flipping_any_bit_is_rejected(msg: Message, bit: int) -> None:
    peer, controller = codec_pair(KEYS)
    frame = bytearray(peer.send(msg))
    position = bit % (len(frame) * 8)
    frame[position // 8] ^= 1 << (position % 8)
    try:
        controller.receive_data(bytes(frame))
        controller.receive_data(b"")
        frames = drain(controller)
    except WireError:
        return
    raise AssertionError(f"tampered frame accepted: {frames}")


@SETTINGS
@given(msgs=st.lists(any_message, min_size=2, max_size=4), data=st.data())
def test_replayed_or_reordered_frames_are_rejected(msgs: list[Message], data: st.DataObject) -> None:
    peer, controller = codec_pair(KEYS)
    frames = [peer.send(msg) for msg in msgs]
    order = data.draw(st.permutations(range(len(frames))).filter(lambda p: list(p) != sorted(p)) | st.just([0, 0]))
    try:
        for index in order:
            controller.receive_data(frames[index])
            drain(controller)
    except WireError:
        return
    raise AssertionError(f"order {order} accepted")


@SETTINGS
@given(msg=any_message, channels=st.permutations(list(Channel)[:4]))
def test_cross_channel_and_reflected_frames_are_rejected(msg: Message, channels: list[Channel]) -> None:
    sender = FrameConnection(channel=channels[0], side=Side.PEER, keys=KEYS, limits=FrameLimits(max_body=1 << 20, max_payload=0))
    wire = sender.send(msg)
    for receiver in (
        FrameConnection(channel=channels[1], side=Side.CONTROLLER, keys=KEYS),
        FrameConnection(channel=channels[0], side=Side.PEER, keys=KEYS),  # reflected back at a peer
    ):
        receiver.receive_data(wire)
        try:
            drain(receiver)
        except WireError:
            continue
        raise AssertionError("frame accepted on the wrong channel or direction")


@SETTINGS
@given(body_len=st.integers(min_value=1025, max_value=2**32 - 1), payload_len=st.integers(min_value=0, max_value=2**64 - 1))
def test_oversized_length_rejected_before_the_body(body_len: int, payload_len: int) -> None:
    controller = FrameConnection(channel=Channel.DATA, side=Side.CONTROLLER, keys=KEYS, limits=FrameLimits(max_body=1024, max_payload=4096))
    controller.receive_data(HEADER.pack(PROTOCOL_VERSION, 0, 0x0401, 0, body_len, payload_len))
    try:
        controller.next_frame()
    except FrameTooLarge:
        return
    raise AssertionError("oversized frame header accepted")
