"""What makes a hang visible, agent side: /proc parsing, the quiet clock, and the store connection traced to a pid."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from flodl_async.agent.activity import (
    RECHECK_S,
    ProcStat,
    RankActivityTracker,
    last_line_of,
    parse_net_tcp,
    parse_stat,
    store_connections,
    tree_state,
    tree_ticks,
)
from flodl_async.host.proctree import parse_children, process_tree, socket_inodes

STAT = "4242 (python3 (x) y) S 1 4242 4242 0 -1 4194304 100 0 0 0 {utime} {stime} 0 0 20 0 3 0 {start} 1000 100 18446744073709551615"
TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:9C40 0100007F:72E0 01 00000000:00000000 00:00000000 00000000     0        0 111 1 0000000000000000 20 4 30 10 -1
   1: 0100007F:9C41 0100007F:72E0 06 00000000:00000000 00:00000000 00000000     0        0 222 1 0000000000000000 20 4 30 10 -1
   2: 0100007F:9C42 0100007F:0050 01 00000000:00000000 00:00000000 00000000     0        0 333 1 0000000000000000 20 4 30 10 -1
"""


def test_stat_fields_survive_a_command_name_with_spaces_and_parentheses() -> None:
    stat = parse_stat(STAT.format(utime=7, stime=3, start=99))
    assert stat is not None
    assert (stat.state, stat.cpu_ticks, stat.start_ticks) == ("S", 10, 99)
    assert parse_stat("garbage") is None


def test_only_established_connections_to_the_store_port_count() -> None:
    assert parse_net_tcp(TCP, 0x72E0) == frozenset({111})  # 222 is TIME_WAIT, 333 goes elsewhere
    assert parse_net_tcp(TCP, 1) == frozenset()


def test_the_last_line_is_the_last_non_blank_line_or_carriage_return_update() -> None:
    assert last_line_of(b"epoch 1\nepoch 2\n\n") == "epoch 2"
    assert last_line_of(b" 10%|#\r 20%|##") == "20%|##"
    assert last_line_of(b"\n  \n") == ""
    assert len(last_line_of(b"x" * 1000)) == 200


def test_quiet_is_time_without_output_or_cpu_progress() -> None:
    tracker = RankActivityTracker(rank=1, pid=5, store_port=0, now=100.0)
    tracker.cpu(1000, 100.0)
    assert tracker.report("S", 110.0).quiet_s == 10.0  # a fresh rank counts from its start
    tracker.output(b"step 1\n", 110.0)
    tracker.cpu(1000, 112.0)  # no ticks moved
    report = tracker.report("S", 115.0)
    assert (report.quiet_s, report.output_age_s, report.last_line, report.uptime_s) == (
        5.0,
        5.0,
        "step 1",
        15.0,
    )
    tracker.cpu(
        1000 + os.sysconf("SC_CLK_TCK") * 3, 118.0
    )  # three CPU seconds in six: progress, 50 %
    report = tracker.report("R", 120.0)
    assert (report.quiet_s, report.cpu_percent) == (2.0, 50.0)
    assert (
        RankActivityTracker(rank=0, pid=1, store_port=0, now=0.0).report("S", 1.0).output_age_s
        == -1.0
    )


