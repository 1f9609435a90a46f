"""numba_flash.ops: the TF32 and 16-bit tensor-core operations, compiled (on a GPU) or emulated.

Each test is a small one-warp kernel checked against a NumPy model of the PTX
instruction. The mma kernels build their fragments from the layouts drawn in
``ops.mma_tf32_m16n8k8``'s docstring and in the module docstring of ``ops`` (16-bit),
so in the simulator they check that the emulation implements those layouts, and on a
GPU that the hardware does. Inputs are distinct random values, so that a wrong index
cannot pass, and outputs are poisoned before each launch.
"""
import ml_dtypes
import numpy as np
import pytest

import numba_flash  # noqa: F401  (before numba: decides the simulator)
import numba
from numba import cuda
from numba_flash import ops
from numba_flash.launch import launch


def tf32_rna(x):
    """NumPy reference of cvt.rna.tf32.f32: nearest TF32, ties away from zero."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)


def _round_kernel(round_fn):
    @cuda.jit
    def kern(x, out):
        i = cuda.grid(1)
        if i < x.shape[0]:
            out[i] = round_fn(x[i])
    return kern


ROUND = {"tf32_round": _round_kernel(ops.tf32_round), "tf32_round_fast": _round_kernel(ops.tf32_round_fast)}
TIES = [1 + 2**-11, -(1 + 2**-11), 1 + 3 * 2**-11, 2**-11]       # exactly halfway
ROUND_EXTRA = {"tf32_round": [0.0, -0.0, 1.0, 3.5],
               "tf32_round_fast": [0.0, -0.0, 3e38, -1e-40]}   # finite values only: it keeps no inf/NaN


@pytest.mark.parametrize("name", ROUND)
def test_tf32_round_is_nearest_ties_away(name):
    """Both roundings against the NumPy model of cvt.rna.tf32.f32 (the fast one on finite values)."""
    rng = np.random.default_rng(len(name))
    x = np.concatenate([rng.standard_normal(64) * 10, TIES, ROUND_EXTRA[name]]).astype(np.float32)
    out = np.full_like(x, np.nan)
    launch(ROUND[name], 1, 128, 0, (x, out))
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


# --------------------------------------------------------------------------- 16-bit operations
POISON32 = 0xFFFFFFFF      # no register the tests expect: it would hold two 0xFFFF halves
DTYPES = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}


def bits16(x, kind):
    """NumPy model of cvt.rn: nearest-even ``kind`` bit patterns (uint16) of float32 values."""
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float32).astype(DTYPES[kind]).view(np.uint16)


def _pack_kernel(pack):
    @cuda.jit
    def kern(lo, hi, out):
        for i in range(cuda.threadIdx.x, lo.shape[0], 32):
            out[i] = pack(lo[i], hi[i])
    return kern


PACK = {"bf16": _pack_kernel(ops.pack_bf16x2), "f16": _pack_kernel(ops.pack_f16x2)}


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")   # the simulator, rounding to inf
@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_pack_x2(kind):
    special = np.array([
        1 + 2**-8, -(1 + 2**-8), 1 + 3 * 2**-8, 2**-20 * (1 + 2**-8),     # bf16 ties (7-bit mantissa)
        1 + 2**-11, -(1 + 2**-11), 1 + 3 * 2**-11, -(2**-25), 3 * 2**-25,  # f16 ties (10 bits; subnormal)
        65520.0, np.finfo(np.float32).max,                                 # ties / rounding to inf
        0.0, -0.0, np.inf, -np.inf, 1.0, -3.5], np.float32)
    rng = np.random.default_rng(0)
    lo = np.concatenate([special, (rng.standard_normal(47) * 100).astype(np.float32)])
    hi = rng.permutation(lo)
    out = np.full(lo.shape, POISON32, np.uint32)
    launch(PACK[kind], 1, 32, 0, (lo, hi, out))
    want = bits16(lo, kind).astype(np.uint32) | (bits16(hi, kind).astype(np.uint32) << 16)
    np.testing.assert_array_equal(out, want)


ROW = 24                   # shared row stride in elements (48 bytes): rows start 16-byte aligned


def _ldmatrix_kernel(load):
    @cuda.jit
    def kern(src, starts, out):
        sm = cuda.shared.array(0, numba.uint16)
        lane = cuda.threadIdx.x
        for i in range(lane, src.shape[0], 32):
            sm[i] = src[i]
        cuda.syncthreads()
        r0, r1, r2, r3 = load(sm, starts[lane])
        out[lane, 0] = r0
        out[lane, 1] = r1
        out[lane, 2] = r2
        out[lane, 3] = r3
    return kern


LDMATRIX = {False: _ldmatrix_kernel(ops.ldmatrix_x4), True: _ldmatrix_kernel(ops.ldmatrix_x4_trans)}


def ldmatrix_model(src, starts, trans):
    """NumPy model of ldmatrix.x4(.trans): lane 8i + r gives the start of row r of matrix i;
    register i of lane 4g + t holds M_i[g, 2t], M_i[g, 2t+1] (.trans: M_i[2t, g], M_i[2t+1, g])."""
    m = src[starts.reshape(4, 8, 1) + np.arange(8)]          # m[i, r, c] = M_i[r, c]
    if trans:
        m = m.transpose(0, 2, 1)
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    lo, hi = m[:, g, 2 * t].T, m[:, g, 2 * t + 1].T          # (32 lanes, 4 registers)
    return lo.astype(np.uint32) | (hi.astype(np.uint32) << 16)


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_x4(trans):
    rng = np.random.default_rng(1)
    src = rng.permutation(0xFFFF)[:32 * ROW].astype(np.uint16)    # distinct, never 0xFFFF
    starts = (rng.permutation(32) * ROW + 8 * rng.integers(0, 3, 32)).astype(np.int32)
    out = np.full((32, 4), POISON32, np.uint32)
    launch(LDMATRIX[trans], 1, 32, src.nbytes, (src, starts, out))
    np.testing.assert_array_equal(out, ldmatrix_model(src, starts, trans))


@cuda.jit(device=True, inline="always")
def _pair(lo, hi):
    return numba.uint32(lo) | (numba.uint32(hi) << 16)


def _mma16_kernel(mma):
    @cuda.jit
    def kern(a, b, c, d):          # a (16, 16), b (16, 8): uint16 bit patterns; c, d float32
        lane = cuda.threadIdx.x
        g, t = lane >> 2, lane & 3
        r0, r1, r2, r3 = mma(
            _pair(a[g, 2 * t], a[g, 2 * t + 1]), _pair(a[g + 8, 2 * t], a[g + 8, 2 * t + 1]),
            _pair(a[g, 2 * t + 8], a[g, 2 * t + 9]), _pair(a[g + 8, 2 * t + 8], a[g + 8, 2 * t + 9]),
            _pair(b[2 * t, g], b[2 * t + 1, g]), _pair(b[2 * t + 8, g], b[2 * t + 9, g]),
            c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
        d[g, 2 * t] = r0
        d[g, 2 * t + 1] = r1
        d[g + 8, 2 * t] = r2
        d[g + 8, 2 * t + 1] = r3
    return kern


MMA16 = {"bf16": _mma16_kernel(ops.mma_bf16_m16n8k16), "f16": _mma16_kernel(ops.mma_f16_m16n8k16)}


def distinct16(rng, kind, n):
    """``n`` distinct random ``kind`` values with magnitudes in [1/16, 4)."""
    v = np.arange(2**16, dtype=np.uint16).view(DTYPES[kind])
    m = np.abs(v.astype(np.float32))
    return rng.choice(v[(m >= 1 / 16) & (m < 4)], n, replace=False)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_mma_m16n8k16_fragment_layout(kind, seed):
    rng = np.random.default_rng(seed)
    v = distinct16(rng, kind, 16 * 16 + 16 * 8)
    a, b = v[:256].reshape(16, 16), v[256:].reshape(16, 8)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = np.full((16, 8), np.nan, np.float32)
    launch(MMA16[kind], 1, 32, 0, (a.view(np.uint16), b.view(np.uint16), c, d))
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_allclose(d, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.skipif(numba_flash.SIMULATOR, reason="a property of the tensor core itself")
def test_mma_tf32_reads_only_the_tf32_bits():
    """ops.tf32_round_fast's split passes ``small = x - big`` with its low 13 bits set: the
    tensor core must read only the TF32 bits (what the simulator's twin models)."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((16, 8)).astype(np.float32)
    b = rng.standard_normal((8, 8)).astype(np.float32)
    c = np.zeros((16, 8), np.float32)
    clear = lambda x: (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)  # noqa: E731
    assert np.any(a != clear(a)) and np.any(b != clear(b))
    d_raw, d_clear = np.zeros_like(c), np.zeros_like(c)
    launch(_mma_kernel, 1, 32, 0, (a, b, c, d_raw))
    launch(_mma_kernel, 1, 32, 0, (clear(a), clear(b), c, d_clear))
    np.testing.assert_array_equal(d_raw, d_clear)


_SFU = {"tanh_approx": (_round_kernel(ops.tanh_approx), np.tanh, 2.0**-11),   # PTX ISA's bound
        "rcp_approx": (_round_kernel(ops.rcp_approx), np.reciprocal, 2.0**-23)}  # 1 ulp (float32)


def test_exp2_fma_within_its_bound():
    """``exp2_fma`` (2^x on the FMA units, for x <= 0): relative error within 3e-6 (its
    polynomial's 2.7e-6 in float32 arithmetic) down to 2^-125, 0 below and for -inf,
    NaN stays NaN (in the simulator: the twin, whose multiply-adds round twice)."""
    rng = np.random.default_rng()
    x = np.concatenate([-rng.uniform(0, 1, 2000), -rng.uniform(0, 126, 2000), -rng.uniform(0, 1e-6, 200),
                        [0.0, -0.0, -0.5, -1.5, -124.9, -125.1, -126.0, -200.0, -np.inf, np.nan]]).astype(np.float32)
    out = np.full_like(x, 7.0)
    launch(_round_kernel(ops.exp2_fma), -(-x.size // 128), 128, 0, (x, out))
    want = np.exp2(x.astype(np.float64))
    normal = x >= -125
    rel = np.abs(out[normal] / want[normal] - 1)
    assert rel.max() <= 3e-6, f"relative error {rel.max():.3e} at x = {x[normal][rel.argmax()]}"
    assert (out[(x < -125.1) | (x == -np.inf)] == 0).all() and np.isnan(out[-1])


@pytest.mark.parametrize("name", sorted(_SFU))
def test_special_function_ops_within_their_bounds(name):
    """``tanh_approx`` and ``rcp_approx`` (the softcap's tanh, ``scores.SOFTCAP_TANH``):
    relative error within the PTX manual's bound over a range that covers the tails, and
    exact signs. (The simulator twins are NumPy's float32 functions.)"""
    kern, ref, bound = _SFU[name]
    rng = np.random.default_rng()
    x = np.concatenate([rng.uniform(-12, 12, 4000), rng.uniform(-1e-3, 1e-3, 500),
                        [1e-30, -1e-30, 40.0, -40.0, 0.5, -0.5]]).astype(np.float32)
    if name == "rcp_approx":
        x = x[np.abs(x) >= 1e-30]
    out = np.full_like(x, np.nan)
    launch(kern, -(-x.size // 128), 128, 0, (x, out))
    want = ref(x.astype(np.float64))
    rel = np.abs(out.astype(np.float64) - want) / np.abs(want)
    assert not np.isnan(out).any()
    assert np.sign(out).tolist() == np.sign(want).tolist()
    assert rel.max() <= bound, f"{name}: relative error {rel.max():.3e} > {bound:.3e} at x = {x[rel.argmax()]}"
