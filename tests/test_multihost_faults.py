"""Multi-host failures on namespace hosts (tests/hostkit.py): a cut link, a killed ssh session, the secret in no log or page, a host dying before it joins.

A cut cable is ``ip link set <veth> down`` on the host's peer in the root namespace: the TCP
links to that host stay open and silent, so only the heartbeat deadline can tell. The
launcher's deadlines are scaled down (FLODL_NET_TIMEOUT_SCALE) and reach every agent in its
spec, so each run takes seconds; nothing below asserts a duration, only outcomes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from flodl_async.deadlines import Deadlines
from flodl_async.wire import new_session_secret

from .hostkit import HostKit, NsHost
from .launchkit import PY, Launcher, new_run_id, processes_of_run, script, wait_status
from .test_fanout_e2e import _cluster, _python_wrapper

pytestmark = pytest.mark.e2e

#: Silence deadline 6 s (interval 1.2 s) at the machine's own scale 1; a loaded machine's scale multiplies it.
#: Not smaller: ssh_connect (9 s here) also bounds each agent's start over ssh.
SCALE = 0.6 * float(os.environ.get("FLODL_NET_TIMEOUT_SCALE", "1") or "1")
SILENCE = Deadlines.resolve(env={"FLODL_NET_TIMEOUT_SCALE": str(SCALE)}).heartbeat_silence
ENV = {"FLODL_NET_TIMEOUT_SCALE": str(SCALE)}


def _peer_veth(kit: HostKit, host: NsHost) -> str:
    """The root namespace's end of ``host``'s cable (hostkit names it fv<tag><index>)."""
    return f"fv{kit.tag}{host.name.removeprefix('h')}"


@contextlib.contextmanager
def _link_down(kit: HostKit, host: NsHost) -> Iterator[None]:
    """The host's cable pulled for the block; plugged back in whatever happens, for the next tests."""
    veth = _peer_veth(kit, host)
    subprocess.run(["ip", "link", "set", veth, "down"], check=True, capture_output=True, timeout=60)
    try:
        yield
    finally:
        subprocess.run(
            ["ip", "link", "set", veth, "up"], check=True, capture_output=True, timeout=60
        )


def _ours_on(kit: HostKit, host: NsHost) -> list[str]:
    """Command lines of the processes on ``host`` other than sshd (its listener and its per-connection children)."""
    found = []
    for pid in kit.host_pids(host.ns):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if not argv[0].startswith(b"sshd"):
                found.append(b" ".join(argv).decode(errors="replace"))
    return found


def _three_host_run(
    tmp_path: Path, kit: HostKit, *extra: str, run_id: str
) -> tuple[Launcher, Path, int]:
    """A run of 4 ranks on h1 (2), h2, h3 that wait for a release file; returns once all 4 are ready."""
    h1, h2, h3 = kit.hosts[:3]
    cluster = _cluster(
        tmp_path,
        kit,
        [(h1, "cpu:2"), (h2, "cpu:1"), (h3, "cpu:1")],
        python=str(_python_wrapper(tmp_path)),
    )
    port = int(cluster.read_text().split("port: ", 1)[1].split(",", 1)[0])
    release = tmp_path / "release"
    launcher = Launcher(
        str(cluster),
        "--stop-grace",
        "3",
        *extra,
        "--",
        PY,
        script("wait_for_file.py"),
        str(release),
        run_id=run_id,
        env=ENV,
    )
    try:
        launcher.wait_for_stdout("ready pid", count=4, timeout=120)
    except BaseException:
        launcher.kill()
        raise
    return launcher, release, port


def test_a_cut_link_names_the_host_and_the_cut_off_host_stops_its_ranks(
    hostkit: HostKit, tmp_path: Path
) -> None:
    h2 = hostkit.hosts[1]
    launcher, _release, _port = _three_host_run(tmp_path, hostkit, run_id=new_run_id())
    try:
        with _link_down(hostkit, h2):
            cut_at = time.monotonic()
            done = launcher.finish(
                timeout=60 + 4 * SILENCE
            )  # also: every rank of the run is gone, h2's included
            took = time.monotonic() - cut_at
            # Within the deadline: the heartbeat silence, the others' stop grace (3 s) and a loaded
            # machine's slack; a verdict left to TCP (retransmits for 15 min) or the join window would not be.
            assert took < SILENCE + 3 + 20, (
                f"the verdict came {took:.1f}s after the cut (silence {SILENCE:g}s)"
            )
            # Cut off, h2's agent hears no controller for the silence deadline and stops its ranks by itself.
            deadline = time.monotonic() + 60 + 4 * SILENCE
            while (left := _ours_on(hostkit, h2)) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert left == [], f"still on {h2.name} with its link down: {left}"
    finally:
        launcher.kill()
    assert done.returncode == 4, done.stderr
    verdict = done.stderr.strip().splitlines()[-1]
    assert "h2" in verdict, done.stderr
    assert f"agent on host 'h2' was lost mid-run: no heartbeat for {SILENCE:g}s" in done.stderr, (
        done.stderr
    )
    assert "on host 'h1'" not in done.stderr, done.stderr  # the hosts still heard are not accused
    assert "on host 'h3'" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    # With the link back, h2's sshd session children learn their connections are gone; the fixture then finds h2 empty.


