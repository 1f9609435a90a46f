"""Rung 7 — double buffering: copy the next K chunk while computing on this one.

**Changed from rung 6.** Copies no longer pass through registers and no longer stall the
block. Every global → shared copy is a 16-byte ``cp.async`` (``ops.cp_async16_2d``), which
the hardware completes in the background until ``cp.async.wait_group``. The K chunk gets
two shared-memory slots, used alternately:

    issue chunk c+1 (of this tile, or the next tile's chunk 0) → other slot   cp.async
    wait until chunk c has landed; barrier                                    wait_group
    S += Q_i K_jᵀ on chunk c's slot                                           overlaps the copy
    barrier (chunk c's slot may be refilled)

``V_j`` is issued at the start of tile j and lands while S is computed; ``Q_i`` travels
with the first chunk.

**Why, and what it should buy.** In rungs 2–6 every chunk is "load, barrier, compute,
barrier": while the ``Bc × DK`` chunk is in flight (an L2 round trip: several hundred
cycles per chunk, 32 chunks per key tile at d = 1024) the block's 4 warps have nothing
else to do, and the copy itself costs load, store and address instructions per thread.
Here the copy of chunk c+1 overlaps the FMAs of chunk c, and ``V_j``'s copy overlaps the
whole of S. The shared-memory work per FMA is unchanged, so this only removes stall
time: expect a modest gain, ≈ 1.1–1.3× over rung 6 (the seed's C++ original: 1.56 →
1.39 ms on an H200, its best kernel).

**Tiles.** Rung 6's tile (W = 4, TM = 4, TV = 8) at DK = 32. H200 sweep (CUDA events, L2
not flushed, ms; W × TM × TV): 4 × 2 × 8: 1.22; 8 × 2 × 8: 1.23; 8 × 4 × 8: 0.97;
4 × 4 × 8: 0.88 (chosen, 162 registers). With L2 flushed: 4 × 4 × 8 at DK = 32: 0.93, at
DK = 64: 1.21, unlike rungs 3–6: with two K slots a block needs 115 KB of shared memory at
DK = 64, and two such blocks no longer fit an SM's 228 KB (107 KB at DK = 32: two fit).
8 × 4 × 8: 0.98; 8 × 2 × 8 at DK = 64: 1.15.

**Measured** (NVIDIA H200, 2026-11-29, commit 2a74295; N = d = 1024, ``python bench.py
ladder``; written by docs/gen_ladder.py): 1.027 ms, 4.18 TFLOP/s, max error 3.0e-05
against the float64 oracle (passes the seed's 1e-04). 1.07× faster than rung 6. The seed's
C++ twin on an H200: 1.39 ms, so this rung is 1.35× faster.

**Caveats.** Needs compute capability ≥ 8.0 (``cp.async``), ``d % 4 == 0`` and 16-byte
aligned rows. The second slot costs ``Bc·(DK + 4)`` words of shared memory. The wait
counts are literals: at chunk 0, two younger groups (``V_j``, the next chunk) may stay in
flight; at later chunks one; before ``P V``, one (the next tile's first chunk). Groups
are committed even when empty so these counts hold at the last chunk.
"""
import functools
import math

from numba_flash._runtime import SIMULATOR   # first: GPU or simulator, decided before numba.cuda loads
import numpy as np
from numba import cuda, float32

from numba_flash import ops, warp
from numba_flash.ladder import _host

GPU_TILES = dict(W=4, TM=4, TV=8, DK=32)     # the seed problem's fastest (see "Tiles")
LARGE_D_TILES = dict(W=4, TM=2, TV=8, DK=32)   # Br = 8: Q_i fits shared memory up to d = 4096
SIM_TILES = dict(W=1, TM=2, TV=4, DK=8)     # one warp: the simulator runs a Python thread per lane
TILES = SIM_TILES if SIMULATOR else GPU_TILES


def shape(W, TM, TV, DK):
    """(threads, Br, Bc, Bd) of a tiling: W warps, TM rows per warp, one key and TV columns per lane."""
    assert TV % 4 == 0 and DK % 4 == 0
    return 32 * W, W * TM, 32, 32 * TV


