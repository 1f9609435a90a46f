"""Shared-memory tile building blocks used by the forward and backward kernels.

A thread block of ``NT = RG × CG`` threads owns a tile of *rows* (``RG·TM``) and works
on tiles of *columns* (``CG·TN``). Thread (r, c) owns rows ``r·TM + i`` and columns
``c + CG·j``; for an output of ``DO`` features it owns features ``4·(c + CG·g) + f``.

* ``copy_tile``: global → shared, zero-filled outside the array; with ``use_async``
  one ``cp.async`` per 16 bytes (complete at ``ops.cp_async_wait``), otherwise plain
  loads, ``COPY_BYTES`` of them in flight per thread (:func:`make_copy`, which also
  reads a paged KV cache's rows through its page table).
* ``mm_abt``: ``s[i, j] += Σ_k A[row_i, k] · B[col_j, k]`` over one head-dim chunk of
  ``DK`` (A and B row-major in shared memory, row stride ``stride``): S = Q Kᵀ.
* ``mm_pv``: ``o[i, f] += Σ_n P[row_i, n] · V[n, f]`` over the ``CG·TN`` columns of a
  P tile: O = P V.

Shared rows are padded by ``PAD`` words: 16-byte aligned rows whose start banks differ,
so the 128-bit loads of neighbouring lanes (neighbouring B rows) do not conflict.
"""
import numba
import numpy as np
from numba import cuda

from .. import ops
from ..scores import paged_row

PAD = 4  # words of padding per shared-memory row
COPY_BYTES = 32  # plain-load copies: bytes of loads in flight per thread before their stores


def make_copy(dtype_name, D, NT, use_async, paged=False):
    """``copy(dst, dst_off, dst_stride, src, b1, b2, row0, NROWS, col0, NCOLS, n_lim, tid,
    pages, z, ps)``: ``dst[r, c] = src[b1, b2, row0 + r, col0 + c]`` for ``r < NROWS``, ``c <
    NCOLS``; zero outside (``n_lim`` rows, ``D`` columns). Asynchronous with ``use_async``
    (one ``cp.async`` per 16 bytes, complete at ``ops.cp_async_wait``), otherwise plain
    loads, ``COPY_BYTES`` of them in flight per thread. With ``paged``, logical row ``j`` is
    read from row ``pages[z, j // ps] · ps + j % ps`` (a paged KV cache's sequence ``z``);
    without, ``pages``, ``z`` and ``ps`` are not read."""
    np_dt = np.dtype(dtype_name)
    nb_dt = numba.from_dtype(np_dt)
    ZERO = np_dt.type(0)
    E16 = 16 // np_dt.itemsize         # elements per 16-byte cp.async
    COPY_BATCH = COPY_BYTES // np_dt.itemsize   # 8 floats, 4 doubles (8 doubles spilled in the backward)

    def copy(dst, dst_off, dst_stride, src, b1, b2, row0, NROWS, col0, NCOLS, n_lim, tid, pages, z, ps):
        if use_async:
            CPR = NCOLS // E16                     # 16-byte chunks per row
            for it in range(-(-NROWS * CPR // NT)):
                ch = tid + it * NT
                if ch < NROWS * CPR:
                    r = ch // CPR
                    cc = (ch - r * CPR) * E16
                    gr = row0 + r
                    gc = col0 + cc
                    ok = gr < n_lim and gc < D
                    if paged and ok:
                        gr = paged_row(pages, z, gr, ps)
                    # A zero-byte copy still needs a valid address: point it at element 0.
                    ops.cp_async16(dst, dst_off + r * dst_stride + cc, src, b1, b2,
                                   gr if ok else 0, gc if ok else 0, 16 if ok else 0)
        else:
            buf = cuda.local.array(COPY_BATCH, nb_dt)
            for it0 in range(0, -(-NROWS * NCOLS // NT), COPY_BATCH):
                for u in range(COPY_BATCH):        # all loads first: COPY_BATCH in flight
                    idx = tid + (it0 + u) * NT
                    r = idx // NCOLS
                    gr = row0 + r
                    gc = col0 + idx - r * NCOLS
                    x = ZERO
                    if idx < NROWS * NCOLS and gr < n_lim and gc < D:
                        if paged:
                            gr = paged_row(pages, z, gr, ps)
                        x = src[b1, b2, gr, gc]
                    buf[u] = x
                for u in range(COPY_BATCH):
                    idx = tid + (it0 + u) * NT
                    if idx < NROWS * NCOLS:
                        r = idx // NCOLS
                        dst[dst_off + r * dst_stride + idx - r * NCOLS] = buf[u]

    return cuda.jit(device=True, inline="always")(copy)


def make_tile_ops(dtype_name, D, TM, TN, CG, NT, DK, DO, use_async):
    """``(copy_tile, mm_abt, mm_pv)`` for one specialisation (sizes are compile-time constants)."""
    np_dt = np.dtype(dtype_name)
    VO4 = DO // (4 * CG)               # 4-wide output feature groups per thread
    C = CG * TN
    # 128-bit shared loads for float32; plain loads for float64 (and in the simulator).
    LD4 = ops.ld_shared_x4 if np_dt == np.float32 else ops.ld_x4

    copy_rows = make_copy(dtype_name, D, NT, use_async)

    def copy_tile(dst, dst_off, dst_stride, src, b1, b2, row0, NROWS, col0, NCOLS, n_lim, tid):
        """dst[r, c] = src[b1, b2, row0 + r, col0 + c] for r < NROWS, c < NCOLS; zero outside
        (n_lim rows, D columns). Asynchronous with ``use_async`` (completes at cp_async_wait)."""
        copy_rows(dst, dst_off, dst_stride, src, b1, b2, row0, NROWS, col0, NCOLS, n_lim, tid, dst, 0, 1)

    def mm_abt(smem, a_off, b_off, stride, s, av, bv, r, c):
        """s += A Bᵀ over one head-dim chunk (DK wide) held at a_off / b_off."""
        for kk in range(0, DK, 4):
            for i in range(TM):
                av[i, 0], av[i, 1], av[i, 2], av[i, 3] = LD4(smem, a_off + (r * TM + i) * stride + kk)
            for j in range(TN):
                bv[j, 0], bv[j, 1], bv[j, 2], bv[j, 3] = LD4(smem, b_off + (c + CG * j) * stride + kk)
            for i in range(TM):
                for j in range(TN):
                    acc = s[i, j]
                    for e in range(4):
                        acc += av[i, e] * bv[j, e]
                    s[i, j] = acc

    def mm_pv(smem, p_off, p_stride, v_off, v_stride, o, pv, vv, r, c):
        """o += P V: P is (rows × C) at p_off, V is (C × DO) at v_off."""
        for jj in range(0, C, 4):
            for i in range(TM):
                pv[i, 0], pv[i, 1], pv[i, 2], pv[i, 3] = LD4(smem, p_off + (r * TM + i) * p_stride + jj)
            for e in range(4):
                for g in range(VO4):
                    vv[0], vv[1], vv[2], vv[3] = LD4(smem, v_off + (jj + e) * v_stride + 4 * (c + CG * g))
                    for i in range(TM):
                        p = pv[i, e]
                        for f in range(4):
                            o[i, 4 * g + f] += p * vv[f]

    # Device functions in both modes: the simulator also needs the wrapper, which gives
    # these functions its fake ``cuda`` module (for cuda.local) while they run.
    # Returned as a tuple: kernels bind them to closure names (numba cannot type a namespace).
    return tuple(cuda.jit(device=True, inline="always")(f) for f in (copy_tile, mm_abt, mm_pv))
