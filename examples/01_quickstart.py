"""Quickstart: exact attention from NumPy, checked against the float64 oracle.

    python examples/01_quickstart.py

On a machine without a GPU numba_flash runs its kernels in Numba's CUDA simulator,
so this example then uses a tiny problem.
"""
import time

import numpy as np

import numba_flash
from numba_flash import reference

# (batch, heads, sequence length, head dim): small enough for the simulator.
B, H, N, D = (1, 2, 48, 24) if numba_flash.SIMULATOR else (4, 16, 2048, 128)

rng = np.random.default_rng()
q, k, v = (rng.standard_normal((B, H, N, D), dtype=np.float32) for _ in range(3))

for causal in (False, True):
    t0 = time.perf_counter()
    out, lse = numba_flash.attention_fwd(q, k, v, causal=causal)   # NumPy in, NumPy out
    seconds = time.perf_counter() - t0                             # includes JIT compile on first call
    ref_out, ref_lse = reference.attention_fwd(q, k, v, causal=causal)
    err = np.abs(out - ref_out).max()
    print(f"causal={causal!s:5}  out {out.shape} {out.dtype}  max |out - float64 oracle| = {err:.2e}"
          f"  ({seconds:.2f} s)")
    assert out.dtype == np.float32 and lse.shape == (B, H, N)
    assert err < 1e-4, err

# Queries and keys of different lengths: the causal mask is aligned bottom-right,
# so the last query sees every key (KV-cache decoding).
q_new = q[..., -3:, :]
out_new = numba_flash.attention(q_new, k, v, causal=True)
assert np.allclose(out_new, reference.attention(q_new, k, v, causal=True), atol=1e-5)
print(f"decode step: {q_new.shape[-2]} new queries against {N} keys -> {out_new.shape}")
