"""ssh fan-out on namespace hosts (tests/hostkit.py): real sshd, real agents, real gloo across hosts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from flodl_async._version import __version__
from flodl_async.wire import new_session_secret

from .hostkit import HostKit, NsHost
from .launchkit import (
    PY,
    Finished,
    Launcher,
    assert_nothing_left,
    free_port,
    new_run_id,
    run_launch,
    script,
)

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent


def _python_wrapper(tmp_path: Path) -> Path:
    """A remote `python:` that imports this checkout's flodl_async (namespaces share the filesystem)."""
    wrapper = tmp_path / "python3"
    wrapper.write_text(f'#!/bin/sh\nexport PYTHONPATH={REPO}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(stat.S_IRWXU)
    return wrapper


def _cluster(
    tmp_path: Path,
    kit: HostKit,
    hosts: Sequence[tuple[NsHost, str]],
    *,
    python: str,
    known_hosts: Path | None = None,
    identity: Path | None = None,
    options: Sequence[str] = (),
) -> Path:
    lines = [
        f"controller: {{host: 0.0.0.0, port: {free_port()}, join: {{join_timeout: 60}}}}",
        "workers:",
    ]
    for host, devices in hosts:
        ssh = {
            "target": host.addr,
            "user": "root",
            "identity_file": str(identity or kit.user_key),
            "known_hosts": str(known_hosts or kit.known_hosts),
            **({"options": list(options)} if options else {}),
        }
        lines += [
            f"  - host: {host.name}",
            f"    devices: {devices}",
            f"    python: {python}",
            f"    ssh: {json.dumps(ssh)}",
        ]
    cluster = tmp_path / "cluster.yml"
    cluster.write_text("\n".join(lines) + "\n")
    return cluster


def _launch(cluster: Path, *command: str, timeout: float = 180) -> Finished:
    return run_launch(str(cluster), "--", *command, run_id=new_run_id(), timeout=timeout)


def test_three_hosts_run_a_gloo_all_reduce_with_the_env_contract(
    hostkit: HostKit, tmp_path: Path
) -> None:
    h1, h2, h3 = hostkit.hosts[:3]
    cluster = _cluster(
        tmp_path,
        hostkit,
        [(h1, "cpu:2"), (h2, "cpu:1"), (h3, "cpu:1")],
        python=str(_python_wrapper(tmp_path)),
    )
    out_dir = tmp_path / "envs"
    out_dir.mkdir()
    done = _launch(cluster, PY, script("allreduce_env.py"), str(out_dir))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(" of 4 sum 10") == 4, done.stdout
    seen = {
        int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out_dir.glob("env-*.json")
    }
    assert sorted(seen) == [0, 1, 2, 3]  # RANK contiguous
    by_host: dict[str, list[dict[str, str]]] = {}
    for rank in sorted(seen):
        by_host.setdefault(seen[rank]["hostname"], []).append(seen[rank]["env"])
    assert {name: len(envs) for name, envs in by_host.items()} == {"h1": 2, "h2": 1, "h3": 1}
    for envs in by_host.values():
        assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {str(len(envs))}
        assert len({e["GROUP_RANK"] for e in envs}) == 1
        assert {e["GLOO_SOCKET_IFNAME"] for e in envs} == {
            "eth0"
        }  # the interface of the join connection
        assert sorted(int(e["LOCAL_RANK"]) for e in envs) == list(range(len(envs)))
    assert sorted({e["GROUP_RANK"] for envs in by_host.values() for e in envs}) == ["0", "1", "2"]
    envs = [e for es in by_host.values() for e in es]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    # The store rides the controller's port: every host's ranks reach it where their agent reached the controller.
    assert {e["MASTER_ADDR"] for e in envs} == {hostkit.controller_addr}
    assert len({e["MASTER_PORT"] for e in envs}) == 1


def test_an_unknown_host_key_names_the_host_the_fingerprint_and_the_file(
    hostkit: HostKit, tmp_path: Path
) -> None:
    h1 = hostkit.hosts[0]
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    cluster = _cluster(
        tmp_path, hostkit, [(h1, "cpu:1")], python=str(_python_wrapper(tmp_path)), known_hosts=empty
    )
    done = _launch(cluster, PY, script("allreduce.py"))
    assert done.returncode == 3, done.stderr
    assert f"the host key of {h1.addr}:22 is unknown: it offers SHA256:" in done.stderr
    assert str(empty) in done.stderr
    assert "h1" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_changed_host_key_is_refused_naming_both(hostkit: HostKit, tmp_path: Path) -> None:
    h1, h2 = hostkit.hosts[:2]
    wrong = tmp_path / "known_hosts"
    wrong.write_text(f"{h1.addr} {h2.host_key_pub}\n")  # h2's key listed for h1
    cluster = _cluster(
        tmp_path, hostkit, [(h1, "cpu:1")], python=str(_python_wrapper(tmp_path)), known_hosts=wrong
    )
    done = _launch(cluster, PY, script("allreduce.py"))
    assert done.returncode == 3, done.stderr
    assert f"the host key of {h1.addr}:22 CHANGED: it offers SHA256:" in done.stderr
    assert f"ssh-keygen -R {h1.addr} -f {wrong}" in done.stderr


def test_a_wrong_user_key_names_the_key(hostkit: HostKit, tmp_path: Path) -> None:
    h1 = hostkit.hosts[0]
    stranger = tmp_path / "id_stranger"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True, timeout=60
    )
    cluster = _cluster(
        tmp_path, hostkit, [(h1, "cpu:1")], python=str(_python_wrapper(tmp_path)), identity=stranger
    )
    done = _launch(cluster, PY, script("allreduce.py"))
    assert done.returncode == 3, done.stderr
    assert f"ssh authentication to {h1.addr}:22 as root failed with {stranger}" in done.stderr


