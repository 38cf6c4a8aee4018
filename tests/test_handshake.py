"""The per-connection handshake, sans-IO: what each check defeats, one test per attack."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flodl_async.errors import (
    AuthenticationFailed,
    HandshakeCut,
    HandshakeFailed,
    HandshakeRefused,
    VersionMismatch,
    WireError,
)
from flodl_async.wire import (
    Channel,
    ClientHandshake,
    Credential,
    CredentialKind,
    FrameConnection,
    PeerHello,
    ServerHandshake,
    Side,
    new_session_secret,
)
from flodl_async.wire import messages as m
from flodl_async.wire.handshake import (
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Established,
    Step,
    session_resolver,
)


def _client(secret: bytes, channel: Channel = Channel.JOIN, **kw: object) -> ClientHandshake:
    return ClientHandshake(
        channel=channel, credential=Credential.session(secret), version="1.2.3", **kw
    )  # type: ignore[arg-type]


def _server(
    secret: bytes, channel: Channel = Channel.JOIN, *, run_id: str = "run-a"
) -> ServerHandshake:
    return ServerHandshake(
        channel=channel, resolve=session_resolver(secret), run_id=run_id, version="1.2.3"
    )


def _established(step: Step) -> Established:
    assert step.established is not None
    return step.established


def _connect(
    client: ClientHandshake, server: ServerHandshake
) -> tuple[Established, Established, bytes]:
    """Run both sides to the end; returns both outcomes and every byte the client sent."""
    hello = client.hello()
    server_hello = server.receive_data(hello)
    assert server_hello.failure is None
    proof = client.receive_data(server_hello.send)
    done = server.receive_data(proof.send)
    return _established(proof), _established(done), hello + proof.send


def test_both_sides_derive_the_same_keys_and_learn_the_run(secret: bytes) -> None:
    client_side, server_side, _ = _connect(_client(secret), _server(secret))
    assert client_side.keys.send_mac == server_side.keys.recv_mac
    assert client_side.keys.send_aead == server_side.keys.recv_aead
    assert client_side.keys.recv_aead == server_side.keys.send_aead
    assert (
        len(
            {
                client_side.keys.send_mac,
                client_side.keys.recv_mac,
                client_side.keys.send_aead,
                client_side.keys.recv_aead,
            }
        )
        == 4
    )
    assert client_side.run_id == server_side.run_id == "run-a"
    assert server_side.peer == PeerHello(
        kind=CredentialKind.SESSION, round=0, rank=-1, version="1.2.3"
    )


def test_recorded_client_bytes_fail_on_a_new_connection(secret: bytes) -> None:
    """Attack 1 and 2 at the handshake: a later connection's server nonce makes a recorded proof worthless."""
    _, _, recorded = _connect(_client(secret), _server(secret))
    later = _server(
        secret
    )  # a new connection of the same run, or of a later run with the same secret
    hello_len = len(_client(secret).hello())
    step = later.receive_data(recorded[:hello_len])
    assert step.send  # it answers the (clear) hello with its own fresh nonce
    with pytest.raises(AuthenticationFailed, match="recorded from an earlier connection"):
        later.receive_data(recorded[hello_len:])


def test_recorded_server_bytes_fail_on_a_new_connection(secret: bytes) -> None:
    """The other way round: a replayed server hello does not verify for a client with a fresh nonce."""
    first = _client(secret)
    recorded = _server(secret).receive_data(first.hello()).send
    with pytest.raises(AuthenticationFailed, match="handshake proof did not verify"):
        _client(secret).receive_data(recorded)


def test_a_server_without_the_secret_cannot_prove_itself(secret: bytes) -> None:
    client = _client(secret)
    impostor = _server(new_session_secret())
    with pytest.raises(AuthenticationFailed, match="another session secret"):
        client.receive_data(impostor.receive_data(client.hello()).send)


def test_a_client_without_the_secret_cannot_prove_itself(secret: bytes) -> None:
    server = _server(secret)
    stranger = _client(new_session_secret())
    server_hello = server.receive_data(stranger.hello())
    with pytest.raises(AuthenticationFailed):
        stranger.receive_data(server_hello.send)  # the stranger sees the server's proof fail...
    with pytest.raises(AuthenticationFailed, match="proof did not verify"):
        server.receive_data(bytes(32))  # ...and whatever it sends as a proof fails at the server


def test_keys_are_bound_to_the_channel(secret: bytes) -> None:
    """A client of the join channel against a control-channel server: the proofs differ."""
    client = _client(secret, Channel.JOIN)
    server = _server(secret, Channel.CONTROL)
    with pytest.raises(AuthenticationFailed):
        client.receive_data(server.receive_data(client.hello()).send)


@pytest.mark.parametrize(
    "offset", [5, 36, 40, 44, 46]
)  # nonce, round, rank, version length, version
def test_editing_the_clear_hello_breaks_both_proofs(secret: bytes, offset: int) -> None:
    """A man in the middle who changes any byte of the client's hello (scope, version) is caught."""
    client, server = _client(secret), _server(secret)
    hello = bytearray(client.hello())
    hello[offset] ^= 0x01
    try:
        step = server.receive_data(bytes(hello))
    except HandshakeFailed:
        return  # a malformed edit (the version string's length): refused outright
    with pytest.raises(AuthenticationFailed):
        client.receive_data(step.send)


