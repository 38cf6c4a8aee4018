"""Pure codec tests: every input fed whole and one byte at a time."""

from __future__ import annotations

import struct

import pytest

from flodl_async.errors import (
    AuthenticationFailed,
    FrameTooLarge,
    IllegalKind,
    MalformedBody,
    ReservedFlags,
    SequenceError,
    TruncatedFrame,
    UnknownKind,
    VersionMismatch,
    WireError,
)
from flodl_async.wire import (
    CLOSED,
    NEED_DATA,
    Channel,
    Direction,
    FrameConnection,
    Side,
    new_session_secret,
)
from flodl_async.wire import messages as m
from flodl_async.wire import storeowner as so
from flodl_async.wire.frame import HEADER, HEADER_LEN, TAG_LEN, Frame, FrameLimits
from flodl_async.wire.handshake import PROTOCOL_VERSION
from flodl_async.wire.legality import LEGAL_KINDS
from flodl_async.wire.restarts import RestartRank
from flodl_async.wire.scalars import Report
from flodl_async.wire.schema import Message, pack_message

from .trainerwire import CONTROL_DOWN, CONTROL_UP
from .wirekit import (
    WHOLE_AND_BYTEWISE,
    LinkPair,
    codec_pair,
    feed,
    handshake_keys,
    sealed,
    sender_and_receiver,
)

UP, DOWN = Direction.TO_CONTROLLER, Direction.FROM_CONTROLLER

#: Samples of every kind in the kind table, by the route each may travel (data: see test_wire_tensor).
SAMPLES: dict[tuple[Channel, Direction], list[Message]] = {
    (Channel.JOIN, UP): [
        m.JoinHello(host="node-a", devices=("cpu:0", "cpu:1"), pid=42, agent_version="0.1"),
        m.RankExited(
            round=0, rank=3, local_rank=1, host="b", exit_code=None, signal=9, stderr_tail=("boom",)
        ),
        m.RankOutput(attempt=1, rank=3, stream="out", data=b" 10%|#\r 20%|##"),
        m.RanksStopped(round=2),
        m.RankStats(
            round=1,
            ranks=(
                m.RankActivity(
                    rank=3,
                    pid=99,
                    uptime_s=12.0,
                    state="S",
                    cpu_percent=0.5,
                    last_line="epoch 1",
                    output_age_s=3.5,
                    quiet_s=3.5,
                ),
            ),
        ),
        m.Heartbeat(sent_at=12.5, rank=1),
        so.StoreOwnerAnswer(query=7, standing="store_foreign_uid", detail="uid 65534 (nobody)"),
    ],
    (Channel.JOIN, DOWN): [
        m.JoinAccept(ranks=(0, 1), run_id="r", formation_wait_s=30.0),
        m.JoinReject(reason="duplicate host"),
        m.WorldFormed(
            world_size=4,
            ranks=(2, 3),
            group_rank=1,
            group_world_size=2,
            store_host=False,
            command=("python", "t.py"),
            env={"A": "1"},
        ),
        m.OpenRound(round=1),
        m.StartRanks(round=0, restart_count=0, master_addr="10.0.0.1", master_port=29500),
        m.StopRanks(round=0, reason="restart", grace_s=1.0),
        RestartRank(round=0, rank=1, incarnation=1),
        m.Abort(reason="interrupted"),
        m.Finish(),
        m.SignalRanks(signal=10),
        m.Abort(reason="rank 3 failed", exit_code=4),
        m.Heartbeat(sent_at=12.5),
        so.StoreOwnerQuery(
            query=7, peer_host="10.0.0.2", peer_port=41000, our_host="10.0.0.1", our_port=29400
        ),
    ],
    (Channel.RENDEZVOUS, UP): [
        m.RendezvousHello(host="node-a"),
        m.StoreAddress(round=1, host="10.0.0.1", port=40000),
    ],
    (Channel.CONTROL, UP): [
        m.RankHello(rank=1, local_rank=1, world_size=2, pid=7),
        m.Heartbeat(sent_at=1.0, rank=1),
        Report(rank=1, scalars={"loss": 0.25, "lr": 1e-3}),
        *CONTROL_UP,
    ],
    (Channel.CONTROL, DOWN): [
        m.RankWelcome(rank=1, run_id="r"),
        m.Heartbeat(sent_at=1.0, rank=1),
        *CONTROL_DOWN,
    ],
}


