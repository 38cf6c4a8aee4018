"""The ranks' socket interface on every kind of agent (namespace hosts, tests/hostkit.py): real gloo across hosts.

gloo without ``GLOO_SOCKET_IFNAME`` resolves the hostname; on these hosts (a namespace hostname
that does not resolve, or the controller's host, whose name resolves to 127.0.0.1 here) it binds
loopback and the cross-host all_reduce never completes. Each agent must pick the NIC the others reach.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from .hostkit import HostKit, NsHost
from .launchkit import PY, Launcher, free_port, new_run_id, reap, run_launch, script
from .test_fanout_e2e import REPO, _python_wrapper

pytestmark = pytest.mark.e2e


def _ssh_worker(kit: HostKit, host: NsHost, devices: str, python: Path) -> list[str]:
    ssh = {
        "target": host.addr,
        "user": "root",
        "identity_file": str(kit.user_key),
        "known_hosts": str(kit.known_hosts),
    }
    return [
        f"  - host: {host.name}",
        f"    devices: {devices}",
        f"    python: {python}",
        f"    ssh: {json.dumps(ssh)}",
    ]


def _envs(out_dir: Path) -> dict[str, dict[str, str]]:
    """hostname → the env of that host's one rank (allreduce_env.py's files)."""
    seen = [json.loads(p.read_text()) for p in out_dir.glob("env-*.json")]
    return {doc["hostname"]: doc["env"] for doc in seen}


def test_a_dial_in_agent_gives_its_ranks_the_interface_of_its_join_connection(
    hostkit: HostKit, tmp_path: Path, xdg: Path
) -> None:
    h1, h2 = hostkit.hosts[:2]
    token = tmp_path / "token"
    assert (
        subprocess.run(
            [PY, "-m", "flodl_async.cli.flodl", "token", "new", str(token)],
            capture_output=True,
            timeout=60,
            check=False,
        ).returncode
        == 0
    )
    port = free_port()
    cluster = tmp_path / "cluster.yml"
    lines = [
        f"controller: {{host: 0.0.0.0, port: {port}, token_file: {token}, join: {{join_timeout: 60}}}}",
        "workers:",
    ]
    lines += _ssh_worker(hostkit, h1, "cpu:1", _python_wrapper(tmp_path))
    lines += [f"  - host: {h2.name}", "    devices: cpu:1", "    dial_in: true"]
    cluster.write_text("\n".join(lines) + "\n")
    out_dir = tmp_path / "envs"
    out_dir.mkdir()
    env = {"XDG_RUNTIME_DIR": str(xdg)}
    launcher = Launcher(
        str(cluster),
        "--",
        PY,
        script("allreduce_env.py"),
        str(out_dir),
        run_id=new_run_id(),
        env=env,
    )
    agent = None
    try:
        # h2's own agent, as its systemd unit would start it: it dials the controller on the bridge.
        agent_argv = [
            PY,
            "-m",
            "flodl_async.agent",
            "--controller",
            f"{hostkit.controller_addr}:{port}",
            "--host",
            h2.name,
        ]
        agent_argv += ["--devices", "cpu:1", "--token-file", str(token), "--connect-timeout", "60"]
        agent_env = {**os.environ, **env, "PYTHONPATH": str(REPO)}
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            agent_env.pop(name, None)
        agent = subprocess.Popen(
            hostkit.inside_argv(h2, *agent_argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=agent_env,
        )
        _, agent_err = agent.communicate(timeout=120)
        done = launcher.finish(timeout=120)
    finally:
        reap(agent)
        launcher.kill()
    assert agent.returncode == 0, agent_err
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(" of 2 sum 3") == 2, done.stdout
    envs = _envs(out_dir)
    assert sorted(envs) == ["h1", "h2"]
    assert (
        envs["h2"]["GLOO_SOCKET_IFNAME"] == envs["h2"]["NCCL_SOCKET_IFNAME"] == "eth0"
    )  # its namespace's NIC, not lo
    assert envs["h2"]["MASTER_ADDR"] == hostkit.controller_addr
    assert hostkit.leftovers() == {}


def test_the_controllers_own_ranks_bind_the_interface_that_reaches_the_other_hosts(
    hostkit: HostKit, tmp_path: Path
) -> None:
    h1, h2 = hostkit.hosts[:2]
    python = _python_wrapper(tmp_path)
    lines = [
        f"controller: {{host: 0.0.0.0, port: {free_port()}, join: {{join_timeout: 60}}}}",
        "workers:",
    ]
    lines += ["  - host: localhost", "    devices: cpu:1"]
    lines += _ssh_worker(hostkit, h1, "cpu:1", python) + _ssh_worker(hostkit, h2, "cpu:1", python)
    cluster = tmp_path / "cluster.yml"
    cluster.write_text("\n".join(lines) + "\n")
    out_dir = tmp_path / "envs"
    out_dir.mkdir()
    done = run_launch(
        str(cluster),
        "--",
        PY,
        script("allreduce_env.py"),
        str(out_dir),
        run_id=new_run_id(),
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(" of 3 sum 6") == 3, done.stdout
    envs = _envs(out_dir)
    local = envs.pop(os.uname().nodename)
    assert sorted(envs) == ["h1", "h2"]
    # The local agent joined over loopback, but its ranks bind the bridge, which the namespace hosts reach.
    assert local["GLOO_SOCKET_IFNAME"] == local["NCCL_SOCKET_IFNAME"] == hostkit.bridge
    assert local["MASTER_ADDR"] == "127.0.0.1"
    for name in ("h1", "h2"):
        assert envs[name]["GLOO_SOCKET_IFNAME"] == "eth0"
        assert envs[name]["MASTER_ADDR"] == hostkit.controller_addr
    assert hostkit.leftovers() == {}


def test_the_local_workers_nccl_socket_ifname_reaches_its_ranks(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"controller: {{port: {free_port()}}}\nworkers:\n  - host: localhost\n    devices: cpu:2\n    nccl_socket_ifname: lo\n"
    )
    out_dir = tmp_path / "envs"
    out_dir.mkdir()
    done = run_launch(
        str(cluster),
        "--",
        PY,
        script("dump_env.py"),
        str(out_dir),
        run_id=new_run_id(),
        env={"GLOO_SOCKET_IFNAME": "eth9"},
    )
    assert done.returncode == 0, done.stderr
    envs = [json.loads(p.read_text()) for p in out_dir.glob("env-*.json")]
    assert len(envs) == 2
    # The file's setting wins over the launcher's own environment, as it does on a remote host.
    assert {(e["GLOO_SOCKET_IFNAME"], e["NCCL_SOCKET_IFNAME"]) for e in envs} == {("lo", "lo")}
