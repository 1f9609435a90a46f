"""The tensor-core backward (float16, bfloat16) against the float64 oracle's gradients.

Tolerance (FlashAttention's rule): ``max|grad - oracle| <= 2 · max|baseline - oracle|``
plus a floor, per gradient, where the baseline is NumPy on the same 16-bit inputs with
the kernels' roundings: float32 scores, softmax and products, P and dS rounded to the
input dtype before the products that take them (tensor cores take 16-bit operands),
delta from the baseline's own 16-bit output, and the gradients rounded to the input
dtype. The floor is one unit in the last place of max|oracle| in the input dtype (the
output rounding), the float32 logit-rounding slack of the float32 tests, with a softcap
the special-function tanh's 2⁻¹¹ relative error on the capped score
(``numba_flash.scores.SOFTCAP_TANH``; as for the forward, ``test_forward_mma``), and
what the 16-bit rounding of O does to ``delta = rowsum(dO ∘ O)`` (:func:`delta_slack`):
the baseline rounds its own O, whose error may happen to miss what the kernel's O's does.
"""
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, note, settings
from hypothesis import strategies as st

import numba_flash  # before numba: it decides whether the simulator is needed
from numba_flash import reference, registry
from numba_flash.testing import TANH_APPROX
import conftest
from conftest import ON_GPU, Case, bits, host

DTYPES = registry.VARIANTS["backward_dkdv_mma"].dtypes
_T = registry.mma_backward_tiling("dkdv")("bfloat16", 16)
BR, BC = _T.BR, _T.BC