def test_the_samples_cover_the_kind_table() -> None:
    covered = {route: {type(msg) for msg in msgs} for route, msgs in SAMPLES.items()}
    for route, kinds in LEGAL_KINDS.items():
        if route[0] is not Channel.DATA:
            assert covered.get(route, set()) == kinds, route


@pytest.mark.parametrize(
    "route", list(SAMPLES), ids=lambda route: f"{route[0].value}-{route[1].value}"
)
@WHOLE_AND_BYTEWISE
def test_every_sample_round_trips_in_one_stream(
    keys: LinkPair, route: tuple[Channel, Direction], chunk: int | None
) -> None:
    sender, receiver = sender_and_receiver(keys, *route)
    samples = SAMPLES[route]
    stream = b"".join(sender.send(msg) for msg in samples)
    frames = feed(receiver, stream, chunk=chunk)
    assert [f.message for f in frames] == samples
    assert [f.seq for f in frames] == list(range(len(samples)))
    receiver.receive_data(b"")
    assert receiver.next_frame() is CLOSED


def test_need_data_until_the_last_byte(keys: LinkPair) -> None:
    peer, controller = codec_pair(keys)
    data = peer.send(m.Heartbeat(sent_at=3.0))
    controller.receive_data(data[:-1])
    assert controller.next_frame() is NEED_DATA
    controller.receive_data(data[-1:])
    frame = controller.next_frame()
    assert isinstance(frame, Frame)
    assert frame.message == m.Heartbeat(sent_at=3.0)


@WHOLE_AND_BYTEWISE
def test_both_directions_use_their_own_keys(keys: LinkPair, chunk: int | None) -> None:
    peer, controller = codec_pair(keys, channel=Channel.JOIN)
    down = controller.send(m.Abort(reason="stop"))
    [frame] = feed(peer, down, chunk=chunk)
    assert frame.message == m.Abort(reason="stop")


def test_reflected_frame_is_rejected(keys: LinkPair) -> None:
    peer, _controller = codec_pair(keys)
    own = peer.send(m.Heartbeat(sent_at=1.0))
    other_peer = FrameConnection(channel=Channel.CONTROL, side=Side.PEER, keys=keys.peer)
    other_peer.receive_data(own)  # a peer receives its own direction's frame
    with pytest.raises(AuthenticationFailed, match="did not verify"):
        other_peer.next_frame()


def test_frames_of_another_connection_are_rejected(secret: bytes) -> None:
    # Same secret, same channel, same run: only the handshake nonces differ.
    first, second = handshake_keys(secret), handshake_keys(secret)
    peer, _ = codec_pair(first)
    _, other_controller = codec_pair(second)
    other_controller.receive_data(peer.send(m.Heartbeat(sent_at=1.0)))
    with pytest.raises(AuthenticationFailed, match="did not verify"):
        other_controller.next_frame()


def test_frames_of_another_channel_are_rejected(secret: bytes) -> None:
    join_peer, _ = codec_pair(handshake_keys(secret, Channel.JOIN), channel=Channel.JOIN)
    _, control = codec_pair(handshake_keys(secret, Channel.CONTROL))
    control.receive_data(join_peer.send(m.Heartbeat(sent_at=1.0)))
    with pytest.raises(AuthenticationFailed):
        control.next_frame()


def test_frames_of_another_run_are_rejected(secret: bytes) -> None:
    peer, _ = codec_pair(handshake_keys(secret, run_id="run-1"))
    _, other = codec_pair(handshake_keys(secret, run_id="run-2"))
    other.receive_data(peer.send(m.Heartbeat(sent_at=1.0)))
    with pytest.raises(AuthenticationFailed):
        other.next_frame()