def test_a_missing_python_is_named(hostkit: HostKit, tmp_path: Path) -> None:
    h1 = hostkit.hosts[0]
    cluster = _cluster(tmp_path, hostkit, [(h1, "cpu:1")], python="/nonexistent/python3")
    done = _launch(cluster, PY, script("allreduce.py"))
    assert done.returncode == 3, done.stderr
    assert (
        "python '/nonexistent/python3' was not found on "
        f"{h1.addr}:22 (exit 127) — set the worker's python: in the cluster file to its path there"
        in done.stderr
    ), done.stderr
    assert "ssh settings" not in done.stderr  # the ssh side worked: its advice is not this cause's


def test_flodl_async_missing_on_the_host_is_named(hostkit: HostKit, tmp_path: Path) -> None:
    h1 = hostkit.hosts[0]
    bare = tmp_path / "bare-python"
    bare.write_text(
        f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n'
    )  # no site-packages, no PYTHONPATH: flodl_async is absent
    bare.chmod(stat.S_IRWXU)
    cluster = _cluster(tmp_path, hostkit, [(h1, "cpu:1")], python=str(bare))
    done = _launch(cluster, PY, script("allreduce.py"))
    assert done.returncode == 3, done.stderr
    assert (
        f"flodl_async is not importable by {bare} on {h1.addr}:22 — install flodl_async "
        f"{__version__} there (or set the worker's python: in the cluster file)" in done.stderr
    ), done.stderr
    assert "ssh settings" not in done.stderr


def test_proxy_jump_reaches_a_host_through_another(hostkit: HostKit, tmp_path: Path) -> None:
    h1, h2 = hostkit.hosts[:2]
    log = hostkit.root / h2.name / "sshd.log"
    before = log.read_text()
    cluster = _cluster(
        tmp_path,
        hostkit,
        [(h2, "cpu:1")],
        python=str(_python_wrapper(tmp_path)),
        options=[f"ProxyJump=root@{h1.addr}"],
    )
    done = _launch(cluster, PY, script("allreduce.py"))
    assert done.returncode == 0, done.stderr
    assert "rank 0 of 1 sum 1" in done.stdout
    assert (
        f"Connection from {h1.addr} port" in log.read_text()[len(before) :]
    )  # h2 was reached from h1, not from us


def _agent_pid(kit: HostKit, host: NsHost) -> int:
    for pid in kit.host_pids(host.ns):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"flodl_async.agent" in argv and b"--spec-stdin" in argv:
                return pid
    raise AssertionError(f"no agent process on {host.name}")


def _running(tmp_path: Path, kit: HostKit, *extra: str) -> tuple[Launcher, Path]:
    h1, h2, h3 = kit.hosts[:3]
    cluster = _cluster(
        tmp_path,
        kit,
        [(h1, "cpu:2"), (h2, "cpu:1"), (h3, "cpu:1")],
        python=str(_python_wrapper(tmp_path)),
    )
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
        run_id=new_run_id(),
    )
    try:
        launcher.wait_for_stdout("ready pid", count=4, timeout=120)
    except BaseException:
        launcher.kill()
        raise
    return launcher, release


def test_the_secret_is_in_no_remote_argv(hostkit: HostKit, tmp_path: Path) -> None:
    secret = new_session_secret().hex()
    secret_file = tmp_path / "secret"
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    launcher, release = _running(tmp_path, hostkit, "--secret-file", str(secret_file))
    try:
        scanned = 0
        for host in hostkit.hosts[:3]:
            for pid in hostkit.host_pids(host.ns):
                with contextlib.suppress(OSError):
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes()
                    scanned += 1
                    assert secret.encode() not in argv.lower(), (
                        f"the secret is in the argv of pid {pid} on {host.name}"
                    )
        assert scanned >= 3 + 4  # at least each agent and each rank were looked at
        release.write_text("")
        done = launcher.finish(timeout=120)
    finally:
        launcher.kill()
    assert done.returncode == 0, done.stderr


