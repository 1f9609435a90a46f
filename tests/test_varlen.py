"""Packed sequences and partial results against the float64 oracle: variable-length batches
(``attention_varlen_fwd``), KV caches with in-place appends (``attention_with_kvcache``)
and ``merge_attention``.

Each sequence of a packed call is checked on its own against the oracle with the
tolerance rules of the plain tests (:func:`conftest.check_forward` for float32 and
float64, :func:`test_forward_mma.check_forward_low` for float16 and bfloat16): a packed
call must compute exactly what attention over each sequence alone computes, with no row
of another sequence leaking in. Outputs are NaN-poisoned before each launch, so a row the
kernels skip fails. Lengths include empty sequences (no query, or no key: zero output and
``-inf`` lse), Nq != Nk per sequence and lengths that cross tile edges.
"""
import numpy as np
import pytest
from hypothesis import example, given, note
from hypothesis import strategies as st

import numba_flash
from numba import cuda
from numba_flash import api, reference, registry
from conftest import ON_GPU, check_forward, host, np_dtype
from numba_flash.testing import check_forward_low

DTYPES = registry.dtypes("forward")
LOW = registry.LOW_DTYPES
N_MAX = 300 if ON_GPU else 20
D_CHOICES = {"float32": (5, 16), "float64": (3, 8), "float16": (8, 16), "bfloat16": (16,)}
if ON_GPU:
    D_CHOICES = {"float32": (40, 64), "float64": (24,), "float16": (64, 128), "bfloat16": (128,)}


def _check(dt, out, lse, q, k, v, options, scale=None):
    """One sequence, heads first: out, q ``(H, n, d)``, lse ``(H, n)``."""
    if dt in LOW:
        check_forward_low(out, lse, q, k, v, options, scale)
    else:
        check_forward(out, lse, q, k, v, options, scale)


def _heads_first(x):
    return np.ascontiguousarray(np.swapaxes(x, 0, 1))


def _host(x):
    return x if isinstance(x, np.ndarray) else host(x)


def _device(x):
    return numba_flash.to_device(x) if x.dtype == np_dtype("bfloat16") else cuda.to_device(x)


@st.composite
def varlen_cases(draw):
    dt = draw(st.sampled_from(DTYPES))
    batch = draw(st.integers(1, 3))
    lens_q = draw(st.lists(st.integers(0, N_MAX), min_size=batch, max_size=batch))
    lens_k = draw(st.lists(st.integers(0, N_MAX), min_size=batch, max_size=batch))
    hkv = draw(st.sampled_from((1, 2)))
    group = draw(st.sampled_from((1, 2)))
    options = dict(causal=draw(st.booleans()))
    rule = draw(st.sampled_from(("none", "window", "softcap", "alibi")))
    if rule == "window":
        options["window"] = (draw(st.integers(0, 6)), draw(st.one_of(st.none(), st.integers(0, 6))))
    elif rule == "softcap":
        options["softcap"] = draw(st.sampled_from((2.0, 20.0)))
    return dict(dtype=dt, lens_q=lens_q, lens_k=lens_k, hq=hkv * group, hkv=hkv,
                d=draw(st.sampled_from(D_CHOICES[dt])), options=options, alibi=rule == "alibi",
                seed=draw(st.integers(0, 2**31 - 1)))


def _varlen_inputs(case):
    rng = np.random.default_rng(case["seed"])
    dt = np_dtype(case["dtype"])
    cu_q = np.concatenate([[0], np.cumsum(case["lens_q"])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(case["lens_k"])]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], case["hq"], case["d"])).astype(dt)
    k = rng.standard_normal((cu_k[-1], case["hkv"], case["d"])).astype(dt)
    v = rng.standard_normal((cu_k[-1], case["hkv"], case["d"])).astype(dt)
    slopes = (2.0 ** -rng.uniform(0.5, 8.0, case["hq"])).astype(np.float32) if case["alibi"] else None
    return q, k, v, cu_q, cu_k, slopes


def _check_varlen(case, out, lse, q, k, v, cu_q, cu_k, slopes):
    hq, d = case["hq"], case["d"]
    assert out.shape == (cu_q[-1], hq, d) and lse.shape == (cu_q[-1], hq)
    assert out.flags.c_contiguous and lse.flags.c_contiguous
    options = dict(case["options"], alibi_slopes=slopes)
    for b in range(len(cu_q) - 1):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if cu_q[b + 1] == cu_q[b]:
            continue
        _check(case["dtype"], _heads_first(out[rq]), np.ascontiguousarray(lse[rq].T), _heads_first(q[rq]),
               _heads_first(k[rk]), _heads_first(v[rk]), options)


@example(case=dict(dtype="float32", lens_q=[3, 0, 17, 5], lens_k=[7, 4, 17, 0], hq=4, hkv=2, d=16,
                   options=dict(causal=True), alibi=False, seed=1))
@example(case=dict(dtype="bfloat16", lens_q=[1, 16, 2], lens_k=[20, 16, 0], hq=2, hkv=1, d=16,
                   options=dict(causal=False, window=(3, 1)), alibi=False, seed=2))
