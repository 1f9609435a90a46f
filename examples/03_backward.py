"""Backward: gradients through attention, checked against the float64 oracle, then a
few steps of gradient descent on a tiny problem with NumPy arrays.

    python examples/03_backward.py

Task: learn queries Q so that attention(Q, K, V) matches a target output.
Loss L = ½‖attention(Q, K, V) − T‖², so dL/d out = out − T.
"""
import numpy as np

import numba_flash
from numba_flash import reference

H, N, D = (2, 16, 8) if numba_flash.SIMULATOR else (8, 256, 64)
rng = np.random.default_rng()
q, k, v = (rng.standard_normal((H, N, D)) for _ in range(3))       # float64: exact gradients
target = reference.attention(rng.standard_normal((H, N, D)), k, v, causal=True)

# 1. One gradient, checked against the oracle.
out, lse = numba_flash.attention_fwd(q, k, v, causal=True)
dout = out - target
dq, dk, dv = numba_flash.attention_bwd(dout, q, k, v, out, lse, causal=True)
for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), reference.attention_bwd(dout, q, k, v, causal=True)):
    err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
    print(f"{name}: relative error vs float64 oracle {err:.1e}")
    assert err < 1e-10, (name, err)

# 2. Gradient descent on Q.
lr = 0.5
losses = []
for step in range(3 if numba_flash.SIMULATOR else 8):
    out, lse = numba_flash.attention_fwd(q, k, v, causal=True)
    dout = out - target
    losses.append(0.5 * float((dout ** 2).sum()))
    dq, _, _ = numba_flash.attention_bwd(dout, q, k, v, out, lse, causal=True)
    q -= lr * dq
    print(f"step {step}: loss {losses[-1]:.5f}")
assert losses[-1] < losses[0], losses
