"""The model repository: which models to serve, where their code and weights come from, and their specs.

A repository is one YAML file or a directory of them (``*.yaml``/``*.yml`` directly inside it, and
``<name>/config.yaml`` in sub-directories). A file holds one model (a mapping) or ``models:`` (a list)::

    models:
      - name: tiny_mlp
        source: nets.py:tiny_mlp        # torchvision:NAME | timm:NAME | package.module:factory | file.py:factory
        kwargs: {features: 16}           # passed to the factory (optional)
        weights: tiny_mlp.safetensors    # .safetensors, or a state dict (.pt/.pth) read with weights_only=True
        inputs:  [{name: x, shape: [16], dtype: float32}]     # per sample: no batch dimension
        outputs: [{name: y, shape: [4], dtype: float32}]      # optional: found by running one zero sample
        max_batch: 32
        slo_ms: 100          # latency objective, ms (also the default request deadline)
        weight: 1.0          # share of the GPU under oversubscription (fairness weight)
        rate_hint: 50        # expected requests/s before the runtime has measured any
        seed: 0              # optional: torch.manual_seed before building (reproducible random init)
        channels_last: false # optional: true runs the convolutions NHWC, auto times both layouts (GPU)
        fuse_convolutions: false  # optional: true, or channels_last (the NHWC graph only): convolution
                                  # + bias + ReLU as one cuDNN call (GPU)
        split_gemms: false        # optional: true splits float32 GEMMs' reduction where timed faster (GPU)
        fuse_epilogues: true      # optional (default true): a convolution's bias (+ add) + SiLU / sigmoid /
                                  # ReLU6 as one kernel, a squeeze-excitation gate as two (GPU; false: eager's)

Paths (weights, ``file.py`` sources) are relative to the YAML file. Weights are never unpickled as
objects: safetensors, or ``torch.load(weights_only=True)`` which refuses anything but tensors and plain
containers. Parsing is pure (no torch); :meth:`ModelEntry.build` imports torch.

A ``file.py`` source is executed afresh by every :meth:`ModelEntry.build` (a load re-reads the model
from disk, as Triton's does), so its module-level state belongs to that one build; while it runs, its
own directory is first on ``sys.path``, so that it can import a module beside it (imported once per
process, as any import). The user's code run here (the file, the module imported, the factory, the
sample run that finds the outputs) cannot stop the server: an exception, or a ``SystemExit``
(``sys.exit``, argparse at import time), is a :class:`RepositoryError`; ``KeyboardInterrupt`` passes.
Parsing is per model: :func:`scan_repository` keeps the valid models and says why each other one cannot
be used (:attr:`Repository.errors`); :func:`load_repository` is the strict form, an error for any mistake.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import yaml

from ..engine.options import ENGINE_CHOICES, ENGINE_DEFAULTS, ENGINE_KEYS, is_engine_value
from ..runtime.model_config import DTYPES, MAX_BATCH, MAX_SLO_MS
from .protocol import V2_TO_NUMPY

__all__ = ["RepositoryError", "TensorEntry", "ModelEntry", "Repository", "load_repository", "scan_repository"]

_TENSOR_KEYS = {"name", "shape", "dtype"}  # of one entry in inputs / outputs
_ALLOWED_KEYS = {
    "name", "source", "kwargs", "weights", "inputs", "outputs", "max_batch", "slo_ms", "weight", "rate_hint", "seed",
    *ENGINE_KEYS,
}
MAX_RATE_HINT = 1e9  # requests/s: one a nanosecond; 1e308 overflowed the planner's requests per period to inf
MAX_SEED = 2**64 - 1  # torch.manual_seed's largest (2**64: "Overflow when unpacking long long" at load)


class RepositoryError(ValueError):
    """A repository file or model that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # per sample, no batch dimension; -1 = any size
    dtype: str  # numpy name: "float32", "int64", ...

    def spec(self):
        from ..runtime.service import TensorSpec

        return TensorSpec(name=self.name, shape=self.shape, dtype=self.dtype)


