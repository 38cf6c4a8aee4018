"""systemd integration: sd_notify datagrams on a real AF_UNIX socket, the watchdog ticker, credentials, the units.

PID 1 here is not systemd, so the protocol is tested from systemd's side: the test binds the
datagram socket that ``$NOTIFY_SOCKET`` names and reads what the agent sends.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flodl_async.agent.lifecycle import Phase, SessionEvent
from flodl_async.agent.systemd import notification_observer, rank_span, status_line, with_watchdog
from flodl_async.errors import ConfigError
from flodl_async.host.runtime import runtime_root
from flodl_async.host.sdnotify import (
    MAX_STATUS_CHARS,
    Notifier,
    NotifyTarget,
    message,
    socket_address,
    watchdog_interval,
)
from flodl_async.verdict import ExitCode

from .launchkit import (
    PY,
    Launcher,
    assert_nothing_left,
    free_port,
    new_run_id,
    reap,
    run_launch,
    script,
    wait_status,
)

DEPLOY = Path(__file__).parent.parent / "deploy"


# ----- pure: messages and the environment ----------------------------------------------------------


def test_a_message_is_its_fields_as_lines_in_a_fixed_order() -> None:
    assert message(ready=True, status="up", mainpid=42) == b"READY=1\nMAINPID=42\nSTATUS=up\n"
    assert message(stopping=True, status="going") == b"STOPPING=1\nSTATUS=going\n"
    assert message(watchdog=True) == b"WATCHDOG=1\n"
    assert message() == b""


def test_a_status_is_one_line_and_bounded() -> None:
    assert message(status="two\nlines\tand  tabs") == b"STATUS=two lines and tabs\n"
    assert message(status="x" * 1000) == b"STATUS=" + b"x" * MAX_STATUS_CHARS + b"\n"


@pytest.mark.parametrize(
    ("value", "address"),
    [
        ("/run/systemd/notify", "/run/systemd/notify"),
        ("@sd-notify", b"\0sd-notify"),
        ("", None),
        ("@", None),
        ("relative/path", None),
        ("vsock:2:1", None),
    ],
)
def test_the_notify_socket_is_a_path_or_an_abstract_name(
    value: str, address: str | bytes | None
) -> None:
    assert socket_address(value) == address


@pytest.mark.parametrize(
    ("env", "interval"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),  # half the interval, as systemd advises
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "7"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "8"}, None),  # another process's watchdog
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_the_watchdog_interval_is_half_of_watchdog_usec_for_its_own_pid(
    env: dict[str, str], interval: float | None
) -> None:
    assert watchdog_interval(env, pid=7) == interval


def test_not_under_systemd_everything_is_a_no_op() -> None:
    target = NotifyTarget.from_env({"WATCHDOG_USEC": "1000000"}, pid=1)
    assert target == NotifyTarget()
    notifier = Notifier(target)
    assert not notifier.enabled
    assert not notifier.ready("up")
    asyncio.run(
        asyncio.wait_for(notifier.watchdog(), 60)
    )  # returns at once: no watchdog without a socket
    notifier.close()


def test_the_protocol_variables_are_taken_out_of_the_environment() -> None:
    environ = {
        "NOTIFY_SOCKET": "@x",
        "WATCHDOG_USEC": "2000000",
        "WATCHDOG_PID": str(os.getpid()),
        "PATH": "/bin",
    }
    notifier = Notifier.from_environ(environ)
    try:
        assert notifier.target == NotifyTarget(address=b"\0x", watchdog_interval=1.0)
        assert environ == {"PATH": "/bin"}  # the ranks inherit none of it
    finally:
        notifier.close()


def test_status_lines_say_what_the_agent_is_doing() -> None:
    base = {"host": "node-b", "controller": "10.0.0.1:1337", "run_id": "r1"}
    assert (
        status_line(SessionEvent(phase=Phase.DIALING, **base))
        == "waiting for a controller at 10.0.0.1:1337"
    )
    assert (
        status_line(SessionEvent(phase=Phase.RUNNING, ranks=(7, 4, 5, 6), round=0, **base))
        == "run r1: ranks 4–7 running (round 0)"
    )
    assert (
        status_line(SessionEvent(phase=Phase.ADMITTED, ranks=(3,), **base))
        == "run r1: admitted with rank 3, waiting for the world to form"
    )
    assert status_line(
        SessionEvent(
            phase=Phase.STOPPING,
            host="node-b",
            controller="c:1",
            reason="SIGTERM before the world formed",
        )
    ) == ("stopping: SIGTERM before the world formed")
    assert rank_span((0, 2, 5)) == "ranks 0, 2, 5"


def test_the_runtime_directory_of_a_service_is_systemds() -> None:
    assert runtime_root(
        {"RUNTIME_DIRECTORY": "/run/flodl", "XDG_RUNTIME_DIR": "/run/user/1"}
    ) == Path("/run/flodl")
    assert runtime_root({"RUNTIME_DIRECTORY": "/run/flodl:/run/other"}) == Path("/run/flodl")
    assert runtime_root(
        {"RUNTIME_DIRECTORY": "relative", "XDG_RUNTIME_DIR": "/run/user/1"}
    ) == Path("/run/user/1/flodl")


# ----- a real datagram socket ----------------------------------------------------------------------


class Receiver:
    """The service manager's end: a bound AF_UNIX datagram socket, read by a thread (the queue holds only a few datagrams)."""

    def __init__(self, abstract: bool) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="fl-sd-", dir="/tmp"))
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"flodl-test-{secrets.token_hex(6)}"
            self.sock.bind(b"\0" + name.encode())
            self.env_value = "@" + name
        else:
            path = str(self.dir / "notify")
            self.sock.bind(path)
            self.env_value = path
        self.sock.settimeout(0.2)
        self.datagrams: list[bytes] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="sd-receiver", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.datagrams.append(data)

    def received(self) -> list[bytes]:
        with self._lock:
            return list(self.datagrams)

    def wait_for(self, count: int, what: bytes, timeout: float = 60) -> list[bytes]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = [d for d in self.received() if what in d]
            if len(got) >= count:
                return got
            time.sleep(0.02)
        raise AssertionError(f"fewer than {count} datagrams with {what!r}: {self.received()}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(params=["path", "abstract"])
def receiver(request: pytest.FixtureRequest) -> Iterator[Receiver]:
    r = Receiver(abstract=request.param == "abstract")
    yield r
    r.close()


def test_notifications_reach_the_socket(receiver: Receiver) -> None:
    notifier = Notifier(
        NotifyTarget.from_env({"NOTIFY_SOCKET": receiver.env_value}, pid=os.getpid())
    )
    try:
        observe = notification_observer(notifier)
        for phase in (Phase.DIALING, Phase.CONNECTED, Phase.STOPPING):
            observe(
                SessionEvent(
                    phase=phase,
                    host="h",
                    controller="127.0.0.1:1",
                    run_id="r",
                    ranks=(0, 1),
                    reason="finished",
                )
            )
        got = receiver.wait_for(3, b"STATUS=")
    finally:
        notifier.close()
    assert got == [
        b"STATUS=waiting for a controller at 127.0.0.1:1\n",
        f"READY=1\nMAINPID={os.getpid()}\nSTATUS=connected to the controller at 127.0.0.1:1, joining as h\n".encode(),
        "STOPPING=1\nSTATUS=run r: stopping ranks 0–1 (finished)\n".encode(),
    ]


class CountingNotifier(Notifier):
    """Counts the datagrams it sends: what left while the loop was stuck is read off this count,
    not off the receiver's thread, which may lag a few pings behind on a busy machine."""

    def __init__(self, target: NotifyTarget) -> None:
        super().__init__(target)
        self.sent = 0

    def send(self, datagram: bytes) -> bool:
        self.sent += 1
        return super().send(datagram)


async def test_watchdog_pings_keep_coming_while_the_loop_is_healthy_and_stop_when_it_is_stuck(
    receiver: Receiver,
) -> None:
    env = {"NOTIFY_SOCKET": receiver.env_value, "WATCHDOG_USEC": "100000"}  # a ping every 0.05 s
    notifier = CountingNotifier(NotifyTarget.from_env(env, pid=os.getpid()))

    async def body() -> int:
        await asyncio.to_thread(
            receiver.wait_for, 5, b"WATCHDOG=1"
        )  # the loop is free meanwhile: pings flow
        before = notifier.sent
        time.sleep(0.5)  # noqa: ASYNC251  # the loop is stuck on purpose: the ticker cannot run
        stuck = notifier.sent - before
        # and they resume: more arrive than had arrived by now
        await asyncio.to_thread(receiver.wait_for, len(receiver.received()) + 3, b"WATCHDOG=1")
        return stuck

    try:
        stuck = await with_watchdog(body(), notifier)
    finally:
        notifier.close()
    assert stuck == 0  # a healthy loop would have sent about 10 in that half second
    assert set(receiver.received()) == {b"WATCHDOG=1\n"}


async def test_with_watchdog_returns_the_result_and_raises_the_error_unwrapped() -> None:
    notifier = Notifier(NotifyTarget())

    async def fails() -> None:
        raise ConfigError("bad")

    async def works() -> int:
        return 3

    assert await with_watchdog(works(), notifier) == 3
    with pytest.raises(ConfigError, match="bad"):
        await with_watchdog(fails(), notifier)


# ----- a persisting agent under Type=notify ------------------------------------------------------------


@pytest.mark.e2e
def test_a_persisting_agent_is_ready_while_no_controller_answers(
    tmp_path: Path, receiver: Receiver
) -> None:
    """The unit's own command line (token from the credentials directory, --persist) with nobody at the controller's port.

    READY=1 must come at start, saying whom it waits for, not once a controller answers: under
    Type=notify a unit whose controller is down would otherwise hit its start timeout while backing off.
    """
    from flodl_async.host.secretfile import create_token_file

    port = free_port()  # nobody listens there for the whole test
    service_dirs = Path(tempfile.mkdtemp(prefix="fl-svc-", dir="/tmp"))
    try:
        credentials = (
            service_dirs / "credentials"
        )  # what LoadCredential= makes: 0400, the service's own
        credentials.mkdir(mode=0o700)
        create_token_file(credentials / "flodl-token")
        (credentials / "flodl-token").chmod(stat.S_IRUSR)
        runtime = service_dirs / "run"
        runtime.mkdir(mode=0o700)
        env = {
            **os.environ,
            "NOTIFY_SOCKET": receiver.env_value,
            "CREDENTIALS_DIRECTORY": str(credentials),
            "RUNTIME_DIRECTORY": str(runtime),
        }
        exec_start = _unit_settings("flodl-agent.service")["ExecStart"]
        assert (
            "--token-file %d/flodl-token --persist" in exec_start
        )  # the flags under test are the unit's
        cmd = [
            PY,
            "-m",
            "flodl_async.agent",
            "--controller",
            f"127.0.0.1:{port}",
            "--host",
            "svc",
            "--devices",
            "cpu:1",
        ]
        cmd += [
            "--token-file",
            str(credentials / "flodl-token"),
            "--persist",
            "--reconnect-max",
            "0.2",
        ]
        agent = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        try:
            receiver.wait_for(
                2, b"dialing again in"
            )  # two refused dials: it is backing off, still up
            assert agent.poll() is None
            agent.send_signal(signal.SIGTERM)
            _, err = agent.communicate(timeout=60)
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.communicate()
        assert agent.returncode == int(ExitCode.TERMINATED), err
        notes = [d.decode() for d in receiver.received() if d != b"WATCHDOG=1\n"]
        assert (
            notes[0]
            == f"READY=1\nMAINPID={agent.pid}\nSTATUS=waiting for a controller at 127.0.0.1:{port}\n"
        ), notes
        assert (
            sum(note.startswith("READY=1") for note in notes) == 1
        )  # no controller ever answered: READY came from the start
        backoff = [note for note in notes if "dialing again in" in note]
        assert backoff
        assert all(
            note.startswith(
                f"STATUS=waiting for a controller at 127.0.0.1:{port} (dialing again in "
            )
            for note in backoff
        )
        assert "connection refused" in backoff[0].lower()  # and says why
        assert "Traceback" not in err
    finally:
        shutil.rmtree(service_dirs, ignore_errors=True)


def test_the_retired_token_credential_flag_is_refused_as_a_usage_error() -> None:
    done = subprocess.run(
        [
            PY,
            "-m",
            "flodl_async.agent",
            "--controller",
            "127.0.0.1:1",
            "--token-credential",
            "flodl-token",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == int(
        ExitCode.USAGE
    )  # the unit's RestartPreventExitStatus: an old unit does not restart-loop
    assert "unrecognized arguments: --token-credential" in done.stderr


# ----- the units ----------------------------------------------------------------------------------------


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed (apt-get install systemd)",
)
def test_the_units_verify_clean(tmp_path: Path) -> None:
    # systemd-analyze checks that ExecStart's binary exists: the units' /opt/flodl/venv/bin is pointed at shims here.
    shims = tmp_path / "bin"
    shims.mkdir()
    for name in ("flodl-agent", "flodl-launch"):
        (shims / name).write_text("#!/bin/sh\n")
        (shims / name).chmod(0o755)
    units = []
    for unit in sorted(DEPLOY.glob("*.service")):
        text = unit.read_text()
        assert "/opt/flodl/venv/bin/" in text
        name = unit.name.replace("@.service", "@job.service")  # a template verifies as an instance
        (tmp_path / name).write_text(text.replace("/opt/flodl/venv/bin/", f"{shims}/"))
        units.append(str(tmp_path / name))
    assert len(units) == 2
    done = subprocess.run(
        ["systemd-analyze", "verify", *units],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr


def _unit_settings(unit: str) -> dict[str, str]:
    settings = {}
    for line in (DEPLOY / unit).read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            settings[key] = value
    return settings


def test_the_agent_unit_agrees_with_the_exit_codes_and_the_stop_grace() -> None:
    unit = _unit_settings("flodl-agent.service")
    assert unit["Type"] == "notify"
    # A usage error would only fail again; nothing else ends a persisting agent (no exit 3 or 4).
    assert unit["RestartPreventExitStatus"].split() == [str(int(ExitCode.USAGE))]
    assert sorted(unit["SuccessExitStatus"].split()) == sorted(
        [str(int(ExitCode.INTERRUPTED)), str(int(ExitCode.TERMINATED))]
    )
    grace = float(unit["ExecStart"].split("--stop-grace ")[1].split()[0])
    assert (
        float(unit["TimeoutStopSec"]) > grace
    )  # the agent's own TERM → KILL schedule finishes before systemd's KILL
    assert (
        "--token-file %d/flodl-token" in unit["ExecStart"]
    )  # %d: $CREDENTIALS_DIRECTORY, the LoadCredential= below
    assert "--persist" in unit["ExecStart"].split()
    assert "--secret-file" not in unit["ExecStart"]
    assert unit["LoadCredential"] == "flodl-token:/etc/flodl/token"
    assert (unit["KillMode"], unit["RuntimeDirectory"], unit["RuntimeDirectoryMode"]) == (
        "mixed",
        "flodl",
        "0700",
    )


@pytest.mark.e2e
def test_flodl_launch_prints_plain_lines_for_the_journal(tmp_path: Path) -> None:
    run_id = new_run_id()
    xdg = Path(tempfile.mkdtemp(prefix="fl-xdg-", dir="/tmp"))
    try:
        done = run_launch(
            "--nproc",
            "1",
            "--devices",
            "cpu",
            "--port",
            "0",
            "--",
            PY,
            "-c",
            "print('hello')",
            run_id=run_id,
            env={"XDG_RUNTIME_DIR": str(xdg)},
        )
    finally:
        shutil.rmtree(xdg, ignore_errors=True)
    assert done.returncode == 0, done.stderr
    assert "hello" in done.stdout
    for text in (done.stdout, done.stderr):
        assert "\x1b" not in text  # no colour or cursor movement
        assert "\r" not in text  # no progress redraws


# ----- a real flodl-agent in a real run -------------------------------------------------------------------


@pytest.mark.e2e
def test_a_flodl_agent_tells_systemd_ready_status_watchdog_and_stopping(
    tmp_path: Path, receiver: Receiver
) -> None:
    port = free_port()
    run_id = new_run_id()
    secret_file = tmp_path / "secret"
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"controller:\n  port: {port}\n  join: {{min_rank_start: 2, target_ranks: 2, join_timeout: 60}}\nworkers:\n  - host: localhost\n    devices: cpu:1\n"
    )
    dumps = tmp_path / "env"
    dumps.mkdir()
    xdg = Path(tempfile.mkdtemp(prefix="fl-xdg-", dir="/tmp"))
    service_dirs = Path(tempfile.mkdtemp(prefix="fl-svc-", dir="/tmp"))
    try:
        rank_cmd = ["--", PY, script("dump_env.py"), str(dumps)]
        launcher = Launcher(
            str(cluster),
            "--secret-file",
            str(secret_file),
            *rank_cmd,
            run_id=run_id,
            env={"XDG_RUNTIME_DIR": str(xdg)},
        )
        agent = None
        try:
            wait_status(port, lambda doc: doc["joined_ranks"] == 1)
            # What systemd gives a service: the credential (0400, ours), its runtime directory (0700), the notify socket.
            credentials = service_dirs / "credentials"
            credentials.mkdir(mode=0o700)
            shutil.copyfile(secret_file, credentials / "flodl-token")
            (credentials / "flodl-token").chmod(stat.S_IRUSR)
            runtime = service_dirs / "run"
            runtime.mkdir(mode=0o700)
            env = {
                **os.environ,
                "NOTIFY_SOCKET": receiver.env_value,
                "WATCHDOG_USEC": "200000",
                "CREDENTIALS_DIRECTORY": str(credentials),
                "RUNTIME_DIRECTORY": str(runtime),
            }
            cmd = [
                PY,
                "-m",
                "flodl_async.agent",
                "--controller",
                f"127.0.0.1:{port}",
                "--host",
                "walk-in",
                "--devices",
                "cpu:1",
            ]
            cmd += [
                "--secret-file",
                str(credentials / "flodl-token"),
            ]  # a one-run agent's secret, as a credential
            agent = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
            )
            _, agent_err = agent.communicate(timeout=90)
            done = launcher.finish(timeout=60)
        finally:
            launcher.kill()
            reap(agent)
            assert_nothing_left(run_id)
        assert agent is not None
        assert agent.returncode == 0, agent_err
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in agent_err
        notes = [d.decode() for d in receiver.received() if d != b"WATCHDOG=1\n"]
        assert notes == [
            f"STATUS=waiting for a controller at 127.0.0.1:{port}\n",
            f"READY=1\nMAINPID={agent.pid}\nSTATUS=connected to the controller at 127.0.0.1:{port}, joining as walk-in\n",
            f"STATUS=run {run_id}: admitted with rank 1, waiting for the world to form\n",
            f"STATUS=run {run_id}: rank 1 running (round 0)\n",
            f"STOPPING=1\nSTATUS=run {run_id}: stopping rank 1 (run complete)\n",
        ], agent_err
        assert (
            receiver.received().count(b"WATCHDOG=1\n") >= 1
        )  # the first ping goes out as the agent starts
        rank_env = json.loads((dumps / "env-1.json").read_text())
        assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"} & set(
            rank_env
        )  # a rank cannot speak for the service
        assert Path(rank_env["TORCHELASTIC_ERROR_FILE"]).is_relative_to(
            runtime
        )  # the entry lived in $RUNTIME_DIRECTORY
        assert list((runtime / "runs").iterdir()) == []  # and is gone
    finally:
        shutil.rmtree(xdg, ignore_errors=True)
        shutil.rmtree(service_dirs, ignore_errors=True)


