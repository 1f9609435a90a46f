"""Array kinds: NumPy on the host, and device arrays from Numba, CuPy, PyTorch, JAX, ...

Kernels take 4-D views ``(B1, B2, N, d)`` with arbitrary strides (see
``api._kernel_views``), so device inputs are never copied.
"""
import functools
import math

import numpy as np
from numba import cuda

from ._runtime import SIMULATOR

if not SIMULATOR:
    from numba.cuda.cudadrv.devicearray import DeviceNDArray


def _is_torch(x):
    return type(x).__module__.split(".")[0] == "torch"


_TORCH_DTYPES = {}


def logical_dtype(x):
    """The element type as NumPy spells it (bfloat16 is ``ml_dtypes.bfloat16``), or, for a
    PyTorch dtype NumPy has no name for, the PyTorch name (a str)."""
    if _is_torch(x):
        found = _TORCH_DTYPES.get(x.dtype)
        if found is None:
            import ml_dtypes
            name = str(x.dtype).replace("torch.", "")
            try:
                found = np.dtype(getattr(ml_dtypes, name, name))
            except TypeError:
                found = name
            _TORCH_DTYPES[x.dtype] = found
        return found
    return np.dtype(x.dtype)


def is_device_array(x):
    """True for Numba device arrays and anything exporting ``__cuda_array_interface__``
    or a CUDA DLPack capsule (CuPy, PyTorch, JAX)."""
    if _is_torch(x):              # (a bfloat16 tensor's __cuda_array_interface__ raises TypeError)
        return bool(getattr(x, "is_cuda", False))
    if cuda.is_cuda_array(x) if hasattr(cuda, "is_cuda_array") else False:
        return True
    if getattr(x, "__cuda_ndarray__", False):       # Numba (and simulator) device arrays
        return True
    dev = getattr(x, "__dlpack_device__", None)
    if dev is not None and not isinstance(x, np.ndarray):
        try:
            return int(dev()[0]) in (2, 3, 13)       # kDLCUDA, kDLCUDAHost, kDLCUDAManaged
        except Exception:
            return False
    return False


LEGACY_DEFAULT_STREAMS = (0, 1)   # the null stream, and CU_STREAM_LEGACY as CAI v3 names it


def producer_stream(x):
    """The stream whose work produced a device array, or None for the default stream.

    CuPy names it in ``__cuda_array_interface__`` (version 3). PyTorch exports version 2,
    which names no stream, so for a tensor we take PyTorch's current stream on its
    device: the stream PyTorch itself would run the next operation on.
    """
    if getattr(x, "__cuda_ndarray__", False):
        return None
    if _is_torch(x):
        stream = torch_stream(x.device)
    else:
        cai = getattr(x, "__cuda_array_interface__", None)
        stream = None if cai is None else cai.get("stream")
    return None if stream in LEGACY_DEFAULT_STREAMS else stream


_RAW_STREAM = []    # PyTorch's raw current-stream query (device index -> handle), or None


def torch_stream(device):
    """The handle (an int) of PyTorch's current stream on the CUDA ``device``: through
    the C function that returns the handle alone, where this PyTorch has it
    (``current_stream()`` builds a Stream object first: microseconds a call)."""
    if not _RAW_STREAM:
        import torch
        _RAW_STREAM.append(getattr(torch._C, "_cuda_getCurrentRawStream", None))
    raw = _RAW_STREAM[0]
    if raw is not None:
        return raw(device.index)
    import torch
    return torch.cuda.current_stream(device).cuda_stream


def producer_streams(arrays):
    """The set of ``producer_stream`` of the arrays (PyTorch's asked once per device)."""
    streams, torch_devices = set(), set()
    for x in arrays:
        if _is_torch(x):
            if x.device in torch_devices:
                continue
            torch_devices.add(x.device)
        streams.add(producer_stream(x))
    return streams


