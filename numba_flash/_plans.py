"""Repeat calls through cached launch plans.

Most of a call's host time goes into deciding what to launch: checking the inputs,
choosing the kernel and its tiling, folding leading dims into strided views, and Numba
typing each argument. For one *signature* of the inputs (array kind, dtype, shape,
strides and 16-byte alignment of each, the other arguments, the stream and the CUDA
context) all of that comes out the same every time. So the first call with a signature
takes the full path (``api.plan_forward`` / ``plan_backward``), and leaves a
:class:`Plan` behind: per launch the compiled function, grid, block, shared memory and
a parameter buffer in which the data pointers are slots. A later call with the same
signature reads its inputs' data pointers, allocates its outputs (and scratch) from the
pool, writes the pointers into the slots and calls ``cuLaunchKernel``.

Only device inputs of the common kinds take this path (Numba device arrays, PyTorch
tensors, CuPy arrays, mixed if the streams they name agree); NumPy inputs, the simulator,
and every call that fails or that the full path cannot describe as slots, always take
the full path.
"""
import ctypes
import math
import threading

import numpy as np

from . import _arrays, launch as _launch
from ._runtime import SIMULATOR

MAX_PLANS = 256         # signatures remembered; the table starts afresh when it is full
_PLANS = {}


# --------------------------------------------------------------------------- signatures
# Per array kind: (key items, data pointer, the stream it names or None); ``streams``: the
# streams already asked for in this call, per device (PyTorch's lookup costs microseconds).
def _numba_sig(x, streams):
    return (x.dtype, x.shape, x.strides), int(x.gpu_data.device_pointer) if x.size else 0, None


def _torch_sig(x, streams):
    if not x.is_cuda:
        return None
    device = x.device
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = _arrays.torch_stream(device)
    return (x.dtype, x.shape, x.stride(), device), x.data_ptr(), stream


def _cupy_sig(x, streams):
    return (x.dtype, x.shape, x.strides, x.device.id), x.data.ptr, x.__cuda_array_interface__.get("stream")


def _stream(handle):
    return 0 if handle in _arrays.LEGACY_DEFAULT_STREAMS or handle is None else handle


_KINDS = {}     # type -> signature function (None: no fast path for that type)


def _kind_of(t):
    found = _KINDS.get(t, False)
    if found is False:
        name = f"{t.__module__}.{t.__qualname__}"
        found = {"numba.cuda.cudadrv.devicearray.DeviceNDArray": _numba_sig,
                 "numba_cuda.numba.cuda.cudadrv.devicearray.DeviceNDArray": _numba_sig,
                 "torch.Tensor": _torch_sig, "torch.nn.parameter.Parameter": _torch_sig,
                 "cupy.ndarray": _cupy_sig, "cupy._core.core.ndarray": _cupy_sig}.get(name)
        _KINDS[t] = found
    return found


def array_kind(x):
    """Whether ``x`` is a device array of a kind plans take (its signature function), or None."""
    return _kind_of(type(x))


class Signature:
    """What identifies a call for :func:`lookup` / :func:`remember`, and the per-call
    facts a plan needs: the inputs' data pointers, the stream and the context handle."""
    __slots__ = ("key", "pointers", "stream", "context")

    def __init__(self, key, pointers, stream, context):
        self.key, self.pointers, self.stream, self.context = key, pointers, stream, context


def signature(name, arrays, options):
    """The :class:`Signature` of a call to ``name`` with device ``arrays`` and hashable
    ``options``, or None where the fast path does not apply. The arrays may be of
    different kinds (PyTorch inputs with the Numba arrays a forward call returned, say);
    the streams they name (PyTorch: the current stream; CuPy: its array interface's;
    Numba: none) must agree, as the full path then launches on that one stream."""
    if SIMULATOR:
        return None
    key, ptrs, asked, named, aligned = [name], [], {}, None, 0
    for x in arrays:
        t = type(x)
        sig = _kind_of(t)
        found = sig(x, asked) if sig is not None else None
        if found is None:
            return None
        items, ptr, stream = found
        key.append((t, items))
        ptrs.append(ptr)
        aligned = aligned << 1 | (ptr & 15 == 0)
        if stream is not None:
            if named is not None and stream != named:
                return None
            named = stream
    stream, context = _stream(named), _launch.context_handle()
    # Options compare with their types: causal=1 must not find causal=True's plan.
    key += (tuple(map(type, options)), tuple(options), aligned, stream, context)
    return Signature(tuple(key), ptrs, stream, context)


