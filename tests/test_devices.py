"""The one devices parser: every text form, and one error style."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flodl_async.config.cluster import DeviceSpec as ClusterDeviceSpec
from flodl_async.config.cluster import parse_cluster
from flodl_async.config.devices import DeviceKind, DeviceSpec, parse_devices, parse_gpu_ids
from flodl_async.errors import ConfigError
from flodl_async.host import gpus


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("all", DeviceSpec(kind=DeviceKind.ALL_GPUS)),
        (" all ", DeviceSpec(kind=DeviceKind.ALL_GPUS)),
        ("0", DeviceSpec.gpus((0,))),
        ("0,1,3", DeviceSpec.gpus((0, 1, 3))),
        ("2, 0", DeviceSpec.gpus((2, 0))),
        ("cpu:1", DeviceSpec.cpu(1)),
        ("cpu:16", DeviceSpec.cpu(16)),
    ],
)
def test_text_forms(text: str, spec: DeviceSpec) -> None:
    assert parse_devices(text) == spec


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpu", r"^expected `all`, GPU ids like 0,1, or cpu:N with N >= 1; got 'gpu'$"),
        ("", r"^expected `all`.*; got ''$"),
        ("cpu", r"^expected `all`.*; got 'cpu'$"),
        ("cpu:0", r"got 'cpu:0' \(a host needs at least one CPU rank\)$"),
        ("cpu:-1", r"got 'cpu:-1'$"),
        ("cpu:x", r"got 'cpu:x'$"),
        ("0,,1", r"got '0,,1'$"),
        ("-1", r"got '-1'$"),
        ("0,0", r"^GPU ids '0,0' must be distinct and non-negative$"),
        ("ALL", r"got 'ALL'$"),
    ],
)
def test_bad_text_says_what_was_expected(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_devices(text)


def test_bare_cpu_takes_the_callers_rank_count() -> None:
    """flodl-launch --nproc 3 --devices cpu: the count comes from --nproc."""
    assert parse_devices("cpu", bare_cpu_ranks=3) == DeviceSpec.cpu(3)
    assert parse_devices("cpu:2", bare_cpu_ranks=3) == DeviceSpec.cpu(2)


def test_gpu_ids() -> None:
    assert parse_gpu_ids("3,1") == (3, 1)
    with pytest.raises(ConfigError, match="is not a list of GPU ids"):
        parse_gpu_ids("a")


def test_cluster_reexports_the_same_types() -> None:
    assert ClusterDeviceSpec is DeviceSpec


@pytest.mark.parametrize(
    ("devices", "spec"),
    [
        ("all", DeviceSpec(kind=DeviceKind.ALL_GPUS)),
        ("cpu:2", DeviceSpec.cpu(2)),
        ("'0,1'", DeviceSpec.gpus((0, 1))),
        ("3", DeviceSpec.gpus((3,))),
    ],
)
def test_cluster_scalars_go_through_the_same_parser(devices: str, spec: DeviceSpec) -> None:
    cluster = parse_cluster(
        f"workers:\n  - host: a\n    devices: {devices}\n", local_names=frozenset({"a"})
    )
    assert cluster.workers[0].devices == spec


@pytest.mark.parametrize(
    ("text", "gpus", "expected"),
    [
        ("cpu", 0, DeviceSpec.cpu(2)),
        ("cpu:2", 4, DeviceSpec.cpu(2)),
        ("auto", 0, DeviceSpec.cpu(2)),
        ("auto", 4, DeviceSpec.gpus((0, 1))),
        ("all", 2, DeviceSpec.gpus((0, 1))),
        ("1,3", 4, DeviceSpec.gpus((1, 3))),
    ],
)
def test_flodl_launch_nproc_devices_go_through_the_one_parser(
    text: str, gpus: int, expected: DeviceSpec
) -> None:
    from flodl_async.cli.launch import embedded_devices

    assert embedded_devices(2, text, gpus) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("cpu:3", "gives 3 rank(s) but --nproc is 2"),
        ("gpu", "--devices: expected `all`"),
        ("0", "gives 1 rank(s)"),
    ],
)
def test_flodl_launch_nproc_devices_mismatch_is_a_clear_error(text: str, message: str) -> None:
    from flodl_async.cli.launch import embedded_devices

    with pytest.raises(ConfigError, match=re.escape(message)):
        embedded_devices(2, text, 4)


# ----- the caller's CUDA_VISIBLE_DEVICES (flodl_async.host.gpus) -------------------------------------


def _fake_dev(tmp_path: Path, count: int) -> dict[str, str]:
    """A host that looks like it has ``count`` GPUs: only where the device nodes are counted changes."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in [f"nvidia{i}" for i in range(count)] + ["nvidiactl", "nvidia-uvm", "null"]:
        (dev / name).touch()
    return {gpus.DEV_DIR_VARIABLE: str(dev)}


def test_the_host_count_reads_the_device_nodes_only(tmp_path: Path) -> None:
    env = _fake_dev(tmp_path, 4)
    assert gpus.physical_gpu_count(env) == 4
    assert gpus.physical_gpu_count({gpus.DEV_DIR_VARIABLE: str(tmp_path / "missing")}) == 0


@pytest.mark.parametrize(
    ("mask", "visible"),
    [
        (None, ("0", "1", "2", "3")),
        ("2,3", ("2", "3")),
        (" 3 , 1 ", ("3", "1")),
        ("", ()),
        ("0,7,1", ("0",)),  # CUDA reads up to the first invalid entry
        ("1,1", ("1",)),
        ("-1", ()),
        ("GPU-8a3c,MIG-1f", ("GPU-8a3c", "MIG-1f")),
    ],
)
def test_the_mask_is_read_as_cuda_reads_it(mask: str | None, visible: tuple[str, ...]) -> None:
    assert gpus.visible_gpus(mask, 4) == visible


def test_device_ids_index_into_the_visible_set() -> None:
    assert gpus.select((0, 1), ("2", "3")) == ("2", "3")
    assert gpus.select((1,), ("4", "5", "6")) == ("5",)
    with pytest.raises(
        ConfigError,
        match=r"GPU 2 is not visible here: this host shows 2 GPU\(s\) \(visible: 2,3\); device ids count from 0",
    ):
        gpus.select((0, 2), ("2", "3"))


def test_the_visible_count_honours_the_mask(tmp_path: Path) -> None:
    env = _fake_dev(tmp_path, 4)
    assert gpus.host_visible_gpus(env) == ("0", "1", "2", "3")
    assert gpus.host_visible_gpus({**env, "CUDA_VISIBLE_DEVICES": "2,3"}) == ("2", "3")
