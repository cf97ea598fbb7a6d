"""``gpuloom cache``: where gpuloom keeps what it measured or compiled, how much, and emptying it.

Two caches, both rebuilt on demand: the latency profiles measured when a model without one loads
(``gpuloom/profile/cache.py``, one directory per GPU) and the functional export graphs of compiled
models (``gpuloom/engine/graph_cache.py``). Like ``pip cache``: ``dir``, ``info``, ``purge``. A purge
removes only the files gpuloom writes there (``*.json``, and its unfinished ``.*.tmp``), never a
directory or anything else, so a cache pointed at a shared directory loses nothing else. No torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "cache"
HELP = "show where gpuloom keeps measured profiles and compiled graphs, how much, or empty them (like pip cache)"

KINDS = ("profiles", "graphs")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("dir", "info", "purge"),
                   help="dir: the caches' directories; info: their files and sizes; purge: remove their files")
    p.add_argument("kind", nargs="?", choices=KINDS, default=None, help="only this cache (default: both)")
    p.add_argument("--profile-cache", default=None, metavar="DIR",
                   help="the profile cache (default ~/.cache/gpuloom/profiles or $GPULOOM_PROFILE_CACHE; "
                        "gpuloom serve --profile-cache)")
    p.add_argument("--graph-cache", default=None, metavar="DIR",
                   help="the graph cache (default ~/.cache/gpuloom/graphs or $GPULOOM_GRAPH_CACHE; "
                        "gpuloom serve --graph-cache)")


def directories(args: argparse.Namespace) -> dict[str, Path | None]:
    """Each cache asked for -> its directory (None: turned off)."""
    from gpuloom.cachedirs import is_off
    from gpuloom.engine import graph_cache
    from gpuloom.profile.cache import default_cache_dir

    found: dict[str, Path | None] = {}
    if args.kind in (None, "profiles"):
        if args.profile_cache:  # "none" (or 0, off, ...) as in gpuloom serve --profile-cache none
            found["profiles"] = None if is_off(args.profile_cache) else Path(args.profile_cache)
        else:
            found["profiles"] = default_cache_dir()
    if args.kind in (None, "graphs"):
        found["graphs"] = graph_cache.cache_dir(args.graph_cache or None)
    return found


def cache_files(kind: str, directory: Path) -> list[Path]:
    """The files gpuloom wrote in ``directory``: profiles under ``<gpu>-<SMs>sm/``, graphs at the top."""
    from gpuloom.engine.graph_cache import SUFFIX

    patterns = ("*sm/*.json", "*sm/.*.tmp") if kind == "profiles" else ("*" + SUFFIX, ".*.tmp")
    return sorted({p for pattern in patterns for p in directory.glob(pattern) if p.is_file()})


def _size(n: float) -> str:
    """Bytes in binary units, as the caches' bounds are written (512 MiB)."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def run(args: argparse.Namespace) -> int:
    import sys

    from gpuloom.engine import graph_cache

    for kind, directory in directories(args).items():
        if directory is None:
            print(f"{kind}: off" if args.action != "purge" else f"{kind}: off, nothing to remove")
            continue
        if args.action == "dir":
            print(f"{kind}: {directory}")
            continue
        files = cache_files(kind, directory) if directory.is_dir() else []
        if not directory.is_dir():  # a mistyped --profile-cache read as an empty cache, unsaid (on stderr:
            # the counts stay on stdout as they were)
            what = "is not a directory" if directory.exists() else "does not exist (yet)"
            print(f"note: the {kind} cache {directory} {what}", file=sys.stderr)
        total = 0
        for f in files:
            try:
                total += f.stat().st_size
            except OSError:
                pass
        if args.action == "info":
            bound = f", at most {_size(graph_cache.MAX_BYTES)}" if kind == "graphs" else ""
            print(f"{kind}: {directory}: {len(files)} files, {_size(total)}{bound}")
            continue
        removed = 0
        for f in files:
            try:
                f.unlink()
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as e:
                print(f"warning: cannot remove {f}: {e}")
        print(f"{kind}: removed {removed} files ({_size(total)}) from {directory}")
    return 0
