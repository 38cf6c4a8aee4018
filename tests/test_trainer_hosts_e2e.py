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
import signal
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from flodl_async.verdict import ExitCode

from .hostkit import HostKit, NsHost
from .launchkit import PY, Launcher, assert_nothing_left, free_port, new_run_id, wait_status
from .test_fanout_e2e import _python_wrapper
from .test_trainer_e2e import SCRIPT, assert_converged, assert_identical, states
from .test_tunnel_e2e import LOOPBACK_HEX, _dial_from, _listen_addresses

pytestmark = pytest.mark.e2e


def _worker(
    kit: HostKit, host: NsHost, devices: str, python: Path, *, tunnel: bool = False
) -> list[str]:
    ssh = {
        "target": host.addr,
        "user": "root",
        "identity_file": str(kit.user_key),
        "known_hosts": str(kit.known_hosts),
    }
    lines = [
        f"  - host: {host.name}",
        f"    devices: {devices}",
        f"    python: {python}",
        f"    ssh: {json.dumps(ssh)}",
    ]
    return [*lines, "    tunnel: true"] if tunnel else lines


def _cluster(tmp_path: Path, header: Sequence[str], workers: Sequence[str]) -> str:
    # One thread per rank: the 2 cores are shared by every rank of every host.
    path = tmp_path / "cluster.yml"
    path.write_text("\n".join([*header, "env: {OMP_NUM_THREADS: '1'}", "workers:", *workers, ""]))
    return str(path)


def _as_launcher(
    tmp_path: Path, cluster: str, *args: str, run_id: str, timeout: float = 110
) -> subprocess.CompletedProcess[str]:
    cmd = [PY, SCRIPT, "--out", str(tmp_path / "out"), "--cluster", cluster, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLODL_RUN_ID": run_id}
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    finally:
        assert_nothing_left(run_id)


class ScriptLauncher(Launcher):
    """The Trainer script as a background launcher over ``cluster`` (launchkit's line reader, another command)."""

    def __init__(self, tmp_path: Path, cluster: str, *args: str, run_id: str) -> None:
        self.run_id = run_id
        cmd = [PY, SCRIPT, "--out", str(tmp_path / "out"), "--cluster", cluster, *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "FLODL_RUN_ID": run_id}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, env=env
        )
        self.stdout_lines = []

    def held_rank(self) -> tuple[int, int]:
        """The held rank (the script's ``--hold-host``) and its pid, once its first step waits."""
        self.wait_for_stdout("HOLDING rank", timeout=90)
        line = next(line for line in self.stdout_lines if "HOLDING rank" in line)
        held = re.search(r"HOLDING rank (\d+) pid (\d+) on ", line)
        assert held is not None, line
        return int(held[1]), int(held[2])


def _two_agents(tmp_path: Path, kit: HostKit) -> str:
    """The controller's host runs ranks 0-1 (its relay folds them in memory), h1 runs rank 2 (its relay dials the port)."""
    return _cluster(
        tmp_path,
        [f"controller: {{host: 0.0.0.0, port: {free_port()}, join: {{join_timeout: 60}}}}"],
        [
            f"  - host: {socket.gethostname()}",
            "    devices: cpu:2",
            *_worker(kit, kit.hosts[0], "cpu:1", _python_wrapper(tmp_path)),
        ],
    )


def _assert_trained(tmp_path: Path, ranks: int, epochs: int = 2) -> None:
    saved = states(tmp_path)
    assert_identical(saved, {"launcher--1", *(f"rank-{r}" for r in range(ranks))})
    launcher = saved["launcher--1"]
    assert launcher["primary"]
    assert (launcher["world_size"], launcher["epochs_completed"], launcher["interrupted"]) == (
        ranks,
        epochs,
        False,
    )
    assert launcher["losses"][-1] < launcher["losses"][0], launcher["losses"]


