"""The --spec-stdin agent's pure parts: the spec line both ways, the hello line, the interface choice."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flodl_async._version import __version__
from flodl_async.agent.specline import AgentSpec, devices_text, hello_line, parse_hello
from flodl_async.config.devices import parse_devices
from flodl_async.config.sshopts import option_error, parse_option
from flodl_async.errors import ConfigError
from flodl_async.host.ifnames import (
    interface_of_address,
    interface_towards,
    local_ipv4_interfaces,
    ranks_env,
    with_default_ifname,
)

SPEC = AgentSpec(
    controller_host="10.0.0.1",
    controller_port=1337,
    secret_hex="00" * 32,
    host="h1",
    devices="cpu:2",
    run_id="r",
    env={"A": "b"},
    workdir=None,
    timeout_scale=2.0,
    stop_grace=10.0,
)


def test_the_spec_line_round_trips_and_is_one_line() -> None:
    line = SPEC.to_line()
    assert line.count(b"\n") == 1
    assert line.endswith(b"\n")
    assert AgentSpec.from_line(line) == SPEC


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda b: b.pop("secret"), "the spec lacks field 'secret'"),
        (
            lambda b: b.update(controller_port="1337"),
            "spec field 'controller_port' has the wrong type (str)",
        ),
        (lambda b: b.update(controller_port=0), "must be a TCP port (got 0)"),
        (lambda b: b.update(env={"A": 1}), "'env' must map strings to strings"),
        (lambda b: b.update(workdir=3), "'workdir' must be a string or null"),
    ],
)
def test_a_bad_spec_names_the_field(edit, message) -> None:  # type: ignore[no-untyped-def]
    body = json.loads(SPEC.to_line())
    edit(body)
    with pytest.raises(ConfigError, match=r"^--spec-stdin: ") as info:
        AgentSpec.from_line(json.dumps(body).encode())
    assert message in str(info.value)


def test_not_json_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="is not JSON"):
        AgentSpec.from_line(b"deadbeef\n")


def test_hello_names_the_version() -> None:
    assert parse_hello(hello_line()) == __version__
    assert parse_hello("flodl-agent-hello 9.9\n") == "9.9"
    assert parse_hello("Traceback (most recent call last):") is None
    assert parse_hello("flodl-agent-hello") is None


@pytest.mark.parametrize("text", ["cpu:3", "0,2", "all"])
def test_devices_text_reads_back(text: str) -> None:
    assert parse_devices(devices_text(parse_devices(text))) == parse_devices(text)


def test_the_configured_interface_sets_both_variables_over_the_spec_env() -> None:
    assert ranks_env({"GLOO_SOCKET_IFNAME": "x", "A": "b"}, configured_ifname="bond0") == {
        "GLOO_SOCKET_IFNAME": "bond0",
        "NCCL_SOCKET_IFNAME": "bond0",
        "A": "b",
    }
    assert ranks_env({"A": "b"}, configured_ifname=None) == {"A": "b"}


def test_the_default_interface_fills_only_what_is_unset() -> None:
    assert with_default_ifname({}, "eth0") == {
        "GLOO_SOCKET_IFNAME": "eth0",
        "NCCL_SOCKET_IFNAME": "eth0",
    }
    assert with_default_ifname({"NCCL_SOCKET_IFNAME": "ib0"}, "eth0") == {
        "NCCL_SOCKET_IFNAME": "ib0",
        "GLOO_SOCKET_IFNAME": "eth0",
    }
    assert with_default_ifname({"A": "b"}, None) == {"A": "b"}


def test_interface_of_address() -> None:
    interfaces = {"lo": "127.0.0.1", "eth0": "10.77.0.2"}
    assert interface_of_address("10.77.0.2", interfaces) == "eth0"
    assert interface_of_address("10.9.9.9", interfaces) is None


def test_this_machine_reaches_loopback_over_lo() -> None:
    assert local_ipv4_interfaces().get("lo") == "127.0.0.1"
    assert interface_towards("127.0.0.1", 9) == "lo"


def test_ssh_options() -> None:
    assert parse_option("ProxyJump=me@bastion:2222") == ("ProxyJump", "me@bastion:2222")
    assert parse_option("ProxyJump bastion") == ("ProxyJump", "bastion")
    assert option_error("ProxyJump=bastion") is None
    assert (
        option_error("StrictHostKeyChecking=no")
        == "ssh option 'StrictHostKeyChecking' is not supported (supported: ProxyJump); remove it"
    )
    assert (
        option_error("ProxyJump=")
        == "ssh option ProxyJump needs a value, like ProxyJump=user@bastion:22"
    )


@pytest.mark.parametrize(
    ("stdin", "message"),
    [
        (b"", "stdin closed before the spec line came"),
        (b"not json\n", "the first stdin line is not JSON"),
    ],
)
def test_the_agent_says_hello_then_refuses_a_bad_spec_in_one_line(
    stdin: bytes, message: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flodl_async.agent", "--spec-stdin"],
        input=stdin,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stdout.decode().splitlines() == [hello_line()]
    err = done.stderr.decode()
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
