"""Device-side copy of a strided 4-D array into a contiguous one.

The tensor-core forward reads rows with 16-byte ``cp.async``; inputs whose rows are
not contiguous and 16-byte aligned (a transposed view, an odd offset) are first copied
with this kernel, on the device and on the launch stream.
"""
import functools

from numba import cuda

from .._runtime import SIMULATOR

THREADS = 256


@functools.lru_cache(maxsize=None)
def make_copy4():
    """``dst[b1, b2, r, c] = src[b1, b2, r, c]``; launch with
    ``grid = ceil(N · D / THREADS) · B1 · B2``, ``block = THREADS``."""

    @cuda.jit
    def copy4(src, dst):
        B2 = src.shape[1]
        N = src.shape[2]
        D = src.shape[3]
        per_b = (N * D + THREADS - 1) // THREADS
        b = cuda.blockIdx.x // per_b
        i = (cuda.blockIdx.x - b * per_b) * THREADS + cuda.threadIdx.x
        b1 = b // B2
        b2 = b - b1 * B2
        if i < N * D:
            r = i // D
            c = i - r * D
            dst[b1, b2, r, c] = src[b1, b2, r, c]

    copy4.threads = THREADS
    return copy4


@functools.lru_cache(maxsize=None)
def make_append(paged=False):
    """``dst[b, pos[b] + i, h, c] = src[b, i, h, c]``: new rows written into a KV cache at
    each sequence's length (``pos`` int32 ``(B,)``, checked on the host to keep every row
    inside ``dst``, or made so on the device by ``kv_metadata``; nothing is written for a
    negative ``pos[b]``). With ``paged``, ``dst`` is a paged cache ``(num_pages, page_size, H,
    D)`` and two more arguments, the page table ``pages (B, max pages)`` int32 and
    ``page_size``, place row ``j = pos[b] + i`` at page ``pages[b, j // page_size]``, row
    ``j % page_size``. Launch with ``grid = ceil(Nnew · H · D / THREADS) · B``,
    ``block = THREADS``."""

    def append_body(src, dst, pos, pages, page_size):
        N = src.shape[1]
        H = src.shape[2]
        D = src.shape[3]
        per_b = (N * H * D + THREADS - 1) // THREADS
        b = cuda.blockIdx.x // per_b
        i = (cuda.blockIdx.x - b * per_b) * THREADS + cuda.threadIdx.x
        if i < N * H * D:
            r = i // (H * D)
            i -= r * (H * D)
            h = i // D
            c = i - h * D
            j = pos[b] + r
            if j < r:
                return      # a negative position: the sequence is skipped (kv_metadata)
            if paged:
                page = j // page_size
                dst[pages[b, page], j - page * page_size, h, c] = src[b, r, h, c]
            else:
                dst[b, j, h, c] = src[b, r, h, c]

    if not SIMULATOR:
        append_body = cuda.jit(device=True, inline="always")(append_body)
    if paged:
        @cuda.jit
        def append(src, dst, pos, pages, page_size):
            append_body(src, dst, pos, pages, page_size)
    else:
        @cuda.jit
        def append(src, dst, pos):
            append_body(src, dst, pos, pos, 0)

    append.threads = THREADS
    return append
