"""Float64 NumPy oracle for scaled dot-product attention (forward and backward).

This module is the ground truth that the Numba CUDA kernels are tested
against.  It is deliberately plain: it materialises the full score matrix,
works in float64 and uses no numba.

Notation follows the FlashAttention papers (Dao et al., 2022; Dao, 2023).
For one head, with Q in R^{Nq x d}, K in R^{Nk x d}, V in R^{Nk x dv}::

    S   = scale * Q K^T                      (Nq, Nk), scale = 1/sqrt(d) by default
    S   = c tanh(S / c)                      softcap c (optional)
    S_ij -= slope * |i + Nk - Nq - j|        ALiBi (optional)
    S_ij = score_mod(S_ij, b, h, i, j, *mod_args)        (optional, a Python function)
    S_ij = -inf where not mask_mod(b, h, i, j, *mod_args) (optional)
    S_ij = -inf where a mask (causal, window) hides key j from query i
    m_i = max_j S_ij                         (Nq,)
    l_i = sum_j exp(S_ij - m_i)              (Nq,)
    L_i = m_i + log l_i   (logsumexp, "lse") (Nq,)
    P   = exp(S - L)      (row softmax)      (Nq, Nk)
    O   = P V                                (Nq, dv)

Backward, given dO = dLoss/dO::

    dV    = P^T dO                           (Nk, dv)
    dP    = dO V^T                           (Nq, Nk)
    D_i   = rowsum(dO * O)_i  ("delta")      (Nq,)
    dS    = P * (dP - D)                     (Nq, Nk)
            (times 1 - tanh^2(scale Q K^T / c) with a softcap,
             times score_mod_grad(...) with a score_mod)
    dQ    = scale * dS K                     (Nq, d)
    dK    = scale * dS^T Q                   (Nk, d)

All functions accept any number of leading (batch, head, ...) dims, which
must be identical for q, k, v, except grouped-query attention: k and v may
have fewer heads (axis -3) than q, a divisor of q's; query head h reads
K/V head h // (Hq // Hkv), and dk, dv sum over each group.  The score
options (causal, window, softcap, alibi_slopes, score_mod, mask_mod,
score_mod_grad, mod_args) are those of :func:`numba_flash.attention_fwd`.
The user functions are called element by element in float64 (slow: for
test-sized problems).  A query row that
sees no key at all (causal with Nq > Nk, or Nk == 0) gets O_i = 0,
L_i = -inf and zero gradients; no NaN and no floating-point warning is ever
produced for such rows.
"""

import math

import numpy as np

from .scores import CAUSAL, apply_mods, parse, transform, visible_mask

__all__ = ["causal_mask", "attention_fwd", "attention", "attention_bwd"]


def causal_mask(nq, nk):
    """causal_mask(nq, nk) -> mask

    Bottom-right aligned causal mask, shape (nq, nk), dtype bool.

    ``mask[i, j]`` is True where query i may see key j, i.e.
    ``j <= i + nk - nq``.  The last query always sees every key; when
    nq == nk this is the usual lower-triangular ``j <= i``.  This is the
    convention of FlashAttention >= 2.1 (queries are the *last* nq positions
    of a length-nk sequence, as in KV-cache decoding).

    nq=3, nk=5 (offset +2)::

              j: 0 1 2 3 4
        i=0      x x x . .
        i=1      x x x x .
        i=2      x x x x x

    nq=5, nk=3 (offset -2; rows 0 and 1 see nothing)::

              j: 0 1 2
        i=0      . . .
        i=1      . . .
        i=2      x . .
        i=3      x x .
        i=4      x x x

    Note: PyTorch's ``scaled_dot_product_attention(..., is_causal=True)`` is
    *top-left* aligned (``j <= i``, i.e. ``torch.ones(nq, nk).tril()``), so it
    differs from this mask whenever nq != nk.
    """
    return visible_mask(CAUSAL, nq, nk)


def _prepare(q, k, v, scale):
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 2:
            raise ValueError(f"{name} must have ndim >= 2 (..., N, d), got shape {x.shape}. Add a "
                             f"leading axis for a single vector: {name}[None, :].")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return q, k, v, float(scale)


def _group(q, k):
    """Query heads per K/V head (axis -3); 1 when the leading dims agree."""
    if q.shape[:-2] == k.shape[:-2] or q.ndim < 3 or k.ndim != q.ndim:
        return 1
    hq, hk = q.shape[-3], k.shape[-3]
    if q.shape[:-3] != k.shape[:-3] or hk == 0 or hq % hk:
        raise ValueError(f"q's heads (axis -3) must be a multiple of k's, got q {q.shape}, k {k.shape}.")
    return hq // hk


