"""``merge_attention``: the exact merge of partial attention results (split keys, ring
attention, cache + new keys computed apart). Kernels: ``numba_flash.kernels.merge``."""
import numpy as np

from . import _arrays, api, registry


def merge_attention(outs, lses):
    """merge_attention(outs, lses) -> (out, lse)

    Attention over the union of disjoint key sets from the results over each set:
    ``out_i, lse_i = attention_fwd(q, k_i, v_i)`` for ``i = 1 … P`` give
    ``attention_fwd(q, concat(k_i), concat(v_i))`` (within rounding)::

        out = Σᵢ exp(lse_i − lse) · out_i,      lse = log Σᵢ exp(lse_i)

    Args:
        outs: a sequence of ``P >= 1`` arrays ``(..., N, d)`` of one shape and dtype
            (float32, float64, float16 or bfloat16), or one array ``(P, ..., N, d)``.
        lses: likewise, ``(..., N)`` each (or ``(P, ..., N)``): the natural-log
            log-sum-exps that came with them, in the accumulator dtype (float64 for
            float64, float32 otherwise), ``-inf`` for a row that saw no key.

    Returns:
        ``out (..., N, d)`` in the dtype of ``outs`` and ``lse (..., N)``, of the inputs'
        kind (NumPy in, NumPy out; device arrays of the first out's kind). A row with
        ``-inf`` in every lse gets 0 and ``-inf``. NumPy inputs are merged on the host in
        float64; device inputs on the device, in the accumulator dtype, in the order given
        (deterministic).
    """
    outs, lses = _parts(outs, "outs"), _parts(lses, "lses")
    if len(outs) != len(lses):
        raise ValueError(f"outs and lses must hold as many partial results, got {len(outs)} and {len(lses)}.")
    first = outs[0]
    shape, dt = tuple(first.shape), _arrays.logical_dtype(first)
    api._check_dtype(dt, "outs", "forward")
    acc = np.dtype(np.float64 if dt == np.float64 else np.float32)
    kinds = {api._kind(a, "outs") for a in outs} | {api._kind(a, "lses") for a in lses}
    if len(kinds) > 1:
        raise TypeError("outs and lses must all be NumPy arrays or all CUDA device arrays.")
    for i, (o, s) in enumerate(zip(outs, lses)):
        if tuple(o.shape) != shape or _arrays.logical_dtype(o) != dt:
            raise ValueError(f"outs[{i}] has shape {tuple(o.shape)} and dtype {_arrays.logical_dtype(o)}; "
                             f"expected those of outs[0]: {shape}, {dt}.")
        if tuple(s.shape) != shape[:-1] or _arrays.logical_dtype(s) != acc:
            raise ValueError(f"lses[{i}] must be {acc.name} of shape {shape[:-1]} (its out's shape without d), "
                             f"got {_arrays.logical_dtype(s)} of shape {tuple(s.shape)}.")
    if "NumPy" in kinds:
        return _merge_host(outs, lses, dt)
    return _arrays.like(first, _merge_device(outs, lses, dt, acc))


def _parts(x, name):
    x = _arrays.host_view(x)
    if isinstance(x, (list, tuple)):
        if not x:
            raise ValueError(f"{name} must hold at least one partial result, got none.")
        return [_arrays.host_view(a) for a in x]
    if isinstance(x, np.ndarray) or _arrays.is_device_array(x):
        if len(tuple(x.shape)) < 2 or x.shape[0] < 1:
            raise ValueError(f"{name} given as one array must be (P, ...), P >= 1, got shape {tuple(x.shape)}.")
        return [x[i] for i in range(x.shape[0])]
    raise TypeError(f"{name} must be a sequence of arrays or one array (P, ...), got {type(x).__name__}.")


def _merge_host(outs, lses, dt):
    lse = np.stack([np.asarray(s, np.float64) for s in lses])
    m = lse.max(axis=0)
    m_use = np.where(np.isneginf(m), 0.0, m)
    w = np.exp(lse - m_use)
    total = w.sum(axis=0)
    acc = sum(wi[..., None] * np.where(wi[..., None] > 0, np.asarray(o, np.float64), 0.0)
              for wi, o in zip(w, outs))
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(total[..., None] > 0, acc / np.where(total > 0, total, 1.0)[..., None], 0.0)
        lse_out = np.where(total > 0, m_use + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    return out.astype(dt), lse_out.astype(lses[0].dtype)


def _merge_device(outs, lses, dt, acc_dt):
    low = dt.name in registry.LOW_DTYPES
    stream = api._launch_stream(list(outs) + list(lses))
    store = np.dtype(np.uint16) if low else None
    outs = [_arrays.as_numba_device(o, store) for o in outs]
    lses = [_arrays.as_numba_device(s) for s in lses]
    shape = tuple(outs[0].shape)
    acc = _arrays.device_empty(shape, acc_dt, api._POISON, stream=stream)
    m = _arrays.device_empty(shape[:-1], acc_dt, api._POISON, stream=stream)
    l = _arrays.device_empty(shape[:-1], acc_dt, api._POISON, stream=stream)
    out = _arrays.device_empty(shape, dt, api._POISON, store, stream)
    lse = _arrays.device_empty(shape[:-1], acc_dt, api._POISON, stream=stream)
    if int(np.prod(shape)):
        into = registry.specialisation("merge_into", dt.name, 0).kernel()
        finish = registry.specialisation("merge_finish", dt.name, 0).kernel()
        for i, (o, s) in enumerate(zip(outs, lses)):
            for a4, p4, m3, l3, s3 in api._kernel_views([acc, o, m, l, s]):
                api.launch(into, a4.shape[0] * a4.shape[1] * a4.shape[2], into.threads, 0,
                           (a4, p4, m3, l3, s3, i == 0), stream)
        for a4, o4, m3, l3, s3 in api._kernel_views([acc, out, m, l, lse]):
            api.launch(finish, a4.shape[0] * a4.shape[1] * a4.shape[2], finish.threads, 0,
                       (a4, m3, l3, o4, s3), stream)
    return api._finish(dt if low else None, (out, lse))
