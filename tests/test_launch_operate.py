"""Operating a run: status phases, a stand-alone flodl-agent, garbage on the port, bad input."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from flodl_async.agent import RankOutput
from flodl_async.config.cluster import DeviceSpec, WorkerSpec
from flodl_async.control.membership import JoinConfig
from flodl_async.controller import Controller, ExitCode, LaunchPlan, PlacedWorker, Placement
from flodl_async.errors import AuthenticationFailed
from flodl_async.status import Phase, Subscription
from flodl_async.wire import CHANNEL_MAGIC, Channel, ClientHandshake, Credential, new_session_secret
from flodl_async.wire import messages as m
from flodl_async.wire.frame import HEADER
from flodl_async.wire.handshake import PROTOCOL_VERSION

from .launchkit import (
    PY,
    Launcher,
    assert_nothing_left,
    free_port,
    launch_cmd,
    new_run_id,
    reap,
    run_launch,
    script,
    wait_status,
)

pytestmark = pytest.mark.e2e


def _status(port: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/state.json", timeout=2) as response:
            doc: dict[str, Any] = json.loads(response.read())
            return doc
    except OSError:
        return None


def _local_worker_cluster(tmp_path: Path, port: int, *, quorum: int, target: int | None) -> Path:
    """A cluster file whose one local worker brings a single rank, so the window waits for walk-ins."""
    knobs = f"min_rank_start: {quorum}" + (
        f", target_ranks: {target}" if target is not None else ""
    )
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"controller:\n  port: {port}\n  join: {{{knobs}, join_timeout: 60}}\nworkers:\n  - host: localhost\n    devices: cpu:1\n"
    )
    return cluster


def _walk_in(port: int, host: str, secret_file: Path | None = None) -> list[str]:
    """flodl-agent bringing one CPU rank; without a secret file it reads the secret from stdin."""
    secret = ["--secret-file", str(secret_file)] if secret_file is not None else []
    return [
        PY,
        "-m",
        "flodl_async.agent",
        "--controller",
        f"127.0.0.1:{port}",
        *secret,
        "--host",
        host,
        "--devices",
        "cpu:1",
    ]


def test_status_phases_with_a_stand_alone_agent_joining(tmp_path: Path) -> None:
    port = free_port()
    run_id = new_run_id()
    secret_file = tmp_path / "secret"
    go = tmp_path / "go"
    cluster = _local_worker_cluster(tmp_path, port, quorum=2, target=2)
    launcher = Launcher(
        str(cluster),
        "--secret-file",
        str(secret_file),
        "--",
        PY,
        script("wait_for_file.py"),
        str(go),
        run_id=run_id,
    )
    agent = None
    try:
        waiting = wait_status(port, lambda d: d["joined_ranks"] == 1)
        assert waiting["phase"] == "waiting"
        assert [mb["host"] for mb in waiting["members"]] == ["localhost"]
        assert oct(secret_file.stat().st_mode & 0o777) == "0o600"
        agent = subprocess.Popen(
            _walk_in(port, "walk-in", secret_file),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        training = wait_status(port, lambda d: d["phase"] == "training")
        assert training["world_size"] == 2
        assert {mb["host"]: mb["ranks"] for mb in training["members"]} == {
            "localhost": [0],
            "walk-in": [1],
        }
        assert [r["rank"] for r in training["ranks"]] == [0, 1]
        table = subprocess.run(
            [PY, "-m", "flodl_async.cli.flodl", "status", "--addr", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert "phase    training" in table.stdout
        assert "walk-in" in table.stdout
        launcher.wait_for_stdout("ready pid", count=1)
        go.touch()
        done = launcher.finish(timeout=60)
        agent_out, agent_err = agent.communicate(timeout=30)
    finally:
        launcher.kill()
        reap(agent)
        assert_nothing_left(run_id)
    assert done.returncode == 0, done.stderr
    assert 'host "walk-in" joined with ranks 1 ' in done.stderr
    assert agent.returncode == 0, agent_err
    assert "[walk-in:r1] released" in done.stdout  # the walk-in's rank output crossed its join link
    assert "[walk-in:" not in agent_out


def test_wrong_secret_agent_is_refused_clearly(tmp_path: Path) -> None:
    port = free_port()
    run_id = new_run_id()
    cluster = _local_worker_cluster(tmp_path, port, quorum=2, target=None)
    wrong = tmp_path / "wrong"
    wrong.write_text(new_session_secret().hex())
    launcher = Launcher(
        str(cluster), "--", PY, script("wait_for_file.py"), str(tmp_path / "never"), run_id=run_id
    )
    try:
        wait_status(port, lambda d: d["joined_ranks"] == 1)
        agent = subprocess.run(  # the secret on stdin, never on the command line
            _walk_in(port, "intruder"),
            input=wrong.read_text() + "\n",
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert agent.returncode == 3  # could not join
        assert "handshake proof did not verify" in agent.stderr
        assert "check --secret-file" in agent.stderr
        assert "Traceback" not in agent.stderr
        still = _status(port)
        assert still is not None
        assert still["joined_ranks"] == 1
        launcher.proc.terminate()
        done = launcher.finish(timeout=30)
    finally:
        launcher.kill()
    assert done.returncode == 143


def test_garbage_on_the_port_does_not_disturb_the_run(tmp_path: Path) -> None:
    port = free_port()
    run_id = new_run_id()
    go = tmp_path / "go"
    launcher = Launcher(
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        str(port),
        "--",
        PY,
        script("wait_for_file.py"),
        str(go),
        run_id=run_id,
    )
    held: list[socket.socket] = []
    try:
        launcher.wait_for_stdout("ready pid", count=2)

        def connect(data: bytes) -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            if data:
                sock.sendall(data)
            held.append(sock)
            return sock

        connect(os.urandom(4096))  # random bytes
        connect(b"")  # silent
        oversized = HEADER.pack(PROTOCOL_VERSION, 0, m.JoinHello.KIND, 0, 2**31, 0)
        connect(CHANNEL_MAGIC[Channel.JOIN] + oversized)
        # A stranger (another secret): the controller's hello proves nothing to it, and its own made-up
        # proof, with a frame behind it, gets a close. No frame of any kind ever comes back.
        stranger = ClientHandshake(
            channel=Channel.CONTROL,
            credential=Credential.session(new_session_secret()),
            version="x",
        )
        sock = connect(CHANNEL_MAGIC[Channel.CONTROL] + stranger.hello())
        sock.settimeout(5)
        with pytest.raises(AuthenticationFailed, match="handshake proof did not verify"):
            stranger.receive_data(sock.recv(4096))
        sock.sendall(
            os.urandom(32) + HEADER.pack(PROTOCOL_VERSION, 0, m.RankHello.KIND, 0, 8, 0) + bytes(40)
        )
        doc = wait_status(port, lambda d: d["connections"]["dropped"].get("unknown_magic", 0) >= 1)
        assert doc["phase"] == "training"
        for sock in held[2:]:  # the bad bytes were answered by a close, never by a frame
            sock.settimeout(5)
            try:
                answer = sock.recv(1024)
            except ConnectionResetError:  # an abort may reach us as a reset: closed all the same
                answer = b""
            assert answer == b""
        go.touch()
        done = launcher.finish(timeout=60)
    finally:
        for sock in held:
            sock.close()
        launcher.kill()
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "2"], "missing the command to run"),
        (["--", PY, "x.py"], "give either --nproc N (one host) or a cluster file"),
        (
            ["--nproc", "0", "--", PY, "x.py"],
            "--nproc must be a number of at least 1, or auto, gpu or cpu (got '0')",
        ),
        (
            ["--nproc", "2", PY, "x.py", "--epochs", "3"],
            f"unexpected {PY!r}: did you forget `--` before the command?",
        ),  # where it starts
        (["--nproc", "2", "--nprc", "3", "--", PY, "x.py"], "unrecognized arguments: --nprc"),
        (
            ["--nproc", "2", "--devices", "0,0", "--", PY, "x.py"],
            "GPU ids '0,0' must be distinct and non-negative",
        ),
        (
            ["--nproc", "2", "--devices", "all", "--", PY, "x.py"],
            "this host has no visible GPU; for CPU ranks use --devices cpu:2",
        ),
        (
            ["--nproc", "1", "--", "no-such-program-here"],
            "command not found: 'no-such-program-here'",
        ),
        (
            ["--nproc", "1", "--max-restarts", "-1", "--", PY, "x.py"],
            "--max-restarts must be 0 or more",
        ),
        (["missing.yml", "--", PY, "x.py"], "missing.yml: cluster file not found"),
    ],
)
def test_bad_arguments_fail_fast_with_a_usage_code(
    tmp_path: Path, args: list[str], message: str
) -> None:
    no_gpus = (
        tmp_path / "dev"
    )  # a host with no GPU, whatever this machine has (`--devices all` must be refused)
    no_gpus.mkdir()
    run_id = new_run_id()
    done = run_launch(
        *args,
        run_id=run_id,
        timeout=60,
        env={"FLODL_INTERNAL_DEV_DIR": str(no_gpus), "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert "window open" not in done.stderr


def test_bad_cluster_file_names_the_line(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.yml"
    cluster.write_text("workers:\n  - host: localhost\n    devcies: cpu:2\n")
    done = run_launch(str(cluster), "--", PY, "x.py", run_id=new_run_id())
    assert done.returncode == 2
    assert (
        f"{cluster}:3: workers[0].devcies: unknown key 'devcies'; did you mean 'devices'?"
        in done.stderr
    )
    assert "window open" not in done.stderr


def test_an_unreachable_ssh_worker_fails_the_window_naming_host_and_address(tmp_path: Path) -> None:
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    closed = free_port()  # nothing listens there
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"workers:\n  - host: far-away-node\n    devices: cpu:2\n    ssh: {{target: 127.0.0.1, port: {closed}, known_hosts: {known_hosts}}}\n"
    )
    done = run_launch(str(cluster), "--", PY, "x.py", run_id=new_run_id())
    assert done.returncode == 3, done.stderr
    assert "far-away-node" in done.stderr
    assert f"cannot reach 127.0.0.1:{closed} over ssh" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_unsupported_ssh_option_is_refused_by_name(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        "workers:\n  - host: far-away-node\n    devices: cpu:2\n    ssh: {options: [ForwardAgent=yes]}\n"
    )
    done = run_launch(str(cluster), "--", PY, "x.py", run_id=new_run_id())
    assert done.returncode == 2
    assert (
        "ssh option 'ForwardAgent' is not supported (supported: ProxyJump); remove it"
        in done.stderr
    )
    assert "window open" not in done.stderr


def test_a_tunnel_without_trainer_cpu_is_a_config_error_naming_the_line(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.yml"
    cluster.write_text("workers:\n  - host: far-away-node\n    devices: cpu:2\n    tunnel: true\n")
    done = run_launch(str(cluster), "--", PY, "x.py", run_id=new_run_id())
    assert done.returncode == 2
    assert (
        f"{cluster}:4: workers[0].tunnel: worker 'far-away-node' sets `tunnel: true`, but a tunnel carries only controller traffic"
        in done.stderr
    )
    assert "top-level `trainer: cpu`" in done.stderr
    assert "Traceback" not in done.stderr
    assert "window open" not in done.stderr


def test_port_held_by_a_live_listener(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = run_launch(
            "--nproc", "1", "--port", str(port), "--", PY, "x.py", run_id=new_run_id()
        )
    assert done.returncode == 2
    assert f"port {port} on 127.0.0.1 is already held by a live listener" in done.stderr


def test_terminal_phase_is_published_before_cleanup(tmp_path: Path) -> None:
    """In-process controller: every snapshot is observed; `done` comes while the port still serves.

    A subscriber wakes on the loop turn after a publish; teardown closes the port only after the
    agents have processed Finish (many turns later), so "serving" seen on waking is "serving"
    at the publish — and the board's own bytes, served at that moment, say `done`.
    """

    async def main() -> tuple[list[tuple[Phase, bool]], ExitCode]:
        plan = LaunchPlan(
            run_id=new_run_id(),
            secret=new_session_secret(),
            bind_host="127.0.0.1",
            port=0,
            join=JoinConfig(min_rank_start=1, join_timeout=30, target_ranks=1, max_join_timeout=60),
            workers=(
                PlacedWorker(
                    spec=WorkerSpec(host="localhost", devices=DeviceSpec.cpu(1)),
                    placement=Placement.LOCAL,
                ),
            ),
            command=(PY, "-c", "print('hello')"),
        )
        sink = io.BytesIO()
        controller = Controller(plan, output=RankOutput(stdout=sink, stderr=sink))
        seen: list[tuple[Phase, bool]] = []
        terminal = (Phase.DONE, Phase.FAILED)

        async def record(sub: Subscription) -> None:
            async for snapshot in sub:
                seen.append((snapshot.phase, controller.serving))
                if snapshot.phase in terminal:
                    encoded = controller.status_board.encoded
                    assert encoded is not None
                    assert json.loads(encoded)["phase"] == snapshot.phase.value
                    return

        with controller.status_board.subscribe(maxsize=1000) as sub:
            await controller.bind()
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(record(sub), name="status-subscriber")
                    result = await controller.run()
                    sub.close()  # ends the subscriber should it have missed the terminal phase (the asserts say so)
            finally:
                await controller.aclose()
            assert sub.statistics().dropped == 0  # every snapshot observed
        assert_nothing_left(plan.run_id)
        return seen, result.exit_code

    seen, code = asyncio.run(main())
    assert code is ExitCode.OK
    phases = [phase for phase, _ in seen]
    order = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] is not p]
    # The store rides the controller's port: ready as the world forms, so no `forming` wait is published.
    assert order == [Phase.WAITING, Phase.TRAINING, Phase.DONE]
    assert all(serving for phase, serving in seen if phase is Phase.DONE)


def test_flodl_launch_help_lists_examples_and_exit_codes() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flodl_async.cli.launch", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "flodl-launch --nproc 2 -- python examples/train.py" in done.stdout
    assert "130  interrupted" in done.stdout
    assert "--nproc-per-node" in done.stdout


@pytest.mark.parametrize(
    "module", ["flodl_async.cli.launch", "flodl_async.agent", "flodl_async.cli.flodl"]
)
def test_every_command_has_a_version_and_examples(module: str) -> None:
    from flodl_async._version import __version__

    version = subprocess.run(
        [sys.executable, "-m", module, "--version"], capture_output=True, text=True, check=True
    )
    assert version.stdout.strip().endswith(__version__)
    helped = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, check=True
    )
    assert "examples:" in helped.stdout


def test_torchrun_spellings_are_accepted(tmp_path: Path) -> None:
    for spelling in ("--nproc-per-node", "--nproc_per_node"):
        done = run_launch(
            "--standalone",
            spelling,
            "2",
            "--devices",
            "cpu",
            "--port",
            "0",
            "--",
            PY,
            "-c",
            "pass",
            run_id=new_run_id(),
        )
        assert done.returncode == 0, done.stderr
        assert "all 2 ranks exited 0" in done.stderr
    _ = struct  # header packing above uses the wire's own struct layout


def test_an_agent_lost_before_formation_fails_the_window_naming_it(tmp_path: Path) -> None:
    port = free_port()
    run_id = new_run_id()
    secret_file = tmp_path / "secret"
    cluster = _local_worker_cluster(tmp_path, port, quorum=3, target=3)
    launcher = Launcher(
        str(cluster),
        "--secret-file",
        str(secret_file),
        "--",
        PY,
        script("wait_for_file.py"),
        str(tmp_path / "never"),
        run_id=run_id,
    )
    agent = None
    try:
        wait_status(port, lambda d: d["joined_ranks"] == 1)
        agent = subprocess.Popen(
            _walk_in(port, "doomed", secret_file),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_status(port, lambda d: d["joined_ranks"] == 2)
        agent.kill()
        agent.wait(10)
        done = launcher.finish(timeout=60)
    finally:
        launcher.kill()
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait()
    assert done.returncode == 3, done.stderr
    assert (
        "the world did not form: agent on host 'doomed' went away before the world formed"
        in done.stderr
    )


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (["--controller", "127.0.0.1:1"], "not-hex\n", "session secret must be 32 hex characters"),
        (
            ["--controller", "127.0.0.1:1", "--devices", "gpu"],
            "00" * 16 + "\n",
            "--devices: expected `all`, GPU ids like 0,1, or cpu:N",
        ),
        (["--controller", "127.0.0.1:x"], "00" * 16 + "\n", "port must be a number"),
    ],
)
def test_flodl_agent_bad_input_is_a_usage_error(args: list[str], stdin: str, message: str) -> None:
    done = subprocess.run(
        [PY, "-m", "flodl_async.agent", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_flodl_agent_unreachable_controller_is_reported() -> None:
    port = free_port()
    done = subprocess.run(
        [PY, "-m", "flodl_async.agent", "--controller", f"127.0.0.1:{port}", "--devices", "cpu:1", "--connect-timeout", "0"],
        input="00" * 16 + "\n", capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 3  # could not join
    assert f"cannot reach the controller at 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_agent_killed_mid_run_fails_the_run_and_leaves_nothing(tmp_path: Path) -> None:
    port = free_port()
    run_id = new_run_id()
    secret_file = tmp_path / "secret"
    cluster = _local_worker_cluster(tmp_path, port, quorum=2, target=2)
    launcher = Launcher(
        str(cluster),
        "--secret-file",
        str(secret_file),
        "--stop-grace",
        "3",
        "--",
        PY,
        script("wait_for_file.py"),
        str(tmp_path / "never"),
        run_id=run_id,
    )
    agent = None
    try:
        wait_status(port, lambda d: d["joined_ranks"] == 1)
        agent = subprocess.Popen(
            _walk_in(port, "victim", secret_file),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        launcher.wait_for_stdout(
            "ready pid", count=2
        )  # both ranks run (the victim's line came up its join link)
        agent.kill()  # SIGKILL: no goodbye on the join link
        agent.wait(10)
        done = launcher.finish(timeout=60)
    finally:
        launcher.kill()
        if agent is not None:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
            if agent.stdout is not None:
                agent.stdout.close()
        assert_nothing_left(run_id)
    assert done.returncode == 4, done.stderr
    assert "agent on host 'victim' was lost mid-run" in done.stderr


# ----- --secret-file must be private --------------------------------------------------------------


def _loose_secret(tmp_path: Path, mode: int = 0o644) -> Path:
    path = (
        tmp_path / "loose secret"
    )  # a space: the fix must be a command that can be pasted as it is
    path.write_text(new_session_secret().hex() + "\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660], ids=lambda mode: f"{mode:04o}")
def test_flodl_launch_refuses_a_secret_file_group_or_others_can_read(
    tmp_path: Path, mode: int
) -> None:
    secret = _loose_secret(tmp_path, mode)
    port = free_port()
    done = run_launch(
        "--nproc",
        "1",
        "--devices",
        "cpu",
        "--port",
        str(port),
        "--secret-file",
        str(secret),
        "--",
        PY,
        "-c",
        "pass",
        run_id=new_run_id(),
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"flodl-launch: error: secret file {secret}: has mode {mode:04o}, so group or others can get at the session secret "
        f"(refused, as ssh refuses a loose private key) — run `chmod 600 '{secret}'`"
    )
    assert "window open" not in done.stderr
    assert done.stdout == ""
    assert oct(secret.stat().st_mode & 0o777) == oct(mode)  # refused, not silently fixed


def test_flodl_agent_refuses_a_secret_file_group_or_others_can_read(tmp_path: Path) -> None:
    secret = _loose_secret(tmp_path)
    with socket.socket() as controller:  # a real listener: the agent must not even dial it
        controller.bind(("127.0.0.1", 0))
        controller.listen()
        controller.settimeout(0)
        port = controller.getsockname()[1]
        done = subprocess.run(
            [PY, "-m", "flodl_async.agent", "--controller", f"127.0.0.1:{port}", "--devices", "cpu:1", "--secret-file", str(secret)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        with contextlib.suppress(BlockingIOError):  # nothing connected
            dialled, _ = controller.accept()
            dialled.close()
            pytest.fail("flodl-agent dialled the controller with a loose secret file")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"flodl-agent: secret file {secret}: has mode 0644, so group or others can get at the session secret "
        f"(refused, as ssh refuses a loose private key) — run `chmod 600 '{secret}'`"
    )
    assert done.stdout == ""


def test_the_secret_file_flodl_launch_writes_is_0600_even_under_umask_0(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    run_id = new_run_id()
    done = subprocess.run(
        launch_cmd("--nproc", "1", "--devices", "cpu", "--port", "0", "--secret-file", str(secret), "--", PY, "-c", "pass", run_id=run_id),
        capture_output=True, text=True, timeout=60, check=False, preexec_fn=lambda: os.umask(0),
    )  # fmt: skip
    assert_nothing_left(run_id)
    assert done.returncode == 0, done.stderr
    assert oct(secret.stat().st_mode & 0o777) == "0o600"
    assert len(secret.read_text().strip()) == 32
    again = run_launch(
        "--nproc",
        "1",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--secret-file",
        str(secret),
        "--",
        PY,
        "-c",
        "pass",
        run_id=new_run_id(),
    )
    assert again.returncode == 0, again.stderr  # the file it wrote passes its own check


def test_a_missing_directory_of_the_secret_file_is_made_0700_even_under_umask_0(
    tmp_path: Path,
) -> None:
    secret = tmp_path / "made" / "here" / "secret"
    run_id = new_run_id()
    done = subprocess.run(
        launch_cmd("--nproc", "1", "--devices", "cpu", "--port", "0", "--secret-file", str(secret), "--", PY, "-c", "pass", run_id=run_id),
        capture_output=True, text=True, timeout=60, check=False, preexec_fn=lambda: os.umask(0),
    )  # fmt: skip
    assert_nothing_left(run_id)
    assert done.returncode == 0, done.stderr
    assert oct(secret.stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "made").stat().st_mode & 0o777) == "0o700"
    assert oct(secret.parent.stat().st_mode & 0o777) == "0o700"


# ----- one machine, one host: localhost, loopback, the hostname and its FQDN ------------------------


def _aliases_of_this_machine() -> list[str]:
    hostname = socket.gethostname()
    spellings = [hostname, hostname.upper(), f"{hostname}.", "127.0.0.1", "::1", "127.0.0.2"]
    fqdn = socket.getfqdn()
    if fqdn not in spellings and fqdn != "localhost":
        spellings.append(fqdn)
    return spellings


@pytest.mark.parametrize("alias", _aliases_of_this_machine())
def test_an_agent_joining_as_another_name_of_the_controllers_machine_is_a_duplicate(
    tmp_path: Path, alias: str
) -> None:
    port = free_port()
    run_id = new_run_id()
    secret_file = tmp_path / "secret"
    cluster = _local_worker_cluster(
        tmp_path, port, quorum=2, target=2
    )  # the launcher's own agent joins as `localhost`
    launcher = Launcher(
        str(cluster),
        "--secret-file",
        str(secret_file),
        "--",
        PY,
        script("wait_for_file.py"),
        str(tmp_path / "never"),
        run_id=run_id,
    )
    try:
        wait_status(port, lambda d: d["joined_ranks"] == 1)
        agent = subprocess.run(
            _walk_in(port, alias, secret_file),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert agent.returncode == 3, agent.stderr  # could not join: refused
        assert (
            f"join rejected by the controller: host {alias!r} is the machine that already joined this run as 'localhost'"
            in agent.stderr
        )
        assert "Traceback" not in agent.stderr
        still = _status(port)
        assert still is not None
        assert [mb["host"] for mb in still["members"]] == [
            "localhost"
        ]  # not admitted as a second host
        assert still["phase"] == "waiting"
        launcher.proc.terminate()
        done = launcher.finish(timeout=30)
    finally:
        launcher.kill()
    assert done.returncode == 143


def test_a_cluster_file_naming_this_machine_twice_is_a_config_error_naming_the_line(
    tmp_path: Path,
) -> None:
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"workers:\n  - host: localhost\n    devices: cpu:1\n  - host: {socket.gethostname()}\n    devices: cpu:1\n"
    )
    done = run_launch(str(cluster), "--", PY, "-c", "pass", run_id=new_run_id())
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"flodl-launch: error: {cluster}:4: workers[1].host: host {socket.gethostname()!r} is this machine, which workers[0] (line 2) "
        "already lists as 'localhost'; one machine is one worker — give it one entry with all its devices"
    )


# ----- several runs on one machine ----------------------------------------------------------------


@pytest.fixture
def own_runtime() -> Any:
    """A runtime directory of this test's own, so other runs on the machine are not listed."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="fl-xdg-", dir="/tmp"))
    yield {"XDG_RUNTIME_DIR": str(path)}
    shutil.rmtree(path, ignore_errors=True)