def lookup(sig):
    return None if sig is None else _PLANS.get(sig.key)


def remember(sig, plan):
    if sig is None or plan is None:
        return
    if len(_PLANS) >= MAX_PLANS:
        from numba import cuda
        cuda.synchronize()      # the dropped plans' constants may still be read by queued kernels
        _PLANS.clear()
    _PLANS[sig.key] = plan


# --------------------------------------------------------------------------- plans
class _Launch:
    """One kernel launch with its parameters in a persistent buffer (8 bytes a
    parameter, as ``cuLaunchKernel`` reads them through an array of pointers); the
    data pointers are (parameter index, root, byte offset, map) slots: ``map`` None for
    a pointer into the root's memory, else ``(shape, strides, box rows)`` of a TMA tensor
    map over it (the Hopper family), made for each call's pointer (``families.tensor_map``,
    which keeps the maps it made)."""

    def __init__(self, handle, grid, block, smem, values, ptypes, slots):
        self.handle, self.smem, self.slots = handle, smem, slots
        self.grid, self.block = _launch.dims3(grid), _launch.dims3(block)
        self.buf = np.zeros(max(len(values), 1), np.int64)
        for i, (value, ctype) in enumerate(zip(values, ptypes)):
            if ctype is ctypes.c_float:
                self.buf[i:i + 1].view(np.float32)[0] = value
            elif ctype is ctypes.c_double:
                self.buf[i:i + 1].view(np.float64)[0] = value
            else:
                self.buf[i] = value
        self.pointers = np.array([self.buf.ctypes.data + 8 * i for i in range(len(self.buf))], np.uint64)
        self.address = self.pointers.ctypes.data


