"""The namespace hosts themselves: each is reachable over real ssh, has its own hostname and address."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from .hostkit import HostKit

pytestmark = pytest.mark.e2e


def test_each_host_answers_ssh_with_its_own_name_and_address(hostkit: HostKit) -> None:
    for host in hostkit.hosts[:3]:
        out = subprocess.run(hostkit.ssh_argv(host, "hostname; ip -o -4 addr show dev eth0"), capture_output=True, text=True, timeout=60, check=True)
        name, addr_line = out.stdout.splitlines()
        assert name == host.name
        assert f" {host.addr}/24 " in addr_line
    assert hostkit.leftovers() == {}


def test_hosts_reach_each_other_and_the_controller_address(hostkit: HostKit) -> None:
    a, b = hostkit.hosts[0], hostkit.hosts[1]
    probe = f'python3 -c \'import socket; socket.create_connection(("{b.addr}", 22), timeout=10).close(); print("ok")\''
    out = subprocess.run(hostkit.ssh_argv(a, probe), capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "ok"
    assert hostkit.leftovers() == {}


def test_an_unknown_host_key_is_refused_by_the_client(hostkit: HostKit, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    out = subprocess.run(hostkit.ssh_argv(hostkit.hosts[0], "true", known_hosts=empty), capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 255
    assert "Host key verification failed" in out.stderr
