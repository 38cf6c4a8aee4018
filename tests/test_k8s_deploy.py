"""deploy/k8s/: the plain manifests validate offline (kubernetes-validate, its default Kubernetes
version and the one the README states), and the pods' commands run a world as processes in
namespace hosts with what Kubernetes would give each pod: its hostname (``flodl-train-<index>``),
``JOB_COMPLETION_INDEX``, the ConfigMap's variables, the Secret's token file and the headless
Service's name for pod 0 (a private hosts file bind-mounted inside each pod's namespace)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from .hostkit import HostKit
from .launchkit import PY, assert_nothing_left
from .test_everynode_e2e import _finish

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "k8s"


def _documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _by_kind(kind: str, name: str | None = None) -> dict[str, Any]:
    return next(
        d
        for d in _documents()
        if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    )


def readme_kubernetes_version() -> str:
    """The Kubernetes version the README's Clusters section promises the manifests work with."""
    found = re.search(r"Kubernetes\s+(\d+\.\d+)\s+or\s+later", (REPO / "README.md").read_text())
    assert found is not None, "the README's Clusters section names the Kubernetes version"
    return f"{found.group(1)}.0"


@pytest.mark.parametrize(
    "version", [kubernetes_validate.latest_version(), readme_kubernetes_version()]
)
def test_the_manifests_validate_offline(version: str) -> None:
    kinds = set()
    for doc in _documents():
        kubernetes_validate.validate(doc, version, strict=True)
        kinds.add(doc["kind"])
    # plain manifests only: no Helm, no custom resources
    assert kinds == {"ConfigMap", "Job", "Secret", "Service"}


def test_the_job_is_indexed_behind_a_headless_service() -> None:
    job, service = _by_kind("Job"), _by_kind("Service")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]
    assert service["spec"]["clusterIP"] == "None"
    assert spec["template"]["spec"]["subdomain"] == service["metadata"]["name"]
    env = _by_kind("ConfigMap", "flodl-train")["data"]
    assert env["PET_NNODES"] == str(spec["completions"])
    assert env["PET_MASTER_ADDR"] == f"{job['metadata']['name']}-0.{service['metadata']['name']}"


def test_the_pods_commands_form_a_world_on_namespace_hosts(
    hostkit: HostKit, tmp_path: Path
) -> None:
    job = _by_kind("Job")
    name = job["metadata"]["name"]
    pods = int(job["spec"]["completions"])
    assert pods <= len(hostkit.hosts)
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = _by_kind("ConfigMap", "flodl-train")["data"]
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "train.py").write_text(
        _by_kind("ConfigMap", "flodl-train-script")["data"]["train.py"]
    )
    token = tmp_path / "token"
    subprocess.run([PY, "-m", "flodl_async.cli.flodl", "token", "new", str(token)], check=True)
    # the Secret and the ConfigMap mounted where the pod has them (paths of this machine instead)
    mounts = {"/etc/flodl/token": str(token), "/app/train.py": str(tmp_path / "app" / "train.py")}
    command = [mounts.get(word, word) for word in container["command"]]
    hosts = tmp_path / "hosts"
    pod0 = hostkit.hosts[0].addr
    hosts.write_text(f"127.0.0.1 localhost\n{pod0} {env['PET_MASTER_ADDR']} {name}-0\n")
    run_id = "k8s-" + os.urandom(3).hex()
    procs = []
    for index, host in enumerate(hostkit.hosts[:pods]):
        pod_env = {
            **os.environ,
            **{k: v for k, v in env.items() if k.startswith("PET_")},
            "JOB_COMPLETION_INDEX": str(index),
            "PET_RDZV_ID": run_id,  # so this test can prove nothing of the run is left
        }
        argv = hostkit.inside_argv(host, *command, hostname=f"{name}-{index}", hosts_file=hosts)
        procs.append(
            subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=pod_env
            )
        )
    # the other pods first: pod 0's verdict comes last
    results = list(reversed(_finish(list(reversed(procs)))))
    assert_nothing_left(run_id)
    assert [rc for rc, _o, _e in results] == [0] * pods, [e for _r, _o, e in results]
    for index, (_rc, out, _err) in enumerate(results):
        # each pod prints its own rank's line, once, under its pod name and node rank
        assert re.findall(r"^\[([^\]]+):r\d+\] rank \d+ of (\d+) on (\S+)", out, re.M) == [
            (f"{name}-{index}#{index}", str(pods), f"{name}-{index}")
        ], out
