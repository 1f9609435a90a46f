"""Pieces the Hopper kernels share (``forward_wgmma``, ``backward_wgmma``).

Operand tiles live in shared memory as 64-column sub-tiles of 128-byte rows with the
128-byte swizzle the TMA writes (``ops_hopper.tensor_map_4d``): sub-tile ``s`` of a tile
of ``rows`` rows starts ``s · rows · 128`` bytes after the first, and a 16-column k-step
is 32 bytes along a row. Products are issued here and completed by the caller
(``wgmma_commit``, ``wgmma_wait``).
"""
import functools

import numba
from numba import cuda

from .. import ops, warp
from .. import ops_hopper as H

SUB = 128                         # bytes per swizzled row: 64 columns of d per sub-tile
DESC = H.smem_descriptor(16, 1024, 1)   # 128-byte swizzle, 8-row groups 1024 bytes apart
# D = 128: a column product's B (MN-major) spans both 64-column sub-tiles in one m64n128k16
# per 16 keys, rather than one m64n64k16 per sub-tile (False: the two narrow products)
WIDE_COLUMNS = True


def padded(d):
    """The kernels' head dim for a call's ``d``: 64, 128 or 256. The columns between are
    zeros: the TMA fills a box's columns past the rows' end with zeros, which add nothing to
    a product over d and give output columns that are not stored (``make_store_rows``'
    ``cols``)."""
    return 64 if d <= 64 else 128 if d <= 128 else 256


def half_columns(D):
    """The columns of each of the two accumulators ``o0, o1`` that hold a 64 × ``D`` output
    (``o1`` unused at ``D = 64``): 64, or 128 at ``D = 256``."""
    return 128 if D == 256 else 64


def o_columns(D, cols=None):
    """The columns of ``o0`` and ``o1`` for an output of ``cols`` columns (None: ``D``) in
    the kernel of head dim ``D``: :func:`half_columns` each, but at ``D = 256`` with at most
    192 columns, 128 and 64 (P V then one m64n192k16 a k-step over three whole 64-column
    atoms: the fourth holds only zero columns, whose products are not stored)."""
    if D == 256 and cols is not None and cols <= 192:
        return 128, 64
    return half_columns(D), half_columns(D)


