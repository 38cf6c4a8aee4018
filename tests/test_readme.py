"""What the README tells a user to type or to expect: the set-up's and the service's commands, and
the warnings the deploy units and the launchers' environment call for. (The exit tables and links
are tests/test_verdict.py's, the layout table tests/test_layering.py's.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

#: What the tests that skip without a tool need (hostkit's reasons name the same packages).
TEST_PACKAGES = {"curl", "chromium", "prometheus", "openssh-server", "openssh-client", "iproute2", "util-linux"}
CPU_TORCH = "--index-url https://download.pytorch.org/whl/cpu"


def _section(title: str) -> str:
    start = README.index(f"\n## {title}")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def _blocks(section: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def test_the_set_up_block_installs_the_debian_packages_the_tests_need() -> None:
    [block] = _blocks(_section("Set up a fresh machine"))
    [line] = [line for line in block.splitlines() if "apt-get install" in line]
    packages = set(line.split("#")[0].split("apt-get install", 1)[1].split()) - {"-y"}
    assert packages >= TEST_PACKAGES, line
    named = set(
        re.findall(r"apt-get install ([\w .-]+)\)", (ROOT / "tests/hostkit.py").read_text())
    )
    assert {p for names in named for p in names.split()} <= packages, named


def test_the_service_installs_the_cpu_torch_before_flodl_async() -> None:
    """A plain ``pip install flodl_async`` pulls the multi-GB CUDA torch, as the set-up warns."""
    [block] = _blocks(_section("Run the agent as a service"))
    lines = block.splitlines()
    project = next(i for i, line in enumerate(lines) if "pip install /path/to/flodl_async" in line)
    torch = next(i for i, line in enumerate(lines) if "pip install torch" in line)
    assert torch < project
    assert CPU_TORCH in lines[torch]


def test_a_strict_unit_s_read_only_file_system_is_said_with_its_errno() -> None:
    units = [ROOT / "deploy/flodl-agent.service", ROOT / "deploy/flodl-launch@.service"]
    assert all("ProtectSystem=strict" in unit.read_text() for unit in units)
    service = _section("Run the agent as a service")
    assert "ProtectSystem=strict" in service
    assert "EROFS" in service
    assert "ReadWritePaths=" in service


def test_accelerate_on_cpu_ranks_is_told_its_variable() -> None:
    assert "ACCELERATE_USE_CPU=true" in README
