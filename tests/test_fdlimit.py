"""The descriptor limit: raised to the hard limit at start, never failing the run."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from flodl_async.net import fdlimit
from flodl_async.net.fdlimit import DescriptorLimit, descriptor_limit, raise_descriptor_limit

resource = pytest.importorskip("resource")


def test_the_soft_limit_is_raised_to_the_hard_limit() -> None:
    # In a child: the test process keeps its own limits.
    code = (
        "import resource\n"
        "from flodl_async.net.fdlimit import raise_descriptor_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "after = raise_descriptor_limit()\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard, after.soft == hard, after.hard == hard)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.split() == ["True", "True", "True"]


def test_a_refusal_leaves_the_limit_and_the_run_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(_which: int, _limits: tuple[int, int]) -> None:
        raise ValueError("not allowed")

    monkeypatch.setattr(resource, "getrlimit", lambda _which: (256, 4096))
    monkeypatch.setattr(resource, "setrlimit", refuse)
    caplog.set_level(logging.DEBUG, logger="flodl_async.net")
    assert raise_descriptor_limit() == DescriptorLimit(soft=256, hard=4096)
    assert (
        "could not raise the soft limit above 256 (soft limit 256, hard limit 4096): not allowed"
        in caplog.text
    )
    assert all(r.levelno == logging.DEBUG for r in caplog.records)


def test_an_unlimited_hard_limit_tries_the_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    tried: list[int] = []

    def set_limit(_which: int, limits: tuple[int, int]) -> None:
        tried.append(limits[0])
        if limits[0] > 10240:
            raise ValueError("above OPEN_MAX")  # macOS refuses more than its per-process maximum

    monkeypatch.setattr(resource, "getrlimit", lambda _which: (256, resource.RLIM_INFINITY))
    monkeypatch.setattr(resource, "setrlimit", set_limit)
    assert raise_descriptor_limit() == DescriptorLimit(soft=10240, hard=None)
    assert tried == list(fdlimit._FALLBACK_SOFT_LIMITS)


def test_already_at_the_hard_limit_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (4096, 4096))
    monkeypatch.setattr(resource, "setrlimit", lambda *_: pytest.fail("setrlimit called"))
    assert raise_descriptor_limit() == DescriptorLimit(soft=4096, hard=4096)
    assert descriptor_limit().describe() == "soft limit 4096, hard limit 4096"
