"""What one rank process is started as: its command line and its whole environment, from the
world as its host sees it (pure but for the caller's environment and ``PATH`` look-ups).

One function for both ways a rank starts: by its agent at a round's ``StartRanks``
(:mod:`.ranks`), and, on a one-host ``flodl-launch --nproc`` run, by the launcher before its
control plane is up (:mod:`flodl_async.cli.earlyranks`), which the agent then adopts only when it
would have started exactly the same. Kept free of the wire's messages so the launcher's early path
imports little.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Mapping

from ..config.command import host_command, without_internal
from ..config.devices import DeviceKind, DeviceSpec
from ..config.rankenv import RankPlacement, RankSpec, rank_environment
from ..host.gpus import host_visible_gpus, select
from ..host.ifnames import with_default_ifname


def rank_gpu_ids(devices: DeviceSpec, ranks: int) -> tuple[str, ...] | None:
    """The ranks' CUDA_VISIBLE_DEVICES: the host's devices as indices into the caller's own mask
    (:mod:`flodl_async.host.gpus`); None for CPU ranks."""
    if not devices.is_gpu:
        return None
    indices = devices.gpu_ids if devices.kind is DeviceKind.GPU_LIST else tuple(range(ranks))
    return select(indices, host_visible_gpus())


def rank_launch(
    *,
    command: tuple[str, ...],
    run_env: Mapping[str, str],
    host_env: Mapping[str, str],
    placement: RankPlacement,
    error_file: str,
    rank_spec: RankSpec,
    cuda_visible_devices: tuple[str, ...] | None,
    default_ifname: str | None,
) -> tuple[tuple[str, ...], dict[str, str]]:
    """``(argv, env)`` of one rank: the run's ``command`` as this host runs it, in the rank
    environment (:func:`~flodl_async.config.rankenv.rank_environment`)."""
    env = rank_environment(
        os.environ,
        placement,
        error_file=error_file,
        rank_spec=rank_spec,
        cluster_env=without_internal(run_env),
        host_env=without_internal(host_env),
        cuda_visible_devices=cuda_visible_devices,
    )
    # after every explicit setting: it fills only what is unset
    env = with_default_ifname(env, default_ifname)
    # A leading `python` is this host's interpreter (flodl_async.config.command).
    argv = host_command(
        command,
        run_env=run_env,
        host_env=host_env,
        own_python=sys.executable,
        which=functools.partial(shutil.which, path=env.get("PATH")),
    )
    return argv, env
