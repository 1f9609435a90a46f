"""Public entry points: input checking, array-kind handling and kernel dispatch."""
import functools
import math
import numbers

import numpy as np

from . import _arrays, _plans, families, registry
from ._runtime import SIMULATOR
from .launch import context_handle, launch
from . import scores as _scores

MAX_LEN = 2**31 - 1

# Test hook: fill freshly allocated outputs with this value before a launch (NaN in the
# test-suite), so that any element a kernel fails to write shows up as an error.
_POISON = None


# --------------------------------------------------------------------------- inputs
_IDS = {}           # (context, lead, Nq, Nk, dtype, block mask's (B, H)) -> user functions' ids table
MAX_IDS = 64        # the table starts afresh when it is full


class _Inputs:
    """Validated inputs: array kind, dtype, shapes, scale, and the arrays on the device side.

    ``arrays`` maps names to arrays; it starts with q, k, v and may add the backward's
    ``dout`` and ``out`` (shaped like q) and ``lse`` (shaped like q without d).
    ``options``: the score options ``(causal, window, softcap)``; ``slopes``: ALiBi's
    slopes or None.
    """

    def __init__(self, arrays, options, scale, slopes=None, direction="backward", stream=None):
        names = list(arrays)
        values = list(arrays.values())
        causal, window, softcap = options[:3]
        mods = options[3] if len(options) > 3 else None        # a _ModCall or None
        self.rules = _scores.parse(causal, window, softcap, slopes is not None,   # with the values
                                   *(() if mods is None else mods.functions),
                                   nargs=0 if mods is None else len(mods.args),
                                   blocks=mods is not None and mods.block_mask is not None,
                                   exact=mods is not None and mods.block_mask is not None and mods.block_mask.exact)
        self.block_mask = None if mods is None else mods.block_mask
        self.scores = self.rules.spec           # the score rules the kernels compile in
        kinds = [_kind(a, n) for n, a in arrays.items()]
        if len(set(kinds)) > 1:
            desc = ", ".join(f"{n} is a {k} array" for n, k in zip(names, kinds))
            raise TypeError(f"{', '.join(names)} must all be NumPy arrays or all be CUDA device arrays; "
                            f"{desc}. Move them to the same side first (numba.cuda.to_device or .copy_to_host()).")
        self.on_device = kinds[0] == "device"
        dtypes = {n: _arrays.logical_dtype(a) for n, a in arrays.items()}
        data = [n for n in names if n != "lse"]      # lse has the accumulator dtype (checked below)
        for n in data:
            _check_dtype(dtypes[n], n, direction)
        if len({dtypes[n] for n in data}) > 1:
            desc = ", ".join(f"{n}.dtype={dtypes[n]}" for n in data)
            raise TypeError(f"{', '.join(data)} must have the same dtype, got {desc}. Cast them to one "
                            f"dtype first (e.g. {data[1]}.astype({data[0]}.dtype)).")
        self.dtype = dtypes["q"]
        self.low = self.dtype.name in registry.LOW_DTYPES     # 16-bit: the tensor-core family
        # 16-bit floats travel as their uint16 bits: the kernels only move and convert them.
        self.storage = np.dtype(np.uint16) if self.low else self.dtype
        self.acc_dtype = np.dtype(np.float32) if self.low else self.dtype
        if "lse" in dtypes and dtypes["lse"] != self.acc_dtype:
            raise TypeError(f"lse must have dtype {self.acc_dtype.name} for {self.dtype.name} inputs (as "
                            f"attention_fwd returns it), got {dtypes['lse']}. Pass the lse that attention_fwd "
                            "returned for these q, k, v.")
        self.stream = 0
        if self.on_device:
            self.stream = _launch_stream(values) if stream is None else stream
            values = [_arrays.as_numba_device(a, self.storage if self.low and n != "lse" else None)
                      for n, a in zip(names, values)]
        elif self.low:
            values = [a if n == "lse" else a.view(np.uint16) for n, a in zip(names, values)]
        # tuple(): the simulator's device-array shapes do not support negative indices
        shapes = {n: tuple(a.shape) for n, a in zip(names, values)}
        q, k, v = shapes["q"], shapes["k"], shapes["v"]
        for n in ("q", "k", "v"):
            if len(shapes[n]) < 2:
                raise ValueError(f"{n} must have at least 2 dims (..., N, d), got shape {shapes[n]}.")
        self.group = _check_heads(q, k, v)     # query heads per K/V head
        self.lead, self.lead_k = q[:-2], k[:-2]
        self.nq, self.d = q[-2], q[-1]
        self.nk = k[-2]
        if k[-1] != self.d or v[-1] != self.d:
            raise ValueError(f"q, k and v must share the head dim d (last axis), got q {q}, k {k}, v {v}. "
                             "q and k must agree; a v with a smaller head dim can be zero-padded along d "
                             "to q's (then drop the extra output columns).")
        if v[-2] != self.nk:
            raise ValueError(f"k and v must have the same length Nk (axis -2), got k {k} and v {v}. "
                             "Each key needs one value row: pass the k and v of the same sequence.")
        for n in ("dout", "out"):
            if n in shapes and shapes[n] != q:
                raise ValueError(f"{n} must have the shape of q {q}, got {shapes[n]}. Pass "
                                 + ("the out that attention_fwd returned for these q, k, v." if n == "out" else
                                    "the gradient of the loss with respect to that out."))
        if "lse" in shapes and shapes["lse"] != q[:-1]:
            raise ValueError(f"lse must have shape {q[:-1]} (q's shape without d, as returned by "
                             f"attention_fwd), got {shapes['lse']}.")
        if self.d < 1:
            raise ValueError(f"the head dim d must be at least 1, got q {q}. Check the axis order: "
                             "(..., N, d), the head dim last.")
        if self.low and not registry.VARIANTS["forward_mma"].head_dims(self.d):
            raise ValueError(f"{self.dtype.name} attention needs a head dim d that is a multiple of 8 and at "
                             f"most {registry.MMA_MAX_D}, got d={self.d} (q {q}). Zero-pad q, k and v along "
                             f"d to a multiple of 8 (pass scale=1/sqrt({self.d}) to keep the softmax "
                             "unchanged), or use float32.")
        if self.nq > MAX_LEN or self.nk > MAX_LEN:
            raise ValueError(f"sequence lengths must be below 2**31, got Nq={self.nq}, Nk={self.nk}. Query "
                             "rows are independent: split q along Nq and call once per chunk.")
        self.scale = _check_scale(scale, self.d)
        self.batch = math.prod(self.lead)
        self.arrays = dict(zip(names, values))
        self.slopes = None if slopes is None else _check_slopes(slopes, self.lead, self.on_device, self.acc_dtype)
        self.packed = None      # packed sequences' table (numba_flash.varlen), set by their entry points
        if mods is not None and mods.block_mask is not None and mods.args is mods.block_mask.mod_args:
            self.mod_args = mods.block_mask.device_args     # copied to the device once, by block_mask
        else:
            self.mod_args = None if mods is None else _device_mod_args(mods.args, self.stream)
        self.mod_tables = []    # the tables of user functions the kernels read (ids, a block mask's)
        if self.block_mask is not None:
            _check_block_mask(self.block_mask, self.lead, self.nq, self.nk)

    def score_args(self, lse, rows=None, keys=0, list_keys=None, list_rows=0):
        """The kernels' score arguments: window sides, softcap factors and the ALiBi slopes
        as a ``lead + (1,)`` view (stride 0 on the last axis, as the kernels type it);
        without ALiBi a view of ``lse`` (the right type, never read), so that every
        argument is memory a launch plan knows. With a block mask, ``rows`` and ``keys`` are
        the kernels' query and key tile heights, ``list_keys`` the key tiles of its lists
        when not ``keys``, ``list_rows`` the query tiles of its lists per key tile
        (``BlockMask.device_table``)."""
        left, right = self.rules.band()
        cap_in, cap_out = (self.acc_dtype.type(x) for x in self.rules.cap_args(self.scale))
        if self.mod_args is not None:
            return [left, right, cap_in, cap_out], self._mod_ids(rows, keys, list_keys, list_rows)
        if self.slopes is not None:
            src = self.device_slopes
            strides = (0,) * (len(self.lead) - len(src.shape)) + tuple(src.strides)
        else:
            src, strides = lse, tuple(lse.strides)[:-1]
        return [left, right, cap_in, cap_out], _arrays.strided_view(src, self.lead + (1,), strides + (0,))

    def _mod_ids(self, rows=None, keys=0, list_keys=None, list_rows=0):
        """With user functions: per leading index the ALiBi slope (0 without ALiBi), the
        flattened index ``b`` of the dims before the head axis, the head ``h``, ``Nq`` and
        ``Nk``, shape ``lead + (5,)`` in the accumulator dtype (exact: lengths < 2**24 are
        checked), on the device (what ``scores``'s ``score_consts`` reads). Without ALiBi the
        table depends on the shapes only: kept on the device and reused (``_IDS``), as
        each call's copy would wait for the work already queued."""
        if max(self.nq, self.nk, self.batch) >= 1 << 24 and self.acc_dtype == np.float32:
            raise ValueError(f"score_mod/mask_mod take sequences and batches below 2**24 with 16-bit or float32 "
                             f"inputs, got Nq={self.nq}, Nk={self.nk}, {self.batch} leading indices.")
        if self.block_mask is not None:
            self.block_table = self.block_mask.device_table(rows, keys, list_keys, list_rows, self.rules)
            self.mod_tables.append(self.block_table)
        key = (None if SIMULATOR else context_handle(), self.lead, self.nq, self.nk, self.acc_dtype.str,
               None if self.block_mask is None else self.block_mask.shape[:2])
        if self.slopes is None and key in _IDS:
            self.mod_tables.append(_IDS[key])
            return _IDS[key]
        heads = self.lead[-1] if self.lead else 1
        width = 5 if self.block_mask is None else 6
        ids = np.zeros(self.lead + (width,), self.acc_dtype)
        flat = ids.reshape(-1, width)
        n = np.arange(flat.shape[0])
        b, h = n // heads, n % heads
        flat[:, 1], flat[:, 2], flat[:, 3], flat[:, 4] = b, h, self.nq, self.nk
        if self.block_mask is not None:     # ids[..., 5]: the row of the mask's table (scores.block_rules)
            bm, hm = self.block_mask.shape[:2]
            flat[:, 5] = (b % bm) * hm + h % hm
        if self.slopes is not None:
            s = self.device_slopes
            ids[..., 0] = np.broadcast_to(s.copy_to_host() if hasattr(s, "copy_to_host") else np.asarray(s),
                                          self.lead)
            return _arrays.to_device(ids, self.stream)
        if len(_IDS) >= MAX_IDS:
            _IDS.clear()
        found = _IDS[key] = _arrays.to_device(ids)      # (complete before any stream reads it)
        self.mod_tables.append(found)
        return found

    def mod_arrays(self):
        """The device arrays among the user functions' arguments, in order (a launch plan's
        inputs after the call's arrays: :func:`_mod_plan_key`'s order)."""
        return [] if self.mod_args is None else [a for a in self.mod_args if not isinstance(a, (bool, int, float))]

    def score_tail(self, slopes_view):
        """The kernels' last score argument: the slopes' view, or with user functions the
        pair ``(ids view, mod_args)``, with a block mask the triple ``(ids view, mod_args,
        table)`` (the table of the query tile height :meth:`score_args` was last given)."""
        if self.mod_args is None:
            return slopes_view
        return (slopes_view, self.mod_args) + (() if self.block_mask is None else (self.block_table,))

    @functools.cached_property
    def device_slopes(self):
        """The ALiBi slopes on the device, in the accumulator dtype (copied once per call)."""
        if self.on_device:
            return self.slopes
        from numba import cuda
        return cuda.to_device(np.ascontiguousarray(self.slopes, dtype=self.acc_dtype))

    def kernel_views(self, like_q, like_k):
        """:func:`_kernel_views` of arrays shaped like q (leading dims ``(..., Hq)``) and like
        k (``(..., Hkv)``); with grouped heads both as ``(..., Hkv, G)``: q's head axis
        split, k's repeated by a stride-0 axis (no copy)."""
        g = self.group
        if g > 1:
            like_q = [_split_heads(a, len(self.lead), g) for a in like_q]
            like_k = [_split_heads(a, len(self.lead), g, repeat=True) for a in like_k]
        return _kernel_views(list(like_q) + list(like_k), typed_c=self.packed is None)

    def device(self, name):
        """The named input on the device (NumPy inputs are copied, contiguously)."""
        x = self.arrays[name]
        if self.on_device:
            return x
        from numba import cuda
        return cuda.to_device(np.ascontiguousarray(x))

    def empty_like(self, shape, dtype=None):
        """A new device array for an output (in the input dtype, as stored: 16-bit floats as
        uint16 bits; or in ``dtype``), poisoned first in the test-suite."""
        if dtype is not None:
            return _arrays.device_empty(shape, dtype, _POISON, stream=self.stream)
        return _arrays.device_empty(shape, self.dtype, _POISON, None if not self.low else self.storage,
                                    self.stream)

    def result(self, *arrays):
        """NumPy in -> NumPy out; device in -> device arrays out (16-bit bits back in their dtype)."""
        if self.on_device:
            return _finish(self.dtype if self.low else None, arrays)
        return tuple(a.copy_to_host().view(self.dtype) if self.low and a.dtype == self.storage
                     else a.copy_to_host() for a in arrays)

    @property
    def empty(self):
        return self.batch == 0 or self.nq == 0


