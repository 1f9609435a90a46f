"""FlashAttention-2 backward on CUDA cores (float32 and float64), deterministic.

Given the forward's ``lse`` (natural-log row log-sum-exp), P is recomputed tile by tile
and never stored whole:

    delta_i = Σ_f dO[i, f] · O[i, f]                     (pre-pass, ``make_delta``)
    P       = exp(scale · Q Kᵀ − lse)                     (masked entries: 0)
    dV      = Pᵀ dO
    dP      = dO Vᵀ
    dS      = P ∘ (dP − delta)
    dQ      = scale · dS K
    dK      = scale · dSᵀ Q

Two kernels, from one factory, each owning the rows it accumulates so that no two
blocks ever write the same element (no atomics: bitwise reproducible):

* ``dkdv``: a block owns ``R`` keys. It keeps K and V for them (and its dK, dV
  accumulators in registers) and loops over query tiles of ``C`` rows, computing the
  transposed tiles ``Pᵀ = exp(scale · K Qᵀ − lse)`` and ``dPᵀ = V dOᵀ``.
* ``dq``: a block owns ``R`` queries. It keeps Q and dO and loops over key tiles of
  ``C`` keys computing P, dP, dS and dQ += dS K.

Both are the same computation with the roles of the two operand pairs swapped:
*row* operands (``RA``, ``RB``) belong to the block's rows, *column* operands
(``CA``, ``CB``) are streamed, ``S = RA CAᵀ`` and ``dP = RB CBᵀ``.

Thread layout, head-dim chunks (``DK``) and output slices (``DO``, grid axis y) follow
the forward (see ``forward.py`` and ``tiles.py``). When the head dim fits in one chunk
and one slice ("tile mode", every d <= 256 in the registry) the row operands stay in
shared memory for the whole loop and the second products read the column tiles in
place; otherwise each chunk is streamed and the slices are loaded separately.
"""
import functools
import math

import numba
import numpy as np
from numba import cuda

from .. import ops, warp
from .._runtime import SIMULATOR
from ..scores import (LOG2E, SOFTCAP_TANH, ScoreSpec, block_key_lists, block_query_lists, block_row_rules, block_rules,
                      device_rules, has_lists)
from . import tiles
from .forward import Tiling
from .tiles import PAD

KINDS = ("dkdv", "dq")
ZERO32 = np.float32(0)


def _same(x):
    return x


