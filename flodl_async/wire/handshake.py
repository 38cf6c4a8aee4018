"""The per-connection handshake, sans-IO: fresh nonces from both sides, mutual proof, one key set
per connection.

Theory of operation. Every framed connection (after its channel magic, on the
controller port or a relay's unix socket) opens with three messages, before any
frame::

    client → server   ClientHello   (clear)
        u8  wire protocol version        u8  credential kind (session / rank / token)
        u16 length of what follows
        32  client nonce (fresh, random)
        u32 round, i32 rank              (the scope of a rank credential; 0, -1 otherwise)
        u8  length + flodl_async version of the client (utf-8, at most 64 bytes)

    server → client   ServerHello   (clear, then proved)
        u8  wire protocol version        u8  status (0 accept, 1 refuse)
        u16 length of what follows
        accept: 32 server nonce (fresh, random) · u8 length + run id · u8 length + server version
                · 32 server proof
        refuse: the reason, utf-8 (a version mismatch, a credential this endpoint does not take)

    client → server   ClientProof   32 client proof, then the client's first frames

With ``th = SHA-256(ClientHello ‖ ServerHello up to its proof)`` and the
credential key ``K`` (:mod:`.keys`), one HKDF-SHA256 call (salt: both nonces;
info: label, channel, ``th``) yields six 32-byte keys: the server proof key, the
client proof key, and an HMAC key and an AES-256-GCM key per direction. The
proofs are ``HMAC(proof key, th)``. The server builds no frame codec — so acts
on no message — until the client's proof verifies; the client sends no frame
until the server's proof verifies. The handshake costs the client one round trip.

What each check defeats:

* **Both nonces in the key derivation**: the keys of a connection exist for that
  connection only. Bytes recorded from any earlier connection — of this run or of
  an earlier run that used the same ``--secret-file`` — carry proofs and tags
  under keys that no later connection derives: a replayed join, ``RankExited``,
  ``RankHello`` or ``Heartbeat`` fails at the proof, before any message is read.
  Each side's own nonce protects it, so either side alone being honest suffices.
* **Proof before any message**: a peer without the key learns nothing beyond the
  ServerHello (nonce, run id, version: none secret) and can make nothing happen.
* **The transcript hash under both proofs**: a man in the middle who edits the
  clear hello (version, credential kind, rank scope, run id) makes both proofs fail.
* **Distinct keys per role and direction**: the server's proof does not verify
  as the client's (a reflected ServerHello fails), and frames reflected back at
  their sender fail their tag (:mod:`.frame`); the channel in the derivation info
  stops a connection's keys from being valid on another channel.
* **Credential kind and scope, checked by the server's resolver before it answers**:
  the controller takes the session secret, and a cluster token on its join channel
  only when token admission is on (:func:`join_resolver`); a relay
  takes only rank credentials, only for the ranks it runs in the round it runs,
  and derives the key from the claimed scope itself — so a rank credential proves
  exactly one (run, round, rank) and nothing on the controller port.
* **Versions in clear, first**: a peer of another wire protocol version is told so
  (:class:`~flodl_async.errors.VersionMismatch`, naming both versions) instead of
  meeting an authentication failure that would blame the secret.
* **Bounded, deadline-limited**: each message has a fixed ceiling, so a peer that
  talks past it fails at once; the mux gives the whole handshake a short deadline
  and caps unauthenticated connections (:mod:`flodl_async.net.admission`).

The cluster token (dial-in agents). A join link opened with a TOKEN credential
runs exactly this handshake with the token as ``K``: the token never crosses the
wire, the controller proves it holds the token before the agent proves anything,
and a wrong token fails at the agent with "the controller's proof did not verify: it
holds another cluster token, or it is not our controller" (an impostor fails the same way; and
at the controller, which sees the agent close instead of proving, it is counted as
``wrong_token`` in the admission counters). The run's session secret then reaches the agent
in ``JoinAccept.session_secret``, a sealed body (:mod:`.frame`): AES-256-GCM under this
connection's controller→agent key, which is the HKDF of the token with
both nonces as salt and the transcript in the info. So the secret is readable only
by a holder of the token, on this connection: without the token the key cannot be
derived; bytes recorded from this connection open on no other (the nonces differ)
and not in a later run (the secret differs, and the nonces again); the GCM nonce is
the frame's sequence number, never repeated under one key; and the GCM tag is bound
into the HMAC'd frame, so it cannot be swapped or edited. A session-secret join
gets an empty ``session_secret``: it holds the secret already.

Comparisons are constant-time (``hmac.compare_digest``). Any failure raises a
:class:`~flodl_async.errors.WireError` subclass; the I/O shell closes the
connection and, on the server, sends at most a ServerHello refusal.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..errors import (
    AuthenticationFailed,
    HandshakeCut,
    HandshakeFailed,
    HandshakeRefused,
    VersionMismatch,
    WireError,
    WrongToken,
)
from .channels import Channel
from .keys import KDF_LABEL, OPEN_ADMISSION_KEY, Credential, CredentialKind, LinkKeys

#: The wire protocol this build speaks (handshake and frame format together). v3: 4 MiB payload
#: chunks.
PROTOCOL_VERSION = 3
NONCE_BYTES = 32
PROOF_BYTES = 32
_KEY_BYTES = 32
_MAX_TEXT = 64  # versions and run ids
_MAX_REASON = 1024

_PREAMBLE = struct.Struct("<BBH")  # version, kind/status, length of what follows
_CLIENT_FIXED = struct.Struct("<32sIi")  # nonce, round, rank
_MAX_CLIENT_REST = _CLIENT_FIXED.size + 1 + _MAX_TEXT
_MAX_SERVER_REST = max(NONCE_BYTES + 2 * (1 + _MAX_TEXT) + PROOF_BYTES, _MAX_REASON)

_ACCEPT = 0
_REFUSE = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerHello:
    """What a server learns from a ClientHello, for its credential resolver to judge."""

    kind: CredentialKind
    round: int
    rank: int
    version: str


#: Returns the credential key the claimed ``PeerHello`` must hold, or raises
#: :class:`HandshakeRefused`.
CredentialResolver = Callable[[PeerHello], bytes]


@dataclass(frozen=True, slots=True, kw_only=True)
class Established:
    """The handshake is done: this connection's keys, who the peer is, and bytes that followed
    it."""

    keys: LinkKeys
    run_id: str
    peer: PeerHello
    #: Bytes the peer sent after the handshake (its first frames): feed them to the frame codec.
    leftover: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    """What one ``receive_data`` call produced: bytes to write, and the outcome once there is one.

    On the server, ``failure`` is set when the peer was refused: write ``send`` (the refusal),
    then close. Everywhere else a failure is raised.
    """

    send: bytes = b""
    established: Established | None = None
    failure: WireError | None = None


_NOTHING = Step()


def _text(raw: bytes, what: str) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise HandshakeFailed(f"handshake: the {what} is not utf-8") from None


def _short(text: str, what: str) -> bytes:
    raw = text.encode()
    if len(raw) > _MAX_TEXT:
        raise ValueError(f"{what} {text!r} is longer than {_MAX_TEXT} bytes")
    return raw


def _key_block(
    *, channel: Channel, key: bytes, client_nonce: bytes, server_nonce: bytes, transcript: bytes
) -> tuple[bytes, ...]:
    info = b"/".join(
        (KDF_LABEL, b"link", channel.value.encode(), hashlib.sha256(transcript).digest())
    )
    block = HKDF(
        algorithm=hashes.SHA256(),
        length=6 * _KEY_BYTES,
        salt=client_nonce + server_nonce,
        info=info,
    ).derive(key)
    return tuple(block[i : i + _KEY_BYTES] for i in range(0, len(block), _KEY_BYTES))


class _Reader:
    """Accumulates a bounded prefix of the stream and cuts length-prefixed messages off it."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def message(self, max_rest: int, what: str) -> tuple[int, int, bytes, bytes] | None:
        """(version, kind/status, whole message, body) once one whole message is buffered."""
        if len(self.buf) < _PREAMBLE.size:
            return None
        version, code, rest = _PREAMBLE.unpack_from(self.buf)
        if version != PROTOCOL_VERSION:
            return version, code, b"", b""  # the caller reports the version before anything else
        if rest > max_rest:
            raise HandshakeFailed(
                f"handshake: the {what} announces {rest} bytes, more than the {max_rest} it may "
                "have"
            )
        end = _PREAMBLE.size + rest
        if len(self.buf) < end:
            return None
        whole = bytes(self.buf[:end])
        del self.buf[:end]
        return version, code, whole, whole[_PREAMBLE.size :]


