"""Warp-level operations that work both compiled and in Numba's CUDA simulator.

Kernels call ``warp.shfl_xor_sync`` etc. from this module, never ``cuda.shfl_*``
directly. Compiled, these are numba's own intrinsics. The simulator has none of
them, so there they are emulated: each lane of a warp writes its value into a
32-slot buffer, waits for the other participating lanes at a barrier (``_simulator.Barrier``) and
reads the lane it asked for (a vote, ``all_sync``: every lane's); the next exchange uses a
second buffer (and the one after it the first again, which by then every lane has read).

The emulation leans on simulator internals (``BlockThread.thread_id``, the block state
``numba_flash._simulator`` keeps), which is one reason numba-cuda is pinned.
"""
import threading

from numba import cuda

from ._runtime import SIMULATOR

FULL_MASK = 0xFFFFFFFF

if not SIMULATOR:
    shfl_sync = cuda.shfl_sync
    shfl_xor_sync = cuda.shfl_xor_sync
    shfl_down_sync = cuda.shfl_down_sync
    all_sync = cuda.all_sync

    @cuda.jit(device=True, inline=True)
    def syncwarp():
        """The warp's lanes meet (``bar.warp.sync``: memory ordered among them)."""
        cuda.syncwarp()

else:
    # A guard against a hang (a lane named in the mask that exited or took another branch),
    # not a time budget: lanes of a busy 2-core machine reach a shuffle seconds apart at most.
    from . import _simulator

    _TIMEOUT_S = 600.0
    _slots_lock = threading.Lock()

    class _Slot:
        """A warp's rendezvous: two value buffers used in turn (a lane writes the next
        exchange's buffer only after every lane passed this one's barrier, so after every
        lane read the buffer before it: one barrier per exchange, not two)."""
        def __init__(self, block, parties):
            self.values = ([None] * 32, [None] * 32)
            self.turn = [0] * 32
            self.barrier = _simulator.Barrier(block, parties)

    def _lanes(thread):
        """The lanes of the thread's warp that exist (the block's last warp may be short)."""
        nthreads = 1
        for n in thread._manager._block_dim:
            nthreads *= n
        return min(32, nthreads - 32 * (thread.thread_id // 32))

    def _slot(thread, mask):
        block = thread._manager._block
        warp = thread.thread_id // 32
        with _slots_lock:
            table = block.extra.setdefault("warps", {})
            slot = table.get((warp, mask))
            if slot is None:
                parties = bin(mask & ((1 << _lanes(thread)) - 1)).count("1")
                slot = table[(warp, mask)] = _Slot(block, parties)
        return slot

    def _exchange(mask, value):
        """Rendezvous of the lanes in ``mask``; returns (my lane, every lane's value)."""
        t = _simulator.current_thread()
        lane = t.thread_id % 32
        s = _slot(t, int(mask))
        buf = s.values[s.turn[lane]]
        s.turn[lane] ^= 1
        buf[lane] = value
        try:
            s.barrier.wait(_TIMEOUT_S)
            values = list(buf)
        except threading.BrokenBarrierError:
            raise RuntimeError("warp shuffle: a lane named in the mask never arrived "
                               "(a lane returned early or took another branch)") from None
        return lane, values

    def shfl_sync(mask, value, src_lane):
        lane, values = _exchange(mask, value)
        return values[int(src_lane) % 32]

    def shfl_xor_sync(mask, value, lane_mask):
        lane, values = _exchange(mask, value)
        return values[(lane ^ int(lane_mask)) % 32]

    def shfl_down_sync(mask, value, delta):
        lane, values = _exchange(mask, value)
        src = lane + int(delta)
        return values[src] if src < 32 else value

    def all_sync(mask, predicate):
        """Whether ``predicate`` holds on every lane in ``mask`` (``vote.sync.all``)."""
        lanes = _lanes(_simulator.current_thread())
        _, values = _exchange(mask, bool(predicate))
        return all(values[lane] for lane in range(lanes) if (int(mask) >> lane) & 1)

    def syncwarp():
        _exchange(FULL_MASK, None)