def _flodl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "flodl_async.cli.flodl", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **env},
        check=False,
    )


def test_flodl_ps_and_status_find_the_local_runs(
    tmp_path: Path, own_runtime: dict[str, str]
) -> None:
    release = tmp_path / "release"
    assert "no flodl run on this machine" in _flodl("ps", env=own_runtime).stdout
    waiting = ("--port", "0", "--", PY, script("wait_for_file.py"), str(release))
    first = Launcher(
        "--nproc", "2", "--devices", "cpu", *waiting, run_id=new_run_id(), env=own_runtime
    )
    second: Launcher | None = None
    try:
        first.wait_for_stdout("ready pid", count=2)
        alone = _flodl("status", env=own_runtime)
        assert alone.returncode == 0, alone.stderr
        assert f"run      {first.run_id}" in alone.stdout  # no --addr: the one local run
        second = Launcher(
            "--nproc", "1", "--devices", "cpu", *waiting, run_id=new_run_id(), env=own_runtime
        )
        second.wait_for_stdout("ready pid")
        ps = _flodl("ps", env=own_runtime)
        assert ps.returncode == 0, ps.stderr
        rows = {line.split()[0]: line.split() for line in ps.stdout.splitlines()[1:]}
        assert set(rows) == {first.run_id, second.run_id}
        assert rows[first.run_id][2] == str(first.proc.pid)
        assert rows[first.run_id][4] == "2"
        assert rows[first.run_id][5] == "training"
        assert rows[second.run_id][2] == str(second.proc.pid)
        assert rows[second.run_id][4] == "1"
        ambiguous = _flodl("status", env=own_runtime)
        assert ambiguous.returncode == 2
        assert "2 runs on this machine; pick one with --addr HOST:PORT" in ambiguous.stderr
        assert first.run_id in ambiguous.stdout
        assert second.run_id in ambiguous.stdout
        # A SIGKILLed launcher cannot remove its entry: the next reader sweeps it.
        second.proc.kill()
        second.kill()
        assert_nothing_left(second.run_id)
        after_kill = _flodl("ps", env=own_runtime)
        assert second.run_id not in after_kill.stdout
        assert first.run_id in after_kill.stdout
        release.touch()
        assert first.finish().returncode == 0
    finally:
        release.touch()
        first.kill()
        if second is not None:
            second.kill()
    assert "no flodl run on this machine" in _flodl("ps", env=own_runtime).stdout
    assert os.listdir(Path(own_runtime["XDG_RUNTIME_DIR"]) / "flodl" / "controllers") == []


