"""Numba's CUDA simulator, made event-driven (numba-cuda 0.30.4, which is pinned).

The simulator runs each thread of a block as a Python thread. Its ``BlockManager`` waits
for them by polling: a loop that checks every live thread's "blocked in syncthreads"
flag and ``is_alive()``, over and over, until the block is done. That loop holds the
GIL most of the time, so the threads doing the kernel's work wait for it: a profile of a
small backward call showed 12 million ``is_alive`` calls and about 60% of the time in
lock acquisition.

Here a block instead keeps one condition variable and two counts, its live threads and
those waiting at the barrier. ``syncthreads`` waits on the condition; the last thread to
arrive (or to exit, since an exited thread no longer counts, as in the original) releases
the others; the manager sleeps (on a condition of its own, so that threads finishing
do not wake those at a barrier) until no thread is left or one has raised. Same
semantics as the original, including what happens on an exception: every other thread
of the block is aborted at its next barrier and the exception is re-raised by the
launch, with its traceback.

Other emulations keep their per-block state here too (``_hopper_sim``: shared addresses,
mbarriers, named barriers, warpgroup rendezvous in ``extra``) and wait on condition
variables over the block's lock (:meth:`_Block.condition`), which an abort wakes as well.

A device function called inside a kernel runs with its module's ``cuda`` swapped for the
launch's fake module; the simulator swaps and restores it around every call, under a lock
(a fifth of a small CUDA-core forward's time). Here the first call of a launch swaps it and
the launch's end restores it (:func:`_kernel_call`; the simulator runs one kernel at a
time).

``install`` also lets ``cuda.jit`` take ``launch_bounds`` (ignored), which the simulator
rejects and compiled kernels pass.
"""
import contextlib
import threading

import numpy as np
from numba.cuda.simulator import kernel as _kernel
from numba.cuda.simulator import kernelapi as _kernelapi


class _Block:
    """The barrier state one block's threads share."""
    __slots__ = ("lock", "cond", "done", "conditions", "live", "nthreads", "waiting", "generation", "failed",
                 "extra")

    def __init__(self, nthreads):
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)     # syncthreads
        self.done = threading.Condition(self.lock)     # the manager: every thread finished, or one raised
        self.conditions = []        # more conditions on the lock (condition()), woken on abort
        self.live = nthreads        # threads not yet finished
        self.nthreads = nthreads
        self.waiting = 0            # threads blocked in syncthreads
        self.generation = 0         # barrier phases completed
        self.failed = None          # the first thread that raised
        self.extra = {}             # other emulations' per-block state, by name

    def condition(self):
        """A new condition variable on the block's lock, notified (as syncthreads's is) when
        the block aborts: waiters check their thread's ``abort`` when they wake."""
        with self.lock:
            cond = threading.Condition(self.lock)
            self.conditions.append(cond)
        return cond

    def _release_if_complete(self):
        """With the lock held: open the barrier when every live thread has arrived."""
        if self.waiting and self.waiting == self.live:
            self.waiting = 0
            self.generation += 1
            self.cond.notify_all()


def _syncthreads(self):
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    block = self._manager._block
    with block.cond:
        phase = block.generation
        block.waiting += 1
        block._release_if_complete()
        while block.generation == phase and not self.abort:
            block.cond.wait()
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


def _thread_run(self):
    block = self._manager._block
    try:
        _original_thread_run(self)
    finally:
        with block.cond:
            block.live -= 1
            if self.exception is not None and block.failed is None:
                block.failed = self
            block._release_if_complete()
            if block.live == 0 or block.failed is not None:
                block.done.notify()


def _manager_run(self, grid_point, *args):
    nthreads = int(np.prod(self._block_dim))
    block = self._block = _Block(nthreads)

    def target():
        self._f(*args)

    threads = [_kernel.BlockThread(target, self, grid_point, point, self._debug)
               for point in np.ndindex(*self._block_dim)]
    for t in threads:
        t.start()
    with block.cond:
        while block.live and block.failed is None:
            block.done.wait()
        failed = block.failed
        if failed is not None:
            # Abort every other thread at its next barrier; do not join (as the original).
            for t in threads:
                t.abort = True
            for cond in [block.cond, *block.conditions]:
                cond.notify_all()
    if failed is not None:
        raise failed.exception[0].with_traceback(failed.exception[1])


_original_thread_run = _kernel.BlockThread.run


class _Launch:
    """The modules whose ``cuda`` the launch under way has swapped for its fake one, kept
    swapped until it ends (the simulator runs one kernel at a time)."""
    lock = threading.Lock()
    modules = None              # id(module globals) -> True, during a launch
    stack = None                # their swaps (context managers), undone when the launch ends


def _kernel_call(self, *args):
    """``FakeCUDAKernel.__call__``: a device function called inside a launch runs with its
    module swapped once per launch instead of once per call; a launch undoes its swaps."""
    context = _kernel._kernel_context
    if context is not None and self._device:
        key = id(self.fn.__globals__)
        if key not in _Launch.modules:
            with _Launch.lock:
                if key not in _Launch.modules:
                    _Launch.stack.enter_context(_kernelapi.swapped_cuda_module(self.fn, context))
                    _Launch.modules[key] = True
        return self.fn(*args)
    if context is not None or self._device:
        return _original_kernel_call(self, *args)
    _Launch.modules, _Launch.stack = {}, contextlib.ExitStack()
    try:
        return _original_kernel_call(self, *args)
    finally:
        stack, _Launch.modules, _Launch.stack = _Launch.stack, None, None
        stack.close()


_original_kernel_call = _kernel.FakeCUDAKernel.__call__


def _accept_launch_bounds():
    """``cuda.jit(launch_bounds=...)`` as on a GPU: the simulator's ``jit`` has no such
    argument (a register budget means nothing to it), so it is dropped."""
    from numba import cuda
    from numba.cuda import simulator
    from numba.cuda.simulator import api

    original = api.jit

    def jit(func_or_sig=None, *args, launch_bounds=None, **kwargs):
        return original(func_or_sig, *args, **kwargs)

    jit.__doc__ = original.__doc__
    for module in (api, simulator, cuda):
        module.jit = jit


def install():
    """Replace the polling block manager, and let ``cuda.jit`` take ``launch_bounds`` (once)."""
    if getattr(_kernel.BlockManager.run, "event_driven", False):
        return
    _manager_run.event_driven = True
    _kernel.BlockThread.syncthreads = _syncthreads
    _kernel.BlockThread.run = _thread_run
    _kernel.BlockManager.run = _manager_run
    _kernel.FakeCUDAKernel.__call__ = _kernel_call
    _accept_launch_bounds()
