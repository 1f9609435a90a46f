"""Programmable attention: score_mod and mask_mod as plain Python functions.

    python examples/05_programmable_attention.py

A ``score_mod(score, b, h, q_idx, kv_idx, *mod_args)`` rewrites each score (``score`` is
``scale · q·k`` after the built-in softcap and ALiBi, in float32 or float64), a
``mask_mod(b, h, q_idx, kv_idx, *mod_args)`` returns False to hide a key. ``b`` is the
flattened index of the dims before the head axis, ``h`` the head. ``mod_args`` are arrays
(NumPy or device) and numbers handed to the functions unchanged: change their data and
nothing recompiles. No decorator: numba_flash compiles the functions into its kernels
(on a GPU; the simulator calls them as they are). Each variant below is checked against
the float64 oracle given the same functions, and the built-in rules against their
hand-written twins. The backward of a score_mod needs its derivative, score_mod_grad.
Last, a block mask: the document mask evaluated once and reused, forward and backward.
"""
import math

import numpy as np

import numba_flash
from numba_flash.testing import assert_attention_close

B, H, N, D = (2, 4, 256, 64) if not numba_flash.SIMULATOR else (1, 2, 24, 16)
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((B, H, N, D)).astype(np.float32) for _ in range(3))


def relative_bias(score, b, h, i, j, table):
    return score + table[h, i - j + N - 1]            # one learned bias per head and distance


def same_document(b, h, i, j, docs):
    return docs[b, i] == docs[b, j] and j <= i          # causal within each packed document


def prefix_lm(b, h, i, j, prefix):
    return j <= i or j < prefix                         # the prefix sees itself both ways


def sliding_window(b, h, i, j, left):
    return i - left <= j <= i


def tanh_softcap(score, b, h, i, j, cap):
    return cap * math.tanh(score / cap)


def tanh_softcap_grad(score, b, h, i, j, cap):
    t = math.tanh(score / cap)
    return 1.0 - t * t


def alibi(score, b, h, i, j, slopes):
    return score - slopes[h] * abs(i - j)


def density(mask_mod, *args):
    seen = [mask_mod(b, h, i, j, *args) for b in range(B) for h in range(H) for i in range(N) for j in range(N)]
    return sum(seen) / len(seen)


table = (0.1 * rng.standard_normal((H, 2 * N - 1))).astype(np.float32)
docs = np.sort(rng.integers(0, 4, (B, N)), axis=1).astype(np.int32)
slopes = (2.0 ** -np.arange(1, H + 1)).astype(np.float32)
cases = [
    ("relative-position bias", {"score_mod": relative_bias, "mod_args": (table,)}),
    ("document masking", {"mask_mod": same_document, "mod_args": (docs,)}),
    ("prefix-LM", {"mask_mod": prefix_lm, "mod_args": (N // 4,)}),
    ("sliding window", {"mask_mod": sliding_window, "mod_args": (N // 8,)}),
    ("tanh softcap", {"score_mod": tanh_softcap, "mod_args": (5.0,)}),
    ("ALiBi", {"score_mod": alibi, "mod_args": (slopes,)}),
]
for name, options in cases:
    out, lse = numba_flash.attention_fwd(q, k, v, **options)
    assert_attention_close(out, q, k, v, lse, **options)
    line = f"{name:24s} matches the float64 oracle"
    if "mask_mod" in options:
        line += f"; {density(options['mask_mod'], *options['mod_args']):.0%} of the pairs visible"
    print(line)

# The built-in options and their hand-written twins agree.
twins = [({"mask_mod": sliding_window, "mod_args": (N // 8,)}, {"window": (N // 8, 0)}),
         ({"score_mod": tanh_softcap, "mod_args": (5.0,)}, {"softcap": 5.0}),
         ({"score_mod": alibi, "mod_args": (slopes,)}, {"alibi_slopes": slopes})]
for mine, built_in in twins:
    a = numba_flash.attention(q, k, v, **mine)
    b = numba_flash.attention(q, k, v, **built_in)
    print(f"{list(built_in)[0]:24s} built-in and score/mask_mod agree to {np.abs(a - b).max():.1e}")
    assert np.abs(a - b).max() < 1e-4

# Backward: a score_mod needs its derivative.
out, lse = numba_flash.attention_fwd(q, k, v, score_mod=tanh_softcap, mod_args=(5.0,))
dout = rng.standard_normal(out.shape).astype(np.float32)
dq, dk, dv = numba_flash.attention_bwd(dout, q, k, v, out, lse, score_mod=tanh_softcap,
                                       score_mod_grad=tanh_softcap_grad, mod_args=(5.0,))
rq, rk, rv = numba_flash.attention_bwd(dout, q, k, v, out, lse, softcap=5.0)
print(f"{'softcap backward':24s} agrees with the built-in softcap's to {np.abs(dq - rq).max():.1e}")
assert max(np.abs(x - y).max() for x, y in ((dq, rq), (dk, rk), (dv, rv))) < 1e-3

# Block masks: evaluate a mask once, reuse it in every call (every layer, forward and
# backward). Key tiles no row of a query tile sees are skipped; when every row sees one run
# of keys (bm.exact: documents, causal, windows, prefix-LM) the kernels mask by those runs
# and never call the function.
bm = numba_flash.block_mask(same_document, B, 1, N, N, mod_args=(docs,))   # H = 1: every head alike
out_b, lse_b = numba_flash.attention_fwd(q, k, v, block_mask=bm)
assert_attention_close(out_b, q, k, v, lse_b, mask_mod=same_document, mod_args=(docs,))
grads_b = numba_flash.attention_bwd(dout, q, k, v, out_b, lse_b, block_mask=bm)
grads_m = numba_flash.attention_bwd(dout, q, k, v, out_b, lse_b, mask_mod=same_document, mod_args=(docs,))
print(f"{'block mask':24s} {bm!r}, exact: {bm.exact}; backward agrees with the mask_mod's to "
      f"{max(np.abs(x - y).max() for x, y in zip(grads_b, grads_m)):.1e}")
assert max(np.abs(x - y).max() for x, y in zip(grads_b, grads_m)) < 1e-4
classes = np.bincount(bm.tile_classes(32, 32).ravel(), minlength=3) / bm.tile_classes(32, 32).size
print(f"{'32 x 32 tiles':24s} {classes[0]:.0%} empty, {classes[1]:.0%} partial, {classes[2]:.0%} full")
