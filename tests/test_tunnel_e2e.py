"""``tunnel: true`` on namespace hosts (tests/hostkit.py): agents reach a loopback-only controller through ssh.

With every worker tunneling, the controller binds 127.0.0.1 only, so the hosts (each in its own
network namespace, on a bridge to the root namespace) cannot reach it directly at all: the
remote forward on each ssh session is their one path. The rank scripts here need no
rank-to-rank traffic (a tunnel carries none), as a Trainer CPU-backend job would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from .hostkit import HostKit, NsHost, require_namespace_hosts
from .launchkit import PY, Launcher, assert_nothing_left, free_port, new_run_id, run_launch, script
from .test_fanout_e2e import _python_wrapper

pytestmark = pytest.mark.e2e

#: /proc/net/tcp: the state column's LISTEN, and 127.0.0.1 as the kernel prints it.
TCP_LISTEN = "0A"
LOOPBACK_HEX = "0100007F"


def _tunnel_cluster(
    tmp_path: Path,
    kit: HostKit,
    hosts: Sequence[tuple[NsHost, str]],
    *,
    port: int,
    direct: Sequence[NsHost] = (),
) -> Path:
    """Every host tunnels, but those in ``direct``."""
    lines = [
        "trainer: cpu",
        f"controller: {{port: {port}, join: {{join_timeout: 60}}}}",
        "workers:",
    ]
    for host, devices in hosts:
        ssh = {
            "target": host.addr,
            "user": "root",
            "identity_file": str(kit.user_key),
            "known_hosts": str(kit.known_hosts),
        }
        lines += [
            f"  - host: {host.name}",
            f"    devices: {devices}",
            f"    tunnel: {'false' if host in direct else 'true'}",
            f"    python: {_python_wrapper(tmp_path)}",
            f"    ssh: {json.dumps(ssh)}",
        ]
    cluster = tmp_path / "cluster.yml"
    cluster.write_text("\n".join(lines) + "\n")
    return cluster


def _listen_addresses(port: int) -> set[str]:
    """The local addresses (kernel hex) of this namespace's TCP listeners on ``port``."""
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            address, _, hex_port = fields[1].partition(":")
            if fields[3] == TCP_LISTEN and int(hex_port, 16) == port:
                found.add(address)
    return found


