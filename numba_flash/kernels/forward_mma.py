"""Fused FlashAttention-2 forward on tensor cores (float16 and bfloat16).

One thread block of ``WARPS`` warps computes ``BM = 16 · MT · WARPS`` query rows for one
leading index; warp ``w`` owns ``MT`` blocks of 16 rows (16 is the M extent of one
``mma.m16n8k16``), so each K or V fragment it reads from shared memory feeds ``MT``
``mma``. K/V tiles of ``BN`` keys stream through a two-slot ring in shared memory: tile
``j + 1`` is in flight (``cp.async``) while tile ``j`` is used.

    for each K/V tile j:                                      (log2 units)
        S    = Q Kjᵀ · scale · log2 e          mma, fp32 accumulators (16 × BN per warp)
        m'   = max(m, rowmax S);  P = exp2(S − m');  l = l · exp2(m − m') + rowsum P
        O    = O · exp2(m − m') + P Vj        P rounded to the input dtype, fp32 accumulators
    O /= l;  lse = (m + log2 l) · ln 2

Fragments (see ``numba_flash.ops``): Q is read once from shared memory with
``ldmatrix`` into A fragments; K tiles give the B fragments of S = Q Kᵀ by plain
``ldmatrix`` (a K row is a column of Kᵀ), V tiles give those of P V by
``ldmatrix.trans``. The S accumulators of two neighbouring 8-key blocks, packed in
pairs, are exactly the A fragment of P for 16 keys, so P never leaves registers.
A lane holds rows ``g`` and ``g + 8`` of each of its warp's 16-row blocks, columns
``2t, 2t + 1`` of each 8-column block: row max and row sum need two butterfly shuffles
(over the ``t`` lanes).

Shared rows are ``DP + 8`` elements (``DP`` = d rounded up to 16; columns past d are
zero-filled; see ``mma_parts``, whose loads and fragment reads the backward shares).

Score rules and tile skipping follow the CUDA-core forward (bottom-right aligned);
rows and keys past the ends are zero-filled on load and masked to ``-inf``.
"""
import dataclasses
import functools
import math

import numba
from numba import cuda

from .. import ops, warp
from .._runtime import SIMULATOR
from ..scores import (SOFTCAP_TANH, ScoreSpec, block_lists, block_row_rules, block_rules, device_rules,
                      device_sequence)
from .forward import LN2
from .mma_parts import ROW_PAD, device, make_copy_rows, make_fragments, make_mma_pair, operand_kinds, padded_dim



@dataclasses.dataclass(frozen=True)
class MmaTiling:
    """Compile-time shape of one tensor-core forward specialisation."""
    WARPS: int        # warps per block
    BN: int           # keys per K/V tile (multiple of 16)
    Q_IN_REGS: bool   # keep Q's A fragments in registers (else re-read them per tile)
    MT: int = 1       # 16-row blocks per warp: each K/V fragment read from shared memory feeds MT mma
    # key splits (``split`` kernels, one warp each) run as the warps of one block and merged
    # in its shared memory, a region of its own per warp (``make_forward_mma``): at most this
    # many (the kernel's launch bound; a launch's count is its threads / 32, its shared
    # memory that many one-warp blocks' worth); 1: none
    KEY_WARPS: int = 1

    @property
    def BM(self):
        return 16 * self.MT * self.WARPS

    @property
    def threads(self):
        return 32 * self.WARPS * self.KEY_WARPS

    # the launch helpers size the grid with these (as for the CUDA-core ``Tiling``)
    @property
    def DO(self):
        return 1 << 30    # the whole head dim in one block


def smem_elements(d, t: MmaTiling):
    """Q tile plus two K and two V slots, rows of ``DP + ROW_PAD`` 16-bit elements (one such
    region per key warp, as many as ``t.KEY_WARPS``)."""
    return (t.BM + 4 * t.BN) * (padded_dim(d) + ROW_PAD) * t.KEY_WARPS