def test_frames_under_another_secret_are_rejected(keys: LinkPair) -> None:
    peer, _ = codec_pair(keys)
    _, stranger = codec_pair(handshake_keys(new_session_secret()))
    stranger.receive_data(peer.send(m.Heartbeat(sent_at=1.0)))
    with pytest.raises(AuthenticationFailed, match="did not verify"):
        stranger.next_frame()


def test_replayed_frame_is_rejected(keys: LinkPair) -> None:
    peer, controller = codec_pair(keys)
    first = peer.send(m.Heartbeat(sent_at=1.0))
    controller.receive_data(first + first)
    assert isinstance(controller.next_frame(), Frame)
    with pytest.raises(SequenceError, match="sequence 0, expected 1"):
        controller.next_frame()


def test_reordered_frames_are_rejected(keys: LinkPair) -> None:
    peer, controller = codec_pair(keys)
    first = peer.send(m.Heartbeat(sent_at=1.0))
    second = peer.send(m.Heartbeat(sent_at=2.0))
    controller.receive_data(second + first)
    with pytest.raises(SequenceError, match="sequence 1, expected 0"):
        controller.next_frame()


def test_failed_connection_stays_failed(keys: LinkPair) -> None:
    peer, controller = codec_pair(keys)
    data = bytearray(peer.send(m.Heartbeat(sent_at=1.0)))
    data[-1] ^= 1
    controller.receive_data(bytes(data))
    with pytest.raises(AuthenticationFailed):
        controller.next_frame()
    controller.receive_data(peer.send(m.Heartbeat(sent_at=2.0)))
    with pytest.raises(AuthenticationFailed, match="already failed"):
        controller.next_frame()


def test_oversized_body_rejected_from_the_header_alone(keys: LinkPair) -> None:
    _, controller = codec_pair(keys, limits=FrameLimits(max_body=1024))
    header = HEADER.pack(PROTOCOL_VERSION, 0, m.Heartbeat.KIND, 0, 1025, 0)
    controller.receive_data(header)  # no body bytes at all: the header alone must be enough
    with pytest.raises(FrameTooLarge, match="1025 bytes exceeds the 1024-byte ceiling"):
        controller.next_frame()


def test_payload_refused_on_channels_without_tensors(keys: LinkPair) -> None:
    _, controller = codec_pair(keys, channel=Channel.JOIN)
    controller.receive_data(HEADER.pack(PROTOCOL_VERSION, 0, m.Heartbeat.KIND, 0, 10, 1))
    with pytest.raises(FrameTooLarge, match="payload of 1 bytes"):
        controller.next_frame()


def test_sender_refuses_to_build_an_oversized_frame(keys: LinkPair) -> None:
    peer, _ = codec_pair(keys, channel=Channel.JOIN, limits=FrameLimits(max_body=64))
    with pytest.raises(FrameTooLarge):
        peer.send(m.JoinHello(host="x" * 100, devices=(), pid=1))


def test_version_mismatch_names_both_versions(keys: LinkPair) -> None:
    _, controller = codec_pair(keys)
    controller.receive_data(HEADER.pack(PROTOCOL_VERSION + 1, 0, 1, 0, 0, 0))
    with pytest.raises(VersionMismatch, match=f"v{PROTOCOL_VERSION + 1}.*v{PROTOCOL_VERSION}"):
        controller.next_frame()


def test_unknown_kind_after_authentication(keys: LinkPair) -> None:
    _, controller = codec_pair(keys)
    controller.receive_data(sealed(keys, 0xFFFE, b"\x80"))
    with pytest.raises(UnknownKind, match="0xfffe"):
        controller.next_frame()


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"\xc1", "not valid msgpack"),
        (b"\x81\xa1a\x01", "expected an array, got dict"),
        (b"\x91\x01", "required field 'reason' is missing"),
        (b"\x92\x01\x05", "expected str, got int"),
        (b"\x92\xa1x\xa1x", "schema version"),
        (b"\x90", "schema version"),
    ],
)
def test_malformed_bodies_are_named(keys: LinkPair, body: bytes, match: str) -> None:
    peer, _ = codec_pair(keys, channel=Channel.JOIN)
    peer.receive_data(sealed(keys, m.Abort.KIND, body, direction=DOWN))
    with pytest.raises(MalformedBody, match=match):
        peer.next_frame()