_STREAMS = {}


def _check_heads(q, k, v):
    """Query heads per K/V head (1 without grouping), or a ValueError naming the fix."""
    if not (len(k) == len(v) and k[:-2] == v[:-2]):
        raise ValueError(f"k and v must have identical leading dims, got k {k} and v {v}. Pass the k and v "
                         "of the same heads.")
    if len(q) == len(k) and q[:-2] == k[:-2]:
        return 1
    if len(q) != len(k) or len(q) < 3 or q[:-3] != k[:-3] or k[-3] == 0 or q[-3] % k[-3]:
        raise ValueError(f"q, k and v must have identical leading dims, or differ only in the head axis (-3) "
                         f"with q's heads a multiple of k's (grouped-query attention), got q {q}, k {k}, "
                         f"v {v}. Broadcast or reshape them first; for GQA pass q (..., Hq, Nq, d) and k, v "
                         "(..., Hkv, Nk, d) with Hq % Hkv == 0.")
    return q[-3] // k[-3]


class _ModCall:
    """A call's user functions ``(score_mod, mask_mod, score_mod_grad)`` and its
    ``mod_args`` as given (calls with them take no launch plan)."""

    def __init__(self, functions, args, block_mask=None):
        self.functions, self.args, self.block_mask = functions, args, block_mask


