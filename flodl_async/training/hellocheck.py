"""Whether a rank's ``TrainerHello`` may join the run: its digest, its spec against the launcher's
and against the first rank's, its model schema.

Pure. The coordinator asks :func:`check_hello` for each hello; the answer is the run's spec or a
verdict that names the rank, its host and the first difference.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..wire import messages as m
from .modelschema import ModelSchema
from .spec import TrainerSpec, digest_of, spec_diff

_SAME_ARGUMENTS = (
    "Every rank must build the Trainer from the same arguments — are the ranks running different "
    "code or command lines?"
)


def check_hello(
    hello: m.TrainerHello,
    *,
    host: str,
    launcher: TrainerSpec | None,
    reference: tuple[m.TrainerHello, TrainerSpec] | None,
) -> TrainerSpec | str:
    """The run's spec if ``hello`` can join, else why not.

    ``host``: how the verdict names the rank's host (``host b``); ``launcher``: the launcher's own
    spec, when a launcher runs the script; ``reference``: the first valid hello and its spec (None
    while ``hello`` would be the first, which then becomes the reference).
    """
    who = f"rank {hello.rank} ({host})"
    try:
        claimed = digest_of(hello.spec, hello.model)
    except ConfigError as exc:
        return f"{who} sent a Trainer spec this controller cannot read: {exc}"
    if claimed != hello.digest:
        return (
            f"{who} sent a digest that does not match its own Trainer spec; are the rank and the "
            "controller running the same flodl_async version?"
        )
    if launcher is not None:
        diff = spec_diff(launcher.to_wire(), hello.spec)
        if diff is not None:
            return f"{who} built a different Trainer than the launcher: {diff}. {_SAME_ARGUMENTS}"
    if reference is None:
        try:
            return TrainerSpec.from_wire(hello.spec)
        except ConfigError as exc:
            return f"{who} sent an invalid Trainer spec: {exc}"
    ref, spec = reference
    if hello.digest == ref.digest:
        return spec
    diff = spec_diff(ref.spec, hello.spec)
    what = "Trainer"
    if diff is None:
        what = "model"
        diff = (
            ModelSchema.from_wire(ref.model).first_difference(ModelSchema.from_wire(hello.model))
            or "the digests differ"
        )
    return f"{who} built a different {what} than rank {ref.rank}: {diff}. {_SAME_ARGUMENTS}"
