"""The ssh options a worker's ``ssh.options`` may carry: parsed and checked when the cluster file is
read.

Pure, so :mod:`flodl_async.config.cluster` can refuse an unsupported option by name without
importing asyncssh.
"""

from __future__ import annotations

#: ssh options a worker may set (anything else is refused by name).
SUPPORTED_OPTIONS = ("ProxyJump",)


def parse_option(option: str) -> tuple[str, str]:
    """``"ProxyJump=bastion"`` or ``"ProxyJump bastion"`` → ``("ProxyJump", "bastion")``."""
    text = option.strip()
    sep = "=" if "=" in text else " "
    name, _, value = text.partition(sep)
    return name.strip(), value.strip()


def option_error(option: str) -> str | None:
    """Why ``option`` is refused, or None when it is supported."""
    name, value = parse_option(option)
    if name not in SUPPORTED_OPTIONS:
        return (
            f"ssh option {name!r} is not supported (supported: {', '.join(SUPPORTED_OPTIONS)}); "
            "remove it"
        )
    if not value:
        return f"ssh option {name} needs a value, like {name}=user@bastion:22"
    return None