def _mod_call(score_mod, mask_mod, score_mod_grad, mod_args, block_mask=None):
    """The :class:`_ModCall` of the public options, or None without user functions. A
    block mask brings its ``mask_mod`` and ``mod_args`` where the call gives none."""
    if not isinstance(mod_args, (tuple, list)):
        raise TypeError(f"mod_args must be a tuple of arrays and numbers, got {type(mod_args).__name__}. "
                        "Example: mod_args=(bias_table,) for a score_mod(s, b, h, i, j, table).")
    if block_mask is not None:
        from .blockmask import BlockMask
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a numba_flash.BlockMask (from numba_flash.block_mask), got "
                            f"{type(block_mask).__name__}.")
        if mask_mod is not None and mask_mod is not block_mask.mask_mod:
            raise ValueError(f"mask_mod {getattr(mask_mod, '__qualname__', mask_mod)} is not the block mask's "
                             f"({block_mask!r}): pass the same function, or leave mask_mod out.")
        mask_mod = block_mask.mask_mod
        if not len(mod_args):
            mod_args = block_mask.mod_args
    if score_mod is None and mask_mod is None and score_mod_grad is None:
        if len(mod_args):
            raise ValueError("mod_args were given without a score_mod or mask_mod to read them.")
        return None
    return _ModCall((score_mod, mask_mod, score_mod_grad), tuple(mod_args), block_mask)


def _check_block_mask(bm, lead, nq, nk):
    """A block mask built for this call's shape (its B and H, or 1 for either), else a
    ValueError."""
    B, H = math.prod(lead[:-1]), (lead[-1] if lead else 1)
    b, h, mq, mk = bm.shape
    if (mq, mk) != (nq, nk) or b not in (1, B) or h not in (1, H):
        raise ValueError(f"block_mask was built for (B, H, Nq, Nk) = {bm.shape}; this call has "
                         f"({B}, {H}, {nq}, {nk}) (B: q's leading dims before the head axis, flattened; "
                         "B or H may be 1 in the mask). Build one with numba_flash.block_mask for these shapes.")


def _device_mod_args(args, stream):
    """``mod_args`` as kernel arguments: NumPy arrays (and PyTorch CPU tensors) copied to
    the device, CUDA device arrays (Numba, CuPy, PyTorch, JAX) as Numba views, numbers as Python numbers (Numba
    types ints as int64, floats as float64); anything else a TypeError naming its place."""
    out = []
    for i, a in enumerate(args):
        if _arrays._is_torch(a) and not a.is_cuda:      # a PyTorch CPU tensor: as NumPy
            a = _arrays.host_view(a)
        if isinstance(a, (bool, np.bool_)):
            out.append(bool(a))
        elif isinstance(a, numbers.Integral):
            out.append(int(a))
        elif isinstance(a, numbers.Real):
            out.append(float(a))
        elif isinstance(a, np.ndarray) or _arrays.is_device_array(a):
            try:
                dt = np.dtype(_arrays.logical_dtype(a))
            except TypeError:           # a dtype NumPy has no name for (a PyTorch one)
                dt = np.dtype(np.void)
            if dt.kind not in "biuf" or dt.kind == "f" and dt.itemsize < 4:
                raise TypeError(f"mod_args[{i}] has dtype {dt}; mod_args arrays must be bool, integer, float32 "
                                "or float64. Cast it first (e.g. .astype(np.float32)).")
            out.append(_arrays.to_device(np.ascontiguousarray(a), stream) if isinstance(a, np.ndarray)
                       else _arrays.as_numba_device(a))
        else:
            raise TypeError(f"mod_args[{i}] must be a NumPy or CUDA device array or a number, got "
                            f"{type(a).__name__}.")
    return tuple(out)


