"""Candidate rung 8: warp pairs share each query row group (S split over keys, O over columns).

Rung 8 as committed gives each warp 16 query rows and a block Bd = 128 output columns: a
lane holds Bd/2 output values, so Bd cannot grow past 128 without spilling, and S = Q Kᵀ
is recomputed d / Bd = 8 times (90% of its instructions). Here two warps share 16 rows:

* S: warp (r, h) computes S for rows 16r.. × keys h·Bc/2 .. (h+1)·Bc/2 (half the keys);
* row max: each warp's partial max goes through shared memory to its partner;
* P (fp32) goes to shared memory; each warp of the pair then computes O for its rows
  and half the block's Bd columns over all Bc keys: Bd = 256 at the same 64 O values
  per lane, so S is recomputed 4 times instead of 8;
* the row sums are combined through shared memory once, at the end.

Prediction (issue slots per warp and key tile, N = d = 1024, W = 4, Bc = 64, Bd = 256,
DK = 32; 128 blocks): S 128 k-steps × ~76 instructions (4 A + 4·2 B fragments loaded and
split, 12 mma, 16 adds) ≈ 9.7k, against ≈ 17.4k now; P·V unchanged ≈ 2k; so ≈ 0.6× the
time: ≈ 0.7 ms against 1.11 (rung 7: 0.94).
"""
import functools
import math

import numba
import numpy as np
from numba import cuda, float32

from numba_flash import ops, warp
from numba_flash._runtime import SIMULATOR
from numba_flash.ladder import _host

GPU_TILES = dict(W=4, Bc=64, Bd=256, DK=32)
SIM_TILES = dict(W=2, Bc=32, Bd=32, DK=8)     # one warp pair
TILES = SIM_TILES if SIMULATOR else GPU_TILES


def shape(W, Bc, Bd, DK, FAST=False):
    """(threads, Br, Bc, Bd): W warps in pairs, 16 query rows per pair."""
    assert W % 2 == 0 and Bc % 16 == 0 and Bd % 16 == 0 and DK % 8 == 0
    return 32 * W, 8 * W, Bc, Bd


