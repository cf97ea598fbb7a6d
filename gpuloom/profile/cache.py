"""Profiles measured at load, kept on disk so that the next start does not measure them again.

A model with no shipped or given profile is profiled on the GPU when it loads (the service's
``measure_profiles``); the result goes here, filed under the GPU and a fingerprint of what was timed:
the model's name, its input shapes and dtypes, its largest batch, how it was compiled (channels-last,
fused convolutions), its parameters' names, shapes and dtypes and the operators of its compiled graph
in order. A model edited so that any of these change is measured again; new weights of the same
shapes are not (they do not change the timing). ``gpuloom serve --profile-cache none`` measures
every time.

Pure Python; no torch import (the caller gives the parameters' descriptions).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Iterable

from ..cachedirs import user_cache_dir
from .store import Profile, ProfileError, write_profile

__all__ = ["ProfileCache", "default_cache_dir", "fingerprint", "op_name"]

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def default_cache_dir() -> Path:
    """``$GPULOOM_PROFILE_CACHE``, else ``$XDG_CACHE_HOME/gpuloom/profiles``, else ``~/.cache/gpuloom/profiles``."""
    if os.environ.get("GPULOOM_PROFILE_CACHE"):
        return Path(os.environ["GPULOOM_PROFILE_CACHE"])
    return user_cache_dir("profiles")


def fingerprint(name: str, input_shapes: Iterable[Iterable[int]], input_dtypes: Iterable[str], max_batch: int,
                runner: str, parameters: Iterable[tuple[str, tuple[int, ...], str]], ops: Iterable[str] = ()) -> str:
    """16 hex digits over everything a measured profile depends on that a load can see."""
    what = {"name": name, "inputs": [list(map(int, s)) for s in input_shapes], "dtypes": list(input_dtypes),
            "max_batch": int(max_batch), "runner": runner,
            "parameters": [[n, list(map(int, shape)), dt] for n, shape, dt in parameters], "ops": list(ops)}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def op_name(target: object) -> str:
    """A compiled graph operator's target as the fingerprint names it, the same in every process.

    ``str()`` of a torch operator (``aten.conv2d.default``) or a builtin is stable, but a Python
    function's is ``<function bias_act at 0x7f...>``: a new address each process, so a model with
    gpuloom's epilogue or gate kernels missed the cache at every start and was profiled again (the
    H100's serve smoke, run 156). Those are named by module and qualified name instead; the names
    that never carried an address stay as they were, so their cached profiles still match."""
    text = str(target)
    if not _ADDRESS.search(text):
        return text
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    return f"{module}.{name}" if module and name else _ADDRESS.sub("", text)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "gpu"


class ProfileCache:
    """One directory per GPU (``<root>/<gpu name>-<SMs>sm/``), one JSON profile per fingerprint."""

    def __init__(self, root: str | os.PathLike, gpu_name: str, sm_count: int) -> None:
        self.directory = Path(root) / f"{_slug(gpu_name)}-{int(sm_count)}sm"

    def path(self, name: str, fp: str) -> Path:
        return self.directory / f"{_slug(name)}-{fp}.json"

    def get(self, name: str, fp: str) -> Profile | None:
        """The profile filed under ``fp``, or None (none yet, or a file that does not read as one)."""
        path = self.path(name, fp)
        try:
            with open(path) as f:
                return Profile.from_json(json.load(f))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, ProfileError):  # torn or foreign: measure again
            return None

    def put(self, name: str, fp: str, profile: Profile) -> Path:
        """Write ``profile`` atomically (a reader never sees half a file); returns its path."""
        self.directory.mkdir(parents=True, exist_ok=True)
        return write_profile(profile, self.path(name, fp))
