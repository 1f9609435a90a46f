"""Packed sequences: variable-length batches and KV caches (serving layouts).

Both entry points here reduce to one kernel feature, packed rows (``scores.ScoreSpec``'s
``packed``): the queries and keys of all sequences lie in one ``(tokens, heads, d)``
array each, and a table of ``(q_start, q_len, k_start, k_len)`` per sequence tells each
block of the forward kernels which rows are its sequence's. No row is copied or padded:

* :func:`attention_varlen_fwd` / :func:`attention_varlen`: FlashAttention's
  ``flash_attn_varlen_func`` layout, sequences delimited by ``cu_seqlens`` prefix sums;
* :func:`attention_with_kvcache`: one cache row block per sequence, ``(B, Nmax, H, d)``,
  of which sequence ``b`` uses the first ``cache_seqlens[b]`` rows (plus any ``k_new``
  appended in place first).

The sequence metadata (``cu_seqlens``, ``cache_seqlens``) is checked on the host before
any launch, so device metadata is first copied to the host (a few bytes, and a wait for
the work queued before it); pass NumPy metadata to avoid that wait, or, for a KV cache,
``check_metadata=False``, which reads it on the device (``kernels/kv_metadata.py``).
"""
import dataclasses
import functools

import numpy as np

from . import _arrays, _plans, api, families, registry, scores
from .kernels import forward_wgmma, wgmma_schedule

MAX_SEQUENCES = families.MAX_GRID_Y      # one grid row (axis z) per sequence


@dataclasses.dataclass(frozen=True)
class Packed:
    """The sequence table of a packed call, as ``families`` launches it."""
    table: object        # (S, 4) int32 on the device: q_start, q_len, k_start, k_len
    count: int           # S, the number of sequences
    max_q: int           # the longest query and key sequences (the grid covers them)
    max_k: int
    pages: object = None     # a paged cache's page table (S, max pages) int32 on the device, else ``table``
    page_size: int = 0
    tiles: int = 0           # the Hopper forward's query tiles over all sequences (the table's work order)
    # rows between one sequence's last key and the next sequence's first may hold anything
    # (a KV cache's unused rows, even NaN): kernels must not read them (the Hopper family's
    # TMA boxes would, so it leaves such calls to the mma.sync family)
    gaps: bool = False

    def __post_init__(self):
        if self.pages is None:
            object.__setattr__(self, "pages", self.table)


# --------------------------------------------------------------------------- metadata
def _host_ints(x, name, length=None):
    """A 1-D integer array of sequence metadata on the host (device arrays are copied)."""
    x = _arrays.host_view(x)
    if not isinstance(x, np.ndarray):
        if not _arrays.is_device_array(x):
            raise TypeError(f"{name} must be a 1-D int32 NumPy or device array, got {type(x).__name__}.")
        x = _arrays.as_numba_device(x).copy_to_host()
    if x.ndim != 1 or x.dtype.kind not in "iu":
        raise TypeError(f"{name} must be a 1-D integer array (int32, as FlashAttention's), got dtype "
                        f"{x.dtype} and shape {x.shape}.")
    if length is not None and x.shape[0] != length:
        raise ValueError(f"{name} must have {length} entries, got {x.shape[0]}.")
    return x.astype(np.int64)


def _bounds(x):
    """``(min, max)`` of a 1-D integer array ((0, 0) if empty); through a Python list for
    a decoding batch's few entries (two NumPy reductions cost microseconds each)."""
    if x.size == 0:
        return 0, 0
    if x.size <= 256:
        values = x.tolist()
        return min(values), max(values)
    return int(x.min()), int(x.max())


def _prefix_sums(cu, name, total, total_name):
    """Checked ``cu_seqlens``: starts at 0, never decreases, ends at ``total``."""
    if cu.shape[0] < 1:
        raise ValueError(f"{name} must have batch + 1 >= 1 entries (prefix sums starting at 0), got none.")
    if cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise ValueError(f"{name} must start at 0 and never decrease (prefix sums of the sequence lengths), "
                         f"got {cu.tolist() if cu.size <= 16 else cu}.")
    if cu[-1] != total:
        raise ValueError(f"{name}[-1] must equal the number of rows of {total_name} ({total}), got {cu[-1]}. "
                         "Every row must belong to a sequence.")
    return cu


def _sequences(cu_q, cu_k, total_q, total_k, max_q, max_k):
    """``(cu_q, cu_k, lens_q, lens_k)``: checked ``cu_seqlens`` on the host and the lengths;
    ``max_seqlen_q``, ``max_seqlen_k`` (when given) checked against them."""
    cu_q = _prefix_sums(_host_ints(cu_q, "cu_seqlens_q"), "cu_seqlens_q", total_q, "q")
    cu_k = _prefix_sums(_host_ints(cu_k, "cu_seqlens_k", cu_q.shape[0]), "cu_seqlens_k", total_k, "k")
    lens_q, lens_k = np.diff(cu_q), np.diff(cu_k)
    for given, lens, n in ((max_q, lens_q, "max_seqlen_q"), (max_k, lens_k, "max_seqlen_k")):
        if given is not None and lens.size and int(given) < int(lens.max()):
            raise ValueError(f"{n}={given} is shorter than the longest sequence ({int(lens.max())}). "
                             "Pass None to let the sequence table decide.")
    return cu_q, cu_k, lens_q, lens_k


def _table(starts_q, lens_q, starts_k, lens_k, block_q=0):
    """The sequence table ``(S, 7)`` int32 on the host: q_start, q_len, k_start, k_len per
    sequence, then the Hopper forward's work order for its ``block_q``-row query tiles
    (``wgmma_schedule.work_order``; zeros for ``block_q = 0``: KV-cache calls, which that
    family never takes)."""
    count = len(lens_q)
    if count > MAX_SEQUENCES:
        raise ValueError(f"at most {MAX_SEQUENCES} sequences per call, got {count}: call once per part "
                         "of the batch.")
    table = np.empty((count, 7), np.int32)
    table[:, 0], table[:, 1], table[:, 2], table[:, 3] = starts_q, lens_q, starts_k, lens_k
    table[:, 4:] = wgmma_schedule.work_order(lens_q, lens_k, block_q) if block_q else 0
    return table


