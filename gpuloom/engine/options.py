"""The values ``gpuloom.compile``'s layout and fusion options take, checked alike wherever a user
writes them: compile's arguments, ``ModelConfig`` and a repository's YAML (torch-free, so the
repository parser can use it). A bool is matched by type: ``1`` is not ``True`` here (it once
slipped through one of three copies of this check)."""

from __future__ import annotations

from typing import Any


def is_channels_last(value: Any) -> bool:
    """False, True or "auto" (both layouts timed per bucket)."""
    return isinstance(value, bool) or value == "auto"


def is_fuse_convolutions(value: Any) -> bool:
    """False, True or "channels_last" (the channels-last graph only)."""
    return isinstance(value, bool) or value == "channels_last"
