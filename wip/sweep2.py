"""Rungs 5-8 on the seed problem at several tiles, timed as bench.py ladder does (L2 flushed
before each repeat). Run from the repo root: python wip/sweep2.py"""
import math, numpy as np
from numba import cuda
from numba_flash.ladder import seed_inputs, _host, k05_float4 as k5, k06_smem_layout as k6, \
    k07_double_buffer as k7, k08_tensor_cores as k8
from numba_flash import reference
q, k, v = seed_inputs(1024, 1024)
ref = reference.attention(q, k, v)
qd, kd, vd = (cuda.to_device(x) for x in (q, k, v))
scale_log2 = np.float32(1 / math.sqrt(1024) * 1.4426950408889634)
flush = cuda.device_array(64 << 20, np.uint8)

def t_ms(fn, reps=21):
    fn(); cuda.synchronize(); ts = []
    for _ in range(reps):
        flush[:] = 1
        s = cuda.event(timing=True); e = cuda.event(timing=True)
        s.record(); fn(); e.record(); e.synchronize(); ts.append(cuda.event_elapsed_time(s, e))
    return float(np.median(ts))

R = lambda W, TM, TV, DK: dict(W=W, TM=TM, TV=TV, DK=DK)
T = lambda W, Bc, Bd, DK: dict(W=W, Bc=Bc, Bd=Bd, DK=DK)
cases = [(m, R(4, 4, 8, dk)) for m in (k5, k6, k7) for dk in (32, 64)]
cases += [(k7, R(8, 4, 8, 32)), (k7, R(8, 2, 8, 64))]
cases += [(k8, T(*t)) for t in [(4, 64, 256, 32), (4, 128, 256, 32), (4, 128, 256, 16), (2, 128, 256, 32),
                                (8, 128, 256, 32), (8, 128, 256, 16), (4, 96, 256, 32), (4, 128, 128, 32),
                                (2, 128, 256, 16), (6, 128, 256, 16)]]
for mod, tiles in cases:
    try:
        kern = mod.make_kernel(**tiles)
        NT, Br, Bc, Bd = mod.shape(**tiles)
        out = cuda.device_array((1024, 1024), np.float32)
        smem = kern.smem_bytes(1024) if callable(kern.smem_bytes) else kern.smem_bytes
        f = lambda: _host.run_kernel(kern, (-(-1024 // Br), -(-1024 // Bd)), NT, smem, (qd, kd, vd, out, scale_log2))
        ms = t_ms(f)
        err = float(np.abs(out.copy_to_host() - ref).max())
        regs = [getattr(c, "regs_per_thread", None) for c in kern.overloads.values()]
        lmem = [getattr(c, "local_mem_per_thread", None) for c in kern.overloads.values()]
        print(f"{mod.__name__.split('.')[-1]} {tiles} {ms:.3f} ms err {err:.1e} regs {regs} local {lmem} smem {smem}", flush=True)
    except Exception as ex:
        print(mod.__name__, tiles, "ERR", repr(ex)[:300], flush=True)
