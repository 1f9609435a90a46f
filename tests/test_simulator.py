"""numba_flash._simulator: the event-driven block manager keeps the simulator's semantics,
with greenlets (the cooperative mode) and with OS threads."""
import numpy as np
import pytest

import numba_flash
import numba_flash.api
from numba import cuda

pytestmark = pytest.mark.skipif(not numba_flash.SIMULATOR, reason="the simulator's block manager")


@pytest.fixture(params=["greenlets", "threads"])
def mode(request, monkeypatch):
    """Each test in both modes (the cooperative one where greenlet is installed)."""
    from numba_flash import _simulator
    cooperative = request.param == "greenlets"
    if cooperative and _simulator._greenlet is None:
        pytest.skip("greenlet is not installed")
    monkeypatch.setattr(_simulator, "COOPERATIVE", cooperative)
    return request.param


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


def test_barriers_with_exited_threads(mode):
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


def test_syncthreads_count(mode):
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


def test_an_exception_in_one_thread_is_raised_by_the_launch(mode):
    with pytest.raises(IndexError, match="tid=\\[7, 0, 0\\]"):
        _out_of_bounds[1, 8](np.zeros(8))
    _reverse_in_phases[1, 8](np.zeros((1, 8)), np.zeros((1, 8)), 2)     # the next launch runs as usual


@cuda.jit
def _shuffle_with_a_lane_gone(out):
    from numba_flash import warp
    t = cuda.threadIdx.x
    if t == 5:
        return              # lane 5 never reaches the shuffle that names it
    out[t] = warp.shfl_xor_sync(warp.FULL_MASK, t, 1)


def test_a_deadlocked_warp_is_reported(mode, monkeypatch):
    """Greenlets: found at once (no thread can go on); threads: after the guard's timeout."""
    from numba_flash import warp
    monkeypatch.setattr(warp, "_TIMEOUT_S", 0.5)
    with pytest.raises(RuntimeError, match="never arrived"):
        _shuffle_with_a_lane_gone[1, 32](np.zeros(32))