@pytest.mark.e2e
def test_a_flodl_agent_stopped_before_the_world_forms_says_stopping(tmp_path: Path) -> None:
    port = free_port()
    run_id = new_run_id()
    secret_file = tmp_path / "secret"
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(  # three ranks wanted, two come: the window stays open while the agent waits in it
        f"controller:\n  port: {port}\n  join: {{min_rank_start: 3, target_ranks: 3, join_timeout: 60}}\nworkers:\n  - host: localhost\n    devices: cpu:1\n"
    )
    xdg = Path(tempfile.mkdtemp(prefix="fl-xdg-", dir="/tmp"))
    receiver = Receiver(abstract=True)
    try:
        args = (
            str(cluster),
            "--secret-file",
            str(secret_file),
            "--stop-grace",
            "3",
            "--",
            PY,
            "-c",
            "pass",
        )
        launcher = Launcher(*args, run_id=run_id, env={"XDG_RUNTIME_DIR": str(xdg)})
        agent = None
        try:
            wait_status(port, lambda doc: doc["joined_ranks"] == 1)
            env = {**os.environ, "NOTIFY_SOCKET": receiver.env_value, "XDG_RUNTIME_DIR": str(xdg)}
            cmd = [
                PY,
                "-m",
                "flodl_async.agent",
                "--controller",
                f"127.0.0.1:{port}",
                "--host",
                "walk-in",
                "--devices",
                "cpu:1",
            ]
            agent = subprocess.Popen(
                [*cmd, "--secret-file", str(secret_file)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            receiver.wait_for(1, b"admitted with rank 1")
            agent.send_signal(
                signal.SIGTERM
            )  # what systemctl stop sends (KillMode=mixed: to the agent alone)
            _, agent_err = agent.communicate(timeout=60)
            launcher.proc.send_signal(signal.SIGTERM)
            launcher.finish(timeout=60)
        finally:
            launcher.kill()
            reap(agent)
            assert_nothing_left(run_id)
        assert agent.returncode == 143, agent_err
        notes = [d.decode() for d in receiver.received()]
        assert notes[-1] == "STOPPING=1\nSTATUS=stopping: SIGTERM before the world formed\n", notes
        assert [n.split("\n")[0] for n in notes[:2]] == [
            f"STATUS=waiting for a controller at 127.0.0.1:{port}",
            "READY=1",
        ]
    finally:
        receiver.close()
        shutil.rmtree(xdg, ignore_errors=True)


def test_the_job_unit_admits_agents_by_the_cluster_token_they_load_too() -> None:
    """The job's launcher and the agents hold the one token file; no hand-copied session secret anywhere."""
    job, agent = _unit_settings("flodl-launch@.service"), _unit_settings("flodl-agent.service")
    assert job["LoadCredential"] == agent["LoadCredential"] == "flodl-token:/etc/flodl/token"
    assert (
        "--token-file %d/flodl-token" in job["ExecStart"]
    )  # overrides the cluster file's controller.token_file
    assert "--secret-file" not in job["ExecStart"]
    # Nothing reads a secret at /etc/flodl/secret: no unit or README line may tell anyone to put one there.
    for text in (
        *(unit.read_text() for unit in DEPLOY.glob("*.service")),
        (DEPLOY.parent / "README.md").read_text(),
    ):
        assert "/etc/flodl/secret" not in text
