"""The multi-host first day's papercuts (issue 21 §4), each through a real flodl-launch.

Which ``python`` a leading ``python`` runs on each host (the worker's ``python:``, ``PATH``'s, the
agent's own), torchrun's spellings (``-m``, ``--run-path``, ``--no-python``, ``--nproc-per-node
gpu|cpu``, ``--redirects``/``--tee``), a resubmitted run id, the one port rule and cluster-file paths
relative to the file.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from flodl_async.config.addr import DEFAULT_PORT
from flodl_async.config.cluster import load_cluster
from flodl_async.config.command import (
    PYTHON_VAR,
    RESOLVE_VAR,
    host_command,
    launch_command,
    without_internal,
)
from flodl_async.config.streams import StreamRouting, parse_stream_set
from flodl_async.errors import ConfigError

from .launchkit import (
    PY,
    Launcher,
    assert_nothing_left,
    free_port,
    new_run_id,
    run_launch,
)

HOST = socket.gethostname()
SHOW_EXE = "import sys; print('exe', sys.executable, sys.argv[1:])"


def _wrapper(path: Path, tag: str) -> Path:
    """An executable that says ``tag`` on stderr, then is this interpreter: which python ran shows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "{tag}" >&2\nexec {PY} "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@contextlib.contextmanager