@dataclass(frozen=True)
class ModelEntry:
    """One model of the repository, as written (paths resolved)."""

    name: str
    source: str
    inputs: tuple[TensorEntry, ...]
    outputs: tuple[TensorEntry, ...] | None  # None: found by running the model once
    max_batch: int = 32
    slo_ms: float = 100.0  # ms
    weight: float = 1.0
    rate_hint: float = 50.0  # requests/s
    weights: Path | None = None
    kwargs: dict = field(default_factory=dict, hash=False, compare=False)
    origin: Path | None = None  # the YAML file it came from
    seed: int | None = None  # torch.manual_seed before the factory runs (random-init models reproducible)
    channels_last: bool | str = ENGINE_DEFAULTS["channels_last"]  # gpuloom.compile's option: False, True or "auto"
    # gpuloom.compile's option: False, True or "channels_last"
    fuse_convolutions: bool | str = ENGINE_DEFAULTS["fuse_convolutions"]
    # gpuloom.compile's option: float32 GEMMs split where timed faster (GPU)
    split_gemms: bool = ENGINE_DEFAULTS["split_gemms"]
    # gpuloom.compile's fuse_epilogues and fuse_gates: gpuloom's own kernels (GPU)
    fuse_epilogues: bool = ENGINE_DEFAULTS["fuse_epilogues"]

    # -- building ---------------------------------------------------------------------------
    def build(self):
        """Instantiate the module (eval mode, CPU) with its weights; returns ``(ModelConfig, module)``."""
        import torch

        factory = _resolve_factory(self.source, self.origin)
        if self.seed is not None:
            torch.manual_seed(self.seed)
        try:
            module = factory(**self.kwargs)
        except (Exception, SystemExit) as e:  # the user's factory: say whose it was (sys.exit must not end the server)
            raise RepositoryError(f"model {self.name!r}: factory {self.source!r} failed: {_failure(e)}") from e
        if not isinstance(module, torch.nn.Module):
            raise RepositoryError(f"model {self.name!r}: {self.source!r} returned {type(module).__name__}, expected a torch.nn.Module")
        if self.weights is not None:
            state = load_weights(self.weights)
            try:
                module.load_state_dict(state, strict=True)
            except RuntimeError as e:
                raise RepositoryError(f"model {self.name!r}: weights {self.weights} do not match the module: {e}") from e
        module.eval()
        outputs = self.outputs if self.outputs is not None else self._infer_outputs(module)
        from ..runtime.service import ModelConfig

        config = ModelConfig(
            name=self.name,
            inputs=tuple(t.spec() for t in self.inputs),
            outputs=tuple(t.spec() for t in outputs),
            max_batch=self.max_batch,
            slo_ms=self.slo_ms,
            weight=self.weight,
            rate_hint=self.rate_hint,
            channels_last=self.channels_last,
            fuse_convolutions=self.fuse_convolutions,
            split_gemms=self.split_gemms,
            fuse_epilogues=self.fuse_epilogues,
        )
        return config, module

    def source_file(self) -> Path | None:
        """The ``file.py`` of a ``file.py:factory`` source (relative to the YAML), else None."""
        return _source_file(self.source, self.origin)

    def raised_at(self, exc: BaseException) -> str | None:
        """``file:line`` in this model's ``file.py`` source where ``exc`` (or the exception it was
        raised from) was raised, innermost first; None when it did not pass through that file. What a
        failed load's one log line names, so that the user's mistake is found without a traceback."""
        src = self.source_file()
        if src is None:
            return None
        src = src.resolve()
        chain: list[BaseException] = []
        while exc is not None and all(exc is not c for c in chain):
            chain.append(exc)
            exc = exc.__cause__ or exc.__context__
        for e in reversed(chain):  # the innermost exception is where the mistake is
            for frame, line in reversed(list(traceback.walk_tb(e.__traceback__))):
                name = frame.f_code.co_filename
                if Path(name).name == src.name and Path(name).resolve() == src:
                    return f"{name}:{line}"
        return None

    def _infer_outputs(self, module) -> tuple[TensorEntry, ...]:
        """Run one zero sample to learn the outputs' names, per-sample shapes and dtypes."""
        import torch

        xs = [torch.zeros((1, *[max(d, 1) for d in t.shape]), dtype=getattr(torch, t.dtype)) for t in self.inputs]
        try:
            with torch.no_grad():
                out = module(*xs)
        except (Exception, SystemExit) as e:  # the user's forward
            shapes = ", ".join(f"{t.name} {list(t.shape)} {t.dtype}" for t in self.inputs)
            raise RepositoryError(f"model {self.name!r}: running one zero sample of its inputs ({shapes}, without the "
                                  f"batch) to find its outputs (the YAML lists none) failed: {_failure(e)}") from e
        named = output_dict(out)
        return tuple(
            TensorEntry(name=n, shape=tuple(v.shape[1:]), dtype=str(v.dtype).removeprefix("torch.")) for n, v in named.items()
        )


