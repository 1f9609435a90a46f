"""The Hopper forward's published-items protocol alone, in a kernel of one block: what
compute-sanitizer's racecheck makes of mbarrier-ordered shared memory (on a GPU machine)::

    compute-sanitizer --tool racecheck python tools/mbarrier_probe.py

Thread 0 (the producer) writes ``ITEMS`` items of eight 32-bit words into two slots: it
waits on a slot's ``empty`` mbarrier (from the third item on), stores the item with two
``st.shared.v4.u32`` and arrives on the slot's ``full`` mbarrier. A consumer warpgroup
(threads 128-255) waits on ``full``, reads the item with two ``ld.shared.v4.u32``, meets on
a named barrier and has one thread arrive on ``empty``: ``forward_wgmma``'s
``publish_item`` and ``take_item``. Every consumer thread sums the words it read; the run
checks the sums (exit 1 if wrong).

Measured on an H100 (CUDA 13.0's compute-sanitizer): the sums are right and racecheck
reports the consumers' loads against the producer's stores as hazards, as it reports the
Hopper forward's slot loads (``LDS``, ``LDS.128``) against its slot stores (``STS.128``)
with the published items on: racecheck does not take an mbarrier's arrival and the wait
on its phase as ordering plain shared-memory accesses (docs/performance.md item 125). The
rest of the Hopper forward is checked with the items off:
``tools/sanitize.py --hopper --set kernels.forward_wgmma.PUBLISH_HEAD_DIM=0``.
Runs in the simulator too (``NUMBA_ENABLE_CUDASIM=1``), where the intrinsics' twins run it.
"""
import sys

import numba
import numpy as np
from numba import cuda

from numba_flash import ops_hopper as H
from numba_flash.kernels.wgmma_parts import wait_phase

ITEMS = 16
SLOTS = 2


@cuda.jit
def _probe(out):
    sm = cuda.shared.array(256, numba.uint8)
    base = H.shared_address(sm)      # full mbarriers, empty mbarriers, then the slots (32 bytes each)
    full, empty, slots = base, base + 8 * SLOTS, base + 64
    tid = cuda.threadIdx.x
    if tid == 0:
        for s in range(SLOTS):
            H.mbarrier_init(full + 8 * s, 1)
            H.mbarrier_init(empty + 8 * s, 1)
        H.fence_mbarrier_init()
    cuda.syncthreads()
    if tid < 128:
        if tid == 0:                  # the producer
            for n in range(ITEMS):
                slot = n % SLOTS
                if n >= SLOTS:
                    wait_phase(empty + 8 * slot, ((n // SLOTS) - 1) & 1)
                at = slots + 32 * slot
                H.st_shared_v4(at, n, n + 1, n + 2, n + 3)
                H.st_shared_v4(at + 16, n + 4, n + 5, n + 6, n + 7)
                H.mbarrier_arrive(full + 8 * slot)
        return
    total = 0                         # a consumer thread
    for n in range(ITEMS):
        slot = n % SLOTS
        wait_phase(full + 8 * slot, (n // SLOTS) & 1)
        at = slots + 32 * slot
        a, b, c, d = H.ld_shared_v4(at)
        e, f, g, h = H.ld_shared_v4(at + 16)
        total += a + b + c + d + e + f + g + h
        H.named_barrier(1, 128)
        if tid == 128:
            H.mbarrier_arrive(empty + 8 * slot)
    out[tid - 128] = total


def run():
    """The consumers' sums and the sum each should have (item n's words sum to 8 n + 28)."""
    out = cuda.to_device(np.full(128, -1, np.int64))
    _probe[1, 256](out)
    cuda.synchronize()
    return out.copy_to_host(), sum(8 * n + 28 for n in range(ITEMS))


def main():
    got, want = run()
    ok = bool((got == want).all())
    print("mbarrier probe:", "ok" if ok else f"WRONG: {got[:4]}..., expected {want}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