def _check_slopes(slopes, lead, on_device, acc_dtype):
    """ALiBi slopes checked: the same array kind as q, a shape that is a tail of q's
    leading dims ending at the head axis ((Hq,), (B, Hq), ...), float32 (or the inputs'
    float64). Device slopes are returned as Numba arrays in the accumulator dtype."""
    kind = _kind(slopes, "alibi_slopes")
    if (kind == "device") != on_device:
        raise TypeError(f"alibi_slopes is a {kind} array but q is {'a device' if on_device else 'a NumPy'} "
                        "array: pass both on the same side.")
    shape = tuple(slopes.shape)
    tails = [lead[len(lead) - n:] for n in range(1, len(lead) + 1)]
    if not lead:
        raise ValueError(f"alibi_slopes needs a head axis: q must be (..., H, N, d), got q with leading dims "
                         f"{lead}. Add a head axis, e.g. q[None].")
    if shape not in tails:
        raise ValueError(f"alibi_slopes must have shape {tails[0]} (one slope per query head) or one of "
                         f"{tails[1:]} (per batch and head), got {shape}.")
    dt = _arrays.logical_dtype(slopes)
    if dt not in (np.dtype(np.float32), acc_dtype):
        raise TypeError(f"alibi_slopes must be float32, got {dt}. Cast it: alibi_slopes.astype(np.float32).")
    if on_device:
        slopes = _arrays.as_numba_device(slopes)
        if dt != acc_dtype:           # float64 inputs with float32 slopes: a small host round trip
            from numba import cuda
            slopes = cuda.to_device(slopes.copy_to_host().astype(acc_dtype))
    return slopes


def _split_heads(x, nlead, g, repeat=False):
    """View ``(..., H, *tail)`` as ``(..., H / g, g, *tail)`` (query-like arrays) or, with
    ``repeat``, ``(..., H, g, *tail)`` with stride 0 on the new axis (K/V-like arrays)."""
    shape, strides = tuple(x.shape), tuple(x.strides)
    h = nlead - 1
    if repeat:
        shape, strides = shape[:h + 1] + (g,) + shape[h + 1:], strides[:h + 1] + (0,) + strides[h + 1:]
    else:
        shape = shape[:h] + (shape[h] // g, g) + shape[h + 1:]
        strides = strides[:h] + (strides[h] * g, strides[h]) + strides[h + 1:]
    return _arrays.strided_view(x, shape, strides)


def _launch_stream(arrays):
    """Launch on the producer's stream when all inputs name the same one (CuPy, PyTorch);
    otherwise wait for each named stream and launch on the default stream."""
    from numba import cuda
    streams = _arrays.producer_streams(arrays)
    streams.discard(None)
    if not streams:
        return 0
    if len(streams) == 1:
        handle = streams.pop()
        if handle not in _STREAMS:     # Numba's wrapper of a stream it does not own: made once
            _STREAMS[handle] = cuda.external_stream(handle)
        return _STREAMS[handle]
    for handle in streams:
        cuda.external_stream(handle).synchronize()
    return 0


def _kind(x, name):
    if isinstance(x, np.ndarray):
        return "NumPy"
    if _arrays.is_device_array(x):
        return "device"
    raise TypeError(f"{name} must be a NumPy array or a CUDA device array (Numba, CuPy, PyTorch, JAX), "
                    f"got {type(x).__name__}. Wrap lists with np.asarray({name}, dtype=np.float32).")


def _check_dtype(dt, name, direction):
    """``dt`` must be one the registry computes ``direction`` in."""
    allowed = registry.dtypes(direction)
    if isinstance(dt, np.dtype) and dt.name in allowed:
        return
    if isinstance(dt, np.dtype) and dt.name in registry.dtypes("forward"):
        raise TypeError(f"{name} has dtype {dt.name}: the {direction} supports {_or(allowed, 'and')} only so "
                        "far. Cast the inputs to float32 for the backward (e.g. x.astype(np.float32)).")
    raise TypeError(f"{name} has dtype {dt}; expected {_or(allowed)}. Cast it first, e.g. "
                    f"{name}.astype(np.float32).")


def _or(names, word="or"):
    return ", ".join(names[:-1]) + f" {word} " + names[-1] if len(names) > 1 else names[0]


def _check_scale(scale, d):
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None (meaning 1/sqrt(d)), got {scale!r}. Pass "
                        "a float, e.g. scale=float(x) for a one-element array.")
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and positive, got {scale}. Use None for 1/sqrt(d).")
    return scale


# --------------------------------------------------------------------------- views
def _kernel_views(arrays, typed_c=True):
    """The arrays as the kernels take them, per launch: matrices ``(..., N, d)`` (the first
    array is one) as 4-D ``(B1, B2, N, d)`` views, per-row arrays ``(..., N)`` (lse,
    delta) as 3-D ``(B1, B2, N)`` views. Arrays with exactly two leading dims are passed
    as they are (no new view objects: each costs host time per call). ``typed_c``: see
    :func:`_fold` (packed sequences' views, never contiguous with more than one head, keep
    layout A whatever their sizes)."""
    lead = len(tuple(arrays[0].shape)) - 2
    if lead == 2:
        return [tuple(arrays if typed_c else map(_arrays.never_f, arrays))]
    is_row = [len(tuple(a.shape)) == lead + 1 for a in arrays]
    mats = [_unit_tail(a) if r else a for a, r in zip(arrays, is_row)]
    return [tuple(_drop_tail(v) if r else v for v, r in zip(views, is_row)) for views in _fold(mats, typed_c)]


