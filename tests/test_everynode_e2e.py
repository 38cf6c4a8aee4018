"""Every-node mode end to end: the same ``flodl-launch --nnodes`` command on every node.

Two nodes on this machine (one hostname: told apart by node rank) and three namespace hosts
(tests/hostkit.py, each its own hostname and address): the world forms across the nodes with
the cluster token, each rank's lines are printed once, by its own node, the verdict's exit code
reaches every node, a node started with another command is refused by name, and SIGUSR1/SIGUSR2
reach the ranks while the run goes on. Synchronised on the nodes' output, never on sleeps.
"""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from .hostkit import HostKit
from .launchkit import PY, Launcher, assert_nothing_left, free_port, new_run_id, script

pytestmark = pytest.mark.e2e

RANK_LINE = re.compile(r"^\[([^\]:]+):r(\d+)\] ", re.M)


def _token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    subprocess.run([PY, "-m", "flodl_async.cli.flodl", "token", "new", str(path)], check=True)
    return path


def _node_argv(
    rank: int, nnodes: str, endpoint: str, token: Path, command: Sequence[str], *extra: str
) -> list[str]:
    return [
        PY,
        "-m",
        "flodl_async.cli.launch",
        "--nnodes",
        nnodes,
        "--node-rank",
        str(rank),
        "--rdzv-endpoint",
        endpoint,
        "--token-file",
        str(token),
        *extra,
        "--",
        *command,
    ]