_VARLEN_TABLES = {}     # a varlen call's metadata -> its checked sequence table (repeat calls)
MAX_VARLEN_TABLES = 64


def _varlen_table(cu_q, cu_k, total_q, total_k, max_q, max_k, block_q):
    """``(table, longest query sequence, longest key sequence)`` of a varlen call: the
    metadata checked (:func:`_sequences`) and the table built (:func:`_table`) once per
    distinct metadata, then kept: the layers of a model's forward pass repeat one batch's
    ``cu_seqlens``, and their calls skip both (the host's part of a call was 0.41 ms
    against 0.09 for a padded batch on an H200: docs/performance.md item 67)."""
    cu_q, cu_k = _host_ints(cu_q, "cu_seqlens_q"), _host_ints(cu_k, "cu_seqlens_k")
    key = (cu_q.tobytes(), cu_k.tobytes(), total_q, total_k, max_q, max_k, block_q)
    found = _VARLEN_TABLES.get(key)
    if found is None:
        cu_q, cu_k, lens_q, lens_k = _sequences(cu_q, cu_k, total_q, total_k, max_q, max_k)
        count = lens_q.shape[0]
        longest = (int(lens_q.max()), int(lens_k.max())) if count else (0, 0)
        found = (_table(cu_q[:-1], lens_q, cu_k[:-1], lens_k, block_q),) + longest
        if len(_VARLEN_TABLES) >= MAX_VARLEN_TABLES:
            _VARLEN_TABLES.clear()
        _VARLEN_TABLES[key] = found
    return found


# --------------------------------------------------------------------------- layouts
def _swap01(x):
    """``(T, H, d)`` as ``(H, T, d)``: a view in the array's own kind (NumPy, PyTorch,
    Numba); other device kinds transpose themselves."""
    if isinstance(x, np.ndarray):
        return x.transpose(1, 0, 2)
    if _arrays._is_torch(x):
        return x.permute(1, 0, 2)
    if getattr(x, "__cuda_ndarray__", False):
        shape, strides = tuple(x.shape), tuple(x.strides)
        return _arrays.strided_view(x, (shape[1], shape[0], shape[2]), (strides[1], strides[0], strides[2]))
    return x.transpose(1, 0, 2)


def _merge01(x, name, view_only=False):
    """``(B, N, H, d)`` as ``(B·N, H, d)``: a view where the strides allow, else a copy in
    PyTorch, CuPy and NumPy, or (Numba arrays, and ``view_only``: KV caches, which a copy
    would leave stale once appended to, and which are too large to copy per call) a
    ValueError."""
    shape = tuple(x.shape)
    new = (shape[0] * shape[1],) + shape[2:]
    strides = tuple(x.stride()) if _arrays._is_torch(x) else tuple(x.strides)
    mergeable = shape[0] <= 1 or shape[1] <= 1 or strides[0] == shape[1] * strides[1]
    if not mergeable and (view_only or getattr(x, "__cuda_ndarray__", False)):
        raise ValueError(f"{name} must have its first two axes contiguous ((B, N) mergeable into B·N rows), "
                         f"got strides {strides} for shape {shape}. Pass a contiguous array.")
    if getattr(x, "__cuda_ndarray__", False):
        return _arrays.strided_view(x, new, (strides[0] if shape[1] == 1 else strides[1],) + strides[2:])
    return x.reshape(new)


def _check_rank(x, name, rank, layout):
    shape = tuple(x.shape)
    if len(shape) != rank:
        raise ValueError(f"{name} must be {layout}, got shape {shape}.")
    return shape