@functools.lru_cache(maxsize=None)
def make_forward_mma(dtype_name: str, D: int, t: MmaTiling, scores: ScoreSpec, split: bool = False):
    """Build the tensor-core forward kernel for one (dtype, head dim, tiling, score rules).

    Kernel arguments: ``q (B1, B2, Nq, D)``, ``k, v (B1, B2, Nk, D)`` as ``uint16`` views
    of the float16/bfloat16 data (unit inner stride, 16-byte aligned rows; ``D`` a
    multiple of 8), ``out (B1, B2, Nq, D)`` (``uint16`` view), ``lse (B1, B2, Nq)``
    float32, ``scale_log2`` float32, then the score arguments (``left, right`` int64,
    ``cap_in, cap_out`` float32, ``slopes (B1, B2, 1)`` float32: see
    ``numba_flash.kernels.forward.make_forward``). Launch with ``grid = (ceil(Nq / BM) · B1 · B2, 1)``,
    ``block = 32 · WARPS``, ``smem_elements(D, t) · 2`` bytes of dynamic shared memory.

    With ``scores.packed`` three last arguments give each sequence's rows
    (``numba_flash.scores.ScoreSpec``): ``seqs (S, 4)`` int32, and for a paged KV cache
    (``scores.paged``) its page table ``pages (S, max pages)`` int32 and ``page_size``
    (int64; otherwise any int32 matrix and 0, not read): launch with ``grid = (ceil(max q_len / BM) ·
    B1 · B2, 1, S)``; ``out`` and ``lse`` may then have any strides.

    With ``split`` (key splits, for grids that would leave SMs idle: decoding) the kernel
    computes partial results as the CUDA-core forward's splits do, for
    ``numba_flash.kernels.forward.make_merge``: ``out`` becomes ``parts (Z·B1, B2, Nq, D)``
    float32 (each split's normalised output), ``lse`` ``parts_ml (2·Z·B1, B2, Nq)``
    (row maxima in log2 units, then row sums), then come ``out`` and ``lse`` as above
    (the final results), and ``split_keys`` (int64, keys per split, a multiple of ``BN``
    counted from the query tile's first visible key tile) follows ``scale_log2``; launch
    with ``Z`` times the blocks on grid axis x. With one split (``Z = 1``: ``parts`` of
    ``B1`` on its first axis, any size on the others) the kernel writes the final ``out``
    and ``lse`` itself, as the kernel without ``split`` does, and writes neither ``parts``
    nor ``parts_ml``: no merge to launch. With ``t.KEY_WARPS > 1`` the ``Z`` splits of a
    query tile (2 <= ``Z`` <= ``t.KEY_WARPS``) are the warps of one block (launch with the
    blocks of one split, ``32 Z`` threads and ``Z`` one-warp blocks' shared memory): warp
    ``w`` computes split ``w`` as a one-warp block would, in a shared-memory region of its
    own, then the warps leave their partial rows (O, row maxima and sums, unnormalised) in
    their regions and, after one block barrier, merge them as the merge kernel does, each
    warp a share of the columns, and write the final ``out`` and ``lse``; ``parts`` and
    ``parts_ml`` are then not read (no merge to launch).
    """
    assert D % 8 == 0
    mma, pack = operand_kinds(dtype_name)
    BN, BM, NT, MT = t.BN, t.BM, t.threads, t.MT
    WR = 16 * MT                       # query rows per warp
    H = 2 * MT                         # query rows per lane
    assert BN % 16 == 0
    DP = padded_dim(D)
    RS = DP + ROW_PAD                  # shared row stride, elements
    KC = DP // 16                      # k16 steps of S = Q Kᵀ
    NB = BN // 8                       # 8-key blocks of S
    ND = DP // 8                       # 8-column blocks of O
    K_OFF = BM * RS                    # Q tile first, then the two K slots, then the two V slots
    V_OFF = K_OFF + 2 * BN * RS
    SLOT = BN * RS
    Q_IN_REGS = t.Q_IN_REGS
    SPLIT = split
    KW = t.KEY_WARPS                   # the most key splits merged in a block (one warp each)
    assert KW == 1 or (split and t.WARPS == 1), (KW, split, t.WARPS)
    REGION = V_OFF + 2 * SLOT          # a warp's shared memory (all of it where KW = 1), 16-bit elements
    assert KW * REGION == smem_elements(D, t)
    NE = MT * ND * 4                   # O accumulators per lane
    assert KW == 1 or 64 * (NE + 2 * H) <= REGION, (D, t)     # a warp's partial rows fit its region
    NC = 32 * t.WARPS                  # threads copying a tile (key warps: each its own tiles)
    ZERO, NEG_INF, LN2_T = numba.float32(0), numba.float32(-math.inf), numba.float32(LN2)
    ALIGN = None if SIMULATOR else 16
    JIT = {} if SIMULATOR else {"launch_bounds": (NT, 1)}
    row_keys, in_row, key_range, _, tile_needs_mask, score, score_consts = device_rules(
        scores, "float32", SOFTCAP_TANH[dtype_name], block_rows=True)
    block_keys, _ = block_rules(scores)
    key_tile_count, key_tile_at, key_tile_consts = block_lists(scores)
    block_rows, block_tile = block_row_rules(scores)
    sequence = device_sequence(scores)

    copy_q = make_copy_rows(D, NC, BM)
    copy_kv = make_copy_rows(D, NC, BN)
    copy_kv_paged = make_copy_rows(D, NC, BN, paged=True)
    PAGED = scores.paged
    mma_pair = make_mma_pair(mma)
    a_frag, b_frag, bt_frag = make_fragments(RS)

    @device
    def merge_warps(o, m, l, w, nw, lane, g, tq, q0, Nq, q_start, b1, b2, fout, flse):
        """Key warps' epilogue (``nw`` of them): each warp's O, row maxima and sums
        (unnormalised) into its region, lane-major (float32 word ``32 i + lane`` of its
        ``i``-th value); one block barrier; then per row the maximum over the warps ``mu``,
        the merged sum of the factors ``2^(m_u − mu)``, and per column the merged O / sum
        (the factors taken again: no array indexed by the launch's warp count), the columns
        of 8-column block ``n`` by warp ``n % nw``; lse by warp 0. A warp without a visible
        key has ``m = −inf``: factor 0 (a row no warp saw: 0, lse −inf)."""
        smem_f = cuda.shared.array(0, numba.float32, alignment=ALIGN)      # the kernel's shared memory
        fb = (w * REGION) >> 1
        warp.syncwarp()                # every lane's last reads of the region done
        for mt in range(MT):
            for n in range(ND):
                for e in range(4):
                    smem_f[fb + 32 * ((mt * ND + n) * 4 + e) + lane] = o[mt, n, e]
        for h in range(H):
            lh = l[h]
            for off in (1, 2):
                lh += warp.shfl_xor_sync(warp.FULL_MASK, lh, off)
            smem_f[fb + 32 * (NE + h) + lane] = m[h]
            smem_f[fb + 32 * (NE + H + h) + lane] = lh
        cuda.syncthreads()
        for h in range(H):
            mt = h >> 1
            e0 = 2 * (h & 1)
            row = q0 + 16 * mt + g + 8 * (h & 1)
            mx = NEG_INF
            for u in range(nw):
                mx = max(mx, smem_f[((u * REGION) >> 1) + 32 * (NE + h) + lane])
            mu_h = ZERO if mx == NEG_INF else mx
            lt = ZERO
            for u in range(nw):
                at = ((u * REGION) >> 1) + lane
                lt += smem_f[at + 32 * (NE + H + h)] * ops.exp2_approx(smem_f[at + 32 * (NE + h)] - mu_h)
            inv = ZERO if lt == ZERO else numba.float32(1) / lt
            if row < Nq:
                for n in range(ND):
                    col = 8 * n + 2 * tq
                    if n % nw == w and col < D:
                        a0, a1 = ZERO, ZERO
                        for u in range(nw):
                            fac = ops.exp2_approx(smem_f[((u * REGION) >> 1) + 32 * (NE + h) + lane] - mu_h)
                            at = ((u * REGION) >> 1) + 32 * ((mt * ND + n) * 4 + e0) + lane
                            a0 += smem_f[at] * fac
                            a1 += smem_f[at + 32] * fac
                        bits = pack(a0 * inv, a1 * inv)
                        fout[b1, b2, q_start + row, col] = numba.uint16(bits & 0xFFFF)
                        fout[b1, b2, q_start + row, col + 1] = numba.uint16(bits >> 16)
                if tq == 0 and w == 0:
                    flse[b1, b2, q_start + row] = NEG_INF if lt == ZERO else (mx + math.log2(lt)) * LN2_T

    @device
    def forward_body(q, k, v, out, lse, fout, flse, scale_log2, split_keys, left, right, cap_in, cap_out, slopes,
                     seqs, pages, page_size):
        q_start, Nq, k_start, Nk = sequence(seqs, cuda.blockIdx.z, q.shape[2], k.shape[2])
        tid = cuda.threadIdx.x
        lane = tid & 31
        w = tid >> 5
        g = lane >> 2
        tq = lane & 3
        n_qt = (Nq + BM - 1) // BM
        B2 = q.shape[1]
        B = q.shape[0] * B2
        if KW > 1:                     # block x = (query tile, leading index), warp = key split
            Z = cuda.blockDim.x >> 5
            zb = cuda.blockIdx.x
            zs = w
        elif SPLIT:                    # block x = (query tile, leading index, key split)
            Z = out.shape[0] // q.shape[0]
            zb = cuda.blockIdx.x // Z
            zs = cuda.blockIdx.x - zb * Z
        else:
            Z = 1
            zb = cuda.blockIdx.x
            zs = 0
        qt = n_qt - 1 - zb // B        # heaviest (causal: last) query tiles first
        if qt < 0:                     # packed sequences: the grid covers the longest one
            return
        b = zb - (zb // B) * B
        b1 = b // B2
        b2 = b - b1 * B2
        q0 = qt * BM
        diag = Nk - Nq                 # bottom-right alignment (numba_flash.scores)
        geo = (Nk, diag, left, right)
        sc = score_consts(scale_log2, cap_in, cap_out, slopes, b1, b2)
        warp_row = WR * w              # this warp's first row in the tile
        sb = 0                         # where this warp's shared memory starts
        ct = tid                       # a thread's place among the copying threads
        if KW > 1:                     # (key warps: each its own rows 0.., memory and copies)
            warp_row = 0
            sb = w * REGION
            ct = lane
        # This lane's rows: q0 + warp_row + 16·mt + g + 8·half, indexed h = 2·mt + half;
        # in the accumulators, half 0 is elements 0, 1 and half 1 is elements 2, 3.

        smem = cuda.shared.array(0, numba.uint16, alignment=ALIGN)
        s = cuda.local.array((MT, NB, 4), numba.float32)
        o = cuda.local.array((MT, ND, 4), numba.float32)
        m = cuda.local.array(H, numba.float32)
        l = cuda.local.array(H, numba.float32)
        mu = cuda.local.array(H, numba.float32)
        qf = cuda.local.array((MT, KC if Q_IN_REGS else 1, 4), numba.uint32)
        qa = cuda.local.array((MT, 4), numba.uint32)
        pa = cuda.local.array((MT, 4), numba.uint32)
        for mt in range(MT):
            for n in range(ND):
                for e in range(4):
                    o[mt, n, e] = ZERO
        for h in range(H):
            m[h] = NEG_INF
            l[h] = ZERO

        kv_begin, kv_end = key_range(q0, BM, geo)   # other keys: invisible to the whole tile
        kv_begin, kv_end = block_keys(slopes, b1, b2, qt, kv_begin, kv_end)       # (and to a block mask)
        kt0 = kv_begin // BN
        n_all = (Nk + BN - 1) // BN
        # the key tiles to visit: kt0, kt0 + 1, ... or, for a block mask with holes, its list's
        n_j = key_tile_count(slopes, b1, b2, qt, n_all, max((max(kv_end, 0) + BN - 1) // BN - kt0, 0))
        j0 = 0
        if SPLIT:                      # split zs: split_keys keys' worth of tiles from the first on
            j0 = zs * (split_keys // BN)
            n_j = min(n_j, j0 + split_keys // BN)

        copy_q(smem, sb, q, b1, b2, q_start + q0, q_start + Nq, ct)
        k_end = k_start + Nk           # rows past this one are zero-filled
        kf = key_tile_at(slopes, b1, b2, qt, n_all, kt0, j0) * BN       # the first tile's first key
        if n_j > j0 and PAGED:         # a paged cache's rows, through the page table
            copy_kv_paged(smem, sb + K_OFF, k, sb + V_OFF, v, b1, b2, kf, Nk, ct, pages, cuda.blockIdx.z, page_size)
        elif n_j > j0:
            copy_kv(smem, sb + K_OFF, k, b1, b2, k_start + kf, k_end, ct)
            copy_kv(smem, sb + V_OFF, v, b1, b2, k_start + kf, k_end, ct)
        ops.cp_async_commit()

        for jj in range(j0, n_j):
            k0 = key_tile_at(slopes, b1, b2, qt, n_all, kt0, jj) * BN
            sct = key_tile_consts(slopes, b1, b2, qt, n_all, jj, sc)      # (a full tile: no mask_mod)
            slot = ((jj - j0) & 1) * SLOT
            ops.cp_async_wait(0)
            if KW > 1:                  # (each warp its own tiles, as many as its split has)
                warp.syncwarp()
            else:
                cuda.syncthreads()      # tile jj landed for all; every warp is done with jj - 1
            if jj + 1 < n_j:            # the other slot held tile jj - 1: refill it
                kn = key_tile_at(slopes, b1, b2, qt, n_all, kt0, jj + 1) * BN
                if PAGED:
                    copy_kv_paged(smem, sb + K_OFF + SLOT - slot, k, sb + V_OFF + SLOT - slot, v, b1, b2, kn, Nk,
                                  ct, pages, cuda.blockIdx.z, page_size)
                else:
                    copy_kv(smem, sb + K_OFF + SLOT - slot, k, b1, b2, k_start + kn, k_end, ct)
                    copy_kv(smem, sb + V_OFF + SLOT - slot, v, b1, b2, k_start + kn, k_end, ct)
                ops.cp_async_commit()
            if Q_IN_REGS and jj == j0:
                for mt in range(MT):
                    for kc in range(KC):
                        qf[mt, kc, 0], qf[mt, kc, 1], qf[mt, kc, 2], qf[mt, kc, 3] = a_frag(
                            smem, sb + (warp_row + 16 * mt) * RS + 16 * kc, lane)

            # ---- S = Q Kᵀ: each K fragment feeds MT row blocks --------------------------------
            for mt in range(MT):
                for n in range(NB):
                    for e in range(4):
                        s[mt, n, e] = ZERO
            for kc in range(KC):
                for mt in range(MT):
                    if Q_IN_REGS:
                        for e in range(4):
                            qa[mt, e] = qf[mt, kc, e]
                    else:
                        qa[mt, 0], qa[mt, 1], qa[mt, 2], qa[mt, 3] = a_frag(
                            smem, sb + (warp_row + 16 * mt) * RS + 16 * kc, lane)
                for n2 in range(NB // 2):
                    # keys 16·n2 … +15 of the tile, head-dim columns 16·kc … +15
                    kb0, kb1, kb2, kb3 = b_frag(smem, sb + K_OFF + slot + 16 * n2 * RS + 16 * kc, lane)
                    for mt in range(MT):
                        mma_pair(s, mt, 2 * n2, qa[mt, 0], qa[mt, 1], qa[mt, 2], qa[mt, 3], kb0, kb1, kb2, kb3)

            # ---- online softmax, per row h ----------------------------------------------------
            # Scores in log2 units, then masked: a loop of its own, so that each loop
            # nest stays small enough for the compiler to unroll it completely (the
            # accumulators then stay in registers).
            for mt in range(MT):
                for n in range(NB):
                    for e in range(4):
                        s[mt, n, e], _ = score(s[mt, n, e], q0 + warp_row + 16 * mt + g + 8 * (e >> 1),
                                               k0 + 8 * n + 2 * tq + (e & 1), diag, sct)
            if tile_needs_mask(q0, BM, k0, BN, geo) or block_tile(slopes, b1, b2, qt, k0, BN):
                for h in range(H):
                    mt = h >> 1
                    lo, hi = row_keys(q0 + warp_row + 16 * mt + g + 8 * (h & 1), geo)
                    lo, hi = block_rows(slopes, b1, b2, q0 + warp_row + 16 * mt + g + 8 * (h & 1), lo, hi)
                    for n in range(NB):
                        for e in range(2 * (h & 1), 2 * (h & 1) + 2):
                            if not in_row(k0 + 8 * n + 2 * tq + (e & 1), lo, hi):
                                s[mt, n, e] = NEG_INF
            for h in range(H):
                mt = h >> 1
                e0 = 2 * (h & 1)
                mx = NEG_INF
                for n in range(NB):      # (a pair at a time: a chain half as deep, the same value)
                    mx = max(mx, max(s[mt, n, e0], s[mt, n, e0 + 1]))
                for off in (1, 2):
                    mx = max(mx, warp.shfl_xor_sync(warp.FULL_MASK, mx, off))
                m_new = max(m[h], mx)
                # a row with no visible key yet keeps m = -inf: exponentiate against 0 instead
                mu[h] = ZERO if m_new == NEG_INF else m_new
                alpha = ops.exp2_approx(m[h] - mu[h])
                m[h] = m_new
                rs = ZERO
                for n in range(NB):
                    for e in range(e0, e0 + 2):
                        p = ops.exp2_approx(s[mt, n, e] - mu[h])
                        s[mt, n, e] = p
                        rs += p
                l[h] = l[h] * alpha + rs
                for n in range(ND):
                    o[mt, n, e0] *= alpha
                    o[mt, n, e0 + 1] *= alpha

            # ---- O += P V: P's A fragments are the packed S accumulators ----------------------
            for kc in range(NB // 2):
                n = 2 * kc
                for mt in range(MT):
                    pa[mt, 0] = pack(s[mt, n, 0], s[mt, n, 1])
                    pa[mt, 1] = pack(s[mt, n, 2], s[mt, n, 3])
                    pa[mt, 2] = pack(s[mt, n + 1, 0], s[mt, n + 1, 1])
                    pa[mt, 3] = pack(s[mt, n + 1, 2], s[mt, n + 1, 3])
                for d2 in range(ND // 2):
                    # keys 16·kc … +15, head-dim columns 16·d2 … +15, transposed
                    vb0, vb1, vb2, vb3 = bt_frag(smem, sb + V_OFF + slot + 16 * kc * RS + 16 * d2, lane)
                    for mt in range(MT):
                        mma_pair(o, mt, 2 * d2, pa[mt, 0], pa[mt, 1], pa[mt, 2], pa[mt, 3], vb0, vb1, vb2, vb3)

        ops.cp_async_wait(0)            # nothing left in flight when the loop had no iteration

        if KW > 1:
            merge_warps(o, m, l, w, Z, lane, g, tq, q0, Nq, q_start, b1, b2, fout, flse)
            return

        # ---- epilogue: O /= l, lse = (m + log2 l) ln 2 ---------------------------------------
        for h in range(H):
            mt = h >> 1
            e0 = 2 * (h & 1)
            row = q0 + warp_row + 16 * mt + g + 8 * (h & 1)
            lh = l[h]
            for off in (1, 2):
                lh += warp.shfl_xor_sync(warp.FULL_MASK, lh, off)
            inv = ZERO if lh == ZERO else numba.float32(1) / lh   # no visible key: 0, lse -inf
            if SPLIT and Z > 1 and row < Nq:    # this split's normalised output, row max and sum
                ob1 = zs * q.shape[0] + b1
                for n in range(ND):
                    col = 8 * n + 2 * tq
                    if col < D:
                        out[ob1, b2, q_start + row, col] = o[mt, n, e0] * inv
                        out[ob1, b2, q_start + row, col + 1] = o[mt, n, e0 + 1] * inv
                if tq == 0:
                    lse[ob1, b2, q_start + row] = m[h]
                    lse[ob1 + Z * q.shape[0], b2, q_start + row] = lh
            elif row < Nq:
                for n in range(ND):
                    col = 8 * n + 2 * tq
                    if col < D:
                        bits = pack(o[mt, n, e0] * inv, o[mt, n, e0 + 1] * inv)
                        fout[b1, b2, q_start + row, col] = numba.uint16(bits & 0xFFFF)
                        fout[b1, b2, q_start + row, col + 1] = numba.uint16(bits >> 16)
                if tq == 0:
                    flse[b1, b2, q_start + row] = NEG_INF if lh == ZERO else (m[h] + math.log2(lh)) * LN2_T

    if split and scores.packed:
        @cuda.jit(**JIT)
        def forward(q, k, v, out, lse, fout, flse, scale_log2, split_keys, left, right, cap_in, cap_out, slopes,
                    seqs, pages, page_size):
            forward_body(q, k, v, out, lse, fout, flse, scale_log2, split_keys, left, right, cap_in, cap_out, slopes,
                         seqs, pages, page_size)
    elif split:
        @cuda.jit(**JIT)
        def forward(q, k, v, out, lse, fout, flse, scale_log2, split_keys, left, right, cap_in, cap_out, slopes):
            forward_body(q, k, v, out, lse, fout, flse, scale_log2, split_keys, left, right, cap_in, cap_out, slopes,
                         slopes, slopes, 0)
    elif scores.packed:
        @cuda.jit(**JIT)
        def forward(q, k, v, out, lse, scale_log2, left, right, cap_in, cap_out, slopes, seqs, pages, page_size):
            forward_body(q, k, v, out, lse, out, lse, scale_log2, 0, left, right, cap_in, cap_out, slopes, seqs,
                         pages, page_size)
    else:
        @cuda.jit(**JIT)
        def forward(q, k, v, out, lse, scale_log2, left, right, cap_in, cap_out, slopes):
            forward_body(q, k, v, out, lse, out, lse, scale_log2, 0, left, right, cap_in, cap_out, slopes, slopes,
                         slopes, 0)

    forward.tiling = t
    forward.smem_bytes = smem_elements(D, t) * 2
    return forward
