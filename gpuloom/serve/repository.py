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

Paths (weights, ``file.py`` sources) are relative to the YAML file. Weights are never unpickled as
objects: safetensors, or ``torch.load(weights_only=True)`` which refuses anything but tensors and plain
containers. Parsing is pure (no torch); :meth:`ModelEntry.build` imports torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from ..engine.options import is_channels_last, is_fuse_convolutions

__all__ = ["RepositoryError", "TensorEntry", "ModelEntry", "Repository", "load_repository"]

_TENSOR_KEYS = {"name", "shape", "dtype"}  # of one entry in inputs / outputs
_ALLOWED_KEYS = {
    "name", "source", "kwargs", "weights", "inputs", "outputs", "max_batch", "slo_ms", "weight", "rate_hint", "seed",
    "channels_last", "fuse_convolutions",
}


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
    channels_last: bool | str = False  # gpuloom.compile's option: False, True or "auto"
    fuse_convolutions: bool | str = False  # gpuloom.compile's option: False, True or "channels_last"

    # -- building ---------------------------------------------------------------------------
    def build(self):
        """Instantiate the module (eval mode, CPU) with its weights; returns ``(ModelConfig, module)``."""
        import torch

        factory = _resolve_factory(self.source, self.origin)
        if self.seed is not None:
            torch.manual_seed(self.seed)
        try:
            module = factory(**self.kwargs)
        except Exception as e:  # the user's factory: say whose it was
            raise RepositoryError(f"model {self.name!r}: factory {self.source!r} failed: {type(e).__name__}: {e}") from e
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
        )
        return config, module

    def _infer_outputs(self, module) -> tuple[TensorEntry, ...]:
        """Run one zero sample to learn the outputs' names, per-sample shapes and dtypes."""
        import torch

        xs = [torch.zeros((1, *[max(d, 1) for d in t.shape]), dtype=getattr(torch, t.dtype)) for t in self.inputs]
        with torch.no_grad():
            out = module(*xs)
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
        raise RepositoryError(f"weights file {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:
        raise RepositoryError(
            f"weights {path}: not a plain state dict loadable with weights_only=True ({type(e).__name__}: {e}); "
            "save with torch.save(model.state_dict()) or as .safetensors"
        ) from e
    if not isinstance(state, dict):
        raise RepositoryError(f"weights {path}: expected a state dict (mapping name -> tensor), found {type(state).__name__}")
    return state


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
    if kind.endswith(".py"):
        path = Path(kind)
        if not path.is_absolute() and origin is not None:
            path = origin.parent / path
        if not path.is_file():
            raise RepositoryError(f"source {source!r}: file {path} does not exist")
        modname = f"gpuloom_repo_{abs(hash(str(path.resolve())))}"
        mod = sys.modules.get(modname)
        if mod is None:
            spec = importlib.util.spec_from_file_location(modname, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[modname] = mod
            spec.loader.exec_module(mod)
    else:
        try:
            mod = importlib.import_module(kind)
        except ImportError as e:
            raise RepositoryError(f"source {source!r}: cannot import module {kind!r}: {e}") from e
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise RepositoryError(f"source {source!r}: module {kind!r} has no callable {name!r}")
    return fn


# -- parsing ---------------------------------------------------------------------------------
def _tensors(raw: Any, where: str) -> tuple[TensorEntry, ...]:
    if not isinstance(raw, list) or not raw:
        raise RepositoryError(f"{where}: expected a non-empty list of {{name, shape, dtype}}, found {raw!r}")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise RepositoryError(f"{where}[{i}]: expected a mapping with a string 'name', found {t!r}")
        unknown = sorted(set(t) - _TENSOR_KEYS)
        if unknown:  # a typo ("shap") would otherwise leave the default and fail later as a torch error
            raise RepositoryError(f"{where}[{i}] {t['name']!r}: unknown keys {unknown}; allowed {sorted(_TENSOR_KEYS)}")
        shape = t.get("shape", [])
        if not isinstance(shape, list) or not all(isinstance(d, int) and (d > 0 or d == -1) for d in shape):
            raise RepositoryError(f"{where}[{i}] {t['name']!r}: shape must be a list of positive ints (or -1), found {shape!r}")
        dtype = str(t.get("dtype", "float32"))
        try:
            sized = np.dtype(dtype).name
        except TypeError:
            raise RepositoryError(f"{where}[{i}] {t['name']!r}: unknown dtype {dtype!r} (e.g. float32, int64)") from None
        if sized != dtype:  # "float" is numpy's float64, "half" float16: say the size
            raise RepositoryError(f"{where}[{i}] {t['name']!r}: dtype {dtype!r} is ambiguous; write "
                                  f"{sized!r} (or e.g. float32) explicitly")
        out.append(TensorEntry(t["name"], tuple(shape), dtype))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise RepositoryError(f"{where}: duplicate tensor names in {names}")
    return tuple(out)


def _number(m: dict, key: str, default: float, where: str, *, integer: bool = False) -> Any:
    v = m.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 or (integer and not isinstance(v, int)):
        kind = "a positive integer" if integer else "a positive number"
        raise RepositoryError(f"{where}: {key} must be {kind}, found {v!r}")
    return v


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
        weights = Path(weights)
        if not weights.is_absolute() and origin is not None:
            weights = origin.parent / weights
    seed = m.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise RepositoryError(f"{where}: seed must be a non-negative integer, found {seed!r}")
    channels_last = m.get("channels_last", False)
    if not is_channels_last(channels_last):
        raise RepositoryError(f"{where}: channels_last must be true, false or auto, found {channels_last!r}")
    fuse = m.get("fuse_convolutions", False)
    if not is_fuse_convolutions(fuse):
        raise RepositoryError(f"{where}: fuse_convolutions must be true, false or channels_last, found {fuse!r}")
    return ModelEntry(
        seed=seed,
        channels_last=channels_last,
        fuse_convolutions=fuse,
        name=name,
        source=source,
        inputs=_tensors(m.get("inputs"), f"{where}: inputs"),
        outputs=_tensors(m["outputs"], f"{where}: outputs") if m.get("outputs") is not None else None,
        max_batch=_number(m, "max_batch", 32, where, integer=True),
        slo_ms=float(_number(m, "slo_ms", 100.0, where)),
        weight=float(_number(m, "weight", 1.0, where)),
        rate_hint=float(_number(m, "rate_hint", 50.0, where)),
        weights=weights,
        kwargs=kwargs,
        origin=origin,
    )


@dataclass
class Repository:
    """Models by name, re-readable from disk (the repository API's load re-reads the files)."""

    path: Path
    models: dict[str, ModelEntry]

    def reload(self) -> "Repository":
        return load_repository(self.path)

    def names(self) -> list[str]:
        return sorted(self.models)


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise RepositoryError(f"model repository {path} does not exist (a directory or a YAML file)")
    files = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
    files += sorted(p / "config.yaml" for p in path.iterdir() if (p / "config.yaml").is_file())
    return files


def load_repository(path: str | Path) -> Repository:
    """Read a repository (YAML file or directory); RepositoryError naming the file on any mistake."""
    path = Path(path)
    models: dict[str, ModelEntry] = {}
    for f in _files(path):
        try:
            doc = yaml.safe_load(f.read_text())
        except yaml.YAMLError as e:
            raise RepositoryError(f"{f}: not valid YAML: {e}") from None
        if doc is None:
            continue
        items = doc["models"] if isinstance(doc, dict) and "models" in doc else [doc]
        if not isinstance(items, list):
            raise RepositoryError(f"{f}: 'models' must be a list")
        for m in items:
            e = parse_model(m, f)
            if e.name in models:
                raise RepositoryError(f"{f}: model {e.name!r} is defined twice (also in {models[e.name].origin})")
            models[e.name] = e
    return Repository(path=path, models=models)
