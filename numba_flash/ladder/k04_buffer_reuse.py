"""Rung 4 — Q_i loaded once (buffer reuse).

**Changed from rung 3.** ``Q_i`` is the same for every key tile, yet rung 3 copied it
again, chunk by chunk, for each of the N / Bc tiles. Now the whole ``Br × d`` row block is
copied into shared memory once, before the key loop, and reused by every tile; only
``K_j`` is chunked. (The seed also widens its register tile at this step, 2 × 4 → 3 × 4
outputs per thread; rung 3 already took the wider tile, which mattered most in Numba.)

**Why, and what it should buy** (N = d = 1024; W = 8, TM = 4, TV = 8, DK = 64 as in
rung 3: Br = 32, Bd = 256, 128 blocks of 256 threads). The S and P·V loops are rung 3's. The
copies per block and key tile drop from ``(Br + Bc)·d`` to ``Bc·d`` floats, half of them
at Br = Bc = 32, and a chunk needs one copy loop and one barrier pair for K alone. The
copies are the part of rung 3 that its 8 warps per SM could not hide (each chunk's loads
wait on L2 before the barrier lets the FMAs start), so expect up to the copies' share of
the time back: ≈ 1.3–1.5× over rung 3. (The seed's C++ rung 4 got *slower* on the H200:
2.21 → 2.57 ms.)

**Tiles.** H200 sweep (CUDA events, L2 not flushed, ms; W × TM × TV at DK = 32):
4 × 2 × 8: 3.6; 8 × 2 × 8: 2.5; 4 × 4 × 8: 2.1; 8 × 4 × 4: 2.7; 4 × 8 × 4: 3.7; 8 × 4 × 8:
1.46. With rung 3's DK = 64 (``bench.py ladder``, L2 flushed): 1.42 ms, against 1.94–2.06
at DK = 32 (chosen: DK = 64).

**Measured** (NVIDIA H200, 2026-11-29, commit 2a74295; N = d = 1024, ``python bench.py
ladder``; written by docs/gen_ladder.py): 1.558 ms, 2.76 TFLOP/s, max error 6.5e-05
against the float64 oracle (passes the seed's 1e-04). 1.24× faster than rung 3. The seed's
C++ twin on an H200: 2.57 ms, so this rung is 1.65× faster.

**Caveats.** Shared memory per block now grows with d: ``4·(Br·d + …)`` bytes, 172 KB at
d = 1024 with Br = 32. Where that does not fit the GPU (d > 1024 on an H200),
``_host.fitting`` takes ``LARGE_D_TILES`` (Br = 8: 165 KB at d = 4096); beyond that,
``launch`` raises a ValueError naming the limit.
"""
import functools
import math

from numba_flash._runtime import SIMULATOR   # first: GPU or simulator, decided before numba.cuda loads
import numba
import numpy as np
from numba import cuda, float32

from numba_flash import warp
from numba_flash.ladder import _host

GPU_TILES = dict(W=8, TM=4, TV=8, DK=64)     # the seed problem's fastest (see "Tiles")
LARGE_D_TILES = dict(W=4, TM=2, TV=8, DK=32)   # Br = 8: Q_i fits shared memory up to d = 4096
UNROLL = 4          # inner loops run in groups of this many steps (rung 3)
BATCH = 8           # loads in flight per thread in a tile copy (rung 3)
U = numba.uint64    # an index known to be >= 0 (rung 3)
SIM_TILES = dict(W=1, TM=2, TV=2, DK=8)     # one warp: the simulator runs a Python thread per lane
TILES = SIM_TILES if SIMULATOR else GPU_TILES


def shape(W, TM, TV, DK):
    """(threads, Br, Bc, Bd) of a tiling: W warps, TM rows per warp, one key and TV columns per lane."""
    return 32 * W, W * TM, 32, 32 * TV


