"""runtime/hostcopy.py: the GIL-holding copy gives exactly numpy's copy. CPU only."""

from __future__ import annotations

import numpy as np
import pytest

from gpuloom.runtime import hostcopy


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64", "uint8"])
@pytest.mark.parametrize("n", [0, 1, 5, 8])
def test_copy_head_equals_the_first_rows_and_owns_its_memory(dtype, n):
    a = (np.random.default_rng(n).standard_normal((8, 3, 7)) * 50).astype(dtype)
    got = hostcopy.copy_head(a, n)
    np.testing.assert_array_equal(got, a[:n])
    assert got.dtype == a.dtype and got.shape == (n, 3, 7)
    if n:
        a[0] += 1  # the copy does not change with its source
        assert not np.array_equal(got[0], a[0])


def test_large_or_strided_sources_take_numpys_copy():
    big = np.ones((2, hostcopy.HOLD_GIL_MAX_BYTES // 4 + 1), np.float32)
    np.testing.assert_array_equal(hostcopy.copy_head(big, 2), big)
    strided = np.arange(40, dtype=np.float32).reshape(8, 5)[:, ::2]
    np.testing.assert_array_equal(hostcopy.copy_head(strided, 3), strided[:3])
