"""Each kernel family's launches, built from a call's checked inputs.

``api.py`` checks the inputs, allocates the outputs and hands the device arrays here; a
family chooses its specialisations (``registry``), folds the arrays into the views its
kernels take (``inp.kernel_views``), and returns its launches as
:func:`numba_flash.launch.launch` argument tuples ``(kernel, grid, block, shared memory,
arguments, stream)``, its kernels' arguments in their declared order (the kernel
factories' docstrings; ``registry``'s signatures). Launch plans (``_plans``) replay
these tuples.

Every attention kernel's arguments end with the score arguments of
``numba_flash.scores`` (``inp.score_args``): window sides, softcap factors, ALiBi slopes.
"""
import copy
import math

from . import _arrays, registry, scores
from .kernels import backward_wgmma, forward_wgmma
from .kernels.backward_mma import stats_rows
from .scores import LOG2E

MAX_GRID_X = 2**31 - 1
MAX_GRID_Y = 65535
SMEM_RESERVED = 1024   # shared memory the driver keeps per resident block (cc 8.0 and later)


def grid(inp, rows, b, rows_per_block, cols_per_block):
    """``(x, y)``: ``rows`` rows of ``b`` leading indices in blocks of ``rows_per_block``,
    the head dim in slices of ``cols_per_block``; a ValueError past the GPU's limits.
    Packed sequences (``inp.packed``): ``(x, y, S)``, ``rows`` the longest sequence's."""
    if inp.packed is not None:
        rows = inp.packed.max_q     # (the sequence count, grid z, is checked with the table)
    g = (-(-rows // rows_per_block) * b, -(-inp.d // cols_per_block))
    if g[0] > MAX_GRID_X or g[1] > MAX_GRID_Y:
        raise ValueError(f"problem too large for one launch: {b} leading indices × {rows} rows "
                         f"needs {g[0]} blocks (limit {MAX_GRID_X}). Split the batch (the leading dims) "
                         "and call once per part.")
    return g if inp.packed is None else g + (inp.packed.count,)


# --------------------------------------------------------------------------- forward
def forward(inp, q, k, v, out, lse, use_async, sm_count, smem_limit, splits, scratch, cc=None):
    """The forward's launches: on a Hopper GPU (``cc`` 9.0) the Hopper family for 16-bit
    inputs it takes (the TMA needs views whose strides it can describe: else the next
    family), the ``mma.sync`` tensor-core family for the other 16-bit inputs, the
    CUDA-core one otherwise (with key splits and their merge when the grid is small; the
    split buffers are appended to ``scratch``). Decoding with grouped heads first takes
    each group's query heads as rows (:func:`_group_rows`)."""
    grouped = _group_rows(inp, q, out, lse)
    if grouped is not None:
        inp, q, out, lse = grouped
    rows = inp.nq if inp.packed is None else inp.packed.max_q
    spec = registry.forward_specialisation(inp.dtype.name, inp.d, inp.scores, use_async, smem_limit=smem_limit,
                                           cc=cc, rows=rows)
    score_args, slopes = inp.score_args(lse, _query_rows(spec), _list_keys(spec))
    views = inp.kernel_views([q, out, lse, slopes], [k, v])
    seqs = () if inp.packed is None else (inp.packed.table, inp.packed.pages, inp.packed.page_size)
    if spec.variant == "forward_wgmma":
        hviews = views if inp.group == 1 else _heads_views(inp, [q, out, lse, slopes, k, v])
        stream = _arrays.stream_handle(inp.stream)
        maps = [_tma_maps(q4, k4, v4, spec.tiling, stream) for q4, _, _, _, k4, v4 in hviews]
        packed = [_arrays.packed_view(o4) for _, o4, _, _, _, _ in hviews]
        lses = []
        if inp.packed is not None:       # the kernel's out and lse as (tokens, heads, ·): forward_wgmma
            packed = [x if x is None else _arrays.rows_first(x) for x in packed]
            lses = [_arrays.rows_first(l3) for _, _, l3, _, _, _ in hviews]
            hviews = [(q4, o4, l3, s3, k4, v4) for (q4, o4, _, s3, k4, v4), l3 in zip(hviews, lses)]
        gaps = inp.packed is not None and inp.packed.gaps    # (its TMA boxes would read a KV cache's unused rows)
        if hviews and not gaps and all(x is not None for x in maps + packed + lses):   # (arrays compare elementwise)
            return _hopper_launches(inp, spec, hviews, maps, packed, score_args, sm_count)
        spec = registry.specialisation("forward_mma", inp.dtype.name, inp.d, inp.scores, True)
        if inp.block_mask is not None:          # its block ranges are per query tile: this family's
            score_args, slopes = inp.score_args(lse, _query_rows(spec), _list_keys(spec))
            views = inp.kernel_views([q, out, lse, slopes], [k, v])
    t, kern = spec.tiling, spec.kernel()
    scale_log2 = inp.acc_dtype.type(inp.scale * LOG2E)
    launches = []
    for q4, o4, l3, s3, k4, v4 in views:
        g = grid(inp, inp.nq, q4.shape[0] * q4.shape[1], t.BM, t.DO)
        tail = (*score_args, inp.score_tail(s3), *seqs)
        if spec.variant == "forward_mma":
            launches.append((kern, g, t.threads, spec.smem_bytes, (q4, k4, v4, o4, l3, scale_log2, *tail),
                             inp.stream))
        else:
            launches += _split_launches(inp, spec, kern, g, (q4, k4, v4, o4, l3), scale_log2, tail,
                                        splits, sm_count, smem_limit, scratch)
    return launches


def _group_rows(inp, q, out, lse):
    """Grouped-query decoding: ``c`` query heads of a group as ``c · Nq`` rows of one query
    head, so that a block reads its K/V head once for all of them (as the query heads of a
    group read the same keys). ``(inputs, q, out, lse)`` with the heads folded (``c``
    the largest divisor of the group with ``c · Nq <= registry.SPLIT_ROWS``: the decoding
    kernel's rows), or None where the rows' positions would matter: the rules must give
    every row the same keys (no ALiBi, no user functions, no left window bound; a right
    bound or ``causal`` only with ``Nq = 1``, whose one query sees every key anyway), and
    q's head axis must fold into its rows (a head stride of ``Nq`` rows, or ``Nq = 1``)."""
    g, nq, rules = inp.group, inp.nq, inp.rules
    if (g == 1 or inp.packed is not None or rules.mods is not None or rules.alibi or rules.left is not None
            or (rules.right is not None and nq > 1)):
        return None
    c = max((c for c in range(1, g + 1) if g % c == 0 and c * nq <= registry.SPLIT_ROWS), default=1)
    if c == 1:
        return None
    h = len(inp.lead) - 1
    views = []
    for a in (q, out, lse):
        shape, strides = tuple(a.shape), tuple(a.strides)
        if nq > 1 and strides[h] != nq * strides[h + 1]:
            return None
        row = strides[h] if nq == 1 else strides[h + 1]
        views.append(_arrays.strided_view(a, shape[:h] + (shape[h] // c, c * nq) + shape[h + 2:],
                                          strides[:h] + (c * strides[h], row) + strides[h + 2:]))
    folded = copy.copy(inp)
    folded.lead = inp.lead[:-1] + (inp.lead[-1] // c,)
    folded.batch = math.prod(folded.lead)
    folded.nq, folded.group = c * nq, g // c
    folded.rules = scores.Scores(softcap=rules.softcap)
    folded.scores = folded.rules.spec
    return (folded, *views)


def _heads_views(inp, arrays):
    """Grouped query heads for the Hopper family, which reads K/V head ``h // group`` for
    query head ``h`` itself: each array ``(*L, H, *tail)`` (q, out, lse, slopes: ``H = Hq``;
    k, v: ``Hkv``) as ``(X, H, *tail)``, ``L`` folded into one axis; ``[]`` where an
    array's leading strides do not fold. Without a head axis (q of shape ``(N, d)``) the
    arrays are one head's: ``(1, 1, *tail)``."""
    h = max(len(inp.lead) - 1, 0)
    folded = []
    for a in arrays:
        shape, strides = tuple(a.shape), tuple(a.strides)
        if not inp.lead:        # no head axis: an axis of one index stands for it
            shape, strides = (1,) + shape, (
                _arrays.unit_axis_stride(shape, strides, a.dtype.itemsize, strides[0] * shape[0]),) + strides
        x, xs = 1, 0
        for n, s in zip(reversed(shape[:h]), reversed(strides[:h])):    # innermost first
            if n == 1:
                continue
            if x > 1 and s != xs * x:
                return []
            xs = s if x == 1 else xs
            x *= n
        if x == 1:      # one leading index: typed C where the view is C-contiguous (_arrays)
            xs = _arrays.unit_axis_stride(shape[h:], strides[h:], a.dtype.itemsize, strides[h] * shape[h])
        folded.append(_arrays.strided_view(a, (x,) + shape[h:], (xs,) + strides[h:]))
    return [tuple(folded)]


def _query_rows(spec):
    """The query rows per block of a forward specialisation (a block mask's tile height)."""
    return spec.tiling.BM


def _list_keys(spec):
    """The key tile width of a forward specialisation: a block mask's lists of key tiles
    (``scores.block_lists``) are built for it."""
    return spec.tiling.BN


def _columns(t):
    """The column tile width of a backward tiling (keys for dQ, queries for dK/dV; the
    CUDA-core or the tensor-core one)."""
    return t.BC if hasattr(t, "BC") else t.CG * t.TN


def _hopper_launches(inp, spec, views, maps, packed, score_args, sm_count):
    """The Hopper forward's launches: one per view, its q, k, v as TMA tensor maps, its
    output as quads of 16-bit values (``_arrays.packed_view``), on a persistent grid
    (``forward_wgmma.grid_size``)."""
    t, kern = spec.tiling, spec.kernel()
    scale_log2 = inp.acc_dtype.type(inp.scale * LOG2E)
    grid(inp, inp.nq, 1, t.BM, t.DO)       # the limits' check
    # packed sequences: the grid for as many query tiles as the longest sequence has, per
    # sequence (the kernel takes its items from the table, so any grid covers them; this one
    # depends only on what a launch plan's signature holds, so a replayed plan fits every call)
    rows = inp.nq if inp.packed is None else inp.packed.count * -(-inp.packed.max_q // t.BM) * t.BM
    launches = []
    for (q4, _, l3, s3, k4, v4), tmaps, o2 in zip(views, maps, packed):
        b = q4.shape[0] * q4.shape[1]
        g = forward_wgmma.grid_size(rows, b, sm_count, t.BM)
        # the sequence table, or the schedule's argument (forward_wgmma.schedule: causal rows' pairs,
        # the longest-first deal's rounds)
        last = inp.packed.table if inp.packed is not None else forward_wgmma.schedule(
            inp.rules, t.BM, rows, inp.nk, b, g, 2 * math.prod(k4.shape[:2]) * inp.nk * inp.d
            * inp.dtype.itemsize, t.BN, inp.d)      # (the bytes of K and V)
        launches.append((kern, g, t.threads, kern.smem_bytes,
                         (*tmaps, o2, l3, inp.nk, inp.group, scale_log2, *score_args, inp.score_tail(s3), last),
                         inp.stream))
    return launches


_MAPS = {}          # (context, stream, pointer, shape, strides, box rows) -> tensor map
MAX_MAPS = 256      # the table starts afresh when it is full
_RETIRED = []       # the maps of the last full table, kept until the next one fills
_GENERATION = [0]   # how many times the table has started afresh (launch plans' memos check it)
_SLOTS = {}         # context -> _MapSlots
# id(tensor map) -> (id of the memory it describes (``gpu_data``), pointer, shape, strides,
# box rows), as the latest call made or reused it: what a launch plan (``_plans``) needs to
# make the map of the same view of another call's memory. No reference to that memory is
# kept; entries leave with their maps.
MAP_SOURCES = {}


class _View:
    """What ``ops_hopper.tensor_map_4d`` reads of an array: its pointer, shape, strides."""

    def __init__(self, ptr, shape, strides):
        self.shape, self.strides = shape, strides
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "strides": strides,
                                         "typestr": "<u2", "version": 3}


def tensor_map(ptr, shape, strides, rows, ary=None, stream=0):
    """The tensor map of the 16-bit view at ``ptr`` with this shape and these strides
    (``rows``-row boxes; ``ary``: that view as a device array, where the caller has one),
    made once per context, launch stream (an int handle) and such values: a map holds only
    them. On a GPU a new map is copied to the device on ``stream``
    (:class:`_MapSlots`), ordered before that stream's later launches, which is why a map
    made for one stream is not reused on another."""
    from ._runtime import SIMULATOR
    from .launch import context_handle
    key = (None if SIMULATOR else context_handle(), stream, ptr, shape, strides, rows)
    m = _MAPS.get(key)
    capturing = not SIMULATOR and _capturing(stream)
    if capturing and m is not None and not _SLOTS[key[0]].holds_captured(m):
        m = None            # a graph must not read a slot that later maps may take (_MapSlots)
    if m is None:
        if len(_MAPS) >= MAX_MAPS and not capturing:
            # Kernels queued by earlier calls may still read the maps dropped here, and the
            # launches of the call under way may read those it made before this one: wait
            # for the first, and keep the maps until the next time the table fills (after
            # that wait, nothing queued before it can read them).
            if not SIMULATOR:
                from numba import cuda
                cuda.synchronize()
                key = (context_handle(),) + key[1:]    # (the wait makes Numba's context current if none was)
            _RETIRED[:] = _MAPS.values()
            _MAPS.clear()
            MAP_SOURCES.clear()
            _GENERATION[0] += 1
        m = _MAPS[key] = _new_map(ptr, shape, strides, rows, ary, stream, capturing)
    return m


def _capturing(stream):
    """Whether ``stream`` (a handle) is being captured into a CUDA graph (False where the
    driver cannot say)."""
    try:
        from cuda.bindings import driver as cu
        err, status = cu.cuStreamIsCapturing(stream)
        return err == cu.CUresult.CUDA_SUCCESS and status == cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE
    except Exception:  # noqa: BLE001 - not capturing as far as anyone can tell
        return False


def map_generation():
    """A number that changes whenever the table of tensor maps starts afresh: a map found
    in the table under one generation keeps its device memory (its slot is not written
    again) for as long as the generation stays the same (:class:`_MapSlots`)."""
    return _GENERATION[0]


def _new_map(ptr, shape, strides, rows, ary, stream, capturing=False):
    """A new tensor map: in the simulator its twin's, on a GPU encoded on the host into the
    next of the context's slots (:class:`_MapSlots`) and copied on ``stream``."""
    from . import ops_hopper
    from ._runtime import SIMULATOR
    if SIMULATOR:
        return ops_hopper.tensor_map_4d(_View(ptr, shape, strides) if ary is None else ary, rows)
    from .launch import context_handle
    ctx = context_handle()
    slots = _SLOTS.get(ctx)
    if slots is None:
        slots = _SLOTS[ctx] = _MapSlots()
    return slots.put(ptr, shape, strides, rows, stream, capturing)


class _MapSlots:
    """Device memory for one context's tensor maps, ``SLOTS`` of 128 bytes taken in turn,
    with a pinned host twin. A new map is written into the next slot on the host and copied
    with ``cuMemcpyHtoDAsync`` on the launch stream: queued like a launch, before the
    launches that read it. (A copy from pageable memory, as ``numba.cuda.to_device``, waits
    for the work queued before it on the legacy default stream, which PyTorch's default
    stream is: every call with new tensors waited for the kernels of the calls before it.)
    A slot is written again ``SLOTS`` maps later: by then its map has left the table (which
    starts afresh every ``MAX_MAPS`` maps, at most half of ``SLOTS``) and the device has
    been synchronised since (:func:`tensor_map`), so no queued kernel and no copy reads it,
    and a call under way, which makes a handful of maps, is not holding it.

    A map made while its stream is being captured into a CUDA graph (``torch.compile``'s
    "reduce-overhead" mode, ``torch.cuda.graph``) takes one of ``CAPTURED`` slots kept
    apart and never written again: the graph copies the map at each replay, from host to
    device memory that must still hold it then, however many maps were made since.
    (Maps made under capture also never start the table afresh: that waits for the
    device, which a capture forbids.)"""
    SLOTS = 1024
    CAPTURED = 256

    def __init__(self):
        import numpy as np
        from cuda.bindings import driver as cu
        from numba import cuda
        n = self.SLOTS * 128
        self.device = cuda.device_array(n, np.uint8)
        self.device_ptr = _arrays.device_pointer(self.device)
        err, self.host_ptr = cu.cuMemHostAlloc(n, 0)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise MemoryError(f"cuMemHostAlloc of {n} bytes for tensor maps failed: {err!r}")
        self.host_ptr = int(self.host_ptr)
        self.views = [None] * self.SLOTS     # each slot's device array, made on its first use
        self.made = 0
        m = self.CAPTURED * 128             # the slots of maps made under capture
        self.captured = cuda.device_array(m, np.uint8)
        err, self.captured_host = cu.cuMemHostAlloc(m, 0)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise MemoryError(f"cuMemHostAlloc of {m} bytes for tensor maps failed: {err!r}")
        self.captured_host = int(self.captured_host)
        self.captured_made = 0

    def holds_captured(self, m):
        """Whether the map ``m`` lies in the slots of maps made under capture."""
        start = _arrays.device_pointer(self.captured)
        return start <= _arrays.device_pointer(m) < start + 128 * self.CAPTURED

    def put(self, ptr, shape, strides, rows, stream, capturing=False):
        """The map of that view (``ops_hopper.encode_tensor_map_4d``) encoded into the next
        slot and copied on ``stream``: that slot's device array."""
        from cuda.bindings import driver as cu

        from . import ops_hopper
        assert 2 * MAX_MAPS <= self.SLOTS, MAX_MAPS
        if capturing:
            i = self.captured_made
            if i >= self.CAPTURED:
                raise RuntimeError(f"more than {self.CAPTURED} tensor maps made under CUDA-graph capture in this "
                                   "process (each stays for the graphs that copy it): capture fewer distinct inputs")
            self.captured_made += 1
            host, device = self.captured_host + 128 * i, _arrays.device_pointer(self.captured) + 128 * i
            view = self.captured[128 * i:128 * (i + 1)]
        else:
            i = self.made % self.SLOTS
            self.made += 1
            host, device = self.host_ptr + 128 * i, self.device_ptr + 128 * i
            view = self.views[i]
            if view is None:
                view = self.views[i] = self.device[128 * i:128 * (i + 1)]
        ops_hopper.encode_tensor_map_4d(ptr, shape, strides, rows, into=host)
        err, = cu.cuMemcpyHtoDAsync(device, host, 128, stream)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyHtoDAsync of a tensor map failed: {err!r}")
        return view


def _tma_maps(q4, k4, v4, t, stream):
    """The tensor maps of q (``t.BM``-row boxes), k and v (``t.BN``) for the TMA, or None
    (:func:`_tma_map`)."""
    found = tuple(_tma_map(a, rows, stream) for a, rows in ((q4, t.BM), (k4, t.BN), (v4, t.BN)))
    return None if any(m is None for m in found) else found


def _tma_map(a, rows, stream):
    """The tensor map of the 4-D view ``a`` (``rows``-row boxes) for the TMA, or None where
    the view has a stride the TMA cannot take (zero, as grouped heads' repeated K/V axis,
    or not a multiple of 16 bytes) or an unaligned start. A map holds only the address,
    shape and strides, so one made for the same values is reused."""
    ptr, shape, strides = _arrays.device_pointer(a), tuple(a.shape), list(a.strides)
    for i in (2, 1, 0):        # a dim of one element: any stride; the map wants a valid one
        if shape[i] == 1:
            strides[i] = strides[i + 1] * shape[i + 1]
    strides = tuple(strides)
    if ptr % 16 or strides[3] != 2 or any(s <= 0 or s % 16 for s in strides[:3]):
        return None
    if strides != tuple(a.strides):
        a = _arrays.strided_view(a, shape, strides)
    m = tensor_map(ptr, shape, strides, rows, a, stream)
    MAP_SOURCES[id(m)] = (id(getattr(a, "gpu_data", a)), ptr, shape, strides, rows)
    return m


def _split_launches(inp, spec, kern, g, arrays, scale_log2, tail, splits, sm_count, smem_limit, scratch):
    """The launches of a forward with key splits (the CUDA-core family, and the tensor
    cores' one-warp kernel for few query rows): one, or with Z key splits (Z blocks per
    query tile) the forward into per-split partial results and then the merge kernel.
    (The one-warp kernel writes the final results itself when Z = 1.)"""
    q4, k4, v4, o4, l3 = arrays
    t = spec.tiling
    nq, nk = (inp.nq, inp.nk) if inp.packed is None else (inp.packed.max_q, inp.packed.max_k)
    n_kt = scores.band_tiles(inp.rules, t.BM, t.BN, nq, nk)   # key tiles a query tile sees
    # Every CUDA-core forward tiling runs one block per SM (256 threads of 128+ registers);
    # the one-warp tensor-core kernel as many as its shared memory allows: an SM holds the
    # per-block opt-in limit plus 1 KiB, and the driver reserves 1 KiB of it per block.
    resident = 1
    if spec.variant != "forward_simt" and smem_limit:
        resident = max(1, (smem_limit + SMEM_RESERVED) // (spec.smem_bytes + SMEM_RESERVED))
    # every block of the grid (packed: its third axis holds a block row per sequence); the
    # causal cost model's query tiles of differing lengths need more than one of them
    min_tiles = registry.MIN_SPLIT_TILES if spec.variant == "forward_simt" else registry.MIN_SPLIT_TILES_ONE_WARP
    z = splits or registry.forward_splits(math.prod(g), n_kt, sm_count * resident,
                                          inp.scores.causal and nq > t.BM, min_tiles)
    if not 1 <= z <= registry.MAX_SPLITS:
        raise ValueError(f"splits must be between 1 and {registry.MAX_SPLITS}, got {z}. Pass splits=None to "
                         "let registry.forward_splits choose.")
    split_tiles = -(-n_kt // z) if n_kt else 1   # whole key tiles per split
    z = -(-n_kt // split_tiles) if n_kt else 1
    split_keys = split_tiles * t.BN
    if z == 1 and spec.variant == "forward_simt":
        return [(kern, g, t.threads, spec.smem_bytes,
                 (q4, k4, v4, o4, l3, scale_log2, max(split_keys, inp.nk), *tail), inp.stream)]
    b1, b2 = q4.shape[0], q4.shape[1]
    one_warp = spec.variant != "forward_simt"     # (which takes the final results too)
    key_warps = registry.block_splits(z, spec.smem_bytes, smem_limit) if one_warp else 1
    threads, smem_bytes = spec.tiling.threads, spec.smem_bytes
    if key_warps > 1:   # the splits as one block's warps, merged there: the final results
        spec = registry.key_warps_specialisation(spec)
        kern, z = spec.kernel(), 1
        threads, smem_bytes = 32 * key_warps, key_warps * smem_bytes    # (the one-warp kernel's, each)
    if z == 1:          # the one-warp kernel's partial results are final: only their split count is read
        parts = inp.empty_like((b1, 1, 1, 1), inp.acc_dtype)
        parts_ml = inp.empty_like((2 * b1, 1, 1), inp.acc_dtype)
    else:
        parts = inp.empty_like((z * b1, b2, inp.nq, inp.d), inp.acc_dtype)
        parts_ml = inp.empty_like((2 * z * b1, b2, inp.nq), inp.acc_dtype)   # row maxima, then row sums
    scratch += (parts, parts_ml)
    forward = (kern, (g[0] * z,) + g[1:], threads, smem_bytes,
               (q4, k4, v4, parts, parts_ml) + ((o4, l3) if one_warp else ()) + (scale_log2, split_keys, *tail),
               inp.stream)
    if z == 1:
        return [forward]
    merge = registry.specialisation("forward_merge", inp.dtype.name, 0,
                                    scores.PACKED if inp.packed is not None else scores.FULL).kernel()
    if inp.packed is None:
        merged = (merge, b1 * b2 * inp.nq, merge.threads, merge.smem_bytes, (parts, parts_ml, o4, l3), inp.stream)
    else:         # the rows each sequence has (packed views may overlap between leading indices)
        merged = (merge, (b1 * b2 * inp.packed.max_q, 1, inp.packed.count), merge.threads, merge.smem_bytes,
                  (parts, parts_ml, o4, l3, inp.packed.table), inp.stream)
    return [forward, merged]


# --------------------------------------------------------------------------- backward
BACKWARD_FAMILIES = {False: ("backward_dkdv_simt", "backward_dq_simt"),    # CUDA cores
                     True: ("backward_dkdv_mma", "backward_dq_mma"),       # tensor cores (16-bit)
                     "hopper": ("backward_dkdv_wgmma", "backward_dq_wgmma")}


def backward(inp, q, k, v, dout, out, lse, dq, dk, dv, use_async, scratch, cc=None):
    """The backward's launches, per view: a pre-pass, then dK/dV (a block per key tile;
    with grouped heads it sums its group's query heads) and dQ (a block per query tile):
    on a Hopper GPU (``cc`` 9.0) the Hopper family for the 16-bit inputs it takes (views
    the TMA can describe: else the next family), tensor cores for the other 16-bit inputs,
    CUDA cores otherwise. The pre-pass computes ``delta = rowsum(dout ∘ out)`` into a
    buffer appended to ``scratch``: one value per query row, or for the tensor cores the
    stats rows of ``backward_mma`` (lse in log2 units and delta, padded)."""
    low = inp.low
    hopper = None
    # (a TMA map cannot describe an empty axis: a packed batch's sequence without queries
    # or keys takes the next family, which writes its zero gradients)
    if (low and inp.packed is None and inp.nq and inp.nk
            and registry.uses_hopper(inp.dtype.name, inp.d, cc, variant="backward_dkdv_wgmma")):
        hopper = _hopper_backward_views(inp, q, k, v, dout, dq, dk, dv)
    pre = "backward_stats" if low else "backward_delta"
    specs = [registry.specialisation(name, inp.dtype.name, inp.d, inp.scores, use_async)
             for name in (pre,) + BACKWARD_FAMILIES["hopper" if hopper else low]]
    k_delta, k_dkdv, k_dq = (s.kernel() for s in specs)
    t, tq = specs[1].tiling, specs[2].tiling
    rows, rows_q = t.RG * t.TM, tq.RG * tq.TM
    scale_t, scale_log2 = inp.acc_dtype.type(inp.scale), inp.acc_dtype.type(inp.scale * LOG2E)
    # a block mask's table: dQ's query tiles, dK/dV's key tiles; its lists: dQ's key tiles,
    # dK/dV's query tiles
    score_args, slopes = inp.score_args(lse, rows_q, rows, _columns(tq), _columns(t))
    n_stats = stats_rows(inp.nq) if low else inp.nq
    delta = inp.empty_like(inp.lead + ((2, n_stats) if low else (n_stats,)), inp.acc_dtype)
    scratch.append(delta)
    launches = []

    def prepass(b, args):
        return (k_delta, (-(-n_stats // k_delta.rows_per_block), b), 32 * k_delta.rows_per_block, 0, args,
                inp.stream)

    if hopper:
        for do4, o4, l3, dl3 in inp.kernel_views([dout, out, lse, delta], []):
            if inp.nq:
                launches.append(prepass(do4.shape[0] * do4.shape[1], (do4, o4, l3, dl3)))
        return launches + _hopper_backward_launches(inp, specs[1:], hopper, delta, slopes, score_args,
                                                    scale_log2, scale_t)
    for q4, do4, o4, l3, dl3, dq4, s3, k4, v4, dk4, dv4 in inp.kernel_views(
            [q, dout, out, lse, delta, dq, slopes], [k, v, dk, dv]):
        b = q4.shape[0] * q4.shape[1]
        group = inp.group          # the innermost leading axis of the views, when > 1
        assert group == 1 or q4.shape[1] == group, (q4.shape, group)
        tail = (*score_args, inp.score_tail(s3))
        stats = (dl3,) if low else (l3, dl3)
        if inp.nq:
            launches.append(prepass(b, (do4, o4, l3, dl3) if low else (do4, o4, dl3)))
        if inp.nk:
            launches.append((k_dkdv, grid(inp, inp.nk, b // group, rows, t.DO), t.threads, specs[1].smem_bytes,
                             (q4, k4, v4, do4, *stats, dk4, dv4, scale_log2, scale_t, *tail, group), inp.stream))
        if inp.nq:
            launches.append((k_dq, grid(inp, inp.nq, b, rows_q, tq.DO), tq.threads, specs[2].smem_bytes,
                             (q4, k4, v4, do4, *stats, dq4, dq4, scale_log2, scale_t, *tail, 1), inp.stream))
    return launches


def _hopper_backward_views(inp, q, k, v, dout, dq, dk, dv):
    """The Hopper backward's operands per view (``_heads_views``: K/V head ``h // group``
    read by the kernels themselves): the tensor maps of the dK/dV kernel's row operands
    K, V (``BR``-row boxes) and column operands Q, dO (``BC``), those of the dQ kernel (the
    other way round), and dQ, dK, dV as quads of 16-bit values; None where the TMA cannot
    describe a view or an output does not pack (the next family takes the call)."""
    t = backward_wgmma.TILING
    views = _heads_views(inp, [q, dout, dq, k, v, dk, dv])
    stream = _arrays.stream_handle(inp.stream)
    found = []
    for q4, do4, dq4, k4, v4, dk4, dv4 in views:
        dkdv_maps = tuple(_tma_map(a, rows, stream) for a, rows in ((k4, t.BR), (v4, t.BR), (q4, t.BC), (do4, t.BC)))
        dq_maps = tuple(_tma_map(a, rows, stream) for a, rows in ((q4, t.BR), (do4, t.BR), (k4, t.BC), (v4, t.BC)))
        packed = tuple(_arrays.packed_view(a) for a in (dq4, dk4, dv4))
        if any(x is None for x in dkdv_maps + dq_maps + packed):    # (arrays compare elementwise)
            return None
        found.append((q4.shape[0], q4.shape[1], dkdv_maps, dq_maps, packed))
    return found or None


def _hopper_backward_launches(inp, specs, views, delta, slopes, score_args, scale_log2, scale_t):
    """The Hopper backward's launches after the pre-pass: per view (from
    :func:`_hopper_backward_views`) the dK/dV kernel, a block per key tile and K/V head,
    and the dQ kernel, a block per query tile and query head."""
    t = backward_wgmma.TILING
    k_dkdv, k_dq = (s.kernel() for s in specs)
    launches = []
    extra = _heads_views(inp, [delta, slopes])
    assert len(extra) == len(views), "the stats and slopes views fold as q's"
    for (x, hq, dkdv_maps, dq_maps, (dq2, dk2, dv2)), (st4, s3) in zip(views, extra):
        tail = (*score_args, inp.score_tail(s3))
        common = (inp.nq, inp.nk, inp.group, scale_log2, scale_t, *tail)
        if inp.nk:
            g = grid(inp, inp.nk, x * hq // inp.group, t.BR, t.DO)[0]
            launches.append((k_dkdv, g, t.threads, specs[0].smem_bytes, (*dkdv_maps, st4, dk2, dv2, *common),
                             inp.stream))
        if inp.nq:
            g = grid(inp, inp.nq, x * hq, t.BR, t.DO)[0]
            launches.append((k_dq, g, t.threads, specs[1].smem_bytes, (*dq_maps, st4, dq2, dq2, *common),
                             inp.stream))
    return launches
