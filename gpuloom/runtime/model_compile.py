"""Compiling a model the way a service serves it: ``gpuloom.compile`` with the config's engine options on
the service's device, after one eager sample (a config that does not fit the model is the user's
error, said plainly, not an export failure deep inside torch); then the compiled model's inputs and
outputs checked against the config, and the outputs filled in where the config leaves them out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .device import DeviceLayer
from .host_device import FakeModel
from .model_config import ModelConfig, TensorSpec


def compile_model(config: ModelConfig, module: Any, device: DeviceLayer) -> tuple[Any, ModelConfig]:
    """``(runner, config)``: ``module`` (an ``nn.Module``, a ``CompiledModel`` compiled already, or a
    ``FakeModel``) ready to serve on ``device``, and ``config`` with its outputs found. Raises
    ValueError (the config does not fit the model) or TypeError (not a model)."""
    if isinstance(module, FakeModel):
        if not config.outputs:
            raise ValueError(f"model {config.name!r}: a FakeModel needs ModelConfig.outputs")
        return module, config
    import torch

    import gpuloom
    from ..engine.compiled import CompiledModel

    kind = device.kind
    dev = torch.device("cuda", getattr(device, "device", 0)) if kind == "cuda" else torch.device("cpu")
    examples = []
    for t in config.inputs:
        dt = getattr(torch, t.dtype)
        if dt.is_floating_point:
            examples.append(torch.randn((1, *t.shape), dtype=torch.float32).to(dt).to(dev))
        else:
            examples.append(torch.zeros((1, *t.shape), dtype=dt, device=dev))
    if isinstance(module, CompiledModel):  # compiled already (benchmarks share one across services)
        cm = module
        if cm.device.type != dev.type or cm.max_batch != config.max_batch:
            raise ValueError(f"model {config.name!r}: the CompiledModel is for {cm.device} with max_batch "
                             f"{cm.max_batch}; expected {dev} and max_batch {config.max_batch}")
        if config.channels_last != "auto" and cm.channels_last != config.channels_last:
            # the plan takes the model's profile by name, made in the layout its config names
            raise ValueError(f"model {config.name!r}: the CompiledModel runs channels_last={cm.channels_last!r} "
                             f"but ModelConfig.channels_last is {config.channels_last!r} (the layout its profile "
                             f"was made in); compile it with channels_last={config.channels_last!r} or set "
                             f"ModelConfig(channels_last=...) to match")
        if config.fuse_convolutions is False and cm.fused_convolutions:
            # likewise: gpuloom.compile fuses the channels-last candidate by default, the service not
            raise ValueError(f"model {config.name!r}: the CompiledModel runs {cm.fused_convolutions} fused "
                             f"convolutions but ModelConfig.fuse_convolutions is False (its profile was made "
                             f"unfused); compile it with fuse_convolutions=False or set "
                             f"ModelConfig(fuse_convolutions=...) to match")
        if config.split_gemms is False and cm.split_linears:
            # likewise: gpuloom.compile splits float32 GEMMs by default on CUDA, the service not
            raise ValueError(f"model {config.name!r}: the CompiledModel splits the GEMMs of {cm.split_linears} "
                             f"linear layers but ModelConfig.split_gemms is False (its profile was made without); "
                             f"compile it with split_gemms=False or set ModelConfig(split_gemms=True)")
        if config.fuse_epilogues is False and cm.fused_epilogues + cm.fused_gates:  # likewise: compile's defaults on CUDA
            raise ValueError(f"model {config.name!r}: the CompiledModel runs {cm.fused_epilogues} convolution "
                             f"epilogues and {cm.fused_gates} squeeze-excitation gates as gpuloom's own kernels "
                             f"but ModelConfig.fuse_epilogues is False (its profile was made without); compile "
                             f"it with fuse_epilogues=False, fuse_gates=False or set "
                             f"ModelConfig(fuse_epilogues=True)")
    elif isinstance(module, torch.nn.Module):
        check_input_order(config, module)
        check_child_names(config, module)
        module = module.eval().to(dev)
        try:  # one eager sample first: a config that does not fit the model is the user's to fix, and
            # torch.export would fail on it deep inside, with its own error log, as an internal error
            with torch.inference_mode():
                module(*examples)
        except Exception as e:  # noqa: BLE001 - any failure here is the model's on these inputs
            shapes = ", ".join(f"{t.name} {list(t.shape)} {t.dtype}" for t in config.inputs)
            raise ValueError(f"model {config.name!r} does not run on one sample of the inputs its config "
                             f"declares ({shapes}, without the batch): {type(e).__name__}: {e}") from e
        # split GEMMs off unless configured: the shipped profiles were timed with cuBLAS's own GEMMs
        # (and a split's choice is timed on a GPU other models may be using)
        cm = gpuloom.compile(module, tuple(examples), max_batch=config.max_batch, device=dev,
                             input_names=[t.name for t in config.inputs], **config.compile_options(dev.type))
    else:
        raise TypeError(f"load expects a torch.nn.Module, got {type(module).__name__}")
    want_in = [(t.shape, t.dtype) for t in config.inputs]
    got_in = [(tuple(s.shape), str(s.dtype).removeprefix("torch.")) for s in cm.specs]
    if want_in != got_in:
        raise ValueError(f"model {config.name!r}: ModelConfig.inputs say {want_in} but the model was compiled "
                         f"for {got_in}")
    with torch.inference_mode():
        out = cm(*examples)
    from ..engine.dag import flat_tensors

    flat = flat_tensors(out)
    found = tuple(TensorSpec(f"output{i}", tuple(int(d) for d in t.shape[1:]), str(t.dtype).removeprefix("torch."))
                  for i, t in enumerate(flat))
    if not config.outputs:
        config = dataclasses.replace(config, outputs=found)
    else:
        got = [(t.shape, t.dtype) for t in found]
        want = [(t.shape, t.dtype) for t in config.outputs]
        if got != want:
            raise ValueError(f"model {config.name!r}: ModelConfig.outputs say {want} (shape, dtype per sample) "
                             f"but the model returns {got}")
    return cm, config


def check_input_order(config: ModelConfig, module: Any) -> None:
    """ValueError where an input is named as one of ``forward``'s parameters but listed at another
    position. Inputs are passed to ``forward`` by position, in the order the config lists them: a
    repository that listed ``forward(self, a, b)``'s inputs as ``[b, a]`` served every request with
    them swapped, silently (a user's walkthrough, sixty-ninth session). Names that are not
    ``forward``'s (``image`` for ``x``) stay by position, as before."""
    import inspect

    try:
        params = [p.name for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):  # no signature to read (a C extension's forward): by position
        return
    names = [t.name for t in config.inputs]
    wrong = [f"{n!r} is input {i} but forward's argument {params.index(n)}" for i, n in enumerate(names)
             if n in params and params.index(n) != i]
    if wrong:
        raise ValueError(f"model {config.name!r}: inputs are passed to forward by position, in the order the "
                         f"config lists them ({names}), and forward takes ({', '.join(params)}): "
                         f"{'; '.join(wrong)}; list the inputs in forward's order")


#: attributes of torch.fx's GraphModule: a model's submodule (or parameter) of one of these names at its
#: top level breaks torch.export's graph ("references nonexistent attribute"; checked for each with
#: torch 2.14), which gpuloom.compile reported as an export failure hinting at control flow
_GRAPH_MODULE_NAMES = ("meta", "graph", "code", "recompile", "to_folder", "add_submodule", "delete_submodule",
                       "delete_all_unused_submodules", "print_readable")


def check_child_names(config: ModelConfig, module: Any) -> None:
    """ValueError naming a top-level submodule, parameter or buffer of ``module`` that torch.export
    cannot trace under its name (``self.meta = nn.Linear(...)``: a user's walkthrough, sixty-ninth
    session, got an internal error about data-dependent control flow)."""
    names = {n.split(".")[0] for n, _ in module.named_parameters()} | {n.split(".")[0] for n, _ in module.named_buffers()}
    names |= {n for n, _ in module.named_children()}
    clash = sorted(names & set(_GRAPH_MODULE_NAMES))
    if clash:
        raise ValueError(f"model {config.name!r}: its attribute{'s' if len(clash) > 1 else ''} {clash} share"
                         f"{'' if len(clash) > 1 else 's'} a name with torch.fx.GraphModule's, which torch.export "
                         f"cannot trace (its graph's attributes would clash); rename {'them' if len(clash) > 1 else 'it'} "
                         f"in the model (e.g. self.meta -> self.meta_head)")
