"""Key material: the session secret, the credentials derived from it, and one connection's frame
keys.

Three kinds of long-lived key material exist, one per role:

* the **session secret** (128 bits, one per run or per ``--secret-file``): held by
  the controller and the agents only;
* a **rank credential** (256 bits): ``HKDF(secret, run id, round, rank)``, given
  by an agent to one rank of one rendezvous round. It lets that rank talk to its
  own host's relay as itself, in that round, and to nothing else: HKDF is
  one-way, so a rank can derive neither the secret nor another rank's or another
  round's credential, and the controller refuses rank credentials outright;
* a **cluster token** (256 bits, ``flodl token new``): long-lived, held by the
  controller (``controller.token_file`` / ``--token-file``) and by dial-in
  agents. It admits an agent to the join channel only; the run's session secret
  then travels to it sealed (:mod:`.handshake` says under which key), and the
  agent's other links use that secret like any agent's.

With ``join.open_admission`` the controller also takes an OPEN credential on its
join channel, whose key is public: such an agent proves nothing, and the secret
it is sent is readable by anyone who records the link. That is what "open"
means; the controller says so loudly when it starts.

None of them keys a frame directly. Every connection runs the handshake of
:mod:`.handshake`, which mixes the credential with both sides' fresh nonces into
:class:`LinkKeys`: an HMAC key and an AES-256-GCM key per direction, used by
exactly one connection.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..errors import ConfigError

SECRET_BYTES = 16
TOKEN_BYTES = 32
CREDENTIAL_BYTES = 32
#: HKDF label of everything wire v2 derives; a new derivation takes a new label, never reuses one.
KDF_LABEL = b"flodl-async/wire-v2"


class Direction(enum.Enum):
    """Which way a frame travels relative to the controller (a relay is the controller of its
    ranks)."""

    TO_CONTROLLER = "up"
    FROM_CONTROLLER = "down"


class CredentialKind(enum.IntEnum):
    """What a connecting peer holds; sent in clear in its hello, and part of the handshake
    transcript."""

    SESSION = 1  # the session secret: agents and their relays, to the controller
    RANK = 2  # a rank credential: one rank of one round, to its host's relay only
    TOKEN = 3  # a cluster token: dial-in agents, on the controller's join channel only
    # no credential (a public key): the join channel of a controller with join.open_admission only
    OPEN = 4


def new_session_secret() -> bytes:
    """A fresh 128-bit secret for one run."""
    return secrets.token_bytes(SECRET_BYTES)


def _hex_bytes(text: str, size: int, *, what: str, fix: str) -> bytes:
    """``text`` (surrounding whitespace ignored) as exactly ``size`` bytes of hex, or a
    :class:`ConfigError` naming ``what`` and saying ``fix``."""
    text = text.strip()
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise ConfigError(
            f"{what} must be {2 * size} hex characters (got {len(text)} characters); {fix}"
        )
    return raw


def secret_from_hex(text: str) -> bytes:
    """Parse a secret given as 32 hex characters (stdin, file or env of an agent)."""
    return _hex_bytes(
        text,
        SECRET_BYTES,
        what="session secret",
        fix="pass the secret the controller printed or wrote to its secret file",
    )


#: The "key" of open admission: public by design, so it authenticates nobody (the controller warns
#: loudly).
OPEN_ADMISSION_KEY = KDF_LABEL + b"/open-admission"


def new_cluster_token() -> bytes:
    """A fresh 256-bit cluster token."""
    return secrets.token_bytes(TOKEN_BYTES)


def token_from_hex(text: str) -> bytes:
    """Parse a cluster token given as 64 hex characters (a token file)."""
    return _hex_bytes(
        text, TOKEN_BYTES, what="cluster token", fix="write one with `flodl token new PATH`"
    )


def rank_credential_key(secret: bytes, *, run_id: str, round: int, rank: int) -> bytes:
    """The credential of ``rank`` in rendezvous ``round`` of ``run_id`` (one-way from the
    secret)."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"session secret must be {SECRET_BYTES} bytes, got {len(secret)}")
    info = b"/".join(
        (KDF_LABEL, b"rank-credential", run_id.encode(), str(round).encode(), str(rank).encode())
    )
    return HKDF(algorithm=hashes.SHA256(), length=CREDENTIAL_BYTES, salt=None, info=info).derive(
        secret
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Credential:
    """What one side proves it holds in a handshake: a kind, its key, and the scope a rank
    credential covers."""

    kind: CredentialKind
    key: bytes = field(repr=False)
    #: Rank credentials only: the rendezvous round and the global rank they are good for.
    round: int = 0
    rank: int = -1

    @classmethod
    def session(cls, secret: bytes) -> Credential:
        """The session secret's credential (agents, relays upstream, the store host)."""
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"session secret must be {SECRET_BYTES} bytes, got {len(secret)}")
        return cls(kind=CredentialKind.SESSION, key=secret)

    @classmethod
    def token(cls, token: bytes) -> Credential:
        """The cluster token's credential (a dial-in agent's join link)."""
        if len(token) != TOKEN_BYTES:
            raise ValueError(f"cluster token must be {TOKEN_BYTES} bytes, got {len(token)}")
        return cls(kind=CredentialKind.TOKEN, key=token)

    @classmethod
    def open_admission(cls) -> Credential:
        """No credential at all: only a controller that runs ``join.open_admission`` takes it."""
        return cls(kind=CredentialKind.OPEN, key=OPEN_ADMISSION_KEY)

    @classmethod
    def for_rank(cls, secret: bytes, *, run_id: str, round: int, rank: int) -> Credential:
        """The credential an agent hands to ``rank`` of ``round`` (derived, never the secret
        itself)."""
        return cls(
            kind=CredentialKind.RANK,
            key=rank_credential_key(secret, run_id=run_id, round=round, rank=rank),
            round=round,
            rank=rank,
        )

    @classmethod
    def rank_from_hex(cls, text: str, *, round: int, rank: int) -> Credential:
        """A rank credential as its environment carries it (64 hex characters)."""
        try:
            key = bytes.fromhex(text.strip())
        except ValueError:
            key = b""
        if len(key) != CREDENTIAL_BYTES:
            raise ConfigError(
                f"rank credential must be {2 * CREDENTIAL_BYTES} hex characters; this rank's "
                "environment was not written by flodl"
            )
        return cls(kind=CredentialKind.RANK, key=key, round=round, rank=rank)


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkKeys:
    """One connection's frame keys, from its handshake: per direction, one HMAC key and one
    AES-256-GCM key.

    Held by exactly one connection: no two connections (nor the two directions of one)
    share a key, which is what makes the GCM nonce rule of :mod:`.frame` sufficient.
    """

    send_mac: bytes = field(repr=False)
    recv_mac: bytes = field(repr=False)
    send_aead: bytes = field(repr=False)
    recv_aead: bytes = field(repr=False)
