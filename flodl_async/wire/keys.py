"""Per-run session secret and the per-channel, per-direction keys derived from it.

The 128-bit session secret is the only shared key material. HKDF-SHA256 turns
it into one key per (run, channel, direction): a frame sealed for the join
channel does not verify on the control channel, and a frame sealed by the
controller does not verify when reflected back at it.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..errors import ConfigError
from .channels import CHANNEL_MAGIC, Channel

SECRET_BYTES = 16
_KDF_LABEL = b"flodl-async/v1"


class Direction(enum.Enum):
    """Which way a frame travels relative to the controller."""

    TO_CONTROLLER = "up"
    FROM_CONTROLLER = "down"


def new_session_secret() -> bytes:
    """A fresh 128-bit secret for one run."""
    return secrets.token_bytes(SECRET_BYTES)


def secret_from_hex(text: str) -> bytes:
    """Parse a secret given as 32 hex characters (stdin, file or env of an agent)."""
    text = text.strip()
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) != SECRET_BYTES:
        raise ConfigError(
            f"session secret must be {2 * SECRET_BYTES} hex characters (got {len(text)} characters); "
            "pass the secret the controller printed or wrote to its secret file"
        )
    return raw


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionKeys:
    """Every frame key of one run, derived once."""

    run_id: str
    _keys: dict[tuple[Channel, Direction], bytes] = field(repr=False)

    @classmethod
    def derive(cls, secret: bytes, run_id: str) -> SessionKeys:
        """Derive the key set for ``run_id`` from ``secret`` (16 bytes)."""
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"session secret must be {SECRET_BYTES} bytes, got {len(secret)}")
        keys: dict[tuple[Channel, Direction], bytes] = {}
        for channel in CHANNEL_MAGIC:
            for direction in Direction:
                info = b"/".join((_KDF_LABEL, run_id.encode(), channel.value.encode(), direction.value.encode()))
                kdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info)
                keys[(channel, direction)] = kdf.derive(secret)
        return cls(run_id=run_id, _keys=keys)

    def key(self, channel: Channel, direction: Direction) -> bytes:
        """The HMAC key for frames on ``channel`` travelling ``direction``."""
        return self._keys[(channel, direction)]
