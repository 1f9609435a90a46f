"""FlashAttention-2 backward on tensor cores (float16 and bfloat16), deterministic.

The computation of ``backward.py`` (which see) with all five products on tensor cores
(``mma.sync`` m16n8k16, float32 accumulators) and the same two kernels from one factory,
each owning the rows it accumulates (no atomics: bitwise reproducible):

* ``dkdv``: a block owns ``BR`` keys (K and V resident in shared memory) and streams
  query tiles of ``BC`` rows (Q and dO): ``Sᵀ = K Qᵀ``, ``dPᵀ = V dOᵀ``, ``Pᵀ`` from the
  forward's ``lse``, ``dSᵀ = Pᵀ ∘ (dPᵀ − delta)``, then ``dV += Pᵀ dO`` and
  ``dK += dSᵀ Q``;
* ``dq``: a block owns ``BR`` queries (Q and dO resident) and streams key tiles (K, V):
  ``S = Q Kᵀ``, ``dP = dO Vᵀ``, ``dS``, ``dQ += dS K``.

In both, *row* operands ``RA, RB`` (K, V or Q, dO) belong to the block's rows and
*column* operands ``CA, CB`` (Q, dO or K, V) stream through a two-slot ring (tile
``j + 1`` in flight with ``cp.async`` while tile ``j`` is used): ``S = RA CAᵀ``,
``dP = RB CBᵀ``, ``acc_a += dS CA`` and (dK/dV) ``acc_b += P CB``. Warp ``w`` owns rows
``16 w … 16 w + 15``; the first two products read RA, RB as A fragments and CA, CB rows
as B fragments by plain ``ldmatrix`` (a row of CA is a column of CAᵀ); P and dS leave
their accumulators packed in pairs as the A fragments of the last two, which read CA,
CB by ``ldmatrix.trans``. P and dS are rounded to the input dtype there (as
FlashAttention does); everything else is float32.

A block accumulates a ``DO``-column slice of its outputs (grid axis y: ``ceil(d / DO)``
slices, each recomputing S and dP): two 16 × 128 float32 accumulators per warp are what
the registers hold.
"""
import dataclasses
import functools

import numba
from numba import cuda

from .. import ops
from .._runtime import SIMULATOR
from ..scores import ScoreSpec
from .backward import make_tile_rules
from .mma_parts import ROW_PAD, device, make_copy_rows, make_fragments, make_mma_pair, operand_kinds, padded_dim

KINDS = ("dkdv", "dq")
STATS_ROWS = 64         # the stats rows (query rows' lse and delta) are padded to a multiple of this


@dataclasses.dataclass(frozen=True)
class MmaBwdTiling:
    """Compile-time shape of one tensor-core backward specialisation."""
    WARPS: int        # warps per block, 16 rows each (keys for dK/dV, queries for dQ)
    BC: int           # columns (queries for dK/dV, keys for dQ) per streamed tile, multiple of 16
    DO: int           # output columns per block (multiple of 16): the head-dim slice of grid axis y

    @property
    def BR(self):
        return 16 * self.WARPS

    @property
    def threads(self):
        return 32 * self.WARPS

    # the launch helpers and bench.py read these (as for the CUDA-core ``Tiling``)
    @property
    def RG(self):
        return self.BR

    @property
    def TM(self):
        return 1

    @property
    def BM(self):
        return self.BR

    @property
    def BN(self):
        return self.BC


def smem_elements(d, t: MmaBwdTiling):
    """RA and RB tiles (``BR`` rows each), two slots of CA and of CB (``BC`` rows each),
    two slots of the column tile's stats (``2 · BC`` float32: dK/dV's query lse and delta)."""
    return (2 * t.BR + 4 * t.BC) * (padded_dim(d) + ROW_PAD) + 8 * t.BC


