"""Public entry points: input checking, array-kind handling and kernel dispatch."""
import math
import numbers

import numpy as np

from . import _arrays, registry
from .kernels.forward import LOG2E
from .launch import launch

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_LOW_PRECISION = ("float16", "bfloat16")
MAX_GRID_X = 2**31 - 1
MAX_GRID_Y = 65535
MAX_LEN = 2**31 - 1

# Test hook: fill freshly allocated outputs with this value before a launch (NaN in the
# test-suite), so that any element a kernel fails to write shows up as an error.
_POISON = None


# --------------------------------------------------------------------------- inputs
class _Inputs:
    """Validated q, k, v: array kind, dtype, shapes, and device views."""

    def __init__(self, names, arrays, causal, scale):
        if not isinstance(causal, (bool, np.bool_)):
            raise TypeError(f"causal must be True or False, got {causal!r} ({type(causal).__name__}).")
        self.causal = bool(causal)
        kinds = [_kind(a, n) for a, n in zip(arrays, names)]
        if len(set(kinds)) > 1:
            desc = ", ".join(f"{n} is a {k} array" for n, k in zip(names, kinds))
            raise TypeError(f"q, k and v must all be NumPy arrays or all be CUDA device arrays; {desc}. "
                            "Move them to the same side first (e.g. numba.cuda.to_device or .copy_to_host()).")
        self.on_device = kinds[0] == "device"
        self.stream = 0
        if self.on_device:
            self.stream = _launch_stream(arrays)
            arrays = [_arrays.as_numba_device(a) for a in arrays]
        self.arrays = arrays
        dtypes = [np.dtype(a.dtype) for a in arrays]
        for a, n, dt in zip(arrays, names, dtypes):
            _check_dtype(dt, n)
        if len(set(dtypes)) > 1:
            desc = ", ".join(f"{n}.dtype={dt}" for n, dt in zip(names, dtypes))
            raise TypeError(f"q, k and v must have the same dtype, got {desc}. Cast them to one dtype "
                            "(float32 or float64) first.")
        self.dtype = dtypes[0]
        # tuple(): the simulator's device-array shapes do not support negative indices
        q, k, v = (tuple(a.shape) for a in arrays[:3])
        for shape, n in zip((q, k, v), names):
            if len(shape) < 2:
                raise ValueError(f"{n} must have at least 2 dims (..., N, d), got shape {shape}.")
        if not (len(q) == len(k) == len(v) and q[:-2] == k[:-2] == v[:-2]):
            raise ValueError(f"q, k and v must have identical leading dims, got q {q}, k {k}, v {v}. "
                             "Broadcast or reshape them first.")
        self.lead = q[:-2]
        self.nq, self.d = q[-2], q[-1]
        self.nk = k[-2]
        if k[-1] != self.d or v[-1] != self.d:
            raise ValueError(f"q, k and v must share the head dim d (last axis), got q {q}, k {k}, v {v}.")
        if v[-2] != self.nk:
            raise ValueError(f"k and v must have the same length Nk (axis -2), got k {k} and v {v}.")
        if self.d < 1:
            raise ValueError(f"the head dim d must be at least 1, got q {q}.")
        if self.nq > MAX_LEN or self.nk > MAX_LEN:
            raise ValueError(f"sequence lengths must be below 2**31, got Nq={self.nq}, Nk={self.nk}.")
        self.scale = _check_scale(scale, self.d)
        self.batch = int(np.prod(self.lead, dtype=np.int64))

    @property
    def empty(self):
        return self.batch == 0 or self.nq == 0


def _launch_stream(arrays):
    """Launch on the producer's stream when all inputs name the same one (CuPy, PyTorch);
    otherwise wait for each named stream and launch on the default stream."""
    from numba import cuda
    streams = {_arrays.producer_stream(a) for a in arrays}
    streams.discard(None)
    if not streams:
        return 0
    if len(streams) == 1:
        return cuda.external_stream(streams.pop())
    for handle in streams:
        cuda.external_stream(handle).synchronize()
    return 0


def _kind(x, name):
    if isinstance(x, np.ndarray):
        return "NumPy"
    if _arrays.is_device_array(x):
        return "device"
    raise TypeError(f"{name} must be a NumPy array or a CUDA device array (Numba, CuPy, PyTorch, JAX), "
                    f"got {type(x).__name__}. Wrap lists with np.asarray.")


def _check_dtype(dt, name):
    if dt in SUPPORTED_DTYPES:
        return
    if dt.name in _LOW_PRECISION:
        raise TypeError(f"{name} has dtype {dt.name}, which is not supported yet: float16 and bfloat16 "
                        "need the tensor-core kernels. Use float32 (e.g. q.astype(np.float32)) for now.")
    raise TypeError(f"{name} has dtype {dt}; expected float32 or float64.")


def _check_scale(scale, d):
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None (meaning 1/sqrt(d)), got {scale!r}.")
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and positive, got {scale}. Use None for 1/sqrt(d).")
    return scale