@WHOLE_AND_BYTEWISE
def test_reserved_flags_have_their_own_error(keys: LinkPair, chunk: int | None) -> None:
    peer, controller = codec_pair(keys)
    data = bytearray(peer.send(m.Heartbeat(sent_at=1.0)))
    data[1] = 0x80
    with pytest.raises(ReservedFlags, match=r"reserved header flags 0x80 .*newer peer.*corrupt"):
        feed(controller, bytes(data), chunk=chunk)
    assert issubclass(ReservedFlags, WireError)  # so every shell closes the connection on it


@pytest.mark.parametrize("cut", [1, HEADER_LEN, HEADER_LEN + 3, -TAG_LEN, -1])
def test_eof_mid_frame_is_truncated(keys: LinkPair, cut: int) -> None:
    peer, controller = codec_pair(keys, channel=Channel.JOIN)
    data = peer.send(
        m.RankExited(round=0, rank=1, local_rank=1, host="node-a")
    )  # a body longer than 3 bytes
    controller.receive_data(data[:cut])
    assert controller.next_frame() is NEED_DATA
    controller.receive_data(b"")
    with pytest.raises(TruncatedFrame):
        controller.next_frame()


def test_newer_peer_extra_fields_are_ignored(keys: LinkPair) -> None:
    import msgpack

    body = msgpack.packb([2, "x", 3.5, 2, 4, [1, 2]])
    peer, _ = codec_pair(keys, channel=Channel.JOIN)
    peer.receive_data(sealed(keys, m.Abort.KIND, body, direction=DOWN))
    frame = peer.next_frame()
    assert isinstance(frame, Frame)
    assert frame.message == m.Abort(reason="x", grace_s=3.5, first_signal=2, exit_code=4)


def test_older_peer_missing_trailing_fields_take_defaults(keys: LinkPair) -> None:
    import msgpack

    peer, _ = codec_pair(keys, channel=Channel.JOIN)
    peer.receive_data(sealed(keys, m.Abort.KIND, msgpack.packb([1, "x"]), direction=DOWN))
    frame = peer.next_frame()
    assert isinstance(frame, Frame)
    assert frame.message == m.Abort(reason="x", grace_s=10.0)


def test_header_layout_is_stable() -> None:
    # Peers of different builds must agree on these 24 bytes; a change here is a protocol bump.
    assert HEADER_LEN == 24
    assert TAG_LEN == 32
    assert struct.calcsize("<BBHQIQ") == HEADER_LEN


def _good_then_tampered(peer: FrameConnection) -> tuple[list[m.RankExited], bytes]:
    good = [m.RankExited(round=0, rank=r, local_rank=r, host="a", exit_code=1) for r in range(2)]
    stream = b"".join(peer.send(msg) for msg in good)
    bad = bytearray(peer.send(m.Heartbeat(sent_at=1.0)))
    bad[-1] ^= 1
    return good, stream + bytes(bad)


def test_frames_delivers_the_good_prefix_then_stays_failed(keys: LinkPair) -> None:
    # Whole payload-less frames in one read: the fast _whole_frames path.
    peer, controller = codec_pair(keys, channel=Channel.JOIN)
    good, stream = _good_then_tampered(peer)
    controller.receive_data(stream)
    assert [f.message for f in controller.frames()] == good
    with pytest.raises(AuthenticationFailed, match="did not verify"):
        controller.frames()
    with pytest.raises(AuthenticationFailed, match="already failed"):
        controller.frames()
    with pytest.raises(AuthenticationFailed, match="already failed"):
        controller.next_frame()


