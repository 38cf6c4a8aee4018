"""Cluster file parsing: the happy path and every error path, with the message text asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl_async.config.cluster import (
    DeviceKind,
    DeviceSpec,
    JoinKnobs,
    load_cluster,
    parse_cluster,
)
from flodl_async.errors import ConfigError

LOCAL = frozenset({"localhost", "ctl-host"})

FULL = """\
controller:
  host: 10.0.0.1
  port: 2000
  join:
    min_rank_start: 2
    join_timeout: 30
    target_ranks: 3
    max_join_timeout: 60
    open_admission: false
env:
  NCCL_DEBUG: INFO
  BATCH: 32
trainer: cpu
workers:
  - host: ctl-host
    devices: [0, 1]
    nccl_socket_ifname: eth0
  - host: node-b
    devices: cpu:4
    tunnel: true
    python: /opt/venv/bin/python
    workdir: /srv/train
    env: {OMP_NUM_THREADS: "2"}
    ssh:
      target: b.lan
      port: 2222
      user: ubuntu
      identity_file: ~/.ssh/id
      known_hosts: ~/.ssh/kh
      options: [ProxyJump=bastion]
  - host: node-c
    devices: all
"""


def test_full_file_parses_into_frozen_specs() -> None:
    spec = parse_cluster(FULL, source="c.yml", local_names=LOCAL)
    assert spec.controller.host == "10.0.0.1"
    assert spec.controller.port == 2000
    assert spec.controller.join == JoinKnobs(
        min_rank_start=2, join_timeout=30, target_ranks=3, max_join_timeout=60, open_admission=False
    )
    assert spec.env == {"NCCL_DEBUG": "INFO", "BATCH": "32"}
    assert spec.trainer == "cpu"
    a, b, c = spec.workers
    assert a.devices == DeviceSpec(kind=DeviceKind.GPU_LIST, gpu_ids=(0, 1))
    assert a.nccl_socket_ifname == "eth0"
    assert b.devices == DeviceSpec.cpu(4)
    assert b.tunnel
    assert b.ssh is not None
    assert (b.ssh.target, b.ssh.port, b.ssh.user, b.ssh.options) == (
        "b.lan",
        2222,
        "ubuntu",
        ("ProxyJump=bastion",),
    )
    assert b.env == {"OMP_NUM_THREADS": "2"}
    assert c.devices.kind is DeviceKind.ALL_GPUS
    assert spec.capacity is None  # `all` is known only once the host is probed
    with pytest.raises(AttributeError):
        spec.controller.port = 1  # type: ignore[misc]


def test_defaults_and_cluster_wrapper() -> None:
    spec = parse_cluster(
        "cluster:\n  workers:\n    - {host: localhost, devices: cpu:2}\n", local_names=LOCAL
    )
    assert spec.controller.port == 1337
    assert spec.controller.host == "127.0.0.1"
    assert spec.capacity == 2
    assert spec.bind_host(LOCAL) == "127.0.0.1"
    assert spec.trainer is None  # a plain torchrun-contract script unless the file says otherwise


def test_join_defaults_follow_the_seed() -> None:
    config = JoinKnobs().resolve(4)
    assert (
        config.min_rank_start,
        config.target_ranks,
        config.join_timeout,
        config.max_join_timeout,
    ) == (4, 4, 300, 600)
    stretched = JoinKnobs(join_timeout=900).resolve(2, scale=2.0)
    assert stretched.max_join_timeout == 1800  # the cap stretches to cover an enlarged window
    assert stretched.join_timeout == 1800


def test_bind_host_is_wildcard_with_remote_untunneled_workers() -> None:
    spec = parse_cluster(FULL.replace("devices: all", "devices: cpu:1"), local_names=LOCAL)
    assert spec.bind_host(LOCAL) == "0.0.0.0"


def test_bind_host_is_loopback_when_every_remote_worker_tunnels() -> None:
    text = "trainer: cpu\nworkers:\n  - {host: localhost, devices: cpu:1}\n  - {host: far, devices: cpu:2, tunnel: true}\n"
    assert parse_cluster(text, local_names=LOCAL).bind_host(LOCAL) == "127.0.0.1"


def test_load_cluster_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yml"
    path.write_text("workers:\n  - {host: localhost, devices: cpu:1}\n")
    assert load_cluster(path).source == str(path)


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match=r"nope\.yml: cluster file not found"):
        load_cluster("nope.yml")


W = "workers:\n  - host: a\n    devices: cpu:1\n"

ERRORS = [
    ("", r"^c\.yml: the file is empty; it needs at least a `workers:` list$"),
    ("workers: [\n", r"^c\.yml:2: not valid YAML: "),
    ("- a\n- b\n", r"^c\.yml:1: expected a mapping with keys controller, workers, env, trainer$"),
    ("controller: {}\n", r"^c\.yml:1: missing required key 'workers' \(a list of worker hosts\)$"),
    ("wrokers: []\n", r"^c\.yml:1: wrokers: unknown key 'wrokers'; did you mean 'workers'\?$"),
    ("workers: []\n", r"^c\.yml:1: workers: expected a non-empty list of workers$"),
    ("workers:\n  - devices: cpu:1\n", r"^c\.yml:2: workers\[0\]: missing required key 'host'$"),
    ("workers:\n  - host: a\n", r"^c\.yml:2: workers\[0\]: missing required key 'devices'$"),
    (
        "workers:\n  - host: ''\n    devices: cpu:1\n",
        r"^c\.yml:2: workers\[0\]\.host: expected a non-empty string$",
    ),
    (
        "workers:\n  - host: a\n    devcies: cpu:1\n",
        r"^c\.yml:3: workers\[0\]\.devcies: unknown key 'devcies'; did you mean 'devices'\?$",
    ),
    (
        "workers:\n  - host: a\n    devices: gpu\n",
        r"^c\.yml:3: workers\[0\]\.devices: expected `all`, GPU ids like 0,1, or cpu:N with N >= 1; got 'gpu'$",
    ),
    (
        "workers:\n  - host: a\n    devices: cpu:0\n",
        r"workers\[0\]\.devices: expected `all`.*got 'cpu:0' \(a host needs at least one CPU rank\)",
    ),
    (
        "workers:\n  - host: a\n    devices: []\n",
        r"^c\.yml:3: workers\[0\]\.devices: expected at least one GPU id$",
    ),
    (
        "workers:\n  - host: a\n    devices: [0, 0]\n",
        r"workers\[0\]\.devices\[1\]: GPU 0 listed twice — each rank must pin a distinct GPU",
    ),
    (
        "workers:\n  - host: a\n    devices: [-1]\n",
        r"workers\[0\]\.devices\[0\]: expected an integer of at least 0 and at most 255, got '-1'",
    ),
    (
        W + "  - host: a\n    devices: cpu:2\n",
        r"^c\.yml:4: workers\[1\]\.host: host 'a' is listed twice; give each host one entry$",
    ),
    (
        W + "    tunnel: yes please\n",
        r"workers\[0\]\.tunnel: expected true or false, got 'yes please'",
    ),
    (
        W + "    ssh: {prot: 22}\n",
        r"workers\[0\]\.ssh\.prot: unknown key 'prot'; did you mean 'port'\?",
    ),
    (
        W + "    ssh: {port: 70000}\n",
        r"workers\[0\]\.ssh\.port: expected an integer of at least 1 and at most 65535, got '70000'",
    ),
    (
        W + "    ssh: {options: -oFoo}\n",
        r"workers\[0\]\.ssh\.options: expected a list of ssh options",
    ),
    (
        W + "    env: {CUDA_VISIBLE_DEVICES: '0'}\n",
        r"workers\[0\]\.env\.CUDA_VISIBLE_DEVICES: CUDA_VISIBLE_DEVICES is reserved: the launcher sets it",
    ),
    (
        W + "env: {FLODL_INTERNAL_X: '1'}\n",
        r"^c\.yml:4: env\.FLODL_INTERNAL_X: FLODL_INTERNAL_X is reserved",
    ),
    (W + "env: {MASTER_PORT: '1'}\n", r"env\.MASTER_PORT: MASTER_PORT is reserved"),
    (
        W + "env: {TORCHELASTIC_RUN_ID: x}\n",
        r"env\.TORCHELASTIC_RUN_ID: TORCHELASTIC_RUN_ID is reserved",
    ),
    (W + "env: {1BAD: x}\n", r"env\.1BAD: environment variable names must match"),
    (W + "env: {A: [1]}\n", r"env\.A: expected a string value, got a list; quote it"),
    (W + "env: [A]\n", r"^c\.yml:4: env: expected a mapping of variable names to values$"),
    (
        W + "controller: {port: 70000}\n",
        r"controller\.port: expected an integer of at least 0 and at most 65535, got '70000'",
    ),
    (W + "controller: {hots: x}\n", r"controller\.hots: unknown key 'hots'; did you mean 'host'\?"),
    (
        W + "controller: {join: {join_timout: 5}}\n",
        r"controller\.join\.join_timout: unknown key 'join_timout'; did you mean 'join_timeout'\?",
    ),
    (
        W + "controller: {join: {join_timeout: -5}}\n",
        r"controller\.join\.join_timeout: expected a positive number of seconds, got '-5'",
    ),
    (
        W + "controller: {join: {min_rank_start: 0}}\n",
        r"controller\.join\.min_rank_start: expected an integer of at least 1, got '0'",
    ),
    (
        W + "controller: {join: {min_rank_start: 1, target_ranks: 0}}\n",
        r"target_ranks: expected an integer of at least 1",
    ),
    (
        W + "controller: {join: {min_rank_start: 1, target_ranks: 1, open_admission: 1}}\n",
        r"open_admission: expected true or false, got '1'",
    ),
    (
        W.replace("cpu:1", "cpu:4") + "controller: {join: {min_rank_start: 3, target_ranks: 2}}\n",
        r"controller\.join\.target_ranks: must be at least min_rank_start \(3\)",
    ),
    (
        W + "controller: {join: {join_timeout: 50, max_join_timeout: 10}}\n",
        r"controller\.join\.max_join_timeout: must be at least join_timeout \(50s\)",
    ),
    (
        "workers:\n  - host: localhost\n    devices: cpu:1\n    tunnel: true\n",
        r"workers\[0\]\.tunnel: worker 'localhost' sets `tunnel: true` but runs on the controller's host",
    ),
    (
        "controller: {host: 10.0.0.9}\nworkers:\n  - {host: 10.0.0.9, devices: cpu:1, tunnel: true}\n",
        r"worker '10\.0\.0\.9' sets `tunnel: true` but runs on the controller's host",
    ),
    (
        "workers:\n  - host: far\n    devices: [0]\n    tunnel: true\n",
        r"workers\[0\]\.tunnel: worker 'far' sets `tunnel: true` with GPU devices \(NCCL backend\)",
    ),
    (
        "workers:\n  - host: far\n    devices: cpu:2\n    tunnel: true\n",
        r"^c\.yml:4: workers\[0\]\.tunnel: worker 'far' sets `tunnel: true`, but a tunnel carries only controller traffic, not the "
        r"rank-to-rank traffic \(gloo\) of a torchrun-contract script; declare the run a Trainer CPU-backend job "
        r"with a top-level `trainer: cpu`, or drop the tunnel$",
    ),
    (
        W + "trainer: gpu\n",
        r"^c\.yml:4: trainer: expected cpu \(a flodl Trainer CPU-backend job\), got 'gpu'$",
    ),
    (W + "trainer: [cpu]\n", r"^c\.yml:4: trainer: expected cpu .*got a list$"),
    (
        "workers:\n  - host: a\n    devices: cpu:1\n  - host: a\n    devices: cpu:1\n",
        r"host 'a' is listed twice",
    ),
    (
        "workers:\n  - host: localhost\n    devices: cpu:1\n  - host: b\n    devices: cpu:1\n  - host: ctl-host\n    devices: cpu:1\n",
        r"^c\.yml:6: workers\[2\]\.host: host 'ctl-host' is this machine, which workers\[0\] \(line 2\) already lists as 'localhost'; "
        r"one machine is one worker — give it one entry with all its devices$",
    ),
    (
        "workers:\n  - {host: CTL-HOST, devices: cpu:1}\n  - {host: 127.0.0.1, devices: cpu:1}\n",
        r"c\.yml:3: workers\[1\]\.host: host '127\.0\.0\.1' is this machine",
    ),
    (
        "workers:\n  - {host: '::1', devices: cpu:1}\n  - {host: localhost., devices: cpu:1}\n",
        r"host 'localhost\.' is this machine, which workers\[0\]",
    ),
    (
        "workers:\n  - {host: a, devices: cpu:1}\n  - {host: b, devices: cpu:1, python: 3}\n",
        r"^c\.yml:3: workers\[1\]\.python: expected a non-empty string$",
    ),
]


@pytest.mark.parametrize(
    ("text", "pattern"), ERRORS, ids=[f"error-{i}" for i in range(len(ERRORS))]
)
def test_error_paths_name_file_line_and_key(text: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        parse_cluster(text, source="c.yml", local_names=LOCAL)


def test_quorum_above_the_configured_capacity_is_allowed_for_walk_in_agents() -> None:
    spec = parse_cluster(
        W + "controller: {join: {min_rank_start: 3, target_ranks: 3}}\n", local_names=LOCAL
    )
    assert spec.capacity == 1
    assert spec.controller.join.resolve(1).min_rank_start == 3


def test_distinct_remote_names_and_one_local_entry_are_fine() -> None:
    spec = parse_cluster(
        "workers:\n  - {host: localhost, devices: cpu:1}\n  - {host: alpha, devices: cpu:1}\n  - {host: beta, devices: cpu:1}\n",
        local_names=LOCAL,
    )
    assert [w.host for w in spec.workers] == ["localhost", "alpha", "beta"]
