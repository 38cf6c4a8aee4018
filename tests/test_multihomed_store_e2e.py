"""A multi-homed host's ranks reach the store on the controller's port from another of its addresses (namespace hosts).

The store admits a connection by its source address. An agent reports every address of its
host at join (:mod:`flodl_async.host.hostaddrs`), so a rank dialing from a second address of an
admitted host is served; an address of no host in the run is still refused.
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from flodl_async.host.hostaddrs import parse_fib_trie, parse_if_inet6, routable

from .hostkit import HostKit, NsHost, worker_python
from .launchkit import PY, free_port, new_run_id, run_launch, script

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent

FIB_TRIE = """\
Main:
  +-- 0.0.0.0/0 3 0 5
     +-- 10.77.5.0/24 2 0 2
        |-- 10.77.5.0
           /24 link UNICAST
        |-- 10.77.5.4
           /32 host LOCAL
        |-- 10.77.5.200
           /32 host LOCAL
        |-- 10.77.5.255
           /32 link BROADCAST
     +-- 127.0.0.0/8 2 0 2
        |-- 127.0.0.1
           /32 host LOCAL
Local:
  +-- 0.0.0.0/0 3 0 5
        |-- 10.77.5.4
           /32 host LOCAL
"""

IF_INET6 = """\
fd000000000000000000000000000002 04 40 00 82     eth0
00000000000000000000000000000001 01 80 10 80       lo
fe8000000000000000fc00fffe000001 04 40 20 80     eth0
"""


def test_every_local_address_is_read_from_the_kernel_tables_and_only_routable_ones_kept() -> None:
    found = parse_fib_trie(FIB_TRIE) + parse_if_inet6(IF_INET6)
    assert found == [
        "10.77.5.4",
        "10.77.5.200",
        "127.0.0.1",
        "fd00::2",
        "::1",
        "fe80::fc:ff:fe00:1",
    ]
    assert routable(found) == [
        "10.77.5.4",
        "10.77.5.200",
        "fd00::2",
    ]  # loopback and link-local name another machine there
    assert routable(["::ffff:10.0.0.1", "10.0.0.1", "not an address", "0.0.0.0", "224.0.0.1"]) == [
        "10.0.0.1"
    ]


def _ns(host: NsHost, *argv: str) -> None:
    subprocess.run(
        ["ip", "netns", "exec", host.ns, *argv], check=True, capture_output=True, timeout=60
    )


def test_ranks_dialing_the_store_from_a_second_address_of_their_host_are_served(
    hostkit: HostKit, tmp_path: Path
) -> None:
    h1, h2 = hostkit.hosts[:2]
    second = f"{hostkit.prefix}.{200 + secrets_byte()}"
    wrapper = worker_python(tmp_path, repo=REPO)
    lines = [
        f"controller: {{host: 0.0.0.0, port: {free_port()}, join: {{join_timeout: 60}}}}",
        "workers:",
    ]
    for host in (h1, h2):
        ssh = hostkit.ssh_worker(host)
        lines += [
            f"  - host: {host.name}",
            "    devices: cpu:1",
            f"    python: {wrapper}",
            f"    ssh: {json.dumps(ssh)}",
        ]
    cluster = tmp_path / "cluster.yml"
    cluster.write_text("\n".join(lines) + "\n")
    _ns(h2, "ip", "addr", "add", f"{second}/24", "dev", "eth0")
    try:
        done = run_launch(
            str(cluster),
            "--",
            PY,
            script("store_from_second_address.py"),
            second,
            h2.name,
            run_id=new_run_id(),
            timeout=180,
        )
    finally:
        subnet = f"{hostkit.prefix}.0/24"
        _ns(
            h2,
            "ip",
            "route",
            "replace",
            subnet,
            "dev",
            "eth0",
            "src",
            h2.addr,
            "proto",
            "kernel",
            "scope",
            "link",
        )
        _ns(h2, "ip", "addr", "del", f"{second}/24", "dev", "eth0")
    assert f"{h2.name} dials the store from {second}" in done.stdout, (
        done.stdout
    )  # the case under test did happen
    assert f"{h1.name} dials the store from {h1.addr}" in done.stdout
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(" of 2 sum 3") == 2, done.stdout


def test_a_store_connection_from_an_address_of_no_host_is_still_refused(
    hostkit: HostKit, tmp_path: Path
) -> None:
    """The controller's own bridge address is no host of a run of remote workers: its store connection is closed."""
    from .launchkit import Launcher, wait_status

    h1 = hostkit.hosts[0]
    port = free_port()
    wrapper = worker_python(tmp_path, repo=REPO)
    ssh = hostkit.ssh_worker(h1)
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"controller: {{host: 0.0.0.0, port: {port}, join: {{join_timeout: 60}}}}\nworkers:\n"
        f"  - host: {h1.name}\n    devices: cpu:1\n    python: {wrapper}\n    ssh: {json.dumps(ssh)}\n"
    )
    gate = tmp_path / "go"
    launcher = Launcher(
        str(cluster), "--", PY, script("wait_for_file.py"), str(gate), run_id=new_run_id()
    )
    try:
        wait_status(port, lambda doc: doc["phase"] == "training")
        with socket.create_connection((hostkit.controller_addr, port), timeout=10) as probe:
            probe.sendall(
                bytes.fromhex("00cef7853c")
            )  # torch's VALIDATE prefix, from an address of no host
            probe.settimeout(10)
            assert probe.recv(16) == b""  # closed at once, nothing served
        doc = wait_status(
            port, lambda doc: doc["connections"]["dropped"].get("store_not_admitted", 0) >= 1
        )
        assert doc["connections"]["dropped"]["store_not_admitted"] >= 1
    finally:
        gate.write_text("")
        launcher.finish(timeout=60)
        launcher.kill()


def secrets_byte() -> int:
    import secrets

    return secrets.randbelow(50)