@functools.lru_cache(maxsize=None)
def make_kernel(W, TM, TV, DK):
    NT, Br, Bc, Bd = shape(W, TM, TV, DK)
    KS = DK + 1                      # row stride of the K chunk: +1 word, no bank conflict
    ZERO, NEG_INF = np.float32(0), np.float32(-np.inf)
    FULL = warp.FULL_MASK
    ALIGN = None if SIMULATOR else 16            # the simulator accepts only alignment=None
    JIT = {} if SIMULATOR else {"launch_bounds": (NT, 1)}

    @cuda.jit(device=True, inline="always")
    def copy_tile(smem, off, stride, src, r0, nrows, c0, ncols, n_lim, d, tid):
        """smem[off + r·stride + c] = src[r0 + r, c0 + c] for r < nrows, c < ncols; zero outside
        src's n_lim rows and d columns. Coalesced: consecutive threads, consecutive columns.
        BATCH loads are issued before their stores, so their latencies overlap."""
        n = nrows * ncols
        buf = cuda.local.array(BATCH, float32)     # registers: the loop over it is unrolled
        for e0 in range(tid, n, NT * BATCH):
            for u in range(BATCH):                 # the loads: BATCH in flight at once ...
                e = e0 + u * NT
                r = e // ncols
                c = e - r * ncols
                x = ZERO
                if e < n and r0 + r < n_lim and c0 + c < d:
                    x = src[U(r0 + r), U(c0 + c)]
                buf[u] = x
            for u in range(BATCH):                 # ... then the stores
                e = e0 + u * NT
                if e < n:
                    r = e // ncols
                    smem[U(off + r * stride + e - r * ncols)] = buf[u]

    def layout(d):
        """Shared-memory layout for head dim d: (DQ, K_OFF, V_OFF, P_OFF, words)."""
        DQ = -(-d // DK) * DK        # Q_i row stride: d rounded up to whole chunks
        K_OFF = Br * DQ              # Q_i (the whole row block) at 0: Br × DQ
        V_OFF = K_OFF + Bc * KS      # K_j chunk     Bc × DK  (row stride KS)
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
        lane = tid & 31                  # lane: key j0 + lane, output columns c0 + lane + 32·f
        i0 = cuda.blockIdx.x * Br
        c0 = cuda.blockIdx.y * Bd
        smem = cuda.shared.array(0, float32, alignment=ALIGN)
        s = cuda.local.array(TM, float32)          # S[w·TM + i, j0 + lane]
        o = cuda.local.array((TM, TV), float32)    # unnormalised O[w·TM + i, c0 + lane + 32·f]
        m = cuda.local.array(TM, float32)          # running row max m_i (log2 units)
        l = cuda.local.array(TM, float32)          # running row sum l_i
        for i in range(TM):
            m[i] = NEG_INF
            l[i] = ZERO
            for f in range(TV):
                o[i, f] = ZERO

        copy_tile(smem, 0, DQ, q, i0, Br, 0, DQ, Nq, d, tid)   # Q_i, once (published by the first barrier)

        for j0 in range(0, Nk, Bc):
            for i in range(TM):
                s[i] = ZERO
            for d0 in range(0, d, DK):
                copy_tile(smem, K_OFF, KS, k, j0, Bc, d0, DK, Nk, d, tid)    # the K_j chunk
                cuda.syncthreads()       # the chunk (and Q_i) is complete before any thread reads it
                for cb in range(0, DK, UNROLL):
                    for cu in range(UNROLL):   # S += Q_i K_jᵀ: TM FMAs per K word
                        c = cb + cu
                        kx = smem[U(K_OFF + lane * KS + c)]
                        for i in range(TM):
                            s[i] += smem[U((w * TM + i) * DQ + d0 + c)] * kx   # broadcast
                cuda.syncthreads()       # the chunk is fully read before the next one overwrites it

            copy_tile(smem, V_OFF, Bd, v, j0, Bc, c0, Bd, Nk, d, tid)        # V_j: Bc keys × Bd columns

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
            cuda.syncthreads()           # P_ij and V_j are complete before P V reads them
            for jb in range(0, Bc, UNROLL):  # O_i += P_ij V_j
                for ju in range(UNROLL):
                    jj = jb + ju
                    for f in range(TV):
                        vx = smem[U(V_OFF + jj * Bd + lane + 32 * f)]      # 32 consecutive words
                        for i in range(TM):
                            o[i, f] += smem[U(P_OFF + (w * TM + i) * Bc + jj)] * vx   # broadcast
            cuda.syncthreads()           # P_ij and V_j are fully read before the next tile overwrites them

        for i in range(TM):
            row = i0 + w * TM + i
            if row < Nq:
                for f in range(TV):
                    col = c0 + lane + 32 * f
                    if col < d:
                        out[row, col] = o[i, f] / l[i]

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
    return _host.run(q, k, v, _launch)