def _fold(arrays, typed_c=True):
    """4-D ``(B1, B2, N, d)`` views of arrays that share their leading dims, per launch.

    The leading dims are folded into at most two strided dims, merging a dim into its
    outer neighbour only where that is valid for *every* array, so that block ``b``
    reads the same leading index in each. Returns a list of per-launch tuples of views;
    only layouts that fold into three or more groups need more than one launch (one
    per index of the outermost leading dim). Axes of one index added in front get, with
    ``typed_c``, a stride under which Numba types a C-contiguous view as layout C, as the
    same call with more leading indices has it (``_arrays.unit_axis_stride``), else 0
    (layout A).
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
        for _ in range(2 - len(groups)):
            n, st = groups[0] if groups else (shapes[0][-2], [s[-2] for s in strides])
            pad = []
            for j, a in enumerate(arrays):
                span = 0
                if typed_c:
                    span = _arrays.unit_axis_stride(tuple(g[0] for g in groups) + shapes[j][-2:],
                                                    tuple(g[1][j] for g in groups) + strides[j][-2:],
                                                    a.dtype.itemsize, n * st[j])
                pad.append(span)
            groups.insert(0, (1, pad))
        return [tuple(
            _arrays.strided_view(a, (groups[0][0], groups[1][0]) + shapes[j][-2:],
                                 (groups[0][1][j], groups[1][1][j]) + strides[j][-2:])
            for j, a in enumerate(arrays))]
    first = next(i for i, n in enumerate(lead) if n != 1)
    index = (0,) * first
    launches = []
    for i in range(lead[first]):
        launches += _fold([_arrays.sub_array(a, index + (i,)) for a in arrays])
    return launches


def _unit_tail(x):
    """View ``(..., N)`` as ``(..., N, 1)``, so per-row arrays fold like the others."""
    shape, strides = tuple(x.shape), tuple(x.strides)
    return _arrays.strided_view(x, shape + (1,), strides + (x.dtype.itemsize,))


def _drop_tail(x4):
    return _arrays.strided_view(x4, tuple(x4.shape)[:3], tuple(x4.strides)[:3])


# --------------------------------------------------------------------------- forward
def _cp_async_ready(inp, arrays):
    """``(arrays, aligned, copied)``: device inputs as the kernels will read them — 16-bit
    ones whose rows are not 16-byte aligned copied contiguously (the tensor-core kernels
    load rows with cp.async only) — whether all of them were aligned as given, and
    whether any was copied (a launch plan would then skip the copy: none is kept)."""
    ok = [_arrays.rows_aligned16(a) for a in arrays]
    if inp.low:
        arrays = [a if good else _contiguous_copy(a, inp.stream) for a, good in zip(arrays, ok)]
    return arrays, all(ok), inp.low and not all(ok)


def _contiguous_copy(x, stream):
    """A C-contiguous device copy of a device array, made on the device."""
    kern = registry.specialisation("copy_rows", "uint16", 0).kernel()
    dst = _arrays.device_empty(tuple(x.shape), x.dtype, stream=stream)
    for s4, d4 in _kernel_views([x, dst]):
        b1, b2, n, d = s4.shape
        if b1 * b2 * n * d:
            launch(kern, -(-n * d // kern.threads) * b1 * b2, kern.threads, 0, (s4, d4), stream)
    return dst


_DEVICES = {}


def _device_facts():
    """(SM count, opt-in shared memory per block in bytes, compute capability) of the
    current device; in the simulator (1, None, None)."""
    if SIMULATOR:
        return 1, None, None
    ctx = context_handle()
    facts = _DEVICES.get(ctx)
    if facts is None:
        from numba import cuda
        dev = cuda.get_current_device()
        facts = _DEVICES[ctx] = (dev.MULTIPROCESSOR_COUNT, dev.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                                 tuple(dev.compute_capability))
    return facts


def plan_forward(q, k, v, causal=False, scale=None, splits=None, *, window=None, softcap=None, alibi_slopes=None,
                 score_mod=None, mask_mod=None, mod_args=(), block_mask=None):
    """Everything :func:`attention_fwd` does before its kernel launches: returns
    ``(result, launches)``, where ``result()`` gives what ``attention_fwd`` returns once
    the launches have run and each launch is a tuple of :func:`numba_flash.launch.launch`'s
    arguments. ``bench.py`` uses it to time the kernels alone, next to the whole call.
    ``splits`` forces the number of key splits of the CUDA-core kernel (tests, tuning);
    by default :func:`numba_flash.registry.forward_splits` decides."""
    mods = _mod_call(score_mod, mask_mod, None, mod_args, block_mask)
    return _plan_forward(q, k, v, alibi_slopes, causal, scale, window, softcap, mods, splits=splits)[:2]


def _plan_forward(q, k, v, slopes, causal, scale, window, softcap, mods=None, splits=None, keep_lse=True):
    """:func:`plan_forward`, and a third item: ``capture(stream)``, the call's
    :class:`numba_flash._plans.Plan` (or None) once its launches have run; without
    ``keep_lse`` that plan returns ``(out,)``, its ``lse`` in the plan's scratch."""
    inp = _Inputs({"q": q, "k": k, "v": v}, (causal, window, softcap, mods), scale, slopes, "forward")
    out = inp.empty_like(inp.lead + (inp.nq, inp.d))
    lse = inp.empty_like(inp.lead + (inp.nq,), inp.acc_dtype)
    launches, scratch = [], []
    result = lambda: inp.result(out, lse)  # noqa: E731
    if inp.empty:
        return result, launches, None
    (qd, kd, vd), aligned, copied = _cp_async_ready(inp, [inp.device(n) for n in "qkv"])
    sm_count, smem_limit, cc = _device_facts()
    launches += families.forward(inp, qd, kd, vd, out, lse, inp.low or aligned, sm_count, smem_limit,
                                 splits, scratch, cc)
    result = functools.partial(_results, inp, (out, lse), (qd, kd, vd))
    if not inp.on_device or copied:
        return result, launches, None
    finish = functools.partial(_finish, inp.dtype if inp.low else None)
    inputs = [qd, kd, vd] + ([inp.device_slopes] if inp.slopes is not None else []) + inp.mod_arrays()
    outputs = [(out, inp.dtype)] + ([(lse, inp.acc_dtype)] if keep_lse else [])
    capture = lambda stream: _plans.capture(  # noqa: E731
        inputs, outputs, scratch + ([] if keep_lse else [lse]), launches, finish, stream,
        constants=inp.mod_tables)
    return result, launches, capture


