"""A leading ``python`` on a host reached over ssh is that worker's ``python:`` (namespace hosts).

The worker's ``python:`` is a wrapper that alone makes flodl_async importable there (the venv a
real host would name), and says so on stderr: the ranks of ``-- python ...`` must run through it,
not through the ssh login ``PATH``'s interpreter (``No module named ...`` on the remote host).
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from .hostkit import HostKit
from .launchkit import free_port, new_run_id, run_launch

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent


def test_a_leading_python_on_an_ssh_host_is_its_workers_python(
    hostkit: HostKit, tmp_path: Path
) -> None:
    h1 = hostkit.hosts[0]
    wrapper = tmp_path / "venv-python"
    wrapper.write_text(
        f'#!/bin/sh\necho "via {h1.name} python:" >&2\nexport PYTHONPATH={REPO}\n'
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(stat.S_IRWXU)
    ssh = {
        "target": h1.addr,
        "user": "root",
        "identity_file": str(hostkit.user_key),
        "known_hosts": str(hostkit.known_hosts),
    }
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"controller: {{host: 0.0.0.0, port: {free_port()}, join: {{join_timeout: 60}}}}\n"
        f"workers:\n  - host: {h1.name}\n    devices: cpu:1\n    python: {wrapper}\n"
        f"    ssh: {json.dumps(ssh)}\n"
    )
    done = run_launch(
        str(cluster), "--", "python", "-c",
        "import sys, flodl_async; print('rank ran', sys.executable)",
        run_id=new_run_id(), timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"[{h1.name}:r0] rank ran {sys.executable}" in done.stdout, done.stdout
    assert f"[{h1.name}:r0] via {h1.name} python:" in done.stderr  # the rank, not only its agent
    assert f"(python: {wrapper})" in done.stderr
