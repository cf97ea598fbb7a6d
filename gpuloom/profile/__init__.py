"""Latency profiles L(model, batch, SMs), knees, and the profile store.

The store and the knee arithmetic are plain Python; measuring (``profiler``) needs torch and a GPU
and is imported lazily by whoever measures.
"""

from .store import GpuInfo, Profile, ProfileError, ProfileStore, model_key

__all__ = ["GpuInfo", "Profile", "ProfileError", "ProfileStore", "model_key"]