@given(case=varlen_cases())
def test_varlen_matches_oracle(case):
    note(repr(case))
    q, k, v, cu_q, cu_k, slopes = _varlen_inputs(case)
    out, lse = numba_flash.attention_varlen_fwd(q, k, v, cu_q, cu_k, alibi_slopes=slopes, **case["options"])
    assert isinstance(out, np.ndarray)
    _check_varlen(case, out, lse, q, k, v, cu_q, cu_k, slopes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_varlen_device_arrays_and_attention(dtype):
    """Device arrays in, device arrays out, bit for bit the NumPy path's results;
    ``attention_varlen`` is the out of ``attention_varlen_fwd``."""
    case = dict(dtype=dtype, lens_q=[5, 9], lens_k=[9, 5], hq=2, hkv=2, d=16, options=dict(causal=True),
                alibi=False, seed=3)
    q, k, v, cu_q, cu_k, _ = _varlen_inputs(case)
    out, lse = numba_flash.attention_varlen_fwd(q, k, v, cu_q, cu_k, causal=True, max_seqlen_q=9)
    dout, dlse = numba_flash.attention_varlen_fwd(*(_device(x) for x in (q, k, v)), cuda.to_device(cu_q),
                                                  cu_k, causal=True)
    assert not isinstance(dout, np.ndarray)
    np.testing.assert_array_equal(host(dout).view(np.uint8), out.view(np.uint8))
    np.testing.assert_array_equal(host(dlse), lse)
    only = numba_flash.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    np.testing.assert_array_equal(only.view(np.uint8), out.view(np.uint8))


def test_varlen_repeat_calls_check_new_metadata(monkeypatch):
    """Repeat calls with the same metadata (a model's layers) reuse its checked sequence
    table; new metadata, even the same array changed in place, is checked and attended
    to anew."""
    from numba_flash import varlen
    monkeypatch.setattr(varlen, "_VARLEN_TABLES", {})
    checks = []
    original = varlen._sequences
    monkeypatch.setattr(varlen, "_sequences", lambda *a: checks.append(1) or original(*a))
    case = dict(dtype="float32", lens_q=[5, 9], lens_k=[9, 5], hq=2, hkv=1, d=8, options=dict(causal=True),
                alibi=False, seed=11)
    q, k, v, cu_q, cu_k, _ = _varlen_inputs(case)
    for _ in range(2):
        out, lse = numba_flash.attention_varlen_fwd(q, k, v, cu_q, cu_k, causal=True)
        _check_varlen(case, out, lse, q, k, v, cu_q, cu_k, None)
    assert len(checks) == 1, "the repeat call checked its metadata again"
    cu_q[1] = 8                          # lengths 8 and 6, in place
    out, lse = numba_flash.attention_varlen_fwd(q, k, v, cu_q, cu_k, causal=True)
    _check_varlen(case, out, lse, q, k, v, cu_q, cu_k, None)
    assert len(checks) == 2
    cu_q[1] = 15                         # past the end: 15, then 14
    with pytest.raises(ValueError, match="never decrease"):
        numba_flash.attention_varlen_fwd(q, k, v, cu_q, cu_k, causal=True)


@pytest.mark.skipif(not ON_GPU, reason="launch plans exist only on a GPU")
def test_varlen_repeat_calls_through_launch_plans(monkeypatch):
    """PyTorch inputs as a model's layers pass them: the first call leaves a launch plan,
    the next calls (new values; then new lengths with the same longest sequences) run
    through it without the inputs' full checks, each matching the oracle."""
    torch = pytest.importorskip("torch")
    from numba_flash import _plans, varlen
    monkeypatch.setattr(_plans, "_PLANS", {})
    monkeypatch.setattr(varlen, "_VARLEN_TABLES", {})
    runs, full = [], []
    original_run, original_inputs = _plans.Plan.run, api._Inputs
    monkeypatch.setattr(_plans.Plan, "run", lambda self, *a, **kw: runs.append(1) or original_run(self, *a, **kw))
    monkeypatch.setattr(api, "_Inputs", lambda *a, **kw: full.append(1) or original_inputs(*a, **kw))
    rng = np.random.default_rng(12)
    bf16 = np_dtype("bfloat16")
    for step, lens in enumerate(([300, 0, 129, 77], [300, 0, 129, 77], [129, 77, 0, 300])):
        case = dict(dtype="bfloat16", lens_q=lens, lens_k=lens, hq=4, hkv=2, d=128, options=dict(causal=True),
                    alibi=False, seed=int(rng.integers(2**31)))
        q, k, v, cu_q, cu_k, _ = _varlen_inputs(case)
        t = [torch.tensor(x.astype(np.float32), dtype=torch.bfloat16, device="cuda") for x in (q, k, v)]
        out, lse = numba_flash.attention_varlen_fwd(*t, cu_q, cu_k, causal=True)
        assert len(runs) == step and len(full) == 1, (step, len(runs), len(full))
        out = out.float().cpu().numpy().astype(bf16)
        _check_varlen(case, out, lse.cpu().numpy(), q, k, v, cu_q, cu_k, None)
    with pytest.raises(TypeError, match="causal must be True or False"):     # not the plan of causal=True
        numba_flash.attention_varlen_fwd(*t, cu_q, cu_k, causal=1)


HOPPER_VARLEN = [   # (dtype, d, hq, hkv, lens_q, lens_k, rule, device): empty sequences, tiles of 128 crossed
    ("bfloat16", 64, 2, 1, [5, 0, 260, 30], [9, 3, 270, 0], dict(causal=True), False),
    ("float16", 128, 2, 2, [40, 131], [200, 7], dict(window=(20, 3), softcap=5.0, alibi=True), True),
]
if ON_GPU:
    HOPPER_VARLEN = [
        ("bfloat16", 128, 8, 2, [513, 0, 1000, 77, 256, 1], [513, 9, 1000, 300, 0, 2000], dict(causal=True), True),
        ("float16", 64, 4, 4, [300, 129, 128], [128, 500, 129], dict(causal=False), False),
        ("bfloat16", 64, 4, 1, [700, 65], [900, 65], dict(window=(100, 5), softcap=10.0, alibi=True), True),
        ("bfloat16", 128, 4, 2, [512, 0, 1000, 250, 256], [512, 9, 1000, 300, 2000], dict(causal=True), False),
    ]


@pytest.mark.parametrize("dtype,d,hq,hkv,lens_q,lens_k,rule,device", HOPPER_VARLEN,
                         ids=[f"{c[0]}-d{c[1]}-{'+'.join(c[6])}" for c in HOPPER_VARLEN])
def test_varlen_on_the_hopper_family(dtype, d, hq, hkv, lens_q, lens_k, rule, device, monkeypatch):
    """Packed sequences on the Hopper forward (forced; on a GPU it is the family of cc 9.0):
    its TMA loads rows of the whole packed array, so each sequence's tiles read rows of
    the next one, which the kernel must never let in. Three persistent blocks, so that
    each takes pairs of tiles and lone middle tiles (``forward_wgmma.packed_item``)."""
    from numba_flash import families
    if ON_GPU and tuple(cuda.get_current_device().compute_capability) != (9, 0):
        pytest.skip("the Hopper family runs on compute capability 9.0 only")
    monkeypatch.setenv(registry.HOPPER_ENV, "1")
    facts = api._device_facts
    monkeypatch.setattr(api, "_device_facts", lambda: (3,) + tuple(facts())[1:])
    calls = []
    real = families._hopper_launches
    monkeypatch.setattr(families, "_hopper_launches", lambda *a: calls.append(a[0].packed.tiles) or real(*a))
    options = {key: value for key, value in rule.items() if key != "alibi"}
    case = dict(dtype=dtype, lens_q=lens_q, lens_k=lens_k, hq=hq, hkv=hkv, d=d, options=options,
                alibi=bool(rule.get("alibi")), seed=len(lens_q) + d)
    q, k, v, cu_q, cu_k, slopes = _varlen_inputs(case)
    if device:      # twice: on a GPU the second call runs through the first one's launch plan
        dev = [_device(x) for x in (q, k, v)]
        dslopes = None if slopes is None else cuda.to_device(slopes)
        out, lse = (host(x) for x in numba_flash.attention_varlen_fwd(*dev, cu_q, cu_k, alibi_slopes=dslopes,
                                                                      **options))
        again = [host(x) for x in numba_flash.attention_varlen_fwd(*dev, cu_q, cu_k, alibi_slopes=dslopes, **options)]
        assert [a.tobytes() for a in again] == [out.tobytes(), lse.tobytes()]
    else:
        out, lse = numba_flash.attention_varlen_fwd(q, k, v, cu_q, cu_k, alibi_slopes=slopes, **options)
    assert calls[0] == sum(-(-n // 128) for n in lens_q), calls      # the family ran, over every query tile
    _check_varlen(case, out, lse, q, k, v, cu_q, cu_k, slopes)


def _non_finite_rows(k, v, start):
    """inf and NaN written into the key and value rows of the sequence starting at row
    ``start`` (its first rows: the ones a tile crossing the sequence before reads)."""
    v[start + 3, 1, 5] = np.inf
    v[start + 8, 0] = np.nan
    k[start + 5, 0, 7] = np.inf


@pytest.mark.parametrize("hopper", [False, True], ids=["mma", "hopper"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_non_finite_values_stay_in_their_sequence(hopper, causal, monkeypatch):
    """inf and NaN in one sequence's q, k and v leave the other sequences' outputs and
    gradients as the oracle has them. Sequence lengths that end inside key tiles: the
    Hopper family's TMA boxes read the next sequence's rows there (its V rows past the end
    are cleared before the last P V: 0 · inf would be NaN), the ``mma.sync`` family's
    loads stop at the end (and the backward's, which packed sequences take on every GPU).
    Each family forced (on a Hopper GPU the Hopper family is the default)."""
    from test_backward_mma import check_backward_low
    from numba_flash import families
    if hopper and ON_GPU and tuple(cuda.get_current_device().compute_capability) != (9, 0):
        pytest.skip("the Hopper family runs on compute capability 9.0 only")
    monkeypatch.setenv(registry.HOPPER_ENV, "1" if hopper else "0")
    calls = []
    real = families._hopper_launches
    monkeypatch.setattr(families, "_hopper_launches", lambda *a: calls.append(1) or real(*a))
    rng = np.random.default_rng(70 + 2 * hopper + causal)
    dt = np_dtype("bfloat16")
    # (the simulator's default tiles are a few rows: short sequences cross them)
    lens = [700, 300, 900] if ON_GPU else [70, 60, 90] if hopper else [11, 9, 13]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v = (rng.standard_normal((int(cu[-1]), 2, 64 if hopper or ON_GPU else 16)).astype(dt) for _ in range(3))
    bad = slice(cu[1], cu[2])                   # sequence 1: its first rows follow sequence 0's end
    _non_finite_rows(k, v, cu[1])
    q[cu[1] + 1, 1] = np.nan
    out, lse = (host(x) for x in numba_flash.attention_varlen_fwd(q, k, v, cu, cu, causal=causal))
    assert bool(calls) == hopper, calls
    assert not np.isfinite(out[bad]).all()      # (the non-finite values were read)
    dout = rng.standard_normal(q.shape).astype(dt)
    grads = [host(g) for g in numba_flash.attention_varlen_bwd(dout, q, k, v, out, lse, cu, cu, causal=causal)]
    for b in (0, 2):
        rows = slice(cu[b], cu[b + 1])
        assert np.isfinite(out[rows]).all() and np.isfinite(lse[rows]).all(), b
        assert all(np.isfinite(g[rows].astype(np.float32)).all() for g in grads), b
        seq = [_heads_first(x[rows]) for x in (q, k, v)]
        _check("bfloat16", _heads_first(out[rows]), np.ascontiguousarray(lse[rows].T), *seq, {"causal": causal})
        check_backward_low([_heads_first(g[rows]) for g in grads], _heads_first(dout[rows]), *seq,
                           {"causal": causal}, None)


@pytest.mark.parametrize("d", [128, 256] if ON_GPU else [64])
def test_varlen_forward_is_deterministic(d):
    """A causal varlen batch gives the same bits call after call, through its launch plan
    and on a copy of its inputs (sequences that end inside key tiles, whose rows past the
    end the Hopper forward clears; on a GPU at d = 128 and 256, eight heads)."""
    rng = np.random.default_rng(90 + d)
    dt = np_dtype("bfloat16")
    lens = [700, 300, 900, 2000, 129] if ON_GPU else [70, 60, 90]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v = (rng.standard_normal((int(cu[-1]), 8 if ON_GPU else 1, d)).astype(dt) for _ in range(3))
    runs = [[host(x) for x in numba_flash.attention_varlen_fwd(*inputs, cu, cu, causal=True)]
            for inputs in ((q, k, v), (q, k, v), (q.copy(), k.copy(), v.copy()))]
    first = _heads_first(runs[0][0][:lens[0]])
    _check("bfloat16", first, np.ascontiguousarray(runs[0][1][:lens[0]].T),
           *(_heads_first(x[:lens[0]]) for x in (q, k, v)), {"causal": True})
    for out, lse in runs[1:]:
        assert out.tobytes() == runs[0][0].tobytes() and lse.tobytes() == runs[0][1].tobytes()


@pytest.mark.parametrize("splits", [1, 3])
def test_varlen_decoding_non_finite_values_stay_in_their_sequence(splits, monkeypatch):
    """The same with one query per sequence (the one-warp decoding kernel, with key splits
    forced and their merge, or one split): inf and NaN in sequence 1's keys and values
    leave sequences 0 and 2 as the oracle has them."""
    monkeypatch.setattr(registry, "forward_splits", lambda *args: splits)
    rng = np.random.default_rng(75 + splits)
    dt = np_dtype("bfloat16")
    lens_k = [700, 300, 900] if ON_GPU else [45, 37, 52]       # (simulator: 16-key tiles)
    cu_q = np.arange(4, dtype=np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    d = 64 if ON_GPU else 16
    q = rng.standard_normal((3, 2, d)).astype(dt)
    k, v = (rng.standard_normal((int(cu_k[-1]), 2, d)).astype(dt) for _ in range(2))
    _non_finite_rows(k, v, cu_k[1])
    out, lse = (host(x) for x in numba_flash.attention_varlen_fwd(q, k, v, cu_q, cu_k))
    assert not np.isfinite(out[1]).all()        # (the non-finite values were read)
    for b in (0, 2):
        keys = slice(cu_k[b], cu_k[b + 1])
        assert np.isfinite(out[b]).all() and np.isfinite(lse[b]).all(), b
        _check("bfloat16", _heads_first(out[b:b + 1]), np.ascontiguousarray(lse[b:b + 1].T),
               _heads_first(q[b:b + 1]), _heads_first(k[keys]), _heads_first(v[keys]), {})


def test_kvcache_unused_rows_stay_out_with_the_hopper_family(monkeypatch):
    """A KV cache's rows past each sequence's length may hold anything, NaN included: with
    the Hopper family forced, KV-cache calls of more than 16 queries still leave them unread
    (its TMA boxes would read them, so they run on mma.sync)."""
    from numba_flash import families
    monkeypatch.setenv(registry.HOPPER_ENV, "1")
    calls = []
    monkeypatch.setattr(families, "_hopper_launches", lambda *a: calls.append(1))
    rng = np.random.default_rng(9)
    dt = np_dtype("bfloat16")
    b, nq, nmax, h, d = 2, 20, 40, 2, 64
    lens = np.array([7, 33], np.int32)
    q = rng.standard_normal((b, nq, h, d)).astype(dt)
    kc, vc = (rng.standard_normal((b, nmax, h, d)).astype(dt) for _ in range(2))
    for i in range(b):
        kc[i, lens[i]:] = np.nan
        vc[i, lens[i]:] = np.nan
    out, lse = numba_flash.attention_with_kvcache(q, kc, vc, lens, return_lse=True)
    assert not calls
    for i in range(b):
        n = lens[i]
        _check("bfloat16", _heads_first(out[i]), np.ascontiguousarray(lse[i].T), _heads_first(q[i]),
               _heads_first(kc[i, :n]), _heads_first(vc[i, :n]), {})


def test_hopper_work_order():
    """The sequence table's work order: most query tiles first, then most keys; the running
    counts of tiles and of pairs of tiles end at their totals. The persistent schedule's
    places for the pairs (``pair_place``) cover every unit's two halves once, a whole
    round's on one block, one after the other."""
    from numba_flash.kernels.wgmma_schedule import pair_place, work_order
    order = work_order([5, 0, 300, 129, 300], [1, 1, 10, 7, 50], 128)
    assert order[:, 1].tolist() == [4, 2, 3, 0, 1]
    assert order[:, 0].tolist() == [3, 6, 8, 9, 9]
    assert order[:, 2].tolist() == [1, 2, 3, 3, 3]
    assert work_order([], [], 128).shape == (0, 3)
    for G, units in ((1, 5), (4, 4), (4, 11), (7, 3), (132, 4352 // 2 + 8)):
        places = [pair_place(i, G, units) for i in range(2 * units)]
        assert sorted(places) == [(v, h) for v in range(units) for h in (0, 1)]
        whole = units - units % G
        for i in range(2 * whole):           # block i % G: both halves of a unit, in turn
            m = i // G
            if m % 2 == 0:
                assert places[i + G] == (places[i][0], 1) and places[i][1] == 0


@pytest.mark.parametrize("dtype,causal,n_new,device", [
    ("float32", True, 2, False), ("bfloat16", False, 3, True), ("float64", True, 0, True)])
def test_kvcache_matches_oracle(dtype, causal, n_new, device):
    """Queries against each sequence's cache rows in use, after appending k_new and v_new in
    place (checked row by row: the new rows land at cache_seqlens, the others are unchanged)."""
    rng = np.random.default_rng(4)
    dt = np_dtype(dtype)
    b, nq, nmax, hq, hkv, d = 3, 2, 14, 4, 2, 16 if dtype in LOW else 8
    lens = np.array([5, 0, nmax - n_new])
    q = rng.standard_normal((b, nq, hq, d)).astype(dt)
    kc = rng.standard_normal((b, nmax, hkv, d)).astype(dt)
    vc = rng.standard_normal((b, nmax, hkv, d)).astype(dt)
    kn = rng.standard_normal((b, n_new, hkv, d)).astype(dt) if n_new else None
    vn = rng.standard_normal((b, n_new, hkv, d)).astype(dt) if n_new else None
    expect_k, expect_v = kc.copy(), vc.copy()
    for i in range(b):
        if n_new:
            expect_k[i, lens[i]:lens[i] + n_new] = kn[i]
            expect_v[i, lens[i]:lens[i] + n_new] = vn[i]
    args = [q, kc, vc]
    new = dict(k_new=kn, v_new=vn)
    if device:
        args = [_device(x) for x in args]
        new = {n: None if x is None else _device(x) for n, x in new.items()}
    out, lse = numba_flash.attention_with_kvcache(*args, lens.astype(np.int32), causal=causal, return_lse=True,
                                                  **new)
    out, lse = _host(out), _host(lse)
    kc_after, vc_after = (_host(x) for x in args[1:])
    np.testing.assert_array_equal(kc_after.view(np.uint8), expect_k.view(np.uint8))
    np.testing.assert_array_equal(vc_after.view(np.uint8), expect_v.view(np.uint8))
    assert out.shape == (b, nq, hq, d) and lse.shape == (b, nq, hq)
    for i in range(b):
        n = lens[i] + n_new
        _check(dtype, _heads_first(out[i]), np.ascontiguousarray(lse[i].T), _heads_first(q[i]),
               _heads_first(expect_k[i, :n]), _heads_first(expect_v[i, :n]), dict(causal=causal))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", [False, True])
def test_merge_attention(dtype, device):
    """Partial results over disjoint key sets (one of them empty, and one invisible to
    some rows under the causal mask) merge into attention over all the keys."""
    rng = np.random.default_rng(5)
    dt = np_dtype(dtype)
    q = rng.standard_normal((2, 3, 6, 8)).astype(dt)
    k = rng.standard_normal((2, 3, 20, 8)).astype(dt)
    v = rng.standard_normal((2, 3, 20, 8)).astype(dt)
    bounds = ((0, 7), (7, 7), (7, 20))
    parts = []
    for lo, hi in bounds:        # the oracle's partials, exact up to float64 rounding
        o, l = reference.attention_fwd(q.astype(np.float64), k[..., lo:hi, :].astype(np.float64),
                                       v[..., lo:hi, :].astype(np.float64))
        parts.append((o.astype(dt), l.astype(np.float64 if dtype == "float64" else np.float32)))
    outs, lses = [p[0] for p in parts], [p[1] for p in parts]
    if device:
        outs, lses = [_device(x) for x in outs], [cuda.to_device(x) for x in lses]
    out, lse = numba_flash.merge_attention(outs, lses)
    out, lse = _host(out), _host(lse)
    ref_out, ref_lse = reference.attention_fwd(*(x.astype(np.float64) for x in (q, k, v)))
    eps = {"float64": 1e-15, "float32": 2**-24}.get(dtype, float(np.finfo(np.float32).eps))
    if dtype in LOW:
        import ml_dtypes
        eps = float(ml_dtypes.finfo(dt).eps)
    # Each partial is rounded to the dtype (half an ulp of |v| at most); the merge adds a few
    # accumulator roundings: 2 ulps of max|v| bound both, lse to the accumulator's precision.
    assert out.dtype == dt and np.abs(out.astype(np.float64) - ref_out).max() <= 2 * eps * np.abs(v.astype(float)).max()
    acc_eps = 1e-14 if dtype == "float64" else 1e-6
    assert np.abs(lse - ref_lse).max() <= acc_eps * max(1.0, np.abs(ref_lse).max())
    stacked_out, stacked_lse = numba_flash.merge_attention(np.stack([p[0] for p in parts]),
                                                           np.stack([p[1] for p in parts]))
    assert stacked_out.shape == out.shape


def test_merge_attention_rows_with_no_key():
    o = np.full((2, 3), 7.0, np.float32)
    out, lse = numba_flash.merge_attention([o, o], [np.full(2, -np.inf, np.float32)] * 2)
    assert (out == 0).all() and np.isneginf(lse).all()


BAD = [
    ("decreasing", lambda: ([0, 5, 3, 10], [0, 2, 4, 6]), ValueError, "never decrease"),
    ("wrong end", lambda: ([0, 5, 9], [0, 2, 6]), ValueError, "must equal the number of rows"),
    ("batch mismatch", lambda: ([0, 5, 10], [0, 6]), ValueError, "must have 3 entries"),
    ("float metadata", lambda: (np.array([0.0, 5.0, 10.0]), [0, 2, 6]), TypeError, "integer"),
]


@pytest.mark.parametrize("make,exc,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_varlen_bad_metadata(make, exc, match):
    q = np.zeros((10, 2, 8), np.float32)
    k = np.zeros((6, 2, 8), np.float32)
    cu_q, cu_k = make()
    cu_q = np.asarray(cu_q) if isinstance(cu_q, np.ndarray) else np.asarray(cu_q, np.int32)
    with pytest.raises(exc, match=match):
        numba_flash.attention_varlen_fwd(q, k, k, cu_q, np.asarray(cu_k, np.int32))


def test_varlen_bad_layout_and_max_seqlen():
    q = np.zeros((10, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"\(total_tokens, heads, d\)"):
        numba_flash.attention_varlen_fwd(q[None], q, q, [0, 10], [0, 10])
    with pytest.raises(ValueError, match="shorter than the longest"):
        numba_flash.attention_varlen_fwd(q, q, q, np.array([0, 10], np.int32), np.array([0, 10], np.int32),
                                         max_seqlen_q=4)


def test_kvcache_bad_input():
    q = np.zeros((2, 1, 2, 8), np.float32)
    kc = np.zeros((2, 6, 2, 8), np.float32)
    kn = np.ones((2, 2, 2, 8), np.float32)
    with pytest.raises(ValueError, match="cache overflows"):
        numba_flash.attention_with_kvcache(q, kc, kc.copy(), np.array([3, 5], np.int32), k_new=kn, v_new=kn)
    assert not kc.any(), "nothing may be written when the call is refused"
    with pytest.raises(ValueError, match="both or neither"):
        numba_flash.attention_with_kvcache(q, kc, kc, np.array([3, 5], np.int32), k_new=kn)
    with pytest.raises(ValueError, match=r"lie in \[0, Nmax=6\]"):
        numba_flash.attention_with_kvcache(q, kc, kc, np.array([3, 7], np.int32))
    with pytest.raises(ValueError, match="same batch size"):
        numba_flash.attention_with_kvcache(q[:1], kc, kc, np.array([3, 5], np.int32))
    with pytest.raises(TypeError, match="cache's dtype"):
        numba_flash.attention_with_kvcache(q, kc, kc.copy(), np.array([0, 0], np.int32), k_new=kn.astype(np.float64),
                                           v_new=kn.astype(np.float64))
    wide = np.zeros((2, 9, 2, 8), np.float32)[:, :6]     # a view whose (B, Nmax) rows do not merge
    with pytest.raises(ValueError, match="k_cache must have its first two axes contiguous"):
        numba_flash.attention_with_kvcache(q, wide, kc, np.array([3, 5], np.int32))
    with pytest.raises(TypeError, match="cache_seqlens must be a 1-D int32 NumPy or device array, got list"):
        numba_flash.attention_with_kvcache(q, kc, kc, [3, 5])


def test_merge_attention_bad_input():
    o = np.zeros((4, 8), np.float32)
    l32 = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="as many partial results"):
        numba_flash.merge_attention([o, o], [l32])
    with pytest.raises(ValueError, match=r"lses\[0\] must be float32"):
        numba_flash.merge_attention([o], [l32.astype(np.float64)])
    with pytest.raises(ValueError, match=r"outs\[1\] has shape"):
        numba_flash.merge_attention([o, o[:3]], [l32, l32])
    with pytest.raises(ValueError, match="at least one"):
        numba_flash.merge_attention([], [])


def test_packed_specialisations_are_registered():
    """Only the families that take packed sequences are asked for them; the others refuse."""
    names = [s.name for s in registry.specialisations() if s.scores.packed]
    assert names and all(n.startswith(("forward_simt", "forward_mma", "forward_merge", "forward_wgmma"))
                         for n in names)
    with pytest.raises(ValueError, match="does not take packed"):
        registry.specialisation("backward_dq_wgmma", "bfloat16", 64, numba_flash.scores.ScoreSpec(packed=True))
    with pytest.raises(ValueError, match="does not take"):     # the TMA cannot gather a paged cache's rows
        registry.specialisation("forward_wgmma", "bfloat16", 64, numba_flash.scores.ScoreSpec(packed=True,
                                                                                            paged=True))


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_key_splits_of_few_query_rows(dtype, packed, splits, monkeypatch):
    """At most ``registry.SPLIT_ROWS`` query rows: the one-warp tensor-core kernel with key
    splits (forced to 3, as a GPU with idle SMs would choose) in blocks of their own and
    their merge (``registry.BLOCK_SPLITS`` off: as where a block's memory does not hold
    them), or with one split writing its final results itself (no merge launched), plain
    and packed (a KV cache), causal and with a window, against the oracle."""
    monkeypatch.setattr(registry, "forward_splits", lambda *args: splits)
    monkeypatch.setattr(registry, "BLOCK_SPLITS", False)
    rng = np.random.default_rng(6)
    dt = np_dtype(dtype)
    assert registry.forward_specialisation(dtype, 16, registry.FULL, True, rows=2).variant == "forward_mma_split"
    if not packed:
        q = rng.standard_normal((2, 3, 16)).astype(dt)
        k, v = (rng.standard_normal((2, 70, 16)).astype(dt) for _ in range(2))
        _, launches = api.plan_forward(q, k, v)
        assert len(launches) == (1 if splits == 1 else 2), launches
        for options in (dict(causal=True), dict(window=(20, 0))):
            out, lse = numba_flash.attention_fwd(q, k, v, **options)
            check_forward_low(out, lse, q, k, v, options, None)
        return
    q = rng.standard_normal((3, 1, 4, 16)).astype(dt)
    kc, vc = (rng.standard_normal((3, 60, 2, 16)).astype(dt) for _ in range(2))
    lens = np.array([60, 0, 33], np.int32)
    out, lse = numba_flash.attention_with_kvcache(q, kc, vc, lens, return_lse=True)
    for i in range(3):
        _check(dtype, _heads_first(out[i]), np.ascontiguousarray(lse[i].T), _heads_first(q[i]),
               _heads_first(kc[i, :lens[i]]), _heads_first(vc[i, :lens[i]]), dict(causal=False))


def test_key_splits_count_every_sequence(monkeypatch):
    """A KV cache's decoding grid has a block row per sequence (its third axis): the split
    rule is told all of its blocks, as for the same problem unpacked (else it splits keys
    for SMs that are busy already)."""
    told, grids = [], []
    monkeypatch.setattr(registry, "forward_splits", lambda blocks, *args: told.append(blocks) or 1)
    monkeypatch.setattr(api, "launch", lambda kern, grid, *args: grids.append(grid))
    q = np.zeros((5, 1, 4, 16), np.float16)
    kc = np.zeros((5, 40, 2, 16), np.float16)
    numba_flash.attention_with_kvcache(q, kc, kc, np.full(5, 40, np.int32))
    assert told and grids
    assert told[-1] == np.prod(grids[-1]) and grids[-1][-1] == 5


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_key_splits_of_one_query_tile_are_costed_whole(dtype, monkeypatch):
    """A causal decoding call has one query tile, which sees every key tile: the split rule
    costs it as the non-causal call (its causal model assumes query tiles of differing
    lengths), with the one-warp kernel's larger least split (its key tiles are small)."""
    told = []
    monkeypatch.setattr(registry, "forward_splits", lambda *args: told.append(args[3:]) or 1)
    q = np.zeros((2, 4, 1, 16), dtype if dtype == "float32" else np_dtype(dtype))
    k = np.zeros((2, 4, 300, 16), q.dtype)
    numba_flash.attention(q, k, k, causal=True)
    least = registry.MIN_SPLIT_TILES if dtype == "float32" else registry.MIN_SPLIT_TILES_ONE_WARP
    assert told == [(False, least)]


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_key_splits_in_one_block(paged, monkeypatch):
    """``registry.BLOCK_SPLITS``: decoding from a KV cache (contiguous, or paged: pages of
    16 rows, shuffled) with three key splits as the warps of one block, merged in its shared
    memory, grouped query heads and a sequence of length 0 included: the oracle's answer."""
    monkeypatch.setattr(registry, "forward_splits", lambda *args: 3)
    monkeypatch.setattr(registry, "BLOCK_SPLITS", True)
    chosen = []
    plain = registry.block_splits
    monkeypatch.setattr(registry, "block_splits", lambda *args: chosen.append(plain(*args)) or chosen[-1])
    rng = np.random.default_rng(80 + paged)
    dt = np_dtype("bfloat16")
    b, hq, hkv, d, page, max_pages = 3, 4, 2, 16, 16, 10
    lens = np.array([150, 0, 37], np.int32)      # three splits of whole tiles of 16, 32 or 64 keys
    q = rng.standard_normal((b, 1, hq, d)).astype(dt)
    if paged:
        table = rng.permutation(b * max_pages).reshape(b, max_pages).astype(np.int32)
        kc, vc = (rng.standard_normal((b * max_pages, page, hkv, d)).astype(dt) for _ in range(2))
        flat_k, flat_v = ([np.concatenate([c[p] for p in table[i]]) for i in range(b)] for c in (kc, vc))
        extra = dict(block_table=table)
    else:
        kc, vc = (rng.standard_normal((b, page * max_pages, hkv, d)).astype(dt) for _ in range(2))
        flat_k, flat_v, extra = kc, vc, {}
    out, lse = numba_flash.attention_with_kvcache(q, kc, vc, lens, return_lse=True, **extra)
    out, lse = _host(out), _host(lse)
    assert chosen == [3]
    for i in range(b):
        _check("bfloat16", _heads_first(out[i]), np.ascontiguousarray(lse[i].T), _heads_first(q[i]),
               _heads_first(flat_k[i][:lens[i]]), _heads_first(flat_v[i][:lens[i]]), dict(causal=False))


@pytest.mark.parametrize("dtype,page,nq,n_new,device,d", [
    ("bfloat16", 5, 1, 2, False, 16), ("float16", 16, 3, 0, True, 16), ("bfloat16", 3, 20, 4, True, 16),
    ("bfloat16", 4, 1, 1, False, 64), ("float16", 16, 1, 0, True, 64), ("bfloat16", 32, 2, 3, False, 64),
    ("float32", 3, 2, 2, True, 8), ("float64", 7, 20, 0, False, 8)])
def test_paged_kvcache_matches_oracle(dtype, page, nq, n_new, device, d, monkeypatch):
    """A paged cache, its pages shuffled and some shared by no sequence: the same result as
    the contiguous cache the pages spell out (decoding and prefill kernels: 1, 3 and 20
    queries), with k_new/v_new appended across page boundaries through the page table;
    float32 and float64 on the CUDA-core kernels (float32 with three key splits forced, as
    a GPU with idle SMs would choose for decoding; float64 a prefill). d = 64: the decoding
    kernel's copies (``mma_parts.make_copy_rows``) step from page to page every row step
    (pages of 4 rows), or copy 16-row pieces of one page each (pages of 16 and 32 rows)."""
    if dtype == "float32":
        monkeypatch.setattr(registry, "forward_splits", lambda *args: 3)
    rng = np.random.default_rng(7 + page)
    dt = np_dtype(dtype)
    b, hq, hkv, max_pages = 3, 2, 1, 6
    num_pages = b * max_pages + 2
    lens = np.array([4, 0, max_pages * page - n_new])
    table = rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
    q = rng.standard_normal((b, nq, hq, d)).astype(dt)
    kc, vc = (rng.standard_normal((num_pages, page, hkv, d)).astype(dt) for _ in range(2))
    kn, vn = ((rng.standard_normal((b, n_new, hkv, d)).astype(dt) for _ in range(2)) if n_new else (None, None))
    # the contiguous view of each sequence, after the appends
    flat_k = [np.concatenate([kc[p] for p in table[i]]) for i in range(b)]
    flat_v = [np.concatenate([vc[p] for p in table[i]]) for i in range(b)]
    for i in range(b):
        if n_new:
            flat_k[i][lens[i]:lens[i] + n_new], flat_v[i][lens[i]:lens[i] + n_new] = kn[i], vn[i]
    args, new = [q, kc, vc], dict(k_new=kn, v_new=vn)
    if device:
        args = [_device(x) for x in args]
        new = {n: None if x is None else _device(x) for n, x in new.items()}
    out, lse = numba_flash.attention_with_kvcache(*args, lens.astype(np.int32), block_table=table, causal=True,
                                                  return_lse=True, **new)
    out, lse = _host(out), _host(lse)
    kc_after = _host(args[1])
    for i in range(b):
        n = lens[i] + n_new
        got_k = np.concatenate([kc_after[p] for p in table[i]])[:n]
        np.testing.assert_array_equal(got_k.view(np.uint8), flat_k[i][:n].view(np.uint8))
        _check(dtype, _heads_first(out[i]), np.ascontiguousarray(lse[i].T), _heads_first(q[i]),
               _heads_first(flat_k[i][:n]), _heads_first(flat_v[i][:n]), dict(causal=True))


def _kvcache_problem(rng, dtype, paged, b, nq, hq, hkv, d, n_new, max_pages=4, page=5, nmax=20):
    """Random inputs of a KV-cache call: ``(q, k_cache, v_cache, k_new, v_new, table)``
    (table None for a contiguous cache of ``nmax`` rows; else ``b`` rows of ``max_pages``
    shuffled pages of ``page`` rows, two pages used by no sequence)."""
    dt = np_dtype(dtype)
    table = None
    if paged:
        num_pages = b * max_pages + 2
        table = rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
        shape = (num_pages, page, hkv, d)
    else:
        shape = (b, nmax, hkv, d)
    q = rng.standard_normal((b, nq, hq, d)).astype(dt)
    kc, vc = (rng.standard_normal(shape).astype(dt) for _ in range(2))
    kn, vn = ((rng.standard_normal((b, n_new, hkv, d)).astype(dt) for _ in range(2)) if n_new else (None, None))
    return q, kc, vc, kn, vn, table


def _cache_rows(cache, table, i, n):
    """Sequence ``i``'s first ``n`` cache rows (through ``table`` for a paged cache)."""
    if table is None:
        return cache[i, :n]
    page = cache.shape[1]
    rows = np.arange(n)
    return cache[table[i, rows // page], rows % page]


@pytest.mark.parametrize("dtype,paged,nq,hq,n_new,meta_dtype", [
    ("float32", False, 2, 2, 2, np.int32), ("bfloat16", False, 1, 4, 1, np.int64),
    ("bfloat16", True, 1, 2, 2, np.int32), ("float16", True, 3, 2, 0, np.int64), ("float64", True, 1, 2, 1, np.int32)])
def test_kvcache_device_metadata_matches_the_checked_call(dtype, paged, nq, hq, n_new, meta_dtype, monkeypatch):
    """``check_metadata=False``: cache_seqlens and block_table stay on the device (never
    copied to the host: the host readers raise here) and the call computes what the
    checked call computes, bit for bit, caches included (contiguous and paged caches,
    appends, grouped query heads decoding in one block, int32 and int64 metadata), which
    matches the oracle per sequence."""
    from numba_flash import varlen
    rng = np.random.default_rng(11)
    b, hkv, d = 3, 1 if hq == 4 else 2, 16 if dtype in LOW else 8
    q, kc, vc, kn, vn, table = _kvcache_problem(rng, dtype, paged, b, nq, hq, hkv, d, n_new)
    nmax = 20
    lens = np.array([7, 0, nmax - n_new], meta_dtype)
    dev = lambda x: None if x is None else _device(x)  # noqa: E731
    extra = {} if table is None else dict(block_table=table)
    checked = numba_flash.attention_with_kvcache(dev(q), dev(kc), dev(vc), lens, k_new=dev(kn), v_new=dev(vn),
                                                 causal=True, return_lse=True, **extra)
    caches = [dev(kc), dev(vc)]
    for name in ("_host_ints", "_page_table"):
        monkeypatch.setattr(varlen, name, lambda *a, name=name: pytest.fail(f"{name}: metadata read on the host"))
    extra = {} if table is None else dict(block_table=cuda.to_device(table.astype(meta_dtype)))
    out, lse = numba_flash.attention_with_kvcache(dev(q), *caches, cuda.to_device(lens), k_new=dev(kn), v_new=dev(vn),
                                                  causal=True, return_lse=True, check_metadata=False, **extra)
    for ours, theirs in ((out, checked[0]), (lse, checked[1])):
        np.testing.assert_array_equal(_host(ours).view(np.uint8), _host(theirs).view(np.uint8))
    kh, vh = (_host(x) for x in caches)
    for i in range(b):
        n = lens[i] + n_new
        k_rows, v_rows = _cache_rows(kh, table, i, n), _cache_rows(vh, table, i, n)
        if n_new:
            np.testing.assert_array_equal(k_rows[lens[i]:].view(np.uint8), kn[i].view(np.uint8))
            np.testing.assert_array_equal(v_rows[lens[i]:].view(np.uint8), vn[i].view(np.uint8))
        _check(dtype, _heads_first(_host(out)[i]), np.ascontiguousarray(_host(lse)[i].T), _heads_first(q[i]),
               _heads_first(k_rows), _heads_first(v_rows), dict(causal=True))


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_device_metadata_skips_what_the_host_would_refuse(paged):
    """``check_metadata=False`` with lengths outside ``[0, Nmax - Nnew]`` (negative, past
    the end) and, paged, a page outside the cache among the entries a sequence uses: those
    sequences get zeros and lse -inf and their caches are left as they were; a bad entry
    that no row in use reaches skips nothing; the other sequences are right."""
    rng = np.random.default_rng(12)
    b, nq, hq, hkv, d, n_new, page, max_pages = 5, 1, 2, 1, 8, 2, 5, 4
    q, kc, vc, kn, vn, table = _kvcache_problem(rng, "float32", paged, b, nq, hq, hkv, d, n_new, max_pages, page)
    nmax = 20
    lens = np.array([-3, 6, nmax - n_new + 1, 3, 2**31 - 1], np.int32)
    skipped = {0, 2, 4}
    if paged:
        table[1, 1] = 10**6             # sequence 1 uses rows 0..7: pages 0 and 1
        table[3, 3] = -7                # sequence 3 uses rows 0..4: its last entry is never read
        skipped.add(1)
    args = [cuda.to_device(x) for x in (q, kc, vc)]
    extra = {} if table is None else dict(block_table=cuda.to_device(table))
    out, lse = numba_flash.attention_with_kvcache(*args, cuda.to_device(lens), k_new=cuda.to_device(kn),
                                                  v_new=cuda.to_device(vn), return_lse=True, check_metadata=False,
                                                  **extra)
    out, lse = _host(out), _host(lse)
    kh, vh = _host(args[1]), _host(args[2])
    for i in range(b):
        if i in skipped:
            assert (out[i] == 0).all() and np.isneginf(lse[i]).all(), i
            continue
        n = lens[i] + n_new
        k_rows, v_rows = _cache_rows(kh, table, i, n), _cache_rows(vh, table, i, n)
        np.testing.assert_array_equal(k_rows[lens[i]:], kn[i])
        _check("float32", _heads_first(out[i]), np.ascontiguousarray(lse[i].T), _heads_first(q[i]),
               _heads_first(k_rows), _heads_first(v_rows), dict(causal=False))
    written = {i for i in range(b) if i not in skipped}
    untouched = np.ones(kh.shape[:2], bool)          # the rows no sequence appended to
    for i in written:
        rows = np.arange(lens[i], lens[i] + n_new)
        if table is None:
            untouched[i, rows] = False
        else:
            untouched[table[i, rows // page], rows % page] = False
    np.testing.assert_array_equal(kh[untouched], kc[untouched])
    np.testing.assert_array_equal(vh[untouched], vc[untouched])


@st.composite
def device_metadata_cases(draw):
    """A KV-cache call with metadata on the device: lengths anywhere in [-3, Nmax + 3] and,
    paged, a page table whose entries may name pages that do not exist."""
    b = draw(st.integers(1, 4))
    page = draw(st.sampled_from([0, 3, 4]))          # 0: a contiguous cache
    max_pages = draw(st.integers(1, 4))
    nmax = page * max_pages if page else draw(st.integers(1, 12))
    n_new = draw(st.integers(0, min(2, nmax)))
    lens = draw(st.lists(st.integers(0, nmax - n_new) | st.integers(-3, nmax + 3), min_size=b, max_size=b))
    num_pages = b * max_pages + 1
    table = None
    if page:        # distinct pages (sequences share none), some entries replaced by pages that do not exist
        order = draw(st.permutations(range(num_pages)))[:b * max_pages]
        bad = draw(st.lists(st.sampled_from([None] * 9 + [-1, num_pages, 2**31 - 1]), min_size=b * max_pages,
                            max_size=b * max_pages))
        flat = [p if x is None else x for p, x in zip(order, bad)]
        table = [flat[i * max_pages:(i + 1) * max_pages] for i in range(b)]
    return dict(b=b, page=page, nmax=nmax, n_new=n_new, lens=lens, table=table, num_pages=num_pages,
                nq=draw(st.integers(1, 3)), group=draw(st.sampled_from([1, 2])),
                dtype=draw(st.sampled_from(["float32", "bfloat16"])), causal=draw(st.booleans()))


@given(case=device_metadata_cases())
def test_kvcache_device_metadata_property(case):
    """Whatever the device metadata holds: a sequence whose length lies in [0, Nmax - Nnew]
    and whose pages in use exist matches the oracle over its rows after its appends; any
    other is skipped (zeros, lse -inf); only the kept sequences' new rows are written."""
    note(str(case))
    rng = np.random.default_rng()
    b, page, n_new, nmax = case["b"], case["page"], case["n_new"], case["nmax"]
    hkv, d = 1, 16 if case["dtype"] in LOW else 8
    hq = hkv * case["group"]
    dt = np_dtype(case["dtype"])
    shape = (case["num_pages"], page, hkv, d) if page else (b, nmax, hkv, d)
    q = rng.standard_normal((b, case["nq"], hq, d)).astype(dt)
    kc, vc = (rng.standard_normal(shape).astype(dt) for _ in range(2))
    kn, vn = (rng.standard_normal((b, n_new, hkv, d)).astype(dt) for _ in range(2))
    lens = np.array(case["lens"], np.int32)
    table = None if not page else np.array(case["table"], np.int32)
    caches = [_device(kc), _device(vc)]
    extra = {} if table is None else dict(block_table=cuda.to_device(table))
    new = dict(k_new=_device(kn), v_new=_device(vn)) if n_new else {}
    out, lse = numba_flash.attention_with_kvcache(_device(q), *caches, cuda.to_device(lens), causal=case["causal"],
                                                  return_lse=True, check_metadata=False, **new, **extra)
    out, lse, kh, vh = _host(out), _host(lse), _host(caches[0]), _host(caches[1])
    expect_k, expect_v = kc.copy(), vc.copy()
    for i in range(b):
        n = int(lens[i])
        ok = 0 <= n <= nmax - n_new
        if ok and page:
            used = -(-(n + n_new) // page)
            ok = all(0 <= p < case["num_pages"] for p in table[i, :used])
        if not ok:
            assert (out[i].astype(np.float64) == 0).all() and np.isneginf(lse[i]).all(), i
            continue
        rows = np.arange(n, n + n_new)
        for expect, new in ((expect_k, kn), (expect_v, vn)):
            if page:
                expect[table[i, rows // page], rows % page] = new[i]
            else:
                expect[i, rows] = new[i]
        k_rows, v_rows = _cache_rows(expect_k, table, i, n + n_new), _cache_rows(expect_v, table, i, n + n_new)
        _check(case["dtype"], _heads_first(out[i]), np.ascontiguousarray(lse[i].T), _heads_first(q[i]),
               _heads_first(k_rows), _heads_first(v_rows), dict(causal=case["causal"]))
    np.testing.assert_array_equal(kh.view(np.uint8), expect_k.view(np.uint8))
    np.testing.assert_array_equal(vh.view(np.uint8), expect_v.view(np.uint8))


def test_kvcache_device_metadata_bad_input():
    """``check_metadata=False`` refuses, naming the fix, what it cannot read on the device."""
    q, kc = np.zeros((2, 1, 2, 8), np.float32), np.zeros((2, 6, 2, 8), np.float32)
    qd, kd = cuda.to_device(q), cuda.to_device(kc)
    lens = cuda.to_device(np.array([1, 2], np.int32))
    call = lambda *a, **kw: numba_flash.attention_with_kvcache(*a, check_metadata=False, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="q and the caches must be device arrays"):
        call(q, kc, kc, np.array([1, 2], np.int32))
    with pytest.raises(TypeError, match="cache_seqlens must be a device array"):
        call(qd, kd, kd, np.array([1, 2], np.int32))
    with pytest.raises(ValueError, match=r"int32 or int64 device array of shape \(2,\), got dtype float32"):
        call(qd, kd, kd, cuda.to_device(np.array([1, 2], np.float32)))
    with pytest.raises(ValueError, match=r"shape \(2,\), got dtype int32 and shape \(3,\)"):
        call(qd, kd, kd, cuda.to_device(np.array([1, 2, 3], np.int32)))
    with pytest.raises(ValueError, match="k_new adds 7 rows to caches of Nmax=6 rows"):
        kn = cuda.to_device(np.zeros((2, 7, 2, 8), np.float32))
        call(qd, kd, kd, lens, k_new=kn, v_new=kn)
    pages = cuda.to_device(np.zeros((2, 6, 2, 8), np.float32))
    with pytest.raises(TypeError, match="block_table must be a device array"):
        call(qd, pages, pages, lens, block_table=np.zeros((2, 1), np.int32))
    with pytest.raises(ValueError, match=r"block_table must be an int32 or int64 device array of shape"):
        call(qd, pages, pages, lens, block_table=cuda.to_device(np.zeros((2, 0), np.int32)))


def test_paged_kvcache_bad_input():
    q = np.zeros((2, 1, 2, 8), np.float16)
    kc = np.zeros((4, 4, 2, 8), np.float16)
    table = np.array([[0, 1], [2, 9]], np.int32)
    with pytest.raises(ValueError, match=r"block_table\[1\] names page 9"):
        numba_flash.attention_with_kvcache(q, kc, kc, np.array([3, 5], np.int32), block_table=table)
    with pytest.raises(ValueError, match=r"lie in \[0, Nmax=8\]"):
        numba_flash.attention_with_kvcache(q, kc, kc, np.array([3, 9], np.int32), block_table=table)
    with pytest.raises(ValueError, match="block_table must be an integer"):
        numba_flash.attention_with_kvcache(q, kc, kc, np.array([3, 4], np.int32), block_table=table[:1])


def test_page_table_checks_read_only_the_entries_in_use():
    """Entries past a sequence's pages may hold anything (-1 padding, huge values), in any
    integer type, and change nothing; a bad entry in use is named; cache lengths are
    bounded for small and large batches alike."""
    from numba_flash import varlen
    used = np.array([5, 8])                                  # pages of 4: two entries each
    for dtype, junk in ((np.int32, -1), (np.int64, 2**40), (np.uint32, 2**32 - 1), (np.int16, -7)):
        table = np.array([[3, 1, junk], [0, 2, junk]], dtype)
        varlen._check_pages(varlen._page_table(table, 2), used, 4, 4)
        bad = table.copy()
        bad[1, 1] = junk
        with pytest.raises(ValueError, match=rf"block_table\[1\] names page {int(bad[1, 1])},"):
            varlen._check_pages(varlen._page_table(bad, 2), used, 4, 4)
    for n in (3, 300):
        lens = np.full(n, 8, np.int32)
        assert varlen._cache_lens(lens, n, 8).tolist() == [8] * n
        for wrong in (9, -1):
            lens[n // 2] = wrong
            with pytest.raises(ValueError, match=r"lie in \[0, Nmax=8\]"):
                varlen._cache_lens(lens, n, 8)
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 1, 2, 8)).astype(np.float32)
    kc, vc = (rng.standard_normal((4, 4, 2, 8)).astype(np.float32) for _ in range(2))
    lens = np.array([5, 8], np.int32)
    padded = numba_flash.attention_with_kvcache(q, kc, vc, lens, block_table=np.array([[3, 1, -1], [0, 2, -1]],
                                                                                    np.int32))
    valid = numba_flash.attention_with_kvcache(q, kc, vc, lens, block_table=np.array([[3, 1, 0], [0, 2, 1]],
                                                                                   np.int32))
    assert not np.isnan(padded).any()
    np.testing.assert_array_equal(padded, valid)


@pytest.mark.parametrize("dtype,device,hopper", [("float32", False, False), ("bfloat16", True, False),
                                                ("float64", True, False), ("bfloat16", False, True)])
def test_varlen_backward_matches_oracle(dtype, device, hopper, monkeypatch):
    """The gradients of a packed batch (an empty sequence, one with queries but no keys and
    one with keys but no queries among them, grouped heads, causal) are each sequence's
    own, by the backward tests' tolerance rules; also with the Hopper family forced
    (d = 64), whose tensor maps cannot describe a sequence without queries or keys (those
    take the next family)."""
    from test_backward import check_backward
    from test_backward_mma import check_backward_low
    if hopper:
        if ON_GPU and tuple(cuda.get_current_device().compute_capability) != (9, 0):
            pytest.skip("the Hopper family runs on compute capability 9.0 only")
        monkeypatch.setenv(registry.HOPPER_ENV, "1")
    case = dict(dtype=dtype, lens_q=[6, 0, 3, 0, 9], lens_k=[6, 0, 0, 4, 13], hq=2, hkv=1,
                d=64 if hopper else 16 if dtype in LOW else 8, options=dict(causal=True), alibi=False, seed=8)
    q, k, v, cu_q, cu_k, _ = _varlen_inputs(case)
    dout = np.random.default_rng(9).standard_normal(q.shape).astype(q.dtype)
    out, lse = numba_flash.attention_varlen_fwd(q, k, v, cu_q, cu_k, causal=True)
    args = [dout, q, k, v, out, lse]
    if device:
        args = [cuda.to_device(x) if x is lse else _device(x) for x in args]
    grads = numba_flash.attention_varlen_bwd(*args, cu_q, cu_k, causal=True)
    dq, dk, dv = (_host(g) for g in grads)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for b in range(len(cu_q) - 1):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if cu_q[b + 1] == cu_q[b]:
            assert not dk[rk].astype(np.float64).any() and not dv[rk].astype(np.float64).any()
            continue
        g = [_heads_first(x) for x in (dq[rq], dk[rk], dv[rk])]
        sq = [_heads_first(x) for x in (dout[rq], q[rq], k[rk], v[rk])]
        (check_backward_low if dtype in LOW else check_backward)(g, *sq, dict(causal=True), None)


@pytest.mark.parametrize("dtype,device,paged", [("float32", False, False), ("bfloat16", True, False),
                                                ("float16", True, True)])
def test_decoding_groups_query_heads(dtype, device, paged, monkeypatch):
    """One query per sequence with grouped heads: a group's query heads are one block's rows
    (``varlen._grouped_rows``), causal dropped as a no-op; a softcap still applies; the
    result is each head's attention over its sequence's cache."""
    calls = []
    real = numba_flash.varlen._grouped_rows
    monkeypatch.setattr(numba_flash.varlen, "_grouped_rows", lambda *a: calls.append(a) or real(*a))
    rng = np.random.default_rng(10)
    dt = np_dtype(dtype)
    b, hq, hkv, d, n = 3, 6, 2, 16 if dtype in LOW else 8, 24
    q = rng.standard_normal((b, 1, hq, d)).astype(dt)
    lens = np.array([24, 1, 0], np.int32)
    if paged:
        page = 8
        kc, vc = (rng.standard_normal((b * 3, page, hkv, d)).astype(dt) for _ in range(2))
        table = rng.permutation(b * 3).reshape(b, 3).astype(np.int32)
        flat = lambda c, i: np.concatenate([c[p] for p in table[i]])  # noqa: E731
        extra = dict(block_table=table)
    else:
        kc, vc = (rng.standard_normal((b, n, hkv, d)).astype(dt) for _ in range(2))
        flat = lambda c, i: c[i]  # noqa: E731
        extra = {}
    args = [_device(x) for x in (q, kc, vc)] if device else [q, kc, vc]
    out, lse = numba_flash.attention_with_kvcache(*args, lens, causal=True, softcap=5.0, return_lse=True, **extra)
    assert calls, "the grouped-rows path was not taken"
    out, lse = _host(out), _host(lse)
    for i in range(b):
        ks, vs = (_heads_first(flat(c, i)[:lens[i]]) for c in (kc, vc))
        _check(dtype, _heads_first(out[i]), np.ascontiguousarray(lse[i].T), _heads_first(q[i]), ks, vs,
               dict(softcap=5.0))


def _torch_caches(torch, rng, paged, b, nmax, hkv, d, page):
    """``(t, k_cache, v_cache, table, extra)`` of random bf16 PyTorch caches: ``t`` makes
    bf16 CUDA tensors; paged: ``b · nmax / page`` shuffled pages, ``table`` their
    page table and ``extra`` the call's ``block_table``; else ``(b, nmax, hkv, d)``,
    table None and no extra."""
    t = lambda x: torch.tensor(x, dtype=torch.bfloat16, device="cuda")  # noqa: E731
    if not paged:
        return (t, *(t(rng.standard_normal((b, nmax, hkv, d))) for _ in range(2)), None, {})
    n_pages = b * nmax // page
    kc, vc = (t(rng.standard_normal((n_pages, page, hkv, d))) for _ in range(2))
    table = rng.permutation(n_pages).astype(np.int32).reshape(b, nmax // page)
    return t, kc, vc, table, dict(block_table=torch.tensor(table, device="cuda"))


@pytest.mark.skipif(not ON_GPU, reason="launch plans exist only on a GPU")
@pytest.mark.parametrize("paged,group", [(False, 1), (False, 4), (True, 2)])
def test_decode_steps_through_launch_plans(paged, group, monkeypatch):
    """Decoding steps as a server makes them (PyTorch tensors, one new token appended per
    step, cache_seqlens advanced by the caller): the first step leaves a launch plan and the
    next steps run through it (new sequence tables each step), every step matching the oracle
    and every cache row where it belongs."""
    torch = pytest.importorskip("torch")
    from numba_flash import _plans
    monkeypatch.setattr(_plans, "_PLANS", {})
    runs = []
    original = _plans.Plan.run
    monkeypatch.setattr(_plans.Plan, "run",
                        lambda self, sig, *a, **kw: runs.append(1) or original(self, sig, *a, **kw))
    rng = np.random.default_rng(8)
    b, nmax, hkv, d, page = 3, 96, 2, 64, 16
    hq = hkv * group
    lens = np.array([10, 0, 77], np.int32)
    t, kc, vc, table, extra = _torch_caches(torch, rng, paged, b, nmax, hkv, d, page)
    for step in range(3):
        q = t(rng.standard_normal((b, 1, hq, d)))
        kn, vn = (t(rng.standard_normal((b, 1, hkv, d))) for _ in range(2))
        out, lse = numba_flash.attention_with_kvcache(q, kc, vc, lens, k_new=kn, v_new=vn, return_lse=True, **extra)
        assert len(runs) == step, "steps after the first must run through the plan"
        f = lambda x: x.float().cpu().numpy().astype(np_dtype("bfloat16"))  # noqa: E731  (exact)
        kh, vh = f(kc), f(vc)
        for i in range(b):
            n = lens[i] + 1
            k_rows, v_rows = _cache_rows(kh, table, i, n), _cache_rows(vh, table, i, n)
            np.testing.assert_array_equal(k_rows[-1], f(kn)[i, 0])
            np.testing.assert_array_equal(v_rows[-1], f(vn)[i, 0])
            _check("bfloat16", _heads_first(f(out)[i]), np.ascontiguousarray(lse.cpu().numpy()[i].T),
                   _heads_first(f(q)[i]), _heads_first(k_rows), _heads_first(v_rows), dict(causal=False))
        lens += 1


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs and launch plans exist only on a GPU")
@pytest.mark.parametrize("paged", [False, True])
def test_decode_steps_with_device_metadata_replay_in_a_cuda_graph(paged):
    """A server's decoding step with ``check_metadata=False`` (PyTorch tensors, the
    lengths advanced on the device): two calls on a side stream (the first builds the launch
    plan, the second runs it), then one captured in a CUDA graph on that stream; each replay
    reads the lengths as they are at replay time, appends where they say and matches the
    oracle, with no host copy of the metadata anywhere."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(13)
    b, nmax, hq, hkv, d, page = 3, 96, 4, 2, 64, 16
    t, kc, vc, table, extra = _torch_caches(torch, rng, paged, b, nmax, hkv, d, page)
    lens = torch.tensor([10, 0, 77], dtype=torch.int32, device="cuda")
    q, kn, vn = t(np.zeros((b, 1, hq, d))), t(np.zeros((b, 1, hkv, d))), t(np.zeros((b, 1, hkv, d)))
    step = lambda: numba_flash.attention_with_kvcache(q, kc, vc, lens, k_new=kn, v_new=vn, return_lse=True,  # noqa: E731
                                                      check_metadata=False, **extra)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):                      # (writes zeros at rows 10, 0 and 77, then at 11, 1 and 78)
            step()
            lens += 1
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out, lse = step()
    f = lambda x: x.float().cpu().numpy().astype(np_dtype("bfloat16"))  # noqa: E731  (exact)
    for _ in range(3):
        for x in (q, kn, vn):
            x.copy_(t(rng.standard_normal(tuple(x.shape))))
        graph.replay()
        lens_h = lens.cpu().numpy()
        kh, vh = f(kc), f(vc)
        for i in range(b):
            n = lens_h[i] + 1
            k_rows, v_rows = _cache_rows(kh, table, i, n), _cache_rows(vh, table, i, n)
            np.testing.assert_array_equal(k_rows[-1], f(kn)[i, 0])
            _check("bfloat16", _heads_first(f(out)[i]), np.ascontiguousarray(lse.cpu().numpy()[i].T),
                   _heads_first(f(q)[i]), _heads_first(k_rows), _heads_first(v_rows), dict(causal=False))
        lens += 1
