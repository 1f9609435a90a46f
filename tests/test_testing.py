"""numba_flash.testing, the public oracle checks and Hypothesis strategies: they accept
numba_flash's own results on the problems they draw, and they reject attention that is
subtly wrong (a mask off by one key, a skipped scale, a rounding to the wrong dtype)."""
import numpy as np
import pytest
from hypothesis import given, settings

import numba_flash
from numba_flash import reference
from numba_flash.testing import assert_attention_close, attention_problems
from conftest import ON_GPU

DTYPES = ("float32", "float64", "float16", "bfloat16")


@settings(max_examples=6 if not ON_GPU else 40)
@given(problem=attention_problems(dtypes=DTYPES, max_len=20, head_dims=(8, 16)))
def test_numba_flash_passes_its_own_check(problem):
    q, k, v, options = problem["q"], problem["k"], problem["v"], problem["options"]
    out, lse = numba_flash.attention_fwd(q, k, v, **options)
    assert_attention_close(out, q, k, v, lse, **options)
    assert_attention_close(out, q, k, v, **options)          # out alone


def _problem(dtype="float32", nq=9, nk=12, d=16):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 3, n, d)) for n in (nq, nk, nk))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def test_wrong_attention_is_rejected():
    """Three plausible bugs, each caught by the rule (the oracle itself passes)."""
    q, k, v = _problem()
    good, lse = reference.attention_fwd(q, k, v, causal=True)
    assert_attention_close(good.astype(np.float32), q, k, v, lse.astype(np.float32), causal=True)
    shifted, _ = reference.attention_fwd(q, k, v, window=(None, 1))          # causal off by one key
    with pytest.raises(AssertionError, match="out: max error"):
        assert_attention_close(shifted.astype(np.float32), q, k, v, causal=True)
    unscaled, _ = reference.attention_fwd(q, k, v, causal=True, scale=1.0)   # scale forgotten
    with pytest.raises(AssertionError, match="out: max error"):
        assert_attention_close(unscaled.astype(np.float32), q, k, v, causal=True)
    q16, k16, v16 = (x.astype(np.float16) for x in (q, k, v))
    coarse = (reference.attention_fwd(q16, k16, v16)[0] * 64).round() / 64   # a 6-bit output
    with pytest.raises(AssertionError, match="out: max error"):
        assert_attention_close(coarse.astype(np.float16), q16, k16, v16)
