"""A tour of the kernel ladder: every rung on one problem, each checked against the oracle.

    python examples/02_ladder_tour.py

``numba_flash.ladder.RUNGS`` holds eight attention kernels, each one idea away from the
previous (read them side by side: ``diff numba_flash/ladder/k05_*.py
numba_flash/ladder/k06_*.py``). On a GPU this runs the seed problem (N = d = 1024);
without one the kernels run in Numba's CUDA simulator, so the problem is tiny. For
timings use ``python bench.py ladder``; the seconds printed here include the JIT compile.
"""
import time

import numpy as np

import numba_flash
from numba_flash import ladder, reference

N, D = (12, 16) if numba_flash.SIMULATOR else (1024, 1024)
TOLERANCE = 1e-4          # the seed's pass/fail: max abs error vs the float64 oracle

q, k, v = ladder.seed_inputs(N, D)         # the seed's input distribution, float32
ref = reference.attention(q, k, v)         # float64 oracle: softmax(q kᵀ / √d) v
where = "Numba's CUDA simulator" if numba_flash.SIMULATOR else "the GPU"
print(f"softmax(Q Kᵀ / √d) V with N = {N}, d = {D}, float32, on {where}\n")

for rung in ladder.RUNGS:
    t0 = time.perf_counter()
    out = rung(q, k, v)                    # NumPy in, NumPy out
    seconds = time.perf_counter() - t0
    err = float(np.abs(out.astype(np.float64) - ref).max())
    print(f"rung {rung.number}  {rung.title}")
    print(f"        what changed: {rung.change}")
    print(f"        max |out - oracle| = {err:.1e} ({'ok' if err <= TOLERANCE else 'FAIL'} at {TOLERANCE:g}); "
          f"{seconds:.2f} s with compile")
    assert out.shape == (N, D) and out.dtype == np.float32
    assert err <= TOLERANCE, f"rung {rung.number} is off by {err:.2e}"

print("\nEvery rung agrees with the oracle. Timings: python bench.py ladder (GPU).")