def output_dict(out: Any, names: list[str] | None = None) -> dict:
    """A module's return value -> ``{name: tensor}``: a tensor is ``output0``, a tuple ``output0..k``, a dict its keys."""
    if isinstance(out, dict):
        return dict(out)
    if isinstance(out, (tuple, list)):
        keys = names or [f"output{i}" for i in range(len(out))]
        return dict(zip(keys, out))
    return {(names[0] if names else "output0"): out}


def load_weights(path: Path) -> dict:
    """A state dict from ``.safetensors`` or a ``torch.save``d state dict, never unpickling objects."""
    import torch

    if not path.is_file():
        raise RepositoryError(f"weights file {path} " + ("is a directory, not a file" if path.is_dir() else "does not exist"))
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except Exception as e:  # safetensors' own error names neither the file nor what to do
            raise RepositoryError(f"weights {path}: not a readable .safetensors file ({type(e).__name__}: {e})") from e
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:
        raise _refused(path, e) from e
    if not isinstance(state, dict):
        raise RepositoryError(f"weights {path}: expected a state dict (mapping name -> tensor), found {type(state).__name__}")
    for key in ("state_dict", "model_state_dict", "model"):  # a training checkpoint: the weights and more
        if isinstance(state.get(key), dict):
            raise RepositoryError(f"weights {path}: a training checkpoint (keys {sorted(map(str, state))[:6]}), not a "
                                  f"state dict: save its weights alone, torch.save(checkpoint[{key!r}], PATH)")
    keys = [k for k in state if not isinstance(k, str)]
    if keys:  # load_state_dict's own error: "'int' object has no attribute 'startswith'"
        raise RepositoryError(f"weights {path}: a state dict's keys must be parameter names (strings), found "
                              f"{keys[0]!r} ({type(keys[0]).__name__})")
    return state


def _refused(path: Path, e: Exception) -> RepositoryError:
    """One line for what ``torch.load(weights_only=True)`` refused. Never torch's own text, which
    advises re-running with ``weights_only=False``: that runs the pickle, which gpuloom never does."""
    named = re.search(r"GLOBAL\s+([\w.]+)", str(e))
    if named:  # a class or function to import and call: an object, not a tensor
        return RepositoryError(
            f"weights {path}: the file holds Python objects beyond tensors (it names {named.group(1)}), which "
            "gpuloom does not load (it never runs a pickle; torch.load(weights_only=True) refused it): save a "
            "state dict of tensors (torch.save(model.state_dict())) or a .safetensors file")
    reason = str(e).strip()
    if reason.startswith("Weights only load failed"):  # torch's advice, then its reason: "Unsupported operand 149"
        reason = reason.partition("WeightsUnpickler error:")[2].strip().split("\n\n")[0]
    reason = " ".join(reason.split())
    return RepositoryError(
        f"weights {path}: not a state dict that torch.load(weights_only=True) can read ({type(e).__name__}"
        f"{': ' + reason[:300] if reason else ''}); save a state dict of tensors (torch.save(model.state_dict())) "
        "or a .safetensors file")


def _failure(e: BaseException) -> str:
    """The user's code's failure, for one line: ``Type: message``, or the ``sys.exit`` it called (a
    ``SystemExit`` taken for what it says would end the server, for one model's mistake)."""
    if isinstance(e, SystemExit):
        code = "" if e.code is None else repr(e.code)
        return (f"it called sys.exit({code}) (SystemExit; argparse does so on a bad command line): a model's code "
                "must raise an exception instead, the server does not exit for it")
    return f"{type(e).__name__}: {e}"


