"""Registers and spills of rung 8 candidates (PTX for sm_90, assembled with ptxas)."""
import sys
sys.path.insert(0, "scratch")
from numba import cuda
from numba_flash import ptx as P
from numba_flash.ladder import _host, k08_tensor_cores as k8
import k08_pairs as k8p
ptxas = P.find_ptxas()
for mod, tiles in [(k8, dict(W=4, Bc=64, Bd=128, DK=32)), (k8p, dict(W=4, Bc=64, Bd=256, DK=32)),
                   (k8p, dict(W=4, Bc=32, Bd=256, DK=32)), (k8p, dict(W=8, Bc=64, Bd=256, DK=32)),
                   (k8p, dict(W=4, Bc=64, Bd=128, DK=32))]:
    kern = mod.make_kernel(**tiles)
    ptx, _ = cuda.compile_ptx(kern.py_func, _host.SIGNATURE, cc=(9, 0), launch_bounds=(kern.threads, 1))
    f = P.features(ptx)
    a = P.assemble(ptx, (9, 0), ptxas)
    print(mod.__name__, tiles, "smem", kern.smem_bytes, {k: v for k, v in a.items()}, "mma" , ptx.count("mma.sync"), flush=True)
