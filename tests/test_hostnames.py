"""Which names mean this machine: one canonical name for localhost, loopback addresses, the hostname and its FQDN."""

from __future__ import annotations

import pytest

from flodl_async.config.cluster import is_local_host, local_host_names
from flodl_async.host.hostnames import LOOPBACK_NAMES, HostAliases, is_loopback_address, normalise

VM = HostAliases.of_machine("vm", "vm.example.com")


@pytest.mark.parametrize(
    "spelling",
    [
        "vm",
        "VM",
        "vm.",
        "localhost",
        "LOCALHOST.",
        "localhost.localdomain",
        "ip6-localhost",
        "vm.example.com",
        "127.0.0.1",
        "127.1.2.3",
        "::1",
        "[::1]",
        "::ffff:127.0.0.1",
    ],
)
def test_every_spelling_of_the_machine_is_its_short_hostname(spelling: str) -> None:
    assert VM.names_this_machine(spelling)
    assert VM.canonical_name(spelling) == "vm"


@pytest.mark.parametrize(
    "other",
    ["alpha", "vm-2", "vm.other.example", "10.0.0.5", "::2", "0.0.0.0", "", "local", "localhost-2"],
)
def test_other_names_are_left_alone(other: str) -> None:
    assert not VM.names_this_machine(other)
    assert VM.canonical_name(other) == other


def test_a_hostname_given_as_an_fqdn_also_has_its_short_form() -> None:
    aliases = HostAliases.of_machine("Node-3.Lab.Example", "")
    assert aliases.canonical == "Node-3"  # as the machine spells it, for messages
    assert aliases.names == frozenset({*LOOPBACK_NAMES, "node-3.lab.example", "node-3"})
    assert aliases.canonical_name("node-3") == "Node-3"


def test_normalise_and_loopback() -> None:
    assert normalise(" VM.Example. ") == "vm.example"
    assert normalise("[::1]") == "::1"
    assert is_loopback_address("127.255.0.1")
    assert not is_loopback_address("localhost")  # a name, not an address
    assert not is_loopback_address("::ffff:10.0.0.1")


def test_the_cluster_files_notion_of_local_is_the_same() -> None:
    names = local_host_names()
    assert "localhost" in names
    assert is_local_host("LOCALHOST", frozenset({"localhost"}))
    assert is_local_host("::1", frozenset())
    assert not is_local_host("alpha", frozenset({"localhost"}))
