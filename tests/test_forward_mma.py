"""The tensor-core forward (float16, bfloat16) against the float64 oracle.

Tolerance (FlashAttention's rule): ``max|out - oracle| <= 2 · max|baseline - oracle|``
plus a floor, where the baseline is NumPy on the same 16-bit inputs with float32
scores, softmax and accumulation, P rounded to the input dtype before P·V (a
tensor-core P·V takes 16-bit operands) and the output rounded to the input dtype.
The floor is one unit in the last place of max|v| in the input dtype (one output
rounding), plus the float32 logit-rounding slack of the float32 tests (scores are
accumulated in a different order than NumPy's). ``lse`` (float32) gets the float32 rule.

With a softcap the kernels take tanh from the special-function unit (``tanh.approx.f32``,
``numba_flash.scores.SOFTCAP_TANH``): relative error at most 2⁻¹¹ by the PTX manual, so
the capped score ``c·t`` may be off by 2⁻¹¹·|c·t|, an error of the kind the logit-rounding
term bounds (with A_ij ≥ |c·t|, :func:`conftest.rounding_sensitivity`): it adds
``2 · 2⁻¹¹`` times the problem's sensitivity.
"""
import dataclasses
import inspect
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, note
from hypothesis import strategies as st

import numba_flash  # before numba: it decides whether the simulator is needed
from numba_flash import registry
from numba_flash.kernels.forward_mma import MmaTiling
from numba_flash.scores import CAUSAL, PACKED
from numba_flash.testing import check_forward_low
from conftest import ON_GPU, Case, bits, host

DTYPES = registry.VARIANTS["forward_mma"].dtypes     # the tensor-core forward
NP_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def _run(case, q, k, v, on_device):
    if on_device:
        q, k, v = (numba_flash.to_device(x) for x in (q, k, v))
    out, lse = numba_flash.attention_fwd(q, k, v, causal=case.causal, scale=case.scale)
    if on_device:
        assert not isinstance(out, np.ndarray) and out.dtype == NP_DTYPES[case.dtype]
        out, lse = host(out), host(lse)
    return out, lse


def _force_hopper(monkeypatch, cache=True):
    """The Hopper family forced for the test (``registry.HOPPER_ENV``), which stops here on a
    GPU of another compute capability than 9.0 (the variable cannot give a GPU instructions
    it lacks); ``cache=False``: no kernel cache (kernels forced by a test share the
    registry's names)."""
    if ON_GPU:
        from numba import cuda
        if cuda.get_current_device().compute_capability != (9, 0):
            pytest.skip("the Hopper family runs on compute capability 9.0 only")
    monkeypatch.setenv(registry.HOPPER_ENV, "1")
    if not cache:
        monkeypatch.setenv("NUMBA_FLASH_CACHE", "0")


_T = registry.mma_tiling("bfloat16", 16)
BM, BN = _T.BM, _T.BN
if ON_GPU:
    # Each new (dtype, d, causal) is a JIT compile of a few seconds: a few head dims here
    # (one per tiling rule and its edges); GPU_SHAPES below and the PTX checks cover others.
    N_MAX, D_VALUES = 600, (16, 64, 72, 128, 136, 256)
else:
    N_MAX, D_VALUES = 3 * BN + 2, (8, 16, 24, 32, 48, 64)


