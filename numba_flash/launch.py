"""Kernel launch: dynamic shared memory above 48 KiB, and a fast path for repeat launches.

CUDA only lets a kernel use more than 48 KiB of dynamic shared memory after it opts
in through ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``; Numba never does
this itself, so we do it once per compiled kernel and device.

Numba's ``kern[grid, block, stream, smem](*args)`` types every argument on every call
(building a Numba type per array) before it looks the compiled kernel up; that is tens of
microseconds per launch, as much as a small kernel runs. So the first launch of a kernel
with given argument *types* goes through Numba (which compiles it, or loads it from the
cache), and records the compiled function; later launches with arguments of the same
types (dtype, ndim and layout, computed exactly as Numba computes them: ``_arrays.layout``) pass the
same flattened parameters Numba would straight to ``cuLaunchKernel``.

Kernels built from registry specialisations are also kept on disk
(``numba_flash._kernel_cache``): the first launch with given argument types in a new
process looks for the cubin a previous process compiled, and where it finds one the
kernel goes straight to the fast path, with no Numba compile.
"""
import ctypes
import sys
import warnings

import numpy as np
from numba import cuda

from . import _arrays, _kernel_cache
from ._runtime import SIMULATOR

if not SIMULATOR:
    from numba.cuda.core.errors import NumbaPerformanceWarning as _PerformanceWarning

DEFAULT_SMEM_LIMIT = 48 * 1024
# The simulator runs one Python thread per CUDA thread, and its scheduler busy-polls
# them; a short GIL switch interval makes kernels with barriers and shuffles run ~5x
# faster there (measured: 6.0 s -> 0.9 s on a 32-thread, 8-block launch).
SIM_SWITCH_INTERVAL_S = 2e-4
_opted_in = {}
# (dispatcher, context, argument types) -> [CUfunction, ctypes type per parameter, the most
# dynamic shared memory it has been launched with (so opted in to), whether the function
# came from the on-disk cache (then launch opts it in itself: Numba never compiled it)]
_fast = {}

# How Numba passes a scalar argument (numba.cuda.dispatcher._Kernel._prepare_args).
# Numba types a Python int as int64 and a Python float as float64.
_SCALAR_CTYPES = {np.float32: ctypes.c_float, np.float64: ctypes.c_double, int: ctypes.c_int64,
                  float: ctypes.c_double}


_layout = _arrays.layout      # (per argument of every launch: the rule lives with the views)


class _TupleKey(tuple):
    """The key of a tuple argument: its items' keys (Numba passes a tuple's items as
    parameters of their own, in order)."""


def _arg_key(a):
    """What determines a parameter's Numba type, or None if the fast path does not handle it."""
    t = type(a)
    if t in _SCALAR_CTYPES:
        return t
    if getattr(a, "__cuda_ndarray__", False) and not isinstance(a, np.ndarray):
        shape, strides = a.shape, a.strides
        return (a.dtype, len(shape), _layout(shape, strides, a.dtype.itemsize))
    if t is tuple:
        keys = _TupleKey(_arg_key(x) for x in a)
        return None if None in keys else keys
    return None


def context_handle():
    """The current CUDA context's handle (an int), or None."""
    from cuda.bindings import driver as cu
    err, ctx = cu.cuCtxGetCurrent()
    return int(ctx) if err == cu.CUresult.CUDA_SUCCESS else None


def _param_ctypes(argkey):
    """The ctypes of the flattened kernel parameters for an argument-types key."""
    ptypes = []
    for k in argkey:
        if isinstance(k, _TupleKey):
            ptypes += _param_ctypes(k)
        elif isinstance(k, tuple):   # meminfo, parent, nitems, itemsize, data, shape, strides
            ptypes += [ctypes.c_int64] * (5 + 2 * k[1])
        else:
            ptypes.append(_SCALAR_CTYPES[k])
    return tuple(ptypes)


