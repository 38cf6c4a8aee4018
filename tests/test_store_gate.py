"""Only the run's own processes reach the run's store: the sock_diag codec on recorded bytes, the
owner of real loopback sockets, the gate's judgement of real processes (another user, a process
of our user outside the run, a rank's child), and a poisoner against the store and a real run.

The poisoner (``scripts/store_poison.py``) sends what torch sends — ``VALIDATE``, then ``SET
init/`` to a value that is no number, which breaks every rank's first ``ADD`` — in a loop from
before the run binds its port. Another user is ``nobody``: that needs root (we are, in CI).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from flodl_async.host.proctree import socket_inodes
from flodl_async.host.sockdiag import (
    NLMSG_ERROR,
    SocketOwner,
    lookup_request,
    parse_reply,
    tcp_owner,
)
from flodl_async.net.mux import PortMux
from flodl_async.net.portstore import PortStore
from flodl_async.net.storegate import Standing, StoreGate
from flodl_async.wire import Channel

from .launchkit import PY, Launcher, free_port, new_run_id, reap, script, wait_status

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="sock_diag and /proc are Linux's")

NOBODY = 65534
POISON = Path(script("store_poison.py")).read_text()

#: A real kernel's answer (x86-64, Linux 6) for 127.0.0.1:36138 → 127.0.0.1:34655: ESTABLISHED,
#: uid 0, inode 0x22BB4F, with the attributes the kernel appends.
REPLY = bytes.fromhex(
    "7c0000001400000001000000a52b0000020100008d2a875f7f000001000000000000000000000000"
    "7f000001000000000000000000000000000000000310000000000000000000000000000000000000"
    "000000004fbb2200050008000000000008000f00000000000c00150001000000000000000600160052000000"
)
#: The same kernel's answer for a four-tuple no socket has: NLMSG_ERROR, -ENOENT.
NO_SUCH_SOCKET = bytes.fromhex(
    "5c0000000200000001000000a52b0000feffffff4800000014000100010000000000000002060000ffffffff"
    "0001875f7f0000010000000000000000000000007f00000100000000000000000000000000000000ffffffff"
    "ffffffff"
)


# ----- the codec ---------------------------------------------------------------------------------


def test_a_lookup_asks_for_one_tcp_socket_by_its_exact_four_tuple() -> None:
    request = lookup_request(("127.0.0.1", 36138), ("127.0.0.1", 34655))
    assert len(request) == 72 == int.from_bytes(request[:4], sys.byteorder)
    assert request[16:18] == bytes([socket.AF_INET, 6])  # family, TCP
    assert request[24:28] == (36138).to_bytes(2, "big") + (34655).to_bytes(2, "big")
    assert request[28:32] == socket.inet_aton("127.0.0.1")
    assert request[44:48] == socket.inet_aton("127.0.0.1")
    assert request[-8:] == b"\xff" * 8  # no cookie: the four-tuple alone


def test_an_ipv4_mapped_peer_is_looked_up_as_ipv4_and_mixed_families_are_refused() -> None:
    mapped = lookup_request(("::ffff:127.0.0.1", 1), ("127.0.0.1", 2))
    assert mapped == lookup_request(("127.0.0.1", 1), ("127.0.0.1", 2))
    assert lookup_request(("::1", 1), ("::1", 2))[16] == socket.AF_INET6
    with pytest.raises(ValueError, match="not of one address family"):
        lookup_request(("::1", 1), ("127.0.0.1", 2))
    with pytest.raises(ValueError):
        lookup_request(("not-an-ip", 1), ("127.0.0.1", 2))


def test_a_recorded_answer_gives_the_owner_and_no_such_socket_gives_none() -> None:
    assert parse_reply(REPLY) == SocketOwner(uid=0, inode=0x22BB4F, state=1)
    assert int.from_bytes(NO_SUCH_SOCKET[4:6], sys.byteorder) == NLMSG_ERROR
    assert parse_reply(NO_SUCH_SOCKET) is None


@pytest.mark.parametrize(
    "mangled",
    [
        REPLY[:10],  # shorter than a header
        REPLY[:40],  # shorter than its own length says
        REPLY[:8] + (2).to_bytes(4, sys.byteorder) + REPLY[12:],  # another request's answer
        NO_SUCH_SOCKET[:16] + (-13).to_bytes(4, sys.byteorder, signed=True) + NO_SUCH_SOCKET[20:],
    ],
    ids=["short", "truncated", "other-sequence", "EACCES"],
)
def test_an_answer_that_is_not_one_is_a_value_error(mangled: bytes) -> None:
    with pytest.raises(ValueError):
        parse_reply(mangled)


# ----- the live lookups --------------------------------------------------------------------------


@contextlib.contextmanager
def listener() -> Iterator[socket.socket]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        sock.settimeout(30)
        yield sock


def test_the_owner_of_a_loopback_connection_is_its_uid_and_an_inode_its_process_holds() -> None:
    with listener() as server, socket.create_connection(server.getsockname()) as client:
        accepted, peer = server.accept()
        with accepted:
            owner = tcp_owner(peer, accepted.getsockname())
            assert owner is not None
            assert owner.uid == os.geteuid()
            assert owner.inode in socket_inodes(os.getpid())
            assert tcp_owner(("127.0.0.1", 1), accepted.getsockname()) is None
            client.close()  # closed: the kernel still has it, but no process holds it
            closed = tcp_owner(peer, accepted.getsockname())
            assert closed is not None
            assert closed.inode == 0


def _python_for(user: str) -> str:
    """An interpreter ``user`` may run (ours may live under /root)."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run the other-user cases: run the suite as root")
        pytest.skip("running as another user needs root")
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            probe = subprocess.run(
                [candidate, "-c", "pass"], user=user, capture_output=True, timeout=30, check=False
            )
            if probe.returncode == 0:
                return candidate
    pytest.fail(f"no python that {user} may run")