def _results(inp, outputs, held):
    """``inp.result(*outputs)``. ``held``: the device arrays of the call's inputs (NumPy
    inputs' copies, strided inputs' contiguous copies), referenced until the results are
    taken, after the launches: the Hopper family's launches read them through tensor maps,
    which hold their addresses only, so without this reference Numba could free them
    (a pending deallocation flushed) before the kernels were launched."""
    del held
    return inp.result(*outputs)


def _plan_attention(q, k, v, slopes, causal, scale, window, softcap, mods=None):
    """:func:`_plan_forward` for :func:`attention`, whose repeat calls allocate no ``lse``."""
    return _plan_forward(q, k, v, slopes, causal, scale, window, softcap, mods, keep_lse=False)


def _finish(low_dtype, outs):
    """Device outputs as a call returns them: 16-bit results from their uint16 bits."""
    if low_dtype is None:
        return tuple(outs)
    return tuple(_arrays.retyped(a, low_dtype) if a.dtype == np.uint16 else a for a in outs)


def _run(plan):
    result, launches = plan[:2]
    for args in launches:
        launch(*args)
    return result()


def _run_mods(planned, mods):
    """:func:`_run` of a call with user functions; Numba's compile errors (and in the
    simulator, which calls the functions as Python, their errors) become a TypeError
    naming the functions."""
    try:
        return _run(planned)
    except Exception as e:
        from numba.core.errors import NumbaError
        if not (isinstance(e, NumbaError) or SIMULATOR):
            raise
        names = ", ".join(f"{n} {getattr(f, '__qualname__', repr(f))}" for n, f in
                          zip(("score_mod", "mask_mod", "score_mod_grad"), mods.functions) if f is not None)
        types = [type(a).__name__ for a in mods.args]
        if isinstance(e, NumbaError):
            raise TypeError(f"{names} did not compile into the kernel (mod_args types: {types}). "
                            f"Numba says: {str(e).strip()[:1500]}") from e
        raise TypeError(f"{names} failed in the simulator's kernel (mod_args types: {types}): "
                        f"{type(e).__name__}: {str(e).strip()[:1500]}. score_mod and score_mod_grad must "
                        "return a number, mask_mod a bool.") from e


def _mod_plan_key(mods, slopes):
    """``(key, arrays)`` for a launch plan of a call with user functions: the key holds
    the functions, the block mask and the numbers among ``mod_args`` (by type and value),
    ``arrays`` the device arrays among them (in order: the plan reads their pointers per
    call). None where a plan cannot serve: ALiBi slopes (their table is uploaded per
    call), NumPy arrays (copied per call) or bools among ``mod_args``."""
    if slopes is not None:
        return None
    bm = mods.block_mask
    args = bm.device_args if bm is not None and mods.args is bm.mod_args else mods.args
    key, arrays = [], []
    for a in args:
        if type(a) in (int, float):
            key.append((type(a), a))
        elif _plans.array_kind(a) is not None:
            key.append("array")
            arrays.append(a)
        else:
            return None
    return (mods.functions, bm, tuple(key)), arrays


def _call(name, planner, arrays, options):
    """The results in the kind of the call's ``q`` (:func:`_arrays.like`; PyTorch CPU
    tensors go in as NumPy views), computed by :func:`_compute`."""
    q = arrays[1 if name == "backward" else 0]
    found = _compute(name, planner, tuple(_arrays.host_view(a) for a in arrays), options)
    return _arrays.like(q, found)


def _compute(name, planner, arrays, options):
    """A call through its cached launch plan when there is one (:mod:`numba_flash._plans`),
    otherwise through ``planner`` (which then leaves a plan behind)."""
    mods, extra, mods_key = options[-1], [], ()
    if mods is not None:
        found = _mod_plan_key(mods, arrays[-1])
        if found is None:                      # user functions a plan cannot hold
            return _run_mods(planner(*arrays, *options), mods)
        mods_key, extra = (found[0],), found[1]
    base = tuple(tuple(o) if isinstance(o, list) else o for o in options[:-1])   # hashable
    # the family choice, which the environment may change, is part of the plan's signature
    sig = _plans.signature(name, [a for a in arrays if a is not None] + extra,
                           base + mods_key + (registry.hopper_choice(),))
    plan = _plans.lookup(sig)
    if plan is not None:
        found = plan.run(sig, _POISON, like=arrays[1 if name == "backward" else 0])
        if found is not None:
            return found
    planned = planner(*arrays, *base, mods)
    found = _run(planned) if mods is None else _run_mods(planned, mods)
    if sig is not None and planned[2] is not None:
        _plans.remember(sig, planned[2](sig.stream))
    return found