def make_block_place(dkdv: bool, R: int, C: int, key_range, query_range, scores: ScoreSpec):
    """``place(block, B1, B2, Nq, group, geo, slopes)`` for a backward kernel: ``(b1, b2_first, r0,
    c_start, n_ct)``, the leading index and first query head of block ``block``, its
    first row ``r0`` (``R`` rows: keys for dK/dV, queries for dQ) and its column tiles
    ``c_start .. c_start + n_ct − 1`` of ``C`` columns (the others see none of its rows).
    dK/dV blocks of grouped K/V heads take ``group`` query heads each; the heaviest row
    tiles come first (early key tiles, late query tiles). A block mask narrows a dQ block's
    keys and a dK/dV block's queries (``scores.block_rules``; for grouped heads the union
    over the group)."""
    block_keys, block_queries = block_rules(scores)
    BLOCKS = scores.mods is not None and scores.mods.blocks

    def place(block, B1, B2, Nq, group, geo, slopes):
        BG = B2 // group                # blocks per b1 along B2: each takes `group` of them
        B = B1 * BG
        bt = block // B
        b = block - bt * B
        b1 = b // BG
        if dkdv:
            r0 = bt * R
            c_begin, c_stop = query_range(r0, R, Nq, geo)
            if BLOCKS:
                lo, hi = Nq, 0
                for gi in range(group):
                    a, z = block_queries(slopes, b1, (b - b1 * BG) * group + gi, bt, c_begin, c_stop)
                    lo, hi = min(lo, a), max(hi, z)
                c_begin, c_stop = lo, hi
        else:
            r0 = ((Nq + R - 1) // R - 1 - bt) * R
            c_begin, c_stop = key_range(r0, R, geo)
            c_begin, c_stop = block_keys(slopes, b1, b - b1 * BG, r0 // R, c_begin, c_stop)
        c_start = c_begin // C
        return b1, (b - b1 * BG) * group, r0, c_start, max((max(c_stop, 0) + C - 1) // C - c_start, 0)
    return place if SIMULATOR else cuda.jit(device=True, inline="always")(place)


def make_tile_rules(dkdv: bool, dtype_name: str, scores: ScoreSpec, R: int, C: int):
    """The score rules as a tensor-core backward kernel (``backward_mma``, ``backward_wgmma``;
    ``R`` rows per block, ``C`` columns per tile) uses them: ``(place, (column_total,
    column_next, column_at, column_consts), probability, tile_needs_mask, block_tile,
    score_consts)`` (:func:`make_block_place`, :func:`make_column_tiles`,
    :func:`make_probability`, ``device_rules``, ``block_row_rules``). dQ blocks mask by an
    exact block mask's row runs (dK/dV blocks call ``mask_mod``)."""
    row_keys, in_row, key_range, query_range, tile_needs_mask, score, score_consts = device_rules(
        scores, "float32", SOFTCAP_TANH[dtype_name], block_rows=not dkdv)
    place = make_block_place(dkdv, R, C, key_range, query_range, scores)
    # (the full tiles' flag left the mma.sync dQ kernel's score loop rolled, its tiles in
    # local memory: a 256-byte stack, measured offline; its full tiles call mask_mod)
    columns = make_column_tiles(dkdv, scores, full_tiles=dkdv)
    block_rows, block_tile = block_row_rules(scores)
    probability = make_probability(dkdv, score, row_keys, in_row, block_rows)
    return place, columns, probability, tile_needs_mask, block_tile, score_consts


def make_probability(dkdv: bool, score, row_keys, in_row, block_rows):
    """``probability(x, row, col, lse_log2, masked, geo, diag, sc, slopes, b1, b2)``: ``(P,
    d score)`` of the raw product ``x`` of block row ``row`` and column ``col`` (dK/dV: a
    key and a query; dQ: a query and a key), ``P = exp2(score − lse_log2)``, 0 where the
    rules hide the pair (checked only in ``masked`` tiles; dQ: with an exact block mask's
    row runs too), for the tensor-core backward kernels (``device_rules``' functions and
    ``block_row_rules``' ``block_rows``)."""
    def probability(x, row, col, lse_log2, masked, geo, diag, sc, slopes, b1, b2):
        if dkdv:                            # row = key, col = query
            y, grad = score(x, col, row, diag, sc)
        else:                               # row = query, col = key
            y, grad = score(x, row, col, diag, sc)
        p = ops.exp2_approx(y - lse_log2)   # 0 for padding and key-less queries (lse +inf)
        if masked:
            if dkdv:
                lo, hi = row_keys(col, geo)
                seen = in_row(row, lo, hi)
            else:
                lo, hi = row_keys(row, geo)
                lo, hi = block_rows(slopes, b1, b2, row, lo, hi)
                seen = in_row(col, lo, hi)
            if not seen:
                p = ZERO32
        return p, grad
    return probability if SIMULATOR else cuda.jit(device=True, inline="always")(probability)


def make_column_tiles(dkdv: bool, scores: ScoreSpec, full_tiles: bool = True):
    """``(column_total, column_next, column_at, column_consts)``: the column tiles a
    block visits, per query head ``b2_first + gi`` of its group (one head but for the dK/dV
    of grouped heads): ``place``'s range ``c_start .. c_start + n_ct − 1``, or with a block
    mask that is not exact its list for the block's row tile (dQ: the query tile's key
    tiles, ``scores.block_key_lists``; dK/dV: the key tile's query tiles,
    ``scores.block_query_lists``), the empty tiles skipped and the full ones scored without
    ``mask_mod`` (``full_tiles`` False: they call it too). Each function takes ``slopes,
    b1, b2_first, rt, n_rt, n_all``: the block's leading index, first head and row tile,
    how many row and column tiles there are; ``(gi, jc)`` is head ``gi``'s ``jc``-th tile:

    * ``column_total(..., n_ct, group)``: how many tiles the block visits;
    * ``column_next(..., n_ct, group, gi, jc)``: the one after ``(gi, jc)`` (after ``(0, −1)``:
      the first);
    * ``column_at(..., c_start, gi, jc)``: its index;
    * ``column_consts(..., gi, jc, sc)``: the score constants ``sc`` for its scores."""
    count, at, consts = (block_query_lists if dkdv else block_key_lists)(scores)
    LISTS = has_lists(scores)           # (else every head has the n_ct tiles of the range)

    def column_total(slopes, b1, b2_first, rt, n_rt, n_all, n_ct, group):
        total = 0
        for gi in range(group):
            total += count(slopes, b1, b2_first + gi, rt, n_rt, n_all, n_ct)
        return total

    def column_next(slopes, b1, b2_first, rt, n_rt, n_all, n_ct, group, gi, jc):
        jc += 1
        if not LISTS:
            if jc >= n_ct:
                return gi + 1, 0
            return gi, jc
        while gi < group and jc >= count(slopes, b1, b2_first + gi, rt, n_rt, n_all, n_ct):
            gi += 1
            jc = 0
        return gi, jc

    def column_at(slopes, b1, b2_first, rt, n_rt, n_all, c_start, gi, jc):
        return at(slopes, b1, b2_first + gi, rt, n_rt, n_all, c_start, jc)

    def column_consts(slopes, b1, b2_first, rt, n_rt, n_all, gi, jc, sc):
        if not full_tiles:
            return sc
        return consts(slopes, b1, b2_first + gi, rt, n_rt, n_all, jc, sc)

    fns = (column_total, column_next, column_at, column_consts)
    return fns if SIMULATOR else tuple(cuda.jit(device=True, inline="always")(f) for f in fns)


if not SIMULATOR:
    _same = cuda.jit(device=True, inline="always")(_same)


def _layout(d, t: Tiling, kind):
    """Shared-memory offsets (in elements) of one block; the last entry is the total."""
    nkc = -(-d // t.DK)
    tile_mode = nkc == 1 and t.DO >= d
    qs = (max(t.DK, t.DO) if tile_mode else t.DK) + PAD
    R, C = t.RG * t.TM, t.CG * t.TN
    ps = C + PAD
    off = {"RA": 0, "RB": R * qs}
    off["CA"] = 2 * R * qs
    off["CB"] = off["CA"] + C * qs
    off["P1"] = off["CB"] + C * qs
    end = off["P1"] + R * ps
    if kind == "dkdv":
        off["P2"] = end
        end += R * ps
    if not tile_mode:
        off["SA"] = end                 # slice of CA: (C × DO)
        end += C * t.DO
        if kind == "dkdv":
            off["SB"] = end             # slice of CB
            end += C * t.DO
    off["END"] = end
    return nkc, tile_mode, qs, ps, off


def smem_words(d, t: Tiling, kind):
    return _layout(d, t, kind)[-1]["END"]


@functools.lru_cache(maxsize=None)
def make_backward(kind: str, dtype_name: str, D: int, t: Tiling, scores: ScoreSpec, use_async: bool):
    """Build the ``dkdv`` or ``dq`` backward kernel for one specialisation.

    Arguments (4-D ``(B1, B2, N, D)`` views with any strides, 3-D ``(B1, B2, Nq)`` for
    lse/delta): ``q, k, v, dout, lse, delta, ga, gb, scale_log2, scale``, the score
    arguments ``left, right, cap_in, cap_out, slopes`` (see ``forward.make_forward``) and
    ``group``. ``dkdv`` writes ``ga = dK`` and ``gb = dV`` (rows are keys); ``dq`` writes
    ``ga = dQ`` and ignores ``gb``. Grouped K/V heads: ``k, v, ga, gb`` are views with
    stride 0 along B2, and a ``dkdv`` block sums over ``group`` consecutive query heads
    (``group = 1`` otherwise, and always for ``dq``). Launch with
    ``grid = (ceil(rows / R) · B1 · B2 / group, ceil(D / DO))``,
    ``block = RG · CG`` and ``smem_words(D, t, kind) · itemsize`` bytes.
    """
    assert kind in KINDS
    DKDV = kind == "dkdv"
    np_dt = np.dtype(dtype_name)
    nb_dt = numba.from_dtype(np_dt)
    TM, TN, CG, RG, DK, DO = t.TM, t.TN, t.CG, t.RG, t.DK, t.DO
    R, C, NT = RG * TM, CG * TN, RG * CG
    NKC, TILE_MODE, QS, PS, OFF = _layout(D, t, kind)
    TILE_COLS = QS - PAD                # columns copied per row in tile mode (zero beyond D)
    RA_OFF, RB_OFF, CA_OFF, CB_OFF, P1_OFF = OFF["RA"], OFF["RB"], OFF["CA"], OFF["CB"], OFF["P1"]
    P2_OFF = OFF.get("P2", 0)
    SA_OFF = OFF.get("SA", CA_OFF)      # tile mode: the column tiles are the slices
    SB_OFF = OFF.get("SB", CB_OFF)
    S_STRIDE = QS if TILE_MODE else DO
    VO = DO // CG
    GB_SHAPE = (TM, VO) if DKDV else (1, 1)
    DT = np_dt.type
    ZERO, POS_INF, NEG_INF, LOG2E_T = DT(0), DT(np.inf), DT(-np.inf), DT(LOG2E)
    ALIGN = None if SIMULATOR else 16
    JIT = {} if SIMULATOR else {"launch_bounds": (NT, 1)}
    copy_tile, mm_abt, mm_pv = tiles.make_tile_ops(dtype_name, D, TM, TN, CG, NT, DK, DO, use_async)
    # dQ blocks mask by an exact block mask's row runs (dK/dV blocks call mask_mod)
    row_keys, in_row, key_range, query_range, _, score, score_consts = device_rules(scores, dtype_name,
                                                                                    block_rows=not DKDV)
    place = make_block_place(DKDV, R, C, key_range, query_range, scores)
    column_total, column_next, column_at, column_consts = make_column_tiles(DKDV, scores)
    block_rows, _ = block_row_rules(scores)
    LISTS = has_lists(scores)

    @cuda.jit(**JIT)
    def backward(q, k, v, dout, lse, delta, ga, gb, scale_log2, scale, left, right, cap_in, cap_out, slopes,
                 group):
        Nq = q.shape[2]
        Nk = k.shape[2]
        diag = Nk - Nq                  # bottom-right alignment (numba_flash.scores)
        geo = (Nk, diag, left, right)
        tid = cuda.threadIdx.x
        r = tid // CG
        c = tid - r * CG
        b1, b2_first, r0, c_start, n_ct = place(cuda.blockIdx.x, q.shape[0], q.shape[1], Nq, group, geo, slopes)
        b2 = b2_first
        d0 = cuda.blockIdx.y * DO
        # Operand roles (a compile-time choice): rows own the accumulators.
        if DKDV:
            ra, rb, ca, cb = k, v, q, dout
            n_rows, n_cols = Nk, Nq
        else:
            ra, rb, ca, cb = q, dout, k, v
            n_rows, n_cols = Nq, Nk
        rt, n_rt, n_all = r0 // R, (n_rows + R - 1) // R, (n_cols + C - 1) // C   # (row, column tiles)
        total = group * n_ct                # (without lists: every head's n_ct tiles of the range)
        gi, jc = 0, 0
        if LISTS:
            total = column_total(slopes, b1, b2_first, rt, n_rt, n_all, n_ct, group)
            gi, jc = column_next(slopes, b1, b2_first, rt, n_rt, n_all, n_ct, group, 0, -1)

        smem = cuda.shared.array(0, nb_dt, alignment=ALIGN)
        s = cuda.local.array((TM, TN), nb_dt)
        dp = cuda.local.array((TM, TN), nb_dt)
        acc_a = cuda.local.array((TM, VO), nb_dt)
        acc_b = cuda.local.array(GB_SHAPE, nb_dt)
        av = cuda.local.array((TM, 4), nb_dt)
        bv = cuda.local.array((TN, 4), nb_dt)
        vv = cuda.local.array(4, nb_dt)
        row_lse = cuda.local.array(TM, nb_dt)
        row_delta = cuda.local.array(TM, nb_dt)
        for i in range(TM):
            for f in range(VO):
                acc_a[i, f] = ZERO
                if DKDV:
                    acc_b[i, f] = ZERO
            if not DKDV:
                row = r0 + r * TM + i
                x = POS_INF             # padding rows and rows with no visible key: P = 0
                y = ZERO
                if row < Nq:
                    y = delta[b1, b2, row]
                    if lse[b1, b2, row] != NEG_INF:
                        x = lse[b1, b2, row] * LOG2E_T
                row_lse[i] = x
                row_delta[i] = y

        if TILE_MODE:                   # row operands stay in shared memory throughout
            copy_tile(smem, RA_OFF, QS, ra, b1, b2, r0, R, 0, TILE_COLS, n_rows, tid)
            copy_tile(smem, RB_OFF, QS, rb, b1, b2, r0, R, 0, TILE_COLS, n_rows, tid)

        # dK, dV of grouped K/V heads sum over the group's query heads b2_first ..
        # b2_first + group − 1, in order (group = 1 without grouping, and for dQ).
        for it in range(total):
            if not LISTS:
                gi = it // n_ct
                jc = it - gi * n_ct
            ct = column_at(slopes, b1, b2_first, rt, n_rt, n_all, c_start, gi, jc)
            b2 = b2_first + gi
            c0 = ct * C
            sc = column_consts(slopes, b1, b2_first, rt, n_rt, n_all, gi, jc,
                               score_consts(scale_log2, cap_in, cap_out, slopes, b1, b2))
            for i in range(TM):
                for j in range(TN):
                    s[i, j] = ZERO
                    dp[i, j] = ZERO
            # ---- S = RA CAᵀ and dP = RB CBᵀ, over head-dim chunks ----------------------
            for kc in range(NKC):
                if TILE_MODE:
                    copy_tile(smem, CA_OFF, QS, ca, b1, b2, c0, C, 0, TILE_COLS, n_cols, tid)
                    copy_tile(smem, CB_OFF, QS, cb, b1, b2, c0, C, 0, TILE_COLS, n_cols, tid)
                else:
                    col = kc * DK
                    copy_tile(smem, RA_OFF, QS, ra, b1, b2, r0, R, col, DK, n_rows, tid)
                    copy_tile(smem, RB_OFF, QS, rb, b1, b2, r0, R, col, DK, n_rows, tid)
                    copy_tile(smem, CA_OFF, QS, ca, b1, b2, c0, C, col, DK, n_cols, tid)
                    copy_tile(smem, CB_OFF, QS, cb, b1, b2, c0, C, col, DK, n_cols, tid)
                ops.cp_async_commit()
                ops.cp_async_wait(0)
                cuda.syncthreads()      # tiles written before any thread reads them
                mm_abt(smem, RA_OFF, CA_OFF, QS, s, av, bv, r, c)
                mm_abt(smem, RB_OFF, CB_OFF, QS, dp, av, bv, r, c)
                if NKC > 1:
                    cuda.syncthreads()  # chunk fully read before the next one overwrites it

            # ---- P = exp2(S·scale·log2e − lse·log2e), dS = P ∘ (dP − delta) -------------
            for j in range(TN):
                col = c0 + c + CG * j
                lse_j = POS_INF
                delta_j = ZERO
                if DKDV and col < Nq:
                    delta_j = delta[b1, b2, col]
                    if lse[b1, b2, col] != NEG_INF:
                        lse_j = lse[b1, b2, col] * LOG2E_T
                for i in range(TM):
                    row = r0 + r * TM + i
                    if DKDV:            # row = key, col = query
                        lo, hi = row_keys(col, geo)
                        seen = col < Nq and in_row(row, lo, hi)
                        x, grad = score(s[i, j], col, row, diag, sc)
                        lse_ij = lse_j
                        delta_ij = delta_j
                    else:               # row = query, col = key
                        lo, hi = row_keys(row, geo)
                        lo, hi = block_rows(slopes, b1, b2, row, lo, hi)
                        seen = in_row(col, lo, hi)
                        x, grad = score(s[i, j], row, col, diag, sc)
                        lse_ij = row_lse[i]
                        delta_ij = row_delta[i]
                    p = ZERO
                    if seen:
                        p = math.exp2(x - lse_ij)
                    ds = p * (dp[i, j] - delta_ij) * grad
                    if DKDV:
                        smem[P1_OFF + (r * TM + i) * PS + c + CG * j] = p
                        smem[P2_OFF + (r * TM + i) * PS + c + CG * j] = ds
                    else:
                        smem[P1_OFF + (r * TM + i) * PS + c + CG * j] = ds
            if not TILE_MODE:           # the DO-wide slices the second products read
                copy_tile(smem, SA_OFF, DO, ca, b1, b2, c0, C, d0, DO, n_cols, tid)
                if DKDV:
                    copy_tile(smem, SB_OFF, DO, cb, b1, b2, c0, C, d0, DO, n_cols, tid)
                ops.cp_async_commit()
                ops.cp_async_wait(0)
            cuda.syncthreads()          # P / dS tiles (and slices) complete before the products

            # ---- dV += Pᵀ dO, dK += dSᵀ Q   |   dQ += dS K ------------------------------
            if DKDV:
                mm_pv(smem, P1_OFF, PS, SB_OFF, S_STRIDE, acc_b, av, vv, r, c)
                mm_pv(smem, P2_OFF, PS, SA_OFF, S_STRIDE, acc_a, av, vv, r, c)
            else:
                mm_pv(smem, P1_OFF, PS, SA_OFF, S_STRIDE, acc_a, av, vv, r, c)
            cuda.syncthreads()          # all reads done before the next tile overwrites them
            if LISTS:
                gi, jc = column_next(slopes, b1, b2_first, rt, n_rt, n_all, n_ct, group, gi, jc)
        ops.cp_async_wait(0)            # nothing left in flight when the loop had no iteration

        # ---- epilogue: dK = scale · acc_a, dV = acc_b   |   dQ = scale · acc_a -----------
        for i in range(TM):
            row = r0 + r * TM + i
            if row < n_rows:
                for g in range(VO // 4):
                    for f in range(4):
                        col = d0 + 4 * (c + CG * g) + f
                        if col < D:
                            ga[b1, b2_first, row, col] = acc_a[i, 4 * g + f] * scale
                            if DKDV:
                                gb[b1, b2_first, row, col] = acc_b[i, 4 * g + f]

    backward.rows_per_block = R
    return backward


@functools.lru_cache(maxsize=None)
def make_delta(dtype_name: str, stats: bool = False):
    """``delta[b1, b2, i] = Σ_f dout[b1, b2, i, f] · out[b1, b2, i, f]``: one warp per row.

    float16 and bfloat16 arrays come as their ``uint16`` bits and sum in float32 (delta
    float32). Launch with ``grid = (ceil(rows / 8), B1 · B2)`` and 256 threads, ``rows``
    = Nq, or with ``stats`` the padded length ``st.shape[3]``.

    With ``stats`` (the tensor-core backward's pre-pass) the kernel is ``(dout, out, lse,
    st)`` and writes, for the ``st.shape[3] >= Nq`` rows of ``st (B1, B2, 2, ·)``, what the
    dK/dV tiles load beside Q and dO: ``st[.., 0, i] = lse · log2(e)`` (``+inf`` where lse
    is ``-inf``: a row that sees no key gets ``P = 0``) and ``st[.., 1, i] = delta``; rows
    past Nq get ``+inf`` and 0.
    """
    widen = {"bfloat16": ops.bf16_to_f32, "float16": ops.f16_to_f32}.get(dtype_name, _same)
    ZERO = (np.float32 if dtype_name in ("bfloat16", "float16") else np.dtype(dtype_name).type)(0)
    POS_INF, NEG_INF, LOG2E_T = numba.float32(math.inf), numba.float32(-math.inf), numba.float32(LOG2E)
    ROWS = 8                            # warps per block = rows per block

    def row_dot(dout, out):             # (b1, b2, row, lane): this lane's part of the row's sum, all lanes' total
        B2 = out.shape[1]
        b = cuda.blockIdx.y
        b1 = b // B2
        b2 = b - b1 * B2
        lane = cuda.threadIdx.x & 31
        row = cuda.blockIdx.x * ROWS + (cuda.threadIdx.x >> 5)
        acc = ZERO
        if row < out.shape[2]:
            for f in range(lane, out.shape[3], 32):
                acc += widen(dout[b1, b2, row, f]) * widen(out[b1, b2, row, f])
        for off in (16, 8, 4, 2, 1):    # every lane takes part, also on rows past the end
            acc += warp.shfl_xor_sync(warp.FULL_MASK, acc, off)
        return b1, b2, row, lane, acc
    row_dot = row_dot if SIMULATOR else cuda.jit(device=True, inline="always")(row_dot)

    if stats:
        @cuda.jit
        def delta_kernel(dout, out, lse, st):
            b1, b2, row, lane, acc = row_dot(dout, out)
            if lane == 0 and row < st.shape[3]:
                x = POS_INF
                if row < out.shape[2]:
                    if lse[b1, b2, row] != NEG_INF:
                        x = lse[b1, b2, row] * LOG2E_T
                else:
                    acc = ZERO
                st[b1, b2, 0, row] = x
                st[b1, b2, 1, row] = acc
    else:
        @cuda.jit
        def delta_kernel(dout, out, delta):
            b1, b2, row, lane, acc = row_dot(dout, out)
            if lane == 0 and row < out.shape[2]:
                delta[b1, b2, row] = acc

    delta_kernel.rows_per_block = ROWS
    return delta_kernel