@functools.lru_cache(maxsize=None)
def make_kernel(W, TM, TV, DK):
    NT, Br, Bc, Bd = shape(W, TM, TV, DK)
    G = TV // 4                      # groups of 4 adjacent output columns per lane
    KS = DK + 4                      # row stride of the K chunk: rows start 4 banks apart, 16-byte aligned
    ZERO, NEG_INF = np.float32(0), np.float32(-np.inf)
    FULL = warp.FULL_MASK
    ALIGN = None if SIMULATOR else 16            # the simulator accepts only alignment=None
    JIT = {} if SIMULATOR else {"launch_bounds": (NT, 1)}

    @cuda.jit(device=True, inline="always")
    def copy_tile(smem, off, stride, src, r0, nrows, c0, ncols, n_lim, d, tid):
        """Start smem[off + r·stride + c] = src[r0 + r, c0 + c] for r < nrows, c < ncols, one
        16-byte cp.async per 4 columns; zeros outside src's n_lim rows and d columns (a
        0-byte copy, its source address kept valid). Lands at ops.cp_async_wait."""
        C4 = ncols >> 2
        for e in range(tid, nrows * C4, NT):
            r = e // C4
            c = (e - r * C4) * 4
            ok = r0 + r < n_lim and c0 + c < d
            ops.cp_async16_2d(smem, off + r * stride + c, src,
                              r0 + r if ok else 0, c0 + c if ok else 0, 16 if ok else 0)

    def layout(d):
        """Shared-memory layout for head dim d: (DQ, K_OFF, V_OFF, P_OFF, words)."""
        DQ = -(-d // DK) * DK        # Q_i row stride: d rounded up to whole chunks
        K_OFF = Br * DQ              # Q_i (the whole row block) at 0: Br × DQ
        V_OFF = K_OFF + 2 * Bc * KS  # two K_j chunk slots, Bc × DK each (row stride KS)
        P_OFF = V_OFF + Bc * Bd      # V_j tile      Bc × Bd
        return DQ, K_OFF, V_OFF, P_OFF, P_OFF + Br * Bc   # P_ij: Br × Bc

    layout_dev = layout if SIMULATOR else cuda.jit(device=True, inline="always")(layout)   # for the kernel

    @cuda.jit(**JIT)
    def kernel(q, k, v, out, scale_log2):
        Nq, d = q.shape
        Nk = k.shape[0]
        DQ, K_OFF, V_OFF, P_OFF, _ = layout_dev(d)
        tid = cuda.threadIdx.x
        w = tid >> 5                     # warp: query rows w·TM + i
        lane = tid & 31                  # lane: key j0 + lane, output columns c0 + 128·g + 4·lane + e
        i0 = cuda.blockIdx.x * Br
        c0 = cuda.blockIdx.y * Bd
        smem = cuda.shared.array(0, float32, alignment=ALIGN)
        s = cuda.local.array(TM, float32)          # S[w·TM + i, j0 + lane]
        o = cuda.local.array((TM, TV), float32)    # unnormalised O[w·TM + i, c0 + 128·g + 4·lane + e]
        m = cuda.local.array(TM, float32)          # running row max m_i (log2 units)
        l = cuda.local.array(TM, float32)          # running row sum l_i
        pv = cuda.local.array((TM, 4), float32)    # four P_ij values of each row
        for i in range(TM):
            m[i] = NEG_INF
            l[i] = ZERO
            for f in range(TV):
                o[i, f] = ZERO

        copy_tile(smem, 0, DQ, q, i0, Br, 0, DQ, Nq, d, tid)         # Q_i, once
        copy_tile(smem, K_OFF, KS, k, 0, Bc, 0, DK, Nk, d, tid)      # tile 0, chunk 0 -> slot 0
        ops.cp_async_commit()
        slot = 0

        for j0 in range(0, Nk, Bc):
            copy_tile(smem, V_OFF, Bd, v, j0, Bc, c0, Bd, Nk, d, tid)    # V_j lands while S is computed
            ops.cp_async_commit()
            for i in range(TM):
                s[i] = ZERO
            for d0 in range(0, d, DK):
                nj, nd = j0, d0 + DK             # the next chunk: of this tile, else the next tile's first
                if nd >= d:
                    nj, nd = j0 + Bc, 0
                if nj < Nk:                      # into the other slot (last read before the previous barrier)
                    copy_tile(smem, K_OFF + (1 - slot) * Bc * KS, KS, k, nj, Bc, nd, DK, Nk, d, tid)
                ops.cp_async_commit()            # committed even when empty: keeps the wait counts below
                if d0 == 0:
                    ops.cp_async_wait(2)         # this chunk (and Q_i) landed; V_j, the next chunk in flight
                else:
                    ops.cp_async_wait(1)         # this chunk landed; the next one in flight
                cuda.syncthreads()       # ... for every thread's copies, not just this thread's
                base = K_OFF + slot * Bc * KS
                for c in range(0, DK, 4):    # S += Q_i K_jᵀ over this chunk, 4 columns per load
                    k0, k1, k2, k3 = ops.ld_shared_x4(smem, base + lane * KS + c)   # 32 rows, no conflict
                    for i in range(TM):
                        q0, q1, q2, q3 = ops.ld_shared_x4(smem, (w * TM + i) * DQ + d0 + c)   # broadcast
                        s[i] += q0 * k0 + q1 * k1 + q2 * k2 + q3 * k3
                cuda.syncthreads()       # this slot is fully read before the next chunk's copy refills it
                slot = 1 - slot

            # Online softmax. Row w·TM + i of S_ij is spread over the 32 lanes of this warp.
            for i in range(TM):
                x = NEG_INF                      # keys past the end get probability 0
                if j0 + lane < Nk:
                    x = s[i] * scale_log2
                mx = x
                for off in (16, 8, 4, 2, 1):     # butterfly: every lane ends with rowmax(S_ij)
                    mx = max(mx, warp.shfl_xor_sync(FULL, mx, off))
                m_new = max(m[i], mx)
                p = math.exp2(x - m_new)         # P_ij
                rs = p
                for off in (16, 8, 4, 2, 1):     # ... and with rowsum(P_ij)
                    rs += warp.shfl_xor_sync(FULL, rs, off)
                alpha = math.exp2(m[i] - m_new)  # rescales what was accumulated against m_i
                l[i] = l[i] * alpha + rs
                m[i] = m_new
                for f in range(TV):
                    o[i, f] *= alpha
                smem[P_OFF + (w * TM + i) * Bc + lane] = p
            ops.cp_async_wait(1)         # V_j landed (the next tile's first chunk may be in flight)
            cuda.syncthreads()           # P_ij and V_j (every thread's copies) are complete before P V reads them
            for jj in range(0, Bc, 4):   # O_i += P_ij V_j, four keys per step
                for i in range(TM):      # broadcast
                    pv[i, 0], pv[i, 1], pv[i, 2], pv[i, 3] = ops.ld_shared_x4(smem, P_OFF + (w * TM + i) * Bc + jj)
                for e in range(4):
                    for g in range(G):   # 32 lanes × 16 consecutive bytes
                        v0, v1, v2, v3 = ops.ld_shared_x4(smem, V_OFF + (jj + e) * Bd + 128 * g + 4 * lane)
                        for i in range(TM):
                            p = pv[i, e]
                            o[i, 4 * g] += p * v0
                            o[i, 4 * g + 1] += p * v1
                            o[i, 4 * g + 2] += p * v2
                            o[i, 4 * g + 3] += p * v3
            cuda.syncthreads()           # P_ij and V_j are fully read before the next tile overwrites them
        ops.cp_async_wait(0)             # nothing left in flight at exit

        for i in range(TM):
            row = i0 + w * TM + i
            if row < Nq:
                for g in range(G):
                    col = c0 + 128 * g + 4 * lane
                    if col < d:          # d % 4 == 0: four columns are all in or all out
                        for e in range(4):
                            out[row, col + e] = o[i, 4 * g + e] / l[i]

    kernel.threads = NT
    kernel.smem_bytes = lambda d: layout(d)[-1] * 4
    return kernel


def _launch(q, k, v, out, scale_log2):
    Nq, d = out.shape
    tiles = _host.fitting(make_kernel, d, TILES, LARGE_D_TILES)
    NT, Br, Bc, Bd = shape(**tiles)
    kern = make_kernel(**tiles)
    grid = (_host.cdiv(Nq, Br), _host.cdiv(d, Bd))
    _host.run_kernel(kern, grid, NT, kern.smem_bytes(d), (q, k, v, out, scale_log2))


def attention(q, k, v):
    """``softmax(q kᵀ / √d) v`` for float32 ``q (Nq, d)``, ``k, v (Nk, d)``: equivalent to
    ``numba_flash.reference.attention``. NumPy in -> NumPy out; device in -> device out."""
    return _host.run(q, k, v, _launch, vector=True)
