"""Addresses as the commands take them: ``HOST:PORT`` and its shorter forms, and the default port.

Shared by ``flodl-agent --controller``, ``flodl status --addr`` and the cluster file's default
port. Pure, and light: the agent parses its ``--controller`` without loading the cluster file's
parser (YAML stays off its start path).
"""

from __future__ import annotations

from ..errors import ConfigError

#: The controller's port when none is given (command line, cluster file or address).
DEFAULT_PORT = 1337


def parse_addr(text: str, *, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """``HOST:PORT``, ``HOST``, ``:PORT`` or ``[v6]:PORT`` → (host, port)."""
    text = text.strip()
    host, port_text = text, ""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ConfigError(f"address {text!r}: unclosed '[' in an IPv6 literal")
        host, rest = text[1:end], text[end + 1 :]
        port_text = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    host = host or "127.0.0.1"
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"address {text!r}: port must be a number from 1 to 65535")
    return host, int(port_text)