def _forward(inp, sig_arrays, uploads, max_q, max_k, out_shape, q_kind, group_rows=0, page_size=0, append=None,
             gaps=False, made=None, sig=None, meta=None):
    """The packed forward of ``inp`` (q, k, v given as ``(H, T, d)``), through a launch
    plan when one fits (:mod:`numba_flash._plans`; device inputs, no ALiBi), else the
    full path, which leaves a plan behind; returns ``(out, lse)`` in ``q_kind``'s kind,
    ``out`` shaped ``out_shape + (Hq, d)`` and lse ``out_shape + (Hq,)``, C-contiguous.

    ``sig_arrays``: the user's arrays the call reads and writes, in the order of the
    launches' inputs (q, k, v, then for appends k_new, k_cache, v_new, v_cache);
    ``uploads``: host int32 arrays copied to the device per call: the sequence table
    (:func:`_table`), then a paged cache's page table, then the append positions;
    ``max_q``, ``max_k``: the grid's query rows and the key count that sizes the key
    splits (a KV cache's capacity, so that the launches do not change as it fills);
    ``group_rows``: q is :func:`_grouped_rows`' view, ``(Hkv, R, d)``, groups of that many
    query heads as rows (one query per sequence), and out and lse are viewed alike;
    ``append``: ``(k_cache, v_cache, k_new, v_new)`` of device caches to append to first;
    ``gaps``: the keys' rows have gaps between sequences (:class:`Packed`); ``made``: a
    list the plan that ran or was captured is appended to; ``sig``: the call's plan
    signature where the caller made it and tried its plan (:func:`_through_plan`), else
    made and tried here; ``meta``: ``(cache_seqlens, block_table, n_new, num_pages)`` of a
    KV-cache call that reads its metadata on the device (:func:`_metadata_launches`; the
    uploads are then the sequence table alone, and ``sig_arrays`` end with the metadata).
    """
    from numba import cuda
    inp.scores = dataclasses.replace(inp.scores, packed=True, paged=bool(page_size))
    if sig is None:
        if inp.on_device and inp.slopes is None:
            sig = _plans.signature("packed", sig_arrays, (inp.rules, inp.scale, max_q, max_k, page_size, group_rows,
                                                          out_shape, tuple(u.shape for u in uploads)))
        found = _through_plan(sig, uploads, q_kind, made)
        if found is not None:
            return found
    devs = [cuda.to_device(u, stream=inp.stream) for u in uploads]
    table = uploads[0]
    launches, inputs, scratch = [], [], []
    if meta is None:
        first, meta_inputs = [], []
        pages, pos = (devs[1] if page_size else None), devs[-1]
    else:
        first, meta_inputs, pages, pos = _metadata_launches(inp, *meta, devs[0], page_size, max_k)
        scratch += [pos] + ([pages] if page_size else [])
    inp.packed = Packed(devs[0], table.shape[0], max_q, max_k, pages, page_size,
                        int(table[-1, 4]) if table.shape[0] else 0, gaps)
    hq, d = inp.lead[0] * max(group_rows, 1), inp.d
    out = inp.empty_like(out_shape + (hq, d))
    lse = inp.empty_like(out_shape + (hq,), inp.acc_dtype)
    copied = False
    if inp.nq and inp.packed.count and max_q:
        if group_rows:
            o_item, l_item = out.dtype.itemsize, lse.dtype.itemsize
            out_t = _arrays.strided_view(out, (inp.lead[0], inp.nq, d), (group_rows * d * o_item, d * o_item, o_item))
            lse_t = _arrays.strided_view(lse, (inp.lead[0], inp.nq), (group_rows * l_item, l_item))
        else:
            out_t = _swap01(_arrays.strided_view(out, (inp.nq, hq, d), _c_strides(out, 3)))
            lse2 = _arrays.strided_view(lse, (inp.nq, hq), _c_strides(lse, 2))
            lse_t = _arrays.strided_view(lse2, (hq, inp.nq), tuple(reversed(lse2.strides)))
        (qd, kd, vd), aligned, copied = api._cp_async_ready(inp, [inp.device(n) for n in "qkv"])
        sm_count, smem_limit, cc = api._device_facts()
        launches += families.forward(inp, qd, kd, vd, out_t, lse_t, inp.low or aligned, sm_count, smem_limit,
                                     None, scratch, cc)
        inputs += [qd, kd, vd]
    if append is not None:
        appends, written = _append_launches(inp, *append, pos, pages)
        launches = appends + launches
        inputs += written
    launches = first + launches
    inputs += meta_inputs
    for args in launches:
        api.launch(*args)
    if sig is not None and not copied and len(inputs) == len(sig_arrays):
        finish = functools.partial(api._finish, inp.dtype if inp.low else None)
        # appends: the caches are read (inputs 1, 2) and written (4, 6): the same arrays twice
        plan = _plans.capture(inputs, [(out, inp.dtype), (lse, inp.acc_dtype)], scratch, launches, finish,
                              sig.stream, devs, aliases={4: 1, 6: 2} if append is not None else {},
                              host_uploads=uploads)
        _plans.remember(sig, plan)
        if made is not None and plan is not None:
            made.append(plan)
    return _arrays.like(q_kind, inp.result(out, lse))


def _through_plan(sig, uploads, q_kind, made=None):
    """The results of the call of ``sig`` (None: no signature) through its launch plan, in
    ``q_kind``'s kind, or None where it has none or the plan's pool cannot serve it."""
    plan = _plans.lookup(sig)
    if plan is None:
        return None
    found = plan.run(sig, api._POISON, uploads, like=q_kind)
    if found is None:
        return None
    if made is not None:
        made.append(plan)
    return _arrays.like(q_kind, found)


def _c_strides(a, n):
    """The C strides of ``a`` seen with its leading axes merged into ``n`` axes."""
    shape = tuple(a.shape)
    item = a.dtype.itemsize
    strides, acc = [], item
    for size in reversed(shape[len(shape) - n + 1:]):
        strides.append(acc)
        acc *= size
    strides.append(acc)
    return tuple(reversed(strides))