class ClientHandshake:
    """The connecting side: ``hello()`` first, then feed what the server sends until
    :class:`Established`."""

    def __init__(
        self,
        *,
        channel: Channel,
        credential: Credential,
        version: str,
        expect_run_id: str | None = None,
        nonce: bytes | None = None,
    ) -> None:
        self.channel = channel
        self._credential = credential
        self._expect_run_id = expect_run_id
        self._nonce = nonce if nonce is not None else secrets.token_bytes(NONCE_BYTES)
        body = _CLIENT_FIXED.pack(self._nonce, credential.round, credential.rank)
        version_raw = _short(version, "version")
        body += bytes([len(version_raw)]) + version_raw
        self._hello = _PREAMBLE.pack(PROTOCOL_VERSION, int(credential.kind), len(body)) + body
        self._reader = _Reader()
        self._done = False
        self._failed: WireError | None = None
        self.server_version = ""

    def hello(self) -> bytes:
        """The ClientHello, to write right after the channel magic."""
        return self._hello

    def receive_data(self, data: bytes) -> Step:
        """Feed bytes from the server; returns the proof to write and the keys once its ServerHello
        verified.

        A failure is for good: every later call raises it again.
        """
        if self._failed is not None:
            raise type(self._failed)(f"handshake already failed: {self._failed}")
        if self._done:
            raise RuntimeError("handshake already finished: feed later bytes to the frame codec")
        try:
            return self._receive(data)
        except WireError as exc:
            self._failed = exc
            raise

    def _receive(self, data: bytes) -> Step:
        if not data:
            raise HandshakeCut(
                f"{self.channel.value} channel: the server closed the connection during the "
                "handshake — it refused or "
                "evicted it (full, or shutting down), it is not a flodl controller or relay, or "
                "it runs a flodl_async "
                f"that does not speak wire protocol v{PROTOCOL_VERSION}"
            )
        self._reader.buf += data
        got = self._reader.message(_MAX_SERVER_REST, "server's hello")
        if got is None:
            return _NOTHING
        version, status, whole, body = got
        if version != PROTOCOL_VERSION:
            raise VersionMismatch(
                f"{self.channel.value} channel: the server speaks wire protocol v{version}, this "
                "build speaks "
                f"v{PROTOCOL_VERSION}; run the same flodl_async version on every host"
            )
        if status == _REFUSE:
            raise HandshakeRefused(
                f"{self.channel.value} channel: the server refused the connection: "
                f"{_text(body, 'refusal')}"
            )
        if status != _ACCEPT or len(body) < NONCE_BYTES + 2 + PROOF_BYTES:
            raise HandshakeFailed(
                f"{self.channel.value} channel: malformed server hello (status {status}, "
                f"{len(body)} bytes)"
            )
        server_nonce = body[:NONCE_BYTES]
        pos = NONCE_BYTES
        run_len = body[pos]
        run_id = _text(body[pos + 1 : pos + 1 + run_len], "run id")
        pos += 1 + run_len
        version_len = body[pos] if pos < len(body) else 0
        self.server_version = _text(body[pos + 1 : pos + 1 + version_len], "server version")
        pos += 1 + version_len
        proof = body[pos : pos + PROOF_BYTES]
        if pos + PROOF_BYTES != len(body):
            raise HandshakeFailed(
                f"{self.channel.value} channel: malformed server hello ({len(body)} bytes)"
            )
        transcript = self._hello + whole[: len(whole) - PROOF_BYTES]
        server_proof_key, client_proof_key, up_mac, down_mac, up_aead, down_aead = _key_block(
            channel=self.channel,
            key=self._credential.key,
            client_nonce=self._nonce,
            server_nonce=server_nonce,
            transcript=transcript,
        )
        if not hmac.compare_digest(hmac.digest(server_proof_key, transcript, "sha256"), proof):
            if self._credential.kind is CredentialKind.TOKEN:
                # An impostor answering at the controller's address fails exactly here too: the
                # agent cannot tell the two apart, so it names both.
                raise WrongToken(
                    f"{self.channel.value} channel: the controller's proof did not verify: it "
                    "holds another cluster token, or it is not our controller (check --token-file "
                    "and --controller)"
                )
            raise AuthenticationFailed(
                f"{self.channel.value} channel: the server's handshake proof did not verify — it "
                "holds another "
                "session secret (check --secret-file: use the controller's), or it is not the "
                "flodl controller you meant"
            )
        if self._expect_run_id is not None and run_id != self._expect_run_id:
            raise HandshakeRefused(
                f"{self.channel.value} channel: the controller runs {run_id!r}, this side was "
                f"started for {self._expect_run_id!r}"
            )
        self._done = True
        keys = LinkKeys(send_mac=up_mac, recv_mac=down_mac, send_aead=up_aead, recv_aead=down_aead)
        peer = PeerHello(
            kind=self._credential.kind,
            round=self._credential.round,
            rank=self._credential.rank,
            version=self.server_version,
        )
        established = Established(
            keys=keys, run_id=run_id, peer=peer, leftover=bytes(self._reader.buf)
        )
        return Step(
            send=hmac.digest(client_proof_key, transcript, "sha256"), established=established
        )


