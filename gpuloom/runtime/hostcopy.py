"""Small host copies that keep the GIL.

Why: numpy releases the GIL around every array copy, however small. On a thread of the runtime
(the watcher copying a batch's outputs off its pinned buffers) each release lets another thread
take the interpreter, and getting it back waits for that thread to block or for its switch
interval (5 ms). On the H200 under load that made a 10-60 KB copy cost 0.12-0.22 ms per batch
(``host_out`` in run 15, ``docs/reports/runtime.md``). A ``memmove`` called through ``ctypes.PyDLL``
keeps the GIL for the few microseconds it takes. Copies above :data:`HOLD_GIL_MAX_BYTES` still go
through numpy, so a large copy never stalls the other threads.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np

HOLD_GIL_MAX_BYTES = 1 << 20  # 1 MiB: about 50-100 us of memmove

_memmove = None
try:
    _memmove = ctypes.PyDLL(ctypes.util.find_library("c") or "libc.so.6").memmove
    _memmove.argtypes, _memmove.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_void_p
except (OSError, AttributeError):  # no libc by that name: numpy copies (which release the GIL)
    _memmove = None


def copy_head(a: np.ndarray, n: int) -> np.ndarray:
    """A copy of ``a[:n]`` (``a`` C-contiguous), made without releasing the GIL when it is small."""
    head = a[:n]
    if _memmove is None or head.nbytes > HOLD_GIL_MAX_BYTES or not a.flags.c_contiguous:
        return head.copy()
    out = np.empty(head.shape, head.dtype)
    if out.nbytes:
        _memmove(out.__array_interface__["data"][0], a.__array_interface__["data"][0], out.nbytes)
    return out


__all__ = ["HOLD_GIL_MAX_BYTES", "copy_head"]
