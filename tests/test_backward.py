"""Property tests of the backward pass against the float64 oracle's gradients.

The oracle's backward is itself checked against finite differences in
``test_reference.py``. Tolerances:

* float32: max error of each gradient <= 3 × that of a plain float32 NumPy backward
  (:func:`baseline_bwd32`) + 1e-6 · max|oracle gradient| + rounding slack for large
  logits (as in the forward tests, scaled by the gradient's size).
* float64: 1e-10 relative to max(1, max|oracle gradient|).
"""
import math

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import numba_flash
from numba import cuda
from numba_flash import reference, registry
import conftest
from conftest import ON_GPU, bits, host, make_qkv

DTYPES = registry.VARIANTS["backward_dkdv_simt"].dtypes     # CUDA cores (tensor cores: test_backward_mma)


class Case(conftest.Case):
    """A backward problem: ``inputs()`` adds the incoming gradient ``dout``."""

    def inputs(self):
        q, k, v = super().inputs()
        dout = np.random.default_rng(self.seed + 1).standard_normal(q.shape).astype(self.dtype)
        return q, k, v, dout


def baseline_bwd32(dout, q, k, v, causal, scale):
    """The oracle's backward formulas evaluated in plain float32 NumPy. ``causal``: a bool or
    a dict of score options (:func:`conftest.score_options`); with fewer K/V heads than
    query heads (GQA) dk, dv are summed over each group, shaped like k, v."""
    dout, q, k, v = (np.asarray(x, np.float32) for x in (dout, q, k, v))
    kh, vh = k, v
    k, v = conftest.expand_heads(q, k, v)
    sc = np.float32(1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    s, grad = conftest.scores32(q, k, causal, scale)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    e = np.exp(s - np.where(np.isfinite(m), m, np.float32(0)))
    l = e.sum(-1, keepdims=True)
    p = e / np.where(l > 0, l, np.float32(1))
    out = p @ v
    dv = np.swapaxes(p, -1, -2) @ dout
    dp = dout @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdims=True)) * grad
    dq, dk = (ds @ k) * sc, (np.swapaxes(ds, -1, -2) @ q) * sc
    if kh.shape != k.shape:     # sum each group's query heads into its K/V head
        g = q.shape[-3] // kh.shape[-3]
        dk = dk.reshape(kh.shape[:-2] + (g,) + dk.shape[-2:]).sum(axis=-3)
        dv = dv.reshape(vh.shape[:-2] + (g,) + dv.shape[-2:]).sum(axis=-3)
    return dq, dk, dv


def _max_abs(x):
    return float(np.max(np.abs(x), initial=0.0))


def check_backward(grads, dout, q, k, v, causal, scale):
    """Assert the gradients against the oracle's by the module's rule; ``causal``: a bool or
    a dict of score options (:func:`conftest.score_options`). The logit-rounding slack
    counts ALiBi's largest bias as logit size too (a float32 program rounds the biased
    score)."""
    dtype = np.asarray(q).dtype
    options = conftest.score_options(causal)
    ref = reference.attention_bwd(dout, q, k, v, scale=scale, **options)
    base = baseline_bwd32(dout, q, k, v, options, scale) if dtype == np.float32 else None
    bias = 0.0
    if options["alibi_slopes"] is not None:
        bias = _max_abs(options["alibi_slopes"]) * max(0, max(np.shape(q)[-2], np.shape(k)[-2]) - 1)
    for i, (name, g, r) in enumerate(zip(("dq", "dk", "dv"), grads, ref)):
        assert isinstance(g, np.ndarray) and g.dtype == dtype and g.shape == r.shape, name
        assert not np.isnan(g).any(), f"NaN in {name} (an element the kernel never wrote?)"
        err = _max_abs(g.astype(np.float64) - r)
        size = max(1.0, _max_abs(r))
        if dtype == np.float64:
            tol = 1e-10 * size
        else:
            mag = max(1.0, _max_abs(q), _max_abs(k)) ** 2 * math.sqrt(q.shape[-1]) + bias
            tol = 3 * _max_abs(base[i].astype(np.float64) - r) + 1e-6 * size + 2**-24 * 8 * mag * size
        assert err <= tol, f"{name}: max error {err:.3e} > tolerance {tol:.3e}"