def _resolve_factory(source: str, origin: Path | None):
    kind, sep, name = source.partition(":")
    if not sep or not name:
        raise RepositoryError(f"source {source!r}: expected torchvision:NAME, timm:NAME, module:factory or file.py:factory")
    if kind == "torchvision":
        import torchvision

        def tv(**kw):
            return torchvision.models.get_model(name, weights=None, **kw)

        return tv
    if kind == "timm":
        try:
            import timm
        except ImportError as e:
            raise RepositoryError(f"source {source!r} needs the timm package (pip install timm)") from e

        def tm(**kw):
            return timm.create_model(name, pretrained=False, **kw)

        return tm
    path = _source_file(source, origin)
    if path is not None:
        if not path.is_file():
            raise RepositoryError(f"source {source!r}: file {path} does not exist")
        mod = _exec_file(path, source)
    else:
        try:
            mod = importlib.import_module(kind)
        except ImportError as e:
            raise RepositoryError(f"source {source!r}: cannot import module {kind!r}: {e}") from e
        except (Exception, SystemExit) as e:  # its top-level code failed, or called sys.exit
            raise RepositoryError(f"source {source!r}: importing module {kind!r} failed: {_failure(e)}") from e
    fn = mod
    for part in name.split("."):  # a dotted name reaches a class's factory: transformers:AutoModel.from_pretrained
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise RepositoryError(f"source {source!r}: module {kind!r} has no callable {name!r}")
    return fn


def _source_file(source: str, origin: Path | None) -> Path | None:
    kind = source.partition(":")[0]
    if not kind.endswith(".py"):
        return None
    path = Path(kind)
    return origin.parent / path if not path.is_absolute() and origin is not None else path


def _exec_file(path: Path, source: str):
    """A new module object running ``path`` as it is on disk now, at every call.

    A load must serve the file as edited (Triton re-reads a model at load), and re-executing each
    time is the simplest rule that is always right: no stale copy by mtime granularity, and two
    models naming one file never share module-level state (each build has its own, as each Triton
    model has its own ``model.py`` instance). The source is compiled here rather than by the import
    system, whose ``__pycache__`` is trusted when the mtime (in whole seconds) and size match: an
    edit of the same length within the second would run the old code. The module is registered in
    ``sys.modules`` under a name fixed per path (dataclasses, typing and pickle look a class's module
    up by name); a model built before keeps its own module through its functions' globals.

    While it runs, the file's directory is first on ``sys.path``, as for ``python file.py``: its
    ``from helper import block`` finds ``helper.py`` beside it whatever the server's working
    directory. Such a module is imported as any is, once per process (``sys.modules`` keeps it): a
    reload runs the file again, not the modules it imports."""
    modname = f"gpuloom_repo_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    previous = sys.modules.get(modname)
    sys.modules[modname] = mod
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        exec(compile(path.read_bytes(), str(path), "exec"), mod.__dict__)
    except BaseException as e:  # the user's file: say whose it was (the log names the line: ModelEntry.raised_at)
        if previous is None:
            sys.modules.pop(modname, None)
        else:
            sys.modules[modname] = previous
        if not isinstance(e, (Exception, SystemExit)):  # KeyboardInterrupt: Ctrl-C still stops the process
            raise
        raise RepositoryError(f"source {source!r}: running {path} failed: {_failure(e)}") from e
    finally:
        try:
            sys.path.remove(folder)  # the first: ours (or the file's own copy of it, the same entry)
        except ValueError:
            pass  # the file took it out itself
    return mod


# -- parsing ---------------------------------------------------------------------------------
def _tensors(raw: Any, where: str) -> tuple[TensorEntry, ...]:
    if not isinstance(raw, list) or not raw:
        raise RepositoryError(f"{where}: expected a non-empty list of {{name, shape, dtype}}, found {raw!r}")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise RepositoryError(f"{where}[{i}]: expected a mapping with a non-empty string 'name', found {t!r}")
        unknown = sorted(set(t) - _TENSOR_KEYS)
        if unknown:  # a typo ("shap") would otherwise leave the default and fail later as a torch error
            raise RepositoryError(f"{where}[{i}] {t['name']!r}: unknown keys {unknown}; allowed {sorted(_TENSOR_KEYS)}")
        if "shape" not in t:  # (was taken as one number per sample, and failed at load as a torch error)
            raise RepositoryError(f"{where}[{i}] {t['name']!r}: 'shape' is required: the sizes of one sample, "
                                  f"without the batch dimension (e.g. [3, 224, 224]; [] for one number per sample)")
        shape = t["shape"]
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
            raise RepositoryError(f"{where}[{i}] {t['name']!r}: shape must be a list of positive ints per sample (no "
                                  f"batch dimension, no -1: each batch size is captured with fixed shapes), found {shape!r}")
        dtype = str(t.get("dtype", "float32"))
        triton = V2_TO_NUMPY.get(dtype.upper().removeprefix("TYPE_"))  # FP32, TYPE_FP32: as the server reports it
        if triton is not None:
            dtype = triton
        try:
            sized = np.dtype(dtype).name
        except TypeError:
            raise RepositoryError(f"{where}[{i}] {t['name']!r}: unknown dtype {dtype!r} (e.g. float32, int64)") from None
        if sized != dtype:  # "float" is numpy's float64, "half" float16: say the size
            raise RepositoryError(f"{where}[{i}] {t['name']!r}: dtype {dtype!r} is ambiguous; write "
                                  f"{sized!r} (or e.g. float32) explicitly")
        if sized not in DTYPES:  # numpy knows object, str, uint16, complex64 ...; the service does not
            raise RepositoryError(f"{where}[{i}] {t['name']!r}: dtype {dtype!r} is not served; one of {list(DTYPES)}")
        out.append(TensorEntry(t["name"], tuple(shape), dtype))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise RepositoryError(f"{where}: duplicate tensor names in {names}")
    return tuple(out)