# --------------------------------------------------------------------------- varlen
def attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                         causal=False, scale=None, window=None, softcap=None, alibi_slopes=None):
    """attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None) -> (out, lse)

    Attention over a packed batch of sequences of different lengths (FlashAttention's
    ``flash_attn_varlen_func`` layout), no padding and no copy: sequence ``b`` is rows
    ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] − 1`` of q and rows ``cu_seqlens_k[b] ..
    cu_seqlens_k[b + 1] − 1`` of k and v, and its queries attend to its keys only, exactly
    as :func:`numba_flash.attention_fwd` on that sequence alone.

    Args:
        q: ``(total_q, Hq, d)``; k, v: ``(total_k, Hkv, d)``, ``Hq % Hkv == 0`` (grouped
            heads as in :func:`numba_flash.attention_fwd`); one dtype (float32, float64,
            float16, bfloat16); NumPy arrays or CUDA device arrays of one kind, any strides.
        cu_seqlens_q, cu_seqlens_k: ``(batch + 1,)`` integer prefix sums of the sequence
            lengths (int32, as FlashAttention's): starting at 0, non-decreasing, ending at
            ``total_q`` (``total_k``). Sequences may be empty. NumPy or device arrays
            (device metadata is copied to the host to be checked, which waits for the
            work queued before it). At most 65535 sequences.
        max_seqlen_q, max_seqlen_k: accepted for FlashAttention compatibility; when given
            they must be at least the longest sequence (the table's own maxima are used).
        causal, scale, window, softcap, alibi_slopes: as :func:`numba_flash.attention_fwd`,
            applied within each sequence (causal and windows bottom-right aligned per
            sequence: ``diag = len_k − len_q``); ALiBi slopes ``(Hq,)`` only.

    Returns:
        ``out (total_q, Hq, d)`` in the input dtype and ``lse (total_q, Hq)`` (q's shape
        without d, the package's rule; FlashAttention's varlen lse is ``(Hq, total_q)``:
        ``lse.T`` gives it), both C-contiguous, of q's kind.

    On compute capability 9.0 the Hopper family takes 16-bit calls (its persistent blocks
    take the sequences' query tiles, most first). Device calls without ALiBi keep a launch
    plan per signature (shapes, options and the longest sequences), and the checked
    sequence table of the last 64 distinct ``cu_seqlens`` pairs: a repeat call with the
    same metadata (a model's next layer) uploads the table and launches, its metadata
    checked once (device metadata is still copied to the host per call).
    """
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                   (causal, window, softcap), scale)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                     causal=False, scale=None, window=None, softcap=None, alibi_slopes=None):
    """attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None) -> out

    Attention over a packed batch of sequences of different lengths, each sequence's
    queries attending to its own keys only: :func:`attention_varlen_fwd` without the lse.

    Returns ``out (total_q, Hq, d)`` in the input dtype, C-contiguous, of q's kind.
    Arguments, layouts and limits: see :func:`attention_varlen_fwd`.
    """
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                   (causal, window, softcap), scale)[0]


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, slopes, options, scale):
    q_kind = q          # (PyTorch CPU tensors go in as NumPy views and come back as tensors)
    q, k, v = (_arrays.host_view(a) for a in (q, k, v))
    for a, n in ((q, "q"), (k, "k"), (v, "v")):
        _check_rank(a, n, 3, "(total_tokens, heads, d)")
    total_q, total_k = tuple(q.shape)[0], tuple(k.shape)[0]
    rows = forward_wgmma.tiling(tuple(q.shape)[2], scores.PACKED).BM    # the Hopper forward's query tiles
    table, max_q, max_k = _varlen_table(cu_q, cu_k, total_q, total_k, max_q, max_k, rows)
    sig = None
    if slopes is None:      # a repeat call: its plan, before the inputs' checks and views
        sig = _plans.signature("varlen", [q, k, v], (*(tuple(o) if isinstance(o, list) else o for o in options),
                                                     scale, max_q, max_k, table.shape, registry.hopper_choice()))
        found = _through_plan(sig, [table], q_kind)
        if found is not None:
            return found
    inp = api._Inputs({"q": _swap01(q), "k": _swap01(k), "v": _swap01(v)}, options, scale, slopes, "forward")
    return _forward(inp, [q, k, v], [table], max_q, max_k, (total_q,), q_kind, sig=sig)


def attention_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                         max_seqlen_k=None, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None):
    """attention_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None) -> (dq, dk, dv)

    Gradients of :func:`attention_varlen_fwd`: given ``dout = dL/d out`` and the forward's
    ``out``, ``lse``, returns ``dq (total_q, Hq, d)``, ``dk``, ``dv (total_k, Hkv, d)`` in
    the input dtype, of q's kind: per sequence exactly
    :func:`numba_flash.attention_bwd` of that sequence alone (deterministic; the keys of a
    sequence with no query get zero gradients).

    Args:
        dout, out: ``(total_q, Hq, d)``; q, k, v as for :func:`attention_varlen_fwd`;
            ``lse (total_q, Hq)`` as it returned; ``cu_seqlens_q``, ``cu_seqlens_k`` and the
            options: the forward's.

    The sequences run one after another (the backward kernels' launches per sequence, into
    the packed gradients in place): correct for any batch, but a batch of many short
    sequences pays a few launches each.
    """
    q_kind = q
    arrays = [_arrays.host_view(a) for a in (dout, q, k, v, out)]
    lse = _arrays.host_view(lse)
    for a, n in zip(arrays, ("dout", "q", "k", "v", "out")):
        _check_rank(a, n, 3, "(total_tokens, heads, d)")
    total_q, total_k = tuple(arrays[1].shape)[0], tuple(arrays[2].shape)[0]
    cu_q, cu_k, lens_q, lens_k = _sequences(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q,
                                            max_seqlen_k)
    if len(tuple(lse.shape)) != 2:
        raise ValueError(f"lse must be (total_q, heads) as attention_varlen_fwd returns it, got {tuple(lse.shape)}.")
    dout_t, q_t, k_t, v_t, out_t = (_swap01(a) for a in arrays)
    options = (causal, window, softcap)
    inp = api._Inputs({"q": q_t, "k": k_t, "v": v_t, "dout": dout_t, "out": out_t, "lse": _swap01_2d(lse)}, options,
                      scale, alibi_slopes)
    hq, hkv, d = inp.lead[0], tuple(k_t.shape)[0], inp.d
    grads = [inp.empty_like((total_q, hq, d)), inp.empty_like((total_k, hkv, d)), inp.empty_like((total_k, hkv, d))]
    dev = {n: inp.device(n) for n in ("q", "k", "v", "dout", "out", "lse")}
    if inp.low:        # the per-sequence calls check dtypes: give them the 16-bit arrays' dtype back
        dev = {n: a if n == "lse" else _arrays.retyped(a, inp.dtype) for n, a in dev.items()}
    slopes = inp.device_slopes if inp.slopes is not None else None
    g_views = [_swap01(g) for g in grads]
    scratch = []
    for b in range(len(lens_q)):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if rq.start == rq.stop and rk.start == rk.stop:
            continue
        part = {n: (a[:, rk] if n in ("k", "v") else a[:, rq]) for n, a in dev.items()}
        seq = api._Inputs(part, options, scale, slopes, stream=inp.stream)
        views = [g_views[0][:, rq], g_views[1][:, rk], g_views[2][:, rk]]
        read = ("q", "k", "v", "dout")
        ready, aligned, _ = api._cp_async_ready(seq, [seq.arrays[n] for n in read])
        found = dict(seq.arrays, **dict(zip(read, ready)))
        for args in families.backward(seq, *(found[n] for n in ("q", "k", "v", "dout", "out", "lse")), *views,
                                      seq.low or aligned, scratch):
            api.launch(*args)
    return _arrays.like(q_kind, inp.result(*grads))


