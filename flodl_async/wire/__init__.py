"""The wire, sans-IO: channel magics, authenticated frames, typed messages, the kind table, tensor payloads.

Nothing in this package touches asyncio or sockets; torch is imported lazily by
:mod:`.tensor` only when tensors are actually packed or unpacked.
"""

from .channels import CHANNEL_MAGIC, MAGIC_LEN, Channel, NeedMore, Routed, Unrouted, sniff
from .frame import CLOSED, NEED_DATA, PROTOCOL_VERSION, Frame, FrameConnection, FrameLimits, Pending, Side
from .keys import Direction, SessionKeys, new_session_secret, secret_from_hex
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
    "Direction",
    "Frame",
    "FrameConnection",
    "FrameLimits",
    "Message",
    "NeedMore",
    "Pending",
    "Routed",
    "SessionKeys",
    "Side",
    "Unrouted",
    "legal_kinds",
    "message",
    "new_session_secret",
    "registered_kinds",
    "secret_from_hex",
    "sniff",
]
