"""FlashAttention forward on Hopper (sm_90a): TMA, mbarriers and warpgroup MMA — first draft.

Not wired into the registry yet: it compiles and assembles for sm_90a without local memory
(``tests/test_hopper_ops.py``), and has not run on a GPU. The plan, the layouts it relies
on and what must be checked first: ``docs/hopper.md``.

One block: warpgroup 0 produces (one thread issues the TMA loads of Q once and of K, V
tiles into a ``STAGES``-deep ring; ``full`` mbarriers say a stage landed, ``empty`` ones
that the consumer is done with it), warpgroup 1 consumes: 64 query rows, per key tile
S = Q Kᵀ (``wgmma`` m64n64k16 from 128-byte-swizzled shared memory), the score rules and
the online softmax on the accumulator (in a local array the compiler keeps in registers),
O += P V with P from registers (``wgmma`` m64n64k16 per 64-column slice of d, V as a
transposed B). Scores, softmax and accumulation in float32; P rounded to the input dtype.

Arguments: the tensor maps of q, k, v (``ops_hopper.tensor_map_4d`` over the ``(B1, B2,
N, d)`` views: 64-row boxes for each), ``out (B1, B2, Nq, D)``
uint16, ``lse (B1, B2, Nq)`` float32, ``nk``, ``group`` (query heads per K/V head),
``scale_log2`` and the score arguments of ``forward.make_forward``. Launch with
``grid = ceil(Nq / 64) · B1 · B2``, 256 threads, :func:`smem_bytes` of dynamic shared memory.
"""
import functools
import math

import numba
from numba import cuda

from .. import ops, warp
from .. import ops_hopper as H
from ..scores import SOFTCAP_TANH, ScoreSpec, device_rules
from .forward import LN2

BM, BN, STAGES = 64, 64, 2
THREADS = 256


def _layout(D):
    nsub = D // 64                       # 64-column (128-byte) sub-tiles of d
    sub_q, sub_k = BM * 128, BN * 128
    q_off = 0
    k_off = q_off + nsub * sub_q
    v_off = k_off + STAGES * nsub * sub_k
    bar_off = v_off + STAGES * nsub * sub_k
    return nsub, sub_q, sub_k, q_off, k_off, v_off, bar_off


def smem_bytes(D):
    """Q, the K and V rings, the mbarriers, and room to align the base to 1024 bytes."""
    return _layout(D)[-1] + 8 * (1 + 2 * STAGES) + 1024