def attention_fwd(q, k, v, *, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None,
                  score_mod=None, mask_mod=None, mod_args=(), block_mask=None):
    """attention_fwd(q, k, v, *, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None, score_mod=None, mask_mod=None, mod_args=(), block_mask=None) -> (out, lse)

    Exact attention forward: ``out = softmax(scale · q kᵀ [+ score rules]) v`` and the
    log-sum-exp ``lse`` of each row of scores, which :func:`attention_bwd` needs.
    Equivalent to :func:`numba_flash.reference.attention_fwd` (float64 oracle), fused:
    no ``Nq × Nk`` matrix is ever stored.

    Args:
        q: ``(..., Nq, d)``; k, v: ``(..., Nk, d)``, identical leading dims (any number,
            including none), except for grouped-query attention (GQA, MQA): q
            ``(..., Hq, Nq, d)`` and k, v ``(..., Hkv, Nk, d)`` with ``Hq % Hkv == 0``;
            query head ``h`` reads K/V head ``h // (Hq // Hkv)`` (no copy of K or V is
            made). All one dtype: float32 or float64 (CUDA cores, any d), or
            float16 or bfloat16 (tensor cores, ``mma.sync``; d a multiple of 8, at most
            256; bfloat16 host arrays as ``ml_dtypes.bfloat16``). NumPy arrays or PyTorch
            CPU tensors, or CUDA device arrays (Numba, CuPy, PyTorch, JAX: anything with
            ``__cuda_array_interface__`` or CUDA DLPack). Any strides: host inputs are
            copied to the device contiguously; device inputs are read in place through
            their strides (no copy), except 16-bit rows that are not contiguous and
            16-byte aligned, which are first copied on the device.
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
        window: ``(left, right)``, each an int >= 0 or None (unbounded): a sliding
            window. With ``off = Nk - Nq``, query ``i`` sees key ``j`` iff
            ``i + off - left <= j <= i + off + right``. ``causal=True`` is ``right = 0``;
            given both, the tighter bound wins. Key tiles outside the band are skipped,
            so the cost follows the visible area.
        softcap: ``c > 0`` or None: scores ``s = scale · q kᵀ`` become ``c · tanh(s / c)``
            before masking and bias (Gemma 2's logit softcapping).
        alibi_slopes: ALiBi, the bias ``-slope_h · |i + off - j|`` added to the (capped)
            score of query head ``h``: float32, shape ``(Hq,)`` (one slope per query
            head) or ``(B, Hq)`` (any tail of q's leading dims ending at the head axis);
            NumPy or device array, as q. With float64 inputs the slopes may be float64;
            float32 device slopes are then converted through the host (a small copy
            each call, and no launch plan).

    Returns:
        ``out (..., Nq, d)`` in the input dtype, and ``lse (..., Nq)``, the natural-log
        log-sum-exp of the scaled visible scores per query row (float64 for float64
        inputs, float32 otherwise). 16-bit inputs: scores, softmax and accumulation
        in float32, P rounded to the input dtype for the P·V product.

    Array kinds: results come back as q's kind. NumPy arrays for NumPy; PyTorch tensors
    for PyTorch tensors, on q's device (CUDA tensors run on the GPU; CPU tensors take the
    host path, like NumPy); CuPy arrays for CuPy; JAX arrays for JAX (through DLPack,
    after a device synchronisation); Numba device arrays for Numba and other device
    arrays. Device results are never copied: the tensor or array views
    numba_flash's pool memory and keeps it alive while it lives.

    Streams: with PyTorch tensors the kernel runs on PyTorch's current stream; with CuPy
    arrays on the stream their ``__cuda_array_interface__`` names (CuPy's current stream
    when they were exported). So it runs after the work that produced the inputs, and the
    results are ready for work queued on that stream afterwards, with no host
    synchronisation. (If q, k and v name different streams, each is synchronised and the
    default stream is used.) Numba device arrays run on the default stream. Outputs are
    allocated on that stream from numba_flash's memory pool, and returned to it on that
    stream when garbage-collected (see :func:`numba_flash.release_cached_memory`): use
    them on another stream only after synchronising with it, as with PyTorch tensors.

    Non-finite inputs are not checked for (that would cost a pass over the inputs); they
    propagate as IEEE arithmetic does, and the NaNs land where the float64 oracle's do:

    * a NaN or ±inf in row ``i`` of q: ``out[i]`` and ``lse[i]`` are NaN;
    * a NaN in key row ``j`` of k: ``out`` and ``lse`` are NaN in every row that sees key
      ``j``; an inf there makes NaN the rows whose score with key ``j`` is +inf or NaN
      (a -inf score just gives key ``j`` zero weight);
    * an inf or NaN in ``v[j, c]``: column ``c`` of ``out`` is inf or NaN in the rows that
      see key ``j`` (``lse`` is unaffected), and may be NaN in rows where key ``j`` is
      masked, as in the oracle's ``P @ v`` (``0 · inf`` is NaN).

    In the simulator such inputs raise no NumPy ``RuntimeWarning`` from the simulated
    threads; the results are the same as on a GPU.
    """
    return _call("forward", _plan_forward, (q, k, v, alibi_slopes),
                 (causal, scale, window, softcap, _mod_call(score_mod, mask_mod, None, mod_args, block_mask)))


def attention(q, k, v, *, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None,
              score_mod=None, mask_mod=None, mod_args=(), block_mask=None):
    """attention(q, k, v, *, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None, score_mod=None, mask_mod=None, mod_args=(), block_mask=None) -> out

    Exact attention ``out = softmax(scale · q kᵀ [+ score rules]) v``, fused (no
    ``Nq × Nk`` matrix is stored): :func:`attention_fwd` without the ``lse``.
    Equivalent to :func:`numba_flash.reference.attention` (float64 oracle).

    Args:
        q: ``(..., Nq, d)``; k, v: ``(..., Nk, d)``, identical leading dims (any number,
            including none; or q ``(..., Hq, Nq, d)`` and k, v ``(..., Hkv, Nk, d)``,
            ``Hq % Hkv == 0``: grouped-query attention). All one dtype: float32, float64, float16 or bfloat16
            (``ml_dtypes.bfloat16`` on the host; 16-bit: d a multiple of 8, at most 256).
            NumPy arrays or PyTorch CPU tensors, or CUDA device arrays (Numba, CuPy,
            PyTorch, JAX), any strides.
        causal: mask future keys, bottom-right aligned when ``Nq != Nk``: query ``i``
            sees key ``j`` iff ``j <= i + Nk - Nq`` (PyTorch's ``is_causal`` is top-left
            aligned; the two agree when ``Nq == Nk``). A row that sees no key gives 0.
        scale: multiplies ``q kᵀ`` before the softmax; ``None`` means ``1/sqrt(d)``.
        window, softcap, alibi_slopes: a sliding window ``(left, right)``, logit
            softcapping ``c · tanh(s / c)`` and ALiBi slopes: see :func:`attention_fwd`.

    Returns:
        ``out (..., Nq, d)`` in the input dtype, of q's kind (NumPy, PyTorch, CuPy or
        Numba: see :func:`attention_fwd`), with no host round trip for device inputs.

    Raises ``TypeError`` / ``ValueError``, naming the argument and the fix, before any
    kernel runs. Streams, memory and non-finite inputs: see :func:`attention_fwd`.
    """
    return _call("attention", _plan_attention, (q, k, v, alibi_slopes),
                 (causal, scale, window, softcap, _mod_call(score_mod, mask_mod, None, mod_args, block_mask)))[0]