def test_kill_9_of_one_agent_fails_the_run_naming_its_host(
    hostkit: HostKit, tmp_path: Path
) -> None:
    launcher, _ = _running(tmp_path, hostkit)
    try:
        os.kill(_agent_pid(hostkit, hostkit.hosts[1]), signal.SIGKILL)
        done = launcher.finish(timeout=120)
    finally:
        launcher.kill()
    assert done.returncode == 4, done.stderr
    assert "h2" in done.stderr.splitlines()[-1], done.stderr


def test_the_launcher_killed_leaves_every_host_clean_within_the_stop_grace(
    hostkit: HostKit, tmp_path: Path
) -> None:
    launcher, _ = _running(tmp_path, hostkit)
    launcher.proc.kill()
    launcher.kill()
    # The ssh sessions die with the launcher; each agent sees EOF on stdin and stops its ranks
    # (TERM, then KILL 3s later). The fixture's check then finds nothing on any host.
    assert hostkit.leftovers(within=3 + 10) == {}
    assert_nothing_left(launcher.run_id)


def test_another_flodl_async_version_names_both(hostkit: HostKit, tmp_path: Path) -> None:
    h1 = hostkit.hosts[0]
    other = tmp_path / "other-python"
    other.write_text(
        "#!/bin/sh\necho flodl-agent-hello 0.0.1\ncat >/dev/null\n"
    )  # an agent of another version
    other.chmod(stat.S_IRWXU)
    cluster = _cluster(tmp_path, hostkit, [(h1, "cpu:1")], python=str(other))
    done = _launch(cluster, PY, script("allreduce.py"))
    assert done.returncode == 3, done.stderr
    assert (
        f"{h1.addr}:22 has flodl_async 0.0.1, this launcher is {__version__} — install the same flodl_async version on every host"
        in done.stderr
    )


def test_ranks_on_ssh_hosts_report_their_activity_and_only_local_clients_read_their_lines(
    hostkit: HostKit, tmp_path: Path
) -> None:
    """Hangs you can see on every host: each ssh-started agent reports its ranks; a status client on another host gets the ages, not the lines."""
    import re

    from .launchkit import wait_status

    launcher, release = _running(tmp_path, hostkit)
    try:
        port = int(re.search(r"port: (\d+)", (tmp_path / "cluster.yml").read_text()).group(1))  # type: ignore[union-attr]

        def all_reported(doc: dict[str, object]) -> bool:
            ranks = doc["ranks"]
            return (
                isinstance(ranks, list)
                and len(ranks) == 4
                and all(isinstance(r.get("pid"), int) and r.get("process") for r in ranks)
            )

        local = wait_status(port, all_reported, timeout=60)
        ranks = local["ranks"]
        assert isinstance(ranks, list)
        assert {r["host"] for r in ranks} == {"h1", "h2", "h3"}
        assert all(
            r["last_line"].startswith("ready pid ") for r in ranks
        )  # the controller's own host sees the lines
        fetch = f"import json, urllib.request; print(urllib.request.urlopen('http://{hostkit.controller_addr}:{port}/state.json', timeout=10).read().decode())"
        remote = subprocess.run(
            ["ip", "netns", "exec", hostkit.hosts[0].ns, PY, "-c", fetch],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        remote_ranks = json.loads(remote.stdout)["ranks"]
        assert [r["last_line"] for r in remote_ranks] == ["", "", "", ""]
        assert all(r["output_age_s"] is not None for r in remote_ranks)
        assert "ready pid" not in remote.stdout
        release.touch()
        done = launcher.finish(timeout=120)
    finally:
        release.touch()
        launcher.kill()
    assert done.returncode == 0, done.stderr


def test_a_failed_rank_is_said_once_not_again_by_each_remote_agent(
    hostkit: HostKit, tmp_path: Path
) -> None:
    """The controller's verdict names the failed rank; an agent it started over ssh does not echo
    the Abort's reason up its stderr (the console would read it once per remote host, unnamed)."""
    h1, h2 = hostkit.hosts[:2]
    cluster = _cluster(
        tmp_path, hostkit, [(h1, "cpu:1"), (h2, "cpu:1")], python=str(_python_wrapper(tmp_path))
    )
    done = _launch(cluster, PY, script("fail.py"))
    assert done.returncode == 4, done.stderr
    verdict = next(line for line in done.stderr.splitlines() if "FAILED" in line)
    assert re.search(r"rank 1 \(local rank 0\) on host 'h[12]' exited with code 3", verdict), (
        done.stderr
    )
    # the controller's line and its verdict; no agent repeats them
    assert done.stderr.count("exited with code 3") == 2, done.stderr
    assert "flodl-agent:" not in done.stderr, done.stderr
