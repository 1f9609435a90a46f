"""KV-cache metadata read on the device: no copy to the host, no wait.

``attention_with_kvcache(..., check_metadata=False)`` takes ``cache_seqlens`` (and a
paged cache's ``block_table``) where they lie, on the device. Before the call's other
launches, this kernel turns them into what those launches read, on the call's stream:
each sequence's key count in the sequence table (column 3), the rows its appended keys
go to, and the page table as int32. Values the host would have refused are made
harmless here instead: a sequence whose length lies outside ``[0, Nmax − Nnew]``, or
which uses a page outside the cache, is skipped (no keys: its output is zeros and its
lse −inf; its new rows are not written), so no launch reads or writes outside the
arrays whatever the metadata holds.
"""
import functools

from numba import cuda

from .._runtime import SIMULATOR

THREADS = 128


@functools.lru_cache(maxsize=None)
def make_kv_metadata(paged=False):
    """``kv_metadata(lens, table, pos, nmax, n_new)``, or with ``paged``
    ``kv_metadata(lens, pages_in, table, pos, pages, nmax, n_new, num_pages, page_size)``.
    Block ``b`` (grid ``B``, block :data:`THREADS`) reads ``lens[b]`` (the rows of
    sequence b's cache in use) and writes ``table[b, 3] = lens[b] + n_new`` and
    ``pos[b] = lens[b]``, or 0 and −1 for a skipped sequence (see the module's doc);
    the append kernel writes nothing at a negative position. With ``paged`` it also
    copies ``pages_in[b]`` (any integer type) to ``pages[b]`` (int32) and checks that
    the ``ceil((lens[b] + n_new) / page_size)`` entries the sequence uses name one of
    the cache's ``num_pages`` pages."""

    def body(lens, pages_in, table, pos, pages, nmax, n_new, num_pages, page_size):
        b = cuda.blockIdx.x
        t = cuda.threadIdx.x
        n = lens[b]
        ok = n >= 0 and n <= nmax - n_new
        if paged:
            used = (n + n_new + page_size - 1) // page_size if ok else 0
            bad = 0
            for j in range(t, pages_in.shape[1], THREADS):
                p = pages_in[b, j]
                if j < used and (p < 0 or p >= num_pages):
                    bad = 1
                pages[b, j] = p if p >= 0 and p < num_pages else -1
            if cuda.syncthreads_or(bad):
                ok = False
        if t == 0:
            if ok:
                table[b, 3] = n + n_new
                pos[b] = n
            else:
                table[b, 3] = 0
                pos[b] = -1

    if not SIMULATOR:
        body = cuda.jit(device=True, inline="always")(body)
    if paged:
        @cuda.jit
        def kv_metadata(lens, pages_in, table, pos, pages, nmax, n_new, num_pages, page_size):
            body(lens, pages_in, table, pos, pages, nmax, n_new, num_pages, page_size)
    else:
        @cuda.jit
        def kv_metadata(lens, table, pos, nmax, n_new):
            body(lens, table, table, pos, table, nmax, n_new, 0, 1)

    kv_metadata.threads = THREADS
    return kv_metadata
