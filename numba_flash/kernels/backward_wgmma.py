"""FlashAttention backward on Hopper (sm_90a): TMA-fed warpgroup MMA, deterministic.

The computation and the two kernels of ``backward_mma`` (which see), each owning the
rows it accumulates (no atomics: bitwise reproducible): ``dkdv`` blocks own ``BR = 128``
keys and stream query tiles, ``dq`` blocks own 128 queries and stream key tiles. The
*row* operands ``RA, RB`` (K and V, or Q and dO) are loaded once by the TMA; the
*column* operands ``CA, CB`` (Q and dO, or K and V) come ``BC = 64`` rows at a time
through a two-stage ring, tile ``j + 2`` loading while tile ``j`` is used, each stage
guarded by one mbarrier that the TMA completes. A block has 256 threads in two
warpgroups, each owning 64 of the rows, everything on ``wgmma`` (``wgmma_parts``):

    S  = RA CAᵀ,  dP = RB CBᵀ                      (64 × 64 per warpgroup, from shared memory)
    P  = exp2(score − lse),  dS = P ∘ (dP − delta) ∘ softcap′   (registers, float32)
    dK/dV:  dV += Pᵀ dO,  dK += dSᵀ Q            (P, dS from registers, rounded to the input dtype)
    dQ:     dQ += dS K

``dV += Pᵀ dO`` is issued as soon as P is ready, before dS is computed, so the tensor
cores work while the warpgroup computes. The dK/dV blocks take the column tiles'
``lse`` and ``delta`` (the ``backward_stats`` pre-pass's rows, which the stage's queries
index) through shared memory, loaded two tiles ahead; dQ threads hold their two rows'.
Grouped heads: a dK/dV block sums the ``group`` query heads of its K/V head
(``backward.make_column_tiles``); K/V head ``h // group`` serves query head ``h``.

Arguments: the tensor maps (``ops_hopper.tensor_map_4d``) of ``RA, RB`` (``BR``-row
boxes) and ``CA, CB`` (``BC``-row boxes) over the ``(X, H, N, D)`` views, ``st (X, Hq,
2, stats_rows(Nq))`` float32, ``ga, gb (X, H, N, D / 4)`` uint64 (the outputs' 16-bit
values in fours: dK and dV, or dQ twice), ``nq, nk, group``, ``scale_log2, scale`` and
the score arguments of ``forward.make_forward``. Launch with ``grid = ceil(rows / BR) ·
X · H / group`` (dK/dV; dQ: ``· Hq``), ``THREADS`` threads and ``kernel.smem_bytes`` of
dynamic shared memory. Head dims 64 and 128, and the multiples of 8 between (:func:`takes`:
the kernel of 128 on zero columns, its outputs' stores stopped at column d).
"""
import dataclasses
import functools

import numba
from numba import cuda

from .. import ops
from .. import ops_hopper as H
from ..scores import ScoreSpec
from .backward import make_tile_rules
from .wgmma_parts import SUB, make_column_product, make_row_product, make_store_rows, padded, wait_phase

KINDS = ("dkdv", "dq")
BR, BC = 128, 64              # rows per block (64 per warpgroup), columns per streamed tile
THREADS = 256
HEAD_DIMS = (64, 128)         # the kernels' head dims (``wgmma_parts.padded``)
# the head dims the family takes by default on a compute capability 9.0 GPU (the others of
# :func:`takes` where forced, until measured; dK/dV at d = 256 would not fit the registers)
DEFAULT_HEAD_DIMS = (64, 128)
STAGES = 2
ROWS = 64                     # rows per warpgroup (one wgmma M)


def by_default(d, scores):
    """Whether a compute capability 9.0 GPU runs head dim ``d`` on this family unless
    told otherwise (:data:`DEFAULT_HEAD_DIMS`; the rules ``scores`` do not matter)."""
    return d in DEFAULT_HEAD_DIMS