class _ServerState(enum.Enum):
    HELLO = 1
    PROOF = 2
    DONE = 3


class ServerHandshake:
    """The accepting side: feed what the client sends; write each :class:`Step`'s ``send``; stop at
    ``established`` or ``failure``."""

    def __init__(
        self,
        *,
        channel: Channel,
        resolve: CredentialResolver,
        run_id: str,
        version: str,
        nonce: bytes | None = None,
    ) -> None:
        self.channel = channel
        self._resolve = resolve
        self._run_id = _short(run_id, "run id")
        self._version = version
        self._version_raw = _short(version, "version")
        self._nonce = nonce if nonce is not None else secrets.token_bytes(NONCE_BYTES)
        self._reader = _Reader()
        self._state = _ServerState.HELLO
        self._expected_proof = b""
        self._keys: LinkKeys | None = None
        self._peer: PeerHello | None = None
        self._failed: WireError | None = None

    def receive_data(self, data: bytes) -> Step:
        """Feed bytes from the client (``b""`` for EOF). A failure, or a refusal, is for good."""
        if self._failed is not None:
            raise type(self._failed)(f"handshake already failed: {self._failed}")
        if self._state is _ServerState.DONE:
            raise RuntimeError("handshake already finished: feed later bytes to the frame codec")
        try:
            step = self._receive(data)
        except WireError as exc:
            self._failed = exc
            raise
        if step.failure is not None:
            self._failed = step.failure
        return step

    def _receive(self, data: bytes) -> Step:
        if not data:
            if (
                self._state is _ServerState.PROOF
                and self._peer is not None
                and self._peer.kind is CredentialKind.TOKEN
            ):
                # A token client closes without a proof exactly when ours did not verify under its
                # token.
                raise WrongToken(
                    f"{self.channel.value} channel: a dial-in agent refused this controller's "
                    "proof: it holds another "
                    "cluster token (check --token-file / controller.token_file on both sides)"
                )
            raise HandshakeFailed(
                f"{self.channel.value} channel: the peer closed during the handshake"
            )
        self._reader.buf += data
        if self._state is _ServerState.HELLO:
            return self._on_hello()
        if len(self._reader.buf) >= PROOF_BYTES:
            proof = bytes(self._reader.buf[:PROOF_BYTES])
            if not hmac.compare_digest(proof, self._expected_proof):
                raise AuthenticationFailed(
                    f"{self.channel.value} channel: the peer's handshake proof did not verify "
                    "(another session secret "
                    "or credential, or bytes recorded from an earlier connection)"
                )
            leftover = bytes(self._reader.buf[PROOF_BYTES:])
            self._state = _ServerState.DONE
            assert self._keys is not None
            assert self._peer is not None
            return Step(
                established=Established(
                    keys=self._keys,
                    run_id=self._run_id.decode(),
                    peer=self._peer,
                    leftover=leftover,
                )
            )
        return _NOTHING

    def _on_hello(self) -> Step:
        got = self._reader.message(_MAX_CLIENT_REST, "client's hello")
        if got is None:
            return _NOTHING
        version, kind_code, whole, body = got
        if version != PROTOCOL_VERSION:
            older = " (a flodl_async that predates the handshake)" if version == 1 else ""
            return self._refuse(
                VersionMismatch(
                    f"{self.channel.value} channel: the peer speaks wire protocol "
                    f"v{version}{older}, this build "
                    f"(flodl_async {self._version}) speaks v{PROTOCOL_VERSION}; run the same "
                    "flodl_async version on every host"
                )
            )
        if len(body) < _CLIENT_FIXED.size + 1:
            raise HandshakeFailed(
                f"{self.channel.value} channel: malformed client hello ({len(body)} bytes)"
            )
        nonce, round_, rank = _CLIENT_FIXED.unpack_from(body)
        version_len = body[_CLIENT_FIXED.size]
        if _CLIENT_FIXED.size + 1 + version_len != len(body):
            raise HandshakeFailed(
                f"{self.channel.value} channel: malformed client hello ({len(body)} bytes)"
            )
        peer_version = _text(body[_CLIENT_FIXED.size + 1 :], "client version")
        try:
            kind = CredentialKind(kind_code)
        except ValueError:
            return self._refuse(
                HandshakeRefused(
                    f"{self.channel.value} channel: unknown credential kind {kind_code}"
                )
            )
        peer = PeerHello(kind=kind, round=round_, rank=rank, version=peer_version)
        try:
            key = self._resolve(peer)
        except HandshakeRefused as exc:
            return self._refuse(exc)
        rest = (
            self._nonce
            + bytes([len(self._run_id)])
            + self._run_id
            + bytes([len(self._version_raw)])
            + self._version_raw
        )
        head = _PREAMBLE.pack(PROTOCOL_VERSION, _ACCEPT, len(rest) + PROOF_BYTES) + rest
        transcript = whole + head
        server_proof_key, client_proof_key, up_mac, down_mac, up_aead, down_aead = _key_block(
            channel=self.channel,
            key=key,
            client_nonce=nonce,
            server_nonce=self._nonce,
            transcript=transcript,
        )
        self._expected_proof = hmac.digest(client_proof_key, transcript, "sha256")
        self._keys = LinkKeys(
            send_mac=down_mac, recv_mac=up_mac, send_aead=down_aead, recv_aead=up_aead
        )
        self._peer = peer
        self._state = _ServerState.PROOF
        if self._reader.buf:
            # A client cannot compute its proof before it has our nonce: bytes already here are not
            # one.
            raise HandshakeFailed(
                f"{self.channel.value} channel: the peer sent {len(self._reader.buf)} bytes before "
                "the server's hello"
            )
        return Step(send=head + hmac.digest(server_proof_key, transcript, "sha256"))

    def _refuse(self, exc: WireError) -> Step:
        self._state = _ServerState.DONE
        reason = str(exc).encode()[:_MAX_REASON]
        return Step(
            send=_PREAMBLE.pack(PROTOCOL_VERSION, _REFUSE, len(reason)) + reason, failure=exc
        )