def stats_rows(nq):
    """Length of the stats rows for ``nq`` query rows: every column tile reads whole 16-byte chunks."""
    return -(-nq // STATS_ROWS) * STATS_ROWS


@functools.lru_cache(maxsize=None)
def make_backward_mma(kind: str, dtype_name: str, D: int, t: MmaBwdTiling, scores: ScoreSpec):
    """Build the ``dkdv`` or ``dq`` tensor-core backward kernel for one specialisation.

    Arguments: ``q, k, v, dout (B1, B2, N, D)`` as ``uint16`` views of the 16-bit data
    (unit inner stride, 16-byte aligned rows, ``D`` a multiple of 8), ``st (B1, B2, 2,
    stats_rows(Nq))`` float32, the query rows' ``lse · log2 e`` and delta written by
    ``backward.make_delta(dtype, stats=True)``, ``ga, gb`` (``uint16`` views shaped like k, or q for dQ),
    ``scale_log2, scale`` float32, the score arguments ``left, right, cap_in, cap_out,
    slopes`` (see ``forward.make_forward``) and ``group``, as for the CUDA-core kernels
    (``backward.make_backward``): ``dkdv`` writes ``ga = dK``, ``gb = dV`` and sums a
    group of ``group`` query heads; ``dq`` writes ``ga = dQ``. Launch with
    ``grid = (ceil(rows / BR) · B1 · B2 / group, ceil(D / DO))``, ``block = 32 · WARPS``,
    ``smem_elements(D, t) · 2`` bytes of dynamic shared memory.
    """
    assert kind in KINDS and D % 8 == 0
    DKDV = kind == "dkdv"
    mma, pack = operand_kinds(dtype_name)
    BC, BR, NT, DO = t.BC, t.BR, t.threads, t.DO
    assert BC % 16 == 0 and DO % 16 == 0 and STATS_ROWS % BC == 0 and 2 * BC // 4 <= NT
    DP = padded_dim(D)
    RS = DP + ROW_PAD                  # shared row stride, elements
    KC = DP // 16                      # k16 steps of S and dP
    NB = BC // 8                       # 8-column blocks of S and dP
    NO = DO // 8                       # 8-column blocks of the accumulators
    RB_OFF = BR * RS                   # RA tile first, then RB, then two CA slots, then two CB slots
    CA_OFF = 2 * BR * RS
    SLOT = BC * RS
    CB_OFF = CA_OFF + 2 * SLOT
    ST_OFF = (CB_OFF + 2 * SLOT) // 2  # then two slots of stats, in float32 elements: lse row, delta row
    ST_SLOT = 2 * BC
    ST_CHUNKS = BC // 4                # 16-byte chunks per stats row of a tile
    assert 2 * (ST_OFF + 2 * ST_SLOT) == smem_elements(D, t)
    FULL_SLICES = DP % DO == 0         # every 16-column block of every slice lies within the padded d
    F32 = numba.float32
    ZERO = F32(0)
    ALIGN = None if SIMULATOR else 16
    JIT = {} if SIMULATOR else {"launch_bounds": (NT, 1)}
    place, columns, probability, tile_needs_mask, block_tile, score_consts = make_tile_rules(
        DKDV, dtype_name, scores, BR, BC)
    column_total, column_next, column_at, column_consts = columns
    copy_r = make_copy_rows(D, NT, BR)
    copy_c = make_copy_rows(D, NT, BC)

    @device
    def copy_stats(smem_f, off, st, b1, b2, c0, tid):
        """``smem_f[off + j] = st[b1, b2, 0, c0 + j]`` and ``smem_f[off + BC + j] = st[b1, b2,
        1, c0 + j]`` for ``j < BC`` (in bounds: the rows are padded), by ``cp.async``."""
        if tid < 2 * ST_CHUNKS:
            which = tid // ST_CHUNKS
            i = 4 * (tid - which * ST_CHUNKS)
            ops.cp_async16(smem_f, off + which * BC + i, st, b1, b2, which, c0 + i, 16)
    mma_pair = make_mma_pair(mma)
    a_frag, b_frag, bt_frag = make_fragments(RS)

    @cuda.jit(**JIT)
    def backward(q, k, v, dout, st, ga, gb, scale_log2, scale, left, right, cap_in, cap_out, slopes, group):
        Nq = q.shape[2]
        Nk = k.shape[2]
        diag = Nk - Nq                  # bottom-right alignment (numba_flash.scores)
        geo = (Nk, diag, left, right)
        tid = cuda.threadIdx.x
        lane = tid & 31
        wr = 16 * (tid >> 5)            # this warp's first row in the block
        g = lane >> 2
        tq = lane & 3
        b1, b2_first, r0, c_start, n_ct = place(cuda.blockIdx.x, q.shape[0], q.shape[1], Nq, group, geo, slopes)
        d0 = cuda.blockIdx.y * DO
        # Operand roles (a compile-time choice): rows own the accumulators.
        if DKDV:
            ra, rb, ca, cb = k, v, q, dout
            n_rows, n_cols = Nk, Nq
        else:
            ra, rb, ca, cb = q, dout, k, v
            n_rows, n_cols = Nq, Nk
        # dK, dV of grouped heads: the column tiles of each query head in turn (make_column_tiles)
        rt, n_rt, n_all = r0 // BR, (n_rows + BR - 1) // BR, (n_cols + BC - 1) // BC   # (row, column tiles)
        total = column_total(slopes, b1, b2_first, rt, n_rt, n_all, n_ct, group)
        gi, jc = column_next(slopes, b1, b2_first, rt, n_rt, n_all, n_ct, group, 0, -1)
        ct = c_start
        if total > 0:
            ct = column_at(slopes, b1, b2_first, rt, n_rt, n_all, c_start, gi, jc)
        b2 = b2_first + gi

        smem = cuda.shared.array(0, numba.uint16, alignment=ALIGN)
        smem_f = cuda.shared.array(0, numba.float32, alignment=ALIGN)    # the same memory, as float32
        s = cuda.local.array((1, NB, 4), numba.float32)
        dp = cuda.local.array((1, NB, 4), numba.float32)
        acc_a = cuda.local.array((1, NO, 4), numba.float32)
        acc_b = cuda.local.array((1, NO if DKDV else 1, 4), numba.float32)
        row_lse = cuda.local.array(2, numba.float32)
        row_delta = cuda.local.array(2, numba.float32)
        for n in range(NO):
            for e in range(4):
                acc_a[0, n, e] = ZERO
                if DKDV:
                    acc_b[0, n, e] = ZERO
        if not DKDV:                    # this lane's two query rows: log2-unit lse, delta
            for h in range(2):
                row = min(r0 + wr + g + 8 * h, st.shape[3] - 1)    # padding rows: +inf, so P = 0
                row_lse[h] = st[b1, b2_first, 0, row]
                row_delta[h] = st[b1, b2_first, 1, row]

        copy_r(smem, 0, ra, b1, b2_first, r0, n_rows, tid)
        copy_r(smem, RB_OFF, rb, b1, b2_first, r0, n_rows, tid)
        if total > 0:
            copy_c(smem, CA_OFF, ca, b1, b2, ct * BC, n_cols, tid)
            copy_c(smem, CB_OFF, cb, b1, b2, ct * BC, n_cols, tid)
            if DKDV:
                copy_stats(smem_f, ST_OFF, st, b1, b2, ct * BC, tid)
        ops.cp_async_commit()

        for it in range(total):
            c0 = ct * BC
            slot = (it & 1) * SLOT
            st_slot = ST_OFF + (it & 1) * ST_SLOT
            gi_next, jc_next = column_next(slopes, b1, b2_first, rt, n_rt, n_all, n_ct, group, gi, jc)
            b2_next = b2_first + gi_next
            ct_next = ct
            if it + 1 < total:
                ct_next = column_at(slopes, b1, b2_first, rt, n_rt, n_all, c_start, gi_next, jc_next)
            ops.cp_async_wait(0)
            cuda.syncthreads()          # tile it landed for all; every warp is done with it − 1
            if it + 1 < total:          # the other slot held tile it − 1: refill it
                copy_c(smem, CA_OFF + SLOT - slot, ca, b1, b2_next, ct_next * BC, n_cols, tid)
                copy_c(smem, CB_OFF + SLOT - slot, cb, b1, b2_next, ct_next * BC, n_cols, tid)
                if DKDV:
                    copy_stats(smem_f, 2 * ST_OFF + ST_SLOT - st_slot, st, b1, b2_next, ct_next * BC, tid)
                ops.cp_async_commit()
            sc = column_consts(slopes, b1, b2_first, rt, n_rt, n_all, gi, jc,
                               score_consts(scale_log2, cap_in, cap_out, slopes, b1, b2))

            # ---- S = RA CAᵀ and dP = RB CBᵀ ---------------------------------------------
            for n in range(NB):
                for e in range(4):
                    s[0, n, e] = ZERO
                    dp[0, n, e] = ZERO
            for kc in range(KC):
                a0, a1, a2, a3 = a_frag(smem, wr * RS + 16 * kc, lane)
                r0_, r1_, r2_, r3_ = a_frag(smem, RB_OFF + wr * RS + 16 * kc, lane)
                for n2 in range(NB // 2):
                    c0_, c1_, c2_, c3_ = b_frag(smem, CA_OFF + slot + 16 * n2 * RS + 16 * kc, lane)
                    mma_pair(s, 0, 2 * n2, a0, a1, a2, a3, c0_, c1_, c2_, c3_)
                    c0_, c1_, c2_, c3_ = b_frag(smem, CB_OFF + slot + 16 * n2 * RS + 16 * kc, lane)
                    mma_pair(dp, 0, 2 * n2, r0_, r1_, r2_, r3_, c0_, c1_, c2_, c3_)

            # ---- P = exp2(score − lse), dS = P ∘ (dP − delta) ∘ softcap′ ----------------
            # This lane holds rows r0 + wr + g + 8·(e >> 1), columns c0 + 8n + 2tq + (e & 1).
            if DKDV:
                masked = tile_needs_mask(c0, BC, r0, BR, geo)
            else:
                masked = tile_needs_mask(r0, BR, c0, BC, geo) or block_tile(slopes, b1, b2, r0 // BR, c0, BC)
            for n in range(NB):
                for e in range(4):
                    row = r0 + wr + g + 8 * (e >> 1)
                    col = c0 + 8 * n + 2 * tq + (e & 1)
                    if DKDV:            # the columns are queries
                        lse_e = smem_f[st_slot + 8 * n + 2 * tq + (e & 1)]
                        delta_e = smem_f[st_slot + BC + 8 * n + 2 * tq + (e & 1)]
                    else:
                        lse_e = row_lse[e >> 1]
                        delta_e = row_delta[e >> 1]
                    p, grad = probability(s[0, n, e], row, col, lse_e, masked, geo, diag, sc, slopes, b1, b2)
                    s[0, n, e] = p
                    dp[0, n, e] = p * (dp[0, n, e] - delta_e) * grad

            # ---- acc_a += dS CA (dK or dQ), acc_b += P CB (dV) ----------------------------
            for kc in range(NB // 2):
                n = 2 * kc
                p0 = pack(s[0, n, 0], s[0, n, 1])
                p1 = pack(s[0, n, 2], s[0, n, 3])
                p2 = pack(s[0, n + 1, 0], s[0, n + 1, 1])
                p3 = pack(s[0, n + 1, 2], s[0, n + 1, 3])
                q0_ = pack(dp[0, n, 0], dp[0, n, 1])
                q1_ = pack(dp[0, n, 2], dp[0, n, 3])
                q2_ = pack(dp[0, n + 1, 0], dp[0, n + 1, 1])
                q3_ = pack(dp[0, n + 1, 2], dp[0, n + 1, 3])
                for d2 in range(NO // 2):
                    if FULL_SLICES or d0 + 16 * d2 < DP:   # the last slice may reach past the padded d
                        c0_, c1_, c2_, c3_ = bt_frag(smem, CA_OFF + slot + 16 * kc * RS + d0 + 16 * d2, lane)
                        mma_pair(acc_a, 0, 2 * d2, q0_, q1_, q2_, q3_, c0_, c1_, c2_, c3_)
                        if DKDV:
                            c0_, c1_, c2_, c3_ = bt_frag(smem, CB_OFF + slot + 16 * kc * RS + d0 + 16 * d2, lane)
                            mma_pair(acc_b, 0, 2 * d2, p0, p1, p2, p3, c0_, c1_, c2_, c3_)
            b2 = b2_next
            ct = ct_next
            gi = gi_next
            jc = jc_next
        ops.cp_async_wait(0)                      # nothing left in flight when the loop had no iteration

        # ---- epilogue: dK = scale · acc_a, dV = acc_b   |   dQ = scale · acc_a -------------
        for h in range(2):
            row = r0 + wr + g + 8 * h
            if row < n_rows:
                for n in range(NO):
                    col = d0 + 8 * n + 2 * tq
                    if col < D:
                        bits = pack(acc_a[0, n, 2 * h] * scale, acc_a[0, n, 2 * h + 1] * scale)
                        ga[b1, b2_first, row, col] = numba.uint16(bits & 0xFFFF)
                        ga[b1, b2_first, row, col + 1] = numba.uint16(bits >> 16)
                        if DKDV:
                            bits = pack(acc_b[0, n, 2 * h], acc_b[0, n, 2 * h + 1])
                            gb[b1, b2_first, row, col] = numba.uint16(bits & 0xFFFF)
                            gb[b1, b2_first, row, col + 1] = numba.uint16(bits >> 16)

    backward.tiling = t
    backward.rows_per_block = BR
    backward.smem_bytes = smem_elements(D, t) * 2
    return backward