class Plan:
    """A call's launches with its data pointers as slots: roots are the call's inputs
    (by position), its uploads (host arrays the launches read on the device: the sequence
    tables of packed calls, in a device buffer the plan keeps, copied to where they differ
    from the last call's), its outputs (allocated per call) and one scratch block
    (allocated per call and freed, stream-ordered, after the last launch)."""

    def __init__(self, launches, outputs, scratch_bytes, finish, ctx, pool, n_uploads=0, keep=()):
        self.launches, self.outputs, self.scratch_bytes = launches, outputs, scratch_bytes
        self.out_bytes = [alloc.itemsize * math.prod(shape) for shape, alloc, _ in outputs]
        self.finish, self.ctx, self.pool, self.n_uploads = finish, ctx, pool, n_uploads
        self.keep = tuple(keep)         # the constants' memory, whose pointers the launches hold
        self.has_maps = any(tmap is not None for ln in launches for *_, tmap in ln.slots)
        self.device_id = ctx.device.id
        self.lock = threading.Lock()
        # (launch, parameter index) -> (pointer, map generation, map address, map) of the
        # last call: a call with the same pointer in that slot (the same tensor, a model's
        # next step) reuses the map while the table of maps has not started afresh
        self.maps = {}
        self.uploaded = None        # (device buffer, byte offsets, the last call's uploads' bytes)

    def run(self, sig, poison=None, uploads=(), like=None):
        """Launch for the call of ``sig``; ``uploads``: the call's host arrays (C-contiguous)
        in the order of the capture's uploads. None where the pool cannot serve it.
        ``like``: the array whose kind the results take; for a PyTorch tensor they are
        PyTorch tensors from its allocator (on the current stream, the plan's, in the
        logical dtype), not Numba arrays from the pool wrapped afterwards: a Numba device
        array and a PyTorch view of it cost tens of microseconds per output. Otherwise the
        outputs are pool memory, made Numba arrays once the kernels are queued (unless
        ``poison`` fills them first): the kernels start that much sooner."""
        from cuda.bindings import driver as cu
        assert len(uploads) == self.n_uploads, (len(uploads), self.n_uploads)
        stream = sig.stream
        offsets = _offsets(uploads)
        if uploads and self.uploaded is not None and offsets != self.uploaded[1]:
            return None                 # (a signature fixes the uploads' shapes)
        outs = _torch_outputs(self.outputs, like, poison, self.device_id) if like is not None else None
        torch_outs = outs is not None
        raw = None                      # the outputs' pool memory, not yet Numba arrays
        if torch_outs:
            out_ptrs = [o.data_ptr() for o in outs]
        elif poison is None:
            raw = _arrays.pool_alloc(self.pool, self.out_bytes, stream)
            if raw is None:
                return None
            out_ptrs = [int(p) for p in raw]
        else:
            outs = [_arrays.pool_empty(self.ctx, self.pool, shape, alloc, stream, dtype, poison)
                    for shape, alloc, dtype in self.outputs]
            if any(o is None for o in outs):
                return None
            out_ptrs = [_arrays.device_pointer(o) for o in outs]
        n_inputs = len(sig.pointers)
        roots = list(sig.pointers) + [0] * len(uploads)     # the uploads' addresses: under the lock
        roots += out_ptrs
        block = None                    # pool memory for the scratch, freed after the launches
        if self.scratch_bytes:
            err, block = cu.cuMemAllocFromPoolAsync(self.scratch_bytes, self.pool, stream)
            if err != cu.CUresult.CUDA_SUCCESS:
                _arrays.pool_free(raw or (), stream)
                return None
            roots.append(int(block))
        maps = []       # the tensor maps whose addresses the launches take: alive until launched
        capturing = self.has_maps and _capturing(stream)
        try:
            with self.lock:
                if uploads:
                    roots[n_inputs:n_inputs + len(uploads)] = self._resident(uploads, offsets, stream, sig.context)
                for i, ln in enumerate(self.launches):
                    for index, root, offset, tmap in ln.slots:
                        ptr = roots[root] + offset
                        ln.buf[index] = ptr if tmap is None else self._map_address((i, index), ptr, tmap, maps, stream,
                                                                                   capturing)
                    err, = cu.cuLaunchKernel(ln.handle, *ln.grid, *ln.block, ln.smem, stream, ln.address, 0)
                    if err != cu.CUresult.CUDA_SUCCESS:
                        raise RuntimeError(f"cuLaunchKernel failed: {err!r}")
        except BaseException:
            _arrays.pool_free(raw or (), stream)    # (after whatever was queued)
            raise
        finally:
            if block is not None:
                cu.cuMemFreeAsync(block, stream)
        if torch_outs:
            return tuple(outs)
        if raw is not None:
            outs = [_arrays.pool_wrap(self.ctx, p, shape, alloc, stream) for p, (shape, alloc, _) in
                    zip(raw, self.outputs)]
        return self.finish(outs)

    def _resident(self, uploads, offsets, stream, context):
        """The device addresses of the call's ``uploads`` (at byte ``offsets``) in the
        plan's buffer, copied there on ``stream`` unless they are the last call's (a model's
        layers repeat one batch's sequence table: nothing to copy). A plan launches on one
        stream, under its lock: a copy into the buffer is queued after the kernels that
        read the last one, and before this call's."""
        if self.uploaded is None:
            from numba import cuda
            self.uploaded = (cuda.device_array(max(offsets[-1], 1), np.uint8), offsets, None)
        buf, _, last = self.uploaded
        base = _arrays.device_pointer(buf)
        contents = [a.tobytes() for a in uploads]
        if contents != last:
            if _capturing(stream):
                raise RuntimeError(
                    "this call copies host metadata (sequence or page tables) to the device, which a CUDA graph "
                    "would copy again from a reused buffer at every replay: for a KV cache pass cache_seqlens and "
                    "block_table as device tensors with check_metadata=False; varlen calls cannot be captured "
                    "unless their cu_seqlens stay the same as the call before the capture.")
            _upload(uploads, offsets, base, stream, context)
            self.uploaded = (buf, offsets, contents)
        return [base + offset for offset in offsets[:-1]]

    def _map_address(self, slot, ptr, tmap, held, stream, capturing=False):
        """The device address of the tensor map of ``tmap``'s view at ``ptr`` for the
        parameter ``slot``: the last call's where it had the same pointer there and the
        table of maps has not started afresh since (the map and its memory are then still
        the table's), else :func:`_map_pointer`'s. The map is appended to ``held``. Under
        CUDA-graph capture (``capturing``) always :func:`_map_pointer`'s, which gives a
        captured graph a map no later one replaces (``families._MapSlots``)."""
        from . import families
        generation = families.map_generation()
        last = self.maps.get(slot)
        if last is not None and last[0] == ptr and last[1] == generation and not capturing:
            held.append(last[3])
            return last[2]
        address = _map_pointer(ptr, tmap, held, stream)
        # (read again: making the map may have started the table afresh)
        self.maps[slot] = (ptr, families.map_generation(), address, held[-1])
        return address