# --------------------------------------------------------------------------- backward
def attention_bwd(dout, q, k, v, out, lse, *, causal=False, scale=None, window=None, softcap=None,
                  alibi_slopes=None, score_mod=None, score_mod_grad=None, mask_mod=None, mod_args=(), block_mask=None):
    """attention_bwd(dout, q, k, v, out, lse, *, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None, score_mod=None, score_mod_grad=None, mask_mod=None, mod_args=(), block_mask=None) -> (dq, dk, dv)

    Gradients of attention: with ``out = softmax(scale · q kᵀ [+ mask]) v`` and a loss
    ``L``, returns ``dL/dq, dL/dk, dL/dv`` given ``dout = dL/d out``. Equivalent to
    :func:`numba_flash.reference.attention_bwd` (float64 oracle). P is recomputed from
    ``lse`` tile by tile, so extra memory is O(N): the gradients and one
    ``delta = rowsum(dout ∘ out)`` value per query row.

    Args:
        dout: ``(..., Nq, d)``, the gradient of the loss with respect to ``out``.
        q, k, v: as for :func:`attention_fwd` (float32, float64, float16 or bfloat16;
            16-bit inputs run on tensor cores, with P and dS rounded to the input dtype
            before their products and float32 accumulation).
        out, lse: what :func:`attention_fwd` returned for the same ``q, k, v, causal,
            scale`` (``out`` shaped like q, ``lse`` like q without its last axis).
        causal, scale, window, softcap, alibi_slopes: as for :func:`attention_fwd`; must
            be the forward's. The softcap's derivative ``1 - tanh²`` is included; the
            slopes get no gradient.

    Returns:
        ``dq (..., Nq, d)``, ``dk (..., Nk, d)``, ``dv (..., Nk, d)`` in the input
        dtype (``dk``, ``dv`` shaped like k and v: with grouped heads, summed over each
        group's query heads, in a fixed order), of q's kind (see :func:`attention_fwd`).

    Same array-kind and stream rules as :func:`attention_fwd`; dout, q, k, v and out
    share one dtype, and lse has the forward's (float32 for 16-bit inputs). Rows with no
    visible key contribute zero gradient. Non-finite values spread further than in the
    forward: a NaN in one query row reaches ``dk`` and ``dv`` of every key it sees, and
    through them usually every gradient. The result is deterministic: no atomics, every gradient element is written by exactly one thread,
    so equal inputs give bitwise-equal gradients.
    """
    return _call("backward", _plan_backward, (dout, q, k, v, out, lse, alibi_slopes),
                 (causal, scale, window, softcap, _mod_call(score_mod, mask_mod, score_mod_grad, mod_args, block_mask)))


def plan_backward(dout, q, k, v, out, lse, causal=False, scale=None, *, window=None, softcap=None,
                  alibi_slopes=None, score_mod=None, score_mod_grad=None, mask_mod=None, mod_args=(), block_mask=None):
    """:func:`attention_bwd` up to its kernel launches; see :func:`plan_forward`."""
    mods = _mod_call(score_mod, mask_mod, score_mod_grad, mod_args, block_mask)
    return _plan_backward(dout, q, k, v, out, lse, alibi_slopes, causal, scale, window, softcap, mods)[:2]


def _plan_backward(dout, q, k, v, out, lse, slopes, causal, scale, window, softcap, mods=None):
    """:func:`plan_backward`, and a third item: ``capture(stream)`` (see :func:`_plan_forward`)."""
    if mods is not None and mods.functions[0] is not None and mods.functions[2] is None:
        raise ValueError("the backward of a score_mod needs score_mod_grad(score, b, h, i, j, *mod_args), its "
                         "derivative d score_mod / d score (1.0 for an additive bias): Numba cannot "
                         "differentiate a function.")
    inp = _Inputs({"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse},
                  (causal, window, softcap, mods), scale, slopes)
    dq = inp.empty_like(inp.lead + (inp.nq, inp.d))
    dk = inp.empty_like(inp.lead_k + (inp.nk, inp.d))
    dv = inp.empty_like(inp.lead_k + (inp.nk, inp.d))
    launches = []
    result = lambda: inp.result(dq, dk, dv)  # noqa: E731
    if inp.batch == 0 or inp.nq + inp.nk == 0:
        return result, launches, None
    dev = {n: inp.device(n) for n in ("q", "k", "v", "dout", "out", "lse")}
    scratch = []
    read = ("q", "k", "v", "dout")
    ready, aligned, copied = _cp_async_ready(inp, [dev[n] for n in read])
    dev.update(zip(read, ready))
    launches += families.backward(inp, *(dev[n] for n in ("q", "k", "v", "dout", "out", "lse")), dq, dk, dv,
                                  inp.low or aligned, scratch, cc=_device_facts()[2])
    result = functools.partial(_results, inp, (dq, dk, dv), tuple(dev.values()))
    if not inp.on_device or not (inp.nq and inp.nk) or copied:
        return result, launches, None
    inputs = [dev[n] for n in ("dout", "q", "k", "v", "out", "lse")]     # the signature's order
    inputs += ([inp.device_slopes] if inp.slopes is not None else []) + inp.mod_arrays()
    capture = lambda stream: _plans.capture(  # noqa: E731
        inputs, [(dq, inp.dtype), (dk, inp.dtype), (dv, inp.dtype)], scratch, launches,
        functools.partial(_finish, inp.dtype if inp.low else None), stream, constants=inp.mod_tables)
    return result, launches, capture