@cuda.jit
def _votes(limits, out):
    """Per warp, ``all_sync`` of ``lane < limits[warp]``, written by every lane."""
    from numba_flash import warp
    t = cuda.threadIdx.x
    out[t] = warp.all_sync(warp.FULL_MASK, t % 32 < limits[t // 32])


def test_a_warps_vote(mode):
    """``warp.all_sync``'s twin: true for a warp only where the predicate holds on all of
    its lanes, every lane told the same; a short last warp (40 threads: 8 lanes) counts its
    own lanes only."""
    for limits, want in (([32, 8], [True, True]), ([31, 8], [False, True]), ([32, 7], [True, False])):
        out = np.zeros(40, np.bool_)
        _votes[1, 40](np.array(limits), out)
        assert out.tolist() == [want[0]] * 32 + [want[1]] * 8, (limits, out)


def test_tensor_core_forward_is_the_same_in_both_modes(monkeypatch):
    """A float16 tensor-core forward (warp shuffles, cp.async groups, mma twins: the state
    each simulated thread keeps) gives the same bits in either mode, and the oracle's answer."""
    from numba_flash import _simulator
    from numba_flash.testing import assert_attention_close
    if _simulator._greenlet is None:
        pytest.skip("greenlet is not installed")
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((1, 2, n, 32)).astype(np.float16) for n in (19, 37, 37))
    _, launches = numba_flash.api.plan_forward(q, k, v, causal=True)
    assert any("mma" in kern.py_func.__qualname__ for kern, *_ in launches), launches
    results = []
    for cooperative in (True, False):
        monkeypatch.setattr(_simulator, "COOPERATIVE", cooperative)
        out, lse = numba_flash.attention_fwd(q, k, v, causal=True)
        assert_attention_close(out, q, k, v, lse=lse, causal=True)
        results.append((np.asarray(out), np.asarray(lse)))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


@cuda.jit
def _arrival_order(order, counter):
    import time
    t = cuda.threadIdx.x
    if t == 0:
        time.sleep(0.05)            # a delay put in to provoke a race: the others go first
    order[t] = cuda.atomic.add(counter, 0, 1)


def test_a_sleeping_thread_lets_the_others_run_first(mode):
    """Greenlets: the sleeper goes last, always. OS threads: it usually does, but how
    soon the others arrive depends on the machine, so there only every thread must run."""
    order, counter = np.full(8, -1, np.int64), np.zeros(1, np.int64)
    _arrival_order[1, 8](order, counter)
    assert sorted(order) == list(range(8)), order
    if mode == "greenlets":
        assert order[0] == 7, order


@cuda.jit
def _racy_neighbour(out, step):
    buf = cuda.shared.array(32, np.float64)
    t = cuda.threadIdx.x
    buf[t] = cuda.blockIdx.x * 100 + t
    # (a barrier belongs here)
    out[cuda.blockIdx.x, t] = buf[(t + step) % 32]


@pytest.mark.parametrize("step", [1, -1])
def test_greenlets_show_a_missing_barrier_whichever_thread_writes(step, monkeypatch):
    """Blocks alternate the order their threads start in, so a launch of two blocks reads
    a neighbour's value before it is written somewhere, whichever side the neighbour is."""
    from numba_flash import _simulator
    if _simulator._greenlet is None:
        pytest.skip("greenlet is not installed")
    monkeypatch.setattr(_simulator, "COOPERATIVE", True)
    out = np.full((2, 32), np.nan)
    _racy_neighbour[2, 32](out, step)
    written = np.arange(2)[:, None] * 100 + (np.arange(32) + step) % 32
    inner = slice(0, 31) if step == 1 else slice(1, 32)     # not the thread that wraps around
    assert not np.array_equal(out[:, inner], written[:, inner])


def test_report_names_the_mode(monkeypatch):
    """``python -m numba_flash`` says how the simulator runs threads."""
    from numba_flash import _simulator
    from numba_flash.__main__ import report
    for cooperative, words in ((True, "greenlets"), (False, "an OS thread per GPU thread")):
        if cooperative and _simulator._greenlet is None:
            continue
        monkeypatch.setattr(_simulator, "COOPERATIVE", cooperative)
        line = next(line for line in report().splitlines() if line.startswith("simulator:"))
        assert words in line, line


def test_a_launch_holds_the_collector_off_and_restores_it(mode, monkeypatch):
    """A simulated launch runs without starts of Python's cyclic collector (numba_flash.
    _gc_pause) and leaves it as it found it: on, and off for a caller who turned it off,
    also when the launch raises; with ``NUMBA_FLASH_GC_PAUSE=0`` the same launch collects."""
    import gc
    from numba_flash import _gc_pause
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((1, 2, 40, 16)).astype(np.float32) for _ in range(3))
    starts = []
    callback = lambda phase, info: phase == "start" and starts.append(_gc_pause._state["depth"])  # noqa: E731
    gc.callbacks.append(callback)
    try:
        numba_flash.attention(q, k, v)
        assert gc.isenabled() and not [d for d in starts if d], starts
        gc.disable()
        try:
            numba_flash.attention(q, k, v)
            assert not gc.isenabled()
        finally:
            gc.enable()
        x = np.zeros((2, 61))
        with pytest.raises(ZeroDivisionError):
            _divide_by_zero[2, 64](x)
        assert gc.isenabled() and _gc_pause._state["depth"] == 0
        monkeypatch.setenv(_gc_pause.ENV, "0")
        del starts[:]
        numba_flash.attention(q, k, v)
        assert starts, "a launch of this size starts collections when nothing holds them off"
    finally:
        gc.callbacks.remove(callback)


@cuda.jit
def _divide_by_zero(x):
    x[cuda.blockIdx.x, cuda.threadIdx.x % 61] = 1 // (cuda.threadIdx.x - 7)