def test_a_taken_default_port_gives_way_for_nproc_runs_but_an_explicit_port_is_strict(
    tmp_path: Path, own_runtime: dict[str, str]
) -> None:
    from flodl_async.config.addr import DEFAULT_PORT

    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with contextlib.suppress(OSError):  # already taken by someone else: taken all the same
            holder.bind(("127.0.0.1", DEFAULT_PORT))
            holder.listen()
        done = run_launch(
            "--nproc",
            "1",
            "--devices",
            "cpu",
            "--",
            PY,
            "-c",
            "pass",
            run_id=new_run_id(),
            env=own_runtime,
        )
        assert done.returncode == 0, done.stderr
        assert re.search(
            rf"port {DEFAULT_PORT} is taken \(another run\? see `flodl ps`\); using free port \d+ instead",
            done.stderr,
        ), done.stderr
        strict = run_launch(
            "--nproc",
            "1",
            "--devices",
            "cpu",
            "--port",
            str(DEFAULT_PORT),
            "--",
            PY,
            "-c",
            "pass",
            run_id=new_run_id(),
            env=own_runtime,
        )
        assert strict.returncode == 2
        assert (
            f"port {DEFAULT_PORT} on 127.0.0.1 is already held by a live listener" in strict.stderr
        )
        cluster = tmp_path / "cluster.yml"
        cluster.write_text(
            f"controller:\n  port: {DEFAULT_PORT}\nworkers:\n  - host: localhost\n    devices: cpu:1\n"
        )
        from_file = run_launch(
            str(cluster), "--", PY, "-c", "pass", run_id=new_run_id(), env=own_runtime
        )
        assert from_file.returncode == 2, from_file.stderr
        assert "already held by a live listener" in from_file.stderr