def _default_port_held() -> Iterator[None]:
    """The default port taken for the block (by us, or already by someone else: taken all the
    same)."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with contextlib.suppress(OSError):
            holder.bind(("127.0.0.1", DEFAULT_PORT))
            holder.listen()
        yield


# ----- pure: the command and the streams ------------------------------------------------------


def test_torchrun_command_forms() -> None:
    assert launch_command(("-m", "pkg.mod", "x")) == ("python", "-m", "pkg.mod", "x")
    assert launch_command(("train.py", "-v"), run_path=True) == ("python", "train.py", "-v")
    assert launch_command(("python", "t.py"), no_python=True) == ("python", "t.py")
    for command, kwargs, message in [
        (("-m", "pkg"), {"no_python": True}, "--no-python runs the command as it is"),
        (("-m", "pkg"), {"run_path": True}, "--run-path takes a Python file's path"),
        (("t.py",), {"run_path": True, "no_python": True}, "pick one"),
        (("python", "t.py"), {"run_path": True}, "takes the Python file's path first"),
        (("-m",), {}, "-m needs a module name"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            launch_command(command, **kwargs)  # type: ignore[arg-type]


def test_each_host_resolves_a_leading_python_by_its_own_rule() -> None:
    command = ("python", "t.py")
    run = {RESOLVE_VAR: "1"}

    def which(word: str) -> str | None:
        return {"python": "/usr/bin/python"}.get(word)

    def on(host_env: dict[str, str], run_env: dict[str, str] = run) -> tuple[str, ...]:
        return host_command(
            command, run_env=run_env, host_env=host_env, own_python="/own", which=which
        )

    assert on({PYTHON_VAR: "/venv/bin/python"}) == ("/venv/bin/python", "t.py")  # python:
    assert on({PYTHON_VAR: ""}) == ("/usr/bin/python", "t.py")  # PATH's
    assert on({}) == ("/own", "t.py")  # a dial-in agent: its own
    assert on({PYTHON_VAR: ""}, {}) == command  # --no-python: as it is
    assert host_command(
        ("python3", "t.py"), run_env=run, host_env={PYTHON_VAR: ""}, own_python="/own", which=which
    ) == ("/own", "t.py")  # PATH has no python3: the agent's own
    assert without_internal({PYTHON_VAR: "x", RESOLVE_VAR: "1", "A": "b"}) == {"A": "b"}


def test_redirects_and_tee_read_as_torchrun_reads_them() -> None:
    routing = StreamRouting(
        redirects=parse_stream_set("--redirects", "3"), tee=parse_stream_set("--tee", "0:1")
    )
    assert [routing.to_console(0, s) for s in ("out", "err")] == [True, False]
    assert [routing.to_console(1, s) for s in ("out", "err")] == [False, False]
    assert all(routing.to_file(r, s) for r in (0, 1) for s in ("out", "err"))
    tee = StreamRouting(tee=parse_stream_set("--tee", "1"))
    assert (tee.to_file(0, "out"), tee.to_file(0, "err"), tee.to_console(0, "err")) == (
        True,
        False,
        True,
    )
    for bad in ("4", "x", "0:3,0:1", "a:1", "0:"):
        with pytest.raises(ConfigError, match="--tee"):
            parse_stream_set("--tee", bad)


def test_cluster_file_paths_are_relative_to_the_file(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "cluster.yml").write_text(
        "controller: {port: 0, token_file: token}\n"
        "workers:\n"
        "  - host: localhost\n    devices: cpu:1\n    python: venv/bin/python\n    workdir: run\n"
        "  - host: far\n    devices: cpu:1\n    python: venv/bin/python\n    workdir: run\n"
        "    ssh: {identity_file: keys/id, known_hosts: keys/known, user: u}\n"
        "  - host: near\n    devices: cpu:1\n    python: python3.11\n"
        "    ssh: {identity_file: ~/.ssh/id, known_hosts: /etc/ssh/known}\n"
    )
    spec = load_cluster(os.path.relpath(conf / "cluster.yml"))
    local, far, near = spec.workers
    assert spec.controller.token_file == str(conf / "token")
    assert (spec.controller.port, spec.controller.port_explicit) == (0, True)
    assert (local.python, local.workdir) == (str(conf / "venv/bin/python"), str(conf / "run"))
    assert (far.python, far.workdir) == ("venv/bin/python", "run")  # that host's own paths
    assert far.ssh is not None
    assert near.ssh is not None
    assert (far.ssh.identity_file, far.ssh.known_hosts) == (
        str(conf / "keys/id"),
        str(conf / "keys/known"),
    )
    assert (near.python, near.ssh.identity_file, near.ssh.known_hosts) == (
        "python3.11",
        "~/.ssh/id",
        "/etc/ssh/known",
    )


def test_a_trainers_own_cluster_file_needs_no_trainer_cpu_for_a_tunnel(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.yml"
    cluster.write_text("workers:\n  - host: far-away-node\n    devices: cpu:2\n    tunnel: true\n")
    with pytest.raises(ConfigError, match="top-level `trainer: cpu`"):
        load_cluster(cluster)  # flodl-launch cannot tell what the script is
    spec = load_cluster(cluster, backend_known=True)  # a Trainer can: it checks its backend
    assert spec.workers[0].tunnel
    assert spec.trainer is None


# ----- python on each host ------------------------------------------------------------------


def test_dash_m_runs_python_dash_m_with_the_launchers_interpreter_when_path_has_none(
    tmp_path: Path,
) -> None:
    """`flodl-launch --nproc 2 -- -m pkg.mod` (systemd's PATH, or none at all: no python on it)."""
    (tmp_path / "pkgdemo").mkdir()
    (tmp_path / "pkgdemo" / "__init__.py").write_text("")
    (tmp_path / "pkgdemo" / "hello.py").write_text(SHOW_EXE + "\n")
    (tmp_path / "empty").mkdir()
    done = run_launch(
        "--nproc", "2", "--devices", "cpu", "--port", "0", "--", "-m", "pkgdemo.hello", "x",
        run_id=new_run_id(),
        env={"PATH": str(tmp_path / "empty"), "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(f"exe {PY} ['x']") == 2, done.stdout
    assert f"python -m pkgdemo.hello x (python: {PY})" in done.stderr  # the banner says what ran


def test_a_leading_python_is_the_workers_python_relative_to_the_cluster_file(
    tmp_path: Path,
) -> None:
    """`python: bin/py` of the controller's own host, read from another directory; `--no-python`
    runs the command as it is; `port: 0` in the file picks a free port."""
    conf = tmp_path / "conf"
    _wrapper(conf / "bin" / "py", "via the worker's python")
    cluster = conf / "cluster.yml"
    cluster.write_text(
        "controller: {port: 0}\nworkers:\n  - host: localhost\n    devices: cpu:1\n"
        "    python: bin/py\n"
    )
    assert Path.cwd() != conf
    done = run_launch(str(cluster), "--", "python", "-c", SHOW_EXE, "a", run_id=new_run_id())
    assert done.returncode == 0, done.stderr
    assert f"exe {PY} ['a']" in done.stdout
    assert "via the worker's python" in done.stderr
    assert f"(python: {conf / 'bin' / 'py'})" in done.stderr
    fakebin = tmp_path / "fakebin"
    _wrapper(fakebin / "python", "via PATH's python")
    plain = run_launch(
        str(cluster), "--no-python", "--", "python", "-c", SHOW_EXE, "b",
        run_id=new_run_id(), env={"PATH": str(fakebin)},
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    assert "via PATH's python" in plain.stderr
    assert "via the worker's python" not in plain.stderr
    assert "(python:" not in plain.stderr


def test_the_controllers_host_takes_paths_python_and_a_walk_in_agent_its_own(
    tmp_path: Path,
) -> None:
    """The same `python` in one run: PATH's on the launcher's host (no `python:`), the agent's own
    interpreter on a host that dialled in on its own (its PATH's would be another)."""
    from flodl_async.wire.keys import new_session_secret

    fakebin = tmp_path / "fakebin"
    _wrapper(fakebin / "python", "via PATH's python")
    port = free_port()
    run_id = new_run_id()
    secret_file = tmp_path / "secret"
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, new_session_secret().hex().encode() + b"\n")
    os.close(fd)
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"controller:\n  port: {port}\n  join: {{min_rank_start: 2, target_ranks: 2, "
        "join_timeout: 60}\nworkers:\n  - host: localhost\n    devices: cpu:1\n"
    )
    only_fake = {**os.environ, "PATH": str(fakebin)}
    launcher = Launcher(
        str(cluster), "--secret-file", str(secret_file), "--", "python", "-c",
        "import os, sys; print('exe', os.environ['RANK'], sys.executable)",
        run_id=run_id, env={"PATH": str(fakebin)},
    )  # fmt: skip
    agent = subprocess.Popen(
        [PY, "-m", "flodl_async.agent", "--controller", f"127.0.0.1:{port}", "--secret-file",
         str(secret_file), "--host", "walk-in", "--devices", "cpu:1", "--connect-timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=only_fake,
    )  # fmt: skip
    try:
        done = launcher.finish(timeout=90)
        _out, agent_err = agent.communicate(timeout=30)
    finally:
        launcher.kill()
        if agent.poll() is None:
            agent.kill()
            agent.communicate()
        assert_nothing_left(run_id)
    assert done.returncode == 0, done.stderr
    assert agent.returncode == 0, agent_err
    assert "[localhost:r0] via PATH's python" in done.stderr, done.stderr
    assert "[walk-in:r1] via PATH's python" not in done.stderr
    assert f"[walk-in:r1] exe 1 {PY}" in done.stdout, done.stdout
    assert f"(python: {fakebin / 'python'})" in done.stderr


def test_run_path_runs_a_python_file(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SHOW_EXE + "\n")
    (tmp_path / "empty").mkdir()
    done = run_launch(
        "--nproc", "1", "--devices", "cpu", "--port", "0", "--run-path", "--", str(script), "-v",
        run_id=new_run_id(), env={"PATH": str(tmp_path / "empty")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"exe {PY} ['-v']" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--nproc", "1", "--no-python", "--", "-m", "pkg"),
            "--no-python runs the command as it is",
        ),
        (("--nproc", "1", "--no-python", "--run-path", "--", "t.py"), "pick one"),
        (("--nproc", "1", "--redirects", "3", "--", PY, "-c", "pass"), "give --log-dir DIR too"),
        (("--nproc", "1", "--log-dir", "x", "--tee", "5", "--", PY), "--tee takes 0 (none)"),
        (
            ("--nproc", "gpu", "--", PY, "-c", "pass"),
            "--nproc-per-node gpu: this host shows no GPU",
        ),
        (("--nproc", "cpu", "--devices", "0", "--", PY), "pick one kind of device"),
        (("--nproc", "x", "--", PY), "or auto, gpu or cpu"),
    ],
)
def test_torchrun_spellings_are_refused_clearly_where_they_cannot_mean_anything(
    args: tuple[str, ...], message: str
) -> None:
    done = run_launch(*args, run_id=new_run_id(), env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_nproc_per_node_cpu_is_a_cpu_rank_per_core() -> None:
    cores = len(os.sched_getaffinity(0))
    done = run_launch(
        "--nproc-per-node", "cpu", "--port", "0", "--", PY, "-c", "pass", run_id=new_run_id()
    )
    assert done.returncode == 0, done.stderr
    assert f"{cores} rank{'s' if cores > 1 else ''} on this host (CPU)" in done.stderr


def test_redirects_and_tee_route_each_ranks_streams(tmp_path: Path) -> None:
    printing = (
        "--", PY, "-c",
        "import os, sys; r = os.environ['RANK']; print('out', r); print('err', r, file=sys.stderr)",
    )  # fmt: skip
    common = ("--nproc", "2", "--devices", "cpu", "--port", "0", "--log-dir", str(tmp_path))
    run_id = new_run_id()
    done = run_launch(*common, "--redirects", "3", "--tee", "0:1", *printing, run_id=run_id)
    assert done.returncode == 0, done.stderr
    assert f"[{HOST}:r0] out 0" in done.stdout
    assert "out 1" not in done.stdout
    assert "err 0" not in done.stderr
    assert "err 1" not in done.stderr
    attempt = tmp_path / run_id / "attempt_0"
    for rank in (0, 1):
        assert (attempt / str(rank) / "stdout.log").read_text() == f"out {rank}\n"
        assert (attempt / str(rank) / "stderr.log").read_text() == f"err {rank}\n"
    run_id = new_run_id()
    teed = run_launch(*common, "--tee", "1", *printing, run_id=run_id)
    assert teed.returncode == 0, teed.stderr
    assert "out 1" in teed.stdout
    assert "err 1" in teed.stderr
    attempt = tmp_path / run_id / "attempt_0"
    assert (attempt / "1" / "stdout.log").read_text() == "out 1\n"
    assert not (attempt / "1" / "stderr.log").exists()  # not teed: in no file, as torchrun has it


# ----- one port rule ------------------------------------------------------------------------


def test_a_cluster_files_default_port_gives_way_unless_dial_in_agents_need_it(
    tmp_path: Path,
) -> None:
    local = "workers:\n  - host: localhost\n    devices: cpu:1\n"
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(local)
    token = tmp_path / "token"
    subprocess.run([PY, "-m", "flodl_async.cli.flodl", "token", "new", str(token)], check=True)
    with_token = tmp_path / "token.yml"
    with_token.write_text(f"controller: {{token_file: {token.name}}}\n{local}")
    explicit = tmp_path / "explicit.yml"
    explicit.write_text(f"controller: {{port: {DEFAULT_PORT}}}\n{local}")
    with _default_port_held():
        gives_way = run_launch(str(cluster), "--", PY, "-c", "pass", run_id=new_run_id())
        kept = run_launch(str(with_token), "--", PY, "-c", "pass", run_id=new_run_id())
        strict = run_launch(str(explicit), "--", PY, "-c", "pass", run_id=new_run_id())
        flag = run_launch(
            str(cluster), "--port", str(DEFAULT_PORT), "--", PY, "-c", "pass", run_id=new_run_id()
        )
    assert gives_way.returncode == 0, gives_way.stderr
    assert re.search(
        rf"port {DEFAULT_PORT} is taken .*; using free port \d+ instead", gives_way.stderr
    )
    taken = f"port {DEFAULT_PORT} on 127.0.0.1 is already held by a live listener"
    for done, origin in [
        (kept, "it is the default port, kept because dial-in agents dial it"),
        (strict, f"controller.port of {explicit} names it: set another there, or 0"),
        (flag, "--port names it: give another, or --port 0"),
    ]:
        assert done.returncode == 2, done.stderr
        assert taken in done.stderr
        assert origin in done.stderr
        assert "Traceback" not in done.stderr


def test_a_trainer_meets_a_taken_port_by_the_same_rule_without_a_traceback(
    tmp_path: Path,
) -> None:
    script = str(Path(__file__).parent / "scripts" / "trainer_mlp.py")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        cluster = tmp_path / "cluster.yml"
        cluster.write_text(
            f"controller:\n  port: {port}\nworkers:\n  - host: {HOST}\n    devices: cpu:1\n"
        )
        run_id = new_run_id()
        try:
            done = subprocess.run(
                [PY, script, "--out", str(tmp_path / "out"), "--cluster", str(cluster)],
                capture_output=True, text=True, timeout=120, check=False,
                env={**os.environ, "FLODL_RUN_ID": run_id, "OMP_NUM_THREADS": "1"},
            )  # fmt: skip
        finally:
            assert_nothing_left(run_id)
    assert done.returncode == 2, done.stderr
    assert f"flodl: FAILED — port {port} on 127.0.0.1 is already held by a live listener" in (
        done.stderr
    )
    assert f"controller.port of {cluster} names it" in done.stderr
    assert "Traceback" not in done.stderr
    assert "--port" not in done.stderr


def test_the_service_units_python_command_runs_under_systemds_path(tmp_path: Path) -> None:
    """deploy/flodl-launch@.service: `FLODL_COMMAND=python train.py` under systemd's default PATH,
    where a Debian host has no `python`: the launcher's own interpreter runs it."""
    systemd_path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"
    expected = shutil.which("python", path=systemd_path) or PY
    done = run_launch(
        "--nproc", "1", "--devices", "cpu", "--port", "0", "--", "python", "-c", SHOW_EXE,
        run_id=new_run_id(), env={"PATH": systemd_path},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"exe {expected} []" in done.stdout
    assert f"(python: {expected})" in done.stderr


def test_a_trainers_default_port_gives_way_when_taken(tmp_path: Path) -> None:
    script = str(Path(__file__).parent / "scripts" / "trainer_mlp.py")
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(f"workers:\n  - host: {HOST}\n    devices: cpu:1\n")
    run_id = new_run_id()
    with _default_port_held():
        try:
            done = subprocess.run(
                [PY, script, "--out", str(tmp_path / "out"), "--cluster", str(cluster),
                 "--epochs", "1"],
                capture_output=True, text=True, timeout=180, check=False,
                env={**os.environ, "FLODL_RUN_ID": run_id, "OMP_NUM_THREADS": "1"},
            )  # fmt: skip
        finally:
            assert_nothing_left(run_id)
    assert done.returncode == 0, done.stderr
    assert re.search(rf"port {DEFAULT_PORT} is taken .*; using free port \d+ instead", done.stderr)
    assert "TRAINER-DONE entry=launcher" in done.stdout
