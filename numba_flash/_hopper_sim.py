"""Simulator twins of ``ops_hopper``: the Hopper instructions in plain Python, same semantics.

Numba's simulator cannot run ``@intrinsic`` functions, so in the simulator ``ops_hopper``
replaces each of its names by the function of the same name here (``__all__``), and the
Hopper kernels run unchanged, one Python thread per GPU thread (``_simulator``).

* Shared memory: ``shared_address`` hands out a fake 32-bit address for a shared array
  (1024-aligned, never 0, below the 18 bits a wgmma descriptor keeps) and records the
  array in the block's state; every other twin turns an integer address back into bytes
  of that array. Addresses outside every recorded array raise.
* mbarriers (PTX semantics): a phase completes when its pending arrivals and its
  transaction bytes both reach 0; the phase bit flips and the arrivals are reset to the
  count. ``mbarrier_try_wait`` blocks on a condition variable until the phase of that
  parity has completed, then returns 1 (kernels spin on it; the simulator should not).
* TMA: ``tensor_map_4d`` returns a 128-byte device array naming its tensor (a registry
  entry, valid while the array lives); ``tma_load_*`` copies the box at once, zero-filled
  outside the tensor and with the 128-byte swizzle of the destination address (16-byte
  chunk bits 4..6 XOR row bits 7..9), then completes its bytes on the mbarrier.
* ``wgmma``: the 128 threads of the warpgroup meet (each publishes its accumulator and
  operands); the last to arrive multiplies with NumPy (float64 sums of the exact products,
  truncated to float32 as ``ops``'s ``mma`` twins do) and each thread takes its own
  tuple. Results are complete at issue, so ``wgmma_wait`` and the fences are no-ops.
* ``named_barrier`` / ``named_arrive``: ``bar.sync`` / ``bar.arrive`` among the threads
  that name the barrier, counted per thread (kernels call them from whole warps).

Per-block state hangs off the block of ``_simulator`` (its ``extra`` dict and a condition
variable on its lock, which an abort wakes). Waits give up after ``_TIMEOUT_S`` with an
error that says what was missing: a guard against a deadlocked kernel, not a time budget.
"""
import itertools
import threading
import time
import weakref

import numpy as np

from . import _simulator

__all__ = ["wgmma_fence", "wgmma_commit", "fence_async_shared", "fence_mbarrier_init", "wgmma_wait", "setmaxnreg",
           "named_barrier", "named_arrive", "mbarrier_init", "mbarrier_arrive", "mbarrier_arrive_expect_tx",
           "mbarrier_try_wait", "shared_address", "global_address", "tensormap_acquire", "tma_load_3d",
           "tma_load_4d", "smem_descriptor", "accumulator", "scale_rows", "to_array", "wgmma", "tensor_map_4d",
           "encode_tensor_map_4d", "clock64", "st_shared_v4", "ld_shared_v4"]

_TIMEOUT_S = 600.0


def clock64():
    """The cycle counter's twin: nanoseconds of the host's monotonic clock."""
    return time.perf_counter_ns()
# A slow warpgroup, for tests: ``(warpgroup, seconds)`` makes that warpgroup's threads pause
# (``_simulator.pause``: sleep, or give way to every runnable thread in the cooperative mode)
# before every named-barrier sync or arrival, so that the others run ahead of it, an order
# a GPU makes rare but allows (a protocol that counts on one warpgroup staying ahead of
# another deadlocks here, as it could on a GPU). None by default.
SLOW_WARPGROUP = None
_FIRST_BASE = 1024          # the first shared array's fake address: aligned, and 0 stays invalid
_WINDOW = 1 << 18           # a wgmma descriptor keeps the low 18 bits of a shared address
_WARPGROUP = 128


# --------------------------------------------------------------------------- per-block state
class _MBarrier:
    __slots__ = ("count", "pending", "tx", "phase")

    def __init__(self, count):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0


class _Named:
    __slots__ = ("nthreads", "arrived", "generation")

    def __init__(self, nthreads):
        self.nthreads, self.arrived, self.generation = nthreads, 0, 0


class _Group:
    """A warpgroup's rendezvous: the operands published so far and the last product."""
    __slots__ = ("values", "arrived", "generation", "results", "error")

    def __init__(self):
        self.values, self.arrived, self.generation = [None] * _WARPGROUP, 0, 0
        self.results = self.error = None


