"""Functionalized export graphs kept on disk, so that a model compiled before skips half its export.

Why: ``gpuloom.compile`` exports a model in two steps (``dag._export``): ``torch.export.export``
traces the user's code into the training IR, then ``run_decompositions({})`` re-traces that graph
into functional ATen (no op mutates its inputs). Under the symbolic batch size the second step is
the larger: mobilenet_v3_small 3.9 s of 8.2 on the H200's host, resnet50 3.2 of 4.4 (run 120;
3.7 of 5.4 s on the build VM), and a server's start is mostly its models' compiles.

The second step is a function of the first's graph alone, so its result is filed under a hash of
that graph: every node with its op, arguments and tensor metadata (shape, stride, dtype, device;
nested graphs too), the signature, the structure of the inputs and outputs (a tuple or a dict of
the same tensors), the batch range and the torch version. An edit of the model
that changes what it computes changes that graph, and misses. The first step always runs: it is
what reads the user's code. Only the decomposed graph is stored (torch's export schema, JSON, no
weights); a hit is rebuilt with the training IR's own parameters and constants, so the model's
current weights are the ones compiled, and nothing is unpickled.

Where: ``$GPULOOM_GRAPH_CACHE`` (``0``, ``off`` or ``none``: no cache; ``gpuloom serve --graph-cache``), else
``$XDG_CACHE_HOME/gpuloom/graphs``, else ``~/.cache/gpuloom/graphs``. A file that does not read
back is decomposed again and rewritten; a graph torch cannot serialize is never cached. The
directory is bounded (:data:`MAX_BYTES`): the least recently used graphs go first.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..cachedirs import is_off, user_cache_dir

if TYPE_CHECKING:  # torch is imported where a graph is handled: `gpuloom cache` lists files without it
    import torch

log = logging.getLogger(__name__)

#: bump when what is stored, or how it is keyed, changes
FORMAT = 1
#: the directory's bound: past it, a store removes the least recently used graphs (a hit counts as a
#: use). A graph is 0.1-5 MB (mobilenet_v3_small 0.5 MB), and every edit of a model adds one.
MAX_BYTES = 512 * 2**20
SUFFIX = ".json"  # a graph's file: <key>.json (gpuloom cache lists and purges these too)


def cache_dir(setting: str | None = None) -> Path | None:
    """Where decomposed graphs are kept, or None when the cache is off. ``setting`` (a directory, or
    ``0``/``off``/``none``; ``gpuloom cache --graph-cache``) or else ``$GPULOOM_GRAPH_CACHE`` decides."""
    env = setting if setting is not None else os.environ.get("GPULOOM_GRAPH_CACHE")
    if is_off(env):
        return None
    if env:
        return Path(env)
    return user_cache_dir("graphs")


def graph_key(ep: torch.export.ExportedProgram) -> str:
    """32 hex digits over everything ``ep.run_decompositions({})`` reads of ``ep``."""
    import torch

    code = ep.graph_module.print_readable(print_output=False, include_stride=True, include_device=True)
    # the inputs' and outputs' structure (a tuple or a dict of the same tensors) is not in the graph
    calls = [(e.fqn, str(e.signature.in_spec), str(e.signature.out_spec)) if e.signature else (e.fqn,)
             for e in ep.module_call_graph]
    what = "\n".join((f"gpuloom graph cache {FORMAT}", f"torch {torch.__version__}", code, str(calls),
                      str(ep.graph_signature), str(sorted((str(k), str(v)) for k, v in ep.range_constraints.items())),
                      str(sorted(ep.state_dict)), str(sorted(ep.constants))))
    return hashlib.sha256(what.encode()).hexdigest()[:32]


class Stats:
    """Process-wide counts, for logs and tests."""

    hits = 0
    misses = 0
    stored = 0


def decompose(ep: torch.export.ExportedProgram) -> tuple[torch.export.ExportedProgram, bool]:
    """``ep.run_decompositions({})``, taken from the cache where this very graph was decomposed before;
    and whether it was."""
    directory = cache_dir()
    if directory is None:
        return ep.run_decompositions({}), False
    key = graph_key(ep)
    path = directory / f"{key}{SUFFIX}"
    hit = _load(path, ep)
    if hit is not None:
        Stats.hits += 1
        try:
            os.utime(path)  # recently used: the last to be evicted
        except OSError:
            pass
        log.debug("decomposed graph from the cache (%s)", path)
        return hit, True
    Stats.misses += 1
    out = ep.run_decompositions({})
    _store(path, out, ep)
    return out, False


def _load(path: Path, ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    _quiet_serde()
    try:
        from torch._export.serde.serialize import SerializedArtifact, deserialize

        # the weights and constants are the training IR's own (dicts: torch.load is never called)
        return deserialize(SerializedArtifact(data, dict(ep.state_dict), dict(ep.constants), None))
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file: decompose again, overwrite it
        log.warning("graph cache: %s does not read back (%s: %s); decomposing again", path, type(e).__name__, e)
        return None


def _unused_symbol_warning(record: logging.LogRecord) -> bool:
    return "did not appear in the graph that was deserialized" not in record.getMessage()


def _quiet_serde() -> None:
    """torch's deserializer warns once per size symbol that export's guards made and the graph does
    not use (tens per model, at every hit): drop those lines, keep the rest of its log."""
    serde_log = logging.getLogger("torch._export.serde.serialize")
    if _unused_symbol_warning not in serde_log.filters:
        serde_log.addFilter(_unused_symbol_warning)


def _store(path: Path, out: torch.export.ExportedProgram, ep: torch.export.ExportedProgram) -> None:
    # a hit is rebuilt from ep's parameters and constants: only a graph that names no others is kept
    if set(out.state_dict) != set(ep.state_dict) or set(out.constants) != set(ep.constants):
        log.debug("graph cache: the decomposition added parameters or constants; not cached")
        return
    try:
        from torch._export.serde.serialize import serialize

        try:
            artifact = serialize(out, serialize_state_dict=False, serialize_constants=False,
                                 serialize_example_inputs=False)
        except TypeError:  # a torch without these options: the weights are serialized, and not written
            artifact = serialize(out)
        data = artifact.exported_program
    except Exception as e:  # noqa: BLE001 - e.g. a custom op without a schema torch can write
        log.debug("graph cache: torch cannot serialize this graph (%s: %s); not cached", type(e).__name__, e)
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        Stats.stored += 1
        _evict(path.parent, keep=path)
    except OSError as e:  # e.g. a read-only home: compile on, decompose again next time
        log.warning("graph cache: cannot write %s (%s); set GPULOOM_GRAPH_CACHE to a writable directory, "
                    "or 0 to turn the cache off", path, e)


def _evict(directory: Path, *, keep: Path, max_bytes: int | None = None) -> None:
    """Remove the least recently used graphs until the directory holds at most ``max_bytes``
    (default :data:`MAX_BYTES`); never ``keep``, the one just written."""
    limit = MAX_BYTES if max_bytes is None else max_bytes
    files = []
    for p in directory.glob("*" + SUFFIX):
        try:
            st = p.stat()
        except OSError:  # removed meanwhile by another process
            continue
        files.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in files)
    for _, size, p in sorted(files, key=lambda f: f[0]):
        if total <= limit:
            break
        if p == keep:
            continue
        try:
            p.unlink()
            total -= size
        except OSError:
            pass