def test_a_peer_of_another_protocol_version_is_told_so_in_clear(secret: bytes) -> None:
    server = _server(secret)
    old = struct.pack("<BBH", 1, 0, 0x0101) + bytes(
        20
    )  # a v1 peer: its first frame header, no handshake
    step = server.receive_data(old)
    assert isinstance(step.failure, VersionMismatch)
    assert "v1 (a flodl_async that predates the handshake)" in str(step.failure)
    assert f"speaks v{PROTOCOL_VERSION}" in str(step.failure)
    # The refusal travels in clear, so a client of this version reads it as a version mismatch too.
    assert b"predates the handshake" in step.send


def test_a_client_reads_a_newer_servers_version_as_a_version_mismatch(secret: bytes) -> None:
    client = _client(secret)
    newer = PROTOCOL_VERSION + 1
    with pytest.raises(
        VersionMismatch,
        match=rf"server speaks wire protocol v{newer}, this build speaks v{PROTOCOL_VERSION}",
    ):
        client.receive_data(struct.pack("<BBH", newer, 0, 4) + bytes(4))


def test_a_refusal_reaches_the_client_with_its_reason(secret: bytes) -> None:
    client = ClientHandshake(
        channel=Channel.CONTROL,
        credential=Credential.for_rank(secret, run_id="r", round=0, rank=1),
        version="1.2.3",
    )
    step = _server(secret, Channel.CONTROL).receive_data(client.hello())
    assert isinstance(step.failure, HandshakeRefused)
    with pytest.raises(
        HandshakeRefused,
        match="rank credential is not accepted here: the controller port takes the session secret only",
    ):
        client.receive_data(step.send)


def test_a_client_for_another_run_stops_at_the_run_id(secret: bytes) -> None:
    client = _client(secret, expect_run_id="run-b")
    with pytest.raises(HandshakeRefused, match="runs 'run-a', this side was started for 'run-b'"):
        client.receive_data(_server(secret).receive_data(client.hello()).send)


def test_an_unknown_credential_kind_is_refused_by_name(secret: bytes) -> None:
    hello = bytearray(_client(secret).hello())
    hello[1] = 9
    step = _server(secret).receive_data(bytes(hello))
    assert isinstance(step.failure, HandshakeRefused)
    assert "unknown credential kind 9" in str(step.failure)


def test_an_oversized_hello_fails_from_its_length_alone(secret: bytes) -> None:
    with pytest.raises(HandshakeFailed, match="announces 60000 bytes"):
        _server(secret).receive_data(struct.pack("<BBH", PROTOCOL_VERSION, 1, 60000))


def test_bytes_before_the_servers_hello_are_refused(secret: bytes) -> None:
    """A client cannot know its proof before the server's nonce: anything sent that early is not one."""
    with pytest.raises(HandshakeFailed, match="before the server's hello"):
        _server(secret).receive_data(_client(secret).hello() + bytes(32))


def test_a_close_mid_handshake_says_what_it_may_mean(secret: bytes) -> None:
    client = _client(secret)
    # its own type: an agent dials again on it (an eviction), never on a malformed hello
    with pytest.raises(
        HandshakeCut,
        match=r"closed the connection during the handshake .* refused or evicted it",
    ):
        client.receive_data(b"")


def test_the_first_frames_after_the_proof_are_handed_over(secret: bytes) -> None:
    client, server = _client(secret, Channel.CONTROL), _server(secret, Channel.CONTROL)
    server_hello = server.receive_data(client.hello())
    proof = client.receive_data(server_hello.send)
    peer = FrameConnection(channel=Channel.CONTROL, side=Side.PEER, keys=_established(proof).keys)
    done = server.receive_data(
        proof.send + peer.send(m.Heartbeat(sent_at=1.0))
    )  # proof and frame in one read
    controller = FrameConnection(
        channel=Channel.CONTROL, side=Side.CONTROLLER, keys=_established(done).keys
    )
    controller.receive_data(_established(done).leftover)
    assert [f.message for f in controller.frames()] == [m.Heartbeat(sent_at=1.0)]


def test_fresh_nonces_every_time(secret: bytes) -> None:
    hellos = {_client(secret).hello()[4 : 4 + NONCE_BYTES] for _ in range(200)}
    assert len(hellos) == 200


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=256), cut=st.integers(min_value=0, max_value=256))
def test_any_bytes_give_a_step_or_a_wire_error(data: bytes, cut: int) -> None:
    server = _server(new_session_secret())
    try:
        for piece in (data[:cut], data[cut:]):
            if piece:
                step = server.receive_data(piece)
                if step.failure is not None or step.established is not None:
                    assert step.established is None  # nothing random can prove the key
                    return
    except WireError:
        return
