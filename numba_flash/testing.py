"""Test attention code against the float64 oracle: tolerances and Hypothesis strategies.

numba_flash's own test-suite checks every kernel with these, and they are public so that
you can fuzz your own attention code (a model's attention layer, a custom kernel) the same
way::

    from hypothesis import given
    from numba_flash.testing import assert_attention_close, attention_problems

    @given(attention_problems())
    def test_my_attention(problem):
        q, k, v, options = problem["q"], problem["k"], problem["v"], problem["options"]
        assert_attention_close(my_attention(q, k, v, **options), q, k, v, **options)

**The tolerance rule.** An output is compared with the float64 oracle
(:mod:`numba_flash.reference`), and may err by at most twice what an ordinary program of
the same precision errs by on the same inputs, plus a few units in the last place, plus
the problem's own sensitivity to the rounding of its logits:

* float64: ``1e-12`` relative, plus the sensitivity term at float64's unit roundoff;
* float32: twice the error of plain float32 NumPy attention (:func:`baseline_fwd32`),
  plus ``1e-6 · max|v|``, plus ``SLACK_ULPS`` times the sensitivity
  (:func:`rounding_sensitivity`): large logits make two correct float32 programs differ
  by more than 2×;
* float16 and bfloat16: twice the error of an ordinary 16-bit tensor-core program
  (:func:`baseline_fwd_low`: float32 scores and softmax, P rounded to the input dtype,
  the output rounded too), plus one unit in the last place of ``max|v|``, plus the float32
  slack (and ``2 · TANH_APPROX`` of the sensitivity with a softcap, for the hardware tanh).

Rows that see no key must be exactly 0 (and their lse ``-inf``). No verdict depends on the
machine: the baselines are computed, not remembered.
"""
import math

import numpy as np

from . import reference, scores
from .scores import visible_mask

TANH_APPROX = 2.0**-11      # tanh.approx.f32's relative error bound (PTX ISA)
LOW_DTYPES = ("float16", "bfloat16")


SCORE_OPTIONS = ("causal", "window", "softcap", "alibi_slopes", "score_mod", "mask_mod", "score_mod_grad", "mod_args")


def score_options(options):
    """The score options that a helper's ``causal`` argument stands for, as a dict of all four
    :data:`SCORE_OPTIONS` (keyword arguments of the API and of the oracle).

    ``options`` is a bool (the causal mask alone) or a dict with any of ``causal``,
    ``window``, ``softcap``, ``alibi_slopes``, ``score_mod``, ``mask_mod``,
    ``score_mod_grad`` and ``mod_args`` (device slopes and device mod_args are copied to the host).
    """
    found = dict.fromkeys(SCORE_OPTIONS)
    found["causal"] = False
    found["mod_args"] = ()
    if isinstance(options, dict):
        unknown = set(options) - set(SCORE_OPTIONS)
        assert not unknown, f"unknown score options {sorted(unknown)}"
        found.update(options)
    else:
        found["causal"] = options
    slopes = found["alibi_slopes"]
    if slopes is not None and not isinstance(slopes, np.ndarray):
        found["alibi_slopes"] = slopes.copy_to_host()
    found["mod_args"] = tuple(to_numpy(a) if hasattr(a, "shape") else a for a in found["mod_args"])
    return found


def score_rules(options):
    """``(rules, slopes)``: the :class:`numba_flash.scores.Scores` of ``options`` (a bool or a
    dict, see :func:`score_options`) and the ALiBi slopes as a NumPy array (or None)."""
    o = score_options(options)
    slopes = o["alibi_slopes"]
    return scores.parse(o["causal"], o["window"], o["softcap"], slopes is not None, o["score_mod"],
                        o["mask_mod"], o["score_mod_grad"], nargs=len(o["mod_args"])), slopes