def test_three_ranks_over_two_agents_train_to_one_state(hostkit: HostKit, tmp_path: Path) -> None:
    """Ranks 0-1 on the controller's host, rank 2 on h1: one state everywhere, and h1's share went up over TCP."""
    run_id = new_run_id()
    done = _as_launcher(
        tmp_path,
        _two_agents(tmp_path, hostkit),
        "--policy",
        "sync",
        "--epochs",
        "4",
        "--verbose",  # the reducer's closing "training data:" lines are -v's
        run_id=run_id,
    )
    assert done.returncode == 0, done.stderr
    _assert_trained(tmp_path, 3, epochs=4)
    assert_converged(states(tmp_path)["launcher--1"]["losses"])  # the same bar as the one-host runs
    # The reducer's own account of the paths: h1's rank reached it over its relay's TCP uplink, with tensors.
    uplinks = _uplinks(done.stderr)
    assert set(uplinks) == {socket.gethostname(), "h1"}, done.stderr
    assert uplinks["h1"][:2] == ("2", "over the port"), uplinks
    assert uplinks[socket.gethostname()][:2] == ("0,1", "in this process"), uplinks
    assert all(frames > 0 and payload > 0 for _ranks, _path, frames, payload in uplinks.values()), (
        uplinks
    )
    assert hostkit.leftovers() == {}


UPLINK = re.compile(
    r"training data: host (\S+) \(ranks ([\d,]+)\) sent (\d+) contribution\(s\), (\d+) tensor bytes, (over the port|in this process)"
)


def _uplinks(stderr: str) -> dict[str, tuple[str, str, int, int]]:
    """The controller's closing lines: host -> (ranks, path, frames, tensor bytes)."""
    return {m[1]: (m[2], m[5], int(m[3]), int(m[4])) for m in UPLINK.finditer(stderr)}


def test_a_tunnel_only_cluster_trains_end_to_end_through_a_loopback_only_controller(
    hostkit: HostKit, tmp_path: Path
) -> None:
    """Every worker `tunnel: true`: the ranks reach the controller only through their relay and its ssh tunnel.

    The Trainer's own cluster file says no `trainer: cpu`: the Trainer knows its backend (CPU)."""
    h1, h2 = hostkit.hosts[:2]
    port = free_port()
    python = _python_wrapper(tmp_path)
    cluster = _cluster(
        tmp_path,
        [f"controller: {{port: {port}, join: {{join_timeout: 60}}}}"],
        [
            *_worker(hostkit, h1, "cpu:2", python, tunnel=True),
            *_worker(hostkit, h2, "cpu:1", python, tunnel=True),
        ],
    )
    hold = tmp_path / "hold"
    launcher = ScriptLauncher(
        tmp_path,
        cluster,
        "--policy",
        "cadence",
        "--epochs",
        "2",
        "--verbose",
        "--hold-file",
        str(hold),
        "--hold-host",
        h2.name,
        run_id=new_run_id(),
    )
    try:
        launcher.held_rank()  # the world trains (h2's rank waits in its first step)
        assert _listen_addresses(port) == {LOOPBACK_HEX}  # the controller's one port: loopback only
        assert (
            _dial_from(h2, hostkit.controller_addr, port) == "ConnectionRefusedError"
        )  # no way in but the tunnel
        # A rank steps only after the init round's consensus, so both hosts' init frames are in the status page already.
        doc = wait_status(
            port,
            lambda d: isinstance(d.get("training"), dict) and len(d["training"]["uplinks"]) == 2,
            timeout=30,
        )
        assert isinstance(doc["training"], dict)
        assert {(u["host"], u["in_process"]) for u in doc["training"]["uplinks"]} == {
            ("h1", False),
            ("h2", False),
        }
        assert all(u["frames"] >= 1 for u in doc["training"]["uplinks"])
        hold.touch()
        done = launcher.finish(timeout=90)
    finally:
        hold.touch()
        launcher.kill()
    assert done.returncode == 0, done.stderr
    _assert_trained(tmp_path, 3)
    uplinks = _uplinks(done.stderr)
    # Both hosts' relays dialled the port (the tunnel's far end is the controller's loopback); none is in its process.
    # Ranks follow the order the hosts joined in, so only their counts per host are known beforehand.
    assert {
        host: (len(ranks.split(",")), path) for host, (ranks, path, _f, _b) in uplinks.items()
    } == {"h1": (2, "over the port"), "h2": (1, "over the port")}
    assert sorted(int(r) for ranks, _p, _f, _b in uplinks.values() for r in ranks.split(",")) == [
        0,
        1,
        2,
    ]
    assert "Traceback" not in done.stderr
    assert hostkit.leftovers() == {}


