"""Rung 2 — coalesced shared-memory tiles.

**Changed from rung 1.** Two things, both about memory access:

* The warp now spans a *row* of the tile: ``tx`` (fastest across a warp) indexes the key
  and the output column, ``ty`` the query row. A warp's global loads of a tile row are
  then ``Bc`` consecutive floats (one 128-byte transaction), and so is its store of O.
* ``Q_i`` and ``K_j`` are staged in shared memory, a ``Bc``-wide chunk of the head dim at a
  time, and ``V_j`` as one ``Bc × Bc`` tile. Each element is read from global memory once
  per block (per key tile) instead of once per *thread*; all reuse happens on-chip.

The arithmetic, the reductions and the barriers are rung 1's.

**Why, and what it should buy** (N = d = 1024, Br = Bc = 32). Rung 1 moved ~1.1 TB of
sectors for Q alone. Now each block copies ``(Br + Bc) · d + Bc · Bc`` floats per key tile,
coalesced: 1024 blocks × 32 tiles × 66 K floats ≈ 8.7 GB, served from L2 (Q, K and V are
12 MB together), ≈ 1 ms. The inner loop becomes two shared loads per FMA — ``Qi[ty, c]``
is one word for the whole warp (a broadcast) and ``Kj[tx, c]`` is 32 words in 32 different
banks — ≈ 2·10⁹ warp loads, ≈ 8 ms of shared-memory issue on 132 SMs. Expect ~10 ms:
≈ 10× faster than rung 1 (the seed's C++ original: 155.9 → 15.9 ms on an H200), with
no change to the arithmetic at all.

**Measured** (NVIDIA H200, 2026-11-29, commit 2a74295; N = d = 1024, ``python bench.py
ladder``; written by docs/gen_ladder.py): 12.853 ms, 0.33 TFLOP/s, max error 6.5e-05
against the float64 oracle (passes the seed's 1e-04). 11.50× faster than rung 1. The
seed's C++ twin on an H200: 15.90 ms, so this rung is 1.24× faster.

**Caveats.** ``Kj`` rows are padded by one word: thread ``tx`` reads row ``tx`` of ``Kj`` at
the same column as its neighbours, and with rows of exactly ``Bc = 32`` words all 32
reads would fall in one bank (a 32-way conflict); ``Bc + 1`` words per row put them in 32
different banks. Tiles are square (``Br = Bc``, a power of two): thread ``(tx, ty)`` copies
element ``(ty, tx)`` of every tile. Q is still reloaded for every key tile.
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
    assert Br == Bc and Bc & (Bc - 1) == 0, "square tiles, a power of two"
    HALVES = tuple(Bc >> s for s in range(1, int(math.log2(Bc)) + 1))   # Bc/2, Bc/4, ..., 1
    KS = Bc + 1                      # row stride of Kj: + 1 word, no bank conflict (see Caveats)
    ZERO, NEG_INF = np.float32(0), np.float32(-np.inf)
    JIT = {} if SIMULATOR else {"launch_bounds": (Br * Bc, 1)}

    @cuda.jit(**JIT)
    def kernel(q, k, v, out, scale_log2):
        Nq, d = q.shape
        Nk = k.shape[0]
        tx = cuda.threadIdx.x            # key in the tile, and output column (varies fastest)
        ty = cuda.threadIdx.y            # query row in the tile
        i0 = cuda.blockIdx.x * Br
        c0 = cuda.blockIdx.y * Bc
        row = i0 + ty
        col = c0 + tx
        Qi = cuda.shared.array((Br, Bc), float32)       # a Bc-wide chunk of the head dim of Q_i
        Kj = cuda.shared.array((Bc, KS), float32)       # ... of K_j, rows padded by one word
        Vj = cuda.shared.array((Bc, Bc), float32)       # V_j: Bc keys × the block's Bc output columns
        Sij = cuda.shared.array((Br, Bc), float32)      # scores, then probabilities P_ij
        red = cuda.shared.array((Br, Bc), float32)      # scratch for the row max and row sum trees

        m_i = NEG_INF                    # running row max (log2 units)
        l_i = ZERO                       # running row sum of exp2(S - m_i)
        o = ZERO                         # unnormalised O[row, col]
        for j0 in range(0, Nk, Bc):
            # S_ij = Q_i K_jᵀ · scale, one Bc-wide chunk of the head dim at a time.
            acc = ZERO
            for d0 in range(0, d, Bc):
                # Coalesced: a warp copies Bc consecutive floats of one row. Zero outside.
                x = ZERO
                if row < Nq and d0 + tx < d:
                    x = q[row, d0 + tx]
                Qi[ty, tx] = x
                x = ZERO
                if j0 + ty < Nk and d0 + tx < d:
                    x = k[j0 + ty, d0 + tx]
                Kj[ty, tx] = x
                cuda.syncthreads()       # the chunk is complete before any thread reads it
                for c in range(Bc):
                    acc += Qi[ty, c] * Kj[tx, c]   # Qi: one word per warp (broadcast)
                cuda.syncthreads()       # the chunk is fully read before the next one overwrites it
            x = NEG_INF                  # keys past the end get probability 0
            if j0 + tx < Nk:
                x = acc * scale_log2
            vx = ZERO
            if j0 + ty < Nk and col < d:
                vx = v[j0 + ty, col]
            Vj[ty, tx] = vx              # V_j, coalesced like Q and K
            Sij[ty, tx] = x
            red[ty, tx] = x
            cuda.syncthreads()           # S_ij and V_j are complete before anyone reads them

            # m_new = max(m_i, rowmax(S_ij)): halve the row until red[ty, 0] holds its max.
            for h in HALVES:
                if tx < h:
                    red[ty, tx] = max(red[ty, tx], red[ty, tx + h])
                cuda.syncthreads()       # this level is complete before the next reads it
            m_new = max(m_i, red[ty, 0])
            cuda.syncthreads()           # every thread has read red[ty, 0] before red is reused

            p = math.exp2(x - m_new)     # P_ij; exp2(-inf) = 0
            Sij[ty, tx] = p
            red[ty, tx] = p
            cuda.syncthreads()           # all of P_ij is written before the tree and P V read it
            for h in HALVES:             # rowsum(P_ij), the same tree with + instead of max
                if tx < h:
                    red[ty, tx] += red[ty, tx + h]
                cuda.syncthreads()       # this level is complete before the next reads it

            alpha = math.exp2(m_i - m_new)        # rescales what was accumulated against m_i
            l_i = l_i * alpha + red[ty, 0]
            # O_i = O_i · alpha + P_ij V_j, both from shared memory (V_j is zero past the end).
            acc = ZERO
            for jj in range(Bc):
                acc += Sij[ty, jj] * Vj[jj, tx]
            o = o * alpha + acc
            m_i = m_new
            cuda.syncthreads()           # Sij, red and Vj are fully read before the next tile rewrites them

        if row < Nq and col < d:
            out[row, col] = o / l_i

    kernel.threads = Br * Bc
    return kernel


def _launch(q, k, v, out, scale_log2):
    Br, Bc = TILES["Br"], TILES["Bc"]
    Nq, d = out.shape
    grid = (_host.cdiv(Nq, Br), _host.cdiv(d, Bc))
    _host.run_kernel(make_kernel(**TILES), grid, (Bc, Br), 0, (q, k, v, out, scale_log2))


def attention(q, k, v):
    """``softmax(q kᵀ / √d) v`` for float32 ``q (Nq, d)``, ``k, v (Nk, d)``: equivalent to
    ``numba_flash.reference.attention``. NumPy in -> NumPy out; device in -> device out."""
    return _host.run(q, k, v, _launch)
