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


#: a served model's engine options (ModelConfig's fields, the repository's keys, gpuloom bench --engine)
ENGINE_KEYS = ("channels_last", "fuse_convolutions", "split_gemms", "fuse_epilogues")
#: a served model's value of each of ENGINE_KEYS where its config does not say (ModelConfig's, the
#: repository's: one place, as the repository once defaulted fuse_epilogues to False after ModelConfig
#: had turned it on, and served models ran without the kernels: H100 run 149)
ENGINE_DEFAULTS = {"channels_last": False, "fuse_convolutions": False, "split_gemms": False, "fuse_epilogues": True}
#: what each of ENGINE_KEYS takes, as error messages say it
ENGINE_CHOICES = {"channels_last": "true, false or auto", "fuse_convolutions": "true, false or channels_last",
                  "split_gemms": "true or false", "fuse_epilogues": "true or false"}


def is_engine_value(key: str, value: Any) -> bool:
    """Whether ``value`` is one ``key`` (of ENGINE_KEYS) takes: the one check a repository's YAML and
    ``gpuloom bench --engine`` share."""
    if key == "channels_last":
        return is_channels_last(value)
    if key == "fuse_convolutions":
        return is_fuse_convolutions(value)
    return isinstance(value, bool)


def parse_engine_options(text: str) -> dict[str, Any]:
    """``"fuse_epilogues=true,split_gemms=true"`` -> ``{"fuse_epilogues": True, "split_gemms": True}``:
    a served model's engine options (``ModelConfig``'s, the repository's keys) as a command line
    writes them. ValueError saying what was expected for an unknown key or value."""
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, raw = item.partition("=")
        key, raw = key.strip(), raw.strip().lower()
        if not eq or key not in ENGINE_KEYS:
            raise ValueError(f"engine option {item!r}: expected KEY=VALUE with KEY one of {', '.join(ENGINE_KEYS)}")
        value: Any = {"true": True, "false": False}.get(raw, raw)
        if not is_engine_value(key, value):
            raise ValueError(f"engine option {key}: expected {ENGINE_CHOICES[key]}, got {raw!r}")
        out[key] = value
    return out