@functools.lru_cache(maxsize=None)
def make_forward_wgmma(dtype_name: str, D: int, scores: ScoreSpec):
    assert D in (64, 128), D
    NSUB, SUB_Q, SUB_K, Q_OFF, K_OFF, V_OFF, BAR_OFF = _layout(D)
    NS = BN // 2                         # S accumulator elements per thread
    s_mma = H.wgmma(BN, dtype_name)
    o_mma = H.wgmma(64, dtype_name, a_in_registers=True, trans_b=1)
    zeros_s, zeros_o = H.accumulator(BN), H.accumulator(64)
    desc = H.smem_descriptor(16, 1024, 1)
    give, take = H.setmaxnreg(40, False), H.setmaxnreg(232, True)
    wait0 = H.wgmma_wait(0)
    pack = ops.pack_bf16x2 if dtype_name == "bfloat16" else ops.pack_f16x2
    row_keys, in_row, key_range, _, tile_needs_mask, score, score_consts = device_rules(
        scores, "float32", SOFTCAP_TANH[dtype_name])
    F32 = numba.float32
    ZERO, NEG_INF, LN2_T = F32(0), F32(-math.inf), F32(LN2)

    @cuda.jit(launch_bounds=(THREADS, 1))
    def forward(tq, tk, tv, out, lse, nk, group, scale_log2, left, right, cap_in, cap_out, slopes):
        Nq = out.shape[2]
        B2 = out.shape[1]
        B = out.shape[0] * B2
        n_qt = (Nq + BM - 1) // BM
        qt = n_qt - 1 - cuda.blockIdx.x // B
        b = cuda.blockIdx.x - (cuda.blockIdx.x // B) * B
        b1 = b // B2
        b2 = b - b1 * B2
        q0 = qt * BM
        diag = nk - Nq
        geo = (nk, diag, left, right)
        kv_begin, kv_end = key_range(q0, BM, geo)
        kt0 = kv_begin // BN
        tiles = max((max(kv_end, 0) + BN - 1) // BN - kt0, 0)

        sm = cuda.shared.array(0, numba.uint8, alignment=1024)
        tid = cuda.threadIdx.x
        base = (H.shared_address(sm) + 1023) & ~1023
        q_full = base + BAR_OFF
        if tid == 0:
            H.mbarrier_init(q_full, 1)
            for st in range(STAGES):
                H.mbarrier_init(q_full + 8 + 8 * st, 1)                # full[st]: the producer's expect_tx
                H.mbarrier_init(q_full + 8 + 8 * STAGES + 8 * st, 1)   # empty[st]: the consumer's arrival
            H.fence_mbarrier_init()
        cuda.syncthreads()

        if tid < 128:                    # ---- producer warpgroup ---------------------------------
            give()
            if tid == 0:
                H.tensormap_acquire(H.global_address(tq))
                H.tensormap_acquire(H.global_address(tk))
                H.tensormap_acquire(H.global_address(tv))
                H.mbarrier_arrive_expect_tx(q_full, NSUB * SUB_Q)
                for sub in range(NSUB):
                    H.tma_load_4d(base + Q_OFF + sub * SUB_Q, H.global_address(tq), 64 * sub, q0, b2, b1, q_full)
                b2k = b2 // group
                for j in range(tiles):
                    st = j % STAGES
                    full = q_full + 8 + 8 * st
                    if j >= STAGES:      # wait for the consumer to release the stage's previous use
                        while H.mbarrier_try_wait(full + 8 * STAGES, ((j // STAGES) - 1) & 1) == 0:
                            pass
                    H.mbarrier_arrive_expect_tx(full, 2 * NSUB * SUB_K)
                    k0 = (kt0 + j) * BN
                    for sub in range(NSUB):
                        at = (st * NSUB + sub) * SUB_K
                        H.tma_load_4d(base + K_OFF + at, H.global_address(tk), 64 * sub, k0, b2k, b1, full)
                        H.tma_load_4d(base + V_OFF + at, H.global_address(tv), 64 * sub, k0, b2k, b1, full)
            return

        # ---- consumer warpgroup: 64 query rows --------------------------------------------------
        take()
        ct = tid - 128
        w = ct >> 5
        g = (ct & 31) >> 2
        tq4 = ct & 3
        row0 = q0 + 16 * w + g                 # this thread's two rows: row0 and row0 + 8
        sc = score_consts(scale_log2, cap_in, cap_out, slopes, b1, b2)
        s = cuda.local.array(NS, numba.float32)
        m0, m1, l0, l1 = NEG_INF, NEG_INF, ZERO, ZERO     # per row (row0, row0 + 8): max, partial sum
        o0 = zeros_o()
        o1 = zeros_o()
        while H.mbarrier_try_wait(q_full, 0) == 0:
            pass
        for j in range(tiles):
            st = j % STAGES
            full = q_full + 8 + 8 * st
            while H.mbarrier_try_wait(full, (j // STAGES) & 1) == 0:
                pass
            k0 = (kt0 + j) * BN
            k_at = base + K_OFF + st * NSUB * SUB_K
            v_at = base + V_OFF + st * NSUB * SUB_K

            # S = Q Kᵀ: 16 columns of d per product, 4 per 64-column sub-tile (32 bytes apart)
            H.wgmma_fence()
            acc = zeros_s()
            for ks in range(D // 16):
                within = 32 * (ks % 4)
                acc = s_mma(acc, desc(base + Q_OFF + (ks // 4) * SUB_Q + within),
                            desc(k_at + (ks // 4) * SUB_K + within), 1 if ks > 0 else 0)
            H.wgmma_commit()
            wait0()
            for i in range(NS):
                s[i] = acc[i]

            # scores in log2 units, masks, online softmax (two rows per thread, a quad per row);
            # one flat loop each, small enough for the compiler to unroll (s stays in registers)
            for i in range(NS):
                s[i], _ = score(s[i], row0 + 8 * ((i >> 1) & 1), k0 + 8 * (i >> 2) + 2 * tq4 + (i & 1), diag, sc)
            if tile_needs_mask(q0, BM, k0, BN, geo):
                lo0, hi0 = row_keys(row0, geo)
                lo1, hi1 = row_keys(row0 + 8, geo)
                for i in range(NS):
                    col = k0 + 8 * (i >> 2) + 2 * tq4 + (i & 1)
                    seen = in_row(col, lo1, hi1) if (i >> 1) & 1 else in_row(col, lo0, hi0)
                    if not seen:
                        s[i] = NEG_INF
            mx0, mx1 = NEG_INF, NEG_INF
            for i in range(NS):
                if (i >> 1) & 1:
                    mx1 = max(mx1, s[i])
                else:
                    mx0 = max(mx0, s[i])
            for off in (1, 2):
                mx0 = max(mx0, warp.shfl_xor_sync(warp.FULL_MASK, mx0, off))
                mx1 = max(mx1, warp.shfl_xor_sync(warp.FULL_MASK, mx1, off))
            mn0, mn1 = max(m0, mx0), max(m1, mx1)
            mu0 = ZERO if mn0 == NEG_INF else mn0     # a row with no visible key yet: against 0
            mu1 = ZERO if mn1 == NEG_INF else mn1
            alpha0, alpha1 = ops.exp2_approx(m0 - mu0), ops.exp2_approx(m1 - mu1)
            m0, m1 = mn0, mn1
            rs0, rs1 = ZERO, ZERO
            for i in range(NS):
                if (i >> 1) & 1:
                    p = ops.exp2_approx(s[i] - mu1)
                    rs1 += p
                else:
                    p = ops.exp2_approx(s[i] - mu0)
                    rs0 += p
                s[i] = p
            l0 = l0 * alpha0 + rs0
            l1 = l1 * alpha1 + rs1
            o0 = H.scale_rows(o0, alpha0, alpha1)
            o1 = H.scale_rows(o1, alpha0, alpha1)

            # O += P V: P's elements 8t .. 8t + 7 are the A operand of keys 16t .. 16t + 15
            H.wgmma_fence()
            for t in range(BN // 16):
                a0, a1 = pack(s[8 * t], s[8 * t + 1]), pack(s[8 * t + 2], s[8 * t + 3])
                a2, a3 = pack(s[8 * t + 4], s[8 * t + 5]), pack(s[8 * t + 6], s[8 * t + 7])
                o0 = o_mma(o0, a0, a1, a2, a3, desc(v_at + 2048 * t), 1)
                if NSUB == 2:
                    o1 = o_mma(o1, a0, a1, a2, a3, desc(v_at + SUB_K + 2048 * t), 1)
            H.wgmma_commit()
            wait0()
            H.named_barrier(1, 128)         # every consumer thread is done with the stage
            if ct == 0:
                H.mbarrier_arrive(full + 8 * STAGES)

        # ---- epilogue: O /= l, lse = (m + log2 l) ln 2 ---------------------------------------
        for off in (1, 2):
            l0 += warp.shfl_xor_sync(warp.FULL_MASK, l0, off)
            l1 += warp.shfl_xor_sync(warp.FULL_MASK, l1, off)
        inv0 = ZERO if l0 == ZERO else F32(1) / l0   # no visible key: 0, lse -inf
        inv1 = ZERO if l1 == ZERO else F32(1) / l1
        for i in range(0, 32, 2):                   # elements i, i + 1: one row, two columns
            h = (i >> 1) & 1
            row = row0 + 8 * h
            inv = inv1 if h else inv0
            if row < Nq:
                col = 8 * (i >> 2) + 2 * tq4
                bits = pack(o0[i] * inv, o0[i + 1] * inv)
                out[b1, b2, row, col] = numba.uint16(bits & 0xFFFF)
                out[b1, b2, row, col + 1] = numba.uint16(bits >> 16)
                if NSUB == 2:
                    bits = pack(o1[i] * inv, o1[i + 1] * inv)
                    out[b1, b2, row, 64 + col] = numba.uint16(bits & 0xFFFF)
                    out[b1, b2, row, 64 + col + 1] = numba.uint16(bits >> 16)
        if tq4 == 0:
            if row0 < Nq:
                lse[b1, b2, row0] = NEG_INF if l0 == ZERO else (m0 + math.log2(l0)) * LN2_T
            if row0 + 8 < Nq:
                lse[b1, b2, row0 + 8] = NEG_INF if l1 == ZERO else (m1 + math.log2(l1)) * LN2_T

    forward.smem_bytes = smem_bytes(D)
    return forward
