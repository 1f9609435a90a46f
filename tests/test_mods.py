"""Programmable attention: ``score_mod`` / ``mask_mod`` / ``mod_args`` (plain Python functions
compiled into every kernel family) against the float64 oracle given the same functions.

Each function below is ordinary Python: the simulator calls it as it is, a GPU compiles it
into the kernels. Problems are tiny (the simulator runs them), drawn fresh per test.
"""
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, note, settings
from hypothesis import strategies as st

import numba_flash  # before numba: it decides whether the simulator is needed
from numba_flash import families, reference, registry, scores
from numba_flash.testing import assert_attention_close
from conftest import ON_GPU, ROOT, process_failure, project_env
from test_backward import check_backward
from test_backward_mma import check_backward_low

DTYPES = ("float32", "float64", "float16", "bfloat16")


def assert_same_result(got, want):
    """A block mask's result against the function's without it: bitwise in the simulator
    (the same Python arithmetic runs); on a GPU the exact mask's score loop never calls
    the function, so the compiler may fold the scale into an FMA there and not in the
    other (measured: dQ one unit in the last place apart in float32 and float64), hence
    within four units in the last place of the largest element."""
    for a, b in zip(got, want):
        if not ON_GPU:
            assert a.tobytes() == b.tobytes()
            continue
        ulp = 2.0 ** -7 if a.dtype == ml_dtypes.bfloat16 else float(np.finfo(a.dtype).eps)
        a, b = a.astype(np.float64), b.astype(np.float64)
        np.testing.assert_allclose(a, b, rtol=0, atol=4 * ulp * max(np.abs(b).max(), 1.0))


def causal_mask(b, h, i, j):
    return j <= i


def relative_bias(s, b, h, i, j, table, shift):
    return s + table[h, i - j + shift]


def bias_grad(s, b, h, i, j, table, shift):
    return 1.0


def same_document(b, h, i, j, docs):
    return docs[b, i] == docs[b, j]


def scaled(s, b, h, i, j, w):
    return s * w


def scaled_grad(s, b, h, i, j, w):
    return w


def bottom_right(b, h, i, j, table, shift):
    return j <= i + shift - 69          # 70 queries, 90 keys: causal, bottom-right aligned


def nothing_for_odd_rows(b, h, i, j):
    return i % 2 == 0