@dataclasses.dataclass(frozen=True)
class WgmmaBwdTiling:
    """The family's tile shape in the registry's and the launch helpers' terms: ``BR``
    rows per block, ``BC`` columns per streamed tile, ``threads`` per block, ``DO``
    head-dim columns per block (all)."""
    BR: int = BR
    BC: int = BC
    threads: int = THREADS
    DO: int = 256

    @property
    def RG(self):              # rows per block, as families.backward reads them
        return self.BR

    @property
    def TM(self):
        return 1


TILING = WgmmaBwdTiling()


def takes(d):
    """Whether the family takes head dim ``d``: a multiple of 8 from 64 to 128."""
    return d % 8 == 0 and 64 <= d <= 128


def _layout(D):
    nsub = padded(D) // 64
    sub_r, sub_c = BR * SUB, BC * SUB          # bytes of one 64-column sub-tile
    ra = 0
    rb = ra + nsub * sub_r
    ca = rb + nsub * sub_r
    cb = ca + STAGES * nsub * sub_c
    stats = cb + STAGES * nsub * sub_c         # per stage: BC lse, then BC delta (float32)
    bars = stats + STAGES * 2 * BC * 4
    return nsub, sub_r, sub_c, ra, rb, ca, cb, stats, bars


def smem_bytes(D):
    """The row tiles, the column ring, the stats ring, the mbarriers (rows, then one per
    stage) and room to align the base to 1024 bytes."""
    return _layout(D)[-1] + 8 * (1 + STAGES) + 1024


