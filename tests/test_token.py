"""The cluster token: ``flodl token new``, the TOKEN handshake on the join channel, and dial-in agents that hold it.

Pure parts (the handshake, the resolver) run in memory; the rest runs the real
``flodl`` / ``flodl-launch`` / ``flodl-agent`` processes with real gloo ranks.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from flodl_async.config.cluster import parse_cluster
from flodl_async.errors import ConfigError, HandshakeRefused, WrongToken
from flodl_async.host.secretfile import read_secret_file, read_token_file
from flodl_async.wire.channels import Channel
from flodl_async.wire.handshake import (
    ClientHandshake,
    ServerHandshake,
    join_resolver,
    session_resolver,
)
from flodl_async.wire.keys import (
    TOKEN_BYTES,
    Credential,
    CredentialKind,
    new_cluster_token,
    new_session_secret,
)

from .launchkit import (
    PY,
    Launcher,
    assert_nothing_left,
    free_port,
    new_run_id,
    run_flodl,
    script,
    wait_status,
)

WRONG_TOKEN_LINE = (
    "the controller's proof did not verify: it holds another cluster token, or it is not our "
    "controller (check --token-file and --controller)"
)


# ----- flodl token new -------------------------------------------------------------------------


_flodl = run_flodl


def test_token_new_writes_a_private_fresh_token_and_prints_no_secret(tmp_path: Path) -> None:
    path = tmp_path / "token"
    done = _flodl("token", "new", str(path))
    assert done.returncode == 0, done.stderr
    text = path.read_text()
    token = read_token_file(path)
    assert len(token) == TOKEN_BYTES  # 256 bits
    assert text.strip() == token.hex()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert token.hex() not in done.stdout + done.stderr
    assert str(path) in done.stdout
    other = tmp_path / "other"
    assert _flodl("token", "new", str(other)).returncode == 0
    assert read_token_file(other) != token  # fresh each time


def test_token_new_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("keep me\n")
    done = _flodl("token", "new", str(path))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert "already exists" in done.stderr
    assert "Traceback" not in done.stderr
    assert path.read_text() == "keep me\n"


def test_a_session_secret_file_is_not_a_token_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, new_session_secret().hex().encode() + b"\n")
    os.close(fd)
    read_secret_file(path)
    with pytest.raises(
        Exception,
        match=r"^token file .*: cluster token must be 64 hex characters .*`flodl token new PATH`",
    ):
        read_token_file(path)


# ----- the TOKEN handshake (sans-IO) -------------------------------------------------------------


def _handshake(
    client_token: bytes, server_token: bytes | None
) -> tuple[ClientHandshake, ServerHandshake, bytes]:
    client = ClientHandshake(
        channel=Channel.JOIN, credential=Credential.token(client_token), version="t"
    )
    server = ServerHandshake(
        channel=Channel.JOIN,
        resolve=join_resolver(new_session_secret(), server_token),
        run_id="r",
        version="t",
    )
    return client, server, server.receive_data(client.hello()).send


def test_the_token_handshake_establishes_matching_keys_without_the_token_on_the_wire() -> None:
    token = new_cluster_token()
    client, server, server_hello = _handshake(token, token)
    assert token not in server_hello
    step = client.receive_data(server_hello)
    assert step.established is not None
    assert token not in client.hello() + step.send
    done = server.receive_data(step.send)
    assert done.established is not None
    assert done.established.peer.kind is CredentialKind.TOKEN
    assert done.established.keys.recv_aead == step.established.keys.send_aead
    assert done.established.keys.send_aead == step.established.keys.recv_aead


def test_a_wrong_token_fails_at_the_agent_and_at_the_controller() -> None:
    client, server, server_hello = _handshake(new_cluster_token(), new_cluster_token())
    with pytest.raises(WrongToken, match=WRONG_TOKEN_LINE.replace("(", r"\(").replace(")", r"\)")):
        client.receive_data(server_hello)
    # The agent closes without proving: the controller counts that as wrong_token, naming the token.
    with pytest.raises(WrongToken, match="another cluster token"):
        server.receive_data(b"")


def test_a_token_is_refused_when_token_admission_is_off_and_on_every_other_channel() -> None:
    _client, _server, refusal = _handshake(new_cluster_token(), None)
    assert b"token admission" in refusal
    assert b"--token-file" in refusal
    hello = ClientHandshake(
        channel=Channel.CONTROL, credential=Credential.token(new_cluster_token()), version="t"
    ).hello()
    other = ServerHandshake(
        channel=Channel.CONTROL,
        resolve=session_resolver(new_session_secret()),
        run_id="r",
        version="t",
    )
    step = other.receive_data(hello)
    assert isinstance(step.failure, HandshakeRefused)


# ----- dial-in agents end to end -----------------------------------------------------------------


def _cluster(tmp_path: Path, port: int, *, join_timeout: float = 120) -> Path:
    """The walk-in is not in the file: the join targets (2 ranks) make room for it."""
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"controller:\n  port: {port}\n  token_file: token\n"
        f"  join: {{min_rank_start: 2, target_ranks: 2, join_timeout: {join_timeout:g}, max_join_timeout: {join_timeout:g}}}\n"
        "workers:\n  - host: localhost\n    devices: cpu:1\n"
    )
    return cluster


def _dial_in_cluster(tmp_path: Path, port: int) -> Path:
    """The walk-in is listed as a dial-in worker: no join knobs, the window waits for the file's capacity (2 ranks)."""
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"controller:\n  port: {port}\n  token_file: token\n"
        "workers:\n  - host: localhost\n    devices: cpu:1\n  - host: walk-in\n    devices: cpu:1\n    dial_in: true\n"
    )
    return cluster


