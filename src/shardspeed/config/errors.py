"""Errors raised for a bad config: each names the key path, the bad value and what is allowed."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A config that cannot be run as written. The message lists every problem found, one a line."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(
            "invalid shardspeed/DeepSpeed config:\n  - " + "\n  - ".join(self.problems)
        )


def closest(name: str, choices: Iterable[str]) -> str | None:
    """The allowed name most like `name`, for "did you mean" hints."""
    matches = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return matches[0] if matches else None


def key_path(*parts: object) -> str:
    """Dotted path of a config key, with list indices in brackets: `a.b[2].c`."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out
