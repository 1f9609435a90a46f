"""numba_flash.scores: the one description of the score rules, and its device helpers.

The device helpers (what every kernel family compiles in) must agree with the host rules
(what the float64 oracle and the tests' baselines use), and the tile-range helpers must
never skip a visible key nor claim a tile needs no mask when one of its keys is hidden.
In the simulator the device helpers are plain Python functions, so this runs everywhere.
"""
import itertools
import math

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import numba_flash
from numba_flash import reference, scores
from numba_flash.scores import CAUSAL, FULL, LOG2E, ScoreSpec, Scores, device_rules, parse, visible_mask

SIDES = st.none() | st.integers(0, 12) | st.sampled_from([0, 1, 1000])


def test_spec_is_a_hashable_value():
    assert ScoreSpec() == FULL and ScoreSpec(causal=True) == CAUSAL
    assert len({FULL, CAUSAL, ScoreSpec(causal=True)}) == 2
    assert scores.spec_of(True) is CAUSAL and scores.spec_of(False) is FULL
    assert (FULL.tag, CAUSAL.tag) == ("full", "causal")
    assert ScoreSpec(window=True, softcap=True, alibi=True).tag == "window+softcap+alibi"
    with pytest.raises(Exception):
        CAUSAL.causal = False


def test_parse_folds_causal_into_the_window():
    assert parse().spec == FULL and parse(causal=True).spec == CAUSAL
    assert parse(window=(None, None)).spec == FULL
    assert parse(window=(None, 0)).spec == CAUSAL                 # a window that is causal
    assert parse(causal=True, window=(None, 5)) == Scores(None, 0)   # the tighter bound wins
    assert parse(causal=True, window=(3, 5)) == Scores(3, 0)
    assert parse(causal=True, window=(3, 5)).spec == ScoreSpec(window=True)
    assert parse(window=[2, None], softcap=30, alibi=True) == Scores(2, None, 30.0, True)
    assert parse(window=(2, 1)).band() == (2, 1) and parse().band() == (scores.UNBOUNDED,) * 2


@pytest.mark.parametrize("kwargs, error, match", [
    ({"causal": 1}, TypeError, "causal must be True or False"),
    ({"window": 3}, TypeError, "window must be a pair"),
    ({"window": (1, 2, 3)}, TypeError, "window must be a pair"),
    ({"window": (-1, 0)}, ValueError, "window left must be >= 0"),
    ({"window": (0, -2)}, ValueError, "window right must be >= 0"),
    ({"window": (1.5, 0)}, TypeError, "window left must be an int"),
    ({"softcap": 0.0}, ValueError, "softcap must be finite and > 0"),
    ({"softcap": float("inf")}, ValueError, "softcap must be finite and > 0"),
    ({"softcap": "30"}, TypeError, "softcap must be a positive float"),
    ({"softcap": True}, TypeError, "softcap must be a positive float"),
])
def test_parse_errors_name_the_option(kwargs, error, match):
    with pytest.raises(error, match=match):
        parse(**kwargs)


def _brute_mask(left, right, nq, nk):
    off = nk - nq
    return np.array([[(left is None or j >= i + off - left) and (right is None or j <= i + off + right)
                      for j in range(nk)] for i in range(nq)], dtype=bool).reshape(nq, nk)


@given(left=SIDES, right=SIDES, causal=st.booleans(), nq=st.integers(0, 20), nk=st.integers(0, 20))
def test_host_rules(left, right, causal, nq, nk):
    rules = parse(causal, (left, right))
    mask = visible_mask(rules, nq, nk)
    np.testing.assert_array_equal(mask, _brute_mask(left, 0 if causal and right is None else
                                                    (min(right, 0) if causal else right), nq, nk))
    assert scores.visible_pairs(rules, nq, nk) == mask.sum()
    if causal and left is None:
        np.testing.assert_array_equal(mask, reference.causal_mask(nq, nk))
    for rows in (1, 4):
        for q0 in range(0, nq, rows):
            b, e = scores.key_range(rules, q0, rows, nq, nk)
            seen = np.flatnonzero(mask[q0:q0 + rows].any(axis=0))
            assert ((seen >= b) & (seen < e)).all()
    for cols in (1, 4):
        for k0 in range(0, nk, cols):
            b, e = scores.query_range(rules, k0, cols, nq, nk)
            seen = np.flatnonzero(mask[:, k0:k0 + cols].any(axis=1))
            assert ((seen >= b) & (seen < e)).all()
    for cols in (1, 4):
        for rows in (1, 4, 8):         # a query tile never spans more key tiles than band_tiles
            for q0 in range(0, nq, rows):
                tiles = np.flatnonzero(mask[q0:q0 + rows].any(axis=0)) // cols
                if tiles.size:
                    assert tiles.max() - tiles.min() + 1 <= scores.band_tiles(rules, rows, cols, nq, nk)