def _agent(port: int, token_file: Path, env: dict[str, str]) -> subprocess.Popen[str]:
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
        "--token-file",
        str(token_file),
    ]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env}
    )


def _all_cmdlines() -> bytes:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                out.append(Path(f"/proc/{entry}/cmdline").read_bytes())
    return b"\n".join(out)


def _get(port: int, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        return bytes(response.read())


def _spellings(secret: bytes) -> tuple[bytes, ...]:
    return (secret, secret.hex().encode(), secret.hex().upper().encode())


@pytest.mark.e2e
def test_a_listed_dial_in_agent_joins_with_the_token_gets_the_secret_sealed_and_runs_its_rank(
    tmp_path: Path, xdg: Path
) -> None:
    """A listed dial-in worker holds only the token; its rank all-reduces with the launcher's (its relay used the sealed secret).

    Neither the token nor the session secret is in any process's argv, the status pages, the
    launcher's or the agent's output, or any file of ``--log-dir``, while every rank prints its
    whole environment into those outputs and files.
    """
    assert _flodl("token", "new", str(tmp_path / "token")).returncode == 0
    token = read_token_file(tmp_path / "token")
    port, run_id = free_port(), new_run_id()
    env = {"XDG_RUNTIME_DIR": str(xdg)}
    logs, release = tmp_path / "logs", tmp_path / "release"
    launcher = Launcher(
        str(_dial_in_cluster(tmp_path, port)),
        *("--secret-file", str(tmp_path / "secret"), "--log-dir", str(logs)),
        *("--", PY, script("env_wait_allreduce.py"), str(release)),
        run_id=run_id,
        env=env,
    )
    agent = None
    try:
        wait_status(port, lambda doc: doc["joined_ranks"] == 1)
        secret = read_secret_file(tmp_path / "secret")
        agent = _agent(port, tmp_path / "token", env)
        launcher.wait_for_stdout(
            "ready pid", count=2, timeout=120
        )  # both ranks up, the world whole: every page has its most
        seen = {
            "argv": _all_cmdlines(),
            "/state.json": _get(port, "/state.json"),
            "/": _get(port, "/"),
        }
        release.write_text("")
        agent_out, agent_err = agent.communicate(timeout=120)
        done = launcher.finish(timeout=120)
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait()
        launcher.kill()
    assert agent.returncode == 0, agent_err
    assert done.returncode == 0, done.stderr
    # The walk-in's rank output crossed its join link: the launcher prints it, the agent does not.
    assert "[walk-in:r1] rank 1 of 2 sum 3" in done.stdout
    assert "[walk-in:r1]" not in agent_out
    assert "rank 0 of 2 sum 3" in done.stdout
    assert (
        "[walk-in:r1] env RANK=1" in done.stdout
    )  # the environments were printed: absence below means something
    assert b"<html" in seen["/"].lower()
    files = sorted(p for p in logs.rglob("*") if p.is_file())
    assert len(files) >= 4, files  # stdout and stderr of both ranks, the walk-in's included
    assert any(b"env RANK=1" in p.read_bytes() for p in files), files
    seen.update({"launcher stdout": done.stdout.encode(), "launcher stderr": done.stderr.encode()})
    seen.update({"agent stdout": agent_out.encode(), "agent stderr": agent_err.encode()})
    seen.update({f"log file {p.relative_to(logs)}": p.read_bytes() for p in files})
    for name, value in (("token", token), ("session secret", secret)):
        for where, raw in seen.items():
            for needle in _spellings(value):
                assert needle not in raw, f"the {name} is in the {where}"
    assert_nothing_left(run_id)


@pytest.mark.e2e
def test_token_file_on_the_command_line_overrides_the_cluster_files(
    tmp_path: Path, xdg: Path
) -> None:
    """``flodl-launch --token-file F`` wins over ``controller.token_file``: F's holder is admitted, the file's is refused."""
    assert (
        _flodl("token", "new", str(tmp_path / "token")).returncode == 0
    )  # the cluster file's controller.token_file
    assert _flodl("token", "new", str(tmp_path / "cli-token")).returncode == 0
    port, run_id = free_port(), new_run_id()
    env = {"XDG_RUNTIME_DIR": str(xdg)}
    cluster = _cluster(tmp_path, port)
    launcher = Launcher(
        str(cluster),
        "--token-file",
        str(tmp_path / "cli-token"),
        "--",
        PY,
        script("allreduce.py"),
        run_id=run_id,
        env=env,
    )
    try:
        wait_status(port, lambda doc: doc["joined_ranks"] == 1)
        refused = _agent(port, tmp_path / "token", env)
        _out, refused_err = refused.communicate(timeout=60)
        admitted = _agent(port, tmp_path / "cli-token", env)
        _out, admitted_err = admitted.communicate(timeout=120)
        done = launcher.finish(timeout=120)
    finally:
        launcher.kill()
    assert refused.returncode == 3, refused_err
    assert WRONG_TOKEN_LINE in refused_err
    assert admitted.returncode == 0, admitted_err
    assert done.returncode == 0, done.stderr
    assert "[walk-in:r1] rank 1 of 2 sum 3" in done.stdout
    assert "1 wrong_token" in done.stderr
    assert_nothing_left(run_id)


@pytest.mark.e2e
def test_a_wrong_token_is_refused_on_both_sides_and_a_persistent_agent_keeps_dialing_loudly(
    tmp_path: Path, xdg: Path
) -> None:
    """One run exits 3 at once; ``--persist`` warns at each refusal and dials again (a wrong
    token may be fixed, and it cannot be told from an impostor), until a signal stops it."""
    assert _flodl("token", "new", str(tmp_path / "token")).returncode == 0
    assert _flodl("token", "new", str(tmp_path / "wrong")).returncode == 0
    port, run_id = free_port(), new_run_id()
    env = {"XDG_RUNTIME_DIR": str(xdg)}
    launcher = Launcher(
        str(_cluster(tmp_path, port, join_timeout=600)),
        "--",
        PY,
        script("allreduce.py"),
        run_id=run_id,
        env=env,
    )
    out, err = tmp_path / "persist.out", tmp_path / "persist.err"
    persistent = None
    try:
        wait_status(port, lambda doc: doc["joined_ranks"] == 1)
        agent = _agent(port, tmp_path / "wrong", env)
        _out, agent_err = agent.communicate(timeout=60)
        doc = wait_status(port, lambda doc: _auth_failed(doc) >= 1)
        assert doc["joined_ranks"] == 1  # nobody was admitted
        persistent = _persistent_agent(port, tmp_path / "wrong", env, out, err)
        _wait_for_text(err, WRONG_TOKEN_LINE, count=2)  # refused, and refused again
        assert persistent.poll() is None, err.read_text()  # still up, dialing
        persistent.send_signal(signal.SIGTERM)
        assert persistent.wait(timeout=60) == 143, err.read_text()
        doc = wait_status(port, lambda doc: _auth_failed(doc) >= 3)
        assert doc["joined_ranks"] == 1
    finally:
        if persistent is not None and persistent.poll() is None:
            persistent.kill()
            persistent.wait()
        launcher.proc.terminate()
        done = launcher.finish(timeout=60)
    assert agent.returncode == 3, agent_err
    lines = [line for line in agent_err.splitlines() if line.strip()]
    assert len(lines) == 1
    assert WRONG_TOKEN_LINE in lines[0]
    assert "session secret" not in agent_err  # a dial-in agent holds none
    assert "Traceback" not in agent_err
    text = err.read_text()
    said = text.count(WRONG_TOKEN_LINE)  # each refusal, said with its next dial...
    assert said == text.count("again in") >= 2
    assert "session secret" not in text
    assert "Traceback" not in text
    # ...and each counted by the controller (one more, maybe, cut short by the SIGTERM): its
    # refusal summaries (one line per interval at most) count them all, the one-run agent's too.
    counted = sum(int(n) for n in re.findall(r"(\d+) wrong_token", done.stderr))
    assert 1 + said <= counted <= 2 + said, done.stderr
    assert_nothing_left(run_id)


def _auth_failed(doc: dict[str, object]) -> int:
    counters = doc.get("connections")
    if not isinstance(counters, dict):
        return 0
    dropped = counters.get("dropped")
    return int(dropped.get("wrong_token", 0)) if isinstance(dropped, dict) else 0


@pytest.mark.e2e
def test_a_token_at_a_controller_without_token_admission_gets_the_refusal_s_own_advice(
    tmp_path: Path, xdg: Path
) -> None:
    """The refusal says what the controller takes; the line's tail follows that cause (no word of
    a session secret, which the agent never held)."""
    assert _flodl("token", "new", str(tmp_path / "token")).returncode == 0
    port, run_id = free_port(), new_run_id()
    env = {"XDG_RUNTIME_DIR": str(xdg)}
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"controller:\n  port: {port}\n  join: {{join_timeout: 600}}\n"
        "workers:\n  - host: localhost\n    devices: cpu:1\n  - host: walk-in\n"
        "    devices: cpu:1\n    dial_in: true\n"
    )
    launcher = Launcher(
        str(cluster), "--", PY, script("allreduce.py"), run_id=run_id, env=env
    )  # fmt: skip
    try:
        wait_status(port, lambda doc: doc["joined_ranks"] == 1)
        agent = _agent(port, tmp_path / "token", env)
        _out, agent_err = agent.communicate(timeout=60)
    finally:
        launcher.proc.terminate()
        launcher.finish(timeout=60)
    assert agent.returncode == 3, agent_err
    lines = [line for line in agent_err.splitlines() if line.strip()]
    assert len(lines) == 1, agent_err
    assert (
        "a cluster token is not accepted here: this controller runs without token admission"
        in (lines[0])
    )
    assert lines[0].endswith(
        " — the refusal says what that controller takes: start the agent again with it, or point "
        "it at the controller you meant"
    ), lines[0]
    assert "session secret" not in agent_err