def test_flodl_agent_started_before_its_controller_waits_for_it(tmp_path: Path) -> None:
    port = free_port()
    run_id = new_run_id()
    secret_file = tmp_path / "secret"
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, new_session_secret().hex().encode() + b"\n")
    os.close(fd)
    agent = subprocess.Popen(
        [*_walk_in(port, "early", secret_file), "--connect-timeout", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    launcher = None
    try:
        assert agent.stderr is not None
        first = agent.stderr.readline()  # nothing listens yet: it says so once, and keeps dialing
        assert (
            f"agent early: no controller at 127.0.0.1:{port} yet (Connection refused); retrying for up to 120s"
            in first
        )
        assert agent.poll() is None
        cluster = _local_worker_cluster(tmp_path, port, quorum=2, target=2)
        launcher = Launcher(
            str(cluster), "--secret-file", str(secret_file), "--", PY, "-c", "pass", run_id=run_id
        )
        done = launcher.finish(timeout=90)
        _out, rest = agent.communicate(timeout=30)
    finally:
        if launcher is not None:
            launcher.kill()
        if agent.poll() is None:
            agent.kill()
            agent.communicate()
        assert_nothing_left(run_id)
    assert done.returncode == 0, done.stderr
    assert 'host "early" joined with ranks 1 ' in done.stderr
    assert agent.returncode == 0, rest
    assert "no controller at" not in rest  # said once only


def test_flodl_agent_gives_up_after_its_connect_timeout() -> None:
    port = free_port()
    done = subprocess.run(
        [PY, "-m", "flodl_async.agent", "--controller", f"127.0.0.1:{port}", "--devices", "cpu:1", "--connect-timeout", "1.5"],
        input="00" * 16 + "\n", capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert (
        f"cannot reach the controller at 127.0.0.1:{port}: Connection refused (waited 1.5s, --connect-timeout)"
        in done.stderr
    )
    assert done.stderr.count("no controller at") == 1


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_the_wait_for_the_controller(sig: signal.Signals, code: int) -> None:
    agent = subprocess.Popen(
        [PY, "-m", "flodl_async.agent", "--controller", f"127.0.0.1:{free_port()}", "--devices", "cpu:1", "--connect-timeout", "300"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert agent.stdin is not None
        assert agent.stderr is not None
        agent.stdin.write("00" * 16 + "\n")
        agent.stdin.flush()
        assert "yet (Connection refused); retrying for up to 300s" in agent.stderr.readline()
        agent.send_signal(sig)
        assert agent.wait(timeout=30) == code
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.communicate()


# `ready` is printed inside the `try`: a Ctrl-C sent the moment the line arrives lands in the
# rank's KeyboardInterrupt handler, not in the bare interpreter.
SAVE_ON_SIGNAL = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda s, f: (print('saved on SIGTERM', flush=True), sys.exit(0)))\n"
    "try:\n"
    "    print('ready', flush=True)\n"
    "    time.sleep(600)\n"
    "except KeyboardInterrupt:\n"
    "    print('saved on SIGINT', flush=True)\n"
)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_launchers_signal_reaches_a_stand_alone_agents_ranks_first(
    sig: signal.Signals, tmp_path: Path
) -> None:
    """The signal table holds on every host: a walk-in flodl-agent's plain-script rank gets Ctrl-C as SIGINT too."""
    port = free_port()
    run_id = new_run_id()
    secret_file = tmp_path / "secret"
    rank = tmp_path / "save_on_signal.py"
    rank.write_text(SAVE_ON_SIGNAL)
    cluster = _local_worker_cluster(tmp_path, port, quorum=2, target=2)
    launcher = Launcher(
        str(cluster),
        "--secret-file",
        str(secret_file),
        "--stop-grace",
        "20",
        "--",
        PY,
        str(rank),
        run_id=run_id,
    )
    agent = None
    try:
        wait_status(port, lambda d: d["joined_ranks"] == 1)
        agent = subprocess.Popen(
            _walk_in(port, "walk-in", secret_file),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        launcher.wait_for_stdout("ready", count=2)
        # The stand-alone agent reports its rank's activity up its join link, like the local one.
        reported = wait_status(
            port,
            lambda d: (
                all(isinstance(r.get("pid"), int) and r.get("process") for r in d["ranks"])
                and len(d["ranks"]) == 2
            ),
        )
        assert {r["host"]: r["last_line"] for r in reported["ranks"]} == {
            "localhost": "ready",
            "walk-in": "ready",
        }
        launcher.proc.send_signal(sig)
        done = launcher.finish(timeout=60)
        _out, agent_err = agent.communicate(timeout=30)
    finally:
        launcher.kill()
        reap(agent)
        assert_nothing_left(run_id)
    assert done.returncode == 128 + sig, done.stderr
    assert (
        f"[walk-in:r1] saved on {sig.name}" in done.stdout
    )  # the remote host's rank, over its join link
    assert re.search(rf"^\[localhost:r0\] saved on {sig.name}$", done.stdout, re.M), done.stdout
    assert f"stopping: ranks got {sig.name}; KILL in 20 s" in done.stderr
    assert agent.returncode == 4, agent_err  # the controller ended the run (flodl-agent's table)
    assert "Traceback" not in agent_err


def test_ctrl_c_reaches_a_stopped_rank_without_waiting_for_the_kill(tmp_path: Path) -> None:
    """A ^Z'd or SIGSTOPped rank still runs its ``except KeyboardInterrupt`` handler at once: the stop signal comes with SIGCONT."""
    port = free_port()
    run_id = new_run_id()
    rank = tmp_path / "save_on_signal.py"
    rank.write_text(SAVE_ON_SIGNAL)
    # A grace longer than the test's own timeout: only the SIGCONT lets the rank save and the run end in time.
    launcher = Launcher(
        "--nproc",
        "1",
        "--devices",
        "cpu",
        "--port",
        str(port),
        "--stop-grace",
        "600",
        "--",
        PY,
        str(rank),
        run_id=run_id,
    )
    try:
        launcher.wait_for_stdout("ready")
        pid = wait_status(
            port, lambda d: len(d["ranks"]) == 1 and isinstance(d["ranks"][0].get("pid"), int)
        )["ranks"][0]["pid"]
        os.kill(pid, signal.SIGSTOP)
        wait_status(port, lambda d: d["ranks"][0].get("process") == "stopped", timeout=30)
        launcher.proc.send_signal(signal.SIGINT)
        done = launcher.finish(timeout=60)
    finally:
        launcher.kill()
        assert_nothing_left(run_id)
    assert done.returncode == 130, done.stderr
    assert re.search(r"^\[[^\]]+:r0\] saved on SIGINT$", done.stdout, re.M), done.stdout


# ----- hangs you can see ------------------------------------------------------------------------


def _rank_rows(doc: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(r["rank"]): r for r in doc["ranks"]}


def test_a_hang_is_visible_per_rank_in_status(tmp_path: Path) -> None:
    """Rank 0 waits in init_process_group (connected to the store); rank 1 never gets there (asleep): status tells them apart."""
    port = free_port()
    run_id = new_run_id()
    launcher = Launcher(
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        str(port),
        "--stop-grace",
        "3",
        "--",
        PY,
        script("hang_at_init.py"),
        run_id=run_id,
    )
    try:
        launcher.wait_for_stdout("loading", count=2)

        def both_reported(doc: dict[str, Any]) -> bool:
            rows = _rank_rows(doc)
            return (
                len(rows) == 2
                and rows[0].get("store_connected") is True
                and (rows[1].get("quiet_s") or 0) >= 2
            )

        doc = wait_status(port, both_reported, timeout=90)
        rows = _rank_rows(doc)
        for rank in (0, 1):
            assert isinstance(rows[rank]["pid"], int)
            assert (
                rows[rank]["last_line"] == f"rank {rank} loading"
            )  # a loopback client sees the line itself
            assert rows[rank]["output_age_s"] is not None
            assert rows[rank]["uptime_s"] > 0
        assert rows[1]["store_connected"] is False  # never reached init_process_group
        assert rows[1]["process"] == "sleeping"
        assert rows[1]["cpu_percent"] == 0
        status_cmd = [
            PY,
            "-m",
            "flodl_async.cli.flodl",
            "status",
            "--addr",
            f"127.0.0.1:{port}",
            "--silent-after",
            "2",
        ]
        table = subprocess.run(status_cmd, capture_output=True, text=True, check=True)
        assert re.search(
            r"SILENT   rank 1 on \S+: silent and idle for \d+s \(sleeping\)", table.stdout
        ), table.stdout
        assert "rank 1 loading" in table.stdout
        os.kill(rows[1]["pid"], signal.SIGSTOP)  # a stopped rank shows as stopped
        stopped = wait_status(
            port, lambda d: _rank_rows(d)[1].get("process") == "stopped", timeout=30
        )
        assert _rank_rows(stopped)[1]["state"] == "running"
        os.kill(rows[1]["pid"], signal.SIGCONT)
        launcher.proc.send_signal(signal.SIGTERM)
        done = launcher.finish(timeout=60)
    finally:
        launcher.kill()
    assert done.returncode == 143, done.stderr


def test_hang_timeout_ends_the_run_naming_the_rank(tmp_path: Path) -> None:
    run_id = new_run_id()
    args = (
        "--nproc",
        "2",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--stop-grace",
        "3",
        "--hang-timeout",
        "3",
    )
    done = run_launch(*args, "--", PY, script("hang_at_init.py"), run_id=run_id, timeout=120)
    assert done.returncode == 6, done.stderr
    hung = r"FAILED — rank [01] \(local rank [01]\) on host '[^']+' hung: no output and no CPU progress for [\d.]+ s \(--hang-timeout 3\)"
    assert re.search(hung, done.stderr), done.stderr
    assert "its last output line: rank " in done.stderr


@pytest.mark.skipif(
    not Path(f"/proc/self/task/{os.getpid()}/children").exists(),
    reason="this kernel has no /proc/<pid>/task/<tid>/children files",
)
def test_a_wrapper_script_whose_python_computes_silently_is_not_hung(tmp_path: Path) -> None:
    """``flodl-launch -- sh run.sh``: the rank's own process is a shell asleep in ``wait``; its python's CPU is the rank's progress."""
    run_sh = tmp_path / "run.sh"
    run_sh.write_text(
        f'{PY} -c "import time\nt = time.time()\nwhile time.time() - t < 6: pass"\necho computed\n'
    )
    args = (
        "--nproc",
        "1",
        "--devices",
        "cpu",
        "--port",
        "0",
        "--stop-grace",
        "3",
        "--hang-timeout",
        "3",
    )
    done = run_launch(*args, "--", "sh", str(run_sh), run_id=new_run_id(), timeout=120)
    assert done.returncode == 0, (
        done.stderr
    )  # read as the shell alone, it was "quiet" for 6 s: exit 6
    assert "computed" in done.stdout


@pytest.mark.parametrize(
    ("devices", "mask", "message"),
    [
        ("all", None, "0 GPUs visible); for CPU ranks use --devices cpu:N"),
        ("0,2", "2,3", "GPU 2 is not visible here: this host shows 2 GPU(s) (visible: 2,3)"),
    ],
)
def test_flodl_agent_checks_its_gpus_within_the_mask_before_dialing(
    tmp_path: Path, devices: str, mask: str | None, message: str
) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    count = 0 if mask is None else 4
    for i in range(count):
        (dev / f"nvidia{i}").touch()
    env = {**os.environ, "FLODL_INTERNAL_DEV_DIR": str(dev)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if mask is not None:
        env["CUDA_VISIBLE_DEVICES"] = mask
    done = subprocess.run(
        [PY, "-m", "flodl_async.agent", "--controller", f"127.0.0.1:{free_port()}", "--devices", devices, "--connect-timeout", "0"],
        input="00" * 16 + "\n", capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert "cannot reach" not in done.stderr  # refused before any dial