def expand_heads(q, *arrays):
    """``arrays`` (shaped like k) with their heads (axis -3) repeated to q's, as grouped-query
    attention reads them (query head ``h`` reads K/V head ``h // (Hq // Hkv)``)."""
    out = []
    for x in arrays:
        if x.shape[:-2] != q.shape[:-2]:
            x = np.repeat(x, q.shape[-3] // x.shape[-3], axis=-3)
        out.append(x)
    return out


def alibi_bias(rules, slopes, lead, nq, nk, rows=None):
    """ALiBi's ``slope · |i + Nk − Nq − j|`` (subtracted from the scores) in float64, shape
    ``lead + (len(rows), nk)`` (``rows``: the query rows, all by default), or None
    without ALiBi."""
    if not rules.alibi:
        return None
    rows = np.arange(nq) if rows is None else np.asarray(rows)
    dist = np.abs(rows[:, None] + (nk - nq) - np.arange(nk)[None, :]).astype(np.float64)
    return np.broadcast_to(np.asarray(slopes, np.float64), lead)[..., None, None] * dist


def scores32(q32, k32, causal, scale):
    """The float32 scores of a plain float32 program: ``(s, grad)`` with ``s`` the scaled
    scores after softcap and ALiBi (:func:`numba_flash.scores.transform`, in float32), -inf
    where the mask hides a key, and ``grad`` the softcap's derivative. ``causal``: a bool or
    a dict of score options (:func:`score_options`); k's heads may be fewer than q's (GQA)."""
    rules, slopes = score_rules(causal)
    (k32,) = expand_heads(q32, k32)
    d = q32.shape[-1]
    sc = np.float32(1.0 / math.sqrt(d) if scale is None else scale)
    s = np.matmul(q32, np.swapaxes(k32, -1, -2)) * sc
    s, grad = scores.transform(rules, s, slopes)
    s, grad, seen = _mods32(rules, s, grad, causal)
    s = np.where(visible_mask(rules, s.shape[-2], s.shape[-1]), s, np.float32(-np.inf))
    assert s.dtype == np.float32 and grad.dtype == np.float32
    return s, grad


def _mods32(rules, s, grad, options):
    """The user functions of ``options`` applied to float32 scores, rounded back to float32
    (a float32 program calls them on float32 scores); masked scores -inf."""
    if rules.mods is None:
        return s, grad, None
    s64, g64, seen = scores.apply_mods(rules, s, grad, score_options(options)["mod_args"])
    s, grad = s64.astype(np.float32), g64.astype(np.float32)
    if seen is not None:
        s = np.where(seen, s, np.float32(-np.inf))
    return s, grad, seen


def softmax32(q32, k32, causal, scale):
    """Plain float32 softmax of the scaled scores: ``(p, m, l, visible)``, with ``m`` the
    row max, ``l`` the row sum of ``exp(s - m)`` and rows that see no key giving p = 0.
    ``causal``: a bool or a dict of score options (:func:`score_options`)."""
    s, _ = scores32(q32, k32, causal, scale)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, np.float32(0))
    e = np.exp(s - m)
    l = np.sum(e, axis=-1, keepdims=True)
    visible = l > 0
    return e / np.where(visible, l, np.float32(1)), m, l, visible


def baseline_fwd32(q, k, v, causal, scale):
    """Plain float32 NumPy attention: what an ordinary float32 implementation gets.

    Returns (out, lse) in float32; rows that see no key get out = 0, lse = -inf.
    ``causal``: a bool or a dict of score options (:func:`score_options`).
    """
    q32, k32, v32 = (np.asarray(x, dtype=np.float32) for x in (q, k, v))
    p, m, l, visible = softmax32(q32, k32, causal, scale)
    (v32,) = expand_heads(q32, v32)
    out = np.matmul(p, v32)
    log_l = np.log(l, out=np.full_like(l, -np.inf), where=visible)
    lse = (m + log_l)[..., 0]
    assert out.dtype == np.float32 and lse.dtype == np.float32
    return out, lse


def _max_abs(x):
    return float(np.max(np.abs(x), initial=0.0))


U32, U64 = 2.0**-24, 2.0**-53   # unit roundoff
SLACK_ULPS = 8                  # allowed logit rounding, in units of U · scale · sum|q_c k_c|


