"""Throughput of the special-function unit on this GPU: ``tanh.approx.f32`` (the softcap's
tanh), ``ex2.approx.ftz.f32`` (the softmax's exponential) and the two interleaved (a GPU
machine)::

    python tools/sfu_rate.py

Each thread runs eight independent chains of the instruction (every multiprocessor full,
eight blocks of 256 threads each); the report gives results per clock per multiprocessor
at the GPU's maximum clock. Where the interleaved rate equals each alone, the two share
one unit, and a score that needs both (a softcapped score) costs it twice a plain score's
time (docs/performance.md item 102: on an H100 16 a clock for each and for both).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numba_flash  # noqa: E402,F401  (before numba.cuda: it decides the simulator)
import numpy as np  # noqa: E402
from numba import cuda, float32  # noqa: E402

from numba_flash import ops  # noqa: E402

KINDS = ("tanh", "ex2", "tanh+ex2")


def make(kind, iters):
    """The kernel: ``iters`` rounds of eight chains, each chain's instruction by ``kind``."""
    k = KINDS.index(kind)
    th, ex = ops.tanh_approx, ops.exp2_approx

    @cuda.jit
    def kernel(out, x0):
        t = cuda.grid(1)
        a0 = x0 + float32(t) * float32(1e-7)
        a1, a2, a3 = a0 + float32(0.1), a0 + float32(0.2), a0 + float32(0.3)
        a4, a5, a6, a7 = a0 + float32(0.4), a0 + float32(0.5), a0 + float32(0.6), a0 + float32(0.7)
        for _ in range(iters):
            if k == 0:
                a0, a1, a2, a3, a4, a5, a6, a7 = th(a0), th(a1), th(a2), th(a3), th(a4), th(a5), th(a6), th(a7)
            elif k == 1:
                a0, a1, a2, a3, a4, a5, a6, a7 = ex(a0), ex(a1), ex(a2), ex(a3), ex(a4), ex(a5), ex(a6), ex(a7)
            else:
                a0, a1, a2, a3, a4, a5, a6, a7 = th(a0), ex(a1), th(a2), ex(a3), th(a4), ex(a5), th(a6), ex(a7)
        out[t] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7
    return kernel


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=4096, help="rounds of eight results a thread")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if numba_flash.SIMULATOR:
        sys.exit("tools/sfu_rate.py times a GPU: none here")
    dev = cuda.get_current_device()
    sms, clock = dev.MULTIPROCESSOR_COUNT, dev.CLOCK_RATE * 1e3
    blocks, threads = 8 * sms, 256
    out = cuda.device_array(blocks * threads, np.float32)
    results = blocks * threads * args.iters * 8
    for kind in KINDS:
        kernel = make(kind, args.iters)
        kernel[blocks, threads](out, np.float32(-0.5))          # compile, warm up
        cuda.synchronize()
        start, end, times = cuda.event(), cuda.event(), []
        for _ in range(args.repeats):
            start.record()
            kernel[blocks, threads](out, np.float32(-0.5))
            end.record()
            end.synchronize()
            times.append(cuda.event_elapsed_time(start, end) * 1e-3)
        t = float(np.median(times))
        print(f"{kind:9s} {1e3 * t:.3f} ms  {results / t / 1e9:7.0f} G results/s  "
              f"{results / t / sms / clock:5.2f} a clock a multiprocessor (at {clock / 1e9:.2f} GHz)")


if __name__ == "__main__":
    main()