def test_a_rank_killed_on_the_remote_host_is_dropped_named_and_leaves_nothing(
    hostkit: HostKit, tmp_path: Path
) -> None:
    hold = tmp_path / "hold"
    args = ("--epochs", "2", "--hold-file", str(hold), "--hold-host", "h1")
    launcher = ScriptLauncher(tmp_path, _two_agents(tmp_path, hostkit), *args, run_id=new_run_id())
    try:
        rank, pid = launcher.held_rank()
        assert pid in hostkit.host_pids(hostkit.hosts[0].ns)  # it runs on h1
        os.kill(pid, signal.SIGKILL)  # h1's one rank, in its first step
        done = launcher.finish(timeout=90)
    finally:
        hold.touch()
        launcher.kill()
    # The run is elastic: h1's host leaves the fold with its last rank, the survivor trains on.
    assert done.returncode == ExitCode.OK, done.stderr
    assert f"DEGRADED — 1 of 3 ranks lost (rank {rank} on host h1: " in done.stderr, done.stderr
    assert (tmp_path / "out" / "launcher--1.pt").exists()  # the launcher's run() returned the state
    assert hostkit.leftovers() == {}


def test_a_host_cut_off_mid_training_costs_its_ranks_and_the_survivors_finish(
    hostkit: HostKit, tmp_path: Path
) -> None:
    """h1's link goes down while its rank trains: the controller loses the host (its links go silent),
    the coordinator drops its rank, and the controller's host trains on to a DEGRADED end."""
    h1 = hostkit.hosts[0]
    hold = tmp_path / "hold"
    args = ("--epochs", "2", "--hold-file", str(hold), "--hold-host", "h1")
    launcher = ScriptLauncher(tmp_path, _two_agents(tmp_path, hostkit), *args, run_id=new_run_id())
    link = ("ip", "netns", "exec", h1.ns, "ip", "link", "set", "eth0")
    try:
        rank, _pid = launcher.held_rank()
        subprocess.run([*link, "down"], check=True)  # the cable is pulled: nothing says goodbye
        done = launcher.finish(timeout=120)
    finally:
        subprocess.run([*link, "up"], check=False)
        hold.touch()
        launcher.kill()
    assert done.returncode == ExitCode.OK, done.stderr
    assert f"DEGRADED — 1 of 3 ranks lost (rank {rank} on host h1: " in done.stderr, done.stderr
    saved = states(tmp_path)
    assert saved["launcher--1"]["world_size"] == 2, saved["launcher--1"]  # the survivors' world
    assert saved["launcher--1"]["epochs_completed"] == 2
    # the cut-off agent finds its controller silent and ends its rank: nothing is left on h1
    assert hostkit.leftovers(within=30) == {}


def test_a_collective_world_re_formed_across_hosts_gets_back_into_the_store(
    hostkit: HostKit, tmp_path: Path
) -> None:
    """Rank 1 dies on the controller's host; rank 2 on h1 re-forms with rank 0 through the run's
    store. Its new store connections come from h1's address, so h1's agent is asked who made them
    (:mod:`flodl_async.net.portstore`): a rank of its own, served."""
    done = _as_launcher(
        tmp_path, _two_agents(tmp_path, hostkit), "--backend", "collective", "--policy", "sync",
        "--epochs", "2", "--kill-rank", "1", "--kill-batch", "9", run_id=new_run_id(),
    )  # fmt: skip
    assert done.returncode == ExitCode.OK, done.stderr
    assert "the survivors re-form their process group as ranks [0, 2]" in done.stderr, done.stderr
    assert "(store_" not in done.stderr, done.stderr  # no store connection of the run refused
    saved = states(tmp_path)
    assert_identical(saved, {"launcher--1", "rank-0", "rank-2"})
    assert hostkit.leftovers() == {}