def session_resolver(secret: bytes) -> CredentialResolver:
    """The controller's resolver: the session secret, and nothing a rank could hold."""

    def resolve(peer: PeerHello) -> bytes:
        if peer.kind is not CredentialKind.SESSION:
            raise HandshakeRefused(
                f"a {peer.kind.name.lower()} credential is not accepted here: the controller port "
                "takes the session "
                "secret only (a rank speaks to its own host's relay)"
            )
        return secret

    return resolve


def join_resolver(
    secret: bytes, token: bytes | None, *, open_admission: bool = False
) -> CredentialResolver:
    """The controller's join channel: the session secret, the cluster token when token admission is
    on, no credential under open admission."""
    by_session = session_resolver(secret)

    def resolve(peer: PeerHello) -> bytes:
        if peer.kind is CredentialKind.OPEN:
            if not open_admission:
                raise HandshakeRefused(
                    "this controller does not run open admission: give the agent --token-file (a "
                    "cluster token) or --secret-file"
                )
            return OPEN_ADMISSION_KEY
        if peer.kind is CredentialKind.TOKEN:
            if token is None:
                raise HandshakeRefused(
                    "a cluster token is not accepted here: this controller runs without token "
                    "admission "
                    "(start flodl-launch with --token-file, or set controller.token_file in "
                    "cluster.yml)"
                )
            return token
        return by_session(peer)

    return resolve
