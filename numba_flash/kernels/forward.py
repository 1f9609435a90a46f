"""Fused FlashAttention-2 forward on CUDA cores (float32 and float64).

One thread block computes a tile of ``BM`` query rows (and, for large head dims, one
slice of ``DO`` output columns) for one leading index. The block keeps its Q tile in
shared memory and streams K/V tiles of ``BN`` keys through shared memory:

    for each K/V tile j:                                  (paper notation, log2 units)
        S    = Q Kjᵀ · scale · log2(e)                    BM × BN, in registers
        m'   = max(m, rowmax(S))                          running row max
        P    = exp2(S − m')                               unnormalised probabilities
        l    = l · exp2(m − m') + rowsum(P)               running row sum
        O    = O · exp2(m − m') + P Vj                    BM × DO, in registers
    O   /= l                                              one divide, after the loop
    lse  = (m + log2 l) · ln 2                            natural-log LSE per row

Thread layout: ``NT = RG × CG`` threads; thread (r, c) with ``r = tid // CG`` and
``c = tid % CG`` owns query rows ``r·TM + i`` (i < TM) and

* score columns ``c + CG·j`` (j < TN): neighbouring lanes read neighbouring K rows,
  whose shared-memory stride ``DK + 4`` words makes the 128-bit loads conflict-free;
* output columns ``4·(c + CG·m) + e`` (m < DO/(4·CG), e < 4): neighbouring lanes read
  neighbouring 16-byte chunks of a V row.

The CG lanes that share a row are consecutive lanes of one warp, so row max and row
sum are ``log2(CG)`` butterfly shuffles. The row sum ``l`` stays a per-lane partial
sum until the end (every lane of a row applies the same rescale factor), so only the
max is reduced inside the loop.

Head dims larger than ``DK`` are streamed through shared memory in chunks of ``DK``
for S = Q Kᵀ. Head dims larger than ``DO`` are split across ``ceil(D / DO)`` blocks
(grid axis y): each recomputes S and produces ``DO`` output columns. That trades
recomputed Q Kᵀ FLOPs for registers and parallelism; see docs/performance.md.

Causal (bottom-right aligned, see ``numba_flash.attention``): query row ``i`` sees key
``j`` iff ``j <= i + Nk − Nq``. Tiles wholly above the diagonal are never visited; the
element mask is evaluated only on tiles that cross the diagonal or the end of K.
"""
import dataclasses
import functools
import math

import numba
import numpy as np
from numba import cuda

from .. import ops, warp
from .._runtime import SIMULATOR

