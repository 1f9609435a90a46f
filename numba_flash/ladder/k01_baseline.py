"""Rung 1 — baseline tiling: one thread per output element, reductions in shared memory.

**What.** The tiled online-softmax loop of docs/ladder.md, written down as directly as
CUDA allows. A block of ``Br × Bc`` threads owns the output tile ``O[i0:i0+Br, c0:c0+Bc]``;
thread ``(tx, ty)`` owns the one element ``O[i0+tx, c0+ty]``. The block walks the keys in
tiles of ``Bc``, and in tile ``j`` thread ``(tx, ty)`` also computes the one score
``S[i0+tx, j0+ty]``, reading ``Q`` and ``K`` straight from global memory::

    S_ij  = Q_i K_jᵀ · scale · log2 e              a length-d dot product per thread
    m_new = max(m_i, rowmax(S_ij))                 tree in shared memory
    P_ij  = exp2(S_ij − m_new)
    l_i   = l_i · exp2(m_i − m_new) + rowsum(P_ij)  tree in shared memory
    O_i   = O_i · exp2(m_i − m_new) + P_ij V_j      V straight from global memory
    O_i  /= l_i                                    once, after the last key tile

Scores are kept in log2 units (``scale · log2 e`` folded into one constant) so every
exponential is one ``exp2``; ``O`` stays unnormalised until the end (FlashAttention-2).

**Why it is slow** (the prediction, N = d = 1024, Br = Bc = 32: 32 × 32 blocks of 1024
threads, 32 key tiles each). ``threadIdx.x`` varies fastest across a warp and indexes the
*row* of Q, so at each of the d steps of its dot product a warp reads 32 different rows
of Q (32 separate 32-byte sectors: "uncoalesced") and one K element (a broadcast). That
is 1024 blocks × 32 warps × 32 key tiles × 1024 steps ≈ 1.1·10⁹ warp loads of Q, ≈ 1.1 TB
of sectors through L1/L2 for 4 MB of distinct data: at L2 rates (~10 TB/s) ~100 ms.
Every one of the d / Bc = 32 column blocks also recomputes the same Q·Kᵀ
(32 × 2N²d ≈ 69 GFLOP), and each reduction tree costs log2(Bc) = 5 barriers. Expect
a time of order 100 ms (the seed's C++ original: 155.9 ms on an H200).

**Measured** (NVIDIA H200, 2026-11-29, commit 2a74295; N = d = 1024, ``python bench.py
ladder``; written by docs/gen_ladder.py): 147.825 ms, 0.03 TFLOP/s, max error 6.5e-05
against the float64 oracle (passes the seed's 1e-04). The seed's C++ twin on an H200:
155.90 ms, so this rung is 1.05× faster.

**Caveats.** The reduction trees read ``red[tx, ty + h]`` with ``tx`` across the warp:
addresses ``Bc`` words apart, a 32-way shared-memory bank conflict. ``Br`` and ``Bc``
must be powers of two (the trees halve).
"""
import functools
import math

from numba_flash._runtime import SIMULATOR   # first: GPU or simulator, decided before numba.cuda loads
import numpy as np
from numba import cuda, float32

from numba_flash.ladder import _host

GPU_TILES = dict(Br=32, Bc=32)
SIM_TILES = dict(Br=4, Bc=4)    # the simulator runs a Python thread per CUDA thread: tiny blocks
TILES = SIM_TILES if SIMULATOR else GPU_TILES


@functools.lru_cache(maxsize=None)
def make_kernel(Br, Bc):
    assert Br & (Br - 1) == 0 and Bc & (Bc - 1) == 0, "the reduction trees need powers of two"
    HALVES = tuple(Bc >> s for s in range(1, int(math.log2(Bc)) + 1))   # Bc/2, Bc/4, ..., 1
    ZERO, NEG_INF = np.float32(0), np.float32(-np.inf)
    JIT = {} if SIMULATOR else {"launch_bounds": (Br * Bc, 1)}

    @cuda.jit(**JIT)
    def kernel(q, k, v, out, scale_log2):
        Nq, d = q.shape
        Nk = k.shape[0]
        tx = cuda.threadIdx.x            # query row in the tile (varies fastest across a warp)
        ty = cuda.threadIdx.y            # output column in the tile, and the key it scores
        row = cuda.blockIdx.x * Br + tx
        col = cuda.blockIdx.y * Bc + ty
        Sij = cuda.shared.array((Br, Bc), float32)   # scores, then probabilities P_ij
        red = cuda.shared.array((Br, Bc), float32)   # scratch for the row max and row sum trees

        m_i = NEG_INF                    # running row max (log2 units)
        l_i = ZERO                       # running row sum of exp2(S - m_i)
        o = ZERO                         # unnormalised O[row, col]
        for j0 in range(0, Nk, Bc):
            # S_ij = Q_i K_jᵀ · scale: thread (tx, ty) scores query row tx against key ty.
            key = j0 + ty
            x = NEG_INF                  # keys past the end get probability 0
            if key < Nk:
                acc = ZERO
                if row < Nq:             # rows past the end score 0 (finite) and are never stored
                    for c in range(d):
                        acc += q[row, c] * k[key, c]
                x = acc * scale_log2
            Sij[tx, ty] = x
            red[tx, ty] = x
            cuda.syncthreads()           # all of S_ij is written before the tree reads it

            # m_new = max(m_i, rowmax(S_ij)): halve the row until red[tx, 0] holds its max.
            for h in HALVES:
                if ty < h:
                    red[tx, ty] = max(red[tx, ty], red[tx, ty + h])
                cuda.syncthreads()       # this level is complete before the next reads it
            m_new = max(m_i, red[tx, 0])
            cuda.syncthreads()           # every thread has read red[tx, 0] before red is reused

            p = math.exp2(x - m_new)     # P_ij; exp2(-inf) = 0
            Sij[tx, ty] = p
            red[tx, ty] = p
            cuda.syncthreads()           # all of P_ij is written before the tree and P V read it
            for h in HALVES:             # rowsum(P_ij), the same tree with + instead of max
                if ty < h:
                    red[tx, ty] += red[tx, ty + h]
                cuda.syncthreads()       # this level is complete before the next reads it

            alpha = math.exp2(m_i - m_new)        # rescales what was accumulated against m_i
            l_i = l_i * alpha + red[tx, 0]
            # O_i = O_i · alpha + P_ij V_j: V read straight from global memory.
            acc = ZERO
            if col < d:
                for jj in range(min(Bc, Nk - j0)):
                    acc += Sij[tx, jj] * v[j0 + jj, col]
            o = o * alpha + acc
            m_i = m_new
            cuda.syncthreads()           # Sij and red are fully read before the next tile rewrites them

        if row < Nq and col < d:
            out[row, col] = o / l_i

    kernel.threads = Br * Bc
    return kernel


def _launch(q, k, v, out, scale_log2):
    Br, Bc = TILES["Br"], TILES["Bc"]
    Nq, d = out.shape
    grid = (_host.cdiv(Nq, Br), _host.cdiv(d, Bc))
    _host.run_kernel(make_kernel(**TILES), grid, (Br, Bc), 0, (q, k, v, out, scale_log2))


def attention(q, k, v):
    """``softmax(q kᵀ / √d) v`` for float32 ``q (Nq, d)``, ``k, v (Nk, d)``: equivalent to
    ``numba_flash.reference.attention``. NumPy in -> NumPy out; device in -> device out."""
    return _host.run(q, k, v, _launch)
