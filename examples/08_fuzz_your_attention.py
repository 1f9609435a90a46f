"""Fuzz your own attention code with Hypothesis, as numba_flash's test-suite fuzzes its kernels.

    python examples/08_fuzz_your_attention.py        (needs hypothesis: pip install hypothesis)

``numba_flash.testing.attention_problems()`` draws attention problems (leading dims,
grouped heads, ragged and empty lengths, dtypes, causal masks, windows, softcaps, ALiBi);
``assert_attention_close`` checks a result against the float64 oracle with the tolerance
rule the suite uses (twice the error an ordinary program of the same precision makes on the
same inputs, plus the problem's sensitivity to logit rounding). Below, a plain NumPy
attention passes, and the same code with a classic bug (the causal mask aligned top-left
instead of bottom-right, which only shows when Nq != Nk) is caught, with the smallest
problem Hypothesis finds. Runs on the CPU: no GPU and no numba_flash kernel is needed.
"""
import numpy as np
from hypothesis import given, settings

from numba_flash.testing import assert_attention_close, attention_problems


def my_attention(q, k, v, causal=False, top_left=False):
    """Softmax attention in the inputs' precision (float32 here), grouped K/V heads allowed."""
    group = q.shape[-3] // k.shape[-3]
    k, v = (np.repeat(x, group, axis=-3) for x in (k, v))
    s = (q @ np.swapaxes(k, -1, -2)) / np.sqrt(q.shape[-1]).astype(q.dtype)
    if causal:
        nq, nk = s.shape[-2:]
        diag = 0 if top_left else nk - nq            # numba_flash's masks align bottom-right
        s = np.where(np.arange(nk) <= np.arange(nq)[:, None] + diag, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    l = p.sum(-1, keepdims=True)
    return (p / np.where(l > 0, l, 1)) @ v


def check(top_left):
    @settings(max_examples=60, database=None, report_multiple_bugs=False)
    @given(attention_problems(dtypes=("float32",), max_len=12, head_dims=(8,), rules=False))
    def fuzz(problem):
        q, k, v = problem["q"], problem["k"], problem["v"]
        for causal in (False, True):
            assert_attention_close(my_attention(q, k, v, causal, top_left), q, k, v, causal=causal)
    fuzz()


check(top_left=False)
print("my_attention: 60 random problems, each within the tolerance of the float64 oracle")
try:
    check(top_left=True)
except AssertionError as exc:
    print(f"my_attention with a top-left causal mask: caught ({str(exc).splitlines()[0]})")
else:
    raise SystemExit("the top-left mask went unnoticed")
