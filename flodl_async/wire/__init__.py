"""The wire, sans-IO: bytes in, frames and typed messages out, and back.

Channel magics and the sniffer, the per-connection handshake and link keys, the authenticated
(and, for sealed kinds, encrypted) frame codec, the message kinds and which channel carries which,
tensor payload specs, and the TCPStore protocol torch's clients speak on the same port. Every
protocol codec lives here so that a byte on any channel is checked by one set of rules.

Pure: nothing here touches asyncio or sockets (torch only inside :mod:`.tensor`'s functions).
May import: _lazy, errors.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_names

#: Public name -> the module that defines it, loaded on first use (PEP 562): a process that needs
#: only the keys (the launcher's early start) does not load the codec and every message class.
_LAZY = {
    "CHANNEL_MAGIC": "channels",
    "MAGIC_LEN": "channels",
    "Channel": "channels",
    "NeedMore": "channels",
    "Routed": "channels",
    "Unrouted": "channels",
    "sniff": "channels",
    "CLOSED": "frame",
    "NEED_DATA": "frame",
    "Frame": "frame",
    "FrameConnection": "frame",
    "FrameLimits": "frame",
    "Pending": "frame",
    "Side": "frame",
    "PROTOCOL_VERSION": "handshake",
    "ClientHandshake": "handshake",
    "CredentialResolver": "handshake",
    "Established": "handshake",
    "PeerHello": "handshake",
    "ServerHandshake": "handshake",
    "Credential": "keys",
    "CredentialKind": "keys",
    "Direction": "keys",
    "LinkKeys": "keys",
    "new_session_secret": "keys",
    "secret_from_hex": "keys",
    "LEGAL_KINDS": "legality",
    "legal_kinds": "legality",
    "Message": "schema",
    "message": "schema",
    "registered_kinds": "schema",
}


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

if TYPE_CHECKING:
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

__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__, globals())
