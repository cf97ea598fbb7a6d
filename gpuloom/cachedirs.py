"""Where gpuloom keeps what it caches, and the words that turn a cache off: one rule for every cache
(the profile cache, the graph cache, ``gpuloom cache``, ``gpuloom serve``'s flags)."""

from __future__ import annotations

import os
from pathlib import Path

#: a cache setting that is one of these (any case, spaces around) turns that cache off
OFF_WORDS = ("0", "off", "none", "false", "no")


def is_off(setting: str | None) -> bool:
    """Whether ``setting`` (a flag's or an environment variable's value) turns a cache off."""
    return setting is not None and setting.strip().lower() in OFF_WORDS


def user_cache_dir(kind: str) -> Path:
    """``$XDG_CACHE_HOME/gpuloom/<kind>``, else ``~/.cache/gpuloom/<kind>``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpuloom" / kind
