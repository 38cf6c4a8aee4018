"""The oversubscription rule: a host's CPU ranks against the cores its agent reported."""

from __future__ import annotations

import os

import msgpack
import pytest

from flodl_async.host.cores import oversubscription, usable_cores
from flodl_async.wire import messages as m
from flodl_async.wire.schema import pack_message, to_body, unpack_message


def test_usable_cores_is_this_processs_affinity() -> None:
    assert usable_cores() == len(os.sched_getaffinity(0)) >= 1


@pytest.mark.parametrize(
    ("devices", "cores", "warned"),
    [
        (("cpu:0", "cpu:1", "cpu:2"), 2, True),
        (("cpu:0", "cpu:1"), 2, False),  # as many ranks as cores fits
        (("cuda:0", "cuda:1", "cuda:2"), 1, False),  # GPU ranks are not CPU ranks
        (("cpu:0", "cpu:1", "cpu:2"), 0, False),  # an agent that reported no count is not judged
    ],
)
def test_only_more_cpu_ranks_than_reported_cores_is_warned(
    devices: tuple[str, ...], cores: int, warned: bool
) -> None:
    warning = oversubscription("h1", devices, cores)
    assert (warning is not None) is warned
    if warning is not None:
        assert warning.startswith(
            f"warning: {len(devices)} CPU ranks on host 'h1', which has {cores} core(s) for them"
        )


def test_the_join_hello_carries_the_core_count_and_an_older_hello_reads_as_none() -> None:
    hello = m.JoinHello(host="h", devices=("cpu:0",), pid=1, cores=3)
    assert unpack_message(m.JoinHello.KIND, pack_message(hello)) == hello
    older = msgpack.packb(
        to_body(hello)[:-2], use_bin_type=True
    )  # an agent from before the field: no trailing count (nor the every-node digest after it)
    assert unpack_message(m.JoinHello.KIND, older) == m.JoinHello(
        host="h", devices=("cpu:0",), pid=1, cores=0
    )