def sim_cost(batch, nq, nk, d, dtype):
    t = registry.backward_tiling(dtype, d)
    rows, cols = t.RG * t.TM, t.CG * t.TN
    tiles = -(-nq // rows) * -(-nk // cols) + -(-nk // rows) * -(-nq // cols)
    return batch * tiles * -(-d // t.DO) * (-(-d // t.DK) + 2)


if ON_GPU:
    N_MAX, D_MAX = 400, 260
    # A fixed set of head dims: each new one compiles two kernels (seconds each), which
    # dominated the GPU run. Tile edges of the backward tilings and a few odd values.
    GPU_DS = (1, 13, 63, 64, 65, 128, 129, 256)
    # One property test per (dtype, causal) shard: pytest-xdist runs them in parallel,
    # and each worker compiles only its shard's kernels.
    SHARDS = [(dt, c) for dt in DTYPES for c in (False, True)]

    def fits(batch, nq, nk, d, dtype):
        return batch * nq * nk * d <= 1 << 24
else:
    N_MAX, D_MAX = 40, 40

    def fits(batch, nq, nk, d, dtype):
        return sim_cost(batch, nq, nk, d, dtype) <= 60

    SHARDS = [(None, None)]      # dtype and causality drawn per example


@st.composite
def cases(draw, dtype=None, causal=None):
    dtype = draw(st.sampled_from(DTYPES)) if dtype is None else dtype
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    batch = math.prod(lead)
    d = draw(st.sampled_from(GPU_DS) if ON_GPU else st.integers(1, D_MAX))
    nq = draw(st.integers(1, N_MAX))
    nk = draw(st.integers(1, N_MAX))
    while not fits(batch, nq, nk, d, dtype) and max(nq, nk, d) > 1:
        nq, nk, d = max(1, nq * 3 // 4), max(1, nk * 3 // 4), max(1, d * 3 // 4)
    return Case(lead, nq, nk, d, dtype, causal=draw(st.booleans()) if causal is None else causal,
                scale=draw(st.none() | st.floats(0.05, 2.0)),
                magnitude=draw(st.sampled_from([1.0, 3.0, 30.0])),
                seed=draw(st.integers(0, 2**31)))


def _edge_examples():
    t = registry.backward_tiling("float32", 8)
    rows, cols = t.RG * t.TM, t.CG * t.TN
    dk = registry.backward_tiling("float32", max(registry.HEAD_DIMS)).DK
    return [
        Case((), rows - 1, cols + 1, 8, causal=True, seed=1),
        Case((), rows + 1, rows, 8, "float64", causal=True, seed=2),
        Case((), cols, rows - 1, 5, causal=False, seed=3),
        Case((2,), 2 * rows + 3, 3, 4, "float64", causal=True, seed=4),   # rows with no visible key
        Case((), 3, 2 * cols + 1, 6, causal=True, seed=5),                # Nq < Nk, bottom-right
        Case((), 1, 1, 1, seed=6),
        Case((), 7, 6, dk + 1, "float64", causal=True, seed=7),          # head-dim chunks + slices
        Case((2, 2), 5, 6, 3, scale=2.0, magnitude=30.0, seed=8),        # large logits
    ]


def _check_case(case):
    q, k, v, dout = case.inputs()
    out, lse = numba_flash.attention_fwd(q, k, v, causal=case.causal, scale=case.scale)
    grads = numba_flash.attention_bwd(dout, q, k, v, out, lse, causal=case.causal, scale=case.scale)
    check_backward(grads, dout, q, k, v, case.causal, case.scale)


@pytest.mark.parametrize("case", _edge_examples(), ids=lambda c: f"seed{c.seed}")
def test_backward_edge_cases(case):
    """Tile edges, rows with no visible key, Nq < Nk, head-dim chunks, large logits."""
    _check_case(case)


@pytest.mark.parametrize("dtype,causal", SHARDS, ids=lambda x: str(x))
@given(data=st.data())
def test_backward_matches_oracle(dtype, causal, data):
    case = data.draw(cases(dtype, causal), label="case")
    note(repr(case))
    _check_case(case)


def test_device_in_device_out_and_deterministic():
    case = Case((2,), 19, 13, 8, "float32", causal=True, seed=11)
    q, k, v, dout = case.inputs()
    dev = [cuda.to_device(x) for x in (q, k, v, dout)]
    out, lse = numba_flash.attention_fwd(*dev[:3], causal=True)
    first = numba_flash.attention_bwd(dev[3], *dev[:3], out, lse, causal=True)
    second = numba_flash.attention_bwd(dev[3], *dev[:3], out, lse, causal=True)
    assert all(hasattr(g, "copy_to_host") and not isinstance(g, np.ndarray) for g in first)
    check_backward([host(g) for g in first], dout, q, k, v, True, None)
    for a, b in zip(first, second):
        assert bits(host(a)) == bits(host(b)), "backward must be bitwise reproducible"


@pytest.mark.parametrize("nq,nk", [(0, 4), (4, 0)])
def test_empty_lengths(nq, nk):
    q, k, v = make_qkv(3, (2,), nq, nk, 4, "float64")
    dout = np.ones_like(q)
    out, lse = numba_flash.attention_fwd(q, k, v, causal=True)
    dq, dk, dv = numba_flash.attention_bwd(dout, q, k, v, out, lse, causal=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for g in (dq, dk, dv):
        assert not np.isnan(g).any() and np.all(g == 0)


@pytest.mark.parametrize("bad,match", [
    (dict(dout=np.zeros((3, 4), np.float32)), "dout"),
    (dict(out=np.zeros((5, 4, 1), np.float32)), "out"),
    (dict(lse=np.zeros((4,), np.float32)), "lse"),
    (dict(lse=np.zeros((5,), np.float64)), "dtype"),
    (dict(dout=[[0.0] * 4] * 5), "dout"),
])
def test_backward_bad_inputs(bad, match):
    q, k, v = make_qkv(0, (), 5, 6, 4, "float32")
    args = dict(dout=np.ones_like(q), q=q, k=k, v=v, out=np.ones_like(q), lse=np.zeros(5, np.float32))
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        numba_flash.attention_bwd(args["dout"], args["q"], args["k"], args["v"], args["out"], args["lse"])


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: large shapes")
@pytest.mark.parametrize("d", registry.HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_large_shapes(d, causal):
    n = 4096 if d <= 128 else 1024 if d <= 256 else 512
    for dtype in DTYPES:
        case = Case((1, 2), n, n + 37, d, dtype, causal=causal, seed=d)
        q, k, v, dout = case.inputs()
        out, lse = numba_flash.attention_fwd(q, k, v, causal=causal)
        grads = numba_flash.attention_bwd(dout, q, k, v, out, lse, causal=causal)
        check_backward(grads, dout, q, k, v, causal, None)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_bitwise_determinism_large():
    q, k, v, dout = Case((2, 4), 2048, 2048, 128, seed=5).inputs()
    dev = [cuda.to_device(x) for x in (q, k, v, dout)]
    out, lse = numba_flash.attention_fwd(*dev[:3], causal=True)
    runs = [[bits(host(g)) for g in numba_flash.attention_bwd(dev[3], *dev[:3], out, lse, causal=True)]
            for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
