"""How many results a clock the special-function unit gives per multiprocessor, instruction
by instruction (a GPU machine)::

    python tools/mufu_rate.py                       # tanh.approx.f32, ex2.approx.ftz.f32, both at once
    python tools/mufu_rate.py --iters 64 --blocks 2 # a quick run (the simulator takes this too)

The softcap costs the forward two special-function results a score (tanh, then exp2;
docs/performance.md items 32, 87, 92), and how it can be made cheaper depends on whether
the unit gives tanh at exp2's rate. Each thread runs eight independent chains of one
instruction (``ops.tanh_approx`` or ``ops.exp2_approx``), enough warps per multiprocessor
to keep the unit busy; the time of a launch (CUDA events, median of five after a warm-up)
gives results per clock per multiprocessor at the device's rated clock (a clock that
boosts past it reads as more). In Numba's simulator the kernels run (a test does) but its
events time nothing: the rates read nan.
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # numba_flash/ from this tree

import numpy as np  # noqa: E402

import numba_flash  # noqa: E402,F401  (before numba: it decides whether the simulator is needed)
from numba_flash import ops  # noqa: E402

import numba  # noqa: E402
from numba import cuda  # noqa: E402

CHAINS = 8
# each op: the instructions of the even chains and of the odd ones ("tanh+ex2": both at
# once, whose rate against each alone says whether they share one unit)
OPS = {"tanh": (ops.tanh_approx, ops.tanh_approx), "ex2": (ops.exp2_approx, ops.exp2_approx),
       "tanh+ex2": (ops.tanh_approx, ops.exp2_approx)}


def make_kernel(op, iters):
    """The kernel: ``CHAINS`` independent chains per thread, ``iters`` steps each, the even
    chains of ``op[0]``, the odd ones of ``op[1]``."""
    f, g = op

    @cuda.jit
    def chains(out, seed):
        t = cuda.grid(1)
        a0 = numba.float32(seed + 1e-4 * t)
        a1, a2, a3, a4, a5, a6, a7 = a0 + 0.1, a0 + 0.2, a0 + 0.3, a0 + 0.4, a0 + 0.5, a0 + 0.6, a0 + 0.7
        for _ in range(iters):
            a0, a1, a2, a3 = f(a0), g(a1), f(a2), g(a3)
            a4, a5, a6, a7 = f(a4), g(a5), f(a6), g(a7)
        if t < out.shape[0]:
            out[t] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7
    return chains


def device_facts():
    """``(multiprocessors, rated clock in Hz)`` of the current device (the simulator's: 1, 1 GHz)."""
    dev = cuda.get_current_device()
    return getattr(dev, "MULTIPROCESSOR_COUNT", 1), getattr(dev, "CLOCK_RATE", 1e6) * 1e3


def measure(name, iters, blocks, threads, repeats=5):
    """``(ms, results a clock per multiprocessor)`` of one launch of ``name``'s chains."""
    kern = make_kernel(OPS[name], iters)
    out = cuda.device_array(blocks * threads, np.float32)
    kern[blocks, threads](out, 0.5)
    cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = cuda.event(), cuda.event()
        start.record()
        kern[blocks, threads](out, 0.5)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    ms = statistics.median(times)
    if not np.isfinite(out.copy_to_host()).all():
        raise RuntimeError(f"{name}: the chains' results are not finite")
    sms, clock_hz = device_facts()
    results = blocks * threads * iters * CHAINS
    return ms, results / (ms * 1e-3) / clock_hz / sms if ms > 0 else float("nan")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=4096, help="steps of each chain (default 4096)")
    p.add_argument("--blocks", type=int, default=None, help="blocks of 256 threads (default 8 per multiprocessor)")
    p.add_argument("--ops", default="tanh,ex2,tanh+ex2", help="comma-separated, of " + ", ".join(OPS))
    args = p.parse_args(argv)
    names = [n.strip() for n in args.ops.split(",") if n.strip()]
    unknown = [n for n in names if n not in OPS]
    if unknown or args.iters < 1:
        p.error(f"--ops takes {', '.join(OPS)} (got {', '.join(unknown) or args.ops}); --iters at least 1")
    blocks = args.blocks or 8 * device_facts()[0]
    rates = {}
    for name in names:
        ms, rate = measure(name, args.iters, blocks, 256)
        rates[name] = rate
        print(f"{name}: {ms:.3f} ms, {rate:.1f} results / clock / multiprocessor", flush=True)
    if "tanh" in rates and "ex2" in rates and rates["ex2"] > 0:
        print(f"tanh / ex2: {rates['tanh'] / rates['ex2']:.2f}")
    return rates


if __name__ == "__main__":
    main()
