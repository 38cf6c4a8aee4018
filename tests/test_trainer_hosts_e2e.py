"""The Trainer across hosts (tests/hostkit.py namespace hosts, real sshd): 3 ranks over 2 agents, and a tunnel-only host.

The script is tests/scripts/trainer_mlp.py in the launcher role (``--cluster`` a cluster file): this
test's child process runs the controller and re-executes itself as the ranks, on its own host and,
through the ssh fan-out, on a namespace host. Every process writes its TrainedState to the shared
output directory (the namespaces share the filesystem).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from .hostkit import HostKit, NsHost
from .launchkit import PY, assert_nothing_left, free_port, new_run_id
from .test_fanout_e2e import _python_wrapper
from .test_trainer_e2e import SCRIPT, assert_identical, states

pytestmark = pytest.mark.e2e


def _worker(kit: HostKit, host: NsHost, devices: str, python: Path, *, tunnel: bool = False) -> list[str]:
    ssh = {"target": host.addr, "user": "root", "identity_file": str(kit.user_key), "known_hosts": str(kit.known_hosts)}
    lines = [f"  - host: {host.name}", f"    devices: {devices}", f"    python: {python}", f"    ssh: {json.dumps(ssh)}"]
    return [*lines, "    tunnel: true"] if tunnel else lines


def _cluster(tmp_path: Path, header: Sequence[str], workers: Sequence[str]) -> str:
    # One thread per rank: the 2 cores are shared by every rank of every host.
    path = tmp_path / "cluster.yml"
    path.write_text("\n".join([*header, "env: {OMP_NUM_THREADS: '1'}", "workers:", *workers, ""]))
    return str(path)


def _as_launcher(tmp_path: Path, cluster: str, *args: str, run_id: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    cmd = [PY, SCRIPT, "--out", str(tmp_path / "out"), "--cluster", cluster, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLODL_RUN_ID": run_id}
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    finally:
        assert_nothing_left(run_id)


def test_three_ranks_over_two_agents_train_to_one_state(hostkit: HostKit, tmp_path: Path) -> None:
    """The controller's host runs ranks 0-1 (its relay folds them in memory), h1 runs rank 2 (its relay dials the port)."""
    h1 = hostkit.hosts[0]
    port = free_port()
    cluster = _cluster(
        tmp_path,
        [f"controller: {{host: 0.0.0.0, port: {port}, join: {{join_timeout: 60}}}}"],
        [f"  - host: {socket.gethostname()}", "    devices: cpu:2", *_worker(hostkit, h1, "cpu:1", _python_wrapper(tmp_path))],
    )
    run_id = new_run_id()
    done = _as_launcher(tmp_path, cluster, "--policy", "sync", "--epochs", "2", run_id=run_id)
    assert done.returncode == 0, done.stderr
    saved = states(tmp_path)
    assert_identical(saved, {"launcher--1", "rank-0", "rank-1", "rank-2"})
    launcher = saved["launcher--1"]
    assert launcher["primary"]
    assert (launcher["world_size"], launcher["epochs_completed"]) == (3, 2)
    assert launcher["losses"][-1] < launcher["losses"][0], launcher["losses"]
    # The reducer's own account of the paths: h1's rank reached it over its relay's TCP uplink, with tensors.
    uplinks = _uplinks(done.stderr)
    assert set(uplinks) == {socket.gethostname(), "h1"}, done.stderr
    assert uplinks["h1"][:2] == ("2", "over the port"), uplinks
    assert uplinks[socket.gethostname()][:2] == ("0,1", "in this process"), uplinks
    assert all(frames > 0 and payload > 0 for _ranks, _path, frames, payload in uplinks.values()), uplinks
    assert hostkit.leftovers() == {}


UPLINK = re.compile(r"training data: host (\S+) \(ranks ([\d,]+)\) sent (\d+) contribution\(s\), (\d+) tensor bytes, (over the port|in this process)")


def _uplinks(stderr: str) -> dict[str, tuple[str, str, int, int]]:
    """The controller's closing lines: host -> (ranks, path, frames, tensor bytes)."""
    return {m[1]: (m[2], m[5], int(m[3]), int(m[4])) for m in UPLINK.finditer(stderr)}
