"""Simulator check of the candidate rung 8 (scratch/k08_pairs.py) against the oracle."""
import sys, time
import numpy as np
sys.path.insert(0, "scratch")
import numba_flash
from numba_flash import reference
import k08_pairs as m

rng = np.random.default_rng(0)
for nq, nk, d in [(16, 32, 8), (40, 24, 24), (17, 50, 40), (33, 7, 12)]:
    q, k, v = (rng.standard_normal((n, d)).astype(np.float32) * 2 for n in (nq, nk, nk))
    t0 = time.time()
    out = m.attention(q, k, v)
    ref = reference.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    err = np.abs(out - ref).max()
    print(nq, nk, d, f"err {err:.2e}", f"{time.time() - t0:.1f}s", "OK" if err < 1e-5 else "FAIL", flush=True)