# ----- flodl-agent --persist ----------------------------------------------------------------------


def _persistent_agent(
    port: int, token_file: Path, env: dict[str, str], out: Path, err: Path
) -> subprocess.Popen[str]:
    cmd = [
        *(
            PY,
            "-m",
            "flodl_async.agent",
            "--controller",
            f"127.0.0.1:{port}",
            "--host",
            "walk-in",
            "--devices",
            "cpu:1",
        ),
        *("--token-file", str(token_file), "--persist", "--reconnect-max", "1"),
    ]
    with out.open("w") as stdout, err.open("w") as stderr:
        return subprocess.Popen(
            cmd, stdout=stdout, stderr=stderr, text=True, env={**os.environ, **env}
        )


def _wait_for_text(path: Path, text: str, *, count: int = 1, timeout: float = 60) -> None:
    """The agent's output file holds ``text`` ``count`` times (its own output is the event)."""
    deadline = time.monotonic() + timeout
    while path.read_text().count(text) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} never held {count}x {text!r}: {path.read_text()}")
        time.sleep(0.05)


@pytest.mark.e2e
def test_a_persistent_agent_serves_two_runs_in_a_row_and_leaves_nothing_between(
    tmp_path: Path, xdg: Path
) -> None:
    assert _flodl("token", "new", str(tmp_path / "token")).returncode == 0
    port = free_port()
    env = {"XDG_RUNTIME_DIR": str(xdg)}
    out, err = tmp_path / "agent.out", tmp_path / "agent.err"
    agent = _persistent_agent(
        port, tmp_path / "token", env, out, err
    )  # up before any controller: it backs off
    try:
        _wait_for_text(err, "again in")
        for n, run_id in enumerate((new_run_id(), new_run_id()), start=1):
            done = Launcher(
                str(_cluster(tmp_path, port)),
                "--",
                PY,
                script("allreduce.py"),
                run_id=run_id,
                env=env,
            ).finish(timeout=120)
            assert done.returncode == 0, done.stderr
            assert "rank 0 of 2 sum 3" in done.stdout
            assert (
                "[walk-in:r1] rank 1 of 2 sum 3" in done.stdout
            )  # over the agent's link, to this run's launcher
            _wait_for_text(err, "the run finished", count=n)
            assert agent.poll() is None, err.read_text()  # still up between the runs
            assert_nothing_left(run_id)  # its ranks are gone...
            assert not (
                xdg / "flodl" / "runs" / run_id / "walk-in"
            ).exists()  # ...and so is its runtime entry
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 143, err.read_text()
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert "stopped after serving 2 run(s)" in err.read_text()
    assert "Traceback" not in err.read_text()
    assert read_token_file(tmp_path / "token").hex() not in err.read_text() + out.read_text()