def _swap01_2d(x):
    """``(T, H)`` as ``(H, T)``, a view in the array's own kind."""
    if isinstance(x, np.ndarray):
        return x.T
    if _arrays._is_torch(x):
        return x.t()
    if getattr(x, "__cuda_ndarray__", False):
        shape, strides = tuple(x.shape), tuple(x.strides)
        return _arrays.strided_view(x, (shape[1], shape[0]), (strides[1], strides[0]))
    return x.T


# --------------------------------------------------------------------------- KV cache
def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None, block_table=None,
                           causal=False, scale=None, window=None, softcap=None, alibi_slopes=None, return_lse=False,
                           check_metadata=True):
    """attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None, block_table=None, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None, return_lse=False, check_metadata=True) -> out (or (out, lse))

    Attention of new queries to a KV cache (decoding, chunked prefill), in the
    ``(batch, tokens, heads, d)`` layout of FlashAttention's ``flash_attn_with_kvcache``:
    sequence ``b`` attends to the first ``cache_seqlens[b]`` rows of its cache, after
    ``k_new[b]`` and ``v_new[b]`` (if given) have been written in place at rows
    ``cache_seqlens[b] .. cache_seqlens[b] + Nnew − 1``. The cache is read where it lies
    (no copy, no padding to the longest sequence).

    Args:
        q: ``(B, Nq, Hq, d)``: the new queries, the last ``Nq`` positions of each sequence.
        k_cache, v_cache: ``(B, Nmax, Hkv, d)``, ``Hq % Hkv == 0`` (grouped heads read
            their K/V head with no copy); or, with ``block_table``, a paged cache
            ``(num_pages, page_size, Hkv, d)``. The first two axes must be mergeable into
            rows (a contiguous cache is). Written in place when ``k_new``/``v_new`` are given.
        cache_seqlens: ``(B,)`` integers, the rows of each cache in use before the call.
            It is not advanced: the caller owns it (add ``Nnew`` after the call). NumPy or
            device array (device arrays are copied to the host to be checked).
        k_new, v_new: ``(B, Nnew, Hkv, d)`` or None (both or neither): rows appended in
            place; ``cache_seqlens[b] + Nnew <= Nmax`` is checked before anything is written.
        block_table: ``(B, max_pages)`` integers or None: sequence ``b``'s row ``j`` lies in
            page ``block_table[b, j // page_size]`` at row ``j % page_size`` (pages in any
            order, and shared between sequences if the caller wishes: appends then write
            the shared page). ``Nmax = max_pages · page_size``; the entries a sequence uses
            (its first ``ceil((cache_seqlens[b] + Nnew) / page_size)``) must name existing
            pages. Every dtype.
        causal, window, softcap, alibi_slopes, scale: as :func:`numba_flash.attention_fwd`,
            per sequence with ``Nk = cache_seqlens[b] + Nnew`` keys: causal lets query ``i``
            see keys ``j <= i + Nk − Nq`` (bottom-right, the queries being the newest
            positions). ALiBi slopes ``(Hq,)`` only.
        return_lse: also return ``lse (B, Nq, Hq)`` (q's shape without d).
        check_metadata: True: ``cache_seqlens`` and ``block_table`` are checked on the
            host before any launch (device metadata is copied there first, which waits
            for the work queued before the call), and bad values raise ValueError.
            False: they must be device arrays (int32 or int64), and the call reads them
            on the device (``kernels/kv_metadata.py``): no copy, no wait, nothing
            depends on their values on the host, so a decoding step can run ahead of
            the GPU and be captured in a CUDA graph (call it once before capturing,
            which builds its launch plan; replays then read the metadata as it is at
            replay time). A sequence whose length lies outside ``[0, Nmax − Nnew]`` or
            which uses a page outside the cache is then skipped, not reported: nothing is
            appended to its cache, its output is zeros and its lse ``−inf``. No value of
            the metadata makes a launch read or write outside the arrays.

    Returns:
        ``out (B, Nq, Hq, d)`` (and ``lse``), C-contiguous, of q's kind. A sequence with no
        key in use gets zeros (lse ``-inf``).

    All arrays (but the metadata) must be of one kind: NumPy (the cache is then updated on
    the host) or CUDA device arrays (updated on the device, on the call's stream). At most
    ``registry.SPLIT_ROWS`` (16) queries per sequence run on the one-warp tensor-core
    kernel with key splits (decoding); more run on the prefill kernels. The number of key
    splits is chosen for the cache's capacity ``Nmax`` (as FlashAttention does), not for
    the rows in use, so that a decoding step launches the same kernels as the step before:
    device calls then run through a launch plan (:mod:`numba_flash._plans`; not with ALiBi)
    whose per-call host work is the metadata checks and the upload of the sequence table
    (a repeat call with the same arguments' kinds, shapes, strides, dtypes, options and
    stream skips the input checks and array views as well). Metadata on the device
    (``cache_seqlens``, ``block_table``) is copied back to be checked, which waits for the
    work queued before the call: pass NumPy metadata in a decoding loop, or device
    metadata with ``check_metadata=False``. A cache far
    larger than the rows in use pays for its empty splits (blocks that exit at once).
    """
    fast = _kv_signature(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                         (causal, window, softcap, scale, bool(check_metadata), alibi_slopes is None))
    known = None if fast is None else _KV_CALLS.get(fast.key)
    if known is not None:
        found = known.run(fast, q, cache_seqlens, block_table)
        if found is not None:
            return found if return_lse else found[0]
    q_kind = q          # (PyTorch CPU tensors go in as NumPy views and come back as tensors)
    q, k_cache, v_cache = (_arrays.host_view(a) for a in (q, k_cache, v_cache))
    qs = _check_rank(q, "q", 4, "(batch, Nq, heads, d)")
    layout = "(batch, Nmax, heads, d)" if block_table is None else "(num_pages, page_size, heads, d)"
    ks = _check_rank(k_cache, "k_cache", 4, layout)
    if tuple(v_cache.shape) != ks:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {ks} and {tuple(v_cache.shape)}.")
    b, nq = qs[0], qs[1]
    pages = meta = None
    if not check_metadata:
        meta = _device_metadata(q, k_cache, cache_seqlens, block_table, b)
    if block_table is None:
        if qs[0] != ks[0]:
            raise ValueError(f"q and k_cache must have the same batch size (axis 0), got q {qs} and k_cache {ks}.")
        nmax = ks[1]
    elif meta is None:
        pages = _page_table(block_table, b)
        nmax = pages.shape[1] * ks[1]
    else:
        nmax = tuple(meta[1].shape)[1] * ks[1]
    lens = _cache_lens(cache_seqlens, b, nmax) if meta is None else None
    n_new = 0
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new go together: pass both or neither.")
    if k_new is not None:
        k_new, v_new = _arrays.host_view(k_new), _arrays.host_view(v_new)
        ns = _check_rank(k_new, "k_new", 4, "(batch, Nnew, heads, d)")
        if ns[0] != b or ns[2:] != ks[2:] or tuple(v_new.shape) != ns:
            raise ValueError(f"k_new and v_new must be (batch={b}, Nnew, {ks[2]}, {ks[3]}) like the cache, got "
                             f"k_new {ns} and v_new {tuple(v_new.shape)}.")
        n_new = ns[1]
        if meta is None:
            _check_room(lens, n_new, nmax)
        elif n_new > nmax:
            raise ValueError(f"k_new adds {n_new} rows to caches of Nmax={nmax} rows. Allocate a longer cache.")
    if pages is not None:
        _check_pages(pages, lens + n_new, ks[1], ks[0])
    k2, v2 = (_swap01(_merge01(c, n, view_only=True)) for c, n in ((k_cache, "k_cache"), (v_cache, "v_cache")))
    group = qs[2] // ks[2] if ks[2] and qs[2] % ks[2] == 0 else 1
    grouped = None
    if nq == 1 and 1 < group <= registry.SPLIT_ROWS and window is None and alibi_slopes is None:
        grouped = _grouped_rows(q, ks[2], group)      # a query head group's rows in one block
    stream = None
    if grouped is not None:
        causal = False      # one query per sequence sees every key in use: causal changes nothing
        if api._kind(q, "q") == "device":
            stream = api._launch_stream([q, k_cache, v_cache])
        q2, row_step = grouped
    else:
        q2 = _swap01(_merge01(q, "q"))
    inp = api._Inputs({"q": q2, "k": k2, "v": v2}, (causal, window, softcap), scale, alibi_slopes, "forward",
                      stream)
    append = None
    if n_new:
        _check_new(inp, k_new, v_new)
        if inp.on_device:
            append = (k_cache, v_cache, k_new, v_new)
        else:
            _append_on_host(k_cache, v_cache, k_new, v_new, lens, pages)
    starts = np.arange(b, dtype=np.int64)
    q_starts, q_lens = (starts * row_step, np.full(b, group)) if grouped else (starts * nq, np.full(b, nq))
    k_starts = starts * nmax if block_table is None else np.zeros(b, np.int64)
    table = _table(q_starts, q_lens, k_starts, 0)     # (gaps: mma.sync only)
    sig_arrays = [q, k_cache, v_cache] + ([k_new, k_cache, v_new, v_cache] if append is not None else [])
    page_size = ks[1] if block_table is not None else 0
    if meta is None:
        uploads = _kv_uploads(table, lens, n_new, pages, append is not None)
    else:
        uploads = [table]           # its key lengths, the page table and the append rows: made on the device
        sig_arrays += [cache_seqlens] + ([block_table] if page_size else [])
        meta = (*meta, n_new, ks[0])
    made = []
    out, lse = _forward(inp, sig_arrays, uploads, group if grouped else nq, nmax, (b, nq), q_kind,
                        group if grouped else 0, page_size, append, gaps=True, made=made, meta=meta)
    if fast is not None and made:
        if len(_KV_CALLS) >= _plans.MAX_PLANS:
            _KV_CALLS.clear()        # (the plans' own table waits for queued work when it drops plans)
        _KV_CALLS[fast.key] = _KVCall(made[0], b, nmax, n_new, page_size, ks[0], table, append is not None,
                                      meta is not None)
    return (out, lse) if return_lse else out