def consumer_registers(producer, threads, producer_threads=128):
    """The registers per thread that a block's consumer warpgroups can take
    (``setmaxnreg.inc``) once its producer warpgroup (``producer_threads`` threads) keeps
    ``producer``. The pool is what the block got at launch: ``launch_bounds(threads, 1)``
    gives each thread 65536 / threads registers rounded down to a multiple of 8 (384
    threads: 168, a pool of 64512, not the 65536 of the register file), and an increase
    beyond the pool does not fail: it waits for registers that never come free (the
    kernel hangs). 384 threads: producer 24 -> 240, producer 32 or 40 -> 232."""
    pool = 65536 // threads // 8 * 8 * threads
    return min(256, (pool - producer * producer_threads) // (threads - producer_threads) // 8 * 8)


@cuda.jit(device=True, inline=True)
def wait_phase(bar, parity):
    """Wait until the mbarrier at shared address ``bar`` has completed phase ``parity``."""
    while H.mbarrier_try_wait(bar, parity) == 0:
        pass


@functools.lru_cache(maxsize=None)
def make_row_product(dtype_name: str, D: int, n: int, sub_a: int, sub_b: int, cols: int = None):
    """``product(a_at, b_at)``: issue the 64 × ``n`` float32 accumulator of ``A Bᵀ`` over the
    head dim ``D`` (64, 128 or 256): A's 64 rows at shared address ``a_at``, B's ``n`` rows at
    ``b_at``, their later sub-tiles (``D >= 128``) every ``sub_a`` and ``sub_b`` bytes on. Both
    operands are K-major (rows along d): S = Q Kᵀ, dP = dO Vᵀ and their transposes. With
    ``cols`` (the operands' columns past it zeros, as the TMA fills them) only the k-steps of
    16 columns that reach below ``cols``: the same sums (a zero product adds exactly 0)."""
    mma = H.wgmma(n, dtype_name)
    zeros = H.accumulator(n)
    desc = DESC
    STEPS = D // 16 if cols is None else -(-min(cols, D) // 16)      # k-steps of 16 columns issued
    S0, S1, S2, S3 = (min(max(STEPS - 4 * s, 0), 4) for s in range(4))   # those of each sub-tile

    @cuda.jit(device=True, inline=True)
    def sub_tile(acc, a_at, b_at, accumulate, steps):
        """The first ``steps`` (1-4, a constant) k-steps of one sub-tile, written out: a
        loop of these large instructions is not unrolled."""
        acc = mma(acc, desc(a_at), desc(b_at), accumulate)
        if steps >= 2:
            acc = mma(acc, desc(a_at + 32), desc(b_at + 32), 1)
        if steps >= 3:
            acc = mma(acc, desc(a_at + 64), desc(b_at + 64), 1)
        if steps >= 4:
            acc = mma(acc, desc(a_at + 96), desc(b_at + 96), 1)
        return acc

    @cuda.jit(device=True, inline=True)
    def product(a_at, b_at):
        acc = sub_tile(zeros(), a_at, b_at, 0, S0)
        if S1 > 0:
            acc = sub_tile(acc, a_at + sub_a, b_at + sub_b, 1, S1)
        if S2 > 0:
            acc = sub_tile(acc, a_at + 2 * sub_a, b_at + 2 * sub_b, 1, S2)
        if S3 > 0:
            acc = sub_tile(acc, a_at + 3 * sub_a, b_at + 3 * sub_b, 1, S3)
        return acc
    return product


@functools.lru_cache(maxsize=None)
def make_column_product(dtype_name: str, D: int, n_k: int, sub_b: int, cols: int = None):
    """``product(o0, o1, p, b_at)``: issue ``O += P B`` for a 64 × ``D`` accumulator held as
    two halves ``o0, o1`` (:func:`half_columns` each; ``o1`` unused at ``D = 64``): ``P`` (64 × ``n_k``) in
    packed registers, ``p[4 t] .. p[4 t + 3]`` the A operand of k-step ``t`` (an
    accumulator's columns ``16 t .. 16 t + 15`` in pairs), B's ``n_k`` rows (the k dim) at
    shared address ``b_at``, MN-major (rows along d, read transposed), its second
    sub-tile ``sub_b`` bytes on. O += P V, dQ += dS K, dK += dSᵀ Q, dV += Pᵀ dO.

    At ``D = 128`` each k-step is one m64n128k16 (:data:`WIDE_COLUMNS`): an MN-major
    descriptor's leading byte offset (LBO) is the distance between its 64-element atoms
    along N, here the two sub-tiles, so one product reads both; its accumulator is ``o0``'s
    32 registers then ``o1``'s (columns 0-63, then 64-127). A is read once per k-step
    instead of twice. At ``D = 256`` each k-step is one m64n256k16 over the four sub-tiles
    (``o0`` columns 0-127, ``o1`` 128-255, 64 registers each), or with ``cols`` at most 192
    one m64n192k16 (``o1`` columns 128-191, 32 registers: :func:`o_columns`)."""
    C0, C1 = o_columns(D, cols)
    mma = H.wgmma(64, dtype_name, a_in_registers=True, trans_b=1)
    wide = H.wgmma(C0 + C1 if D == 256 else D, dtype_name, a_in_registers=True, trans_b=1)   # (D = 64: unused)
    desc = DESC
    wide_desc = H.smem_descriptor(sub_b, 1024, 1)
    WIDE = D == 256 or D == 128 and WIDE_COLUMNS
    HALF = C0 // 2                        # accumulator registers of o0

    @cuda.jit(device=True, inline=True)
    def product(o0, o1, p, b_at):
        if WIDE:
            o = o0 + o1
            for t in range(n_k // 16):
                o = wide(o, p[4 * t], p[4 * t + 1], p[4 * t + 2], p[4 * t + 3], wide_desc(b_at + 2048 * t), 1)
            return o[:HALF], o[HALF:]
        for t in range(n_k // 16):
            o0 = mma(o0, p[4 * t], p[4 * t + 1], p[4 * t + 2], p[4 * t + 3], desc(b_at + 2048 * t), 1)
            if D == 128:
                o1 = mma(o1, p[4 * t], p[4 * t + 1], p[4 * t + 2], p[4 * t + 3], desc(b_at + sub_b + 2048 * t), 1)
        return o0, o1
    return product


@functools.lru_cache(maxsize=None)
def make_row_stored(from_zero: bool = False):
    """``stored(row, n_rows)``: whether an item's row ``row`` is written out (O and lse):
    below ``n_rows``, and with ``from_zero`` at least 0 (query tiles aligned to the
    sequence's end: the first tile's rows before it are not the call's)."""
    @cuda.jit(device=True, inline=True)
    def stored(row, n_rows):
        return row < n_rows and (not from_zero or row >= 0)
    return stored


@functools.lru_cache(maxsize=None)
def make_store_rows(dtype_name: str, D: int, cols: int = None, rows_first: bool = False, from_zero: bool = False):
    """``store_rows(out, b1, b2, row0, n_rows, o0, o1, inv0, inv1, tq4)``: a thread's part of
    a 64 × ``D`` accumulator (two halves ``o0, o1`` of :func:`half_columns` each; ``o1``
    unused at ``D = 64``)
    into rows ``row0`` (times ``inv0``) and ``row0 + 8`` (times ``inv1``) of ``out[b1,
    b2]``, a uint64 view of four 16-bit values per element (``_arrays.packed_view``), rows
    from ``n_rows`` on left out, and columns from ``cols`` on where the output has fewer
    than ``D`` (a multiple of 4). Every lane of the warp calls it (it shuffles). With
    ``rows_first`` ``out`` is ``(B1, rows, B2, ·)`` and row ``r`` of head ``b2`` is
    ``out[b1, r, b2]``: packed sequences' ``(tokens, heads, d)`` output as a C-contiguous
    array, whose column offsets the compiler folds into the stores (a view of it with the
    heads first has a stride it only knows at run time: about twelve instructions of 64-bit
    address arithmetic per 8-byte store). With ``from_zero`` rows before 0 are left out too
    (query tiles aligned to the sequence's end: the first tile's rows before it).

    The accumulator gives a lane two adjacent columns of each 8-column block (lane
    ``tq4`` of a quad: columns ``2 tq4, 2 tq4 + 1``), so storing them as they are writes 16
    bytes of a row per warp instruction: half of each 32-byte sector (half the memory
    transactions wasted; docs/performance.md item 71). Lanes ``tq4`` and ``tq4 ^ 1`` swap one
    pair per two blocks ``2u, 2u + 1`` instead: the even lane keeps block ``2u``'s four
    columns, the odd lane block ``2u + 1``'s, and a quad writes 32 contiguous bytes of its
    row with one 8-byte store per lane. Short loops with constant bounds, so that every
    accumulator index is a constant (a rolled loop picked registers by branching: item 34)."""
    pack = ops.pack_bf16x2 if dtype_name == "bfloat16" else ops.pack_f16x2
    QUADS = (D if cols is None else cols) // 4        # uint64 elements of an output row
    CLIP = QUADS < D // 4
    O1_WIDE = o_columns(D, cols)[1] == 128            # (D = 256: o1 of 64 registers)

    @cuda.jit(device=True, inline=True)
    def store_half(out, b1, b2, row, ok, o, h, inv, odd, half, c0):
        for u in range(4):
            a = pack(o[8 * u + 2 * h] * inv, o[8 * u + 2 * h + 1] * inv)              # block 2u
            b = pack(o[8 * u + 4 + 2 * h] * inv, o[8 * u + 4 + 2 * h + 1] * inv)      # block 2u + 1
            # (the shuffle takes signed words: the bits go through int32 unchanged)
            got = numba.uint32(warp.shfl_xor_sync(warp.FULL_MASK, numba.int32(a if odd else b), 1))
            lo = got if odd else a
            hi = b if odd else got
            col = c0 + 4 * u + 2 * odd + half
            if ok and (not CLIP or col < QUADS):
                value = numba.uint64(lo) | (numba.uint64(hi) << numba.uint64(32))
                if rows_first:
                    out[b1, row, b2, col] = value
                else:
                    out[b1, b2, row, col] = value

    stored = make_row_stored(from_zero)

    @cuda.jit(device=True, inline=True)
    def store_rows(out, b1, b2, row0, n_rows, o0, o1, inv0, inv1, tq4):
        odd, half = tq4 & 1, tq4 >> 1
        ok0, ok1 = stored(row0, n_rows), stored(row0 + 8, n_rows)
        store_half(out, b1, b2, row0, ok0, o0, 0, inv0, odd, half, 0)
        store_half(out, b1, b2, row0 + 8, ok1, o0, 1, inv1, odd, half, 0)
        if D == 128:
            store_half(out, b1, b2, row0, ok0, o1, 0, inv0, odd, half, 16)
            store_half(out, b1, b2, row0 + 8, ok1, o1, 1, inv1, odd, half, 16)

    @cuda.jit(device=True, inline=True)
    def store_rows_256(out, b1, b2, row0, n_rows, o0, o1, inv0, inv1, tq4):
        """``D = 256``: each half's 64 registers as two 64-column blocks of 32 (``o1``'s
        second block only where it has one: :func:`o_columns`)."""
        odd, half = tq4 & 1, tq4 >> 1
        ok0, ok1 = stored(row0, n_rows), stored(row0 + 8, n_rows)
        store_half(out, b1, b2, row0, ok0, o0[:32], 0, inv0, odd, half, 0)
        store_half(out, b1, b2, row0 + 8, ok1, o0[:32], 1, inv1, odd, half, 0)
        store_half(out, b1, b2, row0, ok0, o0[32:], 0, inv0, odd, half, 16)
        store_half(out, b1, b2, row0 + 8, ok1, o0[32:], 1, inv1, odd, half, 16)
        store_half(out, b1, b2, row0, ok0, o1[:32], 0, inv0, odd, half, 32)
        store_half(out, b1, b2, row0 + 8, ok1, o1[:32], 1, inv1, odd, half, 32)
        if O1_WIDE:
            store_half(out, b1, b2, row0, ok0, o1[32:], 0, inv0, odd, half, 48)
            store_half(out, b1, b2, row0 + 8, ok1, o1[32:], 1, inv1, odd, half, 48)
    return store_rows_256 if D == 256 else store_rows