def test_a_store_connection_is_traced_to_the_process_that_holds_it(tmp_path: Path) -> None:
    """A real listener, a real client process: its socket's inode is in /proc/net/tcp and among its fds."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = subprocess.Popen(
            [sys.executable, "-c", f"import socket, sys; s = socket.create_connection(('127.0.0.1', {port})); print('in', flush=True); sys.stdin.read()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        bystander = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
        )
        try:
            assert client.stdout is not None
            assert client.stdout.readline() == "in\n"
            conn, _ = server.accept()
            with conn:
                connections = store_connections(port)
                assert socket_inodes(client.pid) & connections
                assert not socket_inodes(bystander.pid) & connections
                asked: list[int] = []

                def tables(p: int) -> frozenset[int]:
                    asked.append(p)
                    return store_connections(p)

                tracker = RankActivityTracker(rank=0, pid=client.pid, store_port=port, now=0.0)
                assert tracker.sample(1.0, tables).store_connected
                assert tracker.sample(2.0, tables).state in ("S", "R")
                assert asked == [port]  # once seen, the tables are not read again
                # A connect still in progress at the first look (the tables do not list it yet): looked at again after RECHECK_S.
                late: list[float] = []
                pending = RankActivityTracker(rank=2, pid=client.pid, store_port=port, now=0.0)
                assert not pending.sample(
                    1.0, lambda p: (late.append(1.0), frozenset())[1]
                ).store_connected
                assert not pending.sample(
                    2.0, lambda p: (late.append(2.0), store_connections(p))[1]
                ).store_connected  # same sockets: not asked
                assert pending.sample(
                    1.0 + RECHECK_S, lambda p: (late.append(3.0), store_connections(p))[1]
                ).store_connected
                assert late == [1.0, 3.0]
                idle = RankActivityTracker(rank=1, pid=bystander.pid, store_port=port, now=0.0)
                assert not idle.sample(1.0, tables).store_connected
                assert asked == [port]  # a process without sockets costs no table read
        finally:
            for proc in (client, bystander):
                proc.kill()
                proc.communicate()
    gone = RankActivityTracker(rank=0, pid=client.pid, store_port=port, now=0.0)
    assert gone.sample(1.0, store_connections).state == "X"


# ----- a rank is its process tree: a wrapper script is not mistaken for the work ----------------


def test_tree_parts_children_files_states_and_ticks() -> None:
    assert parse_children("4243 4250 \n") == [4243, 4250]
    assert parse_children("") == []
    assert tree_state(["S", "R"]) == "R"  # the busy python under a sleeping shell
    assert tree_state(["S", "T"]) == "T"  # a stopped python shows as stopped
    assert tree_state(["S", "D", "R"]) == "D"
    assert tree_state(["S", "Z"]) == "S"
    assert tree_state(["S", "?"]) == "S"  # an unknown letter never wins
    assert tree_state([]) == "X"
    stats = [
        parse_stat(STAT.format(utime=7, stime=3, start=9)),
        ProcStat(state="R", cpu_ticks=5, start_ticks=10, reaped_ticks=2),
    ]
    assert tree_ticks([s for s in stats if s is not None]) == 10 + 5 + 2


#: Without the children files (a kernel built without CONFIG_PROC_CHILDREN) a tree is its root alone.
needs_children_files = pytest.mark.skipif(
    not Path(f"/proc/self/task/{os.getpid()}/children").exists(),
    reason="this kernel has no /proc/<pid>/task/<tid>/children files",
)


def _wrapped(code: str) -> subprocess.Popen[str]:
    """``sh -c 'python -c CODE; ...'``: a shell that waits for its python (a compound command: no exec)."""
    return subprocess.Popen(
        ["sh", "-c", f'{sys.executable} -c "$0"; echo shell done', code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _stop(proc: subprocess.Popen[str]) -> None:
    for pid in process_tree(proc.pid)[::-1]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.communicate()


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _ticks_of_tree(pid: int) -> int:
    return tree_ticks(
        [
            s
            for p in process_tree(pid)
            if (s := parse_stat(Path(f"/proc/{p}/stat").read_text())) is not None
        ]
    )


BUSY_FOR_0_3_S = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"


@needs_children_files
def test_a_shell_that_waits_for_a_busy_python_is_busy() -> None:
    wrapper = _wrapped("import sys; print('in', flush=True)\nwhile True: pass")
    try:
        assert wrapper.stdout is not None
        assert wrapper.stdout.readline() == "in\n"
        tree = process_tree(wrapper.pid)
        assert len(tree) == 2  # the shell, then its python
        assert tree[0] == wrapper.pid
        shell_alone = parse_stat(Path(f"/proc/{wrapper.pid}/stat").read_text())
        assert shell_alone is not None
        assert shell_alone.state == "S"  # what the old pid-only reading reported: asleep in wait
        tracker = RankActivityTracker(rank=0, pid=wrapper.pid, store_port=0, now=0.0)
        first = tracker.sample(0.0, store_connections)
        assert first.state == "R"
        start = _ticks_of_tree(wrapper.pid)
        _wait_for(lambda: _ticks_of_tree(wrapper.pid) > start, "the python never ran")
        report = tracker.sample(
            1.0, store_connections
        )  # its ticks moved: progress (quiet resets), a nonzero CPU % (1 tick in 1 s: 1 %)
        assert report.cpu_percent > 0
        assert report.quiet_s == 0.0
    finally:
        _stop(wrapper)


def test_the_ticks_of_a_child_that_ended_stay_with_the_tree() -> None:
    """A helper process that ends is reaped by its parent: its CPU moves to the parent's reaped ticks, it is not lost."""
    command = f'{sys.executable} -c "$0"; echo child done; read line'
    wrapper = subprocess.Popen(
        ["sh", "-c", command, BUSY_FOR_0_3_S],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert wrapper.stdout is not None
        assert (
            wrapper.stdout.readline() == "child done\n"
        )  # the python used 0.3 s of CPU and was reaped
        assert process_tree(wrapper.pid) == [wrapper.pid]
        assert _ticks_of_tree(wrapper.pid) >= 0.25 * os.sysconf("SC_CLK_TCK")
    finally:
        _stop(wrapper)


@needs_children_files
def test_a_store_connection_is_traced_through_a_wrapper_shell() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        wrapper = _wrapped(
            f"import socket, sys; s = socket.create_connection(('127.0.0.1', {port})); print('in', flush=True); sys.stdin.read()"
        )
        try:
            assert wrapper.stdout is not None
            assert wrapper.stdout.readline() == "in\n"
            conn, _ = server.accept()
            with conn:
                assert not socket_inodes(wrapper.pid) & store_connections(
                    port
                )  # the shell itself holds no socket
                tracker = RankActivityTracker(rank=0, pid=wrapper.pid, store_port=port, now=0.0)
                assert tracker.sample(1.0, store_connections).store_connected
        finally:
            _stop(wrapper)
