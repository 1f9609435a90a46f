"""The score options and grouped heads against the float64 oracle: GQA/MQA, sliding
windows (with and without causal), softcapping and ALiBi, alone and together.

Each property test draws the dtype, the heads (Hq and the group ratio, MQA included), the
lengths (Nq != Nk, ragged tiles), the options and a seed for fresh random data, so a few
examples cover many combinations; outputs are NaN-poisoned before each launch
(``conftest.poison_outputs``). Tolerances are those of the plain tests, given the same
options: :func:`conftest.check_forward` (float32, float64),
:func:`test_forward_mma.check_forward_low` (float16, bfloat16) and
:func:`test_backward.check_backward` (float32, float64 gradients).

In the simulator every problem is tiny (a simulated launch costs about a second at these
sizes); on a GPU the lengths and head dims are larger.
"""
import dataclasses
import math

import numpy as np
import pytest
from hypothesis import example, given, note, settings
from hypothesis import strategies as st

import numba_flash  # before numba: it decides whether the simulator is needed
import numba_flash.api
from numba import cuda
from numba_flash import reference, registry
from conftest import ON_GPU, bits, check_forward, host, np_dtype
from test_backward import check_backward
from test_backward_mma import check_backward_low
from numba_flash.testing import check_forward_low

FWD_DTYPES = registry.dtypes("forward")
BWD_DTYPES = registry.dtypes("backward")
LOW = ("float16", "bfloat16")

if ON_GPU:
    N_MAX, HEADS, BH_MAX = 300, (1, 2, 4, 8), 16
    # Few head dims: each (rule set, dtype, d, layout) is a JIT compile of seconds, per
    # worker, and these tests draw many rule sets; the head dims themselves are covered by
    # test_forward, test_forward_mma and test_backward.
    D_VALUES = {"float32": (13, 64), "float64": (24,), "float16": (64,), "bfloat16": (128,)}
    ELEMS_CAP = 1 << 24         # batch · heads · Nq · Nk · d: the float64 oracle stays quick
else:
    N_MAX, HEADS, BH_MAX = 24, (1, 2, 4), 4
    D_VALUES = {"float32": tuple(range(1, 17)), "float64": tuple(range(1, 17)), "float16": (8, 16),
                "bfloat16": (8, 16)}
    FWD_COST_CAP = 30           # about 0.5 s of simulated forward (test_forward.sim_cost)
    BWD_COST_CAP = 24           # about 1.4 s of simulated backward (test_backward.sim_cost)