# Repeat decoding calls: the signature of a call's own arguments (kinds, shapes, strides,
# dtypes, options, stream) -> what the call needs besides its metadata. A call with that
# signature passed every check but the metadata's, and its launches do not depend on the
# metadata's values (key splits follow the cache's capacity), so a repeat call checks the
# metadata, builds the sequence table and runs the plan: no array views, no input checks.
_KV_CALLS = {}


def _kv_signature(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, options):
    """The plan signature of an ``attention_with_kvcache`` call over device arrays, with
    its inputs' pointers in the order the launches read them (q, the caches, then the
    appends' k_new, k_cache, v_new, v_cache, then with ``check_metadata=False`` the
    metadata), or None (host arrays, ALiBi, the simulator)."""
    if not options[-1] or (k_new is None) != (v_new is None):
        return None
    arrays = [q, k_cache, v_cache] + ([] if k_new is None else [k_new, k_cache, v_new, v_cache])
    if not options[-2]:         # check_metadata=False: the launches read the metadata
        arrays += [cache_seqlens] + ([] if block_table is None else [block_table])
    meta = tuple(None if x is None else (type(x), tuple(getattr(x, "shape", ())), getattr(x, "dtype", None))
                 for x in (cache_seqlens, block_table))     # (lists too: their length is checked per call)
    try:
        hash(options)
    except TypeError:
        return None
    return _plans.signature("kvcache", arrays, options + meta)