class _State:
    def __init__(self, block):
        self.cond = block.condition()
        self.nthreads = block.nthreads
        self.arrays = []            # [fake base, uint8 view, data pointer] per shared array
        self.next_base = _FIRST_BASE
        self.mbarriers = {}         # shared address -> _MBarrier
        self.named = {}             # barrier id -> _Named
        self.groups = {}            # warpgroup -> _Group


def _here():
    """(this simulated thread, its block's state)."""
    t = _simulator.current_thread()
    manager = getattr(t, "_manager", None)
    if manager is None:
        raise RuntimeError("ops_hopper's instructions run inside a kernel launched in the simulator")
    block = manager._block
    with block.lock:
        st = block.extra.get("hopper")
        if st is None:
            st = block.extra["hopper"] = _State(block)
    return t, st


def _wait(t, st, done, missing):
    """With ``st.cond`` held: sleep until ``done()``; raise if the block aborts or after
    ``_TIMEOUT_S`` (then ``missing()`` says what never came)."""
    deadline = time.monotonic() + _TIMEOUT_S
    while not done():
        if t.abort:
            raise RuntimeError("aborted: another thread of the block raised")
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"{missing()} after {_TIMEOUT_S:g} s: the kernel is deadlocked")
        try:
            st.cond.wait(left)
        except _simulator.Deadlock:
            raise RuntimeError(f"{missing()}: the kernel is deadlocked (no thread of the block can go on)") from None


