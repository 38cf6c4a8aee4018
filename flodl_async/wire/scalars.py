"""The one message of ``fa.report``: named scalars a rank reports, up its relay to the run's status.

A module of its own, beside :mod:`flodl_async.wire.messages` (which holds every other kind and
has no room left): the same registry (:func:`~flodl_async.wire.schema.message`), the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .schema import Message, message


@message(kind=0x0418)
@dataclass(frozen=True, slots=True, kw_only=True)
class Report(Message):
    """Named scalars a rank reported with ``fa.report`` (the latest value of each since its last
    ``Report``), up its relay to the controller's status: a plain script's, or a Trainer's outside
    its step."""

    rank: int
    scalars: dict[str, float] = field(default_factory=dict)
