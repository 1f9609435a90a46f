"""The launch fast path (``numba_flash.launch``) and the output memory pool (``_arrays``).

After the first launch of a kernel with given argument types, ``launch`` skips Numba's
per-call typing and calls the driver itself, with the compiled kernel Numba chose for
those types. That is only right if our layout rule ('C', 'F', 'A') is Numba's: checked
here against Numba's own contiguity flags on small shape/stride patterns. On a GPU,
the fast path is checked against the expected result on C, F, strided and broadcast
arrays, and the pool is checked to hand memory back.
"""
import gc
import importlib.util
import itertools
import os
import warnings

import numpy as np
import pytest
from hypothesis import given, strategies as st
from numba import cuda

import numba_flash
from numba_flash import _arrays
from numba_flash.launch import _fast, _layout, launch

from conftest import ON_GPU

GPU_ONLY = pytest.mark.skipif(not ON_GPU, reason="the fast path and the pool exist on a GPU only")


def _dummyarray():
    """numba-cuda's dummyarray module, loaded from its file (the simulator stubs it out)."""
    import numba_cuda
    path = os.path.join(os.path.dirname(numba_cuda.__file__), "numba", "cuda", "cudadrv", "dummyarray.py")
    spec = importlib.util.spec_from_file_location("_numba_cuda_dummyarray", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DUMMYARRAY = _dummyarray()


def numba_layout(shape, strides, itemsize):
    """DeviceNDArray._numba_type_'s layout, from Numba's dummy array flags."""
    flags = DUMMYARRAY.Array.from_desc(0, shape, strides, itemsize).flags
    broadcast = 0 in strides and int(np.prod(shape)) != 0
    if flags["C_CONTIGUOUS"] and not broadcast:
        return "C"
    if flags["F_CONTIGUOUS"] and not broadcast:
        return "F"
    return "A"


@given(st.integers(1, 4).flatmap(lambda nd: st.tuples(
    st.lists(st.integers(0, 3), min_size=nd, max_size=nd),
    st.lists(st.integers(-2, 30), min_size=nd, max_size=nd))),
    st.sampled_from([2, 4, 8]))
def test_layout_rule_is_numbas(shape_mult, itemsize):
    shape, mult = (tuple(x) for x in shape_mult)
    strides = tuple(m * itemsize for m in mult)
    assert _layout(shape, strides, itemsize) == numba_layout(shape, strides, itemsize)


@pytest.mark.parametrize("shape", [(3, 5), (1, 7), (4, 1), (0, 3), (2, 3, 4, 5)])
@pytest.mark.parametrize("order", "CF")
def test_layout_rule_on_numpy_orders(shape, order):
    a = np.empty(shape, np.float32, order=order)
    assert _layout(a.shape, a.strides, 4) == numba_layout(a.shape, a.strides, 4)


if ON_GPU:
    @cuda.jit
    def _affine(x, out, s):
        i, j = cuda.grid(2)
        if i < out.shape[0] and j < out.shape[1]:
            out[i, j] = x[i, j] * s + i - 2 * j


    @cuda.jit
    def _smem_roundtrip(x, out):
        """Stages x through dynamic shared memory (all of it that the launch gives)."""
        buf = cuda.shared.array(0, np.float32)
        i = cuda.threadIdx.x
        n = x.shape[0]
        for j in range(i, n, cuda.blockDim.x):
            buf[j] = x[j]
        cuda.syncthreads()
        for j in range(i, n, cuda.blockDim.x):
            out[j] = 2 * buf[n - 1 - j]


def _variants(rng):
    """(7, 5) float32 device arrays, as (host copy, device array): C, F, strided, broadcast."""
    base = rng.standard_normal((14, 10)).astype(np.float32)
    yield base[:7, :5], cuda.to_device(np.ascontiguousarray(base[:7, :5]))
    yield base[:7, :5], cuda.to_device(np.asfortranarray(base[:7, :5]))
    yield base[::2, 1::2], cuda.to_device(base)[::2, 1::2]
    row = cuda.to_device(base[0, :5].copy())
    yield np.broadcast_to(base[0, :5], (7, 5)), _arrays.strided_view(row, (7, 5), (0, 4))


@GPU_ONLY
def test_fast_launch_matches_expected_on_every_layout():
    rng = np.random.default_rng()
    for (host, x), number in itertools.product(_variants(rng), (np.float32, float)):   # float: float64
        for _ in range(3):      # the first launch goes through Numba, the next ones to the driver
            s = number(rng.uniform(0.5, 2))
            out = cuda.to_device(np.full((7, 5), np.nan, np.float32))
            launch(_affine, (1, 1), (8, 8), 0, (x, out, s))
            want = host * s + np.arange(7)[:, None] - 2 * np.arange(5)[None, :]
            np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-6, atol=1e-5)
    layouts = {key[2][0][2] for key in _fast if key[0] is _affine}
    assert layouts == {"C", "F", "A"}, f"fast-path entries for layouts {layouts}"
    assert {key[2][2] for key in _fast if key[0] is _affine} == {np.float32, float}


