"""A remote host's `devices: all` is what its own agent counts, not the controller's GPUs (namespace hosts).

Each host's GPUs are faked the way the agent counts them: ``nvidiaN`` nodes in the directory
``FLODL_INTERNAL_DEV_DIR`` names (instead of /dev, :mod:`flodl_async.host.gpus`), set by that host's
``python:`` wrapper only. This
machine (the controller) has no /dev/nvidia* at all, so a count taken here would be 0.
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from flodl_async.host.gpus import DEV_DIR_VARIABLE, physical_gpu_count

from .hostkit import HostKit
from .launchkit import PY, new_run_id, run_launch, script

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent


def _host_with_gpus(tmp_path: Path, name: str, gpus: int) -> Path:
    """A `python:` wrapper whose agent finds ``gpus`` GPUs (and the control node, which is no GPU)."""
    nodes = tmp_path / f"dev-{name}"
    nodes.mkdir()
    for node in [f"nvidia{i}" for i in range(gpus)] + ["nvidiactl", "nvidia-uvm"]:
        (nodes / node).touch()
    wrapper = tmp_path / f"python-{name}"
    wrapper.write_text(
        f'#!/bin/sh\nexport PYTHONPATH={REPO} {DEV_DIR_VARIABLE}={nodes}\nexec {sys.executable} "$@"\n'
    )
    wrapper.chmod(stat.S_IRWXU)
    return wrapper


def _cluster(tmp_path: Path, kit: HostKit, workers: list[tuple[str, str, Path]]) -> Path:
    from .launchkit import free_port

    lines = [
        f"controller: {{host: 0.0.0.0, port: {free_port()}, join: {{join_timeout: 60}}}}",
        "workers:",
    ]
    by_name = {h.name: h for h in kit.hosts}
    for name, devices, python in workers:
        ssh = {
            "target": by_name[name].addr,
            "user": "root",
            "identity_file": str(kit.user_key),
            "known_hosts": str(kit.known_hosts),
        }
        lines += [
            f"  - host: {name}",
            f"    devices: {devices}",
            f"    python: {python}",
            f"    ssh: {json.dumps(ssh)}",
        ]
    cluster = tmp_path / "cluster.yml"
    cluster.write_text("\n".join(lines) + "\n")
    return cluster


def test_the_fake_device_dir_is_counted_like_dev(tmp_path: Path) -> None:
    nodes = tmp_path / "dev"
    nodes.mkdir()
    for node in ("nvidia0", "nvidia1", "nvidia7", "nvidiactl", "nvidia-modeset", "nvme0"):
        (nodes / node).touch()
    assert physical_gpu_count({DEV_DIR_VARIABLE: str(nodes)}) == 3
    assert physical_gpu_count({DEV_DIR_VARIABLE: str(tmp_path / "absent")}) == 0


def test_a_remote_all_is_the_gpus_its_agent_reports_at_join(
    hostkit: HostKit, tmp_path: Path
) -> None:
    # The controller's machine shows no GPU, whatever this machine has: h1's two can only be what h1's agent counted.
    no_gpus = tmp_path / "dev-controller"
    no_gpus.mkdir()
    out = tmp_path / "envs"
    out.mkdir()
    cluster = _cluster(
        tmp_path,
        hostkit,
        [
            ("h1", "all", _host_with_gpus(tmp_path, "h1", 2)),
            ("h2", "cpu:1", _host_with_gpus(tmp_path, "h2", 0)),
        ],
    )
    here = {DEV_DIR_VARIABLE: str(no_gpus), "CUDA_VISIBLE_DEVICES": ""}
    done = run_launch(
        str(cluster),
        "--",
        PY,
        script("dump_env.py"),
        str(out),
        run_id=new_run_id(),
        timeout=180,
        env=here,
    )
    assert done.returncode == 0, done.stderr
    # The window cannot know h1's capacity before h1's agent joins: it says so, and waits for it.
    assert "window open (quorum 1 + what h1 report ranks, target 1 + what h1 report," in done.stderr
    assert "world formed — 3 ranks across 2 host(s)" in done.stderr
    assert "(target ranks reached)" in done.stderr
    envs = [json.loads(p.read_text()) for p in sorted(out.glob("env-*.json"))]
    assert sorted(int(e["RANK"]) for e in envs) == [0, 1, 2]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"}
    local_sizes = sorted(e["LOCAL_WORLD_SIZE"] for e in envs)
    assert local_sizes == ["1", "2", "2"]  # h1's two GPUs are two ranks there, h2's cpu:1 one


def test_a_remote_all_with_no_gpus_fails_the_window_naming_that_host(
    hostkit: HostKit, tmp_path: Path
) -> None:
    cluster = _cluster(
        tmp_path,
        hostkit,
        [
            ("h1", "all", _host_with_gpus(tmp_path, "h1", 2)),
            ("h2", "all", _host_with_gpus(tmp_path, "h2", 0)),
        ],
    )
    done = run_launch(
        str(cluster),
        "--",
        PY,
        script("dump_env.py"),
        str(tmp_path),
        run_id=new_run_id(),
        timeout=180,
    )
    assert done.returncode == 3, done.stderr
    assert "host 'h2' has no devices to offer (devices: all, 0 GPUs visible)" in done.stderr
    assert "Traceback" not in done.stderr