def _start(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    import os

    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _finish(
    procs: Sequence[subprocess.Popen[str]], timeout: float = 90
) -> list[tuple[int, str, str]]:
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            done.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return done


def _two_nodes(
    tmp_path: Path, run_id: str, node1_env: dict[str, str] | None = None
) -> list[tuple[int, str, str]]:
    token = tmp_path / "token"
    if not token.exists():
        _token(tmp_path)
    endpoint = f"127.0.0.1:{free_port()}"
    command = [PY, "-c", _ENV_PRINT]
    # node 1 starts first: it waits for node 0's controller
    one = _start(
        _node_argv(1, "2", endpoint, token, command, "--nproc-per-node", "2"), env=node1_env
    )
    zero = _start(
        _node_argv(
            0,
            "2",
            endpoint,
            token,
            command,
            "--nproc-per-node",
            "2",
            "--rdzv-id",
            run_id,
            "--log-dir",
            str(tmp_path / "logs"),
        )
    )
    results = _finish([zero, one])
    assert_nothing_left(run_id)
    return results


def test_same_hostname_nodes_form_one_world_and_print_each_line_once(tmp_path: Path) -> None:
    run_id = new_run_id()
    (rc0, out0, err0), (rc1, out1, err1) = _two_nodes(tmp_path, run_id)
    assert (rc0, rc1) == (0, 0), (err0, err1)
    assert "done — all 4 ranks exited 0" in err0  # the verdict: on node 0
    assert "done" not in err1
    # each node prints its own ranks' lines, once; one hostname, two names in the run
    lines0, lines1 = RANK_LINE.findall(out0), RANK_LINE.findall(out1)
    assert sorted(int(r) for _h, r in lines0) == [0, 1], out0
    assert sorted(int(r) for _h, r in lines1) == [2, 3], out1
    assert {h for h, _r in lines0} != {h for h, _r in lines1}
    assert "world 4" in out1
    assert f"run {run_id}" in out1  # --rdzv-id is the run id (TORCHELASTIC_RUN_ID), on every node
    # node 0 still logs every rank (--log-dir), the remote ones included
    logged = tmp_path / "logs" / run_id / "attempt_0" / "3" / "stdout.log"
    assert "rank 3 of world 4" in logged.read_text()


def test_every_node_exits_with_the_verdicts_code(tmp_path: Path) -> None:
    run_id = new_run_id()
    (rc0, _out0, err0), (rc1, _out1, err1) = _two_nodes(tmp_path, run_id, {"EXIT_RANK_3": "5"})
    # rank 3 (on node 1) exited 5: the verdict is node 0's, and both nodes exit with its code
    assert (rc0, rc1) == (4, 4), (err0, err1)
    assert "rank 3 (local rank 1) on host" in err0
    assert "exited with code 5" in err0


def test_a_node_started_with_another_command_is_refused_by_name(tmp_path: Path) -> None:
    token = _token(tmp_path)
    endpoint = f"127.0.0.1:{free_port()}"
    run_id = new_run_id()
    zero = _start(_node_argv(0, "2", endpoint, token, [PY, "-c", _ENV_PRINT], "--rdzv-id", run_id))
    other = _start(_node_argv(1, "2", endpoint, token, [PY, "-c", "print('other')"]))
    rc, _out, err = _finish([other])[0]
    zero.send_signal(signal.SIGTERM)
    rc0, _out0, err0 = _finish([zero])[0]
    assert_nothing_left(run_id)
    assert rc == 3
    assert "was started with another command than the controller's node" in err
    assert "#1" in err  # by name
    assert "join refused" in err0
    assert rc0 == 143


def test_three_namespace_hosts_run_the_same_command(hostkit: HostKit, tmp_path: Path) -> None:
    token = _token(tmp_path)
    h1 = hostkit.hosts[0]
    endpoint = f"{h1.addr}:{free_port()}"
    run_id = new_run_id()
    procs = [
        _start(
            hostkit.inside_argv(
                host,
                *_node_argv(
                    rank, "3", endpoint, token, [PY, "-c", _ENV_PRINT], "--rdzv-id", run_id
                ),
            )
        )
        for rank, host in reversed(list(enumerate(hostkit.hosts[:3])))
    ]
    results = _finish(procs)
    assert [rc for rc, _o, _e in results] == [0, 0, 0], [e for _r, _o, e in results]
    outs = {
        host.name: out
        for host, (_rc, out, _err) in zip(reversed(hostkit.hosts[:3]), results, strict=True)
    }
    for rank, host in enumerate(hostkit.hosts[:3]):
        lines = RANK_LINE.findall(outs[host.name])
        assert [h for h, _r in lines] == [f"{host.name}#{rank}"], outs
        assert f"hostname {host.name}" in outs[host.name]
    assert "world 3" in outs[hostkit.hosts[2].name]


def test_sigusr1_and_sigusr2_reach_every_rank_and_the_run_goes_on(tmp_path: Path) -> None:
    record = tmp_path / "record"
    run_id = new_run_id()
    launcher = Launcher(
        "--nproc", "2", "--", PY, script("record_usr.py"), str(record), run_id=run_id
    )
    try:
        launcher.wait_for_stdout("ready", count=2)
        launcher.proc.send_signal(signal.SIGUSR1)
        launcher.wait_for_stdout("got SIGUSR1", count=2)
        launcher.proc.send_signal(signal.SIGUSR2)
        done = launcher.finish()
    finally:
        launcher.kill()
    assert done.returncode == 0, done.stderr
    assert sorted(record.read_text().splitlines()) == [
        "0 SIGUSR1",
        "0 SIGUSR2",
        "1 SIGUSR1",
        "1 SIGUSR2",
    ]
    assert "SIGUSR1: passed on to the ranks of" in done.stderr


def test_each_node_passes_its_own_signals_to_its_own_ranks(tmp_path: Path) -> None:
    # a scheduler (scancel --signal=USR1, a pod's kill) signals every node's launcher
    token = _token(tmp_path)
    endpoint = f"127.0.0.1:{free_port()}"
    record = tmp_path / "record"
    run_id = new_run_id()
    command = [PY, script("record_usr.py"), str(record)]
    zero = _start(_node_argv(0, "2", endpoint, token, command, "--rdzv-id", run_id))
    one = _start(_node_argv(1, "2", endpoint, token, command))
    try:
        for proc in (zero, one):
            assert proc.stdout is not None
            assert "ready" in proc.stdout.readline()
        for proc in (zero, one):
            proc.send_signal(signal.SIGUSR1)
            assert proc.stdout is not None
            assert "got SIGUSR1" in proc.stdout.readline()
            if proc is zero:
                assert record.read_text() == "0 SIGUSR1\n"  # node 0's rank only
        for proc in (zero, one):
            proc.send_signal(signal.SIGUSR2)
        results = _finish([zero, one])
    finally:
        for proc in (zero, one):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert_nothing_left(run_id)
    assert [rc for rc, _o, _e in results] == [0, 0], [e for _r, _o, e in results]
    assert sorted(record.read_text().splitlines()) == [
        "0 SIGUSR1",
        "0 SIGUSR2",
        "1 SIGUSR1",
        "1 SIGUSR2",
    ]


_ENV_PRINT = (
    "import os, socket, sys; "
    "print(f\"rank {os.environ['RANK']} of world {os.environ['WORLD_SIZE']} group "
    "{os.environ['GROUP_RANK']} hostname {socket.gethostname()} run "
    "{os.environ['TORCHELASTIC_RUN_ID']}\", flush=True); "
    "sys.exit(int(os.environ.get('EXIT_RANK_' + os.environ['RANK'], '0')))"
)