@functools.lru_cache(maxsize=None)
def make_backward_wgmma(kind: str, dtype_name: str, D: int, scores: ScoreSpec, dv_early=None):
    """The ``dkdv`` or ``dq`` kernel for one dtype, head dim and score rules; ``dv_early``:
    dK/dV computes dS while dV's product runs (else after it: fewer registers). By default
    on for d = 64 only: on the H200 (bf16, kernels alone) it gained 1.2 % at d = 64 and lost
    3 % at d = 128 (3.744 against 3.632 ms at (4,16,4096,128); docs/performance.md)."""
    assert kind in KINDS and takes(D), (kind, D)
    D, COLS = padded(D), D                # the kernel's head dim; the outputs' columns
    if dv_early is None:
        dv_early = D == 64
    DKDV = kind == "dkdv"
    NSUB, SUB_R, SUB_C, RA_OFF, RB_OFF, CA_OFF, CB_OFF, ST_OFF, BAR_OFF = _layout(D)
    ROW_BYTES, COL_BYTES = 2 * NSUB * SUB_R, 2 * NSUB * SUB_C     # what each barrier's loads bring
    NS = BC // 2                         # S (and dP) accumulator elements per thread
    NP = NS // 2                         # the same, packed in 16-bit pairs
    row_product = make_row_product(dtype_name, D, BC, SUB_R, SUB_C, COLS)   # S = RA CAᵀ, dP = RB CBᵀ (k-steps to d)
    column_product = make_column_product(dtype_name, D, BC, SUB_C)      # acc += P CB, dS CA
    zeros = H.accumulator(64)
    wait0, wait1 = H.wgmma_wait(0), H.wgmma_wait(1)
    pack = ops.pack_bf16x2 if dtype_name == "bfloat16" else ops.pack_f16x2
    store_rows = make_store_rows(dtype_name, D, COLS)
    place, columns, probability, tile_needs_mask, block_tile, score_consts = make_tile_rules(
        DKDV, dtype_name, scores, BR, BC)
    # ALiBi (without user functions) is applied here rather than by the score rule: its bias
    # −slope·|dist| joins lse's side of exp2's argument, with distances in float32 (the rule's
    # took a 64-bit integer-to-float conversion a score, on the unit the exponentials need)
    ALIBI = scores.alibi and scores.mods is None
    if ALIBI:
        probability = make_tile_rules(DKDV, dtype_name, dataclasses.replace(scores, alibi=False), BR, BC)[2]
    column_total, column_next, column_at, column_consts = columns
    F32 = numba.float32
    ZERO, ONE = F32(0), F32(1)

    @cuda.jit(device=True, inline=True)
    def load_columns(base, t_ca, t_cb, full, slot, c0, head, b1):
        """One thread's TMA loads of a column tile's CA and CB rows into ``slot``."""
        bar = full + 8 * slot
        H.mbarrier_arrive_expect_tx(bar, COL_BYTES)
        for sub in range(NSUB):
            at = (slot * NSUB + sub) * SUB_C
            H.tma_load_4d(base + CA_OFF + at, H.global_address(t_ca), 64 * sub, c0, head, b1, bar)
            H.tma_load_4d(base + CB_OFF + at, H.global_address(t_cb), 64 * sub, c0, head, b1, bar)

    @cuda.jit(device=True, inline=True)
    def stat_at(smf, at, i, tq4, v0, v1):
        """The lse (or delta) of score ``i``: dK/dV, its column's from the stats ring at
        ``at``; dQ, its row's, ``v0`` or ``v1``."""
        if DKDV:
            return smf[at + 8 * (i >> 2) + 2 * tq4 + (i & 1)]
        return v1 if (i >> 1) & 1 else v0

    @cuda.jit(device=True, inline=True)
    def distance_offset(i):
        """Score ``i``'s query-key distance less the thread's tile constant (``alibi``)."""
        o = F32(8 * (i >> 2) + (i & 1) - 8 * ((i >> 1) & 1))     # its column's offset less its row's
        return o if DKDV else -o

    @cuda.jit(device=True, inline=True)
    def column_head(b2_first, gi, group):
        """The head of the column operands: the query head ``gi`` of the group (dK/dV), the
        K/V head (dQ)."""
        return b2_first + gi if DKDV else b2_first // group

    @cuda.jit(launch_bounds=(THREADS, 1))
    def backward(t_ra, t_rb, t_ca, t_cb, st, ga, gb, nq, nk, group, scale_log2, scale, left, right, cap_in,
                 cap_out, slopes):
        B1, B2 = st.shape[0], st.shape[1]           # leading index, query heads
        diag = nk - nq
        geo = (nk, diag, left, right)
        G = group if DKDV else 1                     # query heads per block
        b1, b2_first, r0, c_start, n_ct = place(cuda.blockIdx.x, B1, B2, nq, G, geo, slopes)
        n_rows, n_cols = (nk, nq) if DKDV else (nq, nk)
        row_head = b2_first // group if DKDV else b2_first
        rt, n_rt, n_all = r0 // BR, (n_rows + BR - 1) // BR, (n_cols + BC - 1) // BC
        total = column_total(slopes, b1, b2_first, rt, n_rt, n_all, n_ct, G)

        sm = cuda.shared.array(0, numba.uint8, alignment=1024)
        smf = cuda.shared.array(0, numba.float32, alignment=1024)   # the same memory, as float32
        tid = cuda.threadIdx.x
        base = (H.shared_address(sm) + 1023) & ~1023
        stf = (base - H.shared_address(sm) + ST_OFF) // 4            # the stats ring, in floats
        r_full = base + BAR_OFF
        full = r_full + 8
        wg = tid >> 7
        ct = tid & 127
        w = (ct >> 5) & 3
        g = (ct & 31) >> 2
        tq4 = ct & 3
        row0 = r0 + ROWS * wg + 16 * w + g          # this thread's rows: row0 and row0 + 8
        ra_at = base + RA_OFF + ROWS * wg * SUB
        rb_at = base + RB_OFF + ROWS * wg * SUB
        if tid == 0:
            H.mbarrier_init(r_full, 1)
            for slot in range(STAGES):
                H.mbarrier_init(full + 8 * slot, 1)
            H.fence_mbarrier_init()
        cuda.syncthreads()

        # the column tiles: the current one (gi, jc, c), the next, and the one after
        gi, jc = column_next(slopes, b1, b2_first, rt, n_rt, n_all, n_ct, G, 0, -1)
        c = c_start
        gi1, jc1 = column_next(slopes, b1, b2_first, rt, n_rt, n_all, n_ct, G, gi, jc)
        c1 = c_start
        if total > 0:
            c = column_at(slopes, b1, b2_first, rt, n_rt, n_all, c_start, gi, jc)
        if total > 1:
            c1 = column_at(slopes, b1, b2_first, rt, n_rt, n_all, c_start, gi1, jc1)
        if tid == 0 and total > 0:                  # (no tile: nothing is loaded, the outputs are 0)
            H.tensormap_acquire(H.global_address(t_ra))
            H.tensormap_acquire(H.global_address(t_rb))
            H.tensormap_acquire(H.global_address(t_ca))
            H.tensormap_acquire(H.global_address(t_cb))
            H.mbarrier_arrive_expect_tx(r_full, ROW_BYTES)
            for sub in range(NSUB):
                H.tma_load_4d(base + RA_OFF + sub * SUB_R, H.global_address(t_ra), 64 * sub, r0, row_head, b1, r_full)
                H.tma_load_4d(base + RB_OFF + sub * SUB_R, H.global_address(t_rb), 64 * sub, r0, row_head, b1, r_full)
            load_columns(base, t_ca, t_cb, full, 0, c * BC, column_head(b2_first, gi, group), b1)
            if total > 1:
                load_columns(base, t_ca, t_cb, full, 1, c1 * BC, column_head(b2_first, gi1, group), b1)
        which = tid >> 6                             # dK/dV stats: thread tid < 128 moves one value
        if DKDV and tid < 2 * BC:
            if total > 0:
                smf[stf + tid] = st[b1, b2_first + gi, which, c * BC + (tid & 63)]
            if total > 1:
                smf[stf + 2 * BC + tid] = st[b1, b2_first + gi1, which, c1 * BC + (tid & 63)]
        lse0, lse1, delta0, delta1 = ZERO, ZERO, ZERO, ZERO
        if not DKDV:                                 # this thread's two query rows (padding: +inf, P = 0)
            lse0 = st[b1, b2_first, 0, min(row0, st.shape[3] - 1)]
            lse1 = st[b1, b2_first, 0, min(row0 + 8, st.shape[3] - 1)]
            delta0 = st[b1, b2_first, 1, min(row0, st.shape[3] - 1)]
            delta1 = st[b1, b2_first, 1, min(row0 + 8, st.shape[3] - 1)]
        cuda.syncthreads()                           # the first stats are in shared memory

        s = cuda.local.array(NS, numba.float32)
        dp = cuda.local.array(NS, numba.float32)
        gr = cuda.local.array(NS, numba.float32)
        ps = cuda.local.array(NP, numba.uint32)
        ds = cuda.local.array(NP, numba.uint32)
        a0, a1, b0_, b1_ = zeros(), zeros(), zeros(), zeros()   # dK (or dQ) and dV, two 64-column halves each
        if total > 0:
            wait_phase(r_full, 0)
        for it in range(total):
            slot = it & 1
            gi2, jc2 = column_next(slopes, b1, b2_first, rt, n_rt, n_all, n_ct, G, gi1, jc1)
            c2 = c_start
            sv = ZERO
            if it + 2 < total:
                c2 = column_at(slopes, b1, b2_first, rt, n_rt, n_all, c_start, gi2, jc2)
                if DKDV and tid < 2 * BC:            # tile it + 2's stats, stored after this tile
                    sv = st[b1, b2_first + gi2, which, c2 * BC + (tid & 63)]
            c0 = c * BC
            b2q = b2_first + gi if DKDV else b2_first   # the query head of this tile
            sc = column_consts(slopes, b1, b2_first, rt, n_rt, n_all, gi, jc,
                               score_consts(scale_log2, cap_in, cap_out, slopes, b1, b2q))
            ca_at = base + CA_OFF + slot * NSUB * SUB_C
            cb_at = base + CB_OFF + slot * NSUB * SUB_C
            wait_phase(full + 8 * slot, (it >> 1) & 1)
            H.wgmma_fence()
            acc_s = row_product(ra_at, ca_at)
            H.wgmma_commit()
            acc_dp = row_product(rb_at, cb_at)
            H.wgmma_commit()
            wait1()                                  # S done
            H.to_array(acc_s, s)

            # ---- P = exp2(score − lse): this thread's rows row0 + 8 h, columns c0 + 8 (i >> 2) + 2 tq4 + (i & 1)
            if DKDV:
                masked = tile_needs_mask(c0, BC, r0, BR, geo)
            else:
                masked = tile_needs_mask(r0, BR, c0, BC, geo) or block_tile(slopes, b1, b2q, r0 // BR, c0, BC)
            # ALiBi: score i's distance (query + diag − key) is af + distance_offset(i), and
            # P = exp2(score − (lse + slope·|distance|)). (The forward's split of one-sided
            # tiles into row and key parts made ptxas spill the dK/dV kernel's loop-invariant
            # descriptors at d = 128; this form does not.)
            af = F32(c0 + 2 * tq4 + diag - row0) if DKDV else F32(row0 + diag - c0 - 2 * tq4)
            for i in range(NS):
                lse_e = stat_at(smf, stf + slot * 2 * BC, i, tq4, lse0, lse1)
                if ALIBI:
                    lse_e = cuda.fma(sc[3], abs(af + distance_offset(i)), lse_e)
                s[i], gr[i] = probability(s[i], row0 + 8 * ((i >> 1) & 1), c0 + 8 * (i >> 2) + 2 * tq4 + (i & 1),
                                          lse_e, masked, geo, diag, sc, slopes, b1, b2q)
            for k in range(NP):
                ps[k] = pack(s[2 * k], s[2 * k + 1])
            if DKDV:                                 # dV += Pᵀ dO while dS is computed
                H.wgmma_fence()
                b0_, b1_ = column_product(b0_, b1_, ps, cb_at)
                H.wgmma_commit()
                if dv_early:
                    wait1()                          # dP done (dV may still run)
                else:
                    wait0()
            else:
                wait0()
            H.to_array(acc_dp, dp)

            # ---- dS = P ∘ (dP − delta) ∘ softcap′, then dK += dSᵀ Q (dQ += dS K) -----------
            for i in range(NS):
                dp[i] = s[i] * (dp[i] - stat_at(smf, stf + slot * 2 * BC + BC, i, tq4, delta0, delta1)) * gr[i]
            for k in range(NP):
                ds[k] = pack(dp[2 * k], dp[2 * k + 1])
            H.wgmma_fence()
            a0, a1 = column_product(a0, a1, ds, ca_at)
            H.wgmma_commit()
            wait0()
            cuda.syncthreads()                       # both warpgroups are done with the stage
            if it + 2 < total:
                if tid == 0:
                    load_columns(base, t_ca, t_cb, full, slot, c2 * BC, column_head(b2_first, gi2, group), b1)
                if DKDV and tid < 2 * BC:
                    smf[stf + slot * 2 * BC + tid] = sv
            gi, jc, c = gi1, jc1, c1
            gi1, jc1, c1 = gi2, jc2, c2

        # ---- epilogue: dK = scale · a, dV = b   |   dQ = scale · a ---------------------------------
        store_rows(ga, b1, row_head, row0, n_rows, a0, a1, scale, scale, tq4)
        if DKDV:
            store_rows(gb, b1, row_head, row0, n_rows, b0_, b1_, ONE, ONE, tq4)

    backward.smem_bytes = smem_bytes(D)
    return backward
