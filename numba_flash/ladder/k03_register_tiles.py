"""Rung 3 — register tiling and warp-shuffle reductions.

**Changed from rung 2.** The block is ``W`` warps of 32 lanes (1-D). Warp ``w`` owns the
``TM`` query rows ``w·TM + i``; lane ``lane`` owns key ``j0 + lane`` of every key tile
(``Bc = 32``) and the ``TV`` output columns ``c0 + lane + 32·f``. So each thread keeps a
``TM × TV`` tile of O and a column of ``TM`` scores in registers, and a row of S lives
across the 32 lanes of one warp:

* ``rowmax`` and ``rowsum`` are 5-step butterflies of ``shfl.xor`` (every lane ends with
  the result), not shared-memory trees with a barrier per level;
* the scores never go to shared memory until ``P_ij`` is written once for ``P V``.

One dynamic shared-memory buffer holds the tiles (``Q_i`` and ``K_j`` chunks, ``V_j``, ``P_ij``).

**Why, and what it should buy** (N = d = 1024; W = 8, TM = 4, TV = 8, DK = 64: Br = 32
rows, Bd = 256 columns per block, 128 blocks of 256 threads, about one per SM). Rung 2 spent 2
shared loads per FMA, and 14 barriers per key tile on its trees. Here a thread loads
``TM + 1`` words per head-dim step (``TM`` broadcasts of Q, one K word) for ``TM`` FMAs,
and each block produces 8× more columns, so the recomputed ``S = Q Kᵀ`` (once per column
block) is done d / Bd = 4 times instead of 32: ≈ 2·10⁸ shared-memory wavefronts in all
(S ≈ 1.7·10⁸, P·V ≈ 0.4·10⁸), ≈ 0.9 ms at one wavefront per clock on 132 SMs, with two
barriers per 64-column head-dim chunk plus two per key tile. Only 8 warps per SM hide the latency
of those barriers and of the chunk copies, so expect ≈ 2 ms, 6–8× faster than rung 2
(the seed's C++ original: 15.9 → 2.21 ms on an H200).

**Tiles.** The seed's kernel 3 gives each thread 2 × 4 outputs. Here that tile (W = 4)
ran at 6.6 ms, three times its C++ twin, and the register tile turned out to be this
rung's largest lever (H200 sweep, CUDA events, L2 not flushed, ms): TM × TV = 2 × 4: 6.6
(W = 4) and 5.9 (W = 16); 4 × 4: 3.7; 2 × 8: 3.5–3.8; 8 × 4: 2.9; 4 × 8: 2.5 (W = 4) and
2.19 (W = 8: 116 registers). Asking for more blocks per SM instead (launch bounds of 4–8
blocks, 64–86 registers) gave 5.9–6.0 ms at the 2 × 4 tile. Then the head-dim chunk, with
L2 flushed before each repeat as ``bench.py ladder`` does: DK = 16: 3.94, 32: 2.59,
64: 1.82 (chosen; half the chunks, so half the barriers and copy round trips per key
tile). So the widening the seed makes in its kernel 4 happens here; rung 4 keeps this tile.

**Numba's own costs.** Written as plainly as the C++ twin (2 × 4 tile), this rung first ran at 13.0 ms
(no faster than rung 2). An H200 profile showed 166 registers per thread (three blocks
per SM) and warps waiting on global loads; the PTX showed three costs that C++ does not
pay, each fixed here in a way every later rung keeps:

* *Negative indices.* A Numba array accepts ``a[-1]``, so a signed index costs a
  compare-and-add before every access unless the compiler proves it is >= 0 (it did not
  for these offsets into the dynamic shared buffer). ``U = numba.uint64`` marks the hot
  indices as unsigned, and the loads become single instructions with constant offsets.
* *Long ``range`` loops.* Numba's ``range`` loop carries an iterator that LLVM unrolls
  only partially when the body is large, leaving that bookkeeping in every step.
  The inner loops run in groups of ``UNROLL = 4`` steps (``for cb in range(0, DK, UNROLL):
  for cu in range(UNROLL)``), which LLVM unrolls completely.
* *Loads that wait for stores.* In C++ the compiler knows a kernel's pointer arguments
  are global memory and ``__shared__`` arrays are shared memory, so it hoists the loads of
  an unrolled copy loop above the stores and keeps several in flight. Numba passes every
  array as a generic pointer that might alias the shared buffer, so each load waited for
  the previous store: ten dependent L2 round trips per head-dim chunk. ``copy_tile`` now
  loads ``BATCH = 8`` elements into registers before it stores any.

The first two took the rung to 10.9 ms; the third is what the prediction above assumed.

**Measured** (NVIDIA H200, 2026-11-29, commit 2a74295; N = d = 1024, ``python bench.py
ladder``; written by docs/gen_ladder.py): 1.934 ms, 2.22 TFLOP/s, max error 6.5e-05
against the float64 oracle (passes the seed's 1e-04). 6.65× faster than rung 2. The seed's
C++ twin on an H200: 2.21 ms, so this rung is 1.14× faster.

**Caveats.** ``Q_i`` is still reloaded for every key tile. Chunk rows are padded by one
word (as rung 2's ``Kj``), so the 32 lanes reading 32 different K rows at one column hit
32 different banks.
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
UNROLL = 4          # inner loops run in groups of this many steps (see "Numba's own costs")
BATCH = 8           # loads in flight per thread in a tile copy (see "Numba's own costs")
U = numba.uint64    # an index known to be >= 0 (see "Numba's own costs")
SIM_TILES = dict(W=1, TM=2, TV=1, DK=8)     # one warp: the simulator runs a Python thread per lane
TILES = SIM_TILES if SIMULATOR else GPU_TILES


def shape(W, TM, TV, DK):
    """(threads, Br, Bc, Bd) of a tiling: W warps, TM rows per warp, one key and TV columns per lane."""
    return 32 * W, W * TM, 32, 32 * TV


@functools.lru_cache(maxsize=None)
def make_kernel(W, TM, TV, DK):
    NT, Br, Bc, Bd = shape(W, TM, TV, DK)
    KS = DK + 1                      # row stride of the Q and K chunks: +1 word, no bank conflict
    Q_OFF = 0                        # Q_i chunk     Br × DK  (row stride KS)
    K_OFF = Q_OFF + Br * KS          # K_j chunk     Bc × DK  (row stride KS)
    V_OFF = K_OFF + Bc * KS          # V_j tile      Bc × Bd
    P_OFF = V_OFF + Bc * Bd          # P_ij          Br × Bc
    WORDS = P_OFF + Br * Bc
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

    @cuda.jit(**JIT)
    def kernel(q, k, v, out, scale_log2):
        Nq, d = q.shape
        Nk = k.shape[0]
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

        for j0 in range(0, Nk, Bc):
            for i in range(TM):
                s[i] = ZERO
            for d0 in range(0, d, DK):
                copy_tile(smem, Q_OFF, KS, q, i0, Br, d0, DK, Nq, d, tid)    # the Q_i chunk
                copy_tile(smem, K_OFF, KS, k, j0, Bc, d0, DK, Nk, d, tid)    # the K_j chunk
                cuda.syncthreads()       # the chunk is complete before any thread reads it
                for cb in range(0, DK, UNROLL):
                    for cu in range(UNROLL):   # S += Q_i K_jᵀ: TM FMAs per K word
                        c = cb + cu
                        kx = smem[U(K_OFF + lane * KS + c)]
                        for i in range(TM):
                            s[i] += smem[U(Q_OFF + (w * TM + i) * KS + c)] * kx   # broadcast
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
    kernel.smem_bytes = WORDS * 4
    return kernel


def _launch(q, k, v, out, scale_log2):
    NT, Br, Bc, Bd = shape(**TILES)
    Nq, d = out.shape
    kern = make_kernel(**TILES)
    grid = (_host.cdiv(Nq, Br), _host.cdiv(d, Bd))
    _host.run_kernel(kern, grid, NT, kern.smem_bytes, (q, k, v, out, scale_log2))


def attention(q, k, v):
    """``softmax(q kᵀ / √d) v`` for float32 ``q (Nq, d)``, ``k, v (Nk, d)``: equivalent to
    ``numba_flash.reference.attention``. NumPy in -> NumPy out; device in -> device out."""
    return _host.run(q, k, v, _launch)