def _probs(q, k, scale, options, slopes, mods=(None, None, None), mod_args=()):
    """Return (P, lse, grad): softmax probabilities (..., Nq, Nk), lse (..., Nq) and the
    softcap's derivative (1 without one).

    Rows with no visible key give P_i = 0 and lse_i = -inf.
    """
    rules = parse(*options, slopes is not None, *mods)
    s = scale * np.matmul(q, np.swapaxes(k, -1, -2))  # (..., Nq, Nk)
    s, grad = transform(rules, s, None if slopes is None else np.asarray(slopes, np.float64))
    s, grad, seen = apply_mods(rules, s, grad, tuple(_host(a) for a in mod_args))
    if seen is not None:
        s, grad = np.where(seen, s, -np.inf), np.where(seen, grad, 0.0)
    if rules.spec.masks_keys:
        s = np.where(visible_mask(rules, s.shape[-2], s.shape[-1]), s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)  # (..., Nq, 1)
    m = np.where(np.isfinite(m), m, 0.0)  # empty rows: avoid -inf - -inf
    e = np.exp(s - m)  # masked entries -> exp(-inf) = 0
    l = np.sum(e, axis=-1, keepdims=True)  # (..., Nq, 1); 0 for empty rows
    visible = l > 0
    p = e / np.where(visible, l, 1.0)
    log_l = np.log(l, out=np.full_like(l, -np.inf), where=visible)
    lse = (m + log_l)[..., 0]
    return p, lse, grad


def _host(a):
    """A mod argument as the oracle reads it: device arrays (anything with
    ``copy_to_host``, ``get`` or ``cpu``) copied to NumPy, scalars as they are."""
    for name in ("copy_to_host", "get"):
        if hasattr(a, name) and not isinstance(a, np.ndarray):
            return getattr(a, name)()
    if hasattr(a, "cpu") and hasattr(a, "numpy"):
        return a.cpu().numpy()
    return a


def _expand(q, k, v):
    """k, v with their heads repeated to q's (grouped-query attention), and the group size."""
    g = _group(q, k)
    if g > 1:
        k, v = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    return k, v, g


def attention_fwd(q, k, v, *, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None,
                  score_mod=None, mask_mod=None, mod_args=(), score_mod_grad=None):
    """attention_fwd(q, k, v, *, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None, score_mod=None, mask_mod=None, mod_args=(), score_mod_grad=None) -> (out, lse)

    Attention forward pass in float64.

    q: (..., Nq, d), k: (..., Nk, d), v: (..., Nk, dv), same leading dims.
    out: (..., Nq, dv) = softmax(scale * q k^T [masked]) v, float64.
    lse: (..., Nq) natural-log logsumexp of the scaled visible scores
    (-inf for a row that sees no key).  ``scale`` defaults to 1/sqrt(d);
    ``causal`` uses :func:`causal_mask` (bottom-right aligned).
    ``score_mod_grad`` is accepted (the backward's option) and not used.
    """
    q, k, v, scale = _prepare(q, k, v, scale)
    k, v, _ = _expand(q, k, v)
    p, lse, _ = _probs(q, k, scale, (causal, window, softcap), alibi_slopes, (score_mod, mask_mod, None), mod_args)
    return np.matmul(p, v), lse


def attention(q, k, v, *, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None,
              score_mod=None, mask_mod=None, mod_args=(), score_mod_grad=None):
    """attention(q, k, v, *, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None, score_mod=None, mask_mod=None, mod_args=(), score_mod_grad=None) -> out

    ``softmax(scale * q k^T [masked]) v`` in float64, shape (..., Nq, dv): the ``out`` of
    :func:`attention_fwd` (same arguments)."""
    return attention_fwd(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                         alibi_slopes=alibi_slopes, score_mod=score_mod, mask_mod=mask_mod, mod_args=mod_args)[0]


def attention_bwd(dout, q, k, v, *, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None,
                  score_mod=None, score_mod_grad=None, mask_mod=None, mod_args=()):
    """attention_bwd(dout, q, k, v, *, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None, score_mod=None, score_mod_grad=None, mask_mod=None, mod_args=()) -> (dq, dk, dv)

    Gradients ``(dq, dk, dv)`` of ``sum(out * dout)``, recomputing the forward (so,
    unlike :func:`numba_flash.attention_bwd`, it takes no ``out`` or ``lse``).

    dout: (..., Nq, dv).  Returns dq (..., Nq, d), dk (..., Nk, d),
    dv (..., Nk, dv), all float64.  Formulas (module docstring)::

        dV = P^T dO,  dP = dO V^T,  D = rowsum(dO * O),
        dS = P * (dP - D),  dQ = scale dS K,  dK = scale dS^T Q
    """
    q, k, v, scale = _prepare(q, k, v, scale)
    dout = np.asarray(dout, dtype=np.float64)
    kh, vh = k, v
    k, v, g = _expand(q, k, v)
    if score_mod is not None and score_mod_grad is None:
        raise ValueError("the backward of a score_mod needs score_mod_grad (d score_mod / d score).")
    p, _, grad = _probs(q, k, scale, (causal, window, softcap), alibi_slopes, (score_mod, mask_mod, score_mod_grad),
                        mod_args)
    out = np.matmul(p, v)
    pt = np.swapaxes(p, -1, -2)
    dv = np.matmul(pt, dout)
    dp = np.matmul(dout, np.swapaxes(v, -1, -2))
    delta = np.sum(dout * out, axis=-1, keepdims=True)
    ds = p * (dp - delta) * grad
    dq = scale * np.matmul(ds, k)
    dk = scale * np.matmul(np.swapaxes(ds, -1, -2), q)
    if g > 1:       # sum each group's query heads into its K/V head
        dk = dk.reshape(kh.shape[:-2] + (g,) + dk.shape[-2:]).sum(axis=-3)
        dv = dv.reshape(vh.shape[:-2] + (g,) + dv.shape[-2:]).sum(axis=-3)
    return dq, dk, dv
