"""CPU ranks against the cores a host lets its agent use: more ranks than cores compete for them.

``flodl-launch`` checks the controller's own host before anything starts
(:func:`flodl_async.cli.launch.warn_oversubscribed`). Every other host — ssh,
dial-in, walk-in — is checked where its cores are known: its agent counts them
(:func:`usable_cores`, the CPUs it may run on, as ``nproc`` does) and reports
them in its join hello, and the controller warns on the launcher's console
when that host's CPU ranks exceed them (:func:`oversubscription`). An agent
that reports no count (0: an older one) is not judged.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's total)."""
    return len(os.sched_getaffinity(0))


def oversubscription(host: str, devices: Sequence[str], cores: int) -> str | None:
    """The warning for a host whose CPU ranks (``cpu:N`` device labels) exceed its reported cores,
    else None."""
    ranks = sum(1 for label in devices if label.startswith("cpu:"))
    if cores <= 0 or ranks <= cores:
        return None
    return (
        f"warning: {ranks} CPU ranks on host {host!r}, which has {cores} core(s) for them: they "
        "will compete for the cores (fewer ranks run faster)"
    )
