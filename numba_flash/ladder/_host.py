"""Host side shared by every rung: input checks, device copies, the output, the launch.

The rungs differ only in their kernels; what happens around a launch is the same for
all of them and lives here, so that ``diff kNN.py kMM.py`` shows kernel changes only.
"""
import math

import numpy as np
from numba import cuda

from .. import _arrays, api
from .._runtime import SIMULATOR
from ..launch import launch

LOG2E = 1.4426950408889634   # 1 / ln 2: exp(x) = exp2(x · log2 e)


def cdiv(a, b):
    return -(-a // b)


def _check(q, k, v, vector):
    names = ("q", "k", "v")
    kinds = ["NumPy" if isinstance(x, np.ndarray) else "device" if _arrays.is_device_array(x) else None
             for x in (q, k, v)]
    for n, x, kind in zip(names, (q, k, v), kinds):
        if kind is None:
            raise TypeError(f"{n} must be a 2-D float32 NumPy array or CUDA device array, got "
                            f"{type(x).__name__}. Wrap lists with np.asarray(..., dtype=np.float32).")
    if len(set(kinds)) > 1:
        desc = ", ".join(f"{n} is a {kd} array" for n, kd in zip(names, kinds))
        raise TypeError(f"q, k and v must all be NumPy arrays or all be device arrays; {desc}.")
    on_device = kinds[0] == "device"
    if on_device:
        q, k, v = (_arrays.as_numba_device(x) for x in (q, k, v))
    for n, x in zip(names, (q, k, v)):
        if np.dtype(x.dtype) != np.float32:
            raise TypeError(f"{n} has dtype {np.dtype(x.dtype)}; the ladder kernels are float32 only. "
                            f"Use {n}.astype(np.float32).")
        if len(x.shape) != 2:
            raise ValueError(f"{n} must be 2-D (N, d), got shape {tuple(x.shape)}. The ladder computes "
                             "one head; use numba_flash.attention for batches.")
    (nq, d), (nk, dk), (nv, dv) = (tuple(x.shape) for x in (q, k, v))
    if not (d == dk == dv):
        raise ValueError(f"q, k and v must share d (axis 1), got q {q.shape}, k {k.shape}, v {v.shape}.")
    if nk != nv:
        raise ValueError(f"k and v must have the same length (axis 0), got k {k.shape} and v {v.shape}.")
    if min(nq, nk, d) < 1:
        raise ValueError(f"q, k and v must be non-empty, got q {q.shape}, k {k.shape}, v {v.shape}.")
    if vector and d % 4:
        raise ValueError(f"this rung moves rows 16 bytes (4 floats) at a time, so d must be a multiple "
                         f"of 4, got d={d}. Pad q, k and v with zero columns (and scale by 1/sqrt of "
                         "the true d), or use an earlier rung.")
    if on_device:
        for n, x in zip(names, (q, k, v)):
            rows, cols = x.shape
            if (rows > 1 and x.strides[0] != 4 * d) or (cols > 1 and x.strides[1] != 4):
                raise ValueError(f"{n} must be C-contiguous on the device, got strides {tuple(x.strides)}. "
                                 "Make a contiguous copy first.")
            if vector and _arrays.device_pointer(x) % 16:
                raise ValueError(f"{n} must start on a 16-byte boundary for this rung's 128-bit loads. Pass "
                                 "a freshly allocated array (e.g. a contiguous copy), or use rung 4 or earlier.")
    return on_device, (q, k, v), nq, d


SIGNATURE = "void(float32[:, ::1], float32[:, ::1], float32[:, ::1], float32[:, ::1], float32)"
"""Every rung's kernel: ``kernel(q (Nq, d), k (Nk, d), v (Nk, d), out (Nq, d), scale_log2)``."""


def run(q, k, v, launch_rung, *, vector=False):
    """Check q (Nq, d), k and v (Nk, d), move them to the device, allocate out, call
    ``launch_rung(q, k, v, out, scale_log2)`` and return out: NumPy in -> NumPy out,
    device arrays in (Numba's, or any CUDA array interface / DLPack producer) -> a Numba
    device array out. Launches on the default stream (unlike ``numba_flash.attention``,
    no ordering after a producer's stream)."""
    on_device, (q, k, v), nq, d = _check(q, k, v, vector)
    if not on_device:
        q, k, v = (cuda.to_device(np.ascontiguousarray(x)) for x in (q, k, v))
    out = _arrays.device_empty((nq, d), np.float32, api._POISON)   # NaN-poisoned in the tests
    launch_rung(q, k, v, out, np.float32(LOG2E / math.sqrt(d)))
    return out if on_device else out.copy_to_host()


def fitting(make_kernel, d, *tilings):
    """The first of ``tilings`` whose kernel's shared memory at head dim ``d`` fits a block
    on this GPU (any, in the simulator); the last one if none does (its launch then raises
    a ValueError naming the limit). Rungs that keep a whole ``Br × d`` block of Q in shared
    memory list their fastest tiling first and one with fewer rows for large d."""
    if SIMULATOR:
        return tilings[0]
    limit = cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    for t in tilings:
        if make_kernel(**t).smem_bytes(d) <= limit:
            return t
    return tilings[-1]


def run_kernel(kern, grid, block, smem_bytes, args):
    """Launch (opting in to > 48 KiB of dynamic shared memory when asked for it)."""
    launch(kern, grid, block, smem_bytes, args)