def _dial_from(host: NsHost, address: str, port: int) -> str:
    """Connect from inside ``host``'s namespace: 'connected' or the error's class name."""
    probe = (
        "import socket, sys\n"
        "try:\n"
        f"    socket.create_connection(({address!r}, {port}), timeout=10).close()\n"
        "    print('connected')\n"
        "except OSError as exc:\n"
        "    print(type(exc).__name__)\n"
    )
    done = subprocess.run(
        ["ip", "netns", "exec", host.ns, sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


def test_tunnel_hosts_join_a_loopback_only_controller_and_run(
    hostkit: HostKit, tmp_path: Path
) -> None:
    h1, h2 = hostkit.hosts[:2]
    port = free_port()
    cluster = _tunnel_cluster(tmp_path, hostkit, [(h1, "cpu:2"), (h2, "cpu:1")], port=port)
    release = tmp_path / "release"
    launcher = Launcher(
        str(cluster), "--", PY, script("wait_for_file.py"), str(release), run_id=new_run_id()
    )
    try:
        launcher.wait_for_stdout("ready pid", count=3, timeout=120)
        # The controller's one port listens on loopback only ...
        assert _listen_addresses(port) == {LOOPBACK_HEX}
        # ... so a host cannot reach it on the bridge: the ssh tunnel is its only way in.
        assert _dial_from(h1, hostkit.controller_addr, port) == "ConnectionRefusedError"
        release.write_text("")
        done = launcher.finish(timeout=120)
    finally:
        launcher.kill()
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("released") == 3, done.stdout
    assert hostkit.leftovers() == {}
    assert_nothing_left(launcher.run_id)


def test_tunnel_hosts_get_the_env_contract_through_their_relay(
    hostkit: HostKit, tmp_path: Path
) -> None:
    h1, h2 = hostkit.hosts[:2]
    cluster = _tunnel_cluster(tmp_path, hostkit, [(h1, "cpu:1"), (h2, "cpu:2")], port=free_port())
    out_dir = tmp_path / "envs"
    out_dir.mkdir()
    run_id = new_run_id()
    done = run_launch(
        str(cluster), "--", PY, script("dump_env.py"), str(out_dir), run_id=run_id, timeout=180
    )
    assert done.returncode == 0, done.stderr
    seen = {
        int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out_dir.glob("env-*.json")
    }
    assert sorted(seen) == [0, 1, 2]
    assert {e["WORLD_SIZE"] for e in seen.values()} == {"3"}
    assert {e["GROUP_RANK"] for e in seen.values()} == {"0", "1"}  # both hosts joined
    # Each agent dialled its controller on the host's own loopback (the tunnel's end), so the
    # interface of its join connection, which it hands its ranks, is lo.
    assert {e["GLOO_SOCKET_IFNAME"] for e in seen.values()} == {"lo"}
    # The store rides the controller's port as each host reaches it: a tunnelled host on its own
    # loopback, at its tunnel's port (one per host, each ssh session forwarding its own).
    assert {e["MASTER_ADDR"] for e in seen.values()} == {"127.0.0.1"}
    ports = {
        g: {e["MASTER_PORT"] for e in seen.values() if e["GROUP_RANK"] == g} for g in ("0", "1")
    }
    assert all(len(p) == 1 for p in ports.values()), ports
    assert "Traceback" not in done.stderr
    assert hostkit.leftovers() == {}
    assert_nothing_left(run_id)


def test_ranks_say_hello_and_heartbeat_to_the_controller_through_relay_and_tunnel(
    hostkit: HostKit, tmp_path: Path
) -> None:
    h1, h2 = hostkit.hosts[:2]
    cluster = _tunnel_cluster(tmp_path, hostkit, [(h1, "cpu:2"), (h2, "cpu:1")], port=free_port())
    run_id = new_run_id()
    done = run_launch(str(cluster), "--", PY, script("relay_client.py"), run_id=run_id, timeout=180)
    assert done.returncode == 0, done.stderr
    # Each welcome and heartbeat answer came from the controller, which only the tunnels reach.
    assert done.stdout.count(f"welcomed by run {run_id}; heartbeat rtts ms") == 3, done.stdout
    assert hostkit.leftovers() == {}
    assert_nothing_left(run_id)


def test_a_tunnel_host_and_a_direct_host_share_a_wildcard_bound_controller(
    hostkit: HostKit, tmp_path: Path
) -> None:
    h1, h2 = hostkit.hosts[:2]
    port = free_port()
    cluster = _tunnel_cluster(
        tmp_path, hostkit, [(h1, "cpu:1"), (h2, "cpu:1")], port=port, direct=[h2]
    )
    out_dir = tmp_path / "envs"
    out_dir.mkdir()
    run_id = new_run_id()
    done = run_launch(
        str(cluster), "--", PY, script("dump_env.py"), str(out_dir), run_id=run_id, timeout=180
    )
    assert done.returncode == 0, done.stderr
    by_group = {
        e["GROUP_RANK"]: e for e in (json.loads(p.read_text()) for p in out_dir.glob("env-*.json"))
    }
    assert sorted(by_group) == ["0", "1"]
    # h1 came in on its loopback (the tunnel's end), h2 on its bridge interface.
    assert sorted(e["GLOO_SOCKET_IFNAME"] for e in by_group.values()) == ["eth0", "lo"]
    assert hostkit.leftovers() == {}
    assert_nothing_left(run_id)


def test_an_sshd_that_refuses_forwarding_is_named_with_what_to_do(tmp_path: Path) -> None:
    require_namespace_hosts()  # its own kit, not the fixture's: skips or fails as the fixture does
    kit = HostKit.create(1, sshd_options=("AllowTcpForwarding no",))
    try:
        cluster = _tunnel_cluster(tmp_path, kit, [(kit.hosts[0], "cpu:1")], port=free_port())
        run_id = new_run_id()
        done = run_launch(
            str(cluster), "--", PY, script("dump_env.py"), str(tmp_path), run_id=run_id, timeout=180
        )
        assert done.returncode == 3, done.stderr
        assert (
            f"sshd on {kit.hosts[0].addr}:22 refused the tunnel's remote port forward"
            in done.stderr
        )
        assert "AllowTcpForwarding" in done.stderr
        assert "Traceback" not in done.stderr
        assert kit.leftovers() == {}
        assert_nothing_left(run_id)
    finally:
        kit.close()
