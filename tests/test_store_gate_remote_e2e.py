"""Another host's store traffic that is not the run's changes nothing (namespace hosts).

The controller cannot tell who on a worker host made a store connection: its address is the
host's. That host's agent can (:mod:`flodl_async.net.storegate` on its own kernel), so the
port store asks it over its join link before it reads a byte. Poisoners inside a namespace host
(``scripts/store_poison.py``), one as ``nobody`` and one as the run's own user there but no
rank, loop from before the run starts: the run's ranks still rendezvous and all-reduce, and each
kind of offender is counted, and logged once, naming the host, its user and its process.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .hostkit import HostKit, worker_python
from .launchkit import PY, Launcher, free_port, new_run_id, script, wait_status
from .test_store_gate import NOBODY, POISON, _python_for

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(sys.platform != "linux", reason="Linux only")]

REPO = Path(__file__).resolve().parent.parent


def test_poisoners_on_a_worker_host_change_nothing_and_are_named_once(
    hostkit: HostKit, tmp_path: Path
) -> None:
    h1 = hostkit.hosts[0]
    others = _python_for("nobody")
    port, release = free_port(), tmp_path / "release"
    wrapper = worker_python(tmp_path, repo=REPO)
    ssh = hostkit.ssh_worker(h1)
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(
        f"controller: {{host: 0.0.0.0, port: {port}, join: {{join_timeout: 60}}}}\nworkers:\n"
        f"  - host: {h1.name}\n    devices: cpu:2\n    python: {wrapper}\n"
        f"    ssh: {json.dumps(ssh)}\n"
    )
    as_nobody = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")
    poisoners = [
        subprocess.Popen(
            hostkit.inside_argv(
                h1, *user, python, "-c", POISON, hostkit.controller_addr, str(port)
            ),
            stdout=subprocess.PIPE,
            text=True,
        )
        for user, python in ((as_nobody, others), ((), PY))
    ]
    launcher = Launcher(
        str(cluster), "--", PY, script("store_round.py"), str(release), run_id=new_run_id()
    )
    try:
        launcher.wait_for_stdout(" sum 2", count=2, timeout=120)  # both ranks met and reduced
        # both poisoners tried again once the host was admitted: its agent judged them
        wait_status(
            port,
            lambda doc: all(
                doc["connections"]["dropped"].get(reason, 0) >= 2  # type: ignore[index]
                for reason in ("store_foreign_uid", "store_not_run")
            ),
        )
        release.touch()
        done = launcher.finish(timeout=60)
    finally:
        for poisoner in poisoners:
            poisoner.kill()
            out, _ = poisoner.communicate()
            assert "poisoned" not in out, out
        launcher.kill()
    assert done.returncode == 0, done.stderr
    foreign = re.findall(r"^.*\(store_foreign_uid\):.*$", done.stderr, re.M)
    ours = re.findall(r"^.*\(store_not_run\):.*$", done.stderr, re.M)
    assert len(foreign) == 1, done.stderr  # one line, however many tries
    assert f'on host "{h1.name}"' in foreign[0], foreign[0]
    assert f"uid {NOBODY} (nobody)" in foreign[0], foreign[0]
    assert len(ours) == 1, done.stderr
    assert f'on host "{h1.name}"' in ours[0], ours[0]
    assert "uid 0 (root)" in ours[0], ours[0]
    assert "pid " in ours[0], ours[0]