def sim_fits(batch, nq, nk, d):
    """About 2 s of simulator time at most: blocks × K/V tiles × head-dim steps."""
    return ON_GPU or batch * -(-nq // BM) * -(-nk // BN) * (d // 8 + 2) <= 60


@st.composite
def cases(draw):
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    d = draw(st.sampled_from(D_VALUES))
    nq = draw(st.integers(1, N_MAX))
    nk = draw(st.integers(1, N_MAX))
    while not sim_fits(math.prod(lead), nq, nk, d):
        nq, nk = max(1, nq * 2 // 3), max(1, nk * 2 // 3)
    return Case(lead=lead, nq=nq, nk=nk, d=d, dtype=draw(st.sampled_from(DTYPES)), causal=draw(st.booleans()),
                scale=draw(st.none() | st.floats(0.05, 2.0)),
                magnitude=draw(st.sampled_from([1.0, 4.0]) | st.floats(1.0, 8.0)),
                seed=draw(st.integers(0, 2**32 - 1)), device=draw(st.integers(0, 3)) == 0)


EDGE_EXAMPLES = [
    Case((), BM - 1, 5, 16, "bfloat16", seed=1), Case((), BM + 1, 5, 8, "float16", causal=True, seed=2),
    Case((), 5, BN - 1, 24, "float16", seed=3), Case((), 5, BN, 16, "bfloat16", causal=True, seed=4),
    Case((), 3, BN + 1, 16, "bfloat16", causal=True, seed=5, device=True),
    Case((), BM + 1, BM + 1, 16, "float16", causal=True, seed=6),            # diagonal across tiles
    Case((), 2 * BM + 3, 3, 8, "bfloat16", causal=True, seed=7),             # Nq > Nk: empty rows, tiles
    Case((2,), 4, 2 * BN + 3, 8, "float16", causal=True, seed=8),            # Nq < Nk: bottom-right
    Case((2, 2), 5, 6, 40, "bfloat16", scale=0.7, magnitude=6.0, seed=9, device=True),
    Case((), 1, 1, 8, "float16", seed=10),
]


def _with_examples(f):
    for c in reversed(EDGE_EXAMPLES):
        f = example(case=c)(f)
    return f


@_with_examples
@given(case=cases())
def test_forward_mma_matches_oracle(case):
    note(repr(case))
    q, k, v = case.inputs()
    out, lse = _run(case, q, k, v, on_device=False)
    check_forward_low(out, lse, q, k, v, case.causal, case.scale)
    if case.device:
        dout, dlse = _run(case, q, k, v, on_device=True)
        assert bits(dout) == bits(out) and bits(dlse) == bits(lse)


HOPPER_EXAMPLES = [     # ragged against the family's 128-row, 128-key tiles; the ring wraps in the second
    Case((), 100, 150, 64, "bfloat16", causal=True, seed=11),
    Case((2,), 130, 300, 64, "float16", scale=0.5, seed=12, device=True),
    # causal, Nq > Nk: query tiles that see no key among those that do, d = 128 (two consumers)
    Case((2,), 300, 90, 128, "bfloat16", causal=True, seed=13),
    # d = 256: 64-key tiles (a ragged last one), one Q buffer, O as two 128-column halves
    Case((), 150, 170, 256, "bfloat16", causal=True, seed=14),
    Case((2,), 70, 100, 256, "float16", seed=15, device=True),
    # head dims between: the kernels of 128 and 256 on zero columns, the output clipped
    Case((), 150, 170, 96, "bfloat16", causal=True, seed=16),
    Case((2,), 70, 100, 200, "float16", seed=17),
]


@pytest.mark.parametrize("case", HOPPER_EXAMPLES, ids=["causal-100x150", "full-130x300", "causal-300x90",
                                                      "d256-causal-150x170", "d256-full-70x100", "d96-causal-150x170",
                                                      "d200-full-70x100"])
def test_hopper_family_through_the_api(case, monkeypatch):
    """The Hopper family forced on (``NUMBA_FLASH_HOPPER=1``): in the simulator through
    ``ops_hopper``'s twins, on a GPU where it is one of cc 9.0 (elsewhere the variable
    cannot give a GPU the instructions it lacks, so the test stops there)."""
    _force_hopper(monkeypatch)
    assert registry.forward_specialisation(case.dtype, case.d, registry.FULL, True, cc=(9, 0)).variant == "forward_wgmma"
    q, k, v = case.inputs()
    _assert_hopper_launch(q, k, v, causal=case.causal, scale=case.scale)
    out, lse = _run(case, q, k, v, on_device=case.device)
    check_forward_low(out, lse, q, k, v, case.causal, case.scale)


def _assert_hopper_launch(q, k, v, **options):
    """The call's forward launch is the Hopper family's (no silent fallback)."""
    from numba_flash import api
    _, launches = api.plan_forward(q, k, v, **options)
    assert "forward_wgmma" in launches[-1][0].py_func.__module__, launches[-1][0].py_func.__module__


@pytest.mark.parametrize("pingpong, rules", [(True, "window+softcap+alibi"), (False, "window+softcap+alibi"),
                                             (True, "causal+softcap"), (True, "alibi"), (True, "softcap+alibi")])
def test_hopper_family_score_rules(pingpong, rules, monkeypatch):
    """The Hopper family with a window, softcap and ALiBi (the scores' general path), with
    and without the consumers' ping-pong (the kernel is built directly for the second,
    with half its exponentials by ``ops.exp2_fma``); with a softcap alone (its tanh
    taken before the maxima, the cap in exp2's FMA); and ALiBi with and without a softcap
    over more keys than queries (200 x 300), where some key tiles lie wholly before or
    after a warpgroup's diagonal (ALiBi's linear split) and some cross it."""
    from numba_flash.kernels import forward_wgmma
    _force_hopper(monkeypatch)
    if not pingpong:
        plain = forward_wgmma.make_forward_wgmma
        monkeypatch.setattr(forward_wgmma, "make_forward_wgmma",
                            lambda dt, d, scores, **kw: plain(dt, d, scores, pingpong=False, exp2_fma=2, **kw))
    rng = np.random.default_rng(13 + pingpong)
    q = rng.standard_normal((2, 70, 64)).astype(ml_dtypes.bfloat16)
    k, v = (rng.standard_normal((2, 140, 64)).astype(ml_dtypes.bfloat16) for _ in range(2))
    opts = {"window": (40, 7), "softcap": 3.0, "alibi_slopes": np.array([0.25, 0.0625], np.float32)}
    if rules == "causal+softcap":
        opts = {"causal": True, "softcap": 2.0}
    if rules in ("alibi", "softcap+alibi"):
        q = rng.standard_normal((1, 200, 64)).astype(ml_dtypes.bfloat16)
        k, v = (rng.standard_normal((1, 300, 64)).astype(ml_dtypes.bfloat16) for _ in range(2))
        opts = {"alibi_slopes": np.array([0.03], np.float32)}
        if rules == "softcap+alibi":
            opts = {"alibi_slopes": np.array([-0.01], np.float32), "softcap": 4.0}
    _assert_hopper_launch(q, k, v, **opts)
    out, lse = numba_flash.attention_fwd(q, k, v, **opts)
    check_forward_low(out, lse, q, k, v, opts, None)


@pytest.mark.parametrize("of4", [2, 3, 4])
def test_hopper_softcap_tanh_polynomial(of4, monkeypatch):
    """A softcap alone with its tanh by ``forward_wgmma.TANH_POLY_COEFFS`` where a warp's
    tile allows it (``make_forward_wgmma``'s ``tanh_poly``: ``of4`` of every four scores,
    the others by tanh.approx): 128 query rows, the first
    warpgroup's 64 with scores within the polynomial's range (q scaled by 0.6: |cap_in ·
    s| up to about 0.8, where a coefficient wrong by 0.1 or of the wrong sign shows; one
    wrong by 0.02 stays within bf16's tolerance), the
    second's with scores beyond it in every key tile (q scaled by 2: a vote that fails);
    200 keys, the second tile ragged. Both within the oracle's tolerance; the first rows'
    bits differ from tanh.approx's (the same kernel built with ``tanh_poly=0``: the
    polynomial ran there), the second rows' are tanh.approx's (each of their warps fell
    back)."""
    _force_hopper(monkeypatch, cache=False)
    rng = np.random.default_rng(61)
    q = rng.standard_normal((1, 128, 64)) * np.repeat([0.6, 2.0], 64)[:, None]
    q = q.astype(ml_dtypes.bfloat16)
    k, v = (rng.standard_normal((1, 200, 64)).astype(ml_dtypes.bfloat16) for _ in range(2))
    opts = {"softcap": 3.0}
    _assert_hopper_launch(q, k, v, **opts)
    call = lambda: numba_flash.attention_fwd(q, k, v, **opts)  # noqa: E731
    default, _ = _run_built(monkeypatch, call, tanh_poly=0)
    (out, lse), _ = _run_built(monkeypatch, call, tanh_poly=of4)
    check_forward_low(out, lse, q, k, v, opts, None)
    assert bits(out[:, :64]) != bits(default[0][:, :64])
    assert bits(out[:, 64:]) == bits(default[0][:, 64:]) and bits(lse[:, 64:]) == bits(default[1][:, 64:])


def _run_built(monkeypatch, call, **options):
    """``call()``'s results on the host and the Hopper kernel that computed them, built with
    ``make_forward_wgmma``'s ``options`` over the registry's arguments (each checked on
    the kernel's attribute of that name)."""
    from numba_flash.kernels import forward_wgmma
    plain, built = forward_wgmma.make_forward_wgmma, []
    monkeypatch.setattr(forward_wgmma, "make_forward_wgmma",
                        lambda dt, d, scores, **kw: built.append(plain(dt, d, scores, **{**kw, **options}))
                        or built[-1])
    result = [host(x) for x in call()]
    monkeypatch.setattr(forward_wgmma, "make_forward_wgmma", plain)
    assert all(getattr(built[-1], name) == value for name, value in options.items()), options
    return result, built[-1]


@pytest.mark.parametrize("d, keys, causal", [(64, 128, False), (64, 128, True)])
def test_hopper_softcap_in_192_row_blocks(d, keys, causal, monkeypatch):
    """A softcap in 192-row blocks (three consumer warpgroups:
    ``forward_wgmma.SOFTCAP_TILES``, at d = 64 of 128-key tiles), with the polynomial tanh
    for three of every four scores (``TANH_POLY``): 200 query rows (the second block's 8
    rows ragged), 150 keys (the last tile ragged), the oracle's answer. Causal rows take
    these blocks past ``NARROW_CAUSAL_ROWS`` query rows (set to 0 here: the tiny call
    stands for a long one)."""
    from numba_flash.kernels import forward_wgmma
    _force_hopper(monkeypatch, cache=False)
    monkeypatch.setattr(forward_wgmma, "SOFTCAP_TILES", {d: (192, keys)})
    monkeypatch.setattr(forward_wgmma, "TANH_POLY", {d: 3})
    monkeypatch.setattr(forward_wgmma, "NARROW_CAUSAL_ROWS", 0)
    rng = np.random.default_rng()
    q = (rng.standard_normal((1, 200, d)) * 0.6).astype(ml_dtypes.bfloat16)
    k, v = (rng.standard_normal((1, 150, d)).astype(ml_dtypes.bfloat16) for _ in range(2))
    opts = {"softcap": 3.0, "causal": causal}
    from numba_flash import api
    _, launches = api.plan_forward(q, k, v, **opts)
    kernel = launches[-1][0]
    assert "forward_wgmma" in kernel.py_func.__module__ and kernel.threads == forward_wgmma.threads_for(192)
    assert kernel.tanh_poly == 3 and kernel.smem_bytes == forward_wgmma.smem_bytes(d, bn=keys, bm=192)
    out, lse = numba_flash.attention_fwd(q, k, v, **opts)
    check_forward_low(out, lse, q, k, v, opts, None)


@pytest.mark.parametrize("d", [256, 72])
def test_hopper_head_dims_beyond_64_and_128_score_rules(d, monkeypatch):
    """d = 256 (O's 128 registers a thread) and d = 72 (the d = 128 kernel on zero columns)
    on the Hopper family with a window, a softcap and ALiBi (the scores' general path)."""
    _force_hopper(monkeypatch)
    rng = np.random.default_rng(16 + d)
    q = rng.standard_normal((2, 130, d)).astype(ml_dtypes.bfloat16)
    k, v = (rng.standard_normal((2, 150, d)).astype(ml_dtypes.bfloat16) for _ in range(2))
    opts = {"window": (90, 3), "softcap": 3.0, "alibi_slopes": np.array([0.25, 0.0625], np.float32)}
    _assert_hopper_launch(q, k, v, **opts)
    out, lse = numba_flash.attention_fwd(q, k, v, **opts)
    check_forward_low(out, lse, q, k, v, opts, None)


@pytest.mark.parametrize("d", [72, 136, 192])
def test_hopper_skips_the_zero_columns_k_steps(d, monkeypatch):
    """At a head dim between the kernels' (the columns past ``d`` zeros that the TMA
    fills), S = Q Kᵀ issues only the k-steps of 16 columns that reach below ``d``
    (``wgmma_parts.make_row_product``'s ``cols``: 5 of 8 at d = 72, 9 of 16 at 136, a
    sub-tile of one step), and up to 192 columns the d = 256 kernel's P V takes three
    64-column atoms (``wgmma_parts.o_columns``: O's second half of 64 columns): the same
    bits as the kernel that issues every step over all 256 columns (a zero product adds
    exactly 0; O's columns are independent), and the oracle's answer."""
    from numba_flash import api, scores
    from numba_flash.kernels import forward_wgmma, wgmma_parts
    from numba_flash.launch import launch
    _force_hopper(monkeypatch, cache=False)
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((1, 2, 150, d)).astype(ml_dtypes.bfloat16) for _ in range(3))
    outs = []
    for every in (False, True):
        result, launches = api.plan_forward(q, k, v, causal=True)
        if every:          # the same kernel with every k-step issued, and O of all D columns
            spec = registry.forward_specialisation("bfloat16", d, scores.ScoreSpec(causal=True), True, rows=150,
                                                   cc=(9, 0))
            assert spec.variant == "forward_wgmma", spec
            steps = wgmma_parts.make_row_product
            monkeypatch.setattr(forward_wgmma, "make_row_product", lambda *a, cols=None: steps(*a))
            wide = wgmma_parts.o_columns
            monkeypatch.setattr(wgmma_parts, "o_columns", lambda D, cols=None: wide(D))
            monkeypatch.setattr(forward_wgmma, "o_columns", lambda D, cols=None: wide(D))
            for made in (wgmma_parts.make_column_product, wgmma_parts.make_store_rows):
                made.cache_clear()
            try:
                kern = forward_wgmma.make_forward_wgmma.__wrapped__(
                    spec.dtype, spec.d, spec.scores, bn=spec.tiling.BN, bm=spec.tiling.BM,
                    fixed_max=forward_wgmma.FIXED_MAX_SOFTCAP)
            finally:
                for made in (wgmma_parts.make_column_product, wgmma_parts.make_store_rows):
                    made.cache_clear()          # (built under the patch)
            launches[-1] = (kern,) + tuple(launches[-1][1:])
        for args in launches:
            launch(*args)
        outs.append([host(x) for x in result()])
    assert bits(outs[0][0]) == bits(outs[1][0]) and bits(outs[0][1]) == bits(outs[1][1])
    check_forward_low(outs[0][0], outs[0][1], q, k, v, {"causal": True}, None)


@pytest.mark.parametrize("d", [64, 256])
def test_hopper_lazy_maxima(d, monkeypatch):
    """Lazy maxima (the factory's ``slack``, ``forward_wgmma.RESCALE_SLACK``, here 8): rows
    whose maxima rise from key tile to key tile by less than the slack (the old maximum
    kept, P's values above 1, O not rescaled) and by more (raised, O rescaled), in the same
    tiles; without the rescale the output is wrong by about 0.5. Each key tile's keys
    lie along the query rows' shared direction with a length growing tile by tile, and
    the query rows' lengths spread the rises over both sides of the slack."""
    from numba_flash.kernels import forward_wgmma
    _force_hopper(monkeypatch, cache=False)
    plain = forward_wgmma.make_forward_wgmma
    monkeypatch.setattr(forward_wgmma, "make_forward_wgmma", lambda dt, d, scores, **kw: plain(dt, d, scores, slack=8.0,
                                                                                                **kw))
    bn = forward_wgmma.tiling(d, registry.FULL).BN
    nq, nk = 90, 3 * bn + bn // 2                      # three whole key tiles and a ragged one
    rng = np.random.default_rng(30 + d)
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    scale = 1 / math.sqrt(d)
    # a query row of length a and a key of length b along u score about a·b·scale·log2(e)
    # in log2 units; the key tiles' lengths step by `step`, the rows' a in [0.2, 2.6] make
    # the rises per tile 0.2·6 to 2.6·6 log2 units: below and above the slack of 8
    a = np.linspace(0.2, 2.6, nq)
    step = 6.0 / (scale * math.log2(math.e))
    b = step * (np.arange(nk) // bn + rng.uniform(0, 0.3, nk))
    q = a[:, None] * u + 0.05 * rng.standard_normal((nq, d))
    k = b[:, None] * u + 0.05 * rng.standard_normal((nk, d))
    v = rng.standard_normal((nk, d))
    q, k, v = (x[None].astype(ml_dtypes.bfloat16) for x in (q, k, v))
    _assert_hopper_launch(q, k, v)
    out, lse = numba_flash.attention_fwd(q, k, v)
    check_forward_low(out, lse, q, k, v, False, None)


def test_hopper_other_head_dims_only_where_forced(monkeypatch):
    """On a compute capability 9.0 GPU the Hopper forward takes every multiple of 8 from
    64 to 256 by default, packed sequences too (``forward_wgmma.by_default``); its backward
    d = 64 and 128 by default, the multiples of 8 between where forced; neither ever the
    rest."""
    monkeypatch.setenv(registry.HOPPER_ENV, "auto")
    assert [d for d in (56, 64, 96, 128, 200, 256, 264)
            if registry.uses_hopper("bfloat16", d, (9, 0), simulator=False)] == [64, 96, 128, 200, 256]
    assert [d for d in (64, 96, 128, 136, 256)
            if registry.uses_hopper("bfloat16", d, (9, 0), simulator=False, scores=PACKED)] == [64, 96, 128, 136, 256]
    assert [registry.forward_specialisation("float16", d, spec, True, simulator=False, cc=(9, 0)).variant
            for d, spec in ((256, CAUSAL), (256, PACKED), (56, PACKED))] == [
        "forward_wgmma", "forward_wgmma", "forward_mma"]
    assert not registry.uses_hopper("bfloat16", 128, (8, 0), simulator=False)
    assert [d for d in (64, 96, 128) if registry.uses_hopper("bfloat16", d, (9, 0), simulator=False,
                                                             variant="backward_dkdv_wgmma")] == [64, 128]
    monkeypatch.setenv(registry.HOPPER_ENV, "1")
    assert [d for d in (56, 64, 72, 100, 128, 248, 256, 264) if registry.uses_hopper("bfloat16", d, (9, 0),
                                                                                   simulator=False)] == [
        64, 72, 128, 248, 256]
    assert registry.uses_hopper("bfloat16", 256, (9, 0), simulator=False, scores=PACKED)
    assert [d for d in (56, 64, 72, 128, 136, 256) if registry.uses_hopper(     # the backward: up to 128
        "bfloat16", d, (9, 0), simulator=False, variant="backward_dkdv_wgmma")] == [64, 72, 128]


@pytest.mark.parametrize("opts, shape, sched", [
    ({"causal": True}, (1, 2, 640, 128), 15), ({"window": (150, 0)}, (1, 2, 640, 128), -1),
    ({"causal": True}, (1, 3, 300, 256), 13), ({"causal": True}, (1, 3, 700, 64), 25),
    ({"causal": True, "softcap": 4.0}, (1, 3, 400, 64), 13)],
    ids=["causal", "window", "causal-d256", "causal-192-rows", "causal-softcap-192-rows"])
def test_hopper_schedules_through_the_api(opts, shape, sched, monkeypatch):
    """The launch's schedule (``forward_wgmma.schedule``) on three persistent blocks, as a
    GPU of three multiprocessors would have it: causal rows on the pairs (forced where the
    model would weigh L2: ``L2_KV_BYTES`` 0, ``PAIRS_SLACK`` unbounded) with a tail, and a
    window whose rounds go the other way; at d = 256 (``forward_wgmma.PAIRS_HEAD_DIM``),
    three heads of three query tiles (the last ragged), a pair each in one whole round,
    the middle tiles in the tail; in 192-row blocks (``PAIRS_WIDE``; ``NARROW_CAUSAL_ROWS``
    0: the short call stands for a long one) three heads of four query tiles (the last
    ragged), their pairs in two whole rounds, and with a softcap three heads of three query
    tiles, a pair each in one whole round, the middle tiles in the tail. The launch's
    ``sched`` is the model's, the result within the oracle's tolerance (every tile once:
    NaN-poisoned outputs)."""
    if ON_GPU:
        pytest.skip("the simulator's multiprocessor count is set here")
    from numba_flash import api
    from numba_flash.kernels import wgmma_schedule
    monkeypatch.setenv(registry.HOPPER_ENV, "1")
    monkeypatch.setattr(api, "_device_facts", lambda: (3, None, None))
    monkeypatch.setattr(wgmma_schedule, "L2_KV_BYTES", 0)
    monkeypatch.setattr(wgmma_schedule, "PAIRS_SLACK", float("inf"))
    if shape[-1] == 64:
        from numba_flash.kernels import forward_wgmma
        monkeypatch.setattr(forward_wgmma, "PAIRS_WIDE", True)
        monkeypatch.setattr(forward_wgmma, "NARROW_CAUSAL_ROWS", 0)
    wgmma_schedule.paired_places.cache_clear()
    try:
        rng = np.random.default_rng(51)
        # d = 128: five query tiles of two heads: the pairs leave one pair and the middle
        # tiles to the tail (sched 4 · 3 + 2 + 1), the window's rounds go the even way (-1);
        # d = 256: three pairs in the whole round, the middle tiles in the tail (4 · 3 + 1)
        q, k, v = (rng.standard_normal(shape).astype(ml_dtypes.bfloat16) for _ in range(3))
        _, launches = api.plan_forward(q, k, v, **opts)
        assert launches[-1][1] == 3 and launches[-1][4][-1] == sched, launches[-1][4][-1]
        assert launches[-1][0].threads == (512 if shape[-1] == 64 else 384)
        out, lse = numba_flash.attention_fwd(q, k, v, **opts)
        check_forward_low(out, lse, q, k, v, opts, None)
    finally:
        wgmma_schedule.paired_places.cache_clear()       # (its answers under the forced constants)


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_hopper_plan_keeps_the_inputs_its_maps_read(direction, monkeypatch):
    """The Hopper family's launches read q, k, v (and dO) through TMA tensor maps, which
    hold their addresses only: a call of NumPy inputs keeps its device copies referenced
    until its results are taken, after the launches (dropped when the plan returned, a
    pending deallocation could free them before the kernels ran: compute-sanitizer's
    illegal address, docs/performance.md item 100); taken, they are released."""
    import gc
    import weakref
    from numba_flash import api
    from numba_flash.launch import launch
    _force_hopper(monkeypatch, cache=False)
    copies = []
    device = api._Inputs.device
    monkeypatch.setattr(api._Inputs, "device", lambda inp, name: copies.append(device(inp, name)) or copies[-1])
    rng = np.random.default_rng(47)
    q, k, v, dout = (rng.standard_normal((1, 2, 70, 64)).astype(ml_dtypes.bfloat16) for _ in range(4))
    if direction == "forward":
        result, launches = api.plan_forward(q, k, v, causal=True)
    else:
        out, lse = numba_flash.attention_fwd(q, k, v, causal=True)
        copies.clear()
        result, launches = api.plan_backward(dout, q, k, v, out, lse, causal=True)
    assert any("wgmma" in a[0].py_func.__module__ for a in launches)
    held = [weakref.ref(a) for a in copies]
    copies.clear()
    gc.collect()
    assert len(held) >= 3 and all(r() is not None for r in held)      # alive until the results
    for a in launches:
        launch(*a)
    got = result()
    if direction == "forward":
        check_forward_low(got[0], got[1], q, k, v, True, None)
    del result, launches
    gc.collect()
    assert all(r() is None for r in held)


@pytest.mark.parametrize("dtype,caps", [("bfloat16", (30.0, 50.0)), ("float16", (3.0, 30.0))])
def test_hopper_softcap_fixed_maximum(dtype, caps, monkeypatch):
    """``forward_wgmma.FIXED_MAX_SOFTCAP`` forced on: under a softcap within the dtype's
    ``FIXED_MAX_LIMIT`` (the first cap) each row's maximum is the cap, and the bits differ
    from the running maxima's; beyond it (the second) the kernel takes the running maxima,
    the same bits as with the option off. Every result within the oracle's tolerance, with
    causal rows that see no key (Nq > Nk) and a window's, a ragged key tile, and one row whose
    every score lies near -c (its largest exponential near 2^(-2 cap_out), the limit's case)."""
    from numba_flash.kernels import forward_wgmma
    _force_hopper(monkeypatch, cache=False)
    rng = np.random.default_rng(61)
    dt = NP_DTYPES[dtype]
    q = rng.standard_normal((1, 1, 150, 64))
    k, v = (rng.standard_normal((1, 1, 100, 64)) for _ in range(2))
    q[0, 0, -1] = -4 * k[0, 0].mean(axis=0) / np.linalg.norm(k[0, 0].mean(axis=0)) * 60
    k[0, 0] += k[0, 0].mean(axis=0) * 3            # row -1's scores all far below zero
    q, k, v = (x.astype(dt) for x in (q, k, v))
    for cap, frozen, rule in zip(caps + caps, (True, False) * 2, ({"causal": True},) * 2 + ({"window": (40, 7)},) * 2):
        assert (cap * math.log2(math.e) <= forward_wgmma.FIXED_MAX_LIMIT[dtype]) == frozen
        opts = {**rule, "softcap": cap}
        got = {}
        for on in (False, True):
            monkeypatch.setattr(forward_wgmma, "FIXED_MAX_SOFTCAP", on)
            out, lse = numba_flash.attention_fwd(q, k, v, **opts)
            check_forward_low(out, lse, q, k, v, opts, None)
            got[on] = (out, lse)
        same = all(bits(a) == bits(b) for a, b in zip(got[False], got[True]))
        assert same != frozen, (cap, frozen)


@pytest.mark.parametrize("hkv", [2, 1])
def test_hopper_family_grouped_heads(hkv, monkeypatch):
    """Grouped-query heads (and MQA) on the Hopper family: the kernel reads K/V head
    ``h // group`` through K/V's own tensor maps (no repeated view); the launch is checked
    to be the family's, and the result against the oracle."""
    from numba_flash import api
    _force_hopper(monkeypatch)
    rng = np.random.default_rng(20 + hkv)
    q = rng.standard_normal((2, 4, 70, 64)).astype(ml_dtypes.bfloat16)
    k, v = (rng.standard_normal((2, hkv, 90, 64)).astype(ml_dtypes.bfloat16) for _ in range(2))
    _, launches = api.plan_forward(q, k, v, causal=True)
    kern, args = launches[-1][0], launches[-1][4]
    group = args[list(inspect.signature(kern.py_func).parameters).index("group")]
    assert "forward_wgmma" in kern.py_func.__module__ and group == 4 // hkv
    out, lse = numba_flash.attention_fwd(q, k, v, causal=True)
    check_forward_low(out, lse, q, k, v, True, None)


def _forced_option_keeps_bits(monkeypatch, rules, d, nq, nk, lens, seed, option, forced, heads=1):
    """A Hopper forward call (``rules`` "packed": a causal varlen batch of sequences
    ``lens`` with ``heads`` heads; else ``nq`` query and ``nk`` key rows, causal for "causal", a band of 60 keys
    for "window") with the
    registry's kernel, checked against the oracle, then with ``make_forward_wgmma``'s
    ``option`` forced to ``forced(default kernel)``: asserts the kernel took it and the
    same bits. (In the simulator one persistent block takes every item, so every
    transition between items runs.)"""
    _force_hopper(monkeypatch, cache=False)
    rng = np.random.default_rng(seed)
    if rules == "packed":
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        q, k, v = (rng.standard_normal((int(cu[-1]), heads, d)).astype(ml_dtypes.bfloat16) for _ in range(3))
        call = lambda: (numba_flash.attention_varlen(q, k, v, cu, cu, causal=True),)  # noqa: E731
    else:
        opts = {"window": (60, 0)} if rules == "window" else {"causal": rules == "causal"}
        q = rng.standard_normal((1, nq, d)).astype(ml_dtypes.bfloat16)
        k, v = (rng.standard_normal((1, nk, d)).astype(ml_dtypes.bfloat16) for _ in range(2))
        _assert_hopper_launch(q, k, v, **opts)
        call = lambda: numba_flash.attention_fwd(q, k, v, **opts)  # noqa: E731
    default, kernel = _run_built(monkeypatch, call)
    if rules == "packed":
        for z in np.flatnonzero(lens):
            rows = slice(cu[z], cu[z + 1])
            check_forward_low(np.swapaxes(default[0][rows], 0, 1)[None], None,
                              *(np.swapaxes(x[rows], 0, 1)[None] for x in (q, k, v)), True, None)
    else:
        check_forward_low(default[0], default[1], q, k, v, opts, None)
    value = forced(kernel)
    result, kernel = _run_built(monkeypatch, call, **{option: value})
    assert getattr(kernel, option) is value
    assert [bits(x) for x in result] == [bits(x) for x in default], (option, value)


@pytest.mark.parametrize("d, nq, nk", [(128, 300, 90), (128, 200, 350), (64, 250, 250)])
def test_hopper_end_aligned_tiles_change_no_bit(d, nq, nk, monkeypatch):
    """Causal query tiles aligned to the sequence's end (``make_forward_wgmma``'s
    ``end_aligned``, ``forward_wgmma.END_ALIGNED_CAUSAL``): the first tile ragged, its rows
    before 0 read as zeros and never stored. Every row visits the same key tiles in the same
    order, so the bits are the default's: 300 query rows over 90 keys (rows that see no
    key, the first tile's 84 rows before 0 among them), 200 over 350, and at d = 64 in
    192-row blocks (``NARROW_CAUSAL_ROWS`` 0) 250 rows, whose first tile starts 134 rows
    before 0 (two warpgroups wholly before it, the third across it)."""
    from numba_flash.kernels import forward_wgmma
    monkeypatch.setattr(forward_wgmma, "NARROW_CAUSAL_ROWS", 0)
    _forced_option_keeps_bits(monkeypatch, "causal", d, nq, nk, np.array([0]), 61, "end_aligned",
                              lambda kernel: not kernel.end_aligned)


def test_hopper_end_aligned_rule(monkeypatch):
    """``forward_wgmma.aligns_end``: with ``END_ALIGNED_CAUSAL`` causal rows alone (not a
    window, packed sequences or full rows) in 192-row blocks, not 128; without it none."""
    from numba_flash.kernels import forward_wgmma as F
    from numba_flash.scores import ScoreSpec
    rules = (ScoreSpec(causal=True), ScoreSpec(causal=True, softcap=True), ScoreSpec(causal=True, window=True),
             ScoreSpec(causal=True, packed=True), ScoreSpec())
    monkeypatch.setattr(F, "END_ALIGNED_CAUSAL", True)
    assert [F.aligns_end(s, 192) for s in rules] == [True, True, False, False, False]
    assert not any(F.aligns_end(s, 128) for s in rules)
    monkeypatch.setattr(F, "END_ALIGNED_CAUSAL", False)
    assert not any(F.aligns_end(s, 192) for s in rules)


def test_hopper_overlap_rule(monkeypatch):
    """``forward_wgmma.overlaps``: causal rows at d = 64 in two-warpgroup blocks (packed or
    not), windows up to ``OVERLAP_WINDOW_HEAD_DIM``, full rows up to
    ``OVERLAP_FULL_HEAD_DIM`` (0: none; rows without a rule that shortens them, nor a block
    mask), never three consumer warpgroups."""
    from numba_flash.kernels import forward_wgmma as F
    from numba_flash.scores import ScoreSpec
    full, causal, window = ScoreSpec(), ScoreSpec(causal=True), ScoreSpec(window=True)
    packed = ScoreSpec(causal=True, packed=True)
    assert [F.overlaps(s, 128, 64) for s in (full, causal, window, packed)] == [False, True, True, True]
    assert [F.overlaps(s, 128, 128) for s in (full, causal, window, packed)] == [False, False, False, False]
    assert not F.overlaps(causal, 192, 64)
    monkeypatch.setattr(F, "OVERLAP_FULL_HEAD_DIM", 128)
    assert [F.overlaps(s, 128, d) for s in (full, ScoreSpec(softcap=True)) for d in (64, 128, 256)] == \
        [True, True, False] * 2
    assert not F.overlaps(full, 192, 64) and not F.overlaps(ScoreSpec(packed=True), 128, 128)


@pytest.mark.parametrize("rules", ["causal", "full", "packed", "window"])
def test_hopper_overlap_changes_no_bit(rules, monkeypatch):
    """An item's last P V issued with the next item's first Q Kᵀ (``make_forward_wgmma``'s
    ``overlap``; by default for causal rows with two consumer warpgroups at d = 64, packed
    or not, and for windows at d = 64) changes when the products are issued,
    not what is computed: forced away from what the registry's kernel resolves (d = 128, two
    consumers), the kernel's bits, within the tolerance of the float64 oracle. Causal rows
    with Nq > Nk, so that query tiles with no key lie between tiles with keys; full rows; a
    varlen batch with an empty sequence; a band of 60 keys over 300 query and 150 key rows
    (its first query tile sees no key)."""
    _forced_option_keeps_bits(monkeypatch, rules, 128, 300, 90 if rules == "causal" else 150, np.array([150, 0, 70]),
                              41, "overlap", lambda kernel: not kernel.overlap)


@pytest.mark.parametrize("rules, d, nk, lens", [("causal", 128, 90, None), ("causal", 64, 90, None),
                                                ("window", 128, 150, None), ("packed", 128, None, [150, 0, 400, 70]),
                                                ("packed", 64, None, [150, 0, 400, 70])])
def test_hopper_items_published_ahead_change_no_bit(rules, d, nk, lens, monkeypatch):
    """Each work item published one item ahead (``make_forward_wgmma``'s ``publish_ahead``,
    ``forward_wgmma.publishes_ahead``: placed once the item before's first loads are out, and
    read back from its slot by the producer; by default packed rows only) changes when an
    item is placed, not which: forced the other way, the default kernel's bits, within the
    oracle's tolerance. Both consumer
    paths (causal rows at d = 64 and packed rows at d = 64 take the item overlap), items
    without a key tile (Nq > Nk), a varlen batch with an empty sequence (its first key rows
    are read back from the slot)."""
    _forced_option_keeps_bits(monkeypatch, rules, d, 300, nk, np.array(lens or [0]), 59, "publish_ahead",
                              lambda kernel: not kernel.publish_ahead, heads=2)


def test_hopper_packed_head_major_changes_no_bit(monkeypatch):
    """Packed sequences' units head by head within a sequence (``make_forward_wgmma``'s
    ``head_major``, :data:`forward_wgmma.PACKED_HEAD_MAJOR`) or heads fastest change which
    block takes which item, not what is computed: forced the other way, the default
    kernel's bits, within the oracle's tolerance. Three heads over sequences of 2, 0 and 1
    pairs of 128-row query tiles (d = 128), each with a lone middle tile, so that a unit's
    head and pair both come from a division by something other than 1; a unit taken twice
    or never leaves rows unwritten (poisoned) or wrong. (The order does not depend on the
    head dim; the varlen tests run the default order at every head dim.)"""
    _forced_option_keeps_bits(monkeypatch, "packed", 128, 0, None, np.array([520, 0, 300]), 53, "head_major",
                              lambda kernel: not kernel.head_major, heads=3)


@pytest.mark.parametrize("rules, d, nk, lens", [("full", 128, 400, None), ("causal", 128, 90, None),
                                                ("causal", 64, 90, None), ("window", 128, 150, None),
                                                ("packed", 128, None, [150, 0, 400, 70])])
def test_hopper_published_items_change_no_bit(rules, d, nk, lens, monkeypatch):
    """Work items placed by the producer and read by the consumers from shared memory
    (``make_forward_wgmma``'s ``publish``: by default on causal rows, windows and packed
    rows, off on full rows) change who works out an item, not what is computed: forced the
    other way, the default kernel's bits, within the oracle's tolerance. Both consumer
    paths: one item at a time (full rows, a band of 60 keys, the varlen batch) and the item
    overlap (causal rows at d = 64); causal rows with query tiles that see no key between
    tiles that do (Nq > Nk: items of no key tile take a slot too), and a varlen batch with
    an empty sequence. An item read from the wrong slot or word puts rows in the wrong
    place."""
    _forced_option_keeps_bits(monkeypatch, rules, d, 300, nk, np.array(lens or [0]), 47, "publish",
                              lambda kernel: not kernel.publish)


@pytest.mark.parametrize("tiling", [MmaTiling(WARPS=1, BN=16, Q_IN_REGS=False), MmaTiling(WARPS=2, BN=16, Q_IN_REGS=True),
                                    MmaTiling(WARPS=1, BN=32, Q_IN_REGS=True, MT=2)], ids=str)
def test_every_tiling_branch(tiling, monkeypatch):
    """Each compile-time branch of the kernel (Q fragments kept or re-read, several warps, two
    16-row blocks per warp) against the oracle, whichever tilings the registry picks."""
    v = registry.VARIANTS["forward_mma"]
    monkeypatch.setitem(registry.VARIANTS, "forward_mma", dataclasses.replace(v, tiling=lambda dt, d, sim: tiling))
    for dtype, causal in (("bfloat16", True), ("float16", False)):
        case = Case((2,), tiling.BM + 3, tiling.BN + 5, 24, dtype, causal=causal, magnitude=2.0, seed=tiling.BM)
        q, k, v = case.inputs()
        out, lse = _run(case, q, k, v, on_device=False)
        check_forward_low(out, lse, q, k, v, causal, None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_device_inputs_are_copied(dtype):
    """A device view whose rows are not contiguous (every other element of the last axis)
    is copied on the device first; the result equals that of contiguous inputs."""
    case = Case((2,), BM + 2, BN + 3, 16, dtype, causal=True, seed=31)
    q, k, v = case.inputs()
    wide = np.repeat(k, 2, axis=-1)                     # k[..., c] == wide[..., 2c]
    kd = numba_flash.to_device(wide)[:, :, ::2]
    out, lse = numba_flash.attention_fwd(numba_flash.to_device(q), kd, numba_flash.to_device(v), causal=True)
    ref_out, ref_lse = numba_flash.attention_fwd(q, k, v, causal=True)
    assert bits(host(out)) == bits(ref_out) and bits(host(lse)) == bits(ref_lse)


@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic(dtype):
    case = Case((2,), BM + 3, 2 * BN + 1, 24, dtype, causal=True, magnitude=3.0, seed=32)
    q, k, v = case.inputs()
    first, second = _run(case, q, k, v, False), _run(case, q, k, v, False)
    assert bits(first[0]) == bits(second[0]) and bits(first[1]) == bits(second[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_inputs(dtype):
    q, k, v = Case((2,), 0, 5, 8, dtype).inputs()
    out, lse = numba_flash.attention_fwd(q, k, v)
    assert out.shape == (2, 0, 8) and out.dtype == NP_DTYPES[dtype] and lse.dtype == np.float32
    q, k, v = Case((2,), 3, 0, 8, dtype).inputs()
    out, lse = numba_flash.attention_fwd(q, k, v, causal=True)
    assert np.all(out.astype(np.float32) == 0) and np.all(np.isneginf(lse))


@pytest.mark.parametrize("d", [12, 4, 264])
def test_head_dim_limits(d):
    q, k, v = Case((), 3, 3, d, "float16").inputs()
    with pytest.raises(ValueError, match=r"multiple of 8 and at most 256.*d=" + str(d)):
        numba_flash.attention(q, k, v)


def test_mixed_16_bit_dtypes_are_refused():
    q, k, v = Case((), 3, 3, 8, "bfloat16").inputs()
    with pytest.raises(TypeError, match="same dtype"):
        numba_flash.attention(q, k.astype(np.float16), v)


# --------------------------------------------------------------------------- GPU only
GPU_SHAPES = [
    # (lead, Nq, Nk, d, dtype, causal)
    ((2, 4), 1024, 1024, 64, "bfloat16", False),
    ((1, 2), 4096, 4096, 128, "bfloat16", True),
    ((1, 1), 8192, 8192, 128, "float16", True),
    ((1, 1), 8192, 8192, 64, "bfloat16", False),
    ((2,), 1000, 3000, 96, "float16", True),       # Nq < Nk, causal
    ((2,), 3000, 1000, 128, "bfloat16", True),     # Nq > Nk: leading rows see nothing
    ((2,), 2048, 2048, 256, "bfloat16", True),
    ((2,), 1500, 1200, 256, "float16", False),
    ((2,), 777, 1333, 16, "float16", False),
    ((2,), 1200, 1500, 200, "bfloat16", True),
] + [
    # every supported head dim once, alternating dtype and causality (ragged tiles)
    ((1,), 300, 333, d, ("bfloat16", "float16")[d // 8 % 2], d // 8 % 3 == 0)
    for d in range(16, 257, 8)
]


@pytest.mark.skipif(not ON_GPU, reason="GPU-sized shapes: too slow for the CUDA simulator")
@pytest.mark.parametrize("lead,nq,nk,d,dtype,causal", GPU_SHAPES,
                         ids=[f"{'x'.join(map(str, s[0]))}-{s[1]}x{s[2]}-d{s[3]}-{s[4]}-{'causal' if s[5] else 'full'}"
                              for s in GPU_SHAPES])
def test_gpu_large_shapes(lead, nq, nk, d, dtype, causal, monkeypatch):
    """Large shapes, checked row block by row block on the GPU with torch (float64 oracle and
    the 16-bit baseline of this module); then a second run must be bitwise identical. The
    ``mma.sync`` family (the Hopper one off): it runs every GPU of cc >= 8.0."""
    monkeypatch.setenv(registry.HOPPER_ENV, "0")
    _check_large(lead, nq, nk, d, dtype, causal)


HOPPER_SHAPES = [s for s in GPU_SHAPES if registry.VARIANTS["forward_wgmma"].head_dims(s[3])] + [
    ((1, 1), 16384, 16384, 128, "bfloat16", True), ((1, 2), 16384, 16384, 64, "float16", False),
    ((3,), 129, 127, 128, "bfloat16", False), ((3,), 1, 300, 64, "float16", True)]


def _hopper_gpu():
    from numba import cuda
    return ON_GPU and cuda.get_current_device().compute_capability == (9, 0)


@pytest.mark.skipif(not ON_GPU, reason="GPU-sized shapes: too slow for the CUDA simulator")
@pytest.mark.parametrize("lead,nq,nk,d,dtype,causal", HOPPER_SHAPES,
                         ids=[f"{'x'.join(map(str, s[0]))}-{s[1]}x{s[2]}-d{s[3]}-{s[4]}-{'causal' if s[5] else 'full'}"
                              for s in HOPPER_SHAPES])
def test_gpu_hopper_family(lead, nq, nk, d, dtype, causal, monkeypatch):
    """The Hopper family (``forward_wgmma``, cc 9.0) on the shapes above, and against the
    ``mma.sync`` family on the same inputs: within two units in the last place of max|out|."""
    if not _hopper_gpu():
        pytest.skip("the Hopper family runs on compute capability 9.0 only")
    torch = pytest.importorskip("torch")
    monkeypatch.setenv(registry.HOPPER_ENV, "1")
    o_hopper = _check_large(lead, nq, nk, d, dtype, causal)
    monkeypatch.setenv(registry.HOPPER_ENV, "0")
    o_mma = _check_large(lead, nq, nk, d, dtype, causal)
    eps = float(torch.finfo(o_mma.dtype).eps)
    diff = float((o_hopper.double() - o_mma.double()).abs().max())
    assert diff <= 2 * eps * max(1.0, float(o_mma.double().abs().max())), diff


def _check_large(lead, nq, nk, d, dtype, causal):
    """The checks of :func:`test_gpu_large_shapes`; returns the output."""
    torch = pytest.importorskip("torch")
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    g = torch.Generator(device="cuda").manual_seed(nq + 7 * nk + d)
    q, k, v = (torch.randn(lead + (n, d), generator=g, device="cuda").to(tdt) for n in (nq, nk, nk))
    out, lse = numba_flash.attention_fwd(q, k, v, causal=causal)
    out2, lse2 = numba_flash.attention_fwd(q, k, v, causal=causal)
    o = _as_torch(out, torch).view(tdt)
    l = torch.as_tensor(lse, device="cuda")
    assert torch.equal(_as_torch(out2, torch), _as_torch(out, torch)) and torch.equal(
        torch.as_tensor(lse2, device="cuda"), l), "two runs differ"
    sc = 1.0 / math.sqrt(d)
    qf, kf, vf = (x.reshape(-1, x.shape[-2], d) for x in (q, k, v))
    of, lf = o.reshape(-1, nq, d).double(), l.reshape(-1, nq).double()
    err = base = 0.0
    for b in range(qf.shape[0]):
        for r0 in range(0, nq, 1024):
            r1 = min(nq, r0 + 1024)
            vis = (torch.arange(nk, device="cuda")[None, :] <= torch.arange(r0, r1, device="cuda")[:, None] + nk - nq)
            s = (qf[b, r0:r1].double() @ kf[b].double().T) * sc
            s32 = (qf[b, r0:r1].float() @ kf[b].float().T) * sc
            if causal:
                s, s32 = s.masked_fill(~vis, -math.inf), s32.masked_fill(~vis, -math.inf)
            p, p32 = torch.softmax(s, -1).nan_to_num(0.0), torch.softmax(s32, -1).nan_to_num(0.0)
            ref = p @ vf[b].double()
            bl = (p32.to(tdt).float() @ vf[b].float()).to(tdt).double()
            err = max(err, float((of[b, r0:r1] - ref).abs().max()))
            base = max(base, float((bl - ref).abs().max()))
            rl = torch.logsumexp(s, -1)
            fin = torch.isfinite(rl)
            assert torch.equal(torch.isneginf(lf[b, r0:r1]), ~fin)
            assert torch.all(of[b, r0:r1][~fin] == 0)
            if fin.any():   # float32 scores: lse within float32 rounding of a d-term dot product
                assert float((lf[b, r0:r1][fin] - rl[fin]).abs().max()) < 1e-4 * max(1.0, float(rl[fin].abs().max()))
    tol = 2 * base + float(torch.finfo(tdt).eps) * float(vf.abs().max())
    assert err <= tol, (err, base, tol)
    return o


def _as_torch(out, torch):
    """A 16-bit numba_flash output as a torch tensor of its raw bits (int16)."""
    if isinstance(out, torch.Tensor):       # torch inputs give torch outputs
        return out.view(torch.int16)
    return torch.as_tensor(out.view(np.int16), device="cuda")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_traced_kernel(causal, monkeypatch):
    """``make_forward_wgmma(trace=True)`` (``tools/trace_items.py``): the kernel of the
    call's plan, traced, on three persistent blocks, writes the same bits as the untraced
    kernel and stamps every item it took: each warpgroup's phases in order, the producer's
    Q load before the item's Q landed, its key tiles (two query tiles of two heads, 130 x
    130 at d = 128: two key tiles each, or under the causal mask one for the first)."""
    from numba import cuda
    from numba_flash import api
    from numba_flash.kernels import forward_wgmma
    from numba_flash.launch import launch
    if ON_GPU:
        pytest.skip("the simulator's multiprocessor count is set here")
    _force_hopper(monkeypatch, cache=False)
    monkeypatch.setattr(api, "_device_facts", lambda: (3, None, None))
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((1, 2, 130, 128)).astype(ml_dtypes.bfloat16) for _ in range(3))
    outs = []
    for traced in (False, True):
        result, launches = api.plan_forward(q, k, v, causal=causal)
        kern, grid, threads, smem, args, stream = launches[-1]
        assert "forward_wgmma" in kern.py_func.__module__ and not kern.overlap
        if traced:
            spec = registry.forward_specialisation("bfloat16", 128, CAUSAL if causal else registry.FULL, True,
                                                   rows=130, cc=(9, 0))
            kern = forward_wgmma.make_forward_wgmma(spec.dtype, spec.d, spec.scores, bn=spec.tiling.BN,
                                                    bm=spec.tiling.BM, fixed_max=forward_wgmma.FIXED_MAX_SOFTCAP,
                                                    trace=True)
            per_block = -(-2 * 2 // grid)
            trace = cuda.to_device(np.zeros((grid, per_block, forward_wgmma.TRACE_EVENTS), np.int64))
            args = tuple(args) + (trace,)
        for a in launches[:-1]:
            launch(*a)
        launch(kern, grid, threads, smem, args, stream)
        outs.append([host(x) for x in result()])
    assert bits(outs[0][0]) == bits(outs[1][0]) and bits(outs[0][1]) == bits(outs[1][1])
    stamps = trace.copy_to_host()
    tiles = sorted(int(t) for t in stamps[:, :, forward_wgmma.TRACE_TILES].ravel() if t)
    # per head: query tile 0 (rows 0-127) and 1 (128-129) against 130 keys in 128-key tiles
    assert tiles == ([1, 1, 2, 2] if causal else [2, 2, 2, 2]), tiles
    for blk in range(grid):
        for item in range(per_block):
            row = stamps[blk, item]
            if not row[forward_wgmma.TRACE_TILES]:
                continue
            for wg in range(2):
                phases = row[6 * wg:6 * wg + 6]
                assert (np.diff(phases) >= 0).all() and phases[0] > 0, (blk, item, wg, phases)
                assert phases[1] <= row[forward_wgmma.TRACE_K0 + wg] <= phases[2], (blk, item, wg, row)
                assert phases[0] <= row[forward_wgmma.TRACE_PLACED + wg] <= phases[1], (blk, item, wg, row)
                assert row[forward_wgmma.TRACE_PRODUCER] <= phases[1], (blk, item, row)
            assert row[forward_wgmma.TRACE_PRODUCER + 1] >= row[forward_wgmma.TRACE_PRODUCER] > 0