def _record(kern, key, args, smem_bytes):
    """After a Numba launch: remember the compiled function for ``key`` (and keep its cubin
    on disk, where the kernel has a cache identity)."""
    from cuda.bindings import driver as cu
    argtypes = tuple(kern.typeof_pyval(a) for a in args)
    compiled = kern.overloads.get(argtypes)
    if compiled is None:
        return
    handle = compiled._codelibrary.get_cufunc().handle
    if isinstance(handle, cu.CUkernel):
        err, handle = cu.cuKernelGetFunction(handle)
        if err != cu.CUresult.CUDA_SUCCESS:
            return
    ptypes = _param_ctypes(key[2])
    _fast[key] = [handle, ptypes, max(smem_bytes, DEFAULT_SMEM_LIMIT), False]
    _kernel_cache.store(kern, key[2], compiled, ptypes)


def _from_cache(kern, key, smem_bytes):
    """The fast-path entry of ``kern`` for ``key`` from the on-disk cache (recorded), opted
    in to ``smem_bytes`` of dynamic shared memory; None where the cache has none."""
    if not key[1]:                   # no current context to load into
        return None
    ptypes = _param_ctypes(key[2])
    handle = _kernel_cache.load(kern, key[2], ptypes)
    if handle is None:
        return None
    entry = [handle, ptypes, DEFAULT_SMEM_LIMIT, True]
    if smem_bytes > DEFAULT_SMEM_LIMIT:
        if not _opt_in_function(handle, smem_bytes):
            return None
        entry[2] = smem_bytes
    _fast[key] = entry
    return entry


def compiled(kern, args):
    """``(CUfunction, parameter ctypes, dynamic shared memory opted in to)`` of ``kern`` for
    the types of ``args`` in the current context, once :func:`launch` has launched it
    with such arguments (None before, or for arguments the fast path does not take).
    Launch plans (``numba_flash._plans``) build on it."""
    argkey = tuple(_arg_key(a) for a in args)
    if None in argkey:
        return None
    return _fast.get((kern, context_handle(), argkey))


def is_scalar(a):
    """Whether a kernel argument is a scalar (passed by value) rather than an array."""
    return type(a) in _SCALAR_CTYPES


def dims3(n):
    """A grid or block (an int or a tuple of up to 3) as (x, y, z)."""
    return (tuple(n) + (1, 1))[:3] if isinstance(n, tuple) else (n, 1, 1)


def array_params(a, ptr):
    """The kernel parameters of a device array, as Numba flattens them (meminfo, parent,
    nitems, itemsize, data, shape, strides), with ``ptr`` as its data pointer."""
    return [0, 0, a.size, a.dtype.itemsize, ptr, *a.shape, *a.strides]


def _flat_params(args, values):
    """Append the kernel parameters of ``args`` to ``values`` (tuples flattened)."""
    for a in args:
        if type(a) in _SCALAR_CTYPES:
            values.append(a)
        elif type(a) is tuple:
            _flat_params(a, values)
        else:
            values += array_params(a, a.device_ctypes_pointer.value or 0)
    return values


def _launch_fast(entry, grid, block, smem_bytes, args, stream):
    from cuda.bindings import driver as cu
    handle, ptypes = entry[0], entry[1]
    values = _flat_params(args, [])
    err, = cu.cuLaunchKernel(handle, *dims3(grid), *dims3(block), smem_bytes, _arrays.stream_handle(stream),
                             (tuple(values), ptypes), 0)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernel failed: {err!r}")


def _check_smem_limit(nbytes):
    """A ValueError if the GPU cannot give a block ``nbytes`` of shared memory."""
    limit = cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    if nbytes > limit:
        raise ValueError(f"this kernel needs {nbytes} bytes of shared memory per block; the GPU allows "
                         f"{limit}. This head dim / tiling is not supported on this GPU: use a smaller head "
                         "dim (for a ladder rung: an earlier rung, which keeps less in shared memory).")


def _opt_in_function(handle, nbytes):
    """Opt a CUfunction (a kernel loaded from the on-disk cache) in to ``nbytes`` of dynamic
    shared memory; False if the driver refuses."""
    from cuda.bindings import driver as cu
    _check_smem_limit(nbytes)
    err, = cu.cuFuncSetAttribute(handle, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                 nbytes)
    return err == cu.CUresult.CUDA_SUCCESS