def test_state_machine_path_delivers_the_good_prefix_too(keys: LinkPair) -> None:
    # Half a frame first: the rest of the read starts mid-frame, so the state machine decodes it.
    peer, controller = codec_pair(keys, channel=Channel.JOIN)
    good, stream = _good_then_tampered(peer)
    controller.receive_data(stream[:10])
    assert controller.frames() == []
    controller.receive_data(stream[10:])
    assert [f.message for f in controller.frames()] == good
    with pytest.raises(AuthenticationFailed, match="did not verify"):
        controller.frames()


def test_next_frame_delivers_the_good_prefix_one_at_a_time(keys: LinkPair) -> None:
    peer, controller = codec_pair(keys, channel=Channel.JOIN)
    good, stream = _good_then_tampered(peer)
    controller.receive_data(stream)
    for msg in good:
        frame = controller.next_frame()
        assert isinstance(frame, Frame)
        assert frame.message == msg
    with pytest.raises(AuthenticationFailed, match="did not verify"):
        controller.next_frame()


def test_a_contribution_does_not_decode_on_the_join_channel(keys: LinkPair) -> None:
    contribution = m.Contribution(round=0, kind="model", rank=0, weight=1.0, steps=1)
    _, controller = codec_pair(keys, channel=Channel.JOIN)
    controller.receive_data(sealed(keys, contribution.KIND, pack_message(contribution)))
    with pytest.raises(
        IllegalKind,
        match=r"join channel: the peer sent Contribution \(0x0306\), which is not legal",
    ):
        controller.frames()
    assert issubclass(IllegalKind, WireError)


@WHOLE_AND_BYTEWISE
def test_a_kind_legal_only_the_other_way_is_refused(keys: LinkPair, chunk: int | None) -> None:
    # Abort is legal on the join channel, but only from the controller.
    _, controller = codec_pair(keys, channel=Channel.JOIN)
    forged = sealed(keys, m.Abort.KIND, pack_message(m.Abort(reason="x")), direction=UP)
    with pytest.raises(IllegalKind, match="the peer sent Abort"):
        feed(controller, forged, chunk=chunk)


def test_the_tag_is_checked_before_the_kind(keys: LinkPair) -> None:
    # An illegal kind under a bad tag is an authentication failure: unkeyed bytes learn nothing from the table.
    _, controller = codec_pair(keys, channel=Channel.JOIN)
    forged = bytearray(sealed(keys, m.Contribution.KIND, b"\x90"))
    forged[-1] ^= 1
    controller.receive_data(bytes(forged))
    with pytest.raises(AuthenticationFailed):
        controller.frames()


def test_the_kind_is_checked_before_the_body(keys: LinkPair) -> None:
    _, controller = codec_pair(keys, channel=Channel.CONTROL)
    controller.receive_data(
        sealed(keys, m.Abort.KIND, b"\xc1")
    )  # not msgpack: the kind is refused first
    with pytest.raises(IllegalKind):
        controller.next_frame()


def test_sending_an_illegal_kind_is_a_type_error_and_takes_no_sequence_number(
    keys: LinkPair,
) -> None:
    peer, controller = codec_pair(keys, channel=Channel.JOIN)
    with pytest.raises(TypeError, match="Abort may not be sent by the peer on the join channel"):
        peer.send(m.Abort(reason="x"))
    with pytest.raises(
        TypeError, match="Contribution may not be sent by the peer on the join channel"
    ):
        peer.send_parts(m.Contribution(round=0, kind="model", rank=0, weight=1.0, steps=1), [])
    [frame] = feed(controller, peer.send(m.RanksStopped(round=1)))
    assert frame.seq == 0


def test_rank_output_is_sealed_on_the_wire(keys: LinkPair) -> None:
    """What a rank prints often holds secrets: RankOutput's body is encrypted, not only authenticated."""
    sender, receiver = sender_and_receiver(keys, Channel.JOIN, UP)
    msg = m.RankOutput(attempt=0, rank=1, stream="err", data=b"HF_TOKEN=hf_secret_value\n")
    frame = sender.send(msg)
    assert b"hf_secret_value" not in frame
    assert b"err" not in frame
    assert [f.message for f in feed(receiver, frame)] == [msg]