def _impostor(port: int) -> subprocess.Popen[str]:
    """A real server at ``port`` answering every join hello with a well-formed ServerHello and a
    random proof (tests/scripts/impostor_controller.py); returns once it listens."""
    proc = subprocess.Popen(
        [PY, script("impostor_controller.py"), str(port)],
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "listening\n"
    return proc


@pytest.mark.e2e
def test_an_impostor_at_the_controller_address_never_ends_a_persistent_agent(
    tmp_path: Path, xdg: Path
) -> None:
    """Whoever answers at the controller's address between runs cannot stop the fleet's agents.

    Against an impostor a one-run agent exits 3 at once, naming both causes; a persistent one
    warns at each failed proof and dials again; once the impostor is gone and the real
    controller binds that port, it joins the run and serves it.
    """
    assert _flodl("token", "new", str(tmp_path / "token")).returncode == 0
    port, run_id = free_port(), new_run_id()
    env = {"XDG_RUNTIME_DIR": str(xdg)}
    out, err = tmp_path / "agent.out", tmp_path / "agent.err"
    impostor = _impostor(port)
    agent = None
    try:
        once = _agent(port, tmp_path / "token", env)
        _out, once_err = once.communicate(timeout=60)
        agent = _persistent_agent(port, tmp_path / "token", env, out, err)
        _wait_for_text(err, WRONG_TOKEN_LINE, count=2)  # the second attempt failed too
        assert agent.poll() is None, err.read_text()  # and it is still up
        impostor.terminate()
        impostor.communicate(timeout=30)
        done = Launcher(
            str(_cluster(tmp_path, port)),
            "--",
            PY,
            script("allreduce.py"),
            run_id=run_id,
            env=env,
        ).finish(timeout=120)
        _wait_for_text(err, "the run finished")
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 143, err.read_text()
    finally:
        for proc in (impostor, agent):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert once.returncode == 3, once_err
    lines = [line for line in once_err.splitlines() if line.strip()]
    assert len(lines) == 1, once_err
    assert WRONG_TOKEN_LINE in lines[0]
    assert "session secret" not in once_err  # a dial-in agent holds none
    assert done.returncode == 0, done.stderr
    assert "[walk-in:r1] rank 1 of 2 sum 3" in done.stdout  # the persistent agent served the run
    text = err.read_text()
    assert "session secret" not in text
    assert "Traceback" not in text
    assert "stopped after serving 1 run(s)" in text
    assert_nothing_left(run_id)


@pytest.mark.e2e
def test_sigterm_while_a_persistent_agent_backs_off_exits_143_at_once(tmp_path: Path) -> None:
    assert _flodl("token", "new", str(tmp_path / "token")).returncode == 0
    out, err = tmp_path / "agent.out", tmp_path / "agent.err"
    agent = _persistent_agent(free_port(), tmp_path / "token", {}, out, err)  # nobody listens there
    try:
        _wait_for_text(err, "again in", count=2)  # it retried, and waits again
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 143, err.read_text()
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    text = err.read_text()
    assert "cannot reach the controller" in text
    assert "SIGTERM: stopped after serving 0 run(s)" in text
    assert "Traceback" not in text


def test_persist_needs_a_token_file() -> None:
    done = subprocess.run(
        [PY, "-m", "flodl_async.agent", "--controller", "127.0.0.1:1", "--persist"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "--persist needs --token-file" in done.stderr
    assert "Traceback" not in done.stderr


def test_dial_in_workers_parse_and_refuse_what_only_a_launcher_uses() -> None:
    spec = parse_cluster(
        "workers:\n  - host: localhost\n    devices: cpu:1\n  - host: node-b\n    devices: cpu:2\n    dial_in: true\n"
    )
    assert [w.dial_in for w in spec.workers] == [False, True]
    with pytest.raises(ConfigError, match=r"workers\[0\]\.dial_in.*dials in on its own, so ssh"):
        parse_cluster(
            "workers:\n  - host: node-b\n    devices: cpu:2\n    dial_in: true\n    ssh: {user: me}\n"
        )


# ----- open admission -----------------------------------------------------------------------------


def test_no_credential_is_taken_only_under_open_admission() -> None:
    hello = ClientHandshake(
        channel=Channel.JOIN, credential=Credential.open_admission(), version="t"
    ).hello()
    closed = ServerHandshake(
        channel=Channel.JOIN,
        resolve=join_resolver(new_session_secret(), None),
        run_id="r",
        version="t",
    )
    refused = closed.receive_data(hello)
    assert isinstance(refused.failure, HandshakeRefused)
    assert b"does not run open admission" in refused.send
    client = ClientHandshake(
        channel=Channel.JOIN, credential=Credential.open_admission(), version="t"
    )
    server = ServerHandshake(
        channel=Channel.JOIN,
        resolve=join_resolver(new_session_secret(), None, open_admission=True),
        run_id="r",
        version="t",
    )
    step = client.receive_data(server.receive_data(client.hello()).send)
    done = server.receive_data(step.send)
    assert done.established is not None
    assert done.established.peer.kind is CredentialKind.OPEN


@pytest.mark.e2e
def test_open_admission_admits_an_agent_without_a_credential_and_warns_loudly(
    tmp_path: Path, xdg: Path
) -> None:
    port, run_id = free_port(), new_run_id()
    env = {"XDG_RUNTIME_DIR": str(xdg)}
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"controller:\n  port: {port}\n  join: {{min_rank_start: 2, target_ranks: 2, join_timeout: 120, open_admission: true}}\n"
        "workers:\n  - host: localhost\n    devices: cpu:1\n"
    )
    launcher = Launcher(str(cluster), "--", PY, script("allreduce.py"), run_id=run_id, env=env)
    try:
        wait_status(port, lambda doc: doc["joined_ranks"] == 1)
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
            "--open-admission",
        ]
        agent = subprocess.run(
            cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **env}, check=False
        )
        done = launcher.finish(timeout=120)
    finally:
        launcher.kill()
    assert agent.returncode == 0, agent.stderr
    assert "[walk-in:r1] rank 1 of 2 sum 3" in done.stdout
    assert done.returncode == 0, done.stderr
    assert "WARNING: OPEN ADMISSION" in done.stderr
    assert_nothing_left(run_id)
