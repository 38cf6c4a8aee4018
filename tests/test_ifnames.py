"""The ranks' socket-interface choice (flodl_async.host.ifnames) and the dial-in keys nothing could deliver."""

from __future__ import annotations

import pytest

from flodl_async.config.cluster import SshSpec, WorkerSpec, parse_cluster
from flodl_async.config.devices import parse_devices
from flodl_async.config.plan import PlacedWorker, Placement, direct_ssh_targets
from flodl_async.errors import ConfigError
from flodl_async.host.ifnames import (
    controller_host_ifname,
    controller_host_peer,
    interface_holding,
    ranks_env,
    stand_alone_default_ifname,
    with_default_ifname,
)


def _worker(
    host: str, placement: Placement, *, ssh: SshSpec | None = None, tunnel: bool = False
) -> PlacedWorker:
    return PlacedWorker(
        spec=WorkerSpec(host=host, devices=parse_devices("cpu:1"), ssh=ssh, tunnel=tunnel),
        placement=placement,
    )


def test_the_controllers_host_looks_at_its_bind_address_then_the_first_direct_ssh_worker() -> None:
    workers = [
        _worker("localhost", Placement.LOCAL),
        _worker("walk-in", Placement.DIAL_IN),
        _worker("tunnelled", Placement.SSH, tunnel=True),
        _worker("b", Placement.SSH, ssh=SshSpec(target="10.0.0.2", port=2222)),
        _worker("c", Placement.SSH),
    ]
    targets = direct_ssh_targets(workers)
    assert targets == [
        ("10.0.0.2", 2222),
        ("c", 22),
    ]  # no local, dial-in or tunnelled worker: their addresses say nothing
    assert controller_host_peer("10.0.0.1", 1337, targets) == (
        "10.0.0.1",
        1337,
    )  # the address the remote agents dial
    assert controller_host_peer("0.0.0.0", 1337, targets) == ("10.0.0.2", 2222)
    assert controller_host_peer("127.0.0.1", 1337, []) is None  # one host: gloo's own choice stays
    assert (
        controller_host_peer("0.0.0.0", 1337, []) is None
    )  # only dial-in workers: unknown until they join


def test_the_kernel_names_the_interface_of_an_address() -> None:
    assert interface_holding("127.0.0.1") == "lo"
    assert interface_holding("") is None  # a unix socket's link has no address
    assert interface_holding("192.0.2.77") is None  # TEST-NET: held by no interface here
    assert controller_host_ifname(("127.0.0.1", 9)) == "lo"
    assert controller_host_ifname(None) is None


def test_an_explicit_setting_wins_over_the_default() -> None:
    configured = ranks_env({"GLOO_SOCKET_IFNAME": "eth9"}, configured_ifname="bond0")
    assert with_default_ifname(configured, "eth0") == {
        "GLOO_SOCKET_IFNAME": "bond0",
        "NCCL_SOCKET_IFNAME": "bond0",
    }
    assert with_default_ifname({"GLOO_SOCKET_IFNAME": "eth9"}, "eth0") == {
        "GLOO_SOCKET_IFNAME": "eth9",
        "NCCL_SOCKET_IFNAME": "eth0",
    }


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ("    env: {A: b}\n", "env"),
        ("    workdir: /srv/job\n", "workdir"),
        ("    nccl_socket_ifname: eth0\n", "nccl_socket_ifname"),
    ],
)
def test_a_dial_in_worker_refuses_what_nothing_would_deliver_and_says_where_it_goes(
    extra: str, key: str
) -> None:
    text = (
        "workers:\n  - host: localhost\n    devices: cpu:1\n  - host: node-b\n    devices: cpu:1\n    dial_in: true\n"
        + extra
    )
    with pytest.raises(ConfigError) as caught:
        parse_cluster(text)
    message = str(caught.value)
    assert f"workers[1].{key}" in message
    assert "dials in on its own" in message
    assert "Environment= in its unit file" in message
    assert "flodl-agent --workdir" in message


def test_a_dial_in_worker_without_those_keys_parses() -> None:
    spec = parse_cluster(
        "workers:\n  - host: localhost\n    devices: cpu:1\n    env: {A: b}\n  - host: node-b\n    devices: cpu:1\n    dial_in: true\n"
    )
    assert [w.dial_in for w in spec.workers] == [False, True]


def test_a_stand_alone_agent_dialling_over_loopback_sets_no_interface() -> None:
    """On the controller's own machine the join interface is lo: its ranks could not be reached from other hosts."""
    for loopback in ("127.0.0.1", "127.0.1.1", "::1", "localhost"):
        assert stand_alone_default_ifname(loopback) == "", (
            loopback
        )  # "": nothing set, gloo's own choice
    for remote in ("10.0.0.5", "node-a", "fe80::1"):
        assert stand_alone_default_ifname(remote) is None, (
            remote
        )  # None: the join connection's interface
