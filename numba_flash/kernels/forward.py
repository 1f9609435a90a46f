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
* output columns ``4·(c + CG·g) + f`` (g < DO/(4·CG), f < 4): neighbouring lanes read
  neighbouring 16-byte chunks of a V row.

The CG lanes that share a row are consecutive lanes of one warp, so row max and row
sum are ``log2(CG)`` butterfly shuffles. The row sum ``l`` stays a per-lane partial
sum until the end (every lane of a row applies the same rescale factor), so only the
max is reduced inside the loop.

Loads. With ``ASYNC`` (rows 16-byte aligned, unit inner stride: decided by the API)
tiles move global → shared with ``cp.async``, overlapped with compute:

    d <= DK (one chunk):  wait K(j) · S = Q Kᵀ · softmax · wait V(j) · issue K(j+1)
                          · O += P V · issue V(j+1)
    d >  DK (chunks):     chunk c+1 of Q and K is in flight while chunk c is used.

Otherwise tiles are copied with plain loads, eight in flight per thread.

Head dims larger than ``DK`` are streamed through shared memory in chunks of ``DK``
for S = Q Kᵀ. Head dims larger than ``DO`` are split across ``ceil(D / DO)`` blocks
(grid axis y): each recomputes S and produces ``DO`` output columns. That trades
recomputed Q Kᵀ FLOPs for registers and parallelism; see docs/performance.md.

Score rules (``numba_flash.scores``: causal, sliding window, softcap, ALiBi): key tiles
that no query of the block can see are never visited; the element mask is evaluated
only on tiles that cross a mask edge or the end of K.

