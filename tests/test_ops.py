"""numba_flash.ops: the TF32 tensor-core operations, compiled (on a GPU) or emulated.

Each test is a small kernel that builds its fragments from the layout drawn in
``ops.mma_tf32_m16n8k8``'s docstring, so in the simulator it checks that the emulation
implements that layout, and on a GPU that the hardware does.
"""
import numpy as np
import pytest

import numba_flash  # noqa: F401  (before numba: decides the simulator)
from numba import cuda
from numba_flash import ops
from numba_flash.launch import launch


def tf32_rna(x):
    """NumPy reference of cvt.rna.tf32.f32: nearest TF32, ties away from zero."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)


@cuda.jit
def _round_kernel(x, out):
    i = cuda.grid(1)
    if i < x.shape[0]:
        out[i] = ops.tf32_round(x[i])


def test_tf32_round():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(64).astype(np.float32) * 10
    ties = np.array([1 + 2**-11, -(1 + 2**-11), 1 + 3 * 2**-11, 2**-11], np.float32)   # exactly halfway
    x = np.concatenate([x, ties, np.array([0.0, -0.0, 1.0, 3.5], np.float32)])
    out = np.zeros_like(x)
    launch(_round_kernel, 1, 128, 0, (x, out))
    np.testing.assert_array_equal(out.view(np.uint32), tf32_rna(x).view(np.uint32))
    assert np.all(out.view(np.uint32) & 0x1FFF == 0)


@cuda.jit
def _mma_kernel(a, b, c, d):
    lane = cuda.threadIdx.x
    g, t = lane >> 2, lane & 3
    r0, r1, r2, r3 = ops.mma_tf32_m16n8k8(
        a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4],          # a0..a3
        b[t, g], b[t + 4, g],                                        # b0, b1
        c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
    d[g, 2 * t] = r0
    d[g, 2 * t + 1] = r1
    d[g + 8, 2 * t] = r2
    d[g + 8, 2 * t + 1] = r3


@pytest.mark.parametrize("seed", [0, 1])
def test_mma_tf32_m16n8k8_fragment_layout(seed):
    rng = np.random.default_rng(seed)
    a = tf32_rna(rng.standard_normal((16, 8)))        # distinct values everywhere: a wrong
    b = tf32_rna(rng.standard_normal((8, 8)))         # fragment index cannot go unnoticed
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = np.full((16, 8), np.nan, np.float32)
    launch(_mma_kernel, 1, 32, 0, (a, b, c, d))
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_allclose(d, want, rtol=0, atol=1e-5 * np.abs(want).max())