LOG2E = 1.4426950408889634  # 1 / ln 2: exp(x) = exp2(x · log2 e)
LN2 = 0.6931471805599453
PAD = 4  # words of padding per shared-memory row: keeps rows 16-byte aligned and shifts banks


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Compile-time shape of one forward kernel specialisation."""
    TM: int  # query rows per thread
    TN: int  # score columns (keys) per thread
    CG: int  # lanes sharing a row (a power of two, <= 32)
    RG: int  # row groups: threads per block = RG * CG
    DK: int  # head-dim chunk for S = Q Kᵀ (multiple of 8)
    DO: int  # output columns per block (multiple of 4 * CG)

    @property
    def BM(self):
        return self.RG * self.TM

    @property
    def BN(self):
        return self.CG * self.TN

    @property
    def threads(self):
        return self.RG * self.CG


def smem_words(t: Tiling):
    """Dynamic shared memory of one block, in elements: Q, K, V and P tiles."""
    qs = t.DK + PAD
    return t.BM * qs + t.BN * qs + t.BN * t.DO + t.BM * (t.BN + PAD)


@functools.lru_cache(maxsize=None)
def make_forward(dtype_name: str, D: int, t: Tiling, causal: bool):
    """Build the forward kernel for one (dtype, head dim, tiling, causal) specialisation.

    Kernel arguments: ``q (B1, B2, Nq, D)``, ``k (B1, B2, Nk, D)``, ``v (B1, B2, Nk, D)``
    (any strides), ``out (B1, B2, Nq, D)``, ``lse (B1, B2, Nq)``, ``scale_log2`` (scale ·
    log2 e, in the dtype). Launch with ``grid = (ceil(Nq / BM) · B1 · B2, ceil(D / DO))``, ``block = RG · CG`` and
    ``smem_words(t) · itemsize`` bytes of dynamic shared memory.
    """
    np_dt = np.dtype(dtype_name)
    TM, TN, CG, RG, DK, DO = t.TM, t.TN, t.CG, t.RG, t.DK, t.DO
    BM, BN, NT = t.BM, t.BN, t.threads
    assert CG & (CG - 1) == 0 and CG <= 32 and NT % 32 == 0
    assert DK % 8 == 0 and DO % (4 * CG) == 0
    NKC = -(-D // DK)                  # head-dim chunks for S = Q Kᵀ
    VO4 = DO // (4 * CG)               # 4-wide output column groups per thread
    VO = 4 * VO4                       # output columns per thread
    QS = DK + PAD                      # row stride of the Q and K tiles
    PS = BN + PAD                      # row stride of the P tile
    Q_OFF, K_OFF = 0, BM * QS
    V_OFF = K_OFF + BN * QS
    P_OFF = V_OFF + BN * DO
    END = P_OFF + BM * PS
    SHUFFLE_OFFSETS = tuple(CG >> (s + 1) for s in range(int(math.log2(CG))))
    # 128-bit shared loads for float32; plain loads for float64 (and in the simulator).
    LD4 = ops.ld_shared_x4 if np_dt == np.float32 else ops.ld_x4
    DT = np_dt.type
    ZERO, ONE, NEG_INF, LN2_T = DT(0), DT(1), DT(-np.inf), DT(LN2)
    nb_dt = numba.from_dtype(np_dt)
    ALIGN = None if SIMULATOR else 16   # the simulator accepts only alignment=None
    JIT = {} if SIMULATOR else {"launch_bounds": (NT, 1)}

    @cuda.jit(device=True, inline="always")
    def load_tile(dst, dst_off, dst_stride, src, b1, b2, row0, nrows, col0, ncols, n_lim, d_lim, tid):
        """dst[r, c] = src[b1, b2, row0 + r, col0 + c], zero outside (n_lim, d_lim); coalesced along c."""
        for idx in range(tid, nrows * ncols, NT):
            r = idx // ncols
            c = idx - r * ncols
            gr = row0 + r
            gc = col0 + c
            x = ZERO
            if gr < n_lim and gc < d_lim:
                x = src[b1, b2, gr, gc]
            dst[dst_off + r * dst_stride + c] = x

    @cuda.jit(**JIT)
    def forward(q, k, v, out, lse, scale_log2):
        Nq = q.shape[2]
        Nk = k.shape[2]
        tid = cuda.threadIdx.x
        r = tid // CG
        c = tid - r * CG
        n_qt = (Nq + BM - 1) // BM
        B2 = q.shape[1]
        B = q.shape[0] * B2
        # Heaviest (causal: last) query tiles are scheduled first.
        qt = n_qt - 1 - cuda.blockIdx.x // B
        b = cuda.blockIdx.x - (cuda.blockIdx.x // B) * B
        b1 = b // B2
        b2 = b - b1 * B2
        q0 = qt * BM
        d0 = cuda.blockIdx.y * DO
        diag = Nk - Nq                 # key j visible to query i iff j <= i + diag

        smem = cuda.shared.array(0, nb_dt, alignment=ALIGN)
        s = cuda.local.array((TM, TN), nb_dt)
        o = cuda.local.array((TM, VO), nb_dt)
        m = cuda.local.array(TM, nb_dt)
        l = cuda.local.array(TM, nb_dt)
        qv = cuda.local.array((TM, 4), nb_dt)
        kv = cuda.local.array((TN, 4), nb_dt)
        pv = cuda.local.array((TM, 4), nb_dt)
        vv = cuda.local.array(4, nb_dt)
        for i in range(TM):
            m[i] = NEG_INF
            l[i] = ZERO
            for jo in range(VO):
                o[i, jo] = ZERO

        kv_end = Nk
        if causal:
            kv_end = min(Nk, q0 + BM + diag)   # keys past this are invisible to the whole tile
        n_kt = (max(kv_end, 0) + BN - 1) // BN

        if NKC == 1:
            load_tile(smem, Q_OFF, QS, q, b1, b2, q0, BM, 0, DK, Nq, D, tid)

        for kt in range(n_kt):
            k0 = kt * BN
            # ---- S = Q Kᵀ over head-dim chunks -------------------------------------
            for i in range(TM):
                for j in range(TN):
                    s[i, j] = ZERO
            for kc in range(NKC):
                if NKC > 1:
                    load_tile(smem, Q_OFF, QS, q, b1, b2, q0, BM, kc * DK, DK, Nq, D, tid)
                load_tile(smem, K_OFF, QS, k, b1, b2, k0, BN, kc * DK, DK, Nk, D, tid)
                if kc == 0:
                    load_tile(smem, V_OFF, DO, v, b1, b2, k0, BN, d0, DO, Nk, D, tid)
                cuda.syncthreads()  # Q/K/V tiles written before any thread reads them
                for kk in range(0, DK, 4):
                    for i in range(TM):
                        qv[i, 0], qv[i, 1], qv[i, 2], qv[i, 3] = LD4(smem, Q_OFF + (r * TM + i) * QS + kk)
                    for j in range(TN):
                        kv[j, 0], kv[j, 1], kv[j, 2], kv[j, 3] = LD4(smem, K_OFF + (c + CG * j) * QS + kk)
                    for i in range(TM):
                        for j in range(TN):
                            acc = s[i, j]
                            for e in range(4):
                                acc += qv[i, e] * kv[j, e]
                            s[i, j] = acc
                if NKC > 1:
                    cuda.syncthreads()  # all reads of this Q/K chunk done before the next overwrites it

            # ---- online softmax (log2 units) --------------------------------------
            needs_mask = k0 + BN > Nk
            if causal:
                needs_mask = needs_mask or k0 + BN - 1 > q0 + diag
            for i in range(TM):
                row = q0 + r * TM + i
                mx = NEG_INF
                for j in range(TN):
                    x = s[i, j] * scale_log2
                    if needs_mask:
                        key = k0 + c + CG * j
                        if key >= Nk or (causal and key > row + diag):
                            x = NEG_INF
                    s[i, j] = x
                    mx = max(mx, x)
                for off in SHUFFLE_OFFSETS:
                    mx = max(mx, warp.shfl_xor_sync(warp.FULL_MASK, mx, off))
                m_new = max(m[i], mx)
                # A row that has seen no visible key yet keeps m = -inf; exponentiate
                # against 0 instead so that exp2(-inf - -inf) never makes a NaN.
                m_use = ZERO if m_new == NEG_INF else m_new
                alpha = math.exp2(m[i] - m_use)
                m[i] = m_new
                rs = ZERO
                for j in range(TN):
                    p = math.exp2(s[i, j] - m_use)
                    rs += p
                    smem[P_OFF + (r * TM + i) * PS + c + CG * j] = p
                l[i] = l[i] * alpha + rs
                for jo in range(VO):
                    o[i, jo] *= alpha
            cuda.syncthreads()  # P tile complete before P·V reads other lanes' entries

            # ---- O += P V ----------------------------------------------------------
            for jj in range(0, BN, 4):
                for i in range(TM):
                    pv[i, 0], pv[i, 1], pv[i, 2], pv[i, 3] = LD4(smem, P_OFF + (r * TM + i) * PS + jj)
                for e in range(4):
                    for g in range(VO4):
                        vv[0], vv[1], vv[2], vv[3] = LD4(smem, V_OFF + (jj + e) * DO + 4 * (c + CG * g))
                        for i in range(TM):
                            p = pv[i, e]
                            for f in range(4):
                                o[i, 4 * g + f] += p * vv[f]
            cuda.syncthreads()  # K, V and P tiles fully read before the next tile overwrites them

        # ---- epilogue: O /= l, lse = (m + log2 l) ln 2 ---------------------------------
        for i in range(TM):
            li = l[i]
            for off in SHUFFLE_OFFSETS:
                li += warp.shfl_xor_sync(warp.FULL_MASK, li, off)
            row = q0 + r * TM + i
            inv = ZERO if li == ZERO else ONE / li   # no visible key: output 0, lse -inf
            if row < Nq:
                for g in range(VO4):
                    for f in range(4):
                        col = d0 + 4 * (c + CG * g) + f
                        if col < D:
                            out[b1, b2, row, col] = o[i, 4 * g + f] * inv
                if c == 0 and cuda.blockIdx.y == 0:
                    if li == ZERO:
                        lse[b1, b2, row] = NEG_INF
                    else:
                        lse[b1, b2, row] = (m[i] + math.log2(li)) * LN2_T

    forward.tiling = t
    forward.smem_bytes = END * np_dt.itemsize
    return forward