_TORCH_OUT = {}     # NumPy dtype -> the PyTorch dtype of outputs allocated by PyTorch (None: not)


def _torch_outputs(outputs, like, poison, device_id):
    """Outputs of ``(shape, allocated dtype, logical dtype)`` as new PyTorch tensors on
    ``like``'s device when ``like`` is a tensor on the plan's device ``device_id`` (None
    otherwise, or for an empty output or a dtype PyTorch lacks), filled with ``poison`` if
    given."""
    if not _arrays._is_torch(like) or not like.is_cuda:
        return None
    device = like.device
    if device.index != device_id:
        return None
    import torch
    outs = []
    for shape, _, dtype in outputs:
        tdt = _TORCH_OUT.get(dtype, False)
        if tdt is False:
            tdt = _TORCH_OUT[dtype] = getattr(torch, dtype.name, None) if dtype.name in (
                "float16", "bfloat16", "float32", "float64") else None
        if tdt is None or 0 in shape:
            return None
        o = torch.empty(shape, dtype=tdt, device=device)
        if poison is not None:
            o.fill_(poison)
        outs.append(o)
    return outs


class _Staging:
    """Pinned host buffers through which plan calls copy their uploads (sequence and page
    tables) to the device. From pageable memory a copy may wait for the work queued before
    it (on an H200 a paged decoding call's 32 KiB page table made each call wait for the
    last one's kernels, so back-to-back calls ran at host time plus kernel time); from
    pinned memory it is queued like a launch. A ring of ``SLOTS`` buffers per context, each
    refilled only after the copy that last read it has completed (its event)."""
    SLOTS = 8

    def __init__(self):
        self.slots = [None] * self.SLOTS      # (pinned pointer, size, event, NumPy view)
        self.next = 0
        self.lock = threading.Lock()

    def copy(self, uploads, offsets, dst, stream):
        """Queue the copy of ``uploads`` (at byte ``offsets``) to ``dst``; False where no
        pinned memory could be had. The copy ends at the last upload's last byte, not at the
        aligned end of the offsets: the destination may be an array of exactly the uploads'
        size (a plan adopts the full path's device copy of a lone table, :func:`capture`)."""
        from cuda.bindings import driver as cu
        total = int(offsets[len(uploads) - 1]) + uploads[-1].nbytes
        with self.lock:
            i, self.next = self.next, (self.next + 1) % self.SLOTS
            slot = self.slots[i]
            if slot is None or slot[1] < total:
                if slot is not None:
                    cu.cuEventSynchronize(slot[2])
                    cu.cuMemFreeHost(slot[0])
                    cu.cuEventDestroy(slot[2])
                    self.slots[i] = None
                size = max(total, 4096)
                err, ptr = cu.cuMemHostAlloc(size, 0)
                if err != cu.CUresult.CUDA_SUCCESS:
                    return False
                err, event = cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
                if err != cu.CUresult.CUDA_SUCCESS:
                    cu.cuMemFreeHost(ptr)
                    return False
                view = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(int(ptr)))
                slot = self.slots[i] = (ptr, size, event, view)
            else:
                # (long done, but for a ring's worth of calls in flight)
                _checked(cu.cuEventSynchronize(slot[2]), "cuEventSynchronize")
            ptr, _, event, view = slot
            for a, offset in zip(uploads, offsets):
                view[int(offset):int(offset) + a.nbytes] = a.reshape(-1).view(np.uint8)
            _checked(cu.cuMemcpyHtoDAsync(dst, ptr, total, stream), "cuMemcpyHtoDAsync")
            _checked(cu.cuEventRecord(event, stream), "cuEventRecord")     # (the slot's next use waits on it)
        return True