@functools.lru_cache(maxsize=None)
def make_kernel(W, Bc, Bd, DK, FAST=False):
    """FAST: split operands with ops.tf32_round_fast and pass the small part unrounded (the
    mma reads its TF32 bits): 3 instructions an element instead of 7."""
    NT, Br, Bc, Bd = shape(W, Bc, Bd, DK)
    NSH, NOH = Bc // 16, Bd // 16     # 8-column pieces of S (keys) and of O per warp: half of each
    KS = DK + 4                       # Q/K chunk row stride: lane (g, t) reads word 4g + t: no conflict
    VS = Bd + 8                       # V row stride: rows t, t + 4 start 8t banks apart: no conflict
    PS = Bc + 4                       # P row stride: lane (g, t) reads word 4g + t: no conflict
    SLOT = (Br + Bc) * KS             # one Q_i chunk + one K_j chunk
    V_OFF = 2 * SLOT                  # two slots, then V_j (Bc × Bd, row stride VS)
    P_OFF = V_OFF + Bc * VS           # P_ij (Br × Bc, row stride PS)
    R_OFF = P_OFF + Br * PS           # per row and pair half: partial row max, then row sum
    WORDS = R_OFF + 2 * Br
    ZERO, NEG_INF = np.float32(0), np.float32(-np.inf)
    U = numba.uint64 if FAST else numba.int64     # FAST: unsigned shared-memory indices (rung 3)
    FULL = warp.FULL_MASK
    ALIGN = None if SIMULATOR else 16
    JIT = {} if SIMULATOR else {"launch_bounds": (NT, 1)}

    @cuda.jit(device=True, inline="always")
    def copy_tile(smem, off, stride, src, r0, nrows, c0, ncols, n_lim, d, tid):
        C4 = ncols >> 2
        for e in range(tid, nrows * C4, NT):
            r = e // C4
            c = (e - r * C4) * 4
            ok = r0 + r < n_lim and c0 + c < d
            ops.cp_async16_2d(smem, off + r * stride + c, src,
                              r0 + r if ok else 0, c0 + c if ok else 0, 16 if ok else 0)

    @cuda.jit(device=True, inline="always")
    def split(x):
        if FAST:
            big = ops.tf32_round_fast(x)
            return big, x - big
        big = ops.tf32_round(x)
        return big, ops.tf32_round(x - big)

    @cuda.jit(device=True, inline="always")
    def split4(x0, x1, x2, x3):
        h0, l0 = split(x0)
        h1, l1 = split(x1)
        h2, l2 = split(x2)
        h3, l3 = split(x3)
        return (h0, h1, h2, h3), (l0, l1, l2, l3)

    @cuda.jit(device=True, inline="always")
    def split2(x0, x1):
        h0, l0 = split(x0)
        h1, l1 = split(x1)
        return (h0, h1), (l0, l1)

    @cuda.jit(device=True, inline="always")
    def mma3(ah, al, bh, bl, c0, c1, c2, c3):
        t0, t1, t2, t3 = ops.mma_tf32_m16n8k8(al[0], al[1], al[2], al[3], bh[0], bh[1], ZERO, ZERO, ZERO, ZERO)
        t0, t1, t2, t3 = ops.mma_tf32_m16n8k8(ah[0], ah[1], ah[2], ah[3], bl[0], bl[1], t0, t1, t2, t3)
        t0, t1, t2, t3 = ops.mma_tf32_m16n8k8(ah[0], ah[1], ah[2], ah[3], bh[0], bh[1], t0, t1, t2, t3)
        return c0 + t0, c1 + t1, c2 + t2, c3 + t3

    @cuda.jit(**JIT)
    def kernel(q, k, v, out, scale_log2):
        Nq, d = q.shape
        Nk = k.shape[0]
        tid = cuda.threadIdx.x
        w = tid >> 5
        r16 = 16 * (w >> 1)              # the pair's first row in the block
        half = w & 1                     # keys half·Bc/2 .. for S; columns half·Bd/2 .. for O
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        i0 = cuda.blockIdx.x * Br
        c0 = cuda.blockIdx.y * Bd
        smem = cuda.shared.array(0, float32, alignment=ALIGN)
        s = cuda.local.array((NSH, 4), float32)
        o = cuda.local.array((NOH, 4), float32)
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        for h in range(2):
            m[h] = NEG_INF
            l[h] = ZERO
        for n in range(NOH):
            for e in range(4):
                o[n, e] = ZERO

        copy_tile(smem, 0, KS, q, i0, Br, 0, DK, Nq, d, tid)
        copy_tile(smem, Br * KS, KS, k, 0, Bc, 0, DK, Nk, d, tid)
        ops.cp_async_commit()
        slot = 0
        kh = half * (Bc // 2)            # this warp's first key of the tile (S)
        ch = half * (Bd // 2)            # this warp's first output column of the block (O)

        for j0 in range(0, Nk, Bc):
            copy_tile(smem, V_OFF, VS, v, j0, Bc, c0, Bd, Nk, d, tid)
            ops.cp_async_commit()
            for n in range(NSH):
                for e in range(4):
                    s[n, e] = ZERO
            for d0 in range(0, d, DK):
                nj, nd = j0, d0 + DK
                if nd >= d:
                    nj, nd = j0 + Bc, 0
                if nj < Nk:
                    nxt = (1 - slot) * SLOT
                    copy_tile(smem, nxt, KS, q, i0, Br, nd, DK, Nq, d, tid)
                    copy_tile(smem, nxt + Br * KS, KS, k, nj, Bc, nd, DK, Nk, d, tid)
                ops.cp_async_commit()
                if d0 == 0:
                    ops.cp_async_wait(2)
                else:
                    ops.cp_async_wait(1)
                cuda.syncthreads()
                qa = slot * SLOT + (r16 + g) * KS + t
                kb = slot * SLOT + Br * KS + (kh + g) * KS + t
                for kk in range(0, DK, 8):
                    ah, al = split4(smem[U(qa + kk)], smem[U(qa + 8 * KS + kk)],
                                    smem[U(qa + kk + 4)], smem[U(qa + 8 * KS + kk + 4)])
                    for n in range(NSH):
                        bh, bl = split2(smem[U(kb + 8 * n * KS + kk)], smem[U(kb + 8 * n * KS + kk + 4)])
                        s[n, 0], s[n, 1], s[n, 2], s[n, 3] = mma3(ah, al, bh, bl,
                                                                  s[n, 0], s[n, 1], s[n, 2], s[n, 3])
                cuda.syncthreads()
                slot = 1 - slot

            # Row max over this warp's half of the keys, then over the pair (shared memory).
            for h in range(2):
                mx = NEG_INF
                for n in range(NSH):
                    for e in range(2):
                        x = NEG_INF
                        if j0 + kh + 8 * n + 2 * t + e < Nk:
                            x = s[n, 2 * h + e] * scale_log2
                        s[n, 2 * h + e] = x
                        mx = max(mx, x)
                mx = max(mx, warp.shfl_xor_sync(FULL, mx, 1))
                mx = max(mx, warp.shfl_xor_sync(FULL, mx, 2))
                if t == 0:
                    smem[R_OFF + 2 * (r16 + g + 8 * h) + half] = mx
            cuda.syncthreads()           # both halves' maxima are written
            for h in range(2):
                row2 = R_OFF + 2 * (r16 + g + 8 * h)
                m_new = max(m[h], max(smem[row2], smem[row2 + 1]))
                alpha = math.exp2(m[h] - m_new)
                rs = ZERO
                for n in range(NSH):
                    for e in range(2):
                        p = math.exp2(s[n, 2 * h + e] - m_new)
                        smem[P_OFF + (r16 + g + 8 * h) * PS + kh + 8 * n + 2 * t + e] = p
                        rs += p
                l[h] = l[h] * alpha + rs         # this lane's part of this half's row sum
                m[h] = m_new
                for n in range(NOH):
                    o[n, 2 * h] *= alpha
                    o[n, 2 * h + 1] *= alpha

            ops.cp_async_wait(1)
            cuda.syncthreads()           # P_ij and V_j complete (and the maxima read) before P V
            pa = P_OFF + (r16 + g) * PS + t                 # A = P: rows g, g+8; keys t, t+4
            vb = V_OFF + t * VS + ch + g                     # B = V: keys t, t+4; column g
            for n in range(Bc // 8):         # keys 8n .. 8n + 7
                ph, pl = split4(smem[U(pa + 8 * n)], smem[U(pa + 8 * PS + 8 * n)],
                                smem[U(pa + 8 * n + 4)], smem[U(pa + 8 * PS + 8 * n + 4)])
                for nn in range(NOH):        # this warp's output columns ch + 8nn ..
                    bh, bl = split2(smem[U(vb + 8 * n * VS + 8 * nn)], smem[U(vb + (8 * n + 4) * VS + 8 * nn)])
                    o[nn, 0], o[nn, 1], o[nn, 2], o[nn, 3] = mma3(ph, pl, bh, bl,
                                                                  o[nn, 0], o[nn, 1], o[nn, 2], o[nn, 3])
            cuda.syncthreads()           # P, V and the maxima are fully read before they are rewritten
        ops.cp_async_wait(0)

        for h in range(2):
            lh = l[h]
            lh += warp.shfl_xor_sync(FULL, lh, 1)
            lh += warp.shfl_xor_sync(FULL, lh, 2)
            if t == 0:
                smem[R_OFF + 2 * (r16 + g + 8 * h) + half] = lh
        cuda.syncthreads()
        for h in range(2):
            row2 = R_OFF + 2 * (r16 + g + 8 * h)
            lh = smem[row2] + smem[row2 + 1]
            row = i0 + r16 + g + 8 * h
            if row < Nq:
                for nn in range(NOH):
                    for e in range(2):
                        col = c0 + ch + 8 * nn + 2 * t + e
                        if col < d:
                            out[row, col] = o[nn, 2 * h + e] / lh

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
    return _host.run(q, k, v, _launch, vector=True)
