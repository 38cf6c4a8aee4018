"""The launcher role's plan: flodl-launch's rules, this program as the ranks' command (no process started)."""

from __future__ import annotations

import asyncio
import signal
import socket
from pathlib import Path
from typing import Any

import pytest

import flodl_async as fa
from flodl_async.config.cluster import ClusterSpec, ControllerSpec, DeviceSpec, WorkerSpec
from flodl_async.config.devices import parse_devices
from flodl_async.config.plan import Placement
from flodl_async.errors import ConfigError
from flodl_async.net.signals import add_guest_handler
from flodl_async.trainer.entry import LAUNCHER_PRIMARY_VAR, note_rank_restarts
from flodl_async.trainer.launcher import cluster_of, launch_plan
from flodl_async.trainer.state import RunRequest


def trainer(**kw: Any) -> RunRequest:
    """What a Trainer built from ``kw`` hands its launcher driver."""
    args: dict[str, Any] = {
        "model": lambda d: None,
        "optimizer": lambda m: None,
        "train_step": lambda m, b: None,
        "dataset": [0] * 8,
        "batch_size": 2,
        "epochs": 1,
    }
    args.update(kw)
    return fa.Trainer(**args).run_request()


def test_a_cluster_file_becomes_a_local_plan_that_re_runs_this_program(tmp_path: Path) -> None:
    path = tmp_path / "c.yml"
    path.write_text(
        f"controller:\n  host: 127.0.0.1\n  port: 4242\nworkers:\n  - host: {socket.gethostname()}\n    devices: cpu:3\n"
    )
    t = trainer(cluster=str(path))
    plan = launch_plan(
        t,
        cluster_of(t, {}),
        argv=["python", "train.py", "--lr", "1"],
        executable="/py",
        run_id="r1",
    )
    assert plan.command == ("/py", "train.py", "--lr", "1")
    assert plan.port == 4242
    assert plan.run_id == "r1"
    assert [w.placement for w in plan.workers] == [Placement.LOCAL]
    assert plan.cluster_env[LAUNCHER_PRIMARY_VAR] == "1"  # the launcher is the primary, no rank is
    assert plan.join.min_rank_start == 3


def test_rank_command_wins_and_a_program_from_dash_c_is_refused() -> None:
    spec = ClusterSpec(
        controller=ControllerSpec(port=1),
        workers=(WorkerSpec(host=socket.gethostname(), devices=parse_devices("cpu:2")),),
    )
    given = launch_plan(
        trainer(rank_command=["/py", "-m", "app.rank"]),
        spec,
        argv=["python", "-c", "x"],
        executable="/py",
    )
    assert given.command == ("/py", "-m", "app.rank")
    with pytest.raises(ConfigError, match="rank_command"):
        launch_plan(trainer(), spec, argv=["python", "-c", "x"], executable="/py")


def test_max_restarts_is_the_launchers_and_a_rank_under_flodl_launch_says_when_it_differs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    spec = ClusterSpec(
        controller=ControllerSpec(port=1),
        workers=(WorkerSpec(host=socket.gethostname(), devices=parse_devices("cpu:2")),),
    )
    plan = launch_plan(trainer(max_restarts=3), spec, argv=["python", "t.py"], executable="/py")
    assert plan.max_restarts == 3
    assert launch_plan(trainer(), spec, argv=["python", "t.py"], executable="/py").max_restarts == 0
    for wrong in (-1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match=r"Trainer\(max_restarts=\.\.\.\) must be a whole"):
            trainer(max_restarts=wrong)
    with caplog.at_level("WARNING", logger="flodl_async.trainer.api"):
        note_rank_restarts(2, {"TORCHELASTIC_MAX_RESTARTS": "2"})
        note_rank_restarts(0, {"TORCHELASTIC_MAX_RESTARTS": "5"})
        assert caplog.messages == []
        note_rank_restarts(2, {"TORCHELASTIC_MAX_RESTARTS": "0"})
    assert caplog.messages == [
        "Trainer(max_restarts=2) does not apply under flodl-launch: its --max-restarts 0 decides "
        "how many ranks are restarted"
    ]


def test_auto_promote_spans_the_visible_gpus_and_says_so_when_it_cannot(tmp_path: Path) -> None:
    for i in range(4):
        (tmp_path / f"nvidia{i}").touch()  # a host with four GPUs, of which the mask shows two
    spec = cluster_of(
        trainer(), {"CUDA_VISIBLE_DEVICES": "2,3", "FLODL_INTERNAL_DEV_DIR": str(tmp_path)}
    )
    (worker,) = spec.workers
    assert worker.devices == DeviceSpec.gpus((0, 1))
    with pytest.raises(ConfigError, match="auto-promote multi-GPU failed"):
        cluster_of(
            trainer(), {"CUDA_VISIBLE_DEVICES": "0", "FLODL_INTERNAL_DEV_DIR": str(tmp_path)}
        )


def test_tunnel_workers_need_the_cpu_backend() -> None:
    worker = WorkerSpec(host="far", devices=parse_devices("cpu:1"), tunnel=True)
    spec = ClusterSpec(
        controller=ControllerSpec(port=1), workers=(worker,), trainer="cpu", source="c.yml"
    )
    t = trainer(backend=fa.Backend.COLLECTIVE, policy=fa.Policy.SYNC)
    with pytest.raises(ConfigError, match="tunnel: true"):
        launch_plan(t, spec, argv=["python", "t.py"], executable="/py")


def _gate(env: dict[str, str]) -> Any:
    import os
    import subprocess
    import sys

    code = "import flodl_async as fa\nfa.exit_if_worker_role()\nprint('passed through')"
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_INTERNAL_")}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **env},
        check=False,
    )


def test_exit_if_worker_role_passes_through_outside_an_agent_and_runs_the_agent_inside() -> None:
    assert _gate({}).stdout.strip() == "passed through"
    bad = _gate({"FLODL_INTERNAL_AGENT_SPEC": "not json"})
    assert bad.returncode == 2
    assert "JSON list" in bad.stderr
    agent = _gate(
        {"FLODL_INTERNAL_AGENT_SPEC": '["--help"]'}
    )  # the agent ran (its --help) and the script never went on
    assert "flodl-agent" in agent.stdout
    assert "passed through" not in agent.stdout


def test_the_launcher_takes_a_stop_signal_only_where_the_application_has_not() -> None:
    """The loop holds one handler per signal: an application's own SIGTERM handler must outlive the run."""
    loop = asyncio.new_event_loop()
    try:
        got: list[object] = []
        both = asyncio.Event()

        def record(what: object) -> None:
            got.append(what)
            if len(got) == 2:
                both.set()

        loop.add_signal_handler(signal.SIGTERM, record, "the application's graceful stop")
        assert add_guest_handler(loop, signal.SIGTERM, record) is None  # left to the application
        taken = add_guest_handler(loop, signal.SIGINT, record)
        assert taken is not None
        assert taken[0] is signal.SIGINT
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        loop.run_until_complete(
            asyncio.wait_for(both.wait(), timeout=10)
        )  # delivered through the loop's self-pipe
        assert sorted(map(str, got)) == sorted(
            ["the application's graceful stop", str(signal.SIGINT)]
        )
        loop.remove_signal_handler(signal.SIGINT)
        signal.signal(signal.SIGINT, taken[1])
        assert signal.getsignal(signal.SIGINT) is taken[1]
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        loop.close()