def as_numba_device(x, dtype=None):
    """A Numba device array viewing the same device memory (no copy, no synchronisation:
    ``api`` orders the launch after the producer's stream instead), read as ``dtype`` (of
    the same size) if given: 16-bit floats go to the kernels as their uint16 bits."""
    if getattr(x, "__cuda_ndarray__", False):
        return x if dtype is None else retyped(x, dtype)
    if _is_torch(x) and not SIMULATOR and x.numel():
        view = _torch_view(x, dtype)
        if view is not None:
            return view
    if _is_torch(x) and str(x.dtype) == "torch.bfloat16":
        import torch
        x = x.view(torch.int16)   # PyTorch exports no bfloat16 array interface: pass the bits
    if hasattr(x, "__cuda_array_interface__"):
        desc = x.__cuda_array_interface__
    else:
        # DLPack-only producers: read pointer, shape and strides, then view through the CAI.
        # No stream is exchanged (stream_ptr=-1): their pending work must be finished first.
        from cuda.core.utils import StridedMemoryView
        view = StridedMemoryView.from_dlpack(x, stream_ptr=-1)   # strides in elements, or None
        itemsize = np.dtype(view.dtype).itemsize
        strides = None if view.strides is None else tuple(s * itemsize for s in view.strides)
        desc = {"shape": tuple(view.shape), "strides": strides, "typestr": np.dtype(view.dtype).str,
                "data": (int(view.ptr), False), "version": 3}
    if dtype is not None:
        desc = dict(desc, typestr=np.dtype(dtype).str)
    return cuda.from_cuda_array_interface(desc, owner=x, sync=False)


def _torch_view(x, dtype):
    """A Numba array over a CUDA tensor's memory, built from the tensor's own attributes
    (what ``from_cuda_array_interface`` does, without the interface dict: this runs on
    every call). None for dtypes NumPy has no name for."""
    from numba.cuda.cudadrv import devices, driver

    if dtype is None:
        dtype = logical_dtype(x)
        if not isinstance(dtype, np.dtype) or dtype.kind == "V":
            return None
    itemsize = x.element_size()
    shape = tuple(x.shape)
    strides = tuple(s * itemsize for s in x.stride())
    size = driver.memory_size_from_info(shape, strides, itemsize)
    mem = driver.MemoryPointer(devices.get_context(), driver.binding.CUdeviceptr(x.data_ptr()), size, owner=x)
    return DeviceNDArray(shape, strides, dtype, gpu_data=mem)


def device_pointer(ary):
    """Address of the first element (the simulator's is the host buffer's)."""
    if SIMULATOR:
        return ary._ary.ctypes.data
    return ary.device_ctypes_pointer.value or 0


def rows_aligned16(ary):
    """Every row starts on a 16-byte boundary and rows are contiguous (cp.async can copy them)."""
    isz = ary.dtype.itemsize
    shape, strides = tuple(ary.shape), tuple(ary.strides)
    if shape[-1] > 1 and strides[-1] != isz:
        return False
    if any(n > 1 and s % 16 for n, s in zip(shape[:-1], strides[:-1])):
        return False
    return device_pointer(ary) % 16 == 0


def strided_view(ary, shape, strides):
    """View of a device array with a new shape and byte strides (same memory)."""
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return FakeCUDAArray(np.lib.stride_tricks.as_strided(ary._ary, shape, strides))
    return DeviceNDArray(tuple(shape), tuple(strides), ary.dtype, gpu_data=ary.gpu_data)


class _Interface:
    """A host array's memory under another shape, strides and type (``np.asarray`` of it),
    keeping the array alive."""

    def __init__(self, owner, shape, strides, typestr):
        self.owner = owner
        self.__array_interface__ = {"shape": shape, "strides": strides, "typestr": typestr, "version": 3,
                                    "data": (owner.ctypes.data, False)}


def rows_first(ary):
    """A ``(B1, B2, N, ...)`` device view as ``(B1, N, B2, ...)`` (axes 1 and 2 swapped,
    the same memory), or None unless that is C-contiguous: packed sequences' ``(tokens,
    heads, ...)`` arrays, which the kernels see heads first. Axes of one index get their
    C-contiguous strides, so that Numba types the view as layout C (the kernels' stores
    then fold their column offsets: a zero stride, which the heads-first views give such
    an axis, makes it layout A and every store's address a product of run-time strides)."""
    shape, strides = list(ary.shape), list(ary.strides)
    shape[1], shape[2], strides[1], strides[2] = shape[2], shape[1], strides[2], strides[1]
    c_strides = _c_strides(shape, ary.dtype.itemsize)
    if any(n > 1 and s != c for n, s, c in zip(shape, strides, c_strides)):
        return None
    return strided_view(ary, shape, c_strides)


