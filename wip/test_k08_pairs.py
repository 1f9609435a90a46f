"""Simulator check of the rung 8 candidates in wip/ against the oracle (run from the repo root)."""
import sys, time, functools
import numpy as np
sys.path.insert(0, "wip")
import numba_flash
from numba_flash import reference
from numba_flash.ladder import _host
import k08_pairs as kp
import k08_fast as kf

def pairs(fast):
    def launch(q, k, v, out, scale_log2):
        NT, Br, Bc, Bd = kp.shape(**kp.TILES)
        kern = kp.make_kernel(**kp.TILES, FAST=fast)
        _host.run_kernel(kern, (_host.cdiv(out.shape[0], Br), _host.cdiv(out.shape[1], Bd)), NT, kern.smem_bytes,
                         (q, k, v, out, scale_log2))
    return lambda q, k, v: _host.run(q, k, v, launch, vector=True)

rng = np.random.default_rng(0)
for name, fn in (("pairs", pairs(False)), ("pairs fast split", pairs(True)), ("rung 8 fast split", kf.attention)):
    for nq, nk, d in [(16, 32, 8), (40, 24, 24), (17, 50, 40), (33, 7, 12)]:
        q, k, v = (rng.standard_normal((n, d)).astype(np.float32) * 2 for n in (nq, nk, nk))
        t0 = time.time()
        out = fn(q, k, v)
        ref = reference.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
        err = np.abs(out - ref).max()
        print(name, nq, nk, d, f"err {err:.2e}", f"{time.time() - t0:.1f}s", "OK" if err < 1e-5 else "FAIL", flush=True)
