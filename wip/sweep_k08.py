"""Rung 8 on the seed problem at several tiles, next to rung 7 and the first rung 8 design with
the same split and index fixes (wip/k08_fast.py), timed as bench.py ladder does (L2 flushed
before each repeat). Run from the repo root: python wip/sweep_k08.py"""
import sys, math, numpy as np
sys.path.insert(0, "wip")
from numba import cuda
from numba_flash.ladder import seed_inputs, _host, k07_double_buffer as k7, k08_tensor_cores as k8
from numba_flash import reference
import k08_fast as k8f
q, k, v = seed_inputs(1024, 1024)
ref = reference.attention(q, k, v)
qd, kd, vd = (cuda.to_device(x) for x in (q, k, v))
scale_log2 = np.float32(1 / math.sqrt(1024) * 1.4426950408889634)
flush = cuda.device_array(64 << 20, np.uint8)

def t_ms(fn, reps=15):
    fn(); cuda.synchronize(); ts = []
    for _ in range(reps):
        flush[:] = 1
        s = cuda.event(timing=True); e = cuda.event(timing=True)
        s.record(); fn(); e.record(); e.synchronize(); ts.append(cuda.event_elapsed_time(s, e))
    return float(np.median(ts))

T = lambda W, Bc, Bd, DK=32: dict(W=W, Bc=Bc, Bd=Bd, DK=DK)
for mod, tiles in [(k7, k7.GPU_TILES), (k8f, k8f.GPU_TILES), (k8, T(4, 64, 256)), (k8, T(4, 64, 256, 64)),
                   (k8, T(4, 64, 256, 16)), (k8, T(8, 64, 256)), (k8, T(4, 32, 256)), (k8, T(4, 64, 128)),
                   (k8, T(4, 128, 256)), (k8, T(2, 64, 256))]:
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
        print(f"{mod.__name__} {tiles} {ms:.3f} ms err {err:.1e} regs {regs} local {lmem} smem {smem}", flush=True)
    except Exception as ex:
        print(mod.__name__, tiles, "ERR", repr(ex)[:300], flush=True)
