"""Every kernel family with every score rule, at small ragged shapes: a driver for
NVIDIA's compute-sanitizer (on a GPU machine)::

    compute-sanitizer --tool memcheck --report-api-errors no python tools/sanitize.py
    compute-sanitizer --tool racecheck python tools/sanitize.py
    compute-sanitizer --tool synccheck python tools/sanitize.py

Each call is checked against the float64 oracle as well, so a run that the sanitizer
passes also computed the right thing. Exits 1 on a wrong result. ``--quick``: the first
shape only (racecheck is slow); ``--transforms``: softcap and ALiBi on a grouped-head
shape, float32 and bfloat16 only; ``--low``: float16 and bfloat16 only (the tensor-core
kernels).
"""
import sys

import ml_dtypes
import numpy as np

import numba_flash
from numba_flash import reference

OPTIONS = [
    {},
    {"causal": True},
    {"window": (5, 3)},
    {"window": (0, 0), "causal": True},
    {"window": (7, None), "softcap": 3.0, "alibi": True},
    {"causal": True, "softcap": 2.0, "alibi": True},
]
# (Hq, Hkv, Nq, Nk, d): ragged against every tile size, Nq > Nk and Nq < Nk, GQA and MQA
SHAPES = [(2, 2, 37, 53, 40), (4, 2, 70, 29, 64), (3, 1, 17, 131, 24)]
DTYPES = (("float32", 1e-4), ("float64", 1e-10), ("float16", 2e-2), ("bfloat16", 8e-2))   # and tolerances


def main():
    rng = np.random.default_rng(0)
    bad = 0
    shapes, options, dtypes = SHAPES, OPTIONS, DTYPES
    if "--quick" in sys.argv:
        shapes = SHAPES[:1]
    if "--transforms" in sys.argv:
        shapes, options, dtypes = SHAPES[1:2], OPTIONS[4:], DTYPES[::3]
    if "--low" in sys.argv:
        dtypes = [(dt, tol) for dt, tol in dtypes if dt in ("float16", "bfloat16")]
    for (hq, hkv, nq, nk, d) in shapes:
        for opts in options:
            opts = dict(opts)
            q = rng.standard_normal((2, hq, nq, d))
            k, v = (rng.standard_normal((2, hkv, nk, d)) for _ in range(2))
            if opts.pop("alibi", False):
                opts["alibi_slopes"] = (2.0 ** -rng.uniform(0.5, 6, hq)).astype(np.float32)
            ref_out, _ = reference.attention_fwd(q, k, v, **opts)
            dout = rng.standard_normal(ref_out.shape)
            ref_grads = reference.attention_bwd(dout, q, k, v, **opts)
            for dt, tol in dtypes:
                if dt in ("float16", "bfloat16") and d % 8:
                    continue
                npdt = ml_dtypes.bfloat16 if dt == "bfloat16" else np.dtype(dt)
                args = [x.astype(npdt) for x in (q, k, v)]
                out, lse = numba_flash.attention_fwd(*args, **opts)
                err = float(np.abs(out.astype(np.float64) - ref_out).max())
                errs = [err]
                grads = numba_flash.attention_bwd(dout.astype(npdt), *args, out, lse, **opts)
                errs += [float(np.abs(g.astype(np.float64) - r).max() / max(1, np.abs(r).max()))
                         for g, r in zip(grads, ref_grads)]
                ok = max(errs) <= tol
                bad += not ok
                print(f"{'ok ' if ok else 'BAD'} {dt:9s} {(hq, hkv, nq, nk, d)} {opts if 'alibi_slopes' not in opts else {**opts, 'alibi_slopes': '...'}} "
                      f"max err {max(errs):.1e}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