def _allow_dynamic_smem(kern, nbytes):
    """Opt every compiled overload of ``kern`` in to ``nbytes`` of dynamic shared memory."""
    from cuda.bindings import driver as cu
    from numba.cuda.cudadrv.driver import driver

    _check_smem_limit(nbytes)
    for compiled in kern.overloads.values():
        func = compiled._codelibrary.get_cufunc()
        key = (id(compiled), func.device.id)
        if _opted_in.get(key, 0) < nbytes:
            driver.cuKernelSetAttribute(
                cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes, func.handle,
                func.device.id)
            _opted_in[key] = nbytes


def _launch_numba(kern, grid, block, smem_bytes, args, stream):
    """``kern[grid, block, stream, smem_bytes](*args)``, opting in to large shared memory when needed.

    The launch is tried first: once a kernel has opted in, this costs nothing extra.
    Launching with too much shared memory fails before anything runs, so the retry
    after opting in (which needs the compiled overload the failed launch produced) is safe.
    """
    with warnings.catch_warnings():
        # "Grid size N will likely result in GPU under-utilization": the package chooses its
        # grids (small problems have small grids, and key splits fill the GPU where they pay);
        # the warning would only tell users about numba_flash's internals.
        warnings.simplefilter("ignore", _PerformanceWarning)
        if smem_bytes <= DEFAULT_SMEM_LIMIT:
            kern[grid, block, stream, smem_bytes](*args)
            return
        try:
            kern[grid, block, stream, smem_bytes](*args)
        except Exception as e:   # numba's CudaAPIError or cuda.core's CUDAError, depending on the binding
            if "INVALID_VALUE" not in str(e):
                raise
            _allow_dynamic_smem(kern, smem_bytes)
            kern[grid, block, stream, smem_bytes](*args)


def launch(kern, grid, block, smem_bytes, args, stream=0):
    """``kern[grid, block, stream, smem_bytes](*args)``: through Numba the first time a
    kernel meets these argument types (compiling it, and opting in to > 48 KiB of shared
    memory) unless the on-disk cache has it, then straight to the driver. Arguments other
    than device arrays, float32 / float64 / int / float scalars and tuples of these
    always go through Numba."""
    if SIMULATOR:
        previous = sys.getswitchinterval()
        sys.setswitchinterval(SIM_SWITCH_INTERVAL_S)
        try:
            with warnings.catch_warnings():
                # inf/NaN inputs: every simulated thread's NumPy scalar arithmetic would warn at
                # each overflow or invalid operation (np.errstate cannot help: it is per thread).
                # The results are as on a GPU, and documented (api.attention_fwd).
                warnings.simplefilter("ignore", RuntimeWarning)
                kern[grid, block, stream, smem_bytes](*args)
        finally:
            sys.setswitchinterval(previous)
        return
    argkey = tuple(_arg_key(a) for a in args)
    if None in argkey:
        _launch_numba(kern, grid, block, smem_bytes, args, stream)
        return
    key = (kern, context_handle(), argkey)
    entry = _fast.get(key)
    if entry is None:
        entry = _from_cache(kern, key, smem_bytes)
        if entry is not None:
            try:
                _launch_fast(entry, grid, block, smem_bytes, args, stream)
                return
            except RuntimeError:       # the driver refuses the loaded kernel: drop the entry
                del _fast[key]
                _kernel_cache.forget(kern, argkey)
        _launch_numba(kern, grid, block, smem_bytes, args, stream)
        _record(kern, key, args, smem_bytes)
        return
    if smem_bytes > entry[2]:
        if not entry[3]:               # Numba's path opts in to the larger amount
            _launch_numba(kern, grid, block, smem_bytes, args, stream)
            entry[2] = smem_bytes
            return
        if not _opt_in_function(entry[0], smem_bytes):     # loaded from the cache: opt in here
            del _fast[key]
            _launch_numba(kern, grid, block, smem_bytes, args, stream)
            _record(kern, key, args, smem_bytes)
            return
        entry[2] = smem_bytes
    _launch_fast(entry, grid, block, smem_bytes, args, stream)
