"""Property tests of the forward pass against the float64 oracle (numba_flash.reference).

In the simulator every case is kept small (see ``sim_cost``); on a GPU the shapes
are larger and ``test_gpu_large_shapes`` adds FlashAttention-sized problems.
"""
import math
import warnings

import numpy as np
import pytest
from hypothesis import example, given, note
from hypothesis import strategies as st

import numba_flash  # before numba: it decides whether the simulator is needed
from numba import cuda
from numba_flash import api, registry
from numba_flash.scores import CAUSAL, key_bounds, spec_of
from conftest import (ON_GPU, SLACK_ULPS, U32, U64, Case, baseline_fwd32, bits, check_forward, host, make_qkv,
                      rounding_sensitivity)
from numba_flash import reference
from numba_flash.testing import check_forward_low

DTYPES = registry.VARIANTS["forward_simt"].dtypes   # the CUDA-core forward


# --------------------------------------------------------------------------- cases
def sim_cost(batch, nq, nk, d, dtype):
    """Rough cost of one launch in the simulator, in units of ~15 ms: blocks × (K/V tiles ×
    (head-dim chunks + P·V) + epilogue), from the simulator's tiling."""
    t = registry.forward_tiling(dtype, d)
    chunks = -(-d // t.DK)
    return batch * -(-nq // t.BM) * -(-d // t.DO) * (-(-nk // t.BN) * (chunks + 1) + 1)


if ON_GPU:
    N_MAX, D_MAX = 700, 300
    ELEMS_CAP = 1 << 25        # batch · Nq · Nk · d: keeps the float64 oracle on the CPU quick
    # A fixed set of head dims (each new one is a JIT compile of seconds, which dominated the
    # GPU run): the registry's head dims and their tile edges, and a few odd values.
    GPU_DS = sorted({d for dt in DTYPES for p in registry.HEAD_DIMS for t in [registry.forward_tiling(dt, p)]
                     for d in (p, t.DK - 1, t.DK + 1, t.DO + 1) if 1 <= d <= max(registry.HEAD_DIMS)}
                    | {1, 3, 13, 33, 100, 200, D_MAX})
    D_STRATEGY = st.sampled_from(GPU_DS)

    def fits(batch, nq, nk, d, dtype):
        return batch * nq * nk * max(d, 8) <= ELEMS_CAP
else:
    N_MAX, D_MAX = 80, 64
    SIM_COST_CAP = 50           # about 1 s per launch
    D_STRATEGY = st.integers(1, D_MAX)

    def fits(batch, nq, nk, d, dtype):
        return sim_cost(batch, nq, nk, d, dtype) <= SIM_COST_CAP


def _largest(lo, hi, ok):
    """The largest n in [lo, hi] with ok(n) (ok is monotone decreasing), or lo."""
    n = hi
    while n > lo and not ok(n):
        n = max(lo, n * 3 // 4 if n > 8 else n - 1)
    return n


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    batch = math.prod(lead)
    d = draw(D_STRATEGY)
    if not fits(batch, 1, 1, d, dtype):   # keep every case affordable: shrink d first
        d = _largest(1, d, lambda x: fits(batch, 1, 1, x, dtype))
    if draw(st.booleans()):   # whichever length is drawn first may be the long one
        nq = draw(st.integers(1, _largest(1, N_MAX, lambda n: fits(batch, n, 1, d, dtype))))
        nk = draw(st.integers(1, _largest(1, N_MAX, lambda n: fits(batch, nq, n, d, dtype))))
    else:
        nk = draw(st.integers(1, _largest(1, N_MAX, lambda n: fits(batch, 1, n, d, dtype))))
        nq = draw(st.integers(1, _largest(1, N_MAX, lambda n: fits(batch, n, nk, d, dtype))))
    return Case(
        lead=lead, nq=nq, nk=nk, d=d, dtype=dtype,
        causal=draw(st.booleans()),
        scale=draw(st.none() | st.floats(0.05, 2.0)),
        magnitude=draw(st.sampled_from([1.0, 30.0]) | st.floats(1.0, 30.0)),
        seed=draw(st.integers(0, 2**32 - 1)),
        device=draw(st.integers(0, 3)) == 0)


def _edge_examples():
    """Cases at the tile edges of the tiling the registry chooses (simulator or GPU)."""
    out = []
    seed = iter(range(1000, 2000))
    for dt in DTYPES:
        small = registry.forward_tiling(dt, 8)
        BM, BN = small.BM, small.BN
        # Query-tile edges (Nk small) and key-tile edges (Nq small).
        for nq in (BM - 1, BM, BM + 1):
            out.append(Case((), nq, 5, 8, dt, causal=nq % 2 == 0, seed=next(seed)))
        for nk in (BN - 1, BN, BN + 1):
            out.append(Case((), 5, nk, 8, dt, causal=nk % 2 == 1, seed=next(seed)))
        # The causal diagonal crossing query and key tiles (square, just past one tile each).
        out.append(Case((), BM + 1, BM + 1, 8, dt, causal=True, seed=next(seed)))
        # Head-dim edges: chunk (DK) and output-slice (DO) boundaries, for a small and a
        # large head dim's tiling (on a GPU these differ; in the simulator they agree).
        ds = set()
        for probe in (16, max(registry.HEAD_DIMS)):
            t = registry.forward_tiling(dt, probe)
            ds |= {t.DK - 1, t.DK, t.DK + 1, t.DO + 1, 2 * t.DK + 1}
        for i, d in enumerate(sorted(ds)):
            out.append(Case((), 7, 6, d, dt, causal=i % 2 == 1, seed=next(seed), device=i % 3 == 0))
    bm, bn = registry.forward_tiling("float32", 8).BM, registry.forward_tiling("float32", 8).BN
    out += [
        # Causal, Nq < Nk: bottom-right alignment, every row sees keys past the diagonal.
        Case((), 5, 2 * bn + 3, 8, "float32", causal=True, seed=1),
        Case((2,), 3, bn + 1, 12, "float64", causal=True, seed=2, device=True),
        # Causal, Nq > Nk: the first rows see no key (out 0, lse -inf), including whole
        # query tiles that visit no key tile at all.
        Case((), 2 * bm + 3, 3, 8, "float32", causal=True, seed=3),
        Case((2,), bm + 2, bn - 1, 5, "float64", causal=True, seed=4, device=True),
        Case((), bm - 1, 1, 4, "float32", causal=True, seed=5),
        # Tiny everything.
        Case((), 1, 1, 1, "float32", seed=6),
        Case((), 1, 1, 1, "float64", causal=True, seed=7, device=True),
        Case((), 3, 4, 1, "float32", causal=True, seed=8),
        Case((), 1, bn + 1, 3, "float64", causal=True, seed=9),   # one query, KV-cache style
        # Several leading dims; large logits.
        Case((2, 3), 5, 6, 4, "float32", causal=True, seed=10, device=True),
        Case((3,), 9, 10, 16, "float32", scale=2.0, magnitude=30.0, seed=11),
        Case((), 9, 10, 16, "float64", scale=2.0, magnitude=30.0, causal=True, seed=12),
    ]
    return out


EDGE_EXAMPLES = _edge_examples()


def _with_examples(f):
    for c in reversed(EDGE_EXAMPLES):
        f = example(case=c)(f)
    return f


def _run(case, q, k, v, on_device):
    if on_device:
        q, k, v = (cuda.to_device(x) for x in (q, k, v))
    out, lse = numba_flash.attention_fwd(q, k, v, causal=case.causal, scale=case.scale)
    if on_device:
        assert not isinstance(out, np.ndarray) and hasattr(out, "copy_to_host")
        assert not isinstance(lse, np.ndarray) and hasattr(lse, "copy_to_host")
        out, lse = host(out), host(lse)
    else:
        assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    return out, lse


# --------------------------------------------------------------------------- tests
@_with_examples
@given(case=cases())
def test_forward_matches_oracle(case):
    note(repr(case))
    q, k, v = case.inputs()
    out, lse = _run(case, q, k, v, on_device=False)
    check_forward(out, lse, q, k, v, case.causal, case.scale)
    if case.device:
        dout, dlse = _run(case, q, k, v, on_device=True)
        check_forward(dout, dlse, q, k, v, case.causal, case.scale)
        # Same kernel, same contiguous layout: the device path must agree bit for bit.
        assert bits(dout) == bits(out) and bits(dlse) == bits(lse)


def test_edge_examples_are_at_tile_edges():
    """The explicit examples really sit on the registry's tile edges (guards the list)."""
    t = registry.forward_tiling("float32", 8)
    nqs = {c.nq for c in EDGE_EXAMPLES if c.dtype == "float32"}
    nks = {c.nk for c in EDGE_EXAMPLES if c.dtype == "float32"}
    assert {t.BM - 1, t.BM, t.BM + 1} <= nqs and {t.BN - 1, t.BN, t.BN + 1} <= nks
    tl = registry.forward_tiling("float32", max(registry.HEAD_DIMS))
    ds = {c.d for c in EDGE_EXAMPLES if c.dtype == "float32"}
    assert {tl.DK - 1, tl.DK, tl.DK + 1, tl.DO + 1} <= ds
    if not ON_GPU:
        assert all(sim_cost(math.prod(c.lead), c.nq, c.nk, c.d, c.dtype) <= 60 for c in EDGE_EXAMPLES)


_TS = registry.forward_tiling("float32", 4)


@pytest.mark.parametrize("offset", range(-_TS.BN + 1, _TS.BN + 1))
def test_causal_diagonal_offsets(offset):
    """Causal with Nk - Nq at every residue modulo the key tile: the diagonal crosses the
    key tiles at every position, and the last key a full query tile may see
    (``q0 + BM - 1 + Nk - Nq``) lands on every position of its key tile."""
    dtype = DTYPES[offset % 2]
    t = registry.forward_tiling(dtype, 4)
    nq = t.BM + 1                      # one full query tile and one single-row tile
    case = Case((), nq, nq + offset, 4, dtype, causal=True, seed=100 + offset)
    q, k, v = case.inputs()
    out, lse = _run(case, q, k, v, on_device=False)
    check_forward(out, lse, q, k, v, True, None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_is_attention_fwd_out(dtype):
    case = Case((2,), 9, 7, 6, dtype, causal=True, seed=21)
    q, k, v = case.inputs()
    out = numba_flash.attention(q, k, v, causal=True)
    ref, _ = numba_flash.attention_fwd(q, k, v, causal=True)
    assert isinstance(out, np.ndarray) and out.dtype == np.dtype(dtype)
    assert bits(out) == bits(ref)


@pytest.mark.parametrize("on_device", [False, True], ids=["numpy", "device"])
def test_deterministic(on_device):
    """The same inputs twice give bitwise-equal outputs (several blocks, several K tiles)."""
    t = registry.forward_tiling("float32", 20)
    case = Case((2,), t.BM + 3, 2 * t.BN + 1, 20, "float32", causal=True, magnitude=5.0, seed=22)
    q, k, v = case.inputs()
    first = _run(case, q, k, v, on_device)
    second = _run(case, q, k, v, on_device)
    assert bits(first[0]) == bits(second[0]) and bits(first[1]) == bits(second[1])


# --------------------------------------------------------------------------- key splits
@st.composite
def split_cases(draw):
    """Problems for the key-split path: several key tiles, forced splits (the API splits
    on its own only when a launch leaves the GPU's SMs idle)."""
    dtype = draw(st.sampled_from(DTYPES))
    d = draw(D_STRATEGY if ON_GPU else st.integers(1, 20))
    bn = registry.forward_tiling(dtype, d).BN
    nk = draw(st.integers(1, 6 * bn))
    nq = draw(st.integers(1, 300 if ON_GPU else 20))
    return Case(lead=draw(st.sampled_from([(), (2,)])), nq=nq, nk=nk, d=d, dtype=dtype,
                causal=draw(st.booleans()), scale=draw(st.none() | st.floats(0.05, 2.0)),
                magnitude=draw(st.sampled_from([1.0, 30.0])), seed=draw(st.integers(0, 2**32 - 1)))


@example(case=Case((), 19, 33, 17, "float32", causal=True, seed=31), splits=3)   # Nq < Nk, chunked d
@example(case=Case((2,), 20, 9, 3, "float64", causal=True, seed=32), splits=2)   # rows seeing no key
@given(case=split_cases(), splits=st.integers(2, 5))
def test_key_splits_match_oracle(case, splits):
    """Keys split across blocks (grid axis z), partial (O, lse) merged: the oracle's
    answer, rows that see no key in some split or in all of them included."""
    note(repr(case))
    q, k, v = case.inputs()
    plan = api.plan_forward(q, k, v, causal=case.causal, scale=case.scale, splits=splits)
    n_kt = -(-case.nk // registry.forward_tiling(case.dtype, case.d).BN)
    assert len(plan[1]) == (2 if min(splits, n_kt) > 1 else 1)      # the forward, then the merge
    out, lse = api._run(plan)
    check_forward(out, lse, q, k, v, case.causal, case.scale)


def test_forward_splits_rule():
    """Split only where it shortens the critical path; never more than MAX_SPLITS, every
    split at least MIN_SPLIT_TILES key tiles, and a tie keeps fewer splits."""
    f = registry.forward_splits
    assert f(132, 64, 132) == 1                     # one full wave already
    assert f(512, 64, 132) == 1                     # 16 splits would gain 2%, not SPLIT_GAIN
    assert f(128, 16, 132) == 1                     # two splits would make two waves
    assert f(64, 16, 132) == 2                      # 128 blocks of 8 tiles: one wave
    assert f(1, 10**6, 132) == registry.MAX_SPLITS
    assert f(1, 2 * registry.MIN_SPLIT_TILES, 132) == 2
    assert f(1, 1, 132) == 1 and f(1, 0, 132) == 1
    assert f(32, 32, 132) == 4                      # the seed problem (d = 1024): measured best
    assert f(32, 32, 132, causal=True) > 1          # the heaviest causal query tiles are split
    for blocks in (1, 7, 64, 130, 1000):
        for n in (1, 3, 16, 100):
            for causal in (False, True):
                z = f(blocks, n, 132, causal)
                assert 1 <= z <= registry.MAX_SPLITS
                assert z == 1 or -(-n // z) >= registry.MIN_SPLIT_TILES
    one_warp = registry.MIN_SPLIT_TILES_ONE_WARP    # decoding (B, 32 query / 8 K/V heads, 8192 keys, d = 128)
    assert f(8, 256, 660, False, one_warp) == 32    # B = 1: measured best of 16, 32, 64, 128
    assert f(16, 256, 660, False, one_warp) == 32   # B = 2: as measured
    assert f(128, 256, 660, False, one_warp) == 5   # B = 16: item 77's sweep


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_more_key_splits_than_sixteen(dtype):
    """40 key splits (one decoding sequence on an H200 takes 32): the CUDA-core forward and
    the one-warp tensor-core kernel (few query rows) write 40 partial results, which the
    merge folds into the oracle's answer; rows that see no key in a split included
    (causal, Nq < Nk)."""
    if dtype == "float32":
        bn = registry.forward_tiling(dtype, 8).BN
    else:
        assert registry.forward_specialisation(dtype, 16, registry.FULL, True, rows=3).variant == "forward_mma_split"
        bn = registry.mma_split_tiling(dtype, 16).BN
    case = Case((), 3, 40 * bn - 3, 8 if dtype == "float32" else 16, dtype, causal=True,
                seed=int(np.random.default_rng().integers(2**31)))
    q, k, v = case.inputs()
    plan = api.plan_forward(q, k, v, causal=True, splits=40)
    assert len(plan[1]) == 2 and plan[1][0][1][0] % 40 == 0, plan[1]     # the forward's grid, then the merge
    out, lse = api._run(plan)
    (check_forward if dtype == "float32" else check_forward_low)(out, lse, q, k, v, True, None)


@pytest.mark.parametrize("z, dtype, hq, hkv, nq, nk, d, causal", [
    (3, "bfloat16", 8, 2, 1, 150, 32, False),      # grouped decoding: 4 query heads as rows; a ragged last split
    (5, "float16", 2, 2, 3, 300, 24, True),        # Nq < Nk causal: rows that see no key of some splits; zero columns
    (4, "bfloat16", 2, 1, 16, 200, 40, False),     # a block of 16 rows, a ragged last tile
], ids=["gqa-decode-z3", "causal-z5", "rows16-z4"])
def test_key_splits_as_one_blocks_warps(z, dtype, hq, hkv, nq, nk, d, causal, monkeypatch):
    """``registry.BLOCK_SPLITS``: the one-warp kernel's key splits as the warps of one
    block, merged in its shared memory: one launch of ``32 z`` threads a block, no merge
    launch, the oracle's answer (every output written: the outputs start as NaN); two
    splits first, then ``z``, through the same kernel (its shared memory grows with the
    warps: on a GPU the launch opts in to more)."""
    import ml_dtypes
    monkeypatch.setattr(registry, "BLOCK_SPLITS", True)
    rng = np.random.default_rng()
    npdt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    q = rng.standard_normal((2, hq, nq, d)).astype(npdt)
    k, v = (rng.standard_normal((2, hkv, nk, d)).astype(npdt) for _ in range(2))
    kernels = set()
    for warps in (2, z):
        tiles = -(-nk // registry.mma_split_tiling(dtype, d).BN)    # the shapes take these splits of whole tiles
        assert -(-tiles // -(-tiles // warps)) == warps, (tiles, warps)
        plan = api.plan_forward(q, k, v, causal=causal, splits=warps)
        assert [(launch[2], launch[0].py_func.__module__) for launch in plan[1]] == [
            (32 * warps, "numba_flash.kernels.forward_mma")], plan[1]
        kernels.add(plan[1][0][0])
        out, lse = api._run(plan)
        check_forward_low(host(out), host(lse), q, k, v, causal, None)
    assert len(kernels) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_takes_the_most_splits(dtype):
    """The merge kernel folds ``MAX_SPLITS`` key splits (in the simulator more than it has
    threads): its weights against float64 arithmetic, splits that saw no key (max −inf,
    sum 0) and a row no split saw (lse −inf, out 0) included."""
    from numba_flash import scores
    from numba_flash.kernels.forward import MERGE_THREADS
    merge = registry.specialisation("forward_merge", dtype, 0, scores.FULL).kernel()
    rng = np.random.default_rng()
    z, b1, b2, nq, d = registry.MAX_SPLITS, 2, 1, 3, 5
    assert ON_GPU or z > 2 * MERGE_THREADS
    parts = rng.standard_normal((z * b1, b2, nq, d)).astype(dtype)
    mx = rng.uniform(-20, 20, (z * b1, b2, nq))
    sums = rng.uniform(0.5, 50, (z * b1, b2, nq))
    empty = rng.random((z * b1, b2, nq)) < 0.2
    empty[np.arange(z) * b1 + 1, 0, 2] = True        # (b1 = 1, row 2): no split saw a key
    mx[empty], sums[empty] = -np.inf, 0
    parts_ml = np.concatenate([mx, sums]).astype(dtype)
    out = np.full((b1, b2, nq, d), np.nan, dtype)
    lse = np.full((b1, b2, nq), np.nan, dtype)
    args = [cuda.to_device(a) for a in (parts, parts_ml, out, lse)]
    merge[b1 * b2 * nq, merge.threads, 0, merge.smem_bytes](*args)
    out, lse = args[2].copy_to_host(), args[3].copy_to_host()
    a = np.exp2(mx.astype(np.float64)) * sums.astype(np.float64)          # each split's weight, unnormalised
    a = a.reshape(z, b1, b2, nq)
    total = a.sum(0)
    seen = total > 0
    want = np.einsum("zbhn,zbhnd->bhnd", a, parts.astype(np.float64).reshape(z, b1, b2, nq, d))
    want[seen] /= total[seen][:, None]
    want_lse = np.where(seen, np.log(np.where(seen, total, 1)), -np.inf)
    tol = 1e-5 if dtype == "float32" else 1e-12
    assert not seen[1, 0, 2] and lse[1, 0, 2] == -np.inf and (out[1, 0, 2] == 0).all()
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, want_lse, rtol=tol, atol=tol)


# --------------------------------------------------------------------------- empty inputs
def _fwd_any(q, k, v, on_device, **kw):
    if on_device:
        q, k, v = (cuda.to_device(x) for x in (q, k, v))
    out, lse = numba_flash.attention_fwd(q, k, v, **kw)
    if on_device:
        assert hasattr(out, "copy_to_host") and hasattr(lse, "copy_to_host")
        return host(out), host(lse)
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    return out, lse


@pytest.mark.parametrize("on_device", [False, True], ids=["numpy", "device"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_queries(dtype, on_device):
    q, k, v = make_qkv(0, (2,), 0, 5, 4, dtype)
    out, lse = _fwd_any(q, k, v, on_device, causal=True)
    assert out.shape == (2, 0, 4) and lse.shape == (2, 0)
    assert out.dtype == np.dtype(dtype) and lse.dtype == np.dtype(dtype)


@pytest.mark.parametrize("on_device", [False, True], ids=["numpy", "device"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_keys(dtype, causal, on_device):
    """No keys at all: every row sees nothing, so out = 0 and lse = -inf."""
    q, k, v = make_qkv(1, (2,), 5, 0, 4, dtype)
    out, lse = _fwd_any(q, k, v, on_device, causal=causal)
    assert out.shape == (2, 5, 4) and lse.shape == (2, 5)
    assert out.dtype == np.dtype(dtype) and lse.dtype == np.dtype(dtype)
    assert np.all(out == 0)
    assert np.all(np.isneginf(lse))


@pytest.mark.parametrize("on_device", [False, True], ids=["numpy", "device"])
@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)])
def test_empty_leading_dim(lead, on_device):
    q, k, v = make_qkv(2, lead, 6, 5, 4, "float32")
    out, lse = _fwd_any(q, k, v, on_device)
    assert out.shape == lead + (6, 4) and lse.shape == lead + (6,)
    assert out.dtype == np.float32 and lse.dtype == np.float32


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_non_finite_inputs(where):
    """inf and NaN inputs make the outputs NaN that they make NaN in the oracle, and no others
    (attention_fwd's "Non-finite inputs"); no RuntimeWarning (in the simulator: from its threads)."""
    q, k, v = make_qkv(3, (1,), 6, 7, 8, "float32")
    x, rows = {"q": (q, (2, 4)), "k": (k, (3, 5)), "v": (v, (0, 6))}[where]
    x[0, rows[0], 3], x[0, rows[1], 1] = np.inf, np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out, lse = numba_flash.attention_fwd(q, k, v, causal=True)
    with np.errstate(all="ignore"):
        want, want_lse = reference.attention_fwd(q, k, v, causal=True)
    assert np.isnan(out).any() and np.array_equal(np.isnan(out), np.isnan(want))
    # lse: NaN where a whole row is (the oracle's lse is no guide there: it calls such rows empty)
    assert np.array_equal(np.isnan(lse), np.isnan(out).all(-1) if where != "v" else np.zeros_like(lse, bool))


# --------------------------------------------------------------------------- GPU sizes
GPU_SHAPES = [
    # (lead, Nq, Nk, d, dtype, causal)
    ((2, 3), 1000, 1000, 64, "float32", False),
    ((1, 2), 4096, 4096, 64, "float32", True),
    ((2,), 1000, 3000, 128, "float32", True),       # Nq < Nk, causal
    ((2,), 3000, 1000, 128, "float32", True),       # Nq > Nk: leading rows see nothing
    ((1, 2), 4096, 4096, 128, "float32", False),
    ((2,), 1500, 1200, 32, "float32", False),
    ((2,), 1200, 1500, 96, "float32", True),
    ((2,), 2048, 2048, 256, "float32", True),
    ((1,), 1000, 1000, 1024, "float32", True),
    ((1,), 4096, 2048, 1024, "float32", False),
    ((2,), 1000, 700, 32, "float64", True),
    ((2,), 600, 1000, 64, "float64", False),
    ((1,), 1000, 1000, 96, "float64", True),
    ((1,), 700, 1000, 128, "float64", False),
    ((1,), 1000, 500, 256, "float64", True),
    ((1,), 500, 700, 1024, "float64", False),
]
CPU_ORACLE_LIMIT = 1000 * 1000 * 1024   # Nq · Nk · d per leading index, without torch


def _torch_backend():
    try:
        import torch
    except ImportError:
        return None
    return _TorchBackend(torch) if torch.cuda.is_available() else None


class _NumpyBackend:
    """Array operations for the chunked oracle, on the CPU."""
    def __init__(self):
        self.f32, self.f64 = np.float32, np.float64
        self.exp, self.log, self.abs, self.where, self.isfinite = np.exp, np.log, np.abs, np.where, np.isfinite

    def asarray(self, x, dtype):
        return np.asarray(x, dtype=dtype)

    def to64(self, x):
        return x.astype(np.float64)

    def amax(self, x):
        return float(np.max(np.abs(x), initial=0.0))

    def rowmax(self, x):
        return x.max(-1, keepdims=True)

    def rowsum(self, x):
        return x.sum(-1, keepdims=True)

    def arange(self, lo, hi):
        return np.arange(lo, hi)


class _TorchBackend:
    """The same operations with torch on the GPU (float64 there is much faster)."""

    def __init__(self, torch):
        self.t = torch
        self.f32, self.f64 = torch.float32, torch.float64
        self.exp, self.log, self.abs, self.where, self.isfinite = (
            torch.exp, torch.log, torch.abs, torch.where, torch.isfinite)

    def asarray(self, x, dtype):
        """A GPU tensor from a NumPy array."""
        return self.t.as_tensor(np.ascontiguousarray(x)).to("cuda", dtype)

    def to64(self, x):
        return x.double()

    def amax(self, x):
        return float(x.abs().max()) if x.numel() else 0.0

    def rowmax(self, x):
        return x.amax(-1, keepdim=True)

    def rowsum(self, x):
        return x.sum(-1, keepdim=True)

    def arange(self, lo, hi):
        return self.t.arange(lo, hi, device="cuda")


def _chunked_errors(q, k, v, out, lse, causal, be, rows=None):
    """Compare (out, lse) with a float64 oracle computed in chunks of query rows, next to the
    plain float32 baseline (for float32) and the rounding sensitivity of
    :func:`conftest.rounding_sensitivity`; ``be`` is a backend above. Asserts the exact
    out = 0 / lse = -inf rows on the way; returns the maxima the tolerances need."""
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    sc = 1.0 / math.sqrt(d)
    B = int(np.prod(q.shape[:-2], dtype=np.int64))
    q3, k3, v3 = q.reshape(B, nq, d), k.reshape(B, nk, d), v.reshape(B, nk, d)
    o3, l3 = out.reshape(B, nq, d), lse.reshape(B, nq)
    lowp = q.dtype == np.float32
    rows = rows or max(1, (1 << 24) // (nk * d))

    def softmax_rows(s):
        m = be.rowmax(s)
        m = be.where(be.isfinite(m), m, 0.0)
        e = be.exp(s - m)
        l = be.rowsum(e)
        ok = l > 0
        l1 = be.where(ok, l, 1.0)
        return e / l1, be.where(ok, m + be.log(l1), -math.inf)[..., 0]

    r = dict.fromkeys(("err_out", "err_lse", "base_out", "base_lse", "sens_out", "sens_lse",
                       "ref_out", "ref_lse"), 0.0)
    r["v"] = float(np.max(np.abs(v)))
    for b in range(B):
        kb, vb = be.asarray(k3[b], be.f64), be.asarray(v3[b], be.f64)
        if lowp:
            kb32, vb32 = be.asarray(k3[b], be.f32), be.asarray(v3[b], be.f32)
        for r0 in range(0, nq, rows):
            r1 = min(nq, r0 + rows)
            qi = be.asarray(q3[b, r0:r1], be.f64)
            if causal:                # the rule's row bounds (numba_flash.scores), on the backend
                lo, hi = (be.asarray(x, be.f64)[:, None] for x in key_bounds(spec_of(True), r0, r1, nq, nk))
                vis = (be.arange(0, nk)[None, :] >= lo) & (be.arange(0, nk)[None, :] <= hi)
            s = (qi @ kb.T) * sc
            if causal:
                s = be.where(vis, s, -math.inf)
            p, rl = softmax_rows(s)
            ro = p @ vb
            ko, kl = be.asarray(o3[b, r0:r1], be.f64), be.asarray(l3[b, r0:r1], be.f64)
            empty = ~be.isfinite(rl)
            assert bool((~be.isfinite(kl) == empty).all()), "lse must be -inf exactly where no key is visible"
            assert bool((ko[empty] == 0).all()), "rows with no visible key must be exactly 0"
            fin = ~empty
            r["err_out"] = max(r["err_out"], be.amax(ko - ro))
            r["err_lse"] = max(r["err_lse"], be.amax(kl[fin] - rl[fin]))
            r["ref_out"] = max(r["ref_out"], be.amax(ro))
            r["ref_lse"] = max(r["ref_lse"], be.amax(rl[fin]))
            if lowp:   # the plain float32 computation of the same rows
                s32 = (be.asarray(q3[b, r0:r1], be.f32) @ kb32.T) * float(np.float32(sc))
                if causal:
                    s32 = be.where(vis, s32, -math.inf)
                p32, l32 = softmax_rows(s32)
                o32 = p32 @ vb32
                r["base_out"] = max(r["base_out"], be.amax(be.to64(o32) - ro))
                r["base_lse"] = max(r["base_lse"], be.amax(be.to64(l32)[fin] - rl[fin]))
            w = p * (sc * (be.abs(qi) @ be.abs(kb).T))
            r["sens_lse"] = max(r["sens_lse"], be.amax(be.rowsum(w)))
            sub = max(1, min(rows // 2, (1 << 24) // (nk * d)))
            for s0 in range(0, r1 - r0, sub):
                s1 = min(r1 - r0, s0 + sub)
                spread = be.abs(vb[None, :, :] - ro[s0:s1, None, :])          # |v_j - out_i|
                r["sens_out"] = max(r["sens_out"], be.amax((w[s0:s1, :, None] * spread).sum(1)))
    return r


@pytest.mark.skipif(not ON_GPU, reason="GPU-sized shapes: too slow for the CUDA simulator")
@pytest.mark.parametrize("lead,nq,nk,d,dtype,causal", GPU_SHAPES,
                         ids=[f"{'x'.join(map(str, s[0]))}-{s[1]}x{s[2]}-d{s[3]}-{s[4]}-{'causal' if s[5] else 'full'}"
                              for s in GPU_SHAPES])
def test_gpu_large_shapes(lead, nq, nk, d, dtype, causal):
    be = _torch_backend()
    if be is None and nq * nk * d > CPU_ORACLE_LIMIT:
        pytest.skip("float64 oracle this large needs torch on the GPU")
    q, k, v = make_qkv(nq + 7 * nk + d, lead, nq, nk, d, dtype)
    qd, kd, vd = (cuda.to_device(x) for x in (q, k, v))
    out, lse = numba_flash.attention_fwd(qd, kd, vd, causal=causal)
    out, lse = host(out), host(lse)
    assert out.dtype == np.dtype(dtype) and out.shape == lead + (nq, d) and lse.shape == lead + (nq,)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    r = _chunked_errors(q, k, v, out, lse, causal, be or _NumpyBackend())
    if dtype == "float64":
        tol_out = 1e-12 * max(1.0, r["ref_out"]) + SLACK_ULPS * U64 * r["sens_out"]
        tol_lse = 1e-12 * max(1.0, r["ref_lse"]) + SLACK_ULPS * U64 * r["sens_lse"]
    else:
        tol_out = 2 * r["base_out"] + 1e-6 * r["v"] + SLACK_ULPS * U32 * r["sens_out"]
        tol_lse = 2 * r["base_lse"] + 1e-6 * max(1.0, r["ref_lse"]) + SLACK_ULPS * U32 * r["sens_lse"]
    assert r["err_out"] <= tol_out, r
    assert r["err_lse"] <= tol_lse, r


@pytest.mark.skipif(not ON_GPU, reason="the compact tilings differ from the first rule on a GPU only")
@pytest.mark.parametrize("d", [96, 128, 256, 1024])
def test_gpu_compact_tilings(d, monkeypatch):
    """A GPU with less shared memory per block (an A100) gets registry.forward_tiling_compact:
    pretend to be one, and check the result and that the compact kernel ran."""
    first = registry.forward_specialisation("float32", d, CAUSAL, True)
    monkeypatch.setattr(api, "_device_facts", lambda: (132, first.smem_bytes - 1, (8, 0)))   # an A100
    spec = registry.forward_specialisation("float32", d, CAUSAL, True, smem_limit=first.smem_bytes - 1)
    assert spec.compact and spec.smem_bytes < first.smem_bytes
    q, k, v = make_qkv(d, (2,), 600, 700, d, "float32")
    plan = api.plan_forward(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), causal=True)
    assert plan[1][0][0] is spec.kernel()
    out, lse = (host(x) for x in api._run(plan))
    check_forward(out, lse, q, k, v, True, None)


@pytest.mark.parametrize("causal", [False, True])
def test_chunked_oracle_agrees(causal):
    """The chunked oracle of test_gpu_large_shapes (NumPy backend, tiny row chunks) gives
    the same maxima as the full computations the other tests use."""
    q, k, v = make_qkv(23, (2,), 9, 6, 5, "float32", magnitude=3.0)
    out, lse = numba_flash.attention_fwd(q, k, v, causal=causal)
    r = _chunked_errors(q, k, v, out, lse, causal, _NumpyBackend(), rows=4)
    ro, rl = reference.attention_fwd(q, k, v, causal=causal)
    bo, bl = baseline_fwd32(q, k, v, causal, None)
    fin = np.isfinite(rl)
    so, sl = rounding_sensitivity(q, k, v, causal, None, ro, rl)
    expect = dict(err_out=np.abs(out - ro).max(), err_lse=np.abs(lse[fin] - rl[fin]).max(),
                  base_out=np.abs(bo - ro).max(), base_lse=np.abs(bl[fin] - rl[fin]).max(),
                  sens_out=so, sens_lse=sl, ref_out=np.abs(ro).max(), ref_lse=np.abs(rl[fin]).max())
    # The float32 baselines are two float32 computations of the same problem with different
    # row blockings: BLAS rounds them differently per CPU and kernel, so their errors agree
    # only to within the float32 error bound itself (logit sensitivity plus a few ulps of the
    # outputs); a wrong chunked baseline would err by O(|v|). Everything else is float64.
    bounds = dict(base_out=SLACK_ULPS * U32 * (so + np.abs(v).max()),
                  base_lse=SLACK_ULPS * U32 * (sl + np.abs(rl[fin]).max()))
    for key, val in expect.items():
        if key in bounds:
            assert 0 < r[key] <= bounds[key] and 0 < val <= bounds[key], (key, r[key], val, bounds[key])
        else:
            assert r[key] == pytest.approx(val, rel=1e-6, abs=1e-12), key
