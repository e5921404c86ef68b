"""DeepSpeed's module layout where no room has the module (``shardspeed.compat.deepspeed``), and
``python -m shardspeed.compat script.py [args]``, which runs a DeepSpeed script on shardspeed.

The ``deepspeed`` import alias itself is :mod:`shardspeed.alias` (a hook that knows modules by name,
below every room, so the launcher's workers can install it); its names are re-exported here, where
DeepSpeed users look for them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from shardspeed.alias import (
    ALIASES,
    DEEPSPEED_VERSION,
    ENVIRONMENT_SWITCH,
    LAYOUT,
    install,
    install_from_environment,
    is_installed,
    layout_name,
    resolve,
    shardspeed_name,
    switch_is_set,
)
from shardspeed.launcher.entry import run_target

__all__ = [
    "ALIASES",
    "DEEPSPEED_VERSION",
    "ENVIRONMENT_SWITCH",
    "LAYOUT",
    "install",
    "install_from_environment",
    "is_installed",
    "layout_name",
    "main",
    "resolve",
    "shardspeed_name",
    "switch_is_set",
]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shardspeed.compat script.py [args]``: run a DeepSpeed script on shardspeed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print("usage: python -m shardspeed.compat script.py [args]", file=sys.stderr)
        return 2
    install()
    run_target(argv[0], argv[1:])
    return 0
