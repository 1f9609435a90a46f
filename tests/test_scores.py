"""numba_flash.scores: the one description of the score rules, and its device helpers.

The device helpers (what every kernel family compiles in) must agree with the host mask
(what the float64 oracle and the tests' baselines use), and the tile-range helpers must
never skip a visible key nor claim a tile needs no mask when one of its keys is hidden.
In the simulator the device helpers are plain Python functions, so this runs everywhere.
"""
import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import numba_flash
from numba_flash import reference, scores
from numba_flash.scores import CAUSAL, FULL, ScoreSpec, device_rules, visible_mask

SPECS = [FULL, CAUSAL]


def test_spec_is_a_hashable_value():
    assert ScoreSpec() == FULL and ScoreSpec(causal=True) == CAUSAL
    assert len({FULL, CAUSAL, ScoreSpec(causal=True)}) == 2
    assert scores.spec_of(True) is CAUSAL and scores.spec_of(False) is FULL
    assert (FULL.tag, CAUSAL.tag) == ("full", "causal")
    with pytest.raises(Exception):
        CAUSAL.causal = False


def test_causal_mask_is_the_spec_mask():
    for nq, nk in [(3, 5), (5, 3), (4, 4), (1, 7), (7, 1), (0, 3), (3, 0)]:
        np.testing.assert_array_equal(reference.causal_mask(nq, nk), visible_mask(CAUSAL, nq, nk))
        assert visible_mask(FULL, nq, nk).all()


@pytest.mark.skipif(not numba_flash.SIMULATOR, reason="the device helpers are Python functions in the simulator")
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.tag)
@given(nq=st.integers(1, 40), nk=st.integers(1, 40), rows=st.sampled_from([1, 8, 16]),
       cols=st.sampled_from([1, 8, 16]))
def test_device_rules_agree_with_the_mask(spec, nq, nk, rows, cols):
    visible, key_end, query_begin, tile_needs_mask = device_rules(spec)
    diag = nk - nq
    mask = visible_mask(spec, nq, nk)
    for i, j in itertools.product(range(nq), range(nk + cols)):        # keys past Nk included
        assert visible(i, j, nk, diag) == (j < nk and mask[i, j]), (i, j)
    for q0 in range(0, nq, rows):
        tile = mask[q0:q0 + rows]
        seen = np.flatnonzero(tile.any(axis=0))
        end = key_end(q0, rows, nk, diag)
        assert max(end, 0) == scores.key_end(spec, q0, rows, nq, nk)
        assert (seen < max(end, 0)).all(), "a visible key lies past key_end"
        for k0 in range(0, nk, cols):
            hidden = not mask[q0:q0 + rows, k0:k0 + cols].all() or k0 + cols > nk
            if hidden:
                assert tile_needs_mask(q0, rows, k0, cols, nk, diag), (q0, k0)
    for k0 in range(0, nk, cols):
        first = query_begin(k0, diag)
        assert first == scores.query_begin(spec, k0, nq, nk)
        assert not mask[:first, k0:].any(), "a query before query_begin sees a key from k0 on"