@GPU_ONLY
def test_pool_hands_memory_back():
    rng = np.random.default_rng()
    q, k, v = (cuda.to_device(rng.standard_normal((2, 3, 256, 64)).astype(np.float32)) for _ in range(3))
    first, _ = numba_flash.attention_fwd(q, k, v)
    expected = first.copy_to_host()
    del first
    gc.collect()
    cuda.synchronize()
    used0, _, _ = _arrays.pool_usage()
    outs = [numba_flash.attention_fwd(q, k, v) for _ in range(5)]
    cuda.synchronize()
    used1, peak, reserved = _arrays.pool_usage()
    out_bytes = 2 * 3 * 256 * 64 * 4
    assert used1 - used0 >= 5 * out_bytes and peak >= used1 and reserved >= used1
    del outs
    gc.collect()
    cuda.synchronize()
    assert _arrays.pool_usage()[0] <= used0         # freed on garbage collection
    again, _ = numba_flash.attention_fwd(q, k, v)   # reuses freed blocks
    np.testing.assert_array_equal(again.copy_to_host(), expected)
    big = _arrays.device_empty((64, 1024, 1024), np.float32)     # 256 MiB: blocks of its own
    cuda.synchronize()
    reserved = _arrays.pool_usage()[2]
    del big
    gc.collect()
    numba_flash.release_cached_memory()     # (blocks shared with live arrays stay reserved)
    assert _arrays.pool_usage()[2] <= reserved - 256 * 2**20


@GPU_ONLY
def test_fast_launch_grows_shared_memory():
    """A kernel first launched with little dynamic shared memory, then (same argument
    types, so the fast path) with more than the 48 KiB default: the opt-in still happens."""
    rng = np.random.default_rng()
    for n in (256, 4096, 24 * 1024, 8 * 1024, 40 * 1024):
        x = cuda.to_device(rng.standard_normal(n).astype(np.float32))
        out = cuda.to_device(np.full(n, np.nan, np.float32))
        launch(_smem_roundtrip, 1, 256, 4 * n, (x, out))
        np.testing.assert_array_equal(out.copy_to_host(), 2 * x.copy_to_host()[::-1])


@GPU_ONLY
def test_no_numba_performance_warnings():
    """A small problem has a small grid: Numba's low-occupancy warning is about the
    package's own choice, so its launches keep it from users (first launches included)."""
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((1, 5, 7)) for _ in range(3))      # a head dim no other test uses
    from numba.cuda.core.errors import NumbaPerformanceWarning
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumbaPerformanceWarning)
        out, lse = numba_flash.attention_fwd(q, k, v)
        numba_flash.attention_bwd(np.ones_like(out), q, k, v, out, lse)