Key splits. When a problem has too few query tiles to fill the GPU (one
head of 1024 queries is 32 blocks), the keys are split into ranges of ``split_keys``
(a multiple of ``BN``) and split z of a query tile (a block of its own) attends to range z only. Each split
writes its own normalised ``O_z`` and its row max ``m_z`` (log2 units) and row sum ``l_z``
(``out`` then holds one slab of ``B1`` leading indices per split, ``lse`` two: the m's,
then the l's), and ``make_merge``'s kernel combines them:

    M = max_z m_z     a_z = exp2(m_z − M) · l_z     O = Σ_z a_z O_z / Σ_z a_z
    lse = (M + log2 Σ_z a_z) · ln 2

Merging (m, l) rather than each split's lse keeps float32 accurate for large logits:
``m_z − M`` is a difference of two maxima, exact or nearly, where ``lse_z − lse`` would
carry the rounding of two large numbers. A split that sees no key of a row has
``m_z = −inf``, ``l_z = 0`` (weight 0).
"""
import dataclasses
import functools
import math

import numba
import numpy as np
from numba import cuda

from .. import ops, warp
from . import tiles
from .tiles import PAD
from .._runtime import SIMULATOR
from ..scores import ScoreSpec, block_lists, block_row_rules, block_rules, device_rules, device_sequence

LN2 = 0.6931471805599453


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


def chunks(d, t: Tiling):
    return -(-d // t.DK)


def smem_words(d, t: Tiling):
    """Dynamic shared memory of one block, in elements: Q, K (two slots when chunked), V, P."""
    qk = (t.BM + t.BN) * (t.DK + PAD) * (2 if chunks(d, t) > 1 else 1)
    return qk + t.BN * t.DO + t.BM * (t.BN + PAD)


@functools.lru_cache(maxsize=None)
def make_forward(dtype_name: str, D: int, t: Tiling, scores: ScoreSpec, use_async: bool):
    """Build the forward kernel for one (dtype, head dim, tiling, score rules, async) specialisation.

    Kernel arguments: ``q (B1, B2, Nq, D)``, ``k (B1, B2, Nk, D)``, ``v (B1, B2, Nk, D)``
    (any strides; with ``use_async`` the last stride must be 1 and rows 16-byte
    aligned), ``out (Z·B1, B2, Nq, D)``, ``lse (B1, B2, Nq)`` or with splits
    ``(2·Z·B1, B2, Nq)`` (see the module docstring), ``scale_log2`` (scale ·
    log2 e, in the dtype), ``split_keys`` (keys per split: a multiple of ``BN``,
    counted from the query tile's first visible key tile; at least ``Nk`` when
    ``Z = 1``), then the score arguments of ``numba_flash.scores``: ``left, right``
    (int64 window sides), ``cap_in, cap_out`` (softcap), ``slopes (B1, B2, 1)`` (ALiBi
    slopes, in the dtype; any array of that type when ``scores.alibi`` is off: it is
    not read). Launch with ``grid = (ceil(Nq / BM) · B1 · B2 · Z, ceil(D / DO))``,
    ``block = RG · CG`` and ``smem_words(D, t) · itemsize`` bytes of dynamic shared memory.

    With ``scores.packed`` three last arguments ``seqs (S, 4)`` int32, ``pages`` (int32
    matrix) and ``page_size`` (int64) give each sequence's rows
    (``numba_flash.scores.ScoreSpec``; ``pages`` and ``page_size`` are read with
    ``scores.paged`` only: a paged KV cache's page table): launch with ``grid = (ceil(max q_len / BM) ·
    B1 · B2 · Z, ceil(D / DO), S)``, ``split_keys`` covering the longest sequence; ``out``
    and ``lse`` may then have any strides when ``Z = 1``.
    """
    np_dt = np.dtype(dtype_name)
    TM, TN, CG, DK, DO = t.TM, t.TN, t.CG, t.DK, t.DO
    BM, BN, NT = t.BM, t.BN, t.threads
    assert CG & (CG - 1) == 0 and CG <= 32 and NT % 32 == 0
    assert DK % 8 == 0 and DO % (4 * CG) == 0
    NKC = chunks(D, t)                 # head-dim chunks for S = Q Kᵀ
    VO4 = DO // (4 * CG)               # 4-wide output column groups per thread
    VO = 4 * VO4                       # output columns per thread
    QS = DK + PAD                      # row stride of the Q and K tiles
    PS = BN + PAD                      # row stride of the P tile
    SLOT = (BM + BN) * QS              # one Q+K chunk slot
    Q_OFF, K_OFF = 0, BM * QS          # within a slot
    V_OFF = SLOT * (2 if NKC > 1 else 1)
    P_OFF = V_OFF + BN * DO
    END = P_OFF + BM * PS
    assert END == smem_words(D, t)
    SHUFFLE_OFFSETS = tuple(CG >> (s + 1) for s in range(int(math.log2(CG))))
    E16 = 16 // np_dt.itemsize         # elements per 16-byte cp.async
    if use_async:
        assert D % E16 == 0
    DT = np_dt.type
    ZERO, ONE, NEG_INF, LN2_T = DT(0), DT(1), DT(-np.inf), DT(LN2)
    nb_dt = numba.from_dtype(np_dt)
    ALIGN = None if SIMULATOR else 16   # the simulator accepts only alignment=None
    JIT = {} if SIMULATOR else {"launch_bounds": (NT, 1)}

    copy_tile, mm_abt, mm_pv = tiles.make_tile_ops(dtype_name, D, TM, TN, CG, NT, DK, DO, use_async)
    copy_paged = tiles.make_copy(dtype_name, D, NT, use_async, paged=True)
    PAGED = scores.paged

    def copy_kv(smem, off, stride, src, b1, b2, row0, nrows, col0, ncols, n_lim, tid, pages, page_size):
        """``copy_tile`` of K or V rows: through the page table of a paged cache."""
        if PAGED:
            copy_paged(smem, off, stride, src, b1, b2, row0, nrows, col0, ncols, n_lim, tid, pages,
                       cuda.blockIdx.z, page_size)
        else:
            copy_tile(smem, off, stride, src, b1, b2, row0, nrows, col0, ncols, n_lim, tid)

    if not SIMULATOR:
        copy_kv = cuda.jit(device=True, inline="always")(copy_kv)
    row_keys, in_row, key_range, _, tile_needs_mask, score, score_consts = device_rules(scores, dtype_name,
                                                                                        block_rows=True)
    block_keys, _ = block_rules(scores)
    key_tile_count, key_tile_at, key_tile_consts = block_lists(scores)
    block_rows, block_tile = block_row_rules(scores)
    sequence = device_sequence(scores)

    def softmax_update(smem, s, o, m, l, sc, r, c, q0, k0, geo, slopes, b1, b2):
        """Online softmax on one S tile: rescale O and l, write P = exp2(S - m) to shared memory."""
        # Scores in log2 units, then masked: a loop of its own, so that each loop nest
        # stays small enough for the compiler to unroll completely (registers, not stack).
        for i in range(TM):
            for j in range(TN):
                s[i, j], _ = score(s[i, j], q0 + r * TM + i, k0 + c + CG * j, geo[1], sc)
        if tile_needs_mask(q0, BM, k0, BN, geo) or block_tile(slopes, b1, b2, q0 // BM, k0, BN):
            for i in range(TM):
                lo, hi = row_keys(q0 + r * TM + i, geo)
                lo, hi = block_rows(slopes, b1, b2, q0 + r * TM + i, lo, hi)    # (an exact block mask's run)
                for j in range(TN):
                    if not in_row(k0 + c + CG * j, lo, hi):
                        s[i, j] = NEG_INF
        for i in range(TM):
            mx = NEG_INF
            for j in range(TN):
                mx = max(mx, s[i, j])
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

    if not SIMULATOR:
        softmax_update = cuda.jit(device=True, inline="always")(softmax_update)

    def forward_body(q, k, v, out, lse, scale_log2, split_keys, left, right, cap_in, cap_out, slopes, seqs,
                     pages, page_size):
        q_start, Nq, k_start, Nk = sequence(seqs, cuda.blockIdx.z, q.shape[2], k.shape[2])
        tid = cuda.threadIdx.x
        r = tid // CG
        c = tid - r * CG
        n_qt = (Nq + BM - 1) // BM
        B2 = q.shape[1]
        B = q.shape[0] * B2
        # Block x = (query tile, leading index, key split), the split varying fastest and
        # the heaviest (causal: last) query tiles first, so that blocks start heaviest first.
        Z = out.shape[0] // q.shape[0]
        zb = cuda.blockIdx.x // Z
        z = cuda.blockIdx.x - zb * Z   # key split: keys [k_lo, k_lo + split_keys)
        qt = n_qt - 1 - zb // B
        if qt < 0:                     # packed sequences: the grid covers the longest one
            return
        q_end = q_start + Nq           # rows past these are zero-filled on load
        k_end = k_start + Nk
        b = zb - (zb // B) * B
        b1 = b // B2
        b2 = b - b1 * B2
        q0 = qt * BM
        d0 = cuda.blockIdx.y * DO
        diag = Nk - Nq                 # bottom-right alignment (numba_flash.scores)
        geo = (Nk, diag, left, right)
        sc = score_consts(scale_log2, cap_in, cap_out, slopes, b1, b2)
        ob1 = z * q.shape[0] + b1      # this split's slab of out and lse

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

        # Keys outside [kv_begin, kv_end) are invisible to the whole tile; split z takes
        # split_keys of them, counted from the first visible key tile.
        kv_begin, kv_end = key_range(q0, BM, geo)
        kv_begin, kv_end = block_keys(slopes, b1, b2, qt, kv_begin, kv_end)
        # The key tiles: kt0, kt0 + 1, ... or, for a block mask with holes, its list's.
        kt0 = kv_begin // BN
        n_all = (Nk + BN - 1) // BN
        n_j = key_tile_count(slopes, b1, b2, qt, n_all, max((max(kv_end, 0) + BN - 1) // BN - kt0, 0))
        j0 = z * (split_keys // BN)
        n_j = min(n_j, j0 + split_keys // BN)
        k_lo = key_tile_at(slopes, b1, b2, qt, n_all, kt0, j0) * BN

        if NKC == 1:
            # Prologue: Q (once) and K(kt0) in one group, V(kt0) in the next.
            copy_tile(smem, Q_OFF, QS, q, b1, b2, q_start + q0, BM, 0, DK, q_end, tid)
            if n_j > j0:
                copy_kv(smem, K_OFF, QS, k, b1, b2, k_start + k_lo, BN, 0, DK, k_end, tid, pages, page_size)
            ops.cp_async_commit()
            if n_j > j0:
                copy_kv(smem, V_OFF, DO, v, b1, b2, k_start + k_lo, BN, d0, DO, k_end, tid, pages, page_size)
            ops.cp_async_commit()

        for jj in range(j0, n_j):
            k0 = key_tile_at(slopes, b1, b2, qt, n_all, kt0, jj) * BN
            kn = key_tile_at(slopes, b1, b2, qt, n_all, kt0, jj + 1) * BN if jj + 1 < n_j else k0
            for i in range(TM):
                for j in range(TN):
                    s[i, j] = ZERO
            if NKC == 1:
                ops.cp_async_wait(1)       # Q and K(jj) have landed (V(jj) may still be in flight)
                cuda.syncthreads()         # ... for every thread's copies, not just this one's
                mm_abt(smem, Q_OFF, K_OFF, QS, s, qv, kv, r, c)
            else:
                # V(jj) joins chunk 0's group; chunk c+1 is in flight while chunk c is used.
                copy_kv(smem, V_OFF, DO, v, b1, b2, k_start + k0, BN, d0, DO, k_end, tid, pages, page_size)
                copy_tile(smem, Q_OFF, QS, q, b1, b2, q_start + q0, BM, 0, DK, q_end, tid)
                copy_kv(smem, K_OFF, QS, k, b1, b2, k_start + k0, BN, 0, DK, k_end, tid, pages, page_size)
                ops.cp_async_commit()
                for kc in range(NKC):
                    slot = (kc & 1) * SLOT
                    if kc + 1 < NKC:
                        nxt = SLOT - slot  # the other slot: last read in chunk kc-1, before its barrier
                        copy_tile(smem, nxt + Q_OFF, QS, q, b1, b2, q_start + q0, BM, (kc + 1) * DK, DK, q_end, tid)
                        copy_kv(smem, nxt + K_OFF, QS, k, b1, b2, k_start + k0, BN, (kc + 1) * DK, DK, k_end, tid,
                                pages, page_size)
                        ops.cp_async_commit()
                        ops.cp_async_wait(1)   # chunk kc (and V) landed; chunk kc+1 in flight
                    else:
                        ops.cp_async_wait(0)
                    cuda.syncthreads()         # chunk kc visible to all threads
                    mm_abt(smem, slot + Q_OFF, slot + K_OFF, QS, s, qv, kv, r, c)
                    cuda.syncthreads()         # chunk kc fully read before its slot is refilled

            softmax_update(smem, s, o, m, l, key_tile_consts(slopes, b1, b2, qt, n_all, jj, sc), r, c, q0, k0, geo,
                           slopes, b1, b2)
            if NKC == 1:
                ops.cp_async_wait(0)       # V(jj) has landed
            cuda.syncthreads()             # P and V complete; every thread is done reading K(jj)
            if NKC == 1 and jj + 1 < n_j:
                # K(jj + 1), overlapping P V
                copy_kv(smem, K_OFF, QS, k, b1, b2, k_start + kn, BN, 0, DK, k_end, tid, pages, page_size)
                ops.cp_async_commit()
            mm_pv(smem, P_OFF, PS, V_OFF, DO, o, pv, vv, r, c)
            cuda.syncthreads()             # V and P fully read before they are overwritten
            if NKC == 1 and jj + 1 < n_j:
                # V(jj + 1), overlapping the next S
                copy_kv(smem, V_OFF, DO, v, b1, b2, k_start + kn, BN, d0, DO, k_end, tid, pages, page_size)
                ops.cp_async_commit()

        ops.cp_async_wait(0)               # nothing left in flight when the loop had no iteration

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
                            out[ob1, b2, q_start + row, col] = o[i, 4 * g + f] * inv
                if c == 0 and cuda.blockIdx.y == 0:
                    if Z > 1:                  # a split's row max and sum, for the merge
                        lse[ob1, b2, q_start + row] = m[i]
                        lse[ob1 + Z * q.shape[0], b2, q_start + row] = li
                    elif li == ZERO:
                        lse[ob1, b2, q_start + row] = NEG_INF
                    else:
                        lse[ob1, b2, q_start + row] = (m[i] + math.log2(li)) * LN2_T

    if not SIMULATOR:
        forward_body = cuda.jit(device=True, inline="always")(forward_body)
    if scores.packed:
        @cuda.jit(**JIT)
        def forward(q, k, v, out, lse, scale_log2, split_keys, left, right, cap_in, cap_out, slopes, seqs, pages,
                    page_size):
            forward_body(q, k, v, out, lse, scale_log2, split_keys, left, right, cap_in, cap_out, slopes, seqs,
                         pages, page_size)
    else:
        @cuda.jit(**JIT)
        def forward(q, k, v, out, lse, scale_log2, split_keys, left, right, cap_in, cap_out, slopes):
            forward_body(q, k, v, out, lse, scale_log2, split_keys, left, right, cap_in, cap_out, slopes, slopes,
                         slopes, 0)

    forward.tiling = t
    forward.smem_bytes = END * np_dt.itemsize
    return forward


MERGE_THREADS = 32 if SIMULATOR else 128
# At most this many key splits: a single decoding sequence (a handful of query tiles, one
# per key/value head) takes 32 on an H200 (docs/performance.md item 80), more with fewer heads.
MAX_SPLITS = 128


@functools.lru_cache(maxsize=None)
def make_merge(dtype_name: str, packed: bool = False):
    """Combine the key splits' partial results: ``parts (Z·B1, B2, Nq, D)`` and
    ``parts_ml (2·Z·B1, B2, Nq)`` (C-contiguous, as the forward writes them with ``Z``
    splits: row maxima, then row sums) into ``out (B1, B2, Nq, D)`` and
    ``lse (B1, B2, Nq)``. One block per query row: ``grid = B1 · B2 · Nq``,
    ``block = MERGE_THREADS`` and ``merge.smem_bytes`` of dynamic shared memory (per split, at
    most ``MAX_SPLITS``: its row max and row sum, then its weight). For float16 and bfloat16 (the tensor-core forward's
    splits) ``parts``, ``parts_ml`` and ``lse`` are float32 and ``out`` holds the uint16
    bits of the dtype. With ``packed`` a fifth argument, the forward's sequence table
    ``seqs (S, 4)``, says which rows exist (packed views may overlap between leading
    indices): launch with ``grid = (B1 · B2 · max q_len, 1, S)``."""
    from .merge import _convert
    store = _convert(dtype_name)[1]
    np_dt = np.dtype(np.float32 if dtype_name in ("float16", "bfloat16") else dtype_name)
    nb_dt = numba.from_dtype(np_dt)
    ZERO, NEG_INF, LN2_T = np_dt.type(0), np_dt.type(-np.inf), np_dt.type(LN2)
    NT = MERGE_THREADS
    ALIGN = None if SIMULATOR else 16

    def merge_body(parts, parts_ml, out, lse, seqs):
        B1, B2, Nq, D = out.shape
        Z = parts.shape[0] // B1
        tid = cuda.threadIdx.x
        row = cuda.blockIdx.x
        if packed:                # rows q_start .. q_start + q_len − 1 of sequence z
            n_rows = cuda.gridDim.x // (B1 * B2)
            b = row // n_rows
            row -= b * n_rows
            if row >= seqs[cuda.blockIdx.z, 1]:
                return
            row += seqs[cuda.blockIdx.z, 0]
        else:
            b = row // Nq
            row -= b * Nq
        b1 = b // B2
        b2 = b - b1 * B2
        # Each split's row max and row sum, read by one thread a split (all at once, not
        # one dependent load after another), then its weight a_z / Σ a_z in their place.
        w = cuda.shared.array(0, nb_dt, alignment=ALIGN)
        for zz in range(tid, Z, NT):
            w[zz] = parts_ml[zz * B1 + b1, b2, row]
            w[MAX_SPLITS + zz] = parts_ml[(Z + zz) * B1 + b1, b2, row]
        cuda.syncthreads()
        mx = NEG_INF
        for zz in range(Z):
            mx = max(mx, w[zz])
        total = ZERO                               # Σ_z a_z; 0: no split saw a key
        if mx != NEG_INF:
            for zz in range(Z):
                total += math.exp2(w[zz] - mx) * w[MAX_SPLITS + zz]
        cuda.syncthreads()                         # every thread has the maxima
        for zz in range(tid, Z, NT):
            a = ZERO
            if total != ZERO:
                a = math.exp2(w[zz] - mx) * w[MAX_SPLITS + zz] / total
            w[zz] = a
        if tid == 0:
            lse[b1, b2, row] = NEG_INF if total == ZERO else (mx + math.log2(total)) * LN2_T
        cuda.syncthreads()
        for col in range(tid, D, NT):
            acc = ZERO
            zz = 0
            while zz + 4 <= Z:                     # four splits' loads in flight at a time
                acc += ((w[zz] * parts[zz * B1 + b1, b2, row, col]
                         + w[zz + 1] * parts[(zz + 1) * B1 + b1, b2, row, col])
                        + (w[zz + 2] * parts[(zz + 2) * B1 + b1, b2, row, col]
                           + w[zz + 3] * parts[(zz + 3) * B1 + b1, b2, row, col]))
                zz += 4
            while zz < Z:
                acc += w[zz] * parts[zz * B1 + b1, b2, row, col]
                zz += 1
            out[b1, b2, row, col] = store(acc)

    if not SIMULATOR:
        merge_body = cuda.jit(device=True, inline="always")(merge_body)
    if packed:
        @cuda.jit
        def merge(parts, parts_ml, out, lse, seqs):
            merge_body(parts, parts_ml, out, lse, seqs)
    else:
        @cuda.jit
        def merge(parts, parts_ml, out, lse):
            merge_body(parts, parts_ml, out, lse, parts_ml)

    merge.threads = NT
    merge.smem_bytes = 2 * MAX_SPLITS * np_dt.itemsize
    return merge
