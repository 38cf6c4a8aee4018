"""The control plane never imports torch: it costs ~2 s and the controller never needs it."""

from __future__ import annotations

import subprocess
import sys

MODULES = [
    "flodl_async",
    "flodl_async.wire",
    "flodl_async.wire.tensor",
    "flodl_async.net.mux",
    "flodl_async.cli",
    "flodl_async.cluster",
    "flodl_async.agent",
    "flodl_async.devices",
    "flodl_async.runtime",
]


def test_importing_the_control_plane_does_not_import_torch() -> None:
    code = "import sys\n" + "".join(f"import {m}\n" for m in MODULES) + "print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "False"


def test_cli_help_does_not_import_torch() -> None:
    code = (
        "import sys, runpy\nsys.argv=['flodl','--help']\n"
        "try:\n runpy.run_module('flodl_async.cli', run_name='__main__')\nexcept SystemExit:\n pass\n"
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip().endswith("False")