# --------------------------------------------------------------------------- shared memory
def shared_address(ary):
    """A fake 32-bit shared address of a shared array's first element (1024-aligned)."""
    t, st = _here()
    a = np.asarray(ary)
    ptr = a.__array_interface__["data"][0]
    view = a.reshape(-1).view(np.uint8)
    with st.cond:
        for entry in st.arrays:
            if entry[2] == ptr:
                if view.size > entry[1].size:     # the dynamic array again, as a larger dtype
                    entry[1] = view
                return entry[0]
        base = st.next_base
        if base + view.size > _WINDOW:
            raise RuntimeError(f"shared arrays of {base + view.size} bytes in all: more than a wgmma descriptor "
                               f"addresses ({_WINDOW}) and than a GPU has")
        st.arrays.append([base, view, ptr])
        st.next_base = base + -(-view.size // 1024) * 1024 + 1024
        return base


def _bytes_at(st, addr, nbytes):
    """(uint8 view of the shared array holding ``[addr, addr + nbytes)``, offset of addr)."""
    for base, view, _ in st.arrays:
        if base <= addr and addr + nbytes <= base + view.size:
            return view, addr - base
    raise RuntimeError(f"shared address 0x{addr:x} (+{nbytes} bytes) is outside every shared array given to "
                       f"shared_address ({[(hex(b), v.size) for b, v, _ in st.arrays]})")


def _swizzle128(addr):
    """The 128-byte swizzle: 16-byte chunk bits 4..6 XOR row bits 7..9 of the address."""
    return addr ^ ((addr >> 3) & 0x70)


# --------------------------------------------------------------------------- fences, registers
def wgmma_fence():
    """No-op in the simulator (products complete at issue)."""


def wgmma_commit():
    """No-op in the simulator (products complete at issue)."""


def fence_async_shared():
    """No-op in the simulator (one memory, no async proxy)."""


def fence_mbarrier_init():
    """No-op in the simulator (initialisation is visible at once)."""


def _noop():
    pass


def wgmma_wait(pending):
    """A no-op: in the simulator every product has completed when its call returns."""
    return _noop


def setmaxnreg(count, increase):
    """A no-op (the simulator has no register file); checks ``count`` as the GPU version does."""
    assert count % 8 == 0 and 24 <= count <= 256, count
    return _noop


# --------------------------------------------------------------------------- named barriers
def _named(barrier, nthreads, wait):
    t, st = _here()
    if SLOW_WARPGROUP is not None and t.thread_id // _WARPGROUP == SLOW_WARPGROUP[0]:
        _simulator.pause(SLOW_WARPGROUP[1])
    barrier, nthreads = int(barrier), int(nthreads)
    if not 0 <= barrier < 16 or nthreads <= 0 or nthreads % 32 or nthreads > st.nthreads:
        raise ValueError(f"named barrier {barrier} for {nthreads} threads: ids are 0..15 and thread counts "
                         f"multiples of 32, at most the block's {st.nthreads}")
    with st.cond:
        b = st.named.get(barrier)
        if b is None or b.arrived == 0:
            b = st.named.setdefault(barrier, _Named(nthreads))
            b.nthreads = nthreads
        elif b.nthreads != nthreads:
            raise RuntimeError(f"named barrier {barrier}: threads disagree on its thread count "
                               f"({b.nthreads} and {nthreads})")
        b.arrived += 1
        generation = b.generation
        if b.arrived == b.nthreads:
            b.arrived = 0
            b.generation += 1
            st.cond.notify_all()
        elif wait:
            _wait(t, st, lambda: b.generation != generation,
                  lambda: f"named barrier {barrier}: {b.arrived} of its {b.nthreads} threads arrived")


def named_barrier(barrier, nthreads):
    """``bar.sync``: wait until ``nthreads`` threads have synced or arrived on ``barrier``."""
    _named(barrier, nthreads, True)


def named_arrive(barrier, nthreads):
    """``bar.arrive``: count towards ``barrier`` without waiting."""
    _named(barrier, nthreads, False)


# --------------------------------------------------------------------------- mbarriers
def _mbarrier(st, addr):
    mb = st.mbarriers.get(addr)
    if mb is None:
        raise RuntimeError(f"no mbarrier initialised at shared address 0x{addr:x}")
    return mb


def _complete_if_done(st, mb):
    """With the lock held: end the phase once its arrivals and transaction bytes are in."""
    if mb.pending == 0 and mb.tx == 0:
        mb.phase ^= 1
        mb.pending = mb.count
        st.cond.notify_all()


def mbarrier_init(addr, count):
    t, st = _here()
    addr, count = int(addr), int(count)
    if addr % 8 or not 0 < count < 1 << 20:
        raise ValueError(f"mbarrier at 0x{addr:x} for {count} arrivals: it needs an 8-byte aligned address "
                         "and a count in 1 .. 2^20 - 1")
    with st.cond:
        _bytes_at(st, addr, 8)
        st.mbarriers[addr] = _MBarrier(count)


def _arrive(addr, tx):
    t, st = _here()
    addr = int(addr)
    with st.cond:
        mb = _mbarrier(st, addr)
        if mb.pending == 0:
            raise RuntimeError(f"mbarrier 0x{addr:x}: more arrivals in one phase than its count ({mb.count})")
        mb.tx += tx
        mb.pending -= 1
        _complete_if_done(st, mb)


def mbarrier_arrive(addr):
    _arrive(addr, 0)


def mbarrier_arrive_expect_tx(addr, nbytes):
    _arrive(addr, int(nbytes))


def mbarrier_try_wait(addr, parity):
    """Blocks until the phase of ``parity`` has completed (the current phase's parity
    differs), then returns 1."""
    t, st = _here()
    addr, parity = int(addr), int(parity) & 1
    with st.cond:
        mb = _mbarrier(st, addr)
        _wait(t, st, lambda: mb.phase != parity,
              lambda: (f"mbarrier 0x{addr:x}: the phase of parity {parity} never completed ({mb.pending} of "
                       f"{mb.count} arrivals and {mb.tx} transaction bytes pending)"))
    return 1


# --------------------------------------------------------------------------- shared words
def st_shared_v4(addr, w0, w1, w2, w3):
    """Four 32-bit words (each value's low 32 bits) at a 16-byte aligned shared address."""
    t, st = _here()
    addr = int(addr)
    assert addr % 16 == 0, addr
    with st.cond:
        view, off = _bytes_at(st, addr, 16)
        view[off:off + 16] = np.array([int(w) & 0xFFFFFFFF for w in (w0, w1, w2, w3)], np.uint32).view(np.uint8)


def ld_shared_v4(addr):
    """The four 32-bit words (int32) at a 16-byte aligned shared address."""
    t, st = _here()
    addr = int(addr)
    assert addr % 16 == 0, addr
    with st.cond:
        view, off = _bytes_at(st, addr, 16)
        return tuple(int(w) for w in view[off:off + 16].copy().view(np.int32))


# --------------------------------------------------------------------------- TMA
_MAGIC = b"nfTMAP\x00\x01"
_maps = {}                              # id -> (tensor as uint16, box extents innermost first)
_map_ids = itertools.count(1)
_arrays = weakref.WeakValueDictionary()  # data pointer -> the host array behind a device array
_arrays_lock = threading.Lock()


def _host_array(ary):
    """The NumPy array behind a simulator device array (inside a kernel or not)."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray, FakeWithinKernelCUDAArray
    if isinstance(ary, FakeWithinKernelCUDAArray):
        ary = ary.__dict__["_item"]
    if isinstance(ary, FakeCUDAArray):
        return ary._ary
    if isinstance(ary, np.ndarray):
        return ary
    raise TypeError(f"expected a device array, got {type(ary).__name__}")


def global_address(ary):
    """The data pointer of a device array (its host array in the simulator)."""
    a = _host_array(ary)
    ptr = a.__array_interface__["data"][0]
    with _arrays_lock:
        _arrays[ptr] = a
    return ptr


def tensormap_acquire(addr):
    """No-op in the simulator (the map is read when a load uses it)."""


def _tensor_map(addr):
    with _arrays_lock:
        a = _arrays.get(int(addr))
    raw = None if a is None else np.ascontiguousarray(a).view(np.uint8).reshape(-1)[:16]
    if raw is None or raw.size < 16 or raw[:8].tobytes() != _MAGIC:
        raise RuntimeError(f"TMA: 0x{int(addr):x} is not the global_address of a tensor map from tensor_map_4d")
    entry = _maps.get(int(raw[8:16].view(np.uint64)[0]))
    if entry is None:
        raise RuntimeError("TMA: this tensor map outlived the array tensor_map_4d returned (a copy of it?)")
    return entry


def encode_tensor_map_4d(ptr, shape, strides, box_rows, box_cols=64, into=None):
    """Not in the simulator: its maps name a registered host array, which only
    :func:`tensor_map_4d`, given the array rather than its address, can register."""
    raise NotImplementedError("the simulator's tensor maps come from tensor_map_4d (given the array itself)")


def tensor_map_4d(ary, box_rows, box_cols=64):
    """A tensor map over a 4-D device array ``(B1, B2, N, d)`` of 16-bit elements, for
    :func:`tma_load_4d`: a 128-byte device array naming the tensor and its box (``box_cols``
    × ``box_rows`` × 1 × 1), checked as the driver checks it."""
    from numba import cuda
    a = _host_array(ary)
    shape, strides = tuple(a.shape), tuple(a.strides)
    assert len(shape) == 4 and strides[3] == 2 and box_cols * 2 <= 128, (shape, strides, box_cols)
    if (a.__array_interface__["data"][0] % 16 or any(s <= 0 or s % 16 for s in strides[:3])
            or not (0 < box_rows <= 256 and box_cols > 0 and box_cols * 2 % 16 == 0)):
        raise ValueError(f"cuTensorMapEncodeTiled failed (as the driver would) for shape {shape}, strides {strides}: "
                         "TMA needs 16-byte aligned addresses and strides that are multiples of 16 bytes.")
    key = next(_map_ids)
    raw = np.zeros(128, np.uint8)
    raw[:8] = np.frombuffer(_MAGIC, np.uint8)
    raw[8:16] = np.array([key], np.uint64).view(np.uint8)
    tmap = cuda.to_device(raw)
    _maps[key] = (a.view(np.uint16), (box_cols, box_rows, 1, 1))
    weakref.finalize(tmap._ary, _maps.pop, key, None)
    return tmap


def _box(tensor, box, coords):
    """The box at ``coords`` (innermost first) as a (rows, columns) uint16 array, zero
    outside the tensor."""
    cols, rows = box[0], box[1]
    tile = np.zeros((rows, cols), np.uint16)
    outer = tuple(reversed(coords[2:]))
    if all(0 <= c < n for c, n in zip(outer, tensor.shape[:-2])):
        c0, c1 = coords[0], coords[1]
        r0, r1 = max(c1, 0), min(c1 + rows, tensor.shape[-2])
        k0, k1 = max(c0, 0), min(c0 + cols, tensor.shape[-1])
        if r0 < r1 and k0 < k1:
            tile[r0 - c1:r1 - c1, k0 - c0:k1 - c0] = tensor[outer + (slice(r0, r1), slice(k0, k1))]
    return tile


def _tma_load(dst, tmap, coords, mbar):
    tensor, box = _tensor_map(tmap)
    if len(coords) != tensor.ndim:
        raise RuntimeError(f"TMA: a {len(coords)}-D load through a {tensor.ndim}-D tensor map")
    data = _box(tensor, box, [int(c) for c in coords]).view(np.uint8).reshape(-1, 16)
    nbytes = data.size
    t, st = _here()
    dst, mbar = int(dst), int(mbar)
    with st.cond:
        if dst % 128:
            raise RuntimeError(f"TMA: destination 0x{dst:x} is not 128-byte aligned")
        view, off = _bytes_at(st, dst, nbytes)
        hit = [a for a in st.mbarriers if dst <= a < dst + nbytes]
        if hit:
            raise RuntimeError(f"TMA: the box at 0x{dst:x} (+{nbytes} bytes) overwrites the mbarrier at 0x{hit[0]:x}")
        chunks = _swizzle128(dst + 16 * np.arange(len(data))) - dst + off
        view[chunks[:, None] + np.arange(16)] = data
        mb = _mbarrier(st, mbar)
        mb.tx -= nbytes
        _complete_if_done(st, mb)


def tma_load_3d(dst, tmap, c0, c1, c2, mbar):
    _tma_load(dst, tmap, (c0, c1, c2), mbar)


def tma_load_4d(dst, tmap, c0, c1, c2, c3, mbar):
    _tma_load(dst, tmap, (c0, c1, c2, c3), mbar)


# --------------------------------------------------------------------------- warpgroup MMA
def smem_descriptor(lbo, sbo, swizzle):
    """``(shared address) -> u64``: the descriptor, encoded as on the GPU."""
    high = ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (swizzle << 62)

    def descriptor(addr):
        return ((int(addr) & 0x3FFFF) >> 4) | high
    return descriptor


def accumulator(n):
    """``() -> acc``: the zero accumulator tuple (``n // 2`` float32 per thread)."""
    zeros = (np.float32(0),) * (n // 2)

    def zero():
        return zeros
    return zero


def scale_rows(acc, row0, row1):
    f = (np.float32(row0), np.float32(row1))
    return tuple(np.float32(x) * f[(i // 2) % 2] for i, x in enumerate(acc))


def to_array(acc, ary):
    for i, x in enumerate(acc):
        ary[i] = x


_INDEX = {}


def _acc_index(n):
    """(rows, columns), each (128, n / 2): where thread t's accumulator element i lives."""
    if n not in _INDEX:
        t, i = np.arange(_WARPGROUP)[:, None], np.arange(n // 2)[None, :]
        w, g, q = t // 32, (t % 32) // 4, t % 4
        _INDEX[n] = (16 * w + g + 8 * ((i // 2) % 2), 8 * (i // 4) + 2 * q + i % 2)
    return _INDEX[n]


def _values(kind, bits):
    """float64 values of 16-bit patterns."""
    bits = np.asarray(bits, np.uint16)
    if kind == "bf16":
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return bits.view(np.float16).astype(np.float64)


def _register_a(kind, regs):
    """A (64 × 16) from each thread's four packed registers (``ops``'s m16n8k16 A fragment
    per warp, rows 16 w ..)."""
    regs = np.array([[int(r) & 0xFFFFFFFF for r in rs] for rs in regs], np.uint32)        # (128, 4)
    vals = _values(kind, np.stack([regs & 0xFFFF, regs >> 16], axis=-1))                  # (128, 4, 2)
    t, j, h = np.arange(_WARPGROUP)[:, None, None], np.arange(4)[None, :, None], np.arange(2)[None, None, :]
    w, g, q = t // 32, (t % 32) // 4, t % 4
    a = np.zeros((64, 16))
    a[16 * w + g + 8 * (j % 2), 2 * q + 8 * (j // 2) + h] = vals
    return a


def _swizzled_rows(st, kind, desc, nrows, nchunks, atom=0):
    """(nrows, 8 · nchunks) values read through a 128-byte-swizzle descriptor: row r, chunk
    c (8 elements) at ``start + atom · LBO + (r // 8) · SBO + (r % 8) · 128 + 16 c``,
    swizzled (``atom``: which 64-element atom along an MN-major operand's rows)."""
    d = int(desc)
    start, sbo, swizzle = (d & 0x3FFF) << 4, ((d >> 32) & 0x3FFF) << 4, (d >> 62) & 3
    start += atom * (((d >> 16) & 0x3FFF) << 4)
    if swizzle != 1:
        raise NotImplementedError(f"wgmma descriptor with swizzle code {swizzle}: the simulator models the "
                                  "128-byte swizzle (code 1) only")
    r, c = np.arange(nrows)[:, None], np.arange(nchunks)[None, :]
    phys = _swizzle128(start + (r // 8) * sbo + (r % 8) * 128 + 16 * c)
    lo, hi = int(phys.min()), int(phys.max()) + 16
    view, off = _bytes_at(st, lo, hi - lo)
    raw = view[(phys - lo + off)[..., None] + np.arange(16)]                                 # (nrows, nchunks, 16)
    return _values(kind, raw.view(np.uint16).reshape(nrows, 8 * nchunks))


def _product(st, spec, values):
    """The warpgroup's D = A·B (+ C) from every thread's published operands."""
    n, kind, a_in_registers, trans_b = spec
    if any(v[0] != spec for v in values):
        raise RuntimeError("wgmma: the threads of a warpgroup issued different instructions")
    ops = [v[1] for v in values]
    acc, uniform = ops[0], ops[0][2:]
    if any(o[2:] != uniform for o in ops):
        raise RuntimeError("wgmma: descriptors and the accumulate flag differ between the warpgroup's threads")
    desc_b, accumulate = uniform[-2], uniform[-1]
    a = _register_a(kind, [o[1] for o in ops]) if a_in_registers else _swizzled_rows(st, kind, uniform[0], 64, 2)
    if trans_b:                  # MN-major: 16 k-rows of n elements, 64 per 128-byte row, atoms LBO apart
        b = np.hstack([_swizzled_rows(st, kind, desc_b, 16, min(n - 64 * a, 64) // 8, a)
                       for a in range(-(-n // 64))])
    else:                        # K-major: n rows of 16 k
        b = _swizzled_rows(st, kind, desc_b, n, 2).T
    d = a @ b
    rows, cols = _acc_index(n)
    if int(accumulate):
        acc = np.array([o[0] for o in ops], np.float32)
        if acc.shape != (_WARPGROUP, n // 2):
            raise TypeError(f"wgmma m64n{n}: the accumulator must be a tuple of {n // 2} float32")
        c = np.zeros((64, n))
        c[rows, cols] = acc
        d += c
    f = d.astype(np.float32)
    over = np.abs(f.astype(np.float64)) > np.abs(d)        # rounded away from zero: truncate
    f[over] = np.nextafter(f[over], np.float32(0))
    return [tuple(x) for x in f[rows, cols]]


def _issue(spec, operands):
    """Rendezvous of the warpgroup's 128 threads; the last to arrive multiplies."""
    t, st = _here()
    wg, lane = divmod(t.thread_id, _WARPGROUP)
    with st.cond:
        g = st.groups.get(wg)
        if g is None:
            if st.nthreads < _WARPGROUP * (wg + 1):
                raise RuntimeError(f"wgmma needs whole warpgroups of 128 threads; the block has {st.nthreads}")
            g = st.groups[wg] = _Group()
        g.values[lane] = (spec, operands)
        g.arrived += 1
        generation = g.generation
        if g.arrived == _WARPGROUP:
            try:
                g.results, g.error = _product(st, spec, g.values), None
            except Exception as e:
                g.results, g.error = None, e
            g.values, g.arrived = [None] * _WARPGROUP, 0
            g.generation += 1
            st.cond.notify_all()
            if g.error is not None:
                raise g.error
        else:
            _wait(t, st, lambda: g.generation != generation,
                  lambda: f"wgmma: {g.arrived} of the 128 threads of warpgroup {wg} arrived")
            if g.error is not None:
                raise RuntimeError(f"wgmma failed in another thread of the warpgroup: {g.error}")
        return g.results[lane]


_WGMMA = {}


def _wgmma(n, dtype_name, a_in_registers, trans_b):
    kind = {"bfloat16": "bf16", "float16": "f16"}[dtype_name]
    assert n % 8 == 0 and 8 <= n <= 256, n
    spec = (n, kind, bool(a_in_registers), trans_b)
    if a_in_registers:
        def op(acc, a0, a1, a2, a3, desc_b, accumulate):
            return _issue(spec, (acc, (a0, a1, a2, a3), desc_b, accumulate))
    else:
        def op(acc, desc_a, desc_b, accumulate):
            return _issue(spec, (acc, None, desc_a, desc_b, accumulate))
    return op


def wgmma(n, dtype_name, a_in_registers=False, trans_b=0):
    """The warpgroup MMA m64n{n}k16 (see ``ops_hopper.wgmma``), emulated: every thread of
    the warpgroup calls it together and gets its own accumulator tuple."""
    key = (n, dtype_name, a_in_registers, int(trans_b))
    if key not in _WGMMA:
        _WGMMA[key] = _wgmma(*key)
    return _WGMMA[key]