_STAGING = {}       # context handle -> _Staging


def _upload(uploads, offsets, dst, stream, ctx):
    """Copy the host arrays ``uploads`` to ``dst`` + ``offsets``, queued on ``stream``:
    through pinned memory (:class:`_Staging`), else from the arrays themselves."""
    from cuda.bindings import driver as cu
    staging = _STAGING.get(ctx)
    if staging is None:
        staging = _STAGING[ctx] = _Staging()
    if not staging.copy(uploads, offsets, dst, stream):
        for a, offset in zip(uploads, offsets):
            _checked(cu.cuMemcpyHtoDAsync(dst + int(offset), a.ctypes.data, a.nbytes, stream), "cuMemcpyHtoDAsync")


def _checked(result, name):
    """Raise where a driver call failed: a table copy that did not happen would leave the
    launches reading the last call's tables, and a staging buffer reused before its copy
    has read it would give them the next call's (wrong answers, not errors)."""
    from cuda.bindings import driver as cu
    err = result[0] if isinstance(result, tuple) else result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{name} failed: {err!r}")


def _offsets(uploads):
    """Byte offsets of ``uploads`` packed at ``SCRATCH_ALIGN`` boundaries, and their end."""
    offsets = [0]
    for a in uploads:
        offsets.append(offsets[-1] + -(-a.nbytes // SCRATCH_ALIGN) * SCRATCH_ALIGN)
    return offsets


def _capturing(stream):
    """Whether ``stream`` is being captured into a CUDA graph (``families._capturing``)."""
    from . import families
    return families._capturing(stream)


def _map_pointer(ptr, tmap, held, stream):
    """The device address of the tensor map of ``tmap``'s view at ``ptr`` (its copy to the
    device queued on ``stream`` if it is new); the map is
    appended to ``held``: the table of maps may drop it when it fills up (a later map of
    the same call can make it do so), and a reference kept until the launch keeps it alive
    until the kernel is queued (on a GPU its slot is not written again for many maps,
    ``families._MapSlots``; the simulator's map lives as long as its array)."""
    from . import families
    m = families.tensor_map(ptr, *tmap, stream=stream)
    held.append(m)
    return _arrays.device_pointer(m)


SCRATCH_ALIGN = 256


def _leaves(args):
    """The kernel arguments with tuples flattened, in the order their parameters are
    passed (``launch``)."""
    for a in args:
        if type(a) is tuple:
            yield from _leaves(a)
        else:
            yield a


def capture(inputs, outputs, scratch, launches, finish, stream, uploads=(), constants=(), aliases=None,
            host_uploads=None):
    """The :class:`Plan` of a call the full path just ran, or None.

    ``inputs``: the device arrays the call's input pointers point to, in the
    signature's order; ``uploads``: device arrays the full path copied from the host
    (a later call gives :meth:`Plan.run` its host arrays in this order); ``outputs``: (array, logical dtype) of what it returns (before
    ``finish``), which a plan allocates anew each call; ``scratch``: arrays only its
    launches use;
    ``launches``: :func:`numba_flash.launch.launch` argument tuples (tuple arguments
    flattened), whose array arguments must each share its memory with exactly one of
    those arrays (a view made by ``_arrays.strided_view`` or the array itself), or be one
    of ``constants``: device arrays every call with this signature reads (tables
    numba_flash keeps), passed by their pointers and kept alive by the plan. ``aliases``:
    ``{input index: earlier input index}`` of inputs that are the same array as an earlier
    one in every call of the signature (a KV cache read, then written); otherwise two
    inputs sharing memory get no plan (a later call might pass two different arrays).
    ``host_uploads``: the host arrays ``uploads`` were copied from; where there is one, its
    device copy becomes the plan's upload buffer, so that a later call with the same
    contents copies nothing, the first included (a call under CUDA-graph capture cannot
    copy from the host)."""
    from numba.cuda.cudadrv import devices

    from . import families
    inputs = list(inputs) + list(uploads)
    n_inputs = len(inputs)
    ctx = devices.get_context()
    pool = _arrays.pool_for(ctx.device.id)
    if not pool:
        return None
    roots = {}      # id(gpu_data) -> (root index, byte offset of the array's data in the root)
    offsets, total = [], 0
    for a in scratch:
        offsets.append(total)
        total += -(-_arrays.nbytes(a) // SCRATCH_ALIGN) * SCRATCH_ALIGN
    for i, (a, offset) in enumerate([(a, 0) for a in inputs] + [(a, 0) for a, _ in outputs]
                                    + [(a, o) for a, o in zip(scratch, offsets)]):
        index = min(i, n_inputs + len(outputs))
        gid = id(a.gpu_data)
        if aliases and i in aliases and roots.get(gid) == (aliases[i], 0):
            continue                                    # launches use the earlier input's root
        if gid in roots or not a.size:
            return None                                 # the same memory twice, or empty
        roots[gid] = (index, offset)
    fixed = {id(a.gpu_data) for a in constants}
    plans = []
    for kern, grid, block, smem, args, launch_stream in launches:
        if _arrays.stream_handle(launch_stream) != stream:
            return None
        entry = _launch.compiled(kern, args)
        if entry is None or smem > entry[2]:
            return None
        values, slots = [], []
        for a in _leaves(args):
            if _launch.is_scalar(a):
                values.append(a)
                continue
            if id(a.gpu_data) in fixed:
                values += _launch.array_params(a, _arrays.device_pointer(a))
                continue
            root, tmap = roots.get(id(a.gpu_data)), None
            if root is None and id(a) in families.MAP_SOURCES:     # a TMA map over an input
                gid, ptr, shape, strides, rows = families.MAP_SOURCES[id(a)]
                root = roots.get(gid)
                if root is None or root[0] >= n_inputs:
                    return None
                root = (root[0], ptr - _arrays.device_pointer(inputs[root[0]]))
                tmap = (shape, strides, rows)
            if root is None:
                return None
            slots.append((len(values) + 4, root[0], root[1], tmap))
            values += _launch.array_params(a, 0)
        plans.append(_Launch(entry[0], grid, block, smem, values, entry[1], slots))
    outs = [(tuple(a.shape), a.dtype, np.dtype(dt)) for a, dt in outputs]
    plan = Plan(plans, outs, total, finish, ctx, pool, len(uploads), constants)
    if (host_uploads is not None and len(uploads) == len(host_uploads) == 1
            and _arrays.nbytes(uploads[0]) >= host_uploads[0].nbytes):
        plan.uploaded = (uploads[0], _offsets(host_uploads), [a.tobytes() for a in host_uploads])
    return plan