def rounding_sensitivity(q, k, v, causal, scale, ref_out, ref_lse):
    """First-order size of the changes in out and lse caused by rounding the logits.

    If each logit s_ij = scale · q_i · k_j is computed with an error of at most
    U · A_ij, where A_ij = scale · sum_c |q_ic k_jc| (a rounding-error bound of the
    dot product, up to a small factor), then to first order out_ic moves by at most
    U · sum_j p_ij A_ij |v_jc - out_ic| and lse_i by at most U · sum_j p_ij A_ij.
    Returns the maxima of these two sums without the factor U. This is how sensitive
    the problem itself is, whatever computes it: two correct float32 programs can
    differ by this much, while a real bug (a wrong mask, a wrong tile) errs by O(|v|).

    ``causal`` is a bool or a dict of score options (:func:`score_options`); k, v may
    have fewer heads than q (GQA). The other score rules change A_ij: with a softcap
    ``c`` (``t = tanh(s_ij / c)``) the dot product's error reaches the capped score times
    ``1 - t²``, and the capped score ``c · t`` is itself rounded, so A_ij becomes
    ``(1 - t²) · scale · sum_c |q_ic k_jc| + |c · t|`` (at most twice the plain bound);
    ALiBi adds the bias ``|slope · (i + Nk - Nq - j)|``, since the biased score is what a
    float32 program rounds.
    """
    rules, slopes = score_rules(causal)
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    k, v = expand_heads(q, k, v)
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if q.size == 0 or nk == 0:
        return 0.0, 0.0
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q3, k3, v3 = q.reshape(-1, nq, d), k.reshape(-1, nk, d), v.reshape(-1, nk, d)
    o3, l3 = np.asarray(ref_out).reshape(-1, nq, d), np.asarray(ref_lse).reshape(-1, nq)
    slopes3 = np.broadcast_to(np.asarray(slopes, np.float64), q.shape[:-2]).reshape(-1) if rules.alibi else None
    mask = visible_mask(rules, nq, nk)
    modded = None
    if rules.mods is not None:          # the user's scores, computed whole (test-sized problems)
        s_all, _ = scores.transform(rules, sc * np.matmul(q, np.swapaxes(k, -1, -2)),
                                    None if slopes is None else np.asarray(slopes, np.float64))
        s_all, _, seen = scores.apply_mods(rules, s_all, np.ones_like(s_all), score_options(causal)["mod_args"])
        modded = (s_all.reshape(-1, nq, nk), None if seen is None else seen.reshape(-1, nq, nk))
    rows = max(1, (1 << 22) // (nk * d))
    s_out = s_lse = 0.0
    for b in range(q3.shape[0]):
        for r0 in range(0, nq, rows):
            r1 = min(nq, r0 + rows)
            qi, lse = q3[b, r0:r1], l3[b, r0:r1, None]
            s = sc * (qi @ k3[b].T)
            a = sc * (np.abs(qi) @ np.abs(k3[b]).T)
            if rules.softcap is not None:
                t = np.tanh(s / rules.softcap)
                s = rules.softcap * t
                a = (1 - t * t) * a + np.abs(s)
            if rules.alibi:
                bias = alibi_bias(rules, slopes3[b], (), nq, nk, np.arange(r0, r1))
                s = s - bias
                a = a + np.abs(bias)
            vis = mask[r0:r1] & np.isfinite(lse)
            if modded is not None:      # a score_mod's output is rounded too: its size joins A
                s = modded[0][b, r0:r1]
                a = a + np.abs(np.where(np.isfinite(s), s, 0.0))
                if modded[1] is not None:
                    vis = vis & modded[1][b, r0:r1]
            p = np.exp(np.where(vis, s - np.where(np.isfinite(lse), lse, 0.0), -np.inf))
            w = p * a
            s_lse = max(s_lse, _max_abs(w.sum(-1)))
            dev = np.abs(v3[b][None, :, :] - o3[b, r0:r1, None, :])      # (rows, nk, d)
            s_out = max(s_out, _max_abs(np.einsum("ij,ijc->ic", w, dev)))
    return s_out, s_lse


def _check_written(out, lse, shape, out_dtype, lse_dtype):
    """``out`` (and ``lse``, if not None) NumPy arrays of these dtypes and shapes (``lse``:
    ``shape`` without d), with no NaN (an element a kernel never wrote) and no infinity but
    an lse's -inf."""
    assert isinstance(out, np.ndarray) and out.dtype == out_dtype and out.shape == shape
    out64 = out.astype(np.float64)
    assert not np.isnan(out64).any(), "NaN in out (an element the kernel never wrote?)"
    assert np.isfinite(out64).all()
    if lse is not None:
        assert isinstance(lse, np.ndarray) and lse.dtype == lse_dtype and lse.shape == shape[:-1]
        assert not np.isnan(lse).any(), "NaN in lse (an element the kernel never wrote?)"
        assert not np.isposinf(lse).any()


def _check_empty_rows(out, lse, ref_lse):
    """Rows that see no key (the oracle's lse is -inf): out exactly 0, lse -inf there and
    only there. Returns the other rows' mask."""
    empty = np.isneginf(ref_lse)
    if lse is not None:
        np.testing.assert_array_equal(np.isneginf(lse), empty,
                                      err_msg="lse must be -inf exactly where no key is visible")
    assert np.all(out[empty] == 0), "rows with no visible key must be exactly 0"
    return ~empty


def check_forward(out, lse, q, k, v, causal, scale, oracle=None):
    """Assert that ``(out, lse)`` (float32 or float64; ``lse`` may be None) matches the
    float64 oracle.

    Rows that see no key must be exactly out = 0 and lse = -inf. Elsewhere:

    * float32: the error may be at most twice that of a plain float32 NumPy
      computation (:func:`baseline_fwd32`), plus 1e-6 · max|v| (a few ulps), plus
      ``SLACK_ULPS`` times the problem's sensitivity to logit rounding
      (:func:`rounding_sensitivity`). The last term matters only for large logits,
      where the errors of two correct float32 programs vary by more than 2x.
    * float64: 1e-12 relative to max(1, max|oracle|), plus the same sensitivity term
      at float64's unit roundoff.

    ``causal`` is a bool or a dict of score options (:func:`score_options`), given to the
    oracle, the baseline and the sensitivity alike; k, v may have fewer heads than q.
    """
    q, k, v = (np.asarray(x) for x in (q, k, v))
    dtype = q.dtype
    _check_written(out, lse, q.shape, dtype, dtype)
    if oracle is None:
        oracle = reference.attention_fwd(q, k, v, scale=scale, **score_options(causal))
    ref_out, ref_lse = oracle
    fin = _check_empty_rows(out, lse, ref_lse)
    err_out = _max_abs(out.astype(np.float64) - ref_out)
    sens_out, sens_lse = rounding_sensitivity(q, k, v, causal, scale, ref_out, ref_lse)
    if dtype == np.float64:
        tol_out = 1e-12 * max(1.0, _max_abs(ref_out)) + SLACK_ULPS * U64 * sens_out
        tol_lse = 1e-12 * max(1.0, _max_abs(ref_lse[fin])) + SLACK_ULPS * U64 * sens_lse
    else:
        base_out, base_lse = baseline_fwd32(q, k, v, causal, scale)
        tol_out = (2 * _max_abs(base_out.astype(np.float64) - ref_out) + 1e-6 * _max_abs(v)
                   + SLACK_ULPS * U32 * sens_out)
        tol_lse = (2 * _max_abs(base_lse[fin].astype(np.float64) - ref_lse[fin])
                   + 1e-6 * max(1.0, _max_abs(ref_lse[fin])) + SLACK_ULPS * U32 * sens_lse)
    assert err_out <= tol_out, f"out: max error {err_out:.3e} > tolerance {tol_out:.3e}"
    if lse is not None:
        err_lse = _max_abs(lse[fin].astype(np.float64) - ref_lse[fin])
        assert err_lse <= tol_lse, f"lse: max error {err_lse:.3e} > tolerance {tol_lse:.3e}"


def baseline_fwd_low(q, k, v, causal, scale):
    """What an ordinary 16-bit tensor-core attention gets: float32 scores and softmax,
    P rounded to the input dtype, float32 P·V, output rounded to the input dtype.
    ``causal``: a bool or a dict of score options (:func:`score_options`); k, v
    may have fewer heads than q (GQA)."""
    dt = q.dtype
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    p, m, l, visible = softmax32(q32, k32, causal, scale)
    (v32,) = expand_heads(q32, v32)
    out = np.matmul(p.astype(dt).astype(np.float32), v32).astype(dt)
    lse = (m + np.log(l, out=np.full_like(l, -np.inf), where=visible))[..., 0]
    return out, lse


def check_forward_low(out, lse, q, k, v, causal, scale):
    """Assert ``(out, lse)`` of float16/bfloat16 inputs (``lse`` float32, or None) against the
    oracle, by the 16-bit rule (module docstring).
    ``causal``: a bool or a dict of score options (:func:`score_options`), given to
    the oracle, the baseline and the rounding sensitivity alike."""
    dt = q.dtype
    _check_written(out, lse, q.shape, dt, np.dtype(np.float32))
    out64 = out.astype(np.float64)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    ref_out, ref_lse = reference.attention_fwd(q64, k64, v64, scale=scale, **score_options(causal))
    fin = _check_empty_rows(out64, lse, ref_lse)
    base_out, base_lse = baseline_fwd_low(q, k, v, causal, scale)
    sens_out, sens_lse = rounding_sensitivity(q64, k64, v64, causal, scale, ref_out, ref_lse)
    import ml_dtypes
    ulp_v = float(ml_dtypes.finfo(dt).eps) * _max_abs(v64)
    err_out = _max_abs(out64 - ref_out)
    slack = SLACK_ULPS * U32 + (2 * TANH_APPROX if score_rules(causal)[0].softcap is not None else 0.0)
    tol_out = 2 * _max_abs(base_out.astype(np.float64) - ref_out) + ulp_v + slack * sens_out
    tol_lse = (2 * _max_abs(base_lse[fin].astype(np.float64) - ref_lse[fin])
               + 1e-6 * max(1.0, _max_abs(ref_lse[fin])) + slack * sens_lse)
    assert err_out <= tol_out, f"out: max error {err_out:.3e} > tolerance {tol_out:.3e}"
    if lse is not None:
        err_lse = _max_abs(lse[fin].astype(np.float64) - ref_lse[fin])
        assert err_lse <= tol_lse, f"lse: max error {err_lse:.3e} > tolerance {tol_lse:.3e}"




def assert_attention_close(out, q, k, v, lse=None, *, causal=False, window=None, softcap=None, alibi_slopes=None,
                           scale=None, score_mod=None, mask_mod=None, mod_args=()):
    """Assert that ``out`` (and ``lse``, if given: float32 for 16-bit inputs, else the input
    dtype) is softmax attention of ``q, k, v`` with these options, as
    :func:`numba_flash.attention_fwd` defines them, within the tolerance rule above.

    Arrays of any kind (NumPy, Numba, CuPy, PyTorch), q ``(..., Hq, Nq, d)``, k and v
    ``(..., Hkv, Nk, d)``, out shaped like q in q's dtype. Raises ``AssertionError`` naming
    what is wrong and by how much."""
    q, k, v, out = (to_numpy(x) for x in (q, k, v, out))
    lse = None if lse is None else to_numpy(lse)
    options = {"causal": causal, "window": window, "softcap": softcap,
               "alibi_slopes": None if alibi_slopes is None else to_numpy(alibi_slopes),
               "score_mod": score_mod, "mask_mod": mask_mod, "mod_args": mod_args}
    if q.dtype.name in LOW_DTYPES:
        check_forward_low(out, lse, q, k, v, options, scale)
    else:
        check_forward(out, lse, q, k, v, options, scale)


def attention_problems(dtypes=("float32",), max_len=48, head_dims=(8, 16, 32, 64), max_batch=2, rules=True):
    """A Hypothesis strategy of attention problems: dicts with ``q``, ``k``, ``v`` (NumPy,
    standard normal, drawn from a seed) and ``options`` (keyword arguments for
    :func:`numba_flash.attention_fwd` and :func:`assert_attention_close`).

    Drawn: leading dims (batch up to ``max_batch``, 1-3 K/V heads, 1-2 query heads per K/V
    head), ``Nq`` and ``Nk`` in ``[0, max_len]`` independently (empty, ragged, Nq > Nk and
    Nq < Nk), the head dim from ``head_dims``, the dtype from ``dtypes`` (any of float32,
    float64, float16, bfloat16), value magnitudes 0.5-4, and with ``rules`` causal masks,
    sliding windows, softcaps and ALiBi slopes. Needs ``hypothesis``."""
    from hypothesis import strategies as st

    @st.composite
    def problems(draw):
        dtype = draw(st.sampled_from(tuple(dtypes)))
        batch, hkv, group = draw(st.integers(1, max_batch)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
        nq, nk = draw(st.integers(0, max_len)), draw(st.integers(0, max_len))
        d = draw(st.sampled_from(tuple(head_dims)))
        magnitude = draw(st.sampled_from((0.5, 1.0, 4.0)))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        dt = _np_dtype(dtype)
        q = (rng.standard_normal((batch, hkv * group, nq, d)) * magnitude).astype(dt)
        k, v = ((rng.standard_normal((batch, hkv, nk, d)) * magnitude).astype(dt) for _ in range(2))
        options = {"causal": False}
        if rules:
            options["causal"] = draw(st.booleans())
            if draw(st.booleans()):
                options["window"] = (draw(st.one_of(st.none(), st.integers(0, max_len))),
                                     draw(st.one_of(st.none(), st.integers(0, max_len))))
            if draw(st.booleans()):
                options["softcap"] = draw(st.sampled_from((2.0, 10.0, 30.0)))
            if draw(st.booleans()):
                options["alibi_slopes"] = (2.0 ** -rng.uniform(0.5, 8.0, hkv * group)).astype(np.float32)
        return {"q": q, "k": k, "v": v, "options": options}

    return problems()


def _np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def to_numpy(x):
    """A NumPy copy (NumPy arrays as they are) of a device array (Numba, or anything with copy_to_host), a PyTorch
    tensor (bfloat16 as ``ml_dtypes.bfloat16``) or a CuPy array."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    if type(x).__module__.split(".")[0] == "torch":
        import torch
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            import ml_dtypes
            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()
    return x.get()              # CuPy
