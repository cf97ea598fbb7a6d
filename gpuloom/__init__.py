"""gpuloom: serve many deep-learning models on one GPU.

``gpuloom.compile`` is imported lazily so that the pure layers (plan, policy, simulator, profile
store) can be used without importing torch.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["compile", "__version__"]


def __getattr__(name: str):
    if name == "compile":
        from .engine.compiled import compile as _compile

        return _compile
    raise AttributeError(f"module 'gpuloom' has no attribute {name!r}")
