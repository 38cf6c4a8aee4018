"""The namespace hosts themselves: each is reachable over real ssh, has its own hostname and address."""

from __future__ import annotations

import secrets
import subprocess
import tempfile
from pathlib import Path

import pytest

from flodl_async.host.runtime import ProcessIdentity, process_start_time

from .hostkit import HostKit, sweep_abandoned_kits

pytestmark = pytest.mark.e2e


def test_each_host_answers_ssh_with_its_own_name_and_address(hostkit: HostKit) -> None:
    for host in hostkit.hosts[:3]:
        out = subprocess.run(
            hostkit.ssh_argv(host, "hostname; ip -o -4 addr show dev eth0"),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        name, addr_line = out.stdout.splitlines()
        assert name == host.name
        assert f" {host.addr}/24 " in addr_line
    assert hostkit.leftovers() == {}


def test_hosts_reach_each_other_and_the_controller_address(hostkit: HostKit) -> None:
    a, b = hostkit.hosts[0], hostkit.hosts[1]
    probe = f'python3 -c \'import socket; socket.create_connection(("{b.addr}", 22), timeout=10).close(); print("ok")\''
    out = subprocess.run(
        hostkit.ssh_argv(a, probe), capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "ok"
    assert hostkit.leftovers() == {}


def test_an_unknown_host_key_is_refused_by_the_client(hostkit: HostKit, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    out = subprocess.run(
        hostkit.ssh_argv(hostkit.hosts[0], "true", known_hosts=empty),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 255
    assert "Host key verification failed" in out.stderr


def test_a_kit_whose_session_died_is_taken_down_by_the_next_and_a_live_ones_is_not(
    hostkit: HostKit,
) -> None:
    """A SIGKILLed pytest never runs its fixture's teardown: the next kit made sweeps what it left."""
    gone = subprocess.Popen(["sleep", "60"])
    dead = ProcessIdentity(pid=gone.pid, start_time=process_start_time(gone.pid))
    gone.kill()
    gone.wait()
    tag = secrets.token_hex(3)
    root = Path(tempfile.mkdtemp(prefix=f"flodl-hosts-{tag}-"))
    (root / "owner").write_text(f"{dead.pid} {dead.start_time}\n")
    subprocess.run(["ip", "netns", "add", f"fl{tag}h1"], check=True)
    subprocess.run(["ip", "link", "add", f"flbr{tag}", "type", "bridge"], check=True)
    swept = sweep_abandoned_kits()
    assert tag in swept
    assert (
        f"fl{tag}h1"
        not in subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, check=True
        ).stdout
    )
    assert (
        subprocess.run(
            ["ip", "link", "show", f"flbr{tag}"], capture_output=True, check=False
        ).returncode
        != 0
    )
    assert not root.exists()
    assert hostkit.tag not in swept  # this session's own kit: its owner runs
    assert hostkit.root.exists()