@pytest.mark.skipif(not numba_flash.SIMULATOR, reason="the device helpers are Python functions in the simulator")
@given(left=SIDES, right=SIDES, causal=st.booleans(), nq=st.integers(1, 30), nk=st.integers(1, 30),
       rows=st.sampled_from([1, 8, 16]), cols=st.sampled_from([1, 8, 16]))
@example(left=0, right=0, causal=False, nq=5, nk=9, rows=8, cols=8)
@example(left=None, right=None, causal=True, nq=9, nk=5, rows=8, cols=8)
def test_device_rules_agree_with_the_mask(left, right, causal, nq, nk, rows, cols):
    rules = parse(causal, (left, right))
    row_keys, in_row, key_range, query_range, tile_needs_mask, *_ = device_rules(rules.spec)
    diag = nk - nq
    geo = (nk, diag) + rules.band()
    mask = visible_mask(rules, nq, nk)
    for i in range(nq):
        lo, hi = row_keys(i, geo)
        for j in range(nk + cols):                   # keys past Nk included
            assert in_row(j, lo, hi) == (j < nk and mask[i, j]), (i, j)
    for q0 in range(0, nq, rows):
        b, e = key_range(q0, rows, geo)
        assert (max(b, 0), max(e, 0)) == scores.key_range(rules, q0, rows, nq, nk)
        seen = np.flatnonzero(mask[q0:q0 + rows].any(axis=0))
        assert ((seen >= b) & (seen < e)).all(), "a visible key lies outside key_range"
        for k0 in range(0, nk, cols):
            if not mask[q0:q0 + rows, k0:k0 + cols].all() or k0 + cols > nk:
                assert tile_needs_mask(q0, rows, k0, cols, geo), (q0, k0)
    for k0 in range(0, nk, cols):
        b, e = query_range(k0, cols, nq, geo)
        assert (max(b, 0), max(e, 0)) == scores.query_range(rules, k0, cols, nq, nk)
        seen = np.flatnonzero(mask[:, k0:k0 + cols].any(axis=1))
        assert ((seen >= b) & (seen < e)).all(), "a query outside query_range sees a key of the tile"


@pytest.mark.skipif(not numba_flash.SIMULATOR, reason="the device helpers are Python functions in the simulator")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@given(cap=st.none() | st.floats(0.5, 50), slope=st.none() | st.floats(2**-8, 1.0), scale=st.floats(0.05, 2),
       nq=st.integers(1, 12), nk=st.integers(1, 12), seed=st.integers(0, 2**32 - 1))
def test_device_score_matches_the_host_transform(dtype, cap, slope, scale, nq, nk, seed):
    rules = parse(softcap=cap, alibi=slope is not None)
    *_, score, _ = device_rules(rules.spec, dtype)
    DT = np.dtype(dtype).type
    x = np.random.default_rng(seed).standard_normal((nq, nk)) * 20
    cap_in, cap_out = rules.cap_args(scale)
    sc = (DT(scale * LOG2E), DT(cap_in), DT(cap_out), DT((slope or 0) * LOG2E))
    ref, ref_grad = scores.transform(rules, scale * x, slope)
    tol = (1e-5 if dtype == "float32" else 1e-13) * (1 + (cap or 0) + np.abs(ref))   # log2 units vs natural
    for i, j in itertools.product(range(nq), range(nk)):
        y, grad = score(DT(x[i, j]), i, j, nk - nq, sc)
        assert abs(y / LOG2E - ref[i, j]) <= tol[i, j], (i, j, y / LOG2E, ref[i, j])
        assert abs(grad - ref_grad[i, j]) <= (1e-5 if dtype == "float32" else 1e-13), (i, j)
        assert math.isfinite(y)
