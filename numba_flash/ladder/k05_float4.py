"""Rung 5 — 128-bit (float4) loads and stores.

**Changed from rung 4.** Every copy and every shared-memory read moves four floats per
instruction: global → shared copies are ``ld.global.v4`` + ``st.shared.v4``
(``ops.ld_global_x4``, ``ops.st_shared_x4``), and the inner loops read Q, K, P and V with
``ld.shared.v4`` (``ops.ld_shared_x4``). A lane now owns the 4 *adjacent* output columns
``c0 + 128·g + 4·lane + e`` (``g < TV/4``), so that its V reads are one 16-byte load.
128-bit accesses must be 16-byte aligned, so the K chunk loses rung 4's one-word row
padding: its rows are exactly ``DK`` words long.

**Why, and what it should buy.** A quarter of the load/store instructions — if the
accesses stay as cheap per byte. They do not all stay cheap. For 128-bit loads a warp's
request is served in quarter-warp phases of 8 lanes; in the S loop lane ``lane`` reads
``K_j[lane, c:c+4]``, 32 rows ``DK = 32`` words apart, so all 32 lanes hit the same four
banks: a 32-way conflict, 32 wavefronts per load where 4 would do. Per 4 head-dim steps
a warp now spends ``TM`` broadcasts of Q (1 wavefront each) + 32 wavefronts for K = 36
at TM = 4, against rung 4's 4·(TM + 1) = 20 one-wavefront loads. The PV loop and the copies do get
cheaper (V and P reads are conflict-free), but S dominates (d / Bd = 4 recomputations):
expect rung 5 to be *slower* than rung 4, up to ~2× (the seed's C++ float4 kernel was
slower too: 4.93 → 5.76 ms on its Ada GPU, while on the H200 2.57 → 2.20 ms).

**Tiles.** W = 4 warps (Br = 16) instead of rung 4's 8, with rung 4's DK = 64: the
fastest measured (H200 sweep, CUDA events, L2 not flushed, ms; W × TM × TV at DK = 32):
4 × 2 × 8: 3.4; 8 × 2 × 8: 3.0; 8 × 4 × 8: 2.34; 4 × 4 × 8: 2.12. Then 4 × 4 × 8 with L2
flushed before each run: DK = 32: 2.12; DK = 64: 1.87 (chosen; half the chunk loads and
barriers). ``LARGE_D_TILES`` (Br = 8, DK = 32) for d where Q_i does not fit shared memory,
as in rung 4.

**Measured** (NVIDIA H200, 2026-11-29, commit 2a74295; N = d = 1024, ``python bench.py
ladder``; written by docs/gen_ladder.py): 1.880 ms, 2.28 TFLOP/s, max error 3.0e-05
against the float64 oracle (passes the seed's 1e-04). Slower than rung 4 (0.83×): a
regression (see above). The seed's C++ twin on an H200: 2.20 ms, so this rung is 1.17×
faster.

**Caveats.** Needs ``d % 4 == 0`` and 16-byte aligned rows (``attention`` raises a
ValueError otherwise). Kept in the ladder on purpose: vectorising changed the shared
memory access pattern, and the layout that was conflict-free at 4 bytes is not at 16.
Rung 6 fixes the layout.
"""
import functools
import math

from numba_flash._runtime import SIMULATOR   # first: GPU or simulator, decided before numba.cuda loads
import numpy as np
from numba import cuda, float32

from numba_flash import ops, warp
from numba_flash.ladder import _host

GPU_TILES = dict(W=4, TM=4, TV=8, DK=64)     # the seed problem's fastest (see "Tiles")
LARGE_D_TILES = dict(W=4, TM=2, TV=8, DK=32)   # Br = 8: Q_i fits shared memory up to d = 4096
BATCH = 4           # 16-byte loads in flight per thread in a tile copy (rung 3)
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
    KS = DK                          # row stride of the K chunk: 16-byte aligned rows, no padding
    ZERO, NEG_INF = np.float32(0), np.float32(-np.inf)
    FULL = warp.FULL_MASK
    ALIGN = None if SIMULATOR else 16            # the simulator accepts only alignment=None
    JIT = {} if SIMULATOR else {"launch_bounds": (NT, 1)}

    @cuda.jit(device=True, inline="always")
    def copy_tile(smem, off, stride, src, r0, nrows, c0, ncols, n_lim, d, tid):
        """smem[off + r·stride + c] = src[r0 + r, c0 + c] for r < nrows, c < ncols; zero outside
        src's n_lim rows and d columns. 16 bytes per load and store (ncols, d, c0 multiples of 4,
        so four columns are all in or all out); consecutive threads, consecutive 16-byte pieces."""
        C4 = ncols >> 2
        n = nrows * C4
        buf = cuda.local.array((BATCH, 4), float32)   # registers: the loops over it are unrolled
        for e0 in range(tid, n, NT * BATCH):
            for u in range(BATCH):                 # the loads: BATCH in flight at once (rung 3) ...
                e = e0 + u * NT
                r = e // C4
                c = (e - r * C4) * 4
                x0 = x1 = x2 = x3 = ZERO
                if e < n and r0 + r < n_lim and c0 + c < d:
                    x0, x1, x2, x3 = ops.ld_global_x4(src, r0 + r, c0 + c)
                buf[u, 0], buf[u, 1], buf[u, 2], buf[u, 3] = x0, x1, x2, x3
            for u in range(BATCH):                 # ... then the stores
                e = e0 + u * NT
                if e < n:
                    r = e // C4
                    c = (e - r * C4) * 4
                    ops.st_shared_x4(smem, off + r * stride + c, buf[u, 0], buf[u, 1], buf[u, 2], buf[u, 3])

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

        copy_tile(smem, 0, DQ, q, i0, Br, 0, DQ, Nq, d, tid)   # Q_i, once (published by the first barrier)

        for j0 in range(0, Nk, Bc):
            for i in range(TM):
                s[i] = ZERO
            for d0 in range(0, d, DK):
                copy_tile(smem, K_OFF, KS, k, j0, Bc, d0, DK, Nk, d, tid)    # the K_j chunk
                cuda.syncthreads()       # the chunk (and Q_i) is complete before any thread reads it
                for c in range(0, DK, 4):    # S += Q_i K_jᵀ over this chunk, 4 columns per load
                    k0, k1, k2, k3 = ops.ld_shared_x4(smem, K_OFF + lane * KS + c)   # 32 rows: conflict
                    for i in range(TM):
                        q0, q1, q2, q3 = ops.ld_shared_x4(smem, (w * TM + i) * DQ + d0 + c)   # broadcast
                        s[i] += q0 * k0 + q1 * k1 + q2 * k2 + q3 * k3
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
