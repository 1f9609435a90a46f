"""Tests of the float64 NumPy attention oracle (numba_flash.reference)."""

import math
import warnings

import numpy as np
import pytest

from numba_flash import reference as ref

SHAPES = [(4, 4), (3, 5), (5, 3)]  # (Nq, Nk): equal, Nq < Nk, Nq > Nk


def _rand(rng, *shape):
    return rng.standard_normal(shape)


def _qkv(rng, nq, nk, d, dv=None, lead=()):
    dv = d if dv is None else dv
    return (_rand(rng, *lead, nq, d), _rand(rng, *lead, nk, d),
            _rand(rng, *lead, nk, dv))


def _naive(q, k, v, causal, scale=None):
    """Per-row loop with math.exp; q (Nq, d), k (Nk, d), v (Nk, dv)."""
    nq, d = q.shape
    nk = k.shape[0]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros((nq, v.shape[1]))
    lse = np.full(nq, -np.inf)
    for i in range(nq):
        js = [j for j in range(nk) if not causal or j <= i + nk - nq]
        if not js:
            continue
        s = {j: scale * sum(q[i, c] * k[j, c] for c in range(d)) for j in js}
        m = max(s.values())
        w = {j: math.exp(s[j] - m) for j in js}
        l = sum(w.values())
        lse[i] = m + math.log(l)
        for j in js:
            out[i] += (w[j] / l) * v[j]
    return out, lse


