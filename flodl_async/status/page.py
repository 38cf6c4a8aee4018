"""The dashboard served at ``/``: a static page, shipped as package data (``page.html``).

The page polls ``/state.json`` and renders it with ``textContent`` only (never
``innerHTML`` of server strings), so a host or verdict string cannot inject
markup.
"""

from __future__ import annotations

import functools
from importlib import resources


@functools.cache
def dashboard_html() -> bytes:
    """The page's bytes, read from the installed package once and kept."""
    return resources.files(__name__.rpartition(".")[0]).joinpath("page.html").read_bytes()