def _number(m: dict, key: str, default: float, where: str, *, integer: bool = False,
            at_most: tuple[float, str] | None = None) -> Any:
    """``m[key]`` (``default`` where absent): a positive finite number (an integer with ``integer``), at
    most ``at_most``'s bound where given (its text follows the bound in the error: the unit, why)."""
    v = m.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf or (integer and not isinstance(v, int)):
        kind = "a positive integer" if integer else "a positive finite number"
        raise RepositoryError(f"{where}: {key} must be {kind}, found {v!r}{_quoted_number_hint(v)}")
    if at_most is not None and v > at_most[0]:
        raise RepositoryError(f"{where}: {key} must be at most {at_most[0]:.0f}{at_most[1]}, found {v!r}")
    return v


def _quoted_number_hint(v: Any) -> str:
    """Why a number came as a string, where it reads as one: YAML 1.1 (PyYAML) takes ``1.0e308`` and
    ``1e5`` for strings (its floats need a dot and a signed exponent), and ``"8"`` is quoted."""
    if not isinstance(v, str):
        return ""
    try:
        number = float(v)
    except ValueError:
        return ""
    if not math.isfinite(number):  # "inf", "nan": the message says finite
        return ""
    if "e" in v.lower():
        return " (YAML reads 1.0e308 as a string: write 1.0e+308)"
    return " (a string: write the number without quotes)"


def parse_model(m: Any, origin: Path | None) -> ModelEntry:
    where = f"{origin or '<repository>'}"
    if not isinstance(m, dict):
        raise RepositoryError(f"{where}: a model must be a mapping, found {type(m).__name__}")
    name = m.get("name")
    if not isinstance(name, str) or not name or "/" in name:
        raise RepositoryError(f"{where}: model needs a 'name' (a string without '/'), found {name!r}")
    where = f"{where}: model {name!r}"
    unknown = sorted(set(m) - _ALLOWED_KEYS)
    if unknown:
        raise RepositoryError(f"{where}: unknown keys {unknown}; allowed {sorted(_ALLOWED_KEYS)}")
    source = m.get("source")
    if not isinstance(source, str):
        raise RepositoryError(f"{where}: 'source' (torchvision:NAME, timm:NAME or module:factory) is required")
    kwargs = m.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RepositoryError(f"{where}: 'kwargs' must be a mapping")
    weights = m.get("weights")
    if weights is not None:
        if not isinstance(weights, str) or not weights:
            raise RepositoryError(f"{where}: 'weights' must be a file path (a string), found {weights!r}")
        weights = Path(weights)
        if not weights.is_absolute() and origin is not None:
            weights = origin.parent / weights
    seed = m.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise RepositoryError(f"{where}: seed must be an integer from 0 to 2**64 - 1 (torch.manual_seed's range), "
                              f"found {seed!r}")
    engine = {key: m.get(key, ENGINE_DEFAULTS[key]) for key in ENGINE_KEYS}
    for key, value in engine.items():
        if not is_engine_value(key, value):
            raise RepositoryError(f"{where}: {key} must be {ENGINE_CHOICES[key]}, found {value!r}")
    return ModelEntry(
        seed=seed,
        **engine,
        name=name,
        source=source,
        inputs=_tensors(m.get("inputs"), f"{where}: inputs"),
        outputs=_tensors(m["outputs"], f"{where}: outputs") if m.get("outputs") is not None else None,
        # each load compiles, captures and tables batches up to max_batch (1e8 took the CPU 28 s and 9.3 GB)
        max_batch=_number(m, "max_batch", 32, where, integer=True, at_most=(MAX_BATCH, " rows")),
        slo_ms=float(_number(m, "slo_ms", 100.0, where, at_most=(MAX_SLO_MS, " (an hour)"))),
        weight=float(_number(m, "weight", 1.0, where)),
        rate_hint=float(_number(m, "rate_hint", 50.0, where, at_most=(MAX_RATE_HINT, " requests/s"))),
        weights=weights,
        kwargs=kwargs,
        origin=origin,
    )