DIAL = """
import socket, sys, time
port, hops = int(sys.argv[1]), int(sys.argv[2])
if hops:
    import subprocess
    sys.exit(subprocess.call([sys.executable, "-c", sys.argv[3], sys.argv[1], str(hops - 1), sys.argv[3]]))
sock = socket.create_connection(("127.0.0.1", port))
print("connected", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def dialer(port: int, *, hops: int = 0, user: str | None = None) -> Iterator[subprocess.Popen[str]]:
    """A process that connects to ``port`` and holds the connection until its stdin closes; with
    ``hops``, its descendant that many generations down does."""
    python = PY if user is None else _python_for(user)
    proc = subprocess.Popen(
        [python, "-c", DIAL, str(port), str(hops), DIAL],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        user=user,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "connected\n"
        yield proc
    finally:
        assert proc.stdin is not None
        assert proc.stdout is not None
        proc.stdin.close()
        proc.wait(timeout=30)
        proc.stdout.close()


def _judge(gate: StoreGate, server: socket.socket) -> Standing:
    accepted, peer = server.accept()
    with accepted:
        return gate.check(peer, accepted.getsockname()).standing


def test_the_gate_serves_the_runs_tree_and_refuses_everyone_else_on_this_host() -> None:
    with listener() as server:
        port = server.getsockname()[1]
        with dialer(port) as rank:
            gate = StoreGate(roots=(rank.pid,), uids=(os.geteuid(),))
            assert _judge(gate, server) is Standing.SERVED  # the rank itself
            with dialer(port) as bystander:
                assert _judge(gate, server) is Standing.NOT_OURS  # our uid, not of the run
            gate.admit_tree(bystander.pid)
            with dialer(port, hops=2) as grandparent:
                gate.admit_tree(grandparent.pid)  # a rank whose helper's helper dials
                assert _judge(gate, server) is Standing.SERVED
        with dialer(port, user="nobody"):
            assert _judge(gate, server) is Standing.FOREIGN_UID


def test_a_root_that_ended_roots_nothing_even_if_its_pid_comes_back() -> None:
    gate = StoreGate(roots=(2**22 + 7,), uids=(os.geteuid(),))  # no such process: no start time
    with listener() as server, dialer(server.getsockname()[1]):
        assert _judge(gate, server) is Standing.NOT_OURS


# ----- against the store -------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def store_of(rank_pid: int) -> AsyncIterator[tuple[PortMux, PortStore]]:
    mux = PortMux(host="127.0.0.1", port=0, sniff_timeout=30.0, handshake_timeout=30.0)
    store = PortStore(gate=StoreGate(roots=(rank_pid,), uids=(os.geteuid(),)))
    store.admit_host("127.0.0.1")  # loopback is admitted, as in an --nproc run
    mux.register(Channel.STORE, store.protocol_factory)
    await mux.start()
    try:
        yield mux, store
    finally:
        store.close()
        await mux.aclose()


@pytest.mark.parametrize(
    ("user", "reason", "named"),
    [
        ("nobody", "store_foreign_uid", f"uid {NOBODY} (nobody)"),
        (None, "store_not_run", f"uid {os.geteuid()}"),
    ],
    ids=["another-user", "our-user-not-a-rank"],
)
async def test_a_poisoner_on_this_host_changes_nothing_and_is_counted_and_named_once(
    user: str | None, reason: str, named: str, caplog: pytest.LogCaptureFixture
) -> None:
    python = PY if user is None else _python_for(user)
    rank = await asyncio.create_subprocess_exec(PY, "-c", "input()", stdin=subprocess.PIPE)
    try:
        async with store_of(rank.pid) as (mux, store):
            poisoner = await asyncio.create_subprocess_exec(
                python,
                "-c",
                POISON,
                "127.0.0.1",
                str(mux.port),
                "3",
                stdout=subprocess.PIPE,
                user=user,
            )
            try:
                async with asyncio.timeout(60):
                    said, _ = await poisoner.communicate()  # three tries, then it ends
            finally:
                with contextlib.suppress(ProcessLookupError):
                    poisoner.kill()
                await poisoner.wait()
            assert said.decode() == f"refused pid {poisoner.pid}\n"  # never "poisoned"
            assert mux.statistics().dropped.get(reason) == 3
            assert store.state.data == {}
            assert store.connections == 0
    finally:
        rank.kill()
        await rank.wait()
    lines = [
        r
        for r in caplog.records
        if r.name == "flodl_async.net.torchstore" and f"({reason})" in r.getMessage()
    ]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # three refusals or more, one line
    assert named in lines[0].getMessage(), lines[0].getMessage()
    assert f"pid {poisoner.pid}" in lines[0].getMessage(), lines[0].getMessage()
    assert lines[0].levelno == logging.WARNING


# ----- a real run --------------------------------------------------------------------------------


@pytest.mark.e2e
def test_poisoners_of_another_user_and_of_ours_change_nothing_for_an_nproc_run(
    tmp_path: Path,
) -> None:
    port, release = free_port(), tmp_path / "release"
    others = _python_for("nobody")
    poisoners = [
        subprocess.Popen(
            [python, "-c", POISON, "127.0.0.1", str(port)],
            stdout=subprocess.PIPE,
            text=True,
            user=user,
        )
        for python, user in ((others, "nobody"), (PY, None))
    ]
    launcher = Launcher(
        "--nproc", "2", "--devices", "cpu", "--port", str(port), "--",
        PY, script("store_round.py"), str(release),
        run_id=new_run_id(),
    )  # fmt: skip
    try:
        for poisoner in poisoners:  # both tried before the ranks rendezvoused
            assert poisoner.stdout is not None
            assert poisoner.stdout.readline().startswith("refused pid")
        launcher.wait_for_stdout(" sum 2", count=2)
        release.touch()
        done = launcher.finish(timeout=60)
    finally:
        for poisoner in poisoners:
            poisoner.kill()
            poisoner.communicate()
        launcher.kill()
    assert done.returncode == 0, done.stderr
    foreign = re.findall(r"^.*\(store_foreign_uid\):.*$", done.stderr, re.M)
    ours = re.findall(r"^.*\(store_not_run\):.*$", done.stderr, re.M)
    assert len(foreign) == 1, done.stderr  # one line, however many tries
    assert f"uid {NOBODY} (nobody)" in foreign[0], done.stderr
    assert len(ours) == 1, done.stderr
    assert f"uid {os.geteuid()}" in ours[0], done.stderr


@pytest.mark.e2e
def test_a_walk_in_agent_of_this_host_gets_its_ranks_into_the_store(tmp_path: Path) -> None:
    """Its ranks descend from its own process, not the controller's: its join makes it a root."""
    port, secret = free_port(), tmp_path / "secret"
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"controller:\n  port: {port}\n  join: {{min_rank_start: 2, target_ranks: 2, "
        "join_timeout: 60}\nworkers:\n  - host: localhost\n    devices: cpu:1\n"
    )
    launcher = Launcher(
        str(cluster), "--secret-file", str(secret), "--", PY, script("allreduce.py"),
        run_id=new_run_id(),
    )  # fmt: skip
    agent = None
    try:
        wait_status(port, lambda doc: doc["joined_ranks"] == 1)
        agent = subprocess.Popen(
            [
                PY, "-m", "flodl_async.agent", "--controller", f"127.0.0.1:{port}",
                "--host", "walk-in", "--devices", "cpu:1", "--secret-file", str(secret),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        done = launcher.finish(timeout=120)
        agent.communicate(timeout=60)
    finally:
        launcher.kill()
        reap(agent)
    assert done.returncode == 0, done.stderr
    assert "[walk-in:r1] rank 1 of 2 sum 3" in done.stdout, done.stdout
    assert "store_not_run" not in done.stderr
