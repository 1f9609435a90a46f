"""numba_flash._simulator: the event-driven block manager keeps the simulator's semantics."""
import numpy as np
import pytest

import numba_flash
from numba import cuda

pytestmark = pytest.mark.skipif(not numba_flash.SIMULATOR, reason="the simulator's block manager")


def test_installed():
    from numba.cuda.simulator import kernel
    assert getattr(kernel.BlockManager.run, "event_driven", False)


@cuda.jit
def _reverse_in_phases(x, out, phases):
    """Each phase rotates a shared array by one through a barrier; threads past ``live``
    return early, as CUDA threads may: the barrier then waits only for the others."""
    buf = cuda.shared.array(64, np.float64)
    t = cuda.threadIdx.x
    live = cuda.blockDim.x - 3
    if t >= live:
        return
    buf[t] = x[cuda.blockIdx.x, t]
    for _ in range(phases):
        cuda.syncthreads()                  # writes of this phase before the reads
        v = buf[(t + 1) % live]
        cuda.syncthreads()                  # reads before the next writes
        buf[t] = v
    out[cuda.blockIdx.x, t] = buf[t]


def test_barriers_with_exited_threads():
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 40))
    out = np.full_like(x, np.nan)
    _reverse_in_phases[3, 40](x, out, 5)
    live = 40 - 3
    np.testing.assert_array_equal(out[:, :live], np.roll(x[:, :live], -5, axis=1))
    assert np.isnan(out[:, live:]).all()


@cuda.jit
def _count(flags, out):
    out[cuda.blockIdx.x] = cuda.syncthreads_count(flags[cuda.threadIdx.x])


def test_syncthreads_count():
    flags = np.random.default_rng().integers(0, 2, 33).astype(np.int32)
    out = np.zeros(2, np.int64)
    _count[2, 33](flags, out)
    assert list(out) == [flags.sum()] * 2


@cuda.jit
def _out_of_bounds(x):
    t = cuda.threadIdx.x
    cuda.syncthreads()
    x[t + 1] = 1.0          # the last thread writes past the end
    cuda.syncthreads()


def test_an_exception_in_one_thread_is_raised_by_the_launch():
    with pytest.raises(IndexError, match="tid=\\[7, 0, 0\\]"):
        _out_of_bounds[1, 8](np.zeros(8))
