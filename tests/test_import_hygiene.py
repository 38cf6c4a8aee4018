"""What each command loads on its way: the control plane never imports torch (it costs ~2 s and
the controller never needs it), `flodl status` not even asyncio, an ssh agent only its join path.

The layering rules (order, circles, pure packages, every module torch-free) are in test_layering.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_cli_help_does_not_import_torch() -> None:
    code = (
        "import sys, runpy\nsys.argv=['flodl','--help']\n"
        "try:\n runpy.run_module('flodl_async.cli.flodl', run_name='__main__')\nexcept SystemExit:\n pass\n"
        "print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip().endswith("False")


def test_status_query_does_not_import_asyncio() -> None:
    """`flodl status` is one blocking request: the status package (its schema marker) must not pull in asyncio."""
    code = "import sys\nimport flodl_async.cli.flodl, flodl_async.status\nprint('asyncio' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "False"


#: What an agent started over ssh must not import on its way to the join: each costs every host
#: of a fan-out its own cold import on shared cores (ranks, the relay and the store come only once
#: the world has formed; the controller, ssh, status pages and YAML never on an agent).
AGENT_START_FORBIDDEN = (
    "torch",
    "asyncssh",
    "yaml",
    "http",
    "cryptography.x509",
    "cryptography.hazmat.primitives.asymmetric",
    "flodl_async.controller",
    "flodl_async.cli.launch",
    "flodl_async.cli.flodl",
    "flodl_async.config.cluster",
    "flodl_async.control.supervisor",
    "flodl_async.control.membership",
    "flodl_async.status",
    "flodl_async.net.http",
    "flodl_async.net.mux",
    "flodl_async.net.service",
    "flodl_async.net.tcpstore",
    "flodl_async.net.portstore",
    "flodl_async.relay.control",
    "flodl_async.net.torchstore",
    "flodl_async.agent.ranks",
    "flodl_async.agent.storehost",
    "flodl_async.agent.daemon",
)


def test_agent_start_over_ssh_imports_only_what_the_join_needs() -> None:
    """`python -m flodl_async.agent --spec-stdin` as the fan-out starts it, up to dialing the controller.

    The spec names a port that refuses connections, so the agent goes through its whole start —
    hello, spec, session config, runtime sweep, the dial — and exits 3; what it imported by then
    is printed at exit.
    """
    import json
    import socket

    with socket.socket() as closed:  # bound, never listening: a connect there is refused at once
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        spec = {
            "controller_host": "127.0.0.1",
            "controller_port": port,
            "secret": "00" * 16,
            "host": "hygiene",
            "devices": "cpu:1",
            "run_id": "hygiene",
            "env": {},
            "workdir": None,
            "timeout_scale": 1.0,
            "stop_grace": 1.0,
        }
        code = (
            "import atexit, runpy, sys\n"
            "atexit.register(lambda: print('MODULES', ' '.join(sorted(sys.modules)), file=sys.stderr))\n"
            "sys.argv = ['flodl-agent', '--spec-stdin']\n"
            "runpy.run_module('flodl_async.agent', run_name='__main__', alter_sys=True)\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", code],
            check=False,
            input=json.dumps(spec) + "\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 3, result.stderr
    assert "cannot reach the controller" in result.stderr  # it got as far as the dial
    modules = next(
        line for line in result.stderr.splitlines() if line.startswith("MODULES ")
    ).split()[1:]
    assert "flodl_async.net.framed" in modules  # the probe sees the join path's own imports
    offenders = [
        mod
        for mod in modules
        if any(mod == bad or mod.startswith(bad + ".") for bad in AGENT_START_FORBIDDEN)
    ]
    assert offenders == []


def test_building_a_trainer_and_its_spec_does_not_import_torch() -> None:
    """Trainer(...) at import time is safe in every role: the launcher never builds the model."""
    code = (
        "import sys\nimport flodl_async as fa\n"
        "t = fa.Trainer(model=lambda d: None, optimizer=lambda m: None, train_step=lambda m, b: None, dataset=[0] * 8, batch_size=2, epochs=1, "
        "policy=fa.Policy.SYNC, outer=fa.SlowMo())\n"
        "t.spec().to_wire()\nprint(t.entry.value, 'torch' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_INTERNAL_")} | {
        "CUDA_VISIBLE_DEVICES": ""
    }
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=env,
    )
    assert result.stdout.strip() == "inline False"


def test_dir_of_the_package_offers_the_public_names_without_loading_them() -> None:
    """Tab completion reads ``dir()``: the lazy names are there before first use, the helpers the
    face imports are not, and listing them imports no torch."""
    code = (
        "import sys\nimport flodl_async as fa\n"
        "print(sorted(n for n in dir(fa) if not n.startswith('__')))\n"
        "print(sorted(n for n in fa.__all__ if not n.startswith('__')))\n"
        "print('__version__' in dir(fa), 'torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    listed, public, flags = result.stdout.strip().splitlines()
    assert listed == public
    assert "Trainer" in listed
    assert "importlib" not in listed
    assert flags == "True False"


def test_a_local_launch_never_imports_prometheus_client(tmp_path: Path) -> None:
    """/metrics imports prometheus_client on its first scrape only: a launcher that nobody scrapes, from its start
    through its local ranks to its end, never loads it, nor rich (flodl top's alone) (-X importtime lists every import of the launcher's own
    process; the ranks are other processes)."""
    from .launchkit import PY, assert_nothing_left, new_run_id, script

    run_id = new_run_id()
    try:
        done = subprocess.run(
            [PY, "-X", "importtime", "-m", "flodl_async.cli.launch", "--run-id", run_id, "--nproc", "1",
             "--devices", "cpu", "--port", "0", "--", PY, script("dump_env.py"), str(tmp_path)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    finally:
        assert_nothing_left(run_id)
    assert done.returncode == 0, done.stderr
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in done.stderr.splitlines()
        if "import time:" in line
    }
    assert "flodl_async.controller.shell" in imported  # the listing is the launcher's own
    assert not {name for name in imported if name.split(".")[0] in ("prometheus_client", "rich")}

#: What a one-host ``flodl-launch --nproc`` run must never import: ssh is for other hosts only (it
#: was a fifth of the launcher's imports, paid before its ranks could start).
LOCAL_LAUNCH_FORBIDDEN = ("torch", "asyncssh", "flodl_async.controller.fanout")
#: What a one-host launch has not loaded yet when it starts its ranks: its control plane loads while
#: they import torch (flodl_async.cli.earlyranks).
BEFORE_RANKS_FORBIDDEN = (
    "flodl_async.controller",
    "flodl_async.control.supervisor",
    "flodl_async.net.mux",
    "flodl_async.agent.ranks",
    "flodl_async.relay",
    "flodl_async.training",
)


def test_a_one_host_launch_starts_its_ranks_before_its_control_plane_and_never_loads_ssh() -> None:
    """`flodl-launch --nproc 1` end to end in a fresh interpreter: the rank runs (its line comes
    back); when it was started (the launcher's first process) the controller, the agent's rank
    processes and the wire's consumers were not loaded yet; by the exit, nothing of ssh was."""
    code = (
        "import atexit, runpy, subprocess, sys\n"
        "atexit.register(lambda: print('MODULES', ' '.join(sorted(sys.modules)), file=sys.stderr))\n"
        "popen = subprocess.Popen.__init__\n"
        "def first(self, *a, **k):\n"
        "    if not hasattr(sys, 'at_spawn'):\n"
        "        sys.at_spawn = sorted(sys.modules)\n"
        "        print('AT_SPAWN', ' '.join(sys.at_spawn), file=sys.stderr)\n"
        "    popen(self, *a, **k)\n"
        "subprocess.Popen.__init__ = first\n"
        "sys.argv = ['flodl-launch', '--nproc', '1', '--devices', 'cpu', '--port', '0', '--',"
        " sys.executable, '-c', 'print(\"rank ran\")']\n"
        "runpy.run_module('flodl_async.cli.launch', run_name='__main__', alter_sys=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_INTERNAL_")}
    result = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "rank ran" in result.stdout
    modules = next(
        line for line in result.stderr.splitlines() if line.startswith("MODULES ")
    ).split()[1:]
    assert "flodl_async.controller.shell" in modules  # the probe sees the launcher's own imports
    offenders = [
        mod
        for mod in modules
        if any(mod == bad or mod.startswith(bad + ".") for bad in LOCAL_LAUNCH_FORBIDDEN)
    ]
    assert offenders == []
    at_spawn = next(
        line for line in result.stderr.splitlines() if line.startswith("AT_SPAWN ")
    ).split()[1:]
    assert "flodl_async.cli.earlyranks" in at_spawn  # the rank was started on the early path
    early = [
        mod
        for mod in at_spawn
        if any(mod == bad or mod.startswith(bad + ".") for bad in BEFORE_RANKS_FORBIDDEN)
    ]
    assert early == []