@dataclasses.dataclass(frozen=True)
class _KVCall:
    """A repeat ``attention_with_kvcache`` call's plan and the facts of its signature."""
    plan: object
    batch: int
    nmax: int
    n_new: int
    page_size: int          # 0: a contiguous cache
    num_pages: int
    table: np.ndarray       # the sequence table but its key lengths (which the metadata gives)
    append: bool
    on_device: bool = False     # check_metadata=False: the metadata is read by the launches

    def run(self, sig, q, cache_seqlens, block_table):
        """``(out, lse)`` of q's kind, or None where the plan cannot serve the call."""
        if self.on_device:
            found = self.plan.run(sig, api._POISON, [self.table], like=q)
            return None if found is None else _arrays.like(q, found)
        lens = _cache_lens(cache_seqlens, self.batch, self.nmax)
        _check_room(lens, self.n_new, self.nmax)
        pages = None
        if self.page_size:
            pages = _page_table(block_table, self.batch)
            _check_pages(pages, lens + self.n_new, self.page_size, self.num_pages)
        uploads = _kv_uploads(self.table, lens, self.n_new, pages, self.append)
        found = self.plan.run(sig, api._POISON, uploads, like=q)
        return None if found is None else _arrays.like(q, found)


def _kv_uploads(table, lens, n_new, pages, append):
    """A KV-cache call's host tables in the order its launches read them: the sequence
    table (a copy of ``table`` with the key lengths ``lens + n_new``), then a paged
    cache's page table, then the appends' positions."""
    table = table.copy()
    table[:, 3] = lens + n_new if n_new else lens
    uploads = [table]
    if pages is not None:
        uploads.append(_int32(pages))
    if append:
        uploads.append(np.ascontiguousarray(lens, np.int32))
    return uploads


def _cache_lens(cache_seqlens, batch, nmax):
    """``cache_seqlens`` on the host, checked to lie in ``[0, Nmax]``."""
    lens = _host_ints(cache_seqlens, "cache_seqlens", batch)
    low, high = _bounds(lens)
    if low < 0 or high > nmax:
        raise ValueError(f"cache_seqlens must lie in [0, Nmax={nmax}], got {lens.tolist() if batch <= 16 else lens}.")
    return lens


def _check_room(lens, n_new, nmax):
    """Appending ``n_new`` rows overflows no sequence's cache."""
    if n_new and lens.size and lens.max() + n_new > nmax:
        worst = int(np.argmax(lens))
        raise ValueError(f"the cache overflows: sequence {worst} holds {lens[worst]} rows and k_new adds "
                         f"{n_new}, but the cache holds Nmax={nmax}. Allocate a longer cache.")


def _grouped_rows(q, hkv, group):
    """``(view, row_step)``: q ``(B, 1, Hq, d)`` seen as ``(Hkv, R, d)`` whose rows
    ``b · row_step .. + group − 1`` under K/V head ``h`` are the ``group`` query heads that
    read it, of sequence ``b`` (so one decoding block computes a whole group: its K/V rows
    are read once, and ``group`` of the 16 rows of each product are useful); None where
    q's strides do not allow it (its batch stride not Hq head strides)."""
    shape = tuple(q.shape)
    if api._kind(q, "q") == "device":
        a = _arrays.as_numba_device(q)
        dt = _arrays.logical_dtype(q)
        if a.dtype != dt:
            a = _arrays.retyped(a, dt)
    else:
        a = q
    sb, _, sh, sd = tuple(a.strides)
    if sh <= 0 or sb != shape[2] * sh:     # the output's layout: sequence b's heads from row b·Hq
        return None
    step = shape[2]
    view_shape = (hkv, (shape[0] - 1) * step + group, shape[3])
    view_strides = (group * sh, sh, sd)
    if isinstance(a, np.ndarray):
        return np.lib.stride_tricks.as_strided(a, view_shape, view_strides, writeable=False), step
    return _arrays.strided_view(a, view_shape, view_strides), step


def _page_table(block_table, batch):
    """The page table on the host, ``(batch, max_pages)``: int32 as given, other integer
    types as int64."""
    x = _arrays.host_view(block_table)
    if not isinstance(x, np.ndarray):
        if not _arrays.is_device_array(x):
            raise TypeError(f"block_table must be an int32 NumPy or device array, got {type(x).__name__}.")
        x = _arrays.as_numba_device(x).copy_to_host()
    if x.ndim != 2 or x.dtype.kind not in "iu" or x.shape[0] != batch or x.shape[1] < 1:
        raise ValueError(f"block_table must be an integer (batch={batch}, max_pages >= 1) array, got dtype "
                         f"{x.dtype} and shape {x.shape}.")
    return x if x.dtype == np.int32 else x.astype(np.int64)


def _int32(pages):
    """The page table as the kernels read it (the entries in use are checked to fit)."""
    if pages.dtype == np.int32:
        return np.ascontiguousarray(pages)
    return np.ascontiguousarray(np.clip(pages, -1, 2**31 - 1).astype(np.int32))