def sim_cost(bh, nq, nk, d, dtype, backward):
    """Simulator cost of one call (the units of test_forward's and test_backward's
    ``sim_cost``); ``bh``: batch × query heads."""
    if backward and dtype in LOW:
        t = registry.mma_backward_tiling("dkdv")(dtype, d)
        tiles = -(-nq // t.BR) * -(-nk // t.BC) + -(-nk // t.BR) * -(-nq // t.BC)
        return bh * tiles * (d // 8 + 2) * -(-d // t.DO)
    if backward:
        t = registry.backward_tiling(dtype, d)
        rows, cols = t.RG * t.TM, t.CG * t.TN
        tiles = -(-nq // rows) * -(-nk // cols) + -(-nk // rows) * -(-nq // cols)
        return bh * tiles * -(-d // t.DO) * (-(-d // t.DK) + 2)
    if dtype in LOW:
        t = registry.mma_tiling(dtype, d)
        return bh * -(-nq // t.BM) * -(-nk // t.BN) * (d // 8 + 2)
    t = registry.forward_tiling(dtype, d)
    return bh * -(-nq // t.BM) * -(-d // t.DO) * (-(-nk // t.BN) * (-(-d // t.DK) + 1) + 1)


def fits(bh, nq, nk, d, dtype, backward):
    if ON_GPU:
        return bh * nq * nk * d <= ELEMS_CAP
    return sim_cost(bh, nq, nk, d, dtype, backward) <= (BWD_COST_CAP if backward else FWD_COST_CAP)


@dataclasses.dataclass(frozen=True)
class VCase:
    """One problem: q ``batch + (hq, nq, d)``, k and v ``batch + (hkv, nk, d)``, the score
    options, and how the inputs are drawn. ``alibi``: None, ``"head"`` (slopes ``(hq,)``)
    or ``"batch"`` (slopes ``batch + (hq,)``); ``slopes64``: float64 slopes (float64
    inputs only); ``device``: also (forward) or only (backward) with device arrays in and
    out, slopes included."""
    batch: tuple
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int
    dtype: str = "float32"
    causal: bool = False
    window: tuple = None
    softcap: float = None
    alibi: str = None
    scale: float = None
    magnitude: float = 1.0
    seed: int = 0
    device: bool = False
    slopes64: bool = False

    def inputs(self):
        """``(q, k, v, dout, slopes)``: q, k, v, dout in the case's dtype, the slopes
        ``2**-uniform(0.5, 8)`` in float32 (float64 with ``slopes64``) or None."""
        rng = np.random.default_rng(self.seed)
        dt = np_dtype(self.dtype)
        lq, lk = self.batch + (self.hq,), self.batch + (self.hkv,)
        q = rng.standard_normal(lq + (self.nq, self.d)) * self.magnitude
        k = rng.standard_normal(lk + (self.nk, self.d)) * self.magnitude
        v = rng.standard_normal(lk + (self.nk, self.d)) * self.magnitude
        dout = rng.standard_normal(lq + (self.nq, self.d))
        slopes = None
        if self.alibi is not None:
            shape = (self.hq,) if self.alibi == "head" else lq
            slopes = (2.0 ** -rng.uniform(0.5, 8.0, shape)).astype(np.float64 if self.slopes64 else np.float32)
        return q.astype(dt), k.astype(dt), v.astype(dt), dout.astype(dt), slopes

    def options(self, slopes):
        """The API's (and the oracle's) score keywords, with these slopes."""
        return dict(causal=self.causal, window=self.window, softcap=self.softcap, alibi_slopes=slopes)


def to_device(x):
    """A Numba device copy of x (bfloat16 through numba_flash.to_device); None stays None."""
    if x is None:
        return None
    return numba_flash.to_device(x) if x.dtype == np_dtype("bfloat16") else cuda.to_device(x)


# --------------------------------------------------------------------------- strategies
@st.composite
def window_sides(draw, n_max):
    """A window side: None (unbounded), 0 and other small ones, up to wider than any
    length, and (rarely) far beyond it."""
    kind = draw(st.integers(0, 9))
    if kind < 3:
        return None
    if kind < 6:
        return draw(st.integers(0, 3))
    if kind < 9:
        return draw(st.integers(0, 2 * n_max))
    return 10**12


@st.composite
def variant_cases(draw, dtypes):
    dtype = draw(st.sampled_from(dtypes))
    backward = dtypes == BWD_DTYPES
    hq = draw(st.sampled_from(HEADS))
    hkv = hq // draw(st.sampled_from([r for r in HEADS if hq % r == 0]))      # hkv == 1: MQA
    max_b = BH_MAX // hq
    batch = () if max_b < 1 or draw(st.booleans()) else (draw(st.integers(1, min(max_b, 3))),)
    bh = math.prod(batch) * hq
    d = draw(st.sampled_from(D_VALUES[dtype]))
    nq, nk = draw(st.integers(1, N_MAX)), draw(st.integers(1, N_MAX))
    while not fits(bh, nq, nk, d, dtype, backward) and max(nq, nk) > 1:
        nq, nk = max(1, nq * 3 // 4), max(1, nk * 3 // 4)
    window = draw(st.none() | st.tuples(window_sides(N_MAX), window_sides(N_MAX)))
    if window is not None and draw(st.integers(0, 3)) == 0:
        window = list(window)                   # a list is a pair too
    alibi = draw(st.sampled_from([None, "head", "batch"]))
    if alibi == "batch" and not batch:
        alibi = "head"
    low = dtype in LOW
    return VCase(batch=batch, hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, dtype=dtype, causal=draw(st.booleans()),
                 window=window, softcap=draw(st.none() | st.floats(0.5, 50.0)), alibi=alibi,
                 scale=draw(st.none() | st.floats(0.05, 2.0)),
                 magnitude=draw(st.sampled_from([1.0, 4.0] if low else [1.0, 3.0, 30.0])
                                | st.floats(1.0, 8.0 if low else 30.0)),
                 seed=draw(st.integers(0, 2**32 - 1)), device=draw(st.integers(0, 3)) == 0,
                 slopes64=alibi is not None and dtype == "float64" and draw(st.booleans()))


# Edge cases, pinned (tiny: they fit the simulator's budget; checked below).
FWD_EXAMPLES = [
    VCase((), 2, 2, 9, 9, 8, "float32", window=(0, 0), seed=1),                     # the diagonal only
    VCase((2,), 2, 1, 7, 10, 5, "float64", window=(50, 60), seed=2),                 # wider than N; MQA
    VCase((), 4, 2, 10, 13, 8, "bfloat16", causal=True, window=(3, 5), seed=3),      # causal caps right
    VCase((), 2, 2, 20, 6, 8, "float32", window=(2, 1), seed=4),                     # Nq > Nk: empty rows
    VCase((), 2, 1, 21, 5, 8, "float16", window=(1, 0), seed=5),                     # the same, tensor cores
    VCase((), 4, 1, 6, 11, 16, "float16", seed=6),                                   # MQA
    VCase((), 1, 1, 5, 9, 3, "float32", window=(0, None), seed=7),                   # keys from the diagonal on
    VCase((2,), 2, 1, 11, 14, 8, "float32", window=(4, 2), softcap=5.0, alibi="batch", seed=8),   # all at once
    VCase((), 4, 2, 12, 12, 16, "bfloat16", window=(5, 1), softcap=3.0, alibi="head", magnitude=4.0, seed=9,
          device=True),                                                              # all at once, 16-bit
    VCase((1,), 4, 2, 15, 9, 8, "float64", causal=True, window=(None, 4), softcap=1.0, alibi="batch",
          seed=10, device=True),                                                     # device slopes; empty rows
    VCase((), 2, 2, 9, 16, 16, "float32", softcap=0.5, alibi="head", scale=2.0, magnitude=30.0,
          seed=11),                                                                  # the cap saturates
]
BWD_EXAMPLES = [
    VCase((), 4, 2, 8, 8, 6, "float64", window=(0, 0), seed=21),                     # the diagonal only
    VCase((), 2, 1, 14, 5, 4, "float32", window=(2, 1), seed=22),                    # Nq > Nk: empty rows
    VCase((2,), 2, 1, 7, 8, 8, "float32", causal=True, window=(3, 2), softcap=4.0, alibi="batch",
          seed=23),                                                                  # all at once
    VCase((), 4, 1, 7, 8, 5, "float64", window=(40, 100), softcap=20.0, alibi="head", seed=24,
          device=True),                                                              # MQA, wide window
    VCase((), 2, 2, 8, 13, 4, "float32", softcap=0.5, alibi="head", scale=2.0, magnitude=30.0,
          seed=25),                                                                  # the cap saturates
]


def _with_examples(examples):
    """Pin ``examples`` on a property test (Hypothesis runs them first, every time)."""
    def wrap(f):
        for c in reversed(examples):
            f = example(case=c)(f)
        return f
    return wrap


def test_examples_fit_the_simulator():
    """The pinned examples stay cheap in the simulator, and fit the GPU's size cap too."""
    for examples, backward in ((FWD_EXAMPLES, False), (BWD_EXAMPLES, True)):
        for c in examples:
            bh = math.prod(c.batch) * c.hq
            assert bh <= 4 and max(c.nq, c.nk) <= 24 and c.d <= 16, c
            assert sim_cost(bh, c.nq, c.nk, c.d, c.dtype, backward) <= (24 if backward else 30), c


# --------------------------------------------------------------------------- property tests
def _check_forward(case, out, lse, q, k, v, options):
    if case.dtype in LOW:
        check_forward_low(out, lse, q, k, v, options, case.scale)
    else:
        check_forward(out, lse, q, k, v, options, case.scale)


@_with_examples(FWD_EXAMPLES)
@given(case=variant_cases(FWD_DTYPES))
def test_forward_variants_match_oracle(case):
    note(repr(case))
    assert np.isnan(numba_flash.api._POISON), "outputs must be NaN-poisoned"
    q, k, v, _, slopes = case.inputs()
    options = case.options(slopes)
    out, lse = numba_flash.attention_fwd(q, k, v, scale=case.scale, **options)
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    _check_forward(case, out, lse, q, k, v, options)
    if case.device:
        dev = [to_device(x) for x in (q, k, v)]
        dout, dlse = numba_flash.attention_fwd(*dev, scale=case.scale, **case.options(to_device(slopes)))
        assert not isinstance(dout, np.ndarray) and not isinstance(dlse, np.ndarray)
        # The same kernel on the same contiguous layout: bit for bit the NumPy path's result.
        assert bits(host(dout)) == bits(out) and bits(host(dlse)) == bits(lse)


@_with_examples(BWD_EXAMPLES)
@settings(max_examples=40 if ON_GPU else 8)     # the simulator's budget: the backward runs three kernels
@given(case=variant_cases(BWD_DTYPES))
def test_backward_variants_match_oracle(case):
    note(repr(case))
    assert np.isnan(numba_flash.api._POISON), "outputs must be NaN-poisoned"
    q, k, v, dout, slopes = case.inputs()
    options = case.options(slopes)
    args = (dout, q, k, v)
    run_options = options
    if case.device:
        args = tuple(to_device(x) for x in args)
        run_options = case.options(to_device(slopes))
    out, lse = numba_flash.attention_fwd(*args[1:], scale=case.scale, **run_options)
    grads = numba_flash.attention_bwd(*args, out, lse, scale=case.scale, **run_options)
    if case.device:
        assert not any(isinstance(g, np.ndarray) for g in grads)
        grads = [host(g) for g in grads]
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    (check_backward_low if case.dtype in LOW else check_backward)(grads, dout, q, k, v, options, case.scale)


@pytest.mark.parametrize("dtype,backward", [("float32", False), ("float64", False), ("bfloat16", False),
                                            ("float32", True), ("float64", True)])
def test_softcap_saturates(dtype, backward):
    """Scores far beyond the cap (|s / c| in the hundreds and more): tanh saturates to ±1,
    the capped scores are ±c and the softcap's derivative is 0, with no overflow on the way."""
    case = VCase((), 2, 1, 5, 8, 8, dtype, softcap=0.5, magnitude=30.0, seed=41)
    q, k, v, dout, _ = case.inputs()
    options = case.options(None)
    if not backward:
        out, lse = numba_flash.attention_fwd(q, k, v, **options)
        (check_forward_low if dtype in LOW else check_forward)(out, lse, q, k, v, options, None)
        return
    out, lse = (x.astype(dtype) for x in reference.attention_fwd(q, k, v, **options))   # the backward alone
    grads = numba_flash.attention_bwd(dout, q, k, v, out, lse, **options)
    check_backward(grads, dout, q, k, v, options, None)


def test_gqa_backward_is_deterministic():
    """Grouped heads sum into dk, dv in a fixed order: two runs agree bit for bit."""
    if ON_GPU:
        case = VCase((2,), 8, 2, 300, 333, 64, "float32", window=(70, 20), softcap=3.0, alibi="batch", seed=31)
    else:   # two query heads per K/V head, two key tiles and two query tiles for the dK/dV blocks
        case = VCase((), 2, 1, 13, 11, 8, "float32", window=(6, 2), softcap=3.0, alibi="head", magnitude=3.0,
                     seed=31)
    q, k, v, dout, slopes = case.inputs()
    options = case.options(slopes)
    out, lse = numba_flash.attention_fwd(q, k, v, **options)
    first = numba_flash.attention_bwd(dout, q, k, v, out, lse, **options)
    second = numba_flash.attention_bwd(dout, q, k, v, out, lse, **options)
    assert first[1].shape == k.shape and first[2].shape == v.shape
    assert [bits(g) for g in first] == [bits(g) for g in second], "backward must be bitwise reproducible"
    check_backward(first, dout, q, k, v, options, None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_heads_over_several_launches(dtype):
    """Leading dims that fold into more than two groups run one launch per batch index:
    here the slopes of shape (Hq,) broadcast over the batch (stride 0), so batch and K/V
    head cannot merge. Each launch's views of the repeated K/V heads (stride 0) must keep
    their shape: Numba's device-array indexing collapsed them (out-of-bounds reads that
    compute-sanitizer found), ``_arrays.sub_array`` does not."""
    # (17 queries: more than registry.SPLIT_ROWS, so the 16-bit forward is one launch, not a split and a merge)
    case = VCase((2,), 4, 2, 17, 7, 16, dtype, window=(3, None), softcap=3.0, alibi="head", seed=33)
    q, k, v, dout, slopes = case.inputs()
    options = case.options(slopes)
    _, launches = numba_flash.api.plan_forward(q, k, v, **options)
    assert len(launches) == 2, "one launch per batch index"
    for launch in launches:
        q4, k4 = launch[4][0], launch[4][1]
        assert tuple(k4.shape)[:2] == tuple(q4.shape)[:2] == (2, 2) and k4.strides[1] == 0
    out, lse = numba_flash.attention_fwd(q, k, v, **options)
    _check_forward(case, out, lse, q, k, v, options)
    if dtype == "float32":
        grads = numba_flash.attention_bwd(dout, q, k, v, out, lse, **options)
        check_backward(grads, dout, q, k, v, options, None)


@pytest.mark.parametrize("case,folds", [
    (VCase((2,), 4, 1, 1, 37, 16, "bfloat16", causal=True, softcap=5.0, seed=41), True),   # decoding, MQA
    (VCase((), 8, 2, 3, 29, 8, "float32", seed=42), True),                  # 3 queries x 4 heads: 12 rows
    (VCase((), 4, 2, 1, 20, 16, "float16", window=(5, None), seed=43), False),   # a left bound: positions matter
    (VCase((), 4, 2, 1, 20, 8, "float32", alibi="head", seed=44), False),       # a slope per query head
    (VCase((), 4, 2, 2, 20, 8, "float64", causal=True, seed=45), False),        # causal with two queries
    (VCase((), 4, 2, 2, 21, 16, "bfloat16", seed=46, device=True), False),      # q's heads not foldable (below)
    (VCase((), 4, 2, 17, 9, 8, "float32", seed=47), False),                     # more rows than the decoding kernel's
], ids=lambda x: x if isinstance(x, bool) else f"{x.dtype}-nq{x.nq}")
def test_decoding_folds_group_heads_into_rows(case, folds, monkeypatch):
    """Few queries with grouped heads (``families._group_rows``): a group's query heads are
    one block's rows when every row sees the same keys (causal dropped with one query, a
    softcap kept), so K/V are read once per group; not with a left window bound, ALiBi,
    causal over several queries, or a q whose head axis does not fold into its rows (here
    a view of a ``(Nq, Hq, d)`` layout). Either way the oracle's result."""
    from numba_flash import families
    found = []
    real = families._group_rows
    monkeypatch.setattr(families, "_group_rows", lambda *a: found.append(real(*a)) or found[-1])
    q, k, v, _, slopes = case.inputs()
    options = case.options(slopes)
    args = (q, k, v)
    if case.device:         # q (Hq, Nq, d) as a view of (Nq, Hq, d) memory: head stride d, row stride Hq·d
        from numba_flash import _arrays
        qt = numba_flash.to_device(np.ascontiguousarray(q.transpose(1, 0, 2)))
        qv = _arrays.strided_view(qt, q.shape, (case.d * 2, case.hq * case.d * 2, 2))
        args = (qv, to_device(k), to_device(v))
    out, lse = numba_flash.attention_fwd(*args, scale=case.scale, **options)
    assert len(found) == 1 and (found[0] is not None) == folds
    _check_forward(case, host(out), host(lse), q, k, v, options)


def test_oracle_groups_are_repeated_heads():
    """The oracle's GQA is its plain attention on K/V heads repeated (dk, dv summed back):
    the baselines of these tests rely on it."""
    case = VCase((2,), 4, 2, 5, 7, 3, "float64", window=(2, 1), softcap=2.0, alibi="batch", seed=32)
    q, k, v, dout, slopes = case.inputs()
    options = case.options(slopes)
    kr, vr = (np.repeat(x, 2, axis=-3) for x in (k, v))
    for a, b in zip(reference.attention_fwd(q, k, v, **options), reference.attention_fwd(q, kr, vr, **options)):
        np.testing.assert_array_equal(a, b)
    dq, dk, dv = reference.attention_bwd(dout, q, k, v, **options)
    dq_r, dk_r, dv_r = reference.attention_bwd(dout, q, kr, vr, **options)
    np.testing.assert_array_equal(dq, dq_r)
    np.testing.assert_allclose(dk, dk_r.reshape(2, 2, 2, 7, 3).sum(axis=2), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(dv, dv_r.reshape(2, 2, 2, 7, 3).sum(axis=2), rtol=1e-13, atol=1e-13)


# --------------------------------------------------------------------------- bad inputs
def _qkv(hq=4, hkv=2, lead=(2,)):
    rng = np.random.default_rng(0)
    q = rng.standard_normal(lead + (hq, 5, 8)).astype(np.float32)
    k = rng.standard_normal(lead + (hkv, 6, 8)).astype(np.float32)
    return q, k, k.copy()


SLOPES = np.full(4, 0.5, np.float32)

BAD_OPTIONS = [
    # (id, q/k/v maker arguments, options, exception, message)
    ("heads-not-a-multiple", dict(hkv=3), {}, ValueError, r"q's heads a multiple of k's"),
    ("heads-more-kv", dict(hq=2, hkv=4), {}, ValueError, r"q's heads a multiple of k's"),
    ("window-left-negative", {}, dict(window=(-1, 0)), ValueError, r"window left must be >= 0"),
    ("window-right-negative", {}, dict(window=(None, -3)), ValueError, r"window right must be >= 0"),
    ("window-int", {}, dict(window=4), TypeError, r"window must be a pair"),
    ("window-triple", {}, dict(window=(1, 2, 3)), TypeError, r"window must be a pair"),
    ("window-float-side", {}, dict(window=(1.5, 0)), TypeError, r"window left must be an int"),
    ("window-bool-side", {}, dict(window=(0, True)), TypeError, r"window right must be an int"),
    ("softcap-zero", {}, dict(softcap=0.0), ValueError, r"softcap must be finite and > 0"),
    ("softcap-negative", {}, dict(softcap=-2), ValueError, r"softcap must be finite and > 0"),
    ("softcap-inf", {}, dict(softcap=math.inf), ValueError, r"softcap must be finite and > 0"),
    ("softcap-str", {}, dict(softcap="30"), TypeError, r"softcap must be a positive float"),
    ("softcap-bool", {}, dict(softcap=True), TypeError, r"softcap must be a positive float"),
    ("slopes-short", {}, dict(alibi_slopes=np.ones(3, np.float32)), ValueError, r"alibi_slopes must have shape"),
    ("slopes-kv-heads", {}, dict(alibi_slopes=np.ones(2, np.float32)), ValueError,
     r"alibi_slopes must have shape"),
    ("slopes-2d", {}, dict(alibi_slopes=np.ones((1, 4), np.float32)), ValueError, r"alibi_slopes must have shape"),
    ("slopes-3d", {}, dict(alibi_slopes=np.ones((2, 4, 1), np.float32)), ValueError,
     r"alibi_slopes must have shape"),
    ("slopes-int", {}, dict(alibi_slopes=np.ones(4, np.int64)), TypeError, r"alibi_slopes must be float32"),
    ("slopes-float16", {}, dict(alibi_slopes=np.ones(4, np.float16)), TypeError, r"alibi_slopes must be float32"),
    ("slopes-float64", {}, dict(alibi_slopes=np.ones(4, np.float64)), TypeError, r"alibi_slopes must be float32"),
    ("slopes-list", {}, dict(alibi_slopes=[0.5] * 4), TypeError,
     r"alibi_slopes must be a NumPy array or a CUDA device array"),
    ("slopes-no-head-axis", dict(lead=None), dict(alibi_slopes=np.ones(1, np.float32)), ValueError,
     r"alibi_slopes needs a head axis"),
]


@pytest.mark.parametrize("fn", ["attention_fwd", "attention", "attention_bwd"])
@pytest.mark.parametrize("make,options,exc,match", [b[1:] for b in BAD_OPTIONS], ids=[b[0] for b in BAD_OPTIONS])
def test_bad_options(fn, make, options, exc, match, monkeypatch):
    """A clear error, before any kernel launch."""
    if make.get("lead", ()) is None:            # 2-D q, k, v: no head axis
        q, k, v = (x[0, 0] for x in _qkv(hq=1, hkv=1))
    else:
        q, k, v = _qkv(**make)
    monkeypatch.setattr(numba_flash.api, "launch", _forbidden)
    with pytest.raises(exc, match=match):
        _call(fn, q, k, v, options)


def _forbidden(*args, **kwargs):
    raise AssertionError("a kernel was launched, or device memory copied, before the error")


def _call(fn, q, k, v, options, lse=None):
    """``fn`` on q, k, v (the backward with dout = out = q, and ``lse``: zeros by default)."""
    if fn == "attention_bwd":
        lse = np.zeros(tuple(q.shape)[:-1], np.float32) if lse is None else lse
        return numba_flash.attention_bwd(q, q, k, v, q, lse, **options)
    return getattr(numba_flash, fn)(q, k, v, **options)


@pytest.mark.parametrize("fn", ["attention_fwd", "attention_bwd"])
def test_slopes_on_the_other_side(fn, monkeypatch):
    """Slopes must be the same kind of array as q: NumPy with NumPy, device with device."""
    q, k, v = _qkv()
    qd, kd, vd = (cuda.to_device(x) for x in (q, k, v))
    slopes_dev = cuda.to_device(SLOPES)
    lse_dev = cuda.to_device(np.zeros(q.shape[:-1], np.float32))
    monkeypatch.setattr(numba_flash.api, "launch", _forbidden)
    monkeypatch.setattr(cuda, "to_device", _forbidden)
    with pytest.raises(TypeError, match=r"alibi_slopes is a NumPy array but q is a device array"):
        _call(fn, qd, kd, vd, dict(alibi_slopes=SLOPES), lse_dev)
    with pytest.raises(TypeError, match=r"alibi_slopes is a device array but q is a NumPy array"):
        _call(fn, q, k, v, dict(alibi_slopes=slopes_dev))


@pytest.mark.parametrize("options,exc,match", [
    (dict(window=(-1, 0)), ValueError, r"window left must be >= 0"),
    (dict(window=5), TypeError, r"window must be a pair"),
    (dict(softcap=0.0), ValueError, r"softcap must be finite and > 0"),
], ids=["window-negative", "window-int", "softcap-zero"])
def test_oracle_rejects_bad_options(options, exc, match):
    """The oracle takes the options through the same parser, with the same errors."""
    q, k, v = _qkv()
    with pytest.raises(exc, match=match):
        reference.attention_fwd(q, k, v, **options)
    with pytest.raises(ValueError, match=r"multiple of k's"):
        reference.attention_fwd(*_qkv(hkv=3))