def test_causal_mask_alignment():
    np.testing.assert_array_equal(
        ref.causal_mask(3, 5),
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(
        ref.causal_mask(5, 3),
        [[0, 0, 0], [0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    np.testing.assert_array_equal(ref.causal_mask(4, 4),
                                  np.tril(np.ones((4, 4), bool)))
    assert ref.causal_mask(3, 5).dtype == bool


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", SHAPES)
def test_softmax_rows_sum_to_one(nq, nk, causal):
    rng = np.random.default_rng()
    d = nk
    q, k, _ = _qkv(rng, nq, nk, d)
    # One-hot V: out is exactly the probability matrix P.
    p, lse = ref.attention_fwd(q, k, np.eye(nk), causal=causal)
    mask = ref.causal_mask(nq, nk) if causal else np.ones((nq, nk), bool)
    seen = mask.any(axis=1)
    np.testing.assert_allclose(p.sum(axis=1)[seen], 1.0, rtol=0, atol=1e-13)
    assert np.all(p[~mask] == 0.0)
    assert np.all(p[mask] > 0.0)
    # Same P from exp(S - lse) on the visible entries.
    s = (q @ k.T) / math.sqrt(d)
    p2 = np.exp(s[mask] - np.broadcast_to(lse[:, None], s.shape)[mask])
    np.testing.assert_allclose(p2, p[mask], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk,d,dv", [(4, 4, 3, 3), (2, 5, 3, 3),
                                        (5, 2, 3, 3), (3, 4, 2, 5), (1, 1, 1, 1)])
def test_forward_matches_naive_loop(nq, nk, d, dv, causal):
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, nq, nk, d, dv)
    out, lse = ref.attention_fwd(q, k, v, causal=causal)
    out_n, lse_n = _naive(q, k, v, causal)
    assert out.shape == (nq, dv) and lse.shape == (nq,)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    np.testing.assert_allclose(out, out_n, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, lse_n, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(ref.attention(q, k, v, causal=causal), out)


def test_fully_masked_rows():
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, 5, 3, 4)
    dout = _rand(rng, 5, 4)
    with warnings.catch_warnings(), \
            np.errstate(divide="raise", invalid="raise", over="raise"):
        warnings.simplefilter("error")
        out, lse = ref.attention_fwd(q, k, v, causal=True)
        dq, dk, dv = ref.attention_bwd(dout, q, k, v, causal=True)
    assert np.all(out[:2] == 0.0)
    assert np.all(lse[:2] == -np.inf)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse[2:]))
    for g in (dq, dk, dv):
        assert not np.any(np.isnan(g)) and np.all(np.isfinite(g))
    assert np.all(dq[:2] == 0.0)
    # Masked rows contribute nothing to dk/dv: dropping them (3x3 causal
    # keeps the same visibility for rows 2..4) gives the same gradients.
    _, dk3, dv3 = ref.attention_bwd(dout[2:], q[2:], k, v, causal=True)
    np.testing.assert_allclose(dk, dk3, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dv, dv3, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("causal", [False, True])
def test_empty_nk(causal):
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, 3, 0, 4, 2, lead=(2,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = ref.attention_fwd(q, k, v, causal=causal)
        dq, dk, dv = ref.attention_bwd(_rand(rng, 2, 3, 2), q, k, v,
                                       causal=causal)
    assert out.shape == (2, 3, 2) and np.all(out == 0.0)
    assert lse.shape == (2, 3) and np.all(lse == -np.inf)
    assert dq.shape == (2, 3, 4) and np.all(dq == 0.0)
    assert dk.shape == (2, 0, 4) and dv.shape == (2, 0, 2)


@pytest.mark.parametrize("causal", [False, True])
def test_empty_nq(causal):
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, 0, 3, 4, 2, lead=(2,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = ref.attention_fwd(q, k, v, causal=causal)
        dq, dk, dv = ref.attention_bwd(_rand(rng, 2, 0, 2), q, k, v,
                                       causal=causal)
    assert out.shape == (2, 0, 2) and lse.shape == (2, 0)
    assert dq.shape == (2, 0, 4)
    assert dk.shape == (2, 3, 4) and np.all(dk == 0.0)
    assert dv.shape == (2, 3, 2) and np.all(dv == 0.0)


@pytest.mark.parametrize("lead", [(), (2,), (2, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_leading_dims_match_loop(lead, causal):
    rng = np.random.default_rng()
    nq, nk, d = 5, 3, 4
    q, k, v = _qkv(rng, nq, nk, d, lead=lead)
    dout = _rand(rng, *lead, nq, d)
    out, lse = ref.attention_fwd(q, k, v, causal=causal)
    grads = ref.attention_bwd(dout, q, k, v, causal=causal)
    assert out.shape == lead + (nq, d) and lse.shape == lead + (nq,)
    for idx in np.ndindex(*lead):
        o1, l1 = ref.attention_fwd(q[idx], k[idx], v[idx], causal=causal)
        np.testing.assert_allclose(out[idx], o1, rtol=1e-13, atol=1e-15)
        np.testing.assert_array_equal(lse[idx], l1)
        g1 = ref.attention_bwd(dout[idx], q[idx], k[idx], v[idx],
                               causal=causal)
        for g, gi in zip(grads, g1):
            np.testing.assert_allclose(g[idx], gi, rtol=1e-13, atol=1e-15)


def _fd_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(*x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += eps
        xm[i] -= eps
        g[i] = (f(xp) - f(xm)) / (2 * eps)
    return g


@pytest.mark.parametrize("nq,nk,d,dv,causal", [
    (3, 4, 2, 2, False), (3, 4, 2, 3, True), (4, 2, 3, 2, True),
    (3, 3, 2, 2, True)])
def test_backward_matches_finite_differences(nq, nk, d, dv, causal):
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, nq, nk, d, dv)
    dout = _rand(rng, nq, dv)

    def loss(q_, k_, v_):
        return float(np.sum(ref.attention(q_, k_, v_, causal=causal) * dout))

    dq, dk, dv_ = ref.attention_bwd(dout, q, k, v, causal=causal)
    tol = dict(rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dq, _fd_grad(lambda x: loss(x, k, v), q), **tol)
    np.testing.assert_allclose(dk, _fd_grad(lambda x: loss(q, x, v), k), **tol)
    np.testing.assert_allclose(dv_, _fd_grad(lambda x: loss(q, k, x), v), **tol)


@pytest.mark.parametrize("causal", [False, True])
def test_large_logits_stay_finite(causal):
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, 6, 5, 8)
    q, k = 30 * q, 30 * k
    dout = _rand(rng, 6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = ref.attention_fwd(q, k, v, causal=causal)
        grads = ref.attention_bwd(dout, q, k, v, causal=causal)
    seen = ref.causal_mask(6, 5).any(axis=1) if causal else np.ones(6, bool)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse[seen]))
    assert all(np.all(np.isfinite(g)) for g in grads)
    # out is a convex combination of rows of v
    assert np.all(out[seen] <= v.max(axis=0) + 1e-9)
    assert np.all(out[seen] >= v.min(axis=0) - 1e-9)
    out_n, lse_n = _naive(q, k, v, causal)
    np.testing.assert_allclose(out, out_n, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(lse, lse_n, rtol=1e-12)


def test_scale():
    rng = np.random.default_rng()
    d = 4
    q, k, v = _qkv(rng, 3, 5, d)
    dout = _rand(rng, 3, d)
    o_def, l_def = ref.attention_fwd(q, k, v)
    o_exp, l_exp = ref.attention_fwd(q, k, v, scale=1 / np.sqrt(d))
    np.testing.assert_allclose(o_exp, o_def, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(l_exp, l_def, rtol=1e-14, atol=1e-15)
    o2 = ref.attention(q, k, v, scale=2.0)
    assert not np.allclose(o2, o_def)
    # scale enters only through scale * q k^T
    np.testing.assert_allclose(o2, ref.attention(2.0 * q, k, v, scale=1.0),
                               rtol=1e-12, atol=1e-14)
    g2 = ref.attention_bwd(dout, q, k, v, scale=2.0)
    g1 = ref.attention_bwd(dout, 2.0 * q, k, v, scale=1.0)
    np.testing.assert_allclose(g2[0], 2.0 * g1[0], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(g2[1], g1[1], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(g2[2], g1[2], rtol=1e-12, atol=1e-14)


def test_input_conversion_and_validation():
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, 2, 3, 2)
    out, lse = ref.attention_fwd(q.astype(np.float32).tolist(),
                                 k.astype(np.float32), v.astype(np.float32))
    assert out.dtype == np.float64 and lse.dtype == np.float64
    with pytest.raises(ValueError):
        ref.attention(q[0], k, v)
    with pytest.raises(ValueError):
        ref.attention_bwd(_rand(rng, 2, 2), q, k[0], v)