def _get(port: int, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return bytes(response.read())


def test_the_secret_is_in_no_log_line_and_not_on_the_status_page(
    hostkit: HostKit, tmp_path: Path
) -> None:
    secret = new_session_secret()
    secret_file = tmp_path / "secret"
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
    launcher, release, port = _three_host_run(
        tmp_path, hostkit, "--secret-file", str(secret_file), run_id=new_run_id()
    )
    try:
        wait_status(
            port, lambda d: d["joined_ranks"] == 4
        )  # the pages are read while the whole world is up
        pages = {"/state.json": _get(port, "/state.json"), "/": _get(port, "/")}
        release.write_text("")
        done = launcher.finish(timeout=120)
    finally:
        launcher.kill()
    assert done.returncode == 0, done.stderr
    # Every agent's stdout and stderr reach us only through its ssh session, relayed into the launcher's own.
    assert done.stdout.count("ready pid") == 4, done.stdout
    assert done.stdout.count("released") == 4, done.stdout
    needles = {secret.hex(), secret.hex().upper()}
    texts = {
        "launcher stdout": done.stdout,
        "launcher stderr": done.stderr,
        **{f"status {p}": b.decode(errors="replace") for p, b in pages.items()},
    }
    for where, text in texts.items():
        for needle in needles:
            assert needle not in text, f"the secret is in the {where}"
    for where, raw in pages.items():
        assert secret not in raw, f"the secret's raw bytes are in the status page {where}"


def test_a_host_that_dies_before_joining_fails_the_window_at_once_naming_it(
    hostkit: HostKit, tmp_path: Path
) -> None:
    h1, h2, h3 = hostkit.hosts[:3]
    slow = tmp_path / "slow-python"
    slow.write_text(
        f'#!/bin/sh\nsleep 600\nexec {_python_wrapper(tmp_path)} "$@"\n'
    )  # h3 hangs before its agent starts
    slow.chmod(0o700)
    cluster = _cluster(
        tmp_path, hostkit, [(h1, "cpu:1"), (h2, "cpu:1")], python=str(_python_wrapper(tmp_path))
    )
    text = cluster.read_text()
    h3_line = f"  - host: {h3.name}\n    devices: cpu:1\n    python: {slow}\n"
    ssh_h2 = text.split("    ssh: ")[-1]
    cluster.write_text(text + h3_line + "    ssh: " + ssh_h2.replace(h2.addr, h3.addr))
    run_id = new_run_id()
    launcher = Launcher(
        str(cluster),
        "--stop-grace",
        "3",
        "--",
        PY,
        script("wait_for_file.py"),
        str(tmp_path / "never"),
        run_id=run_id,
        env=ENV,
    )
    try:
        deadline = time.monotonic() + 120
        while not any("sleep 600" in c for c in _ours_on(hostkit, h3)):
            assert time.monotonic() < deadline, "h3's python never started"
            assert launcher.proc.poll() is None, launcher.proc.communicate()
            time.sleep(0.05)
        hostkit.power_off(
            h3.ns
        )  # the host dies: everything of it but the sshd listener, which keeps the bridge port up
        done = launcher.finish(timeout=120)
    finally:
        launcher.kill()
    assert done.returncode == 3, done.stderr
    verdict = done.stderr.strip().splitlines()[-1]
    # At once: the verdict's cause is the lost connection, not the join window running out.
    assert "the world did not form: agent on host 'h3' failed before joining" in verdict, (
        done.stderr
    )
    assert f"the ssh connection to {h3.addr}:22 was lost before the agent said hello" in verdict, (
        done.stderr
    )
    assert "Traceback" not in done.stderr, done.stderr[-6000:]
    assert processes_of_run(run_id) == []


def test_a_killed_ssh_session_mid_run_names_the_host_and_its_agent_stops_its_ranks(
    hostkit: HostKit, tmp_path: Path
) -> None:
    h2 = hostkit.hosts[1]
    launcher, _release, _port = _three_host_run(tmp_path, hostkit, run_id=new_run_id())
    try:
        # host_pids leaves out the listener; what remains named "sshd..." are its per-connection children.
        sessions = [
            p
            for p in hostkit.host_pids(h2.ns)
            if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"sshd")
        ]
        assert sessions, f"no sshd session on {h2.name}"
        for (
            pid
        ) in sessions:  # sshd's side of the agent's lifeline dies; the agent sees EOF on its stdin
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        done = launcher.finish(
            timeout=60 + 4 * SILENCE
        )  # also: every rank of the run is gone, h2's included
    finally:
        launcher.kill()
    assert done.returncode == 4, done.stderr
    verdict = done.stderr.strip().splitlines()[-1]
    # Two true stories race, and either may reach the verdict first: the launcher sees the ssh connection go,
    # or h2's agent, its lifeline cut, stops its ranks and reports a rank stopped by SIGTERM up its join link
    # (which does not ride the ssh session). Both name h2, and in both every rank is gone.
    lost = f"agent on host 'h2' was lost mid-run: agent h2: the ssh connection to {h2.addr}:22 was lost"
    stopped = "on host 'h2' was killed by SIGTERM"
    assert lost in verdict or stopped in verdict, done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-6000:]