@dataclass
class Repository:
    """Models by name, re-readable from disk (the repository API's load re-reads the files).

    ``errors``: the name of each model whose entry cannot be used, and why (a YAML file that does not
    parse counts under its directory's name for ``<name>/config.yaml``, else under its stem). Such a
    model is unavailable, not in ``models``; the others stay usable (Triton marks a bad model
    UNAVAILABLE with its reason and loads the rest)."""

    path: Path
    models: dict[str, ModelEntry]
    errors: dict[str, str] = field(default_factory=dict)

    def reload(self) -> "Repository":
        """The repository as on disk now, leniently (:func:`scan_repository`): one bad entry must not
        stop another model's load."""
        return scan_repository(self.path)

    def names(self) -> list[str]:
        """The valid models."""
        return sorted(self.models)

    def require(self, names: Iterable[str] | None = None) -> list[str]:
        """``names`` (every model of the repository when None), each a valid model; else
        RepositoryError naming each one that is invalid (and why) or missing. What a server checks
        before it loads anything: at start a mistake in a model it was asked for stops it, while the
        repository API's load needs only the model it loads to be valid."""
        wanted = sorted(set(self.models) | set(self.errors)) if names is None else list(names)
        problems = [self.errors[n] for n in wanted if n in self.errors]
        missing = [n for n in wanted if n not in self.models and n not in self.errors]
        if missing:
            problems.append(f"models {missing} are not in the repository {self.path}, which has {self.names()}")
        if problems:
            raise RepositoryError("\n".join(problems))
        return wanted


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise RepositoryError(f"model repository {path} does not exist (a directory or a YAML file)")
    files = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
    files += sorted(p / "config.yaml" for p in path.iterdir() if (p / "config.yaml").is_file())
    return files


def scan_repository(path: str | Path) -> Repository:
    """Read a repository (YAML file or directory) model by model: each valid entry in ``models``,
    each mistake in ``errors`` under its model's name, naming the file and field. RepositoryError
    only when the repository itself does not exist."""
    path = Path(path)
    models: dict[str, ModelEntry] = {}
    errors: dict[str, str] = {}
    seen: dict[str, Path] = {}

    def fail(name: str, message: str) -> None:
        errors[name] = f"{errors[name]}; {message}" if name in errors else message

    for f in _files(path):
        fallback = f.parent.name if f.name == "config.yaml" and f.parent != path else f.stem
        try:
            doc = yaml.safe_load(f.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            fail(fallback, f"{f}: not valid YAML: {e}" if isinstance(e, yaml.YAMLError) else f"{f}: cannot be read: {e}")
            continue
        if doc is None:
            continue
        items = doc["models"] if isinstance(doc, dict) and "models" in doc else [doc]
        if not isinstance(items, list):
            fail(fallback, f"{f}: 'models' must be a list")
            continue
        for i, m in enumerate(items):
            name = m.get("name") if isinstance(m, dict) else None
            if not isinstance(name, str) or not name or "/" in name:
                name = fallback if len(items) == 1 else f"{fallback}[{i}]"
            if name in seen:  # neither copy is served: which one was meant is not known
                fail(name, f"{f}: model {name!r} is defined twice (also in {seen[name]})")
                continue
            seen[name] = f
            try:
                models[name] = parse_model(m, f)
            except RepositoryError as e:
                fail(name, str(e))
    for name in errors:
        models.pop(name, None)
    return Repository(path=path, models=models, errors=errors)


def load_repository(path: str | Path) -> Repository:
    """Read a repository (YAML file or directory); RepositoryError naming the file on any mistake in
    any model (:func:`scan_repository` reads the valid ones and lists the others)."""
    repo = scan_repository(path)
    if repo.errors:
        raise RepositoryError("\n".join(repo.errors[n] for n in sorted(repo.errors)))
    return repo