def _inputs(dtype, lead, nq, nk, d, seed, lead_k=None):
    rng = np.random.default_rng(seed)
    npdt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    q = rng.standard_normal(lead + (nq, d)).astype(npdt)
    k, v = (rng.standard_normal((lead_k or lead) + (nk, d)).astype(npdt) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(npdt)
    return rng, q, k, v, dout


def _check_grads(grads, dout, q, k, v, options):
    if q.dtype.name in ("float16", "bfloat16"):
        check_backward_low(grads, dout, q, k, v, options, None)
    else:
        check_backward(grads, dout, q, k, v, options, None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mask_mod_expresses_causal(dtype):
    """A mask_mod of j <= i gives what causal=True gives (Nq == Nk), forward and backward."""
    rng, q, k, v, dout = _inputs(dtype, (2,), 17, 17, 16, 1)
    out, lse = numba_flash.attention_fwd(q, k, v, mask_mod=causal_mask)
    assert_attention_close(out, q, k, v, lse, causal=True)
    assert_attention_close(out, q, k, v, lse, mask_mod=causal_mask)
    grads = numba_flash.attention_bwd(dout, q, k, v, out, lse, mask_mod=causal_mask)
    _check_grads(grads, dout, q, k, v, {"causal": True})


@pytest.mark.parametrize("dtype", DTYPES)
def test_relative_bias_from_a_table(dtype):
    """A score_mod reading a per-head table of relative-position biases (a NumPy array and
    an int in mod_args), forward and backward (its gradient 1: an additive bias), Nq != Nk."""
    rng, q, k, v, dout = _inputs(dtype, (3,), 13, 21, 16, 2)
    table = rng.standard_normal((3, 13 + 21)).astype(np.float32)
    options = {"score_mod": relative_bias, "mod_args": (table, 20)}
    out, lse = numba_flash.attention_fwd(q, k, v, **options)
    assert_attention_close(out, q, k, v, lse, **options)
    grads = numba_flash.attention_bwd(dout, q, k, v, out, lse, score_mod_grad=bias_grad, **options)
    _check_grads(grads, dout, q, k, v, {**options, "score_mod_grad": bias_grad})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_document_mask_with_every_built_in_rule(dtype):
    """Document masking (ids in mod_args) with causal, softcap, ALiBi and grouped heads
    (Hq = 4, Hkv = 2), ragged lengths; rows of the first document see keys of it only."""
    rng, q, k, v, dout = _inputs(dtype, (1, 4), 23, 23, 16, 3, lead_k=(1, 2))
    docs = np.sort(rng.integers(0, 3, (1, 23)), axis=1).astype(np.int32)
    slopes = (2.0 ** -rng.uniform(1, 4, 4)).astype(np.float32)
    options = {"mask_mod": same_document, "mod_args": (docs,), "causal": True, "softcap": 4.0,
               "alibi_slopes": slopes}
    out, lse = numba_flash.attention_fwd(q, k, v, **options)
    assert_attention_close(out, q, k, v, lse, **options)
    grads = numba_flash.attention_bwd(dout, q, k, v, out, lse, **options)
    _check_grads(grads, dout, q, k, v, options)


def test_score_mod_gradient_is_applied():
    """A multiplicative score_mod: the backward multiplies dS by score_mod_grad (float64,
    against the oracle's float64 gradients), with the weight a Python float."""
    rng, q, k, v, dout = _inputs("float64", (2,), 11, 17, 8, 4)
    options = {"score_mod": scaled, "score_mod_grad": scaled_grad, "mod_args": (0.37,)}
    out, lse = numba_flash.attention_fwd(q, k, v, score_mod=scaled, mod_args=(0.37,))
    assert_attention_close(out, q, k, v, lse, score_mod=scaled, mod_args=(0.37,))
    grads = numba_flash.attention_bwd(dout, q, k, v, out, lse, **options)
    _check_grads(grads, dout, q, k, v, options)
    plain = numba_flash.attention_bwd(dout, q, k, v, out, lse, score_mod=scaled, score_mod_grad=bias_grad_1,
                                      mod_args=(0.37,))
    assert not np.allclose(plain[0], grads[0]), "the gradient of the score_mod made no difference"


def bias_grad_1(s, b, h, i, j, w):
    return 1.0


def test_rows_that_see_nothing_and_device_mod_args():
    """A mask_mod that hides every key from odd rows: out 0, lse -inf, zero gradient there;
    mod_args given as device arrays (float32 input)."""
    from numba import cuda
    rng, q, k, v, dout = _inputs("float32", (2,), 10, 9, 8, 5)
    table = rng.standard_normal((2, 19)).astype(np.float32)
    options = {"mask_mod": nothing_for_odd_rows}
    out, lse = numba_flash.attention_fwd(q, k, v, **options)
    assert (out[:, 1::2] == 0).all() and np.isneginf(lse[:, 1::2]).all()
    assert_attention_close(out, q, k, v, lse, **options)
    grads = numba_flash.attention_bwd(dout, q, k, v, out, lse, **options)
    assert (grads[0][:, 1::2] == 0).all()
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    o2, l2 = numba_flash.attention_fwd(dq, dk, dv, score_mod=relative_bias, mod_args=(cuda.to_device(table), 9))
    assert_attention_close(o2, q, k, v, l2, score_mod=relative_bias, mod_args=(table, 9))


def test_hopper_family_takes_mods(monkeypatch):
    """The Hopper family (forced) with a score_mod and a mask_mod: its launch, and the result."""
    if ON_GPU:
        from numba import cuda
        if cuda.get_current_device().compute_capability != (9, 0):
            pytest.skip("the Hopper family runs on compute capability 9.0 only")
    monkeypatch.setenv(registry.HOPPER_ENV, "1")
    rng, q, k, v, _ = _inputs("bfloat16", (2,), 70, 90, 64, 6)
    table = rng.standard_normal((2, 160)).astype(np.float32)
    options = {"score_mod": relative_bias, "mask_mod": bottom_right, "mod_args": (table, 89)}
    from numba_flash import families
    seen = []
    real = families._hopper_launches
    monkeypatch.setattr(families, "_hopper_launches", lambda *a: seen.append(1) or real(*a))
    out, lse = numba_flash.attention_fwd(q, k, v, **options)
    assert seen, "the Hopper family did not take the call"
    assert_attention_close(out, q, k, v, lse, **options)


def test_kernels_are_cached_per_function_not_per_data():
    """The compiled rules are keyed by the functions and the number of mod_args only."""
    a = scores.parse(score_mod=relative_bias, nargs=2).spec
    assert a == scores.parse(score_mod=relative_bias, nargs=2).spec and hash(a) == hash(scores.parse(
        score_mod=relative_bias, nargs=2).spec)
    assert a != scores.parse(score_mod=scaled, nargs=1).spec
    assert "+mods" in a.tag


@pytest.mark.parametrize("call, match", [
    (lambda q: numba_flash.attention(q, q, q, score_mod=3), "score_mod must be a Python function"),
    (lambda q: numba_flash.attention(q, q, q, mask_mod=causal_mask, mod_args=np.zeros(3)), "mod_args must be a tuple"),
    (lambda q: numba_flash.attention(q, q, q, mod_args=(1,)), "without a score_mod or mask_mod"),
    (lambda q: numba_flash.attention(q, q, q, mask_mod=causal_mask, mod_args=("x",)), r"mod_args\[0\] must be"),
    (lambda q: numba_flash.attention(q, q, q, mask_mod=causal_mask, mod_args=(np.zeros(2, np.float16),)),
     "mod_args arrays must be"),
    (lambda q: numba_flash.attention_bwd(q, q, q, q, q, q[..., 0], score_mod=scaled, mod_args=(1.0,)),
     "needs score_mod_grad"),
    (lambda q: numba_flash.attention_bwd(q, q, q, q, q, q[..., 0], score_mod_grad=scaled_grad, mod_args=(1.0,)),
     "without a score_mod"),
])
def test_bad_mods_get_clear_errors(call, match):
    q = np.random.default_rng(7).standard_normal((2, 4, 8)).astype(np.float32)
    with pytest.raises((TypeError, ValueError), match=match):
        call(q)


def test_a_function_that_fails_in_the_simulator_is_named():
    """In the simulator the functions run as Python: a score_mod returning a string fails
    with a TypeError naming it and saying what it must return."""
    if ON_GPU:
        pytest.skip("the simulator calls the functions as Python")

    def returns_text(s, b, h, i, j):
        return "x"
    q = np.random.default_rng(8).standard_normal((1, 8, 8)).astype(np.float32)
    with pytest.raises(TypeError, match="score_mod .*returns_text.*must return a number"):
        numba_flash.attention(q, q, q, score_mod=returns_text)


@pytest.mark.skipif(not ON_GPU, reason="Numba compiles user functions on a GPU (the simulator calls them)")
def test_a_function_that_does_not_compile_is_named():
    def uses_a_dict(s, b, h, i, j):
        return s + {"a": 1.0}["a"]
    q = np.random.default_rng(8).standard_normal((2, 16, 16)).astype(np.float32)
    with pytest.raises(TypeError, match="uses_a_dict"):
        numba_flash.attention(q, q, q, score_mod=uses_a_dict)


_PTX = """
from numba_flash import ptx, registry
from numba_flash.scores import Mods, ScoreSpec
import test_mods as m
spec = ScoreSpec(causal=True, mods=Mods(m.relative_bias, m.same_document3, m.bias_grad, 2, blocks=True))
for v, cc, want in (("forward_mma", (8, 0), "mma.sync"), ("forward_wgmma", (9, 0, "a"), "wgmma.mma_async"),
                    ("backward_dq_mma", (8, 0), "mma.sync"), ("backward_dkdv_mma", (8, 0), "mma.sync")):
    s = registry.specialisation(v, "bfloat16", 64, spec, True)
    sig = s.signature()
    at = sig.rindex("float32[:, :, :]")
    sig = (sig[:at] + "Tuple((float32[:, :, :], Tuple((float32[:, ::1], int64)), int32[:, ::1]))"
           + sig[at + len("float32[:, :, :]"):])
    text = list(ptx.compile_ptx(s.kernel().py_func, sig, [cc], (s.tiling.threads, 1)).values())[0]
    assert text.count(want) > 0, (v, want)
    print(v, text.count(want))
"""


# --------------------------------------------------------------------------- block masks
def doc_causal(b, h, i, j, docs):
    return docs[b, i] == docs[b, j] and j <= i


def _docs(rng, B, N, n_docs=3):
    return np.sort(rng.integers(0, n_docs, (B, N)), axis=1).astype(np.int32)


def test_block_mask_ranges_against_brute_force():
    """Per query row the first and one-past-last visible key, per tile the union, and the
    density, against a brute-force evaluation of the function; B = H = 1 broadcasts."""
    rng = np.random.default_rng(9)
    docs = _docs(rng, 2, 21)
    bm = numba_flash.block_mask(doc_causal, 2, 3, 21, 21, mod_args=(docs,))
    vis = np.array([[[[doc_causal(b, h, i, j, docs) for j in range(21)] for i in range(21)] for h in range(3)]
                    for b in range(2)])
    first = np.where(vis.any(-1), vis.argmax(-1), 21)
    last = np.where(vis.any(-1), 21 - vis[..., ::-1].argmax(-1), 0)
    assert (bm.row_ranges() == np.stack([first, last], -1)).all()
    assert abs(bm.density - vis.mean()) < 1e-12
    tiles = bm.tile_ranges(8)
    for t in range(3):
        rows = slice(8 * t, min(21, 8 * t + 8))
        assert (tiles[:, :, t, 0] == first[:, :, rows].min(-1)).all()
        assert (tiles[:, :, t, 1] == last[:, :, rows].max(-1)).all()
    assert "density" in repr(bm)
    assert bm.exact          # sorted documents, causal within: every row sees one run
    table = bm.device_table(8, 5).copy_to_host()     # (B·H, 4 + 2·24 + 4·3 + 2·5): header, rows, tiles
    assert table.shape == (6, 74) and table.dtype == np.int32
    assert (table[:, :4] == [4, 52, 64, 0]).all()
    ends = np.concatenate([np.stack([first, last], -1), np.broadcast_to([21, 0], (2, 3, 3, 2))], axis=2)
    assert (table[:, 4:52].reshape(2, 3, 24, 2) == ends).all()
    for kt in range(5):                             # key tiles of 5: the queries that see any of their keys
        sees = vis[..., 5 * kt:5 * kt + 5].any(-1)          # (B, H, Nq)
        lo = np.where(sees.any(-1), sees.argmax(-1), 21)
        hi = np.where(sees.any(-1), 21 - sees[..., ::-1].argmax(-1), 0)
        assert (table[:, 64 + 2 * kt].reshape(2, 3) == lo).all() and (table[:, 65 + 2 * kt].reshape(2, 3) == hi).all()
    for t in range(3):
        at = 52 + 4 * t
        rows = slice(8 * t, min(21, 8 * t + 8))
        inner_lo, inner_hi = first[:, :, rows].max(-1), last[:, :, rows].min(-1)
        assert (table[:, at:at + 2].reshape(2, 3, 2) == tiles[:, :, t]).all()
        assert (table[:, at + 2].reshape(2, 3) == inner_lo).all()
        assert (table[:, at + 3].reshape(2, 3) == np.maximum(inner_hi, inner_lo)).all()
    holes = numba_flash.block_mask(same_document3, 1, 1, 21, 21, mod_args=(docs, 0))
    assert not holes.exact and (holes.device_table(8).copy_to_host()[:, 52:].reshape(1, 3, 4)[..., 2:] == 0).all()


@pytest.mark.parametrize("dtype, hopper", [("float32", False), ("bfloat16", False), ("bfloat16", True)])
def test_block_mask_gives_the_mask_mods_result(dtype, hopper, monkeypatch):
    """A call with block_mask= gives what the same mask_mod gives without it (the tiles
    it skips are all hidden; :func:`assert_same_result`), in each forward family, and the
    backward too."""
    if hopper:
        if ON_GPU:
            from numba import cuda
            if cuda.get_current_device().compute_capability != (9, 0):
                pytest.skip("the Hopper family runs on compute capability 9.0 only")
        monkeypatch.setenv(registry.HOPPER_ENV, "1")
    d = 64 if hopper else 16
    rng, q, k, v, dout = _inputs(dtype, (2, 2), 37, 37, d, 10)
    docs = _docs(rng, 2, 37)
    bm = numba_flash.block_mask(doc_causal, 2, 1, 37, 37, mod_args=(docs,))       # H = 1: every head
    out, lse = numba_flash.attention_fwd(q, k, v, block_mask=bm)
    o2, l2 = numba_flash.attention_fwd(q, k, v, mask_mod=doc_causal, mod_args=(docs,))
    assert_same_result((out, lse), (o2, l2))
    assert_attention_close(out, q, k, v, lse, mask_mod=doc_causal, mod_args=(docs,))
    if not hopper:
        grads = numba_flash.attention_bwd(dout, q, k, v, out, lse, block_mask=bm)
        _check_grads(grads, dout, q, k, v, {"mask_mod": doc_causal, "mod_args": (docs,)})


def test_block_mask_skips_what_no_row_of_a_tile_sees():
    """In the simulator the function is Python: count its calls. With the block mask the
    forward evaluates it only inside each query tile's range (far fewer calls for three
    documents), and gives the same result."""
    if ON_GPU:
        pytest.skip("counts calls of the Python function, which only the simulator makes")
    calls = []

    def counted(b, h, i, j, docs):
        calls.append(1)
        return docs[b, i] == docs[b, j]
    rng, q, k, v, dout = _inputs("float32", (1, 1), 64, 64, 8, 11)
    docs = np.repeat(np.arange(4, dtype=np.int32), 16)[None]
    plain, lse = numba_flash.attention_fwd(q, k, v, mask_mod=counted, mod_args=(docs,))
    n_plain = len(calls)
    bm = numba_flash.block_mask(counted, 1, 1, 64, 64, mod_args=(docs,))
    calls.clear()
    blocked = numba_flash.attention(q, k, v, block_mask=bm)
    assert blocked.tobytes() == plain.tobytes()
    assert len(calls) <= n_plain // 2, (len(calls), n_plain)
    calls.clear()   # the backward: dQ blocks mask by the rows' runs, dK/dV blocks take only the queries that see them
    g_plain = numba_flash.attention_bwd(dout, q, k, v, plain, lse, mask_mod=counted, mod_args=(docs,))
    n_plain = len(calls)
    calls.clear()
    g_blocked = numba_flash.attention_bwd(dout, q, k, v, plain, lse, block_mask=bm)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(g_plain, g_blocked))
    assert len(calls) <= n_plain // 4, (len(calls), n_plain)        # four documents


@pytest.mark.parametrize("dtype, hopper", [("float32", False), ("bfloat16", False), ("bfloat16", True)])
def test_forward_masks_exact_block_masks_without_the_function(dtype, hopper, monkeypatch):
    """Every forward family (in the simulator: CUDA cores, mma.sync, Hopper) masks by an
    exact block mask's row runs and never calls the function; a mask with holes (not
    exact) is called inside the bounds. Both against the oracle."""
    if ON_GPU:
        pytest.skip("counts calls of the Python function, which only the simulator makes")
    if hopper:
        monkeypatch.setenv(registry.HOPPER_ENV, "1")
    n, d = (150, 64) if hopper else (45, 16)
    calls = []

    def counted(b, h, i, j, docs):
        calls.append(1)
        return docs[b, i] == docs[b, j] and j <= i

    def holes(b, h, i, j, docs):
        calls.append(1)
        return docs[b, i] == docs[b, j] and (i - j) % 3 != 1
    rng, q, k, v, _ = _inputs(dtype, (1, 2), n, n, d, 12)
    docs = np.repeat(np.arange(3, dtype=np.int32), n // 3)[None]
    for fn, exact in ((counted, True), (holes, False)):
        bm = numba_flash.block_mask(fn, 1, 1, n, n, mod_args=(docs,))
        assert bm.exact == exact
        calls.clear()
        out, lse = numba_flash.attention_fwd(q, k, v, block_mask=bm)
        assert (len(calls) == 0) == exact, (fn.__name__, len(calls))
        assert_attention_close(out, q, k, v, lse, mask_mod=fn, mod_args=(docs,))


def gap_mask(b, h, i, j, lo, hi):
    return (j < lo or j >= hi) and (i + j) % 5 != 0


def full_gap_mask(b, h, i, j, lo, hi):
    return j < lo or (j >= hi and (i + j) % 5 != 0)


def gap_mask_t(b, h, i, j, lo, hi):           # the two transposed (for dK/dV's lists)
    return (i < lo or i >= hi) and (i + j) % 5 != 0


def full_gap_mask_t(b, h, i, j, lo, hi):
    return i < lo or (i >= hi and (i + j) % 5 != 0)


# Masks with holes (not exact) that hide keys lo .. hi - 1 from every query (empty tiles
# inside the range), one also showing keys 0 .. lo - 1 to every query (full tiles): (mask,
# transposed, True where the full tiles are the keys below lo)
SKIPPING = {"gap": (gap_mask, gap_mask_t, False), "full+gap": (full_gap_mask, full_gap_mask_t, True)}


def _counting(fn, calls):
    """``fn`` on a GPU (Numba compiles it); in the simulator, which calls it as Python, ``fn``
    counting its calls in ``calls``."""
    def counted(b, h, i, j, lo, hi):
        calls.append(1)
        return fn(b, h, i, j, lo, hi)
    return fn if ON_GPU else counted


@pytest.mark.parametrize("mask", sorted(SKIPPING))
@pytest.mark.parametrize("dtype, hopper", [("bfloat16", True), ("bfloat16", False), ("float32", False)])
def test_forward_skips_empty_key_tiles(dtype, hopper, mask, monkeypatch):
    """Every forward family (Hopper, mma.sync, CUDA cores) with the masks of
    :data:`SKIPPING` (keys 128..255 hidden, of 400) visits the key tiles of the block
    mask's lists, the empty ones neither loaded nor computed, the full ones without calling
    the function (the simulator counts its calls: for the pairs of the partial tiles only;
    without the block mask, of all), with the oracle's result."""
    fn, _, full = SKIPPING[mask]
    if ON_GPU and hopper:
        from numba import cuda
        if cuda.get_current_device().compute_capability != (9, 0):
            pytest.skip("the Hopper family runs on compute capability 9.0 only")
    monkeypatch.setenv(registry.HOPPER_ENV, "1" if hopper else "0")
    calls = []
    gap, bounds = _counting(fn, calls), (128, 256)
    nq, nk = 20, 400                            # (one query tile; the simulator's time goes as nq · d)
    rng, q, k, v, _ = _inputs(dtype, (1, 1), nq, nk, 64 if hopper else 16, 14)
    bm = numba_flash.block_mask(gap, 1, 1, nq, nk, mod_args=bounds)
    assert not bm.exact and list(bm.tile_classes(128, 128)[0, 0, 0]) == [2 if full else 1, 0, 1, 1]
    calls.clear()
    out, lse = numba_flash.attention_fwd(q, k, v, block_mask=bm)
    with_lists = len(calls)
    calls.clear()
    plain, plain_lse = numba_flash.attention_fwd(q, k, v, mask_mod=gap, mod_args=bounds)
    if not ON_GPU:
        # every valid pair the same number of times (the CUDA-core family: once per slice of
        # the head dim), the keys of empty and full tiles never
        asked = nk - (256 if full else 128)
        assert len(calls) % (nq * nk) == 0 and with_lists * nk == len(calls) * asked, (with_lists, len(calls))
    assert_attention_close(out, q, k, v, lse, mask_mod=gap, mod_args=bounds)
    assert_same_result((out, lse), (plain, plain_lse))


@pytest.mark.parametrize("mask", sorted(SKIPPING))
@pytest.mark.parametrize("kind, dtype", [("dq", "bfloat16"), ("dq", "float32"), ("dkdv", "bfloat16"),
                                         ("dkdv", "float32")])
def test_backward_skips_empty_tiles(kind, dtype, mask, monkeypatch):
    """The backward kernels (tensor cores, CUDA cores) visit the block mask's lists as the
    forward does: dQ a query tile's key tiles, dK/dV a key tile's query tiles (the masks of
    :data:`SKIPPING` transposed, for query heads two to a K/V head), with keys (or queries)
    64..127 hidden, of 160. Each kernel runs alone (the other's launch dropped, so that the
    simulator counts its calls of the function only): the pairs of the partial tiles only
    (the tensor-core dQ kernel's: of the full ones too), its gradients as without the block
    mask and as the oracle's (tolerance: 2⁻⁶ of the largest element in bfloat16, whose
    products round to 8 bits; 1e-5 in float32)."""
    fn, fn_t, full = SKIPPING[mask]
    full = full and not (kind == "dq" and dtype == "bfloat16")   # (backward_mma's dQ: full_tiles=False)
    calls = []
    fn = fn if kind == "dq" else fn_t
    gap, bounds = _counting(fn, calls), (64, 128)
    n, m = 20, 160                              # one tile of the other side; the listed side
    nq, nk, heads, kv_heads = (n, m, (1, 1), None) if kind == "dq" else (m, n, (1, 2), (1, 1))
    rng, q, k, v, dout = _inputs(dtype, heads, nq, nk, 16, 15, kv_heads)
    wide = [np.asarray(x, np.float64) for x in (dout, q, k, v)]
    if kv_heads:
        wide[2:] = (np.repeat(x, 2, axis=-3) for x in wide[2:])
    out, lse = reference.attention_fwd(*wide[1:], mask_mod=fn, mod_args=bounds)     # (the simulator's time)
    out, lse = out.astype(q.dtype), lse.astype(np.float32)
    bm = numba_flash.block_mask(gap, 1, 1, nq, nk, mod_args=bounds)
    backward = families.backward

    def alone(*args, **kwargs):
        launches = backward(*args, **kwargs)
        assert len(launches) == 3, launches        # the pre-pass, dK/dV, dQ
        return [launches[0], launches[1 if kind == "dkdv" else 2]]
    monkeypatch.setattr(families, "backward", alone)
    grads = slice(0, 1) if kind == "dq" else slice(1, 3)
    calls.clear()
    got = numba_flash.attention_bwd(dout, q, k, v, out, lse, block_mask=bm)[grads]
    with_lists = len(calls)
    calls.clear()
    plain = numba_flash.attention_bwd(dout, q, k, v, out, lse, mask_mod=gap, mod_args=bounds)[grads]
    if not ON_GPU:
        pairs, asked = nq * nk * (1 if kind == "dq" else 2), m - (128 if full else 64)
        assert len(calls) % pairs == 0 and with_lists * m == len(calls) * asked, (with_lists, len(calls))
    assert_same_result(got, plain)
    want = reference.attention_bwd(*wide, mask_mod=fn, mod_args=bounds)[grads]
    if kv_heads:
        want = [w.reshape(1, 1, 2, nk, 16).sum(2) for w in want]     # dK, dV of the shared head
    tol = 2.0 ** -6 if dtype == "bfloat16" else 1e-5
    for g, w in zip(got, want):
        err = np.abs(g.astype(np.float64) - w).max()
        assert err <= tol * np.abs(w).max(), (err, np.abs(w).max())


@pytest.mark.parametrize("options", [{"causal": True}, {"window": (70, 10)}], ids=["causal", "window"])
def test_lists_leave_out_what_the_rules_hide(options):
    """A holed block mask with a built-in rule as well: its lists (each query tile's key
    tiles, each key tile's query tiles) hold only the tiles the rule lets some pair
    through, as the ranges the kernels visit without lists, and the forward gives the
    oracle's result (CUDA-core family, float32, 32-row tiles: the window's band crosses
    the gap)."""
    nq = nk = 200
    bounds = (64, 128)
    bm = numba_flash.block_mask(gap_mask, 1, 1, nq, nk, mod_args=bounds)
    assert not bm.exact
    rules = scores.parse(**options)
    rows = keys = 32
    table = np.asarray(bm.device_table(rows, keys, None, rows, rules).copy_to_host())
    n, m = -(-nq // rows), -(-nk // keys)
    classes = bm.tile_classes(rows, keys)[0, 0]
    for i in range(n):               # each query tile's key tiles
        begin, end = scores.key_range(rules, i * rows, rows, nq, nk)
        want = [j for j in range(m) if classes[i, j] != 0 and j * keys < end and (j + 1) * keys > begin]
        at = table[0, 3] + i * (m + 1)
        got = [int(x) & (scores.LIST_FULL - 1) for x in table[0, at + 1:at + 1 + table[0, at]]]
        assert got == want, (i, got, want)
    for j in range(m):               # each key tile's query tiles
        at = table.shape[1] - (m - j) * (n + 1)
        got = [int(x) & (scores.LIST_FULL - 1) for x in table[0, at + 1:at + 1 + table[0, at]]]
        want = [i for i in range(n) if classes[i, j] != 0
                and scores.key_range(rules, i * rows, rows, nq, nk)[0] < (j + 1) * keys
                and scores.key_range(rules, i * rows, rows, nq, nk)[1] > j * keys]
        assert got == want, (j, got, want)
    rng, q, k, v, _ = _inputs("float32", (1, 1), nq, nk, 16, 16)
    out, lse = numba_flash.attention_fwd(q, k, v, block_mask=bm, **options)
    assert_attention_close(out, q, k, v, lse, mask_mod=gap_mask, mod_args=bounds, **options)


def per_head_window(b, h, i, j):
    return abs(i - j) <= 3 + 9 * h


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_block_mask_per_head_with_grouped_heads(dtype):
    """A mask that differs per query head, with two query heads per K/V head: the dK/dV
    blocks of a K/V head visit the union of its heads' queries; forward and backward give
    the function's result (that of the mask_mod without the block mask, as
    :func:`assert_same_result` says), against the oracle too."""
    rng, q, k, v, dout = _inputs(dtype, (1, 2), 26, 26, 8, 13, lead_k=(1, 1))
    bm = numba_flash.block_mask(per_head_window, 1, 2, 26, 26)
    assert bm.exact
    out, lse = numba_flash.attention_fwd(q, k, v, block_mask=bm)
    grads = numba_flash.attention_bwd(dout, q, k, v, out, lse, block_mask=bm)
    plain = numba_flash.attention_bwd(dout, q, k, v, out, lse, mask_mod=per_head_window)
    assert_same_result(grads, plain)
    assert_attention_close(out, q, k, v, lse, mask_mod=per_head_window)
    _check_grads(grads, dout, q, k, v, {"mask_mod": per_head_window})


def chunk_pattern(b, h, i, j, table):
    """Per 32 × 32 chunk (from the table): hidden, visible, or a checkerboard."""
    kind = table[h, i // 32, j // 32]
    return kind == 1 or (kind == 2 and (i + j) % 2 == 0)


@pytest.mark.parametrize("seed", [0, 1])
def test_tile_classes_match_a_brute_force_evaluation(seed):
    """``BlockMask.tile_classes``: empty / partial / full per tile against the mask
    evaluated pair by pair in NumPy, for a table of chunk kinds drawn fresh (two heads,
    ragged lengths): equal for tile sizes that are multiples of 32, and never wrong in the
    safe direction (empty or full only where it is) for the others."""
    rng = np.random.default_rng()
    nq, nk = (int(x) for x in rng.integers(40, 140, 2))
    table = rng.integers(0, 3, (2, -(-nq // 32), -(-nk // 32))).astype(np.int32)
    table[0, 0, :2] = 0, 1                  # every kind at least once
    table[1, 0, 0] = 2
    bm = numba_flash.block_mask(chunk_pattern, 1, 2, nq, nk, mod_args=(table,))
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    kind = table[:, i // 32, j // 32]
    dense = ((kind == 1) | ((kind == 2) & ((i + j) % 2 == 0)))[None]      # (1, 2, nq, nk)
    for rows, keys in ((32, 32), (64, 32), (32, 128), (16, 16), (24, 40), (128, 128)):
        got = bm.tile_classes(rows, keys)
        want = np.zeros_like(got)
        for qt in range(got.shape[2]):
            for kt in range(got.shape[3]):
                blk = dense[:, :, qt * rows:(qt + 1) * rows, kt * keys:(kt + 1) * keys]
                want[:, :, qt, kt] = np.where(blk.all(axis=(2, 3)), 2, np.where(blk.any(axis=(2, 3)), 1, 0))
        if rows % 32 == 0 and keys % 32 == 0:
            np.testing.assert_array_equal(got, want, err_msg=f"tiles {rows} x {keys}")
        else:
            assert ((got == want) | (got == 1)).all(), f"tiles {rows} x {keys}"
    assert set(np.unique(bm.tile_classes(32, 32))) == {0, 1, 2}


@pytest.mark.parametrize("call, match", [
    (lambda q, bm: numba_flash.attention(q, q, q, block_mask="x"), "block_mask must be a numba_flash.BlockMask"),
    (lambda q, bm: numba_flash.attention(q, q, q, block_mask=bm, mask_mod=nothing_for_odd_rows), "is not the block mask's"),
    (lambda q, bm: numba_flash.attention(q[:, :5], q[:, :5], q[:, :5], block_mask=bm), "block_mask was built for"),
    (lambda q, bm: numba_flash.block_mask(causal_mask, 0, 1, 4, 4), "B must be an int >= 1"),
])
def test_bad_block_masks_get_clear_errors(call, match):
    q = np.random.default_rng(12).standard_normal((2, 8, 8)).astype(np.float32)
    bm = numba_flash.block_mask(causal_mask, 1, 2, 8, 8)
    with pytest.raises((TypeError, ValueError), match=match):
        call(q, bm)


def same_document3(b, h, i, j, table, shift):
    return (i - j) % 3 != 1


def test_kernels_with_mods_compile_to_tensor_core_ptx():
    """Without a GPU: the tensor-core forward (sm_80), the Hopper forward (sm_90a) and the
    tensor-core dQ and dK/dV kernels compile with a score_mod, a mask_mod and mod_args (a table and an
    int), and keep their tensor-core instructions."""
    proc = subprocess.run([sys.executable, "-c", _PTX], cwd=ROOT + "/tests", capture_output=True, text=True,
                          env=project_env(NUMBA_ENABLE_CUDASIM="0"), timeout=600)
    assert proc.returncode == 0, process_failure(proc)
    assert proc.stdout.count("\n") == 4, proc.stdout


# --------------------------------------------------------------------------- property test
# A family of functions with one signature: every call passes the same mod_args
# (rel, shift, w, mtab, docs) and each function reads what it needs; the data is drawn
# per example, so on a GPU each function compiles once, whatever the example.
def rel_bias(s, b, h, i, j, rel, shift, w, mtab, docs):
    return s + rel[h, i - j + shift]


def rel_bias_grad(s, b, h, i, j, rel, shift, w, mtab, docs):
    return 1.0


def times_w(s, b, h, i, j, rel, shift, w, mtab, docs):
    return s * w


def times_w_grad(s, b, h, i, j, rel, shift, w, mtab, docs):
    return w


def table_mask(b, h, i, j, rel, shift, w, mtab, docs):
    return mtab[b, i, j] != 0


def doc_mask(b, h, i, j, rel, shift, w, mtab, docs):
    return docs[b, i] == docs[b, j]


def doc_table_mask(b, h, i, j, rel, shift, w, mtab, docs):
    return docs[b, i] == docs[b, j] and mtab[b, i, j] != 0


SCORE_FAMILY = {None: (None, None), "relative bias": (rel_bias, rel_bias_grad), "times w": (times_w, times_w_grad)}
MASK_FAMILY = {None: None, "table": table_mask, "documents": doc_mask, "documents and table": doc_table_mask}


@st.composite
def mod_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    B, hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    nq, nk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    d = draw(st.sampled_from([8, 16]))
    score = draw(st.sampled_from(sorted(SCORE_FAMILY, key=str)))
    mask = draw(st.sampled_from(sorted(MASK_FAMILY, key=str)))
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.tuples(st.one_of(st.none(), st.integers(0, 45)),
                                                 st.one_of(st.none(), st.integers(0, 45)))))
    blocks = mask is not None and draw(st.booleans())
    density = draw(st.sampled_from([0.2, 0.7, 1.0]))
    return dict(dtype=dtype, B=B, hkv=hkv, group=group, nq=nq, nk=nk, d=d, score=score, mask=mask, causal=causal,
                window=window, blocks=blocks, density=density, seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=20 if ON_GPU else 4, deadline=None)     # on a GPU each example compiles five kernels
@given(case=mod_cases())
@example(case=dict(dtype="bfloat16", B=2, hkv=1, group=2, nq=23, nk=19, d=8, score="relative bias", mask="documents",
                   causal=True, window=None, blocks=True, density=1.0, seed=1))     # an exact block mask, GQA
@example(case=dict(dtype="float32", B=1, hkv=1, group=2, nq=13, nk=24, d=8, score="times w", mask="table",
                   causal=False, window=(5, None), blocks=True, density=0.7, seed=2))   # one with holes
def test_random_mods_match_oracle(case):
    """Random problems with functions from a family (additive relative bias from a table,
    a scale; masks from a random table, documents, both), random data in mod_args, with
    causal, windows and grouped heads, with and without a block mask: forward (out, lse)
    and backward (dq, dk, dv) against the float64 oracle given the same functions; the
    block mask's result is that of the function without it (:func:`assert_same_result`)."""
    note(repr(case))
    c = case
    hq = c["hkv"] * c["group"]
    rng, q, k, v, dout = _inputs(c["dtype"], (c["B"], hq), c["nq"], c["nk"], c["d"], c["seed"],
                                 lead_k=(c["B"], c["hkv"]))
    n = max(c["nq"], c["nk"])
    mod_args = (rng.standard_normal((hq, c["nq"] + c["nk"])).astype(np.float32), c["nk"], float(rng.uniform(0.5, 2)),
                (rng.random((c["B"], c["nq"], c["nk"])) < c["density"]).astype(np.int8),
                np.sort(rng.integers(0, 3, (c["B"], n)), axis=1).astype(np.int32))
    score_mod, score_grad = SCORE_FAMILY[c["score"]]
    mask_mod = MASK_FAMILY[c["mask"]]
    if score_mod is None and mask_mod is None:
        mask_mod = doc_mask
    options = dict(causal=c["causal"], window=c["window"], score_mod=score_mod, mask_mod=mask_mod, mod_args=mod_args)
    out, lse = numba_flash.attention_fwd(q, k, v, **options)
    assert_attention_close(out, q, k, v, lse, **options)
    backward = dict(options, score_mod_grad=score_grad)
    grads = numba_flash.attention_bwd(dout, q, k, v, out, lse, **backward)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    _check_grads(grads, dout, q, k, v, backward)
    if c["blocks"]:
        bm = numba_flash.block_mask(mask_mod, c["B"], 1, c["nq"], c["nk"], mod_args=mod_args)
        blocked = dict(options, mask_mod=None, block_mask=bm)
        o2, l2 = numba_flash.attention_fwd(q, k, v, **blocked)
        g2 = numba_flash.attention_bwd(dout, q, k, v, out, lse, score_mod_grad=score_grad, **blocked)
        assert_attention_close(o2, q, k, v, l2, **options)
        assert_same_result((o2, l2), (out, lse))
        assert_same_result(g2, grads)