def baseline_bwd_low(dout, q, k, v, options, scale):
    """What an ordinary 16-bit tensor-core backward gets (see the module docstring);
    ``options``: a bool or a dict of score options; k, v may have fewer heads (GQA)."""
    dt = q.dtype
    f32 = [np.asarray(x, np.float32) for x in (dout, q, k, v)]
    dout32, q32, kh32, vh32 = f32
    k32, v32 = conftest.expand_heads(q32, kh32, vh32)
    sc = np.float32(1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    p, _, _, _ = conftest.softmax32(q32, kh32, options, scale)
    _, grad = conftest.scores32(q32, kh32, options, scale)
    p16 = p.astype(dt).astype(np.float32)
    out = (p16 @ v32).astype(dt).astype(np.float32)
    dv = np.swapaxes(p16, -1, -2) @ dout32
    dp = dout32 @ np.swapaxes(v32, -1, -2)
    ds = (p * (dp - (dout32 * out).sum(-1, keepdims=True)) * grad).astype(dt).astype(np.float32)
    dq, dk = (ds @ k32) * sc, (np.swapaxes(ds, -1, -2) @ q32) * sc
    if kh32.shape != k32.shape:     # sum each group's query heads into its K/V head
        g = q.shape[-3] // kh32.shape[-3]
        dk = dk.reshape(kh32.shape[:-2] + (g,) + dk.shape[-2:]).sum(axis=-3)
        dv = dv.reshape(vh32.shape[:-2] + (g,) + dv.shape[-2:]).sum(axis=-3)
    return tuple(x.astype(dt) for x in (dq, dk, dv))


def delta_slack(dout, q, k, v, options, scale):
    """What the 16-bit rounding of O in ``delta = rowsum(dO ∘ O)`` may add to the
    gradients' error beyond the 2x rule, ``(dq, dk, dv)``. The kernel's delta comes from
    the forward's O, the baseline's from its own: two different roundings, whose errors the
    2x rule takes to be alike. Rounding moves each ``O_id`` by a uniform error of at most
    ``eps/2 · |O_id|``, so ``delta_i`` by a sum of ``d`` such errors: four standard
    deviations of it, ``δ_i = 4 · eps / (2 √3) · sqrt(Σ_d (dO_id O_id)²)``, are taken.
    Then ``dS_ij = P_ij g_ij (dP_ij − delta_i)`` moves by ``P_ij g_ij δ_i`` (``g``: a
    softcap's or score function's derivative), which ``dQ = scale · dS K`` carries as
    ``scale · δ_i · |Σ_j P_ij g_ij K_jd|`` and ``dK = scale · dSᵀ Q`` as at most ``scale ·
    Σ_i P_ij |g_ij| δ_i |Q_id|`` (summed over a K/V head's group of query heads); dV does
    not take delta. Where the softmax is sharp, ``dP_ij − delta_i`` cancels and this term
    is most of a 16-bit backward's error: a bfloat16 problem of one query row, two heads on
    one K/V head, inputs of magnitude 4, had dQ off by 0.101 of 0.286, 0.1010 of it
    from its delta (found by the thorough Hypothesis profile), its NumPy baseline by 0.039."""
    eps = float(ml_dtypes.finfo(q.dtype).eps)
    dout64, q64, kh64, vh64 = (np.asarray(x, np.float64) for x in (dout, q, k, v))
    k64, v64 = conftest.expand_heads(q64, kh64, vh64)
    q32, k32 = (np.asarray(x, np.float32) for x in (q, k))
    p, _, _, _ = conftest.softmax32(q32, k32, options, scale)
    _, grad = conftest.scores32(q32, k32, options, scale)
    pg = p.astype(np.float64) * np.where(np.isfinite(grad), grad, 0).astype(np.float64)   # P ∘ g
    o = p.astype(np.float64) @ v64
    dd = 4 * eps / (2 * math.sqrt(3)) * np.sqrt(((dout64 * o) ** 2).sum(-1))     # (..., Hq, Nq)
    sc = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    dq = sc * dd[..., None] * np.abs(pg @ k64)
    dk = sc * (np.swapaxes(np.abs(pg), -1, -2) @ (dd[..., None] * np.abs(q64)))  # (..., Hq, Nk, d)
    if kh64.shape != k64.shape:                                     # a K/V head's group of query heads
        g = q.shape[-3] // kh64.shape[-3]
        dk = dk.reshape(kh64.shape[:-2] + (g,) + dk.shape[-2:]).sum(axis=-3)
    return float(dq.max(initial=0)), float(dk.max(initial=0)), 0.0


def check_backward_low(grads, dout, q, k, v, causal, scale):
    """Assert 16-bit gradients against the oracle by the module's rule; ``causal``: a bool
    or a dict of score options (:func:`conftest.score_options`)."""
    dt = q.dtype
    options = conftest.score_options(causal)
    rules = conftest.score_rules(options)[0]
    ref = reference.attention_bwd(*(np.asarray(x, np.float64) for x in (dout, q, k, v)), scale=scale, **options)
    base = baseline_bwd_low(dout, q, k, v, options, scale)
    bias = 0.0
    if options["alibi_slopes"] is not None:
        bias = float(np.abs(options["alibi_slopes"]).max()) * max(0, max(q.shape[-2], k.shape[-2]) - 1)
    q64, k64 = (np.asarray(x, np.float64) for x in (q, k))
    mag = max(1.0, float(np.abs(q64).max(initial=0)), float(np.abs(k64).max(initial=0))) ** 2 \
        * math.sqrt(q.shape[-1]) + bias
    eps = float(ml_dtypes.finfo(dt).eps)
    extra = delta_slack(dout, q, k, v, options, scale)
    for name, g, r, b, x in zip(("dq", "dk", "dv"), grads, ref, base, extra):
        assert isinstance(g, np.ndarray) and g.dtype == dt and g.shape == r.shape, name
        g64 = g.astype(np.float64)
        assert not np.isnan(g64).any(), f"NaN in {name} (an element the kernel never wrote?)"
        size = max(1.0, float(np.abs(r).max(initial=0)))
        slack = 2**-24 * 8 * mag
        if rules.softcap is not None:
            slack += 2 * TANH_APPROX * min(rules.softcap, mag)
        err = float(np.abs(g64 - r).max(initial=0))
        tol = 2 * float(np.abs(b.astype(np.float64) - r).max(initial=0)) + eps * size + slack * size + x
        assert err <= tol, f"{name}: max error {err:.3e} > tolerance {tol:.3e}"


class BCase(Case):
    """A backward problem: ``inputs()`` adds the incoming gradient ``dout``."""

    def inputs(self):
        q, k, v = super().inputs()
        dout = np.random.default_rng(self.seed + 1).standard_normal(q.shape).astype(q.dtype)
        return q, k, v, dout


def _run(case, q, k, v, dout, on_device, **options):
    options = dict(causal=case.causal, **options)
    args = (dout, q, k, v)
    if on_device:
        args = tuple(numba_flash.to_device(x) for x in args)
    out, lse = numba_flash.attention_fwd(*args[1:], scale=case.scale, **options)
    grads = numba_flash.attention_bwd(*args, out, lse, scale=case.scale, **options)
    if on_device:
        assert not any(isinstance(g, np.ndarray) for g in grads)
        grads = tuple(host(g) for g in grads)
    return grads


if ON_GPU:
    N_MAX, D_VALUES = 300, (8, 16, 64, 72, 128, 136, 256)
else:
    N_MAX, D_VALUES = 2 * BC + 3, (8, 16, 24, 40)


def sim_fits(batch, nq, nk, d):
    """About 1 s of simulator time at most: blocks × streamed tiles × head-dim steps × slices."""
    t = _T
    tiles = -(-nq // BR) * -(-nk // BC) + -(-nk // BR) * -(-nq // BC)
    return ON_GPU or batch * tiles * (d // 8 + 2) * -(-d // t.DO) <= 56


@st.composite
def cases(draw):
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    d = draw(st.sampled_from(D_VALUES))
    nq, nk = draw(st.integers(1, N_MAX)), draw(st.integers(1, N_MAX))
    while not sim_fits(math.prod(lead), nq, nk, d) and max(nq, nk) > 1:
        nq, nk = max(1, nq * 2 // 3), max(1, nk * 2 // 3)
    if not sim_fits(math.prod(lead), nq, nk, d):
        lead = ()                   # a single 1 × 1 problem always fits
    return BCase(lead=lead, nq=nq, nk=nk, d=d, dtype=draw(st.sampled_from(DTYPES)), causal=draw(st.booleans()),
                 scale=draw(st.none() | st.floats(0.05, 2.0)),
                 magnitude=draw(st.sampled_from([1.0, 4.0]) | st.floats(1.0, 6.0)),
                 seed=draw(st.integers(0, 2**32 - 1)), device=draw(st.integers(0, 3)) == 0)


EDGE_EXAMPLES = [
    BCase((), BR - 1, 5, 16, "bfloat16", scale=0.7, magnitude=5.0, seed=1),
    BCase((), 5, BC + 1, 24, "float16", causal=True, seed=3, device=True),
    BCase((), BR + 1, BC - 6, 40, "bfloat16", causal=True, seed=4),   # diagonal across tiles; 2 output slices
    BCase((), 2 * BR + 3, 3, 8, "bfloat16", causal=True, seed=5),     # Nq > Nk: rows with no key, zero dq
    BCase((), 4, 2 * BC + 3, 8, "float16", causal=True, seed=6),      # Nq < Nk: keys no query sees, zero dk, dv
]


def _with_examples(f):
    for c in reversed(EDGE_EXAMPLES):
        f = example(case=c)(f)
    return f


def test_examples_fit_the_simulator():
    for c in EDGE_EXAMPLES:
        assert sim_fits(math.prod(c.lead), c.nq, c.nk, c.d), c


@_with_examples
@settings(max_examples=40 if ON_GPU else 2)     # the simulator's budget: a few seconds per example
@given(case=cases())
def test_backward_mma_matches_oracle(case):
    note(repr(case))
    q, k, v, dout = case.inputs()
    grads = _run(case, q, k, v, dout, on_device=False)
    check_backward_low(grads, dout, q, k, v, case.causal, case.scale)
    if case.device:
        assert [bits(g) for g in _run(case, q, k, v, dout, on_device=True)] == [bits(g) for g in grads]


@pytest.mark.parametrize("dtype", DTYPES if ON_GPU else ("bfloat16",))
def test_deterministic(dtype):
    """Bitwise identical gradients run to run (no atomics: each block owns its rows). In
    the simulator bfloat16 only: its threads run one at a time, so it checks the
    bookkeeping (no stale buffer, no read of memory nothing wrote), not scheduling."""
    case = BCase((), BR + 3, BC + 1, 8, dtype, causal=True, magnitude=3.0, seed=32)
    q, k, v, dout = case.inputs()
    first, second = (_run(case, q, k, v, dout, False) for _ in range(2))
    assert [bits(g) for g in first] == [bits(g) for g in second]


@pytest.mark.parametrize("dtype", DTYPES if ON_GPU else ("bfloat16",))
def test_grouped_heads_and_rules(dtype):
    """Grouped K/V heads (dk, dv summed over each group) with a window, softcap and ALiBi
    (in the simulator bfloat16 only: float16 differs in the instructions' types, and the
    property tests draw both)."""
    case = BCase((), BR - 3, BC + 5, 8, dtype, magnitude=2.0, seed=33)
    q, k, v, dout = case.inputs()
    q, dout = np.concatenate([q[None]] * 4), np.concatenate([dout[None]] * 4)
    q = q + np.arange(4, dtype=np.float32).reshape(4, 1, 1).astype(q.dtype)   # distinct heads
    k, v = np.stack([k, k[::-1]]), np.stack([v, v[::-1]])
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    options = dict(window=(7, 3), softcap=4.0, alibi_slopes=slopes)
    grads = _run(case, q, k, v, dout, False, **options)
    assert grads[1].shape == k.shape and grads[2].shape == v.shape
    check_backward_low(grads, dout, q, k, v, dict(options, causal=False), None)


@pytest.mark.parametrize("dtype", DTYPES if ON_GPU else ("bfloat16",))
def test_strided_device_inputs_are_copied(dtype):
    """A device view whose rows are not contiguous is copied on the device first; the
    gradients equal those of contiguous inputs (the copy is dtype-blind: in the simulator
    bfloat16 only)."""
    case = BCase((), BR + 2, BC + 3, 8, dtype, causal=True, seed=34)
    q, k, v, dout = case.inputs()
    out, lse = numba_flash.attention_fwd(q, k, v, causal=True)
    wide = np.repeat(k, 2, axis=-1)                     # k[..., c] == wide[..., 2c]
    kd = numba_flash.to_device(wide)[:, ::2]
    dev = [numba_flash.to_device(x) for x in (dout, q)]
    grads = numba_flash.attention_bwd(*dev, kd, numba_flash.to_device(v), numba_flash.to_device(out),
                                      numba_flash.to_device(lse), causal=True)
    want = numba_flash.attention_bwd(dout, q, k, v, out, lse, causal=True)
    assert [bits(host(g)) for g in grads] == [bits(g) for g in want]


def test_lse_dtype_is_checked():
    q, k, v, dout = BCase((), 3, 3, 8, "bfloat16").inputs()
    out, lse = numba_flash.attention_fwd(q, k, v)
    with pytest.raises(TypeError, match=r"lse must have dtype float32 for bfloat16 inputs"):
        numba_flash.attention_bwd(dout, q, k, v, out, lse.astype(ml_dtypes.bfloat16))


# --------------------------------------------------------------------------- GPU only
GPU_SHAPES = [
    # (lead, Nq, Nk, d, dtype, causal)
    ((2,), 1024, 1024, 128, "bfloat16", False),
    ((1, 2), 2048, 2048, 64, "float16", True),
    ((2,), 700, 1500, 96, "bfloat16", True),       # Nq < Nk, causal
    ((2,), 1500, 700, 128, "float16", True),       # Nq > Nk: leading rows see nothing
    ((1,), 1200, 1000, 256, "bfloat16", False),    # two output slices
    ((1,), 900, 1100, 200, "float16", True),
    ((3,), 333, 555, 40, "bfloat16", False),
]


@pytest.mark.skipif(not ON_GPU, reason="GPU-sized shapes: too slow for the CUDA simulator")
@pytest.mark.parametrize("lead,nq,nk,d,dtype,causal", GPU_SHAPES,
                         ids=[f"{'x'.join(map(str, s[0]))}-{s[1]}x{s[2]}-d{s[3]}-{s[4]}-{'causal' if s[5] else 'full'}"
                              for s in GPU_SHAPES])
def test_gpu_large_shapes(lead, nq, nk, d, dtype, causal):
    case = BCase(lead, nq, nk, d, dtype, causal=causal, seed=nq + 7 * nk + d)
    q, k, v, dout = case.inputs()
    grads = _run(case, q, k, v, dout, on_device=True)
    check_backward_low(grads, dout, q, k, v, causal, None)
    assert [bits(g) for g in _run(case, q, k, v, dout, on_device=True)] == [bits(g) for g in grads]


# --------------------------------------------------------------------------- the Hopper family
def _hopper_gpu():
    if not ON_GPU:
        return False
    from numba import cuda
    return cuda.get_current_device().compute_capability == (9, 0)


def _hopper_run(monkeypatch, case, q, k, v, dout, on_device=False, **options):
    """The backward with the Hopper family forced on, asserting that its launches were the
    call's (no silent fallback to ``mma.sync``); out and lse from the float64 oracle (in
    the simulator a forward costs as much as the backward)."""
    from numba_flash import _plans, families
    monkeypatch.setenv(registry.HOPPER_ENV, "1")
    monkeypatch.setattr(_plans, "_PLANS", {})      # a fresh plan: a remembered one skips the planner
    seen = []
    real = families._hopper_backward_launches
    monkeypatch.setattr(families, "_hopper_backward_launches", lambda *a: seen.append(1) or real(*a))
    options = dict(causal=case.causal, scale=case.scale, **options)
    out, lse = reference.attention_fwd(*(np.asarray(x, np.float64) for x in (q, k, v)), **options)
    args = (dout, q, k, v, out.astype(q.dtype), lse.astype(np.float32))
    if on_device:
        args = tuple(numba_flash.to_device(x) for x in args)
    grads = numba_flash.attention_bwd(*args, **options)
    assert seen, "the Hopper backward did not take the call"
    return tuple(host(g) for g in grads) if on_device else grads


def _grouped(case, hkv):
    """The case's inputs with ``hkv`` K/V heads for its query heads (the last lead axis)."""
    q, k, v, dout = case.inputs()
    if not case.lead:           # (no head axis)
        return q, k, v, dout
    return q, k[..., :hkv, :, :].copy(), v[..., :hkv, :, :].copy(), dout


HOPPER_CASES = [    # ragged against the family's 128-row blocks and 64-column tiles
    (BCase((1, 2), 130, 70, 64, "bfloat16", causal=True, magnitude=2.0, seed=41), 1),   # 2 query blocks; 2 -> 1 heads
    (BCase((1,), 40, 200, 128, "float16", scale=0.3, seed=42), 1),                      # the ring wraps
    (BCase((), 20, 30, 64, "bfloat16", seed=45), 1),                                    # q (N, d): no head axis
    (BCase((1, 2), 90, 140, 96, "bfloat16", causal=True, seed=46), 2),     # d = 96: d = 128's kernels, clipped
]


@pytest.mark.parametrize("case,hkv", HOPPER_CASES, ids=["causal-130x70-d64-gqa", "full-40x200-d128", "no-heads-20x30",
                                                        "causal-90x140-d96-gqa"])
def test_hopper_backward_through_the_api(case, hkv, monkeypatch):
    """The Hopper backward (``backward_wgmma``) forced on: in the simulator through
    ``ops_hopper``'s twins, on a GPU of cc 9.0; grouped heads summed into dk, dv."""
    if ON_GPU and not _hopper_gpu():
        pytest.skip("the Hopper family runs on compute capability 9.0 only")
    q, k, v, dout = _grouped(case, hkv)
    grads = _hopper_run(monkeypatch, case, q, k, v, dout)
    check_backward_low(grads, dout, q, k, v, case.causal, case.scale)


@pytest.mark.parametrize("rules", ["window+softcap+alibi", "alibi"])
def test_hopper_backward_score_rules(rules, monkeypatch):
    """The Hopper backward with a window, softcap and ALiBi on grouped heads; and ALiBi
    alone over 200 queries and 300 keys, where some tiles lie wholly on one side of the
    diagonal (ALiBi's linear form) in both kernels and others cross it."""
    if ON_GPU and not _hopper_gpu():
        pytest.skip("the Hopper family runs on compute capability 9.0 only")
    case = BCase((2,), 70, 90, 64, "bfloat16", magnitude=2.0, seed=43)
    options = dict(window=(30, 5), softcap=4.0, alibi_slopes=np.array([0.5, 0.25], np.float32))
    if rules == "alibi":
        case = BCase((1,), 200, 300, 64, "bfloat16", magnitude=2.0, seed=44)
        options = dict(alibi_slopes=np.array([0.03], np.float32))
    q, k, v, dout = _grouped(case, 1)
    grads = _hopper_run(monkeypatch, case, q, k, v, dout, **options)
    check_backward_low(grads, dout, q, k, v, dict(options, causal=False), None)


HOPPER_GPU_SHAPES = [s for s in GPU_SHAPES if registry.VARIANTS["backward_dkdv_wgmma"].head_dims(s[3])] + [
    ((1, 4), 4096, 4096, 128, "bfloat16", True),
    ((2, 2), 1000, 3000, 64, "bfloat16", False),
    ((1,), 16384, 16384, 128, "bfloat16", True),     # the longest rows (the oracle: ~2 GB per N x N matrix)
]


@pytest.mark.parametrize("lead,nq,nk,d,dtype,causal", HOPPER_GPU_SHAPES,
                         ids=[f"{'x'.join(map(str, s[0]))}-{s[1]}x{s[2]}-d{s[3]}-{s[4]}-{'causal' if s[5] else 'full'}"
                              for s in HOPPER_GPU_SHAPES])
def test_gpu_hopper_backward(lead, nq, nk, d, dtype, causal, monkeypatch):
    """The Hopper backward at GPU sizes: against the oracle, bitwise the same run to run,
    and within rounding of the ``mma.sync`` family's gradients."""
    if not _hopper_gpu():
        pytest.skip("the Hopper family runs on compute capability 9.0 only")
    case = BCase(lead, nq, nk, d, dtype, causal=causal, seed=nq + 5 * nk + d)
    q, k, v, dout = case.inputs()
    grads = _hopper_run(monkeypatch, case, q, k, v, dout, on_device=True)
    check_backward_low(grads, dout, q, k, v, causal, None)
    assert [bits(g) for g in _hopper_run(monkeypatch, case, q, k, v, dout, on_device=True)] == \
        [bits(g) for g in grads]
    monkeypatch.setenv(registry.HOPPER_ENV, "0")
    other = _run(case, q, k, v, dout, on_device=True)
    for name, g, o in zip(("dq", "dk", "dv"), grads, other):
        g64, o64 = g.astype(np.float64), o.astype(np.float64)
        size = max(1.0, float(np.abs(o64).max()))
        assert np.abs(g64 - o64).max() <= 8 * float(ml_dtypes.finfo(g.dtype).eps) * size, name