def _check_pages(pages, used, page_size, num_pages):
    """Every page a sequence uses (its first ``ceil(used / page_size)`` entries) exists."""
    if page_size < 1:
        raise ValueError(f"a paged cache's page_size (axis 1) must be at least 1, got {page_size}.")
    unsigned = np.uint32 if pages.dtype.itemsize == 4 else np.uint64
    if pages.size and pages.view(unsigned).max() < num_pages:
        return                  # every entry names a page (a negative one reads as a huge unsigned)
    n_used = -(-np.asarray(used, np.int64) // page_size)          # entries each sequence uses
    bad = (np.arange(pages.shape[1]) < n_used[:, None]) & ((pages < 0) | (pages >= num_pages))
    if bad.any():
        b = int(np.argmax(bad.any(axis=1)))
        row = pages[b, :n_used[b]]
        raise ValueError(f"block_table[{b}] names page {int(row.min() if row.min() < 0 else row.max())}, "
                         f"outside the cache's {num_pages} pages (sequence {b} uses its first {row.size} "
                         "entries).")


def _check_new(inp, k_new, v_new):
    """``k_new`` and ``v_new``: the cache's dtype, on the cache's side."""
    for name, new in (("k_new", k_new), ("v_new", v_new)):
        if _arrays.logical_dtype(new) != inp.dtype:
            raise TypeError(f"{name} must have the cache's dtype {inp.dtype}, got {_arrays.logical_dtype(new)}.")
        if api._kind(new, name) != ("device" if inp.on_device else "NumPy"):
            raise TypeError(f"{name} must be on the same side as the cache (all NumPy or all device arrays).")


def _device_metadata(q, k_cache, cache_seqlens, block_table, batch):
    """``(cache_seqlens, block_table)`` as Numba device arrays for a call with
    ``check_metadata=False`` (block_table None without one), or an error naming the fix:
    device arrays of int32 or int64, ``(batch,)`` and ``(batch, max_pages >= 1)``, with
    the call's other arrays on the device too."""
    fix = "pass them as device arrays, or leave check_metadata=True"
    if api._kind(q, "q") != "device" or api._kind(k_cache, "k_cache") != "device":
        raise ValueError("check_metadata=False reads the metadata on the device: q and the caches must be device "
                         "arrays (NumPy calls check their metadata on the host at no cost).")
    found = []
    for name, x, rank in (("cache_seqlens", cache_seqlens, 1), ("block_table", block_table, 2)):
        if x is None:
            found.append(None)
            continue
        if not _arrays.is_device_array(x):
            raise TypeError(f"with check_metadata=False, {name} must be a device array ({fix}), got "
                            f"{type(x).__name__}.")
        d = _arrays.as_numba_device(x)
        shape = tuple(d.shape)
        want = (batch,) if rank == 1 else (batch, "max_pages >= 1")
        if d.dtype not in (np.int32, np.int64) or len(shape) != rank or shape[0] != batch \
                or (rank == 2 and shape[1] < 1):
            raise ValueError(f"with check_metadata=False, {name} must be an int32 or int64 device array of shape "
                             f"{want}, got dtype {d.dtype} and shape {shape}.")
        found.append(d)
    return tuple(found)


def _metadata_launches(inp, lens, block_table, n_new, num_pages, table, page_size, nmax):
    """``(launches, inputs, pages, pos)``: the launch that makes a KV-cache call's device
    metadata into its sequence table's key lengths (written into ``table``), the append
    rows ``pos`` and the int32 page table ``pages`` (None unpaged), both new arrays;
    ``inputs``: the metadata arrays it reads (``kernels/kv_metadata.py``)."""
    b = tuple(lens.shape)[0]
    pos = _arrays.device_empty((max(b, 1),), np.int32, stream=inp.stream)
    if page_size:
        pages = _arrays.device_empty(tuple(block_table.shape), np.int32, stream=inp.stream)
        kern = registry.specialisation("kv_metadata_paged", lens.dtype.name, 0).kernel()
        args, inputs = (lens, block_table, table, pos, pages, nmax, n_new, num_pages, page_size), [lens, block_table]
    else:
        pages = None
        kern = registry.specialisation("kv_metadata", lens.dtype.name, 0).kernel()
        args, inputs = (lens, table, pos, nmax, n_new), [lens]
    launches = [(kern, b, kern.threads, 0, args, inp.stream)] if b else []
    return launches, inputs, pages, pos


def _append_on_host(k_cache, v_cache, k_new, v_new, lens, pages=None):
    """Write ``k_new``, ``v_new`` into NumPy caches at rows ``lens[b]`` on (in place;
    through the page table ``pages`` of a paged cache)."""
    n_new = k_new.shape[1]
    for b, n in enumerate(lens):
        for new, cache in ((k_new, k_cache), (v_new, v_cache)):
            if pages is None:
                cache[b, n:n + n_new] = new[b]
                continue
            ps = cache.shape[1]
            for i in range(n_new):
                j = n + i
                cache[pages[b, j // ps], j % ps] = new[b, i]


def _append_launches(inp, k_cache, v_cache, k_new, v_new, pos, pages=None):
    """``(launches, arrays)``: the launches that write device ``k_new``, ``v_new`` into the
    caches at rows ``pos[b]`` on (device int32; through the device page table ``pages``
    of a paged cache), and the arrays they read and write (k_new, k_cache, v_new, v_cache)."""
    kern = registry.specialisation("cache_append" if pages is None else "cache_append_paged", "uint16", 0).kernel()
    extra = () if pages is None else (pages, int(tuple(k_cache.shape)[1]))
    store = inp.storage if inp.low else None
    launches, arrays = [], []
    for new, cache in ((k_new, k_cache), (v_new, v_cache)):
        src, dst = _arrays.as_numba_device(new, store), _arrays.as_numba_device(cache, store)
        arrays += [src, dst]
        bb, n, h, d = tuple(src.shape)
        if bb * n * h * d:
            launches.append((kern, -(-n * h * d // kern.threads) * bb, kern.threads, 0, (src, dst, pos, *extra),
                             inp.stream))
    return launches, arrays
