"""Device pieces the tensor-core kernels share (float16 and bfloat16 operands).

Tiles live in shared memory as rows of ``DP + ROW_PAD`` 16-bit elements (``DP`` = d
rounded up to 16, columns past d zero-filled): rows 16 bytes apart in bank space, so the
eight row addresses of one ``ldmatrix`` matrix, and the 16-byte ``cp.async`` stores,
hit distinct banks. Fragment layouts: ``numba_flash.ops``.
"""
import numba
from numba import cuda

from .. import ops
from ..scores import paged_row
from .._runtime import SIMULATOR

ROW_PAD = 8          # elements of padding per shared row (16 bytes)
E16 = 8              # 16-bit elements per 16-byte cp.async


def padded_dim(d):
    return -(-d // 16) * 16


def device(f):
    """``f`` as an inlined device function (plain Python in the simulator)."""
    return f if SIMULATOR else cuda.jit(device=True, inline="always")(f)


def operand_kinds(dtype_name):
    """``(mma, pack)``: the m16n8k16 product and the float32-pair packing of the dtype."""
    assert dtype_name in ("float16", "bfloat16"), dtype_name
    if dtype_name == "bfloat16":
        return ops.mma_bf16_m16n8k16, ops.pack_bf16x2
    return ops.mma_f16_m16n8k16, ops.pack_f16x2


def make_copy_rows(D, NT, NROWS, paged=False):
    """``copy_rows(smem, off, src, b1, b2, row0, n_lim, tid)``: ``smem[off + r·RS + c] =
    src[b1, b2, row0 + r, c]`` for ``r < NROWS``, ``c < DP``, zero outside the array
    (rows ``>= n_lim``, columns ``>= D``), by 16-byte ``cp.async`` from the ``NT``
    threads of a block (complete at ``cp_async_wait``). Needs ``row0 < n_lim``: a
    zero-byte copy still reads a valid address, that row's.

    Each thread copies one column chunk of rows ``NT / CPR2`` apart, ``CPR2`` the row's
    chunk count rounded up to a power of two (threads past the row's end idle: a quarter
    of them at d = 96): the index arithmetic is done once, and a chunk costs a compare, a
    select and an address (measured in SASS: 26 → 8 instructions a chunk at d = 128).

    With ``paged`` the rows are a paged KV cache's, and K's and V's rows are copied
    together (the same logical rows): ``copy_rows(smem, off_k, k, off_v, v, b1, b2, row0,
    n_lim, tid, pages, z, ps)`` reads logical row ``j`` from row ``pages[z, j // ps] · ps
    + j % ps`` of ``k`` and ``v``, each row's page looked up once for both. Three ways:

    * where a thread copies many rows (``ITER >= 4``: the one-warp decoding kernel) and
      ``ps`` is a multiple of ``PIECE`` (16 rows, or ``STEP`` if more, or the tile's rows
      if fewer: every serving page size), in pieces of ``PIECE`` rows, each within one
      page: a table read per piece, then its rows as ``copy_rows`` copies them, a stride
      apart (the next way, a 4-D address per row, made the paged decode 1.10× the
      contiguous one's time on an H200);
    * where a thread copies many rows and pages hold at least the ``STEP`` rows between
      them, one division per thread and copy (its first row), then the rows' offset in
      their page by a step and a compare each, and the page table read only where a step
      crosses into the next page (a division per row made the paged decode 2.7× slower
      than the contiguous one on an H200; a table load per row, 1.8×);
    * otherwise a division per row: few rows per thread (the 8-warp kernels, whose
      registers the longer ways would spill) or small pages.

    Rows past ``n_lim`` read row ``row0`` (copying nothing), and never look their page up.
    """
    DP = padded_dim(D)
    RS = DP + ROW_PAD
    CPR = DP // E16                    # 16-byte chunks per row
    CPR2 = 1 << (CPR - 1).bit_length()
    assert NT % CPR2 == 0, (NT, D)     # NT a power of two >= 32, D <= 256
    STEP = NT // CPR2                  # rows between one thread's chunks
    ITER = -(-NROWS // STEP)
    RAGGED = NROWS % STEP != 0         # the last pass covers part of the threads
    STRAIGHT = ITER >= 4               # paged: rows by steps (see above)
    PIECE = min(max(16, STEP), NROWS)  # paged: rows copied from one page lookup (see above)
    PIECES = STRAIGHT and PIECE % STEP == 0 and NROWS % PIECE == 0

    if paged:
        @device
        def copy_paged(smem, off_k, k, off_v, v, b1, b2, row0, n_lim, tid, pages, z, ps):
            r = tid // CPR2
            c = (tid - r * CPR2) * E16
            if CPR2 == CPR or c < DP:
                c_ok = D == DP or c < D
                c_src = c if c_ok else 0
                dk = off_k + r * RS + c
                dv = off_v + r * RS + c
                fallback = paged_row(pages, z, row0, ps)    # row0's own row
                j = row0 + r
                if PIECES and ps % PIECE == 0:               # each piece of the tile in one page
                    for p0 in range(0, NROWS, PIECE):
                        jp = row0 + p0                       # the piece's first row
                        page = numba.uint32(jp) // numba.uint32(ps)
                        base = pages[z, page] * ps + (jp - page * ps) + r if jp < n_lim else fallback
                        for it in range(PIECE // STEP):
                            ok = c_ok and jp + r + it * STEP < n_lim
                            n = 16 if ok else 0
                            at = (p0 + it * STEP) * RS
                            ops.cp_async16_rows(smem, dk + at, k, b1, b2, base, c_src, it * STEP if ok else 0, n)
                            ops.cp_async16_rows(smem, dv + at, v, b1, b2, base, c_src, it * STEP if ok else 0, n)
                elif STRAIGHT and ps >= STEP:
                    page = j // ps
                    within = j - page * ps
                    base = pages[z, page] * ps if j < n_lim else fallback    # the page's first row
                    for it in range(ITER):
                        if not RAGGED or r + it * STEP < NROWS:
                            ok = c_ok and j < n_lim
                            row = base + within if ok else fallback
                            n = 16 if ok else 0
                            ops.cp_async16_rows(smem, dk + it * STEP * RS, k, b1, b2, row, c_src, 0, n)
                            ops.cp_async16_rows(smem, dv + it * STEP * RS, v, b1, b2, row, c_src, 0, n)
                        j += STEP
                        within += STEP
                        if within >= ps:
                            within -= ps
                            page += 1
                            if j < n_lim:           # (entries past the rows in use may hold anything)
                                base = pages[z, page] * ps
                else:
                    for it in range(ITER):
                        if not RAGGED or r + it * STEP < NROWS:
                            ok = c_ok and j < n_lim
                            row = paged_row(pages, z, j, ps) if ok else fallback
                            n = 16 if ok else 0
                            ops.cp_async16_rows(smem, dk + it * STEP * RS, k, b1, b2, row, c_src, 0, n)
                            ops.cp_async16_rows(smem, dv + it * STEP * RS, v, b1, b2, row, c_src, 0, n)
                        j += STEP
        return copy_paged

    @device
    def copy_rows(smem, off, src, b1, b2, row0, n_lim, tid):
        r = tid // CPR2
        c = (tid - r * CPR2) * E16
        if CPR2 == CPR or c < DP:
            c_ok = D == DP or c < D
            c_src = c if c_ok else 0
            dst = off + r * RS + c
            row = min(row0 + r, n_lim - 1)     # this thread's first row, or a valid one
            for it in range(ITER):
                if not RAGGED or r + it * STEP < NROWS:
                    ok = c_ok and row0 + r + it * STEP < n_lim
                    ops.cp_async16_rows(smem, dst + it * STEP * RS, src, b1, b2, row, c_src,
                                        it * STEP if ok else 0, 16 if ok else 0)
    return copy_rows


def make_mma_pair(mma):
    """``mma_pair(acc, mt, n, a0..a3, b0..b3)``: ``acc[mt, n] += A·B₀`` and ``acc[mt, n + 1]
    += A·B₁``, one A fragment against the two 8-column B fragments (``b0, b1`` and ``b2,
    b3``) of one ``ldmatrix_x4``."""
    @device
    def mma_pair(acc, mt, n, a0, a1, a2, a3, b0, b1, b2, b3):
        acc[mt, n, 0], acc[mt, n, 1], acc[mt, n, 2], acc[mt, n, 3] = mma(
            a0, a1, a2, a3, b0, b1, acc[mt, n, 0], acc[mt, n, 1], acc[mt, n, 2], acc[mt, n, 3])
        acc[mt, n + 1, 0], acc[mt, n + 1, 1], acc[mt, n + 1, 2], acc[mt, n + 1, 3] = mma(
            a0, a1, a2, a3, b2, b3, acc[mt, n + 1, 0], acc[mt, n + 1, 1], acc[mt, n + 1, 2], acc[mt, n + 1, 3])
    return mma_pair


def make_fragments(RS):
    """``(a_frag, b_frag, bt_frag)``, ``ldmatrix_x4`` reads of a 16 × 16 block whose first
    element is ``smem[off]`` (rows ``RS`` apart):

    * ``a_frag``: the A fragment of rows ``0..15``, columns ``0..15`` (row-major A);
    * ``b_frag``: the B fragments of two 8-column blocks of ``Bᵀ`` stored as rows: rows
      ``0..15`` are B's columns, columns ``0..15`` its k (a K tile for ``Q Kᵀ``);
    * ``bt_frag``: the B fragments of rows ``0..15`` as k, columns ``0..7`` and ``8..15``
      as n (a V tile for ``P V``), by ``ldmatrix.trans``.
    """
    @device
    def a_frag(smem, off, lane):
        return ops.ldmatrix_x4(smem, off + (lane & 15) * RS + 8 * (lane >> 4))

    @device
    def b_frag(smem, off, lane):
        return ops.ldmatrix_x4(smem, off + ((lane & 7) + 8 * (lane >> 4)) * RS + 8 * ((lane >> 3) & 1))

    @device
    def bt_frag(smem, off, lane):
        return ops.ldmatrix_x4_trans(smem, off + ((lane & 7) + 8 * ((lane >> 3) & 1)) * RS + 8 * (lane >> 4))
    return a_frag, b_frag, bt_frag
