"""The wire, sans-IO: channel magics, the per-connection handshake, authenticated and encrypted
frames,
typed messages, the kind table, tensor payloads.

Nothing in this package touches asyncio or sockets; torch is imported lazily by
:mod:`.tensor` only when tensors are actually packed or unpacked.
"""

from .channels import CHANNEL_MAGIC, MAGIC_LEN, Channel, NeedMore, Routed, Unrouted, sniff
from .frame import CLOSED, NEED_DATA, Frame, FrameConnection, FrameLimits, Pending, Side
from .handshake import (
    PROTOCOL_VERSION,
    ClientHandshake,
    CredentialResolver,
    Established,
    PeerHello,
    ServerHandshake,
)
from .keys import (
    Credential,
    CredentialKind,
    Direction,
    LinkKeys,
    new_session_secret,
    secret_from_hex,
)
from .legality import LEGAL_KINDS, legal_kinds
from .schema import Message, message, registered_kinds

__all__ = [
    "CHANNEL_MAGIC",
    "CLOSED",
    "LEGAL_KINDS",
    "MAGIC_LEN",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "Channel",
    "ClientHandshake",
    "Credential",
    "CredentialKind",
    "CredentialResolver",
    "Direction",
    "Established",
    "Frame",
    "FrameConnection",
    "FrameLimits",
    "LinkKeys",
    "Message",
    "NeedMore",
    "PeerHello",
    "Pending",
    "Routed",
    "ServerHandshake",
    "Side",
    "Unrouted",
    "legal_kinds",
    "message",
    "new_session_secret",
    "registered_kinds",
    "secret_from_hex",
    "sniff",
]