# --------------------------------------------------------------------------- views
def _kernel_views(arrays):
    """4-D ``(B1, B2, N, d)`` views of arrays that share their leading dims, per launch.

    The leading dims are folded into at most two strided dims, merging a dim into its
    outer neighbour only where that is valid for *every* array, so that block ``b``
    reads the same leading index in each. Returns a list of per-launch tuples of views;
    only layouts that fold into three or more groups need more than one launch (one
    per index of the outermost leading dim).
    """
    shapes = [tuple(a.shape) for a in arrays]
    strides = [tuple(a.strides) for a in arrays]
    lead = shapes[0][:-2]
    groups = []   # [(size, [stride per array])], outermost first
    for i, n in enumerate(lead):
        if n == 1:
            continue
        st = [s[i] for s in strides]
        if groups and all(prev == n * x for prev, x in zip(groups[-1][1], st)):
            groups[-1] = (groups[-1][0] * n, st)
        else:
            groups.append((n, st))
    if len(groups) <= 2:
        groups = [(1, [0] * len(arrays))] * (2 - len(groups)) + groups
        return [tuple(
            _arrays.strided_view(a, (groups[0][0], groups[1][0]) + shapes[j][-2:],
                                 (groups[0][1][j], groups[1][1][j]) + strides[j][-2:])
            for j, a in enumerate(arrays))]
    first = next(i for i, n in enumerate(lead) if n != 1)
    index = (0,) * first
    launches = []
    for i in range(lead[first]):
        launches += _kernel_views([a[index + (i,)] for a in arrays])
    return launches


def _to_device(inp, x):
    if inp.on_device:
        return x
    from numba import cuda
    return cuda.to_device(np.ascontiguousarray(x))


# --------------------------------------------------------------------------- forward
def _forward(q, k, v, causal, scale):
    inp = _Inputs(("q", "k", "v"), (q, k, v), causal, scale)
    out_shape = inp.lead + (inp.nq, inp.d)
    if inp.empty:
        out = np.empty(out_shape, inp.dtype)
        lse = np.empty(inp.lead + (inp.nq,), inp.dtype)
        if inp.on_device:
            return _arrays.device_empty(out_shape, inp.dtype), _arrays.device_empty(lse.shape, inp.dtype)
        return out, lse
    qd, kd, vd = (_to_device(inp, a) for a in inp.arrays)
    spec = registry.forward_specialisation(inp.dtype.name, inp.d, inp.causal,
                                           all(_arrays.rows_aligned16(a) for a in (qd, kd, vd)))
    t = spec.tiling
    kern = spec.kernel()
    out = _arrays.device_empty(out_shape, inp.dtype, _POISON)
    lse4 = _arrays.device_empty(inp.lead + (inp.nq, 1), inp.dtype, _POISON)  # folds like out
    lse = _arrays.strided_view(lse4, lse4.shape[:-1], lse4.strides[:-1])
    scale_log2 = inp.dtype.type(inp.scale * LOG2E)
    for q4, k4, v4, o4, l4 in _kernel_views([qd, kd, vd, out, lse4]):
        b = q4.shape[0] * q4.shape[1]
        grid = (-(-inp.nq // t.BM) * b, -(-inp.d // t.DO))
        if grid[0] > MAX_GRID_X or grid[1] > MAX_GRID_Y:
            raise ValueError(f"problem too large for one launch: {b} leading indices × Nq={inp.nq} "
                             f"needs {grid[0]} blocks (limit {MAX_GRID_X}). Split the batch.")
        l3 = _arrays.strided_view(l4, l4.shape[:3], l4.strides[:3])
        launch(kern, grid, t.threads, spec.smem_bytes, (q4, k4, v4, o4, l3, scale_log2), inp.stream)
    if inp.on_device:
        return out, lse
    return out.copy_to_host(), lse.copy_to_host()


def attention_fwd(q, k, v, *, causal=False, scale=None):
    """Exact attention forward; returns ``(out, lse)``.

    Equivalent to :func:`numba_flash.reference.attention_fwd` (float64 oracle), fused:
    no ``Nq × Nk`` matrix is ever stored.

    Args:
        q: ``(..., Nq, d)``; k, v: ``(..., Nk, d)``, identical leading dims (any number,
            including none). float32 or float64, all the same dtype. NumPy arrays, or CUDA
            device arrays (Numba, CuPy, PyTorch, JAX: anything with
            ``__cuda_array_interface__`` or CUDA DLPack). Any strides: NumPy inputs are
            copied to the device contiguously; device inputs are read in place through
            their strides (no copy).
        causal: mask future keys, aligned to the bottom-right corner when ``Nq != Nk``
            (as FlashAttention >= 2.1 and KV-cache decoding do): query ``i`` sees key
            ``j`` iff ``j <= i + Nk - Nq``. ``x`` = visible::

                Nq = 2, Nk = 5            Nq = 5, Nk = 2
                  x x x x .                 . .     <- no visible key: out = 0,
                  x x x x x                 . .        lse = -inf
                                            . .
                                            x .
                                            x x

            PyTorch SDPA's ``is_causal`` is top-left aligned (``j <= i``): the two
            agree only when ``Nq == Nk``.
        scale: softmax scale applied to ``q kᵀ``; ``None`` means ``1/sqrt(d)``. Must be
            finite and positive.

    Returns:
        ``out (..., Nq, d)`` in the input dtype, and ``lse (..., Nq)``, the natural-log
        log-sum-exp of the scaled visible scores per query row (float32 for float32
        inputs, float64 for float64). NumPy in gives NumPy out; device in gives Numba
        device arrays out, without a host round trip.

    Streams: device inputs from CuPy or PyTorch name their producer's current stream in
    ``__cuda_array_interface__``; the kernel is launched on that stream, so it runs after
    the work that produced the inputs and the results are ready for work queued on the
    same stream afterwards, with no host synchronisation. (If q, k and v name different
    streams, each is synchronised and the default stream is used.) Numba device arrays
    name no stream: the kernel runs on the default stream. The output is allocated with
    ``numba.cuda.device_array``.
    """
    return _forward(q, k, v, causal, scale)


def attention(q, k, v, *, causal=False, scale=None):
    """Exact attention ``softmax(scale · q kᵀ [+ causal mask]) v``; see :func:`attention_fwd`."""
    return _forward(q, k, v, causal, scale)[0]