def packed_view(ary):
    """The uint64 view of a uint16 device array whose last axis is contiguous, of a
    multiple of 4 long, and whose other strides and start are multiples of 8 bytes: element
    ``[..., i]`` holds elements ``4 i`` (lowest bits) to ``4 i + 3``. None where those do
    not hold."""
    shape, strides = tuple(ary.shape), tuple(ary.strides)
    if (shape[-1] % 4 or strides[-1] != 2 and shape[-1] > 1 or any(s % 8 for s in strides[:-1])
            or device_pointer(ary) % 8):
        return None
    shape, strides = shape[:-1] + (shape[-1] // 4,), strides[:-1] + (8,)
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return FakeCUDAArray(np.asarray(_Interface(ary._ary, shape, strides, "<u8")))
    return DeviceNDArray(shape, strides, np.dtype(np.uint64), gpu_data=ary.gpu_data)


def sub_array(ary, index):
    """``ary[index]`` for a tuple of leading integer indices, as a view with the remaining
    shape and strides. (Numba's device-array indexing collapses a stride-0 axis it does not
    index to size 1, and changes a stride-0 axis's stride: broadcast views, like the
    repeated K/V heads of grouped-query attention, need this instead.)"""
    shape, strides = tuple(ary.shape), tuple(ary.strides)
    n = len(index)
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return FakeCUDAArray(ary._ary[tuple(index)])
    offset = sum(i * s for i, s in zip(index, strides))
    return DeviceNDArray(shape[n:], strides[n:], ary.dtype, gpu_data=ary.gpu_data.view(offset))


def retyped(ary, dtype):
    """The same device memory, shape and strides, read as another dtype of the same size
    (float16/bfloat16 <-> their uint16 bits)."""
    dtype = np.dtype(dtype)
    assert dtype.itemsize == ary.dtype.itemsize
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return FakeCUDAArray(ary._ary.view(dtype))
    return DeviceNDArray(tuple(ary.shape), tuple(ary.strides), dtype, gpu_data=ary.gpu_data)


def to_device(x, stream=0):
    """to_device(x, stream=0) -> a Numba device array with x's shape, dtype and values

    ``numba.cuda.to_device`` that also takes ``ml_dtypes.bfloat16`` arrays (Numba's host
    copies cannot read that dtype's buffer: the bits are copied as uint16 and viewed back).

    Args:
        x: anything ``np.asarray`` accepts (a NumPy array, a list, ...).
        stream: the CUDA stream to copy on (a Numba stream; 0, the default, is the
            default stream).

    Returns:
        a device array; ``.copy_to_host()`` gives x back (bfloat16 included), and it can
        be passed straight to :func:`numba_flash.attention` and friends.
    """
    x = np.asarray(x)
    if x.dtype.kind == "V" and x.dtype.itemsize == 2:       # bfloat16 and other 2-byte ml_dtypes
        return retyped(cuda.to_device(np.ascontiguousarray(x).view(np.uint16), stream=stream), x.dtype)
    return cuda.to_device(x, stream=stream)


def device_empty(shape, dtype, fill=None, storage=None, stream=0):
    """A new C-contiguous device array, optionally filled from the host (tests use NaN).

    ``storage``: allocate as this same-size dtype instead (the fill is converted in
    ``dtype``). On a GPU the memory comes from this package's stream-ordered pool
    (``_pool_array``), allocated on ``stream``.
    """
    dtype = np.dtype(dtype)
    alloc = np.dtype(storage or dtype)
    ary = None if SIMULATOR else _pool_array(tuple(shape), alloc, stream)
    if ary is None:
        ary = cuda.device_array(shape, dtype=alloc)
    if fill is not None:
        _fill(ary, fill, dtype, 0 if SIMULATOR else stream)
    return ary


# ----------------------------------------------------------------- stream-ordered pool
# Outputs are allocated with cuMemAllocFromPoolAsync from a memory pool this package
# creates per device, and returned by cuMemFreeAsync on the same stream when their
# Numba array is garbage-collected: no cudaMalloc / cudaFree (which synchronises the
# device) per call. Like PyTorch's caching allocator, the pool keeps freed memory for
# reuse; numba_flash.release_cached_memory() hands it back to the driver.
_pools = {}


def stream_handle(stream):
    """The raw CUstream of 0, an int, or a Numba stream."""
    return int(stream.handle) if hasattr(stream, "handle") else int(stream or 0)


def pool_for(device_id):
    """This package's memory pool on a device (created on first use), or False where the
    driver offers no pools."""
    from cuda.bindings import driver as cu
    pool = _pools.get(device_id)
    if pool is None:
        props = cu.CUmemPoolProps()
        props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.handleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = device_id
        err, pool = cu.cuMemPoolCreate(props)
        if err != cu.CUresult.CUDA_SUCCESS:
            _pools[device_id] = False          # no pools on this device/driver: Numba allocates
            return False
        keep = cu.cuuint64_t(2**64 - 1)
        cu.cuMemPoolSetAttribute(pool, cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, keep)
        _pools[device_id] = pool
    return pool


def _free_async(ptr, stream):
    try:
        from cuda.bindings import driver as cu
        cu.cuMemFreeAsync(ptr, stream)
    except Exception:   # interpreter shutdown, or the stream is gone: nothing safe left to do
        pass


def nbytes(ary):
    return ary.dtype.itemsize * math.prod(ary.shape)


def _pool_array(shape, dtype, stream):
    """A C-contiguous Numba device array from the pool, or None (empty, or no pool)."""
    from numba.cuda.cudadrv import devices
    ctx = devices.get_context()
    pool = pool_for(ctx.device.id)
    if pool is False:
        return None
    return pool_empty(ctx, pool, shape, dtype, stream_handle(stream))


def pool_empty(ctx, pool, shape, dtype, handle, fill_dtype=None, fill=None):
    """A C-contiguous Numba device array of ``dtype`` from ``pool``, allocated on the
    stream ``handle`` (an int) and freed on it when garbage-collected; None if empty or
    out of pool memory. ``fill``: a value to fill it with (in ``fill_dtype``, of the same
    size: 16-bit floats are allocated as their uint16 bits)."""
    size = dtype.itemsize * math.prod(shape)
    if size == 0:
        return None
    found = pool_alloc(pool, [size], handle)
    if found is None:
        return None                            # out of memory in the pool: let Numba try (and report)
    ary = pool_wrap(ctx, found[0], shape, dtype, handle)
    if fill is not None:
        _fill(ary, fill, fill_dtype or dtype, handle)
    return ary


def pool_alloc(pool, sizes, handle):
    """Memory from ``pool`` of each byte size in ``sizes`` (none 0), allocated on the
    stream ``handle``: a list of driver pointers, or None where the pool cannot serve them
    all (those it served are freed again)."""
    from cuda.bindings import driver as cu
    ptrs = []
    for size in sizes:
        err, ptr = cu.cuMemAllocFromPoolAsync(size, pool, handle)
        if err != cu.CUresult.CUDA_SUCCESS:
            pool_free(ptrs, handle)
            return None
        ptrs.append(ptr)
    return ptrs


def pool_free(ptrs, handle):
    """Return :func:`pool_alloc`'s memory ``ptrs`` to its pool, ordered on the stream
    ``handle`` (after whatever is queued there)."""
    from cuda.bindings import driver as cu
    for p in ptrs:
        cu.cuMemFreeAsync(p, handle)


def pool_wrap(ctx, ptr, shape, dtype, handle):
    """A C-contiguous Numba device array of ``dtype`` over the pool memory ``ptr``
    (:func:`pool_alloc`'s), which it frees on the stream ``handle`` when garbage-collected."""
    from numba.cuda.cudadrv.driver import MemoryPointer
    size = dtype.itemsize * math.prod(shape)
    mem = MemoryPointer(ctx, ptr, size, finalizer=functools.partial(_free_async, int(ptr), handle))
    return DeviceNDArray(shape, _c_strides(shape, dtype.itemsize), dtype, gpu_data=mem)


def _fill(ary, value, dtype, stream):
    if stream_handle(stream):
        cuda.external_stream(stream_handle(stream)).synchronize()   # the allocation is ordered on it
    host = np.full(ary.shape, value, dtype=dtype)
    ary.copy_to_device(host.view(ary.dtype))


def layout(shape, strides, itemsize):
    """Numba's array layout letter for a device array: 'C', 'F' or 'A' (the rule of
    ``DeviceNDArray._numba_type_`` over ``dummyarray``'s contiguity flags)."""
    size = 1
    for n in shape:
        size *= n
    if size == 0:
        return "C"
    if 0 in strides:
        return "A"                      # broadcast
    expected = itemsize
    c = True
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1:
            if s != expected:
                c = False
                break
            expected *= n
    if c:
        return "C"
    expected = itemsize
    for n, s in zip(shape, strides):
        if n != 1:
            if s != expected:
                return "A"
            expected *= n
    return "F"


def unit_axis_stride(shape, strides, itemsize, span):
    """The stride for an axis of one index added in front of a view ``shape, strides``:
    any stride addresses its index 0, but Numba types an array with a zero stride as
    layout A, and one whose other axes are C-contiguous as layout C. So ``span`` (non-zero)
    where the view is C-contiguous (it is then typed C, as the same view with more leading
    indices), else 0 (typed A, as a view that is not contiguous in any case, rather than F
    or C by the accident of its sizes)."""
    return span if layout(shape, strides, itemsize) == "C" else 0


def never_f(ary):
    """``ary``, or where Numba would type it as layout F only because of the sizes of a
    strided view (axes of one index let its other strides pass as F-contiguous: one
    sequence of one head of a packed call), the same view typed A (an axis of one index
    given stride 0), as the same view with more indices is. No kernel takes layout F."""
    shape, strides = tuple(ary.shape), tuple(ary.strides)
    if 1 not in shape or layout(shape, strides, ary.dtype.itemsize) != "F":
        return ary
    unit = shape.index(1)
    return strided_view(ary, shape, strides[:unit] + (0,) + strides[unit + 1:])


def _c_strides(shape, itemsize):
    strides, s = [], itemsize
    for n in reversed(shape):
        strides.append(s)
        s *= n
    return tuple(reversed(strides))


def pool_usage():
    """(bytes in use now, peak bytes in use since the last reset, bytes reserved) of the current
    device's pool; the peak is reset. (0, 0, 0) in the simulator or without a pool."""
    if SIMULATOR:
        return 0, 0, 0
    from cuda.bindings import driver as cu
    from numba.cuda.cudadrv import devices
    pool = _pools.get(devices.get_context().device.id)
    if not pool:
        return 0, 0, 0
    a = cu.CUmemPool_attribute
    get = lambda attr: int(cu.cuMemPoolGetAttribute(pool, attr)[1])   # noqa: E731
    used, high, reserved = (get(x) for x in (a.CU_MEMPOOL_ATTR_USED_MEM_CURRENT, a.CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                                             a.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT))
    cu.cuMemPoolSetAttribute(pool, a.CU_MEMPOOL_ATTR_USED_MEM_HIGH, cu.cuuint64_t(0))
    return used, high, reserved


def release_cached_memory():
    """release_cached_memory() -> None

    Hand the device memory numba_flash keeps for reuse (its pools' free blocks) back to
    the driver, like PyTorch's ``torch.cuda.empty_cache()``: outputs of numba_flash calls
    return their memory to a stream-ordered pool when garbage-collected, and the pool
    keeps it for the next call. Outputs still alive are not affected. Synchronises the
    device first. Does nothing in the simulator (no pool there)."""
    if SIMULATOR:
        return
    from cuda.bindings import driver as cu
    cuda.synchronize()
    for pool in _pools.values():
        if pool:
            cu.cuMemPoolTrimTo(pool, 0)


# ----------------------------------------------------------------- results of the input's kind
def host_view(x):
    """A PyTorch CPU tensor as a NumPy array over its memory (bfloat16 as
    ``ml_dtypes.bfloat16``, no copy); anything else unchanged."""
    if _is_torch(x) and x.device.type == "cpu":
        import torch
        t = x.detach()
        if t.dtype == torch.bfloat16:
            import ml_dtypes
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return x


def like(x, outs):
    """``outs`` (NumPy arrays, or Numba device arrays on a GPU) as arrays of ``x``'s kind:
    PyTorch tensors on ``x``'s device (no copy: the tensor keeps the Numba array, and so
    its pool block, alive), CuPy arrays (the same), or unchanged (NumPy, Numba and other
    device arrays), and JAX arrays for JAX inputs on a GPU, through DLPack from a PyTorch
    tensor or CuPy array over the same memory (one of the two must be installed; the
    device is synchronised first, as JAX orders nothing after numba_flash's stream)."""
    if _is_torch(x):
        return tuple(o if _is_torch(o) else _as_torch(o, x.device) for o in outs)
    module = type(x).__module__.split(".")[0]
    if module == "cupy" and not SIMULATOR:
        import cupy
        return tuple(cupy.asarray(o) for o in outs)
    if module in ("jax", "jaxlib") and not SIMULATOR and outs and not isinstance(outs[0], np.ndarray):
        return _as_jax(outs)
    return tuple(outs)


def _as_jax(outs):
    import importlib.util
    import jax.dlpack
    cuda.synchronize()
    if importlib.util.find_spec("torch") is not None:
        return tuple(jax.dlpack.from_dlpack(_as_torch(o, "cuda")) for o in outs)
    import cupy
    return tuple(jax.dlpack.from_dlpack(cupy.asarray(o)) for o in outs)


def _as_torch(o, device):
    import torch
    bf16 = np.dtype(o.dtype).kind == "V"        # ml_dtypes.bfloat16: PyTorch reads its bits as int16
    if isinstance(o, np.ndarray):
        return torch.from_numpy(o.view(np.int16)).view(torch.bfloat16) if bf16 else torch.from_numpy(o)
    if bf16:
        return torch.as_tensor(retyped(o, np.int16), device=device).view(torch.bfloat16)
    return torch.as_tensor(o, device=device)
