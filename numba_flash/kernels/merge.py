"""Merging partial attention results over disjoint key sets (``numba_flash.merge_attention``).

Attention over keys ``K₁ ∪ K₂ ∪ …`` from the partial results ``(out_i, lse_i)`` of each
set: with ``m = maxᵢ lse_i`` and ``wᵢ = exp(lse_i − m)``,

    out = Σᵢ wᵢ · out_i / Σᵢ wᵢ,        lse = m + log Σᵢ wᵢ

folded in one partial at a time (``merge_into``, an online softmax over partials) into a
running ``(acc, m, l)`` in the accumulator dtype, then ``merge_finish`` writes
``out = acc / l`` and ``lse = m + log l`` (a row no partial saw a key of: 0 and
``-inf``). One block per row, its threads across the head dim; rows are read as the
4-D and 3-D views of ``api._kernel_views`` (any strides).
"""
import functools
import math

import numba
import numpy as np
from numba import cuda

from .. import ops
from .._runtime import SIMULATOR

THREADS = 32 if SIMULATOR else 128


def _convert(dtype_name):
    """``(load, store)`` device functions: a stored element to the accumulator dtype and
    back (16-bit floats are stored as their uint16 bits)."""
    if dtype_name in ("float16", "bfloat16"):
        pack = ops.pack_bf16x2 if dtype_name == "bfloat16" else ops.pack_f16x2

        def store(x):
            return numba.uint16(pack(x, x) & 0xFFFF)
        return (ops.bf16_to_f32 if dtype_name == "bfloat16" else ops.f16_to_f32), _device(store)

    def same(x):
        return x
    return _device(same), _device(same)


def _device(f):
    return f if SIMULATOR else cuda.jit(device=True, inline="always")(f)


@_device
def _block_row(acc):
    """``(b1, b2, row)``: this block's row of ``acc (B1, B2, N, D)`` (one block per row)."""
    B2, N = acc.shape[1], acc.shape[2]
    row = cuda.blockIdx.x
    b = row // N
    row -= b * N
    b1 = b // B2
    return b1, b - b1 * B2, row


@functools.lru_cache(maxsize=None)
def make_merge_into(dtype_name: str):
    """``merge_into(acc, part, m, l, part_lse, first)``: fold one partial result into the
    running ``acc (B1, B2, N, D)``, ``m, l (B1, B2, N)`` (``first``: start them from it).
    Launch with ``grid = B1 · B2 · N``, ``block = THREADS``."""
    load, _ = _convert(dtype_name)
    acc_dt = np.float64 if dtype_name == "float64" else np.float32
    ZERO, NEG_INF = acc_dt(0), acc_dt(-np.inf)

    @cuda.jit
    def merge_into(acc, part, m, l, part_lse, first):
        b1, b2, row = _block_row(acc)
        D = acc.shape[3]
        mi = part_lse[b1, b2, row]
        m_old = NEG_INF if first else m[b1, b2, row]
        l_old = ZERO if first else l[b1, b2, row]
        m_new = max(m_old, mi)
        m_use = ZERO if m_new == NEG_INF else m_new      # no key seen yet: weights 0, no NaN
        a = math.exp(m_old - m_use)
        w = math.exp(mi - m_use)
        for c in range(cuda.threadIdx.x, D, THREADS):
            x = w * load(part[b1, b2, row, c]) if w != ZERO else ZERO   # 0 · inf would be NaN
            acc[b1, b2, row, c] = x if first else acc[b1, b2, row, c] * a + x
        cuda.syncthreads()        # every thread has read m and l before they change
        if cuda.threadIdx.x == 0:
            m[b1, b2, row] = m_new
            l[b1, b2, row] = l_old * a + w

    merge_into.threads = THREADS
    return merge_into


@functools.lru_cache(maxsize=None)
def make_merge_finish(dtype_name: str):
    """``merge_finish(acc, m, l, out, lse)``: ``out = acc / l`` in the stored dtype and
    ``lse = m + log l`` (0 and ``-inf`` where ``l = 0``). Grid and block as ``merge_into``."""
    _, store = _convert(dtype_name)
    acc_dt = np.float64 if dtype_name == "float64" else np.float32
    ZERO, ONE, NEG_INF = acc_dt(0), acc_dt(1), acc_dt(-np.inf)

    @cuda.jit
    def merge_finish(acc, m, l, out, lse):
        b1, b2, row = _block_row(acc)
        D = acc.shape[3]
        total = l[b1, b2, row]
        inv = ZERO if total == ZERO else ONE / total
        for c in range(cuda.threadIdx.x, D, THREADS):
            out[b1, b2, row, c] = store(acc[b1, b2, row, c] * inv)
        if cuda.threadIdx.x == 0:
            lse[b1, b2, row] = NEG_INF if total == ZERO else m[b1, b2, row] + math.log(total)

    merge_finish.threads = THREADS
    return merge_finish
