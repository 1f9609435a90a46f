"""Numba's CUDA simulator, made event-driven and run on greenlets (numba-cuda 0.30.4, which is pinned).

The simulator runs each thread of a block as a Python thread. Its ``BlockManager`` waits
for them by polling: a loop that checks every live thread's "blocked in syncthreads"
flag and ``is_alive()``, over and over, until the block is done. That loop holds the
GIL most of the time, so the threads doing the kernel's work wait for it: a profile of a
small backward call showed 12 million ``is_alive`` calls and about 60% of the time in
lock acquisition.

Here a block instead keeps one condition variable and two counts, its live threads and
those waiting at the barrier. ``syncthreads`` waits on the condition; the last thread to
arrive (or to exit, since an exited thread no longer counts, as in the original) releases
the others. Same semantics as the original, including what happens on an exception:
every other thread of the block is aborted and the exception is re-raised by the launch,
with its traceback.

**Cooperative mode** (the default where the ``greenlet`` package is installed): each
simulated thread is a greenlet, and one OS thread runs the block's greenlets in turn, each
until it waits (a barrier, a warp's shuffle, an mbarrier, a wgmma's rendezvous) or ends;
whoever completes a wait makes its waiters runnable again, in the order they arrived.
Blocks start their threads in turn in thread order and in reverse (by the parity of the
block's index), so that a missing barrier shows whichever thread of a racing pair writes.
Nothing is preempted, so no lock is contended and no OS thread switches: a launch spends
its time in the kernel's own Python (OS threads spent half of theirs in the kernel's
scheduler, switching between threads that wait for the GIL). A block whose live threads
all wait can never go on: the first waiter gets :class:`Deadlock` at once (the threads'
mode waits out a timeout). ``NUMBA_FLASH_SIMULATOR_THREADS=1`` (read at import) runs OS
threads as the original does (the fallback without greenlet).

Emulations written for both modes: waits go through the block's conditions
(:meth:`_Block.condition`: a ``threading.Condition`` on the block's lock, or its
cooperative twin with the same interface), the running simulated thread is
:func:`current_thread` (numba's own ``threading.current_thread()`` calls are routed to it),
per-thread state hangs off that thread object, and :func:`pause` lets the others run
ahead. ``_hopper_sim`` keeps its per-block state in the block's ``extra``.

A device function called inside a kernel runs with its module's ``cuda`` swapped for the
launch's fake module; the simulator swaps and restores it around every call, under a lock
(a fifth of a small CUDA-core forward's time). Here the first call of a launch swaps it and
the launch's end restores it (:func:`_kernel_call`; the simulator runs one kernel at a
time).

A launch holds Python's cyclic collector off until it ends (``_gc_pause``: collections
took a sixth of the simulator tests' time).

``install`` also lets ``cuda.jit`` take ``launch_bounds`` (ignored), which the simulator
rejects and compiled kernels pass.
"""
import collections
import contextlib
import os
import threading
import time

import numpy as np
from numba.cuda.simulator import kernel as _kernel
from numba.cuda.simulator import kernelapi as _kernelapi

from . import _gc_pause

try:
    import greenlet as _greenlet
except ImportError:          # OS threads, as numba's simulator runs them
    _greenlet = None

THREADS_ENV = "NUMBA_FLASH_SIMULATOR_THREADS"
COOPERATIVE = _greenlet is not None and os.environ.get(THREADS_ENV, "") in ("", "0")


class Deadlock(RuntimeError):
    """Raised, in the cooperative mode, in a waiting thread of a block none of whose live
    threads can go on."""


class _CoopCondition:
    """``threading.Condition``'s interface for greenlets of one OS thread: ``with`` holds
    nothing (a greenlet gives way only where it waits), ``wait`` parks the caller and
    returns to the block's scheduler, ``notify_all`` makes the waiters runnable in the
    order they came (``timeout`` is unused: a deadlock is found when nothing can run)."""
    __slots__ = ("block", "waiters")

    def __init__(self, block):
        self.block = block
        self.waiters = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait(self, timeout=None):
        self.waiters.append(_greenlet.getcurrent())
        self.block.main.switch()
        return True

    def notify_all(self):
        if self.waiters:
            self.block.ready.extend(self.waiters)
            self.waiters = []

    notify = notify_all


class _Block:
    """The barrier state one block's threads share."""
    __slots__ = ("lock", "cond", "done", "conditions", "live", "nthreads", "waiting", "generation", "failed",
                 "extra", "cooperative", "ready", "main")

    def __init__(self, nthreads, cooperative=False):
        self.lock = threading.RLock()
        self.cooperative = cooperative
        if cooperative:
            self.ready = collections.deque()        # greenlets that can run, in turn
            self.main = _greenlet.getcurrent()      # the scheduler's
        self.cond = self._new_condition()           # syncthreads
        self.done = self._new_condition()           # the threads' manager: every thread finished, or one raised
        self.conditions = []        # more conditions on the lock (condition()), woken on abort
        self.live = nthreads        # threads not yet finished
        self.nthreads = nthreads
        self.waiting = 0            # threads blocked in syncthreads
        self.generation = 0         # barrier phases completed
        self.failed = None          # the first thread that raised
        self.extra = {}             # other emulations' per-block state, by name

    def _new_condition(self):
        return _CoopCondition(self) if self.cooperative else threading.Condition(self.lock)

    def condition(self):
        """A new condition variable on the block's lock, notified (as syncthreads's is) when
        the block aborts: waiters check their thread's ``abort`` when they wake."""
        with self.lock:
            cond = self._new_condition()
            self.conditions.append(cond)
        return cond

    def _release_if_complete(self):
        """With the lock held: open the barrier when every live thread has arrived."""
        if self.waiting and self.waiting == self.live:
            self.waiting = 0
            self.generation += 1
            self.cond.notify_all()

    def _first_waiter(self):
        """Cooperative mode: take the first waiting greenlet off its condition."""
        for cond in (self.cond, *self.conditions):
            if cond.waiters:
                return cond.waiters.pop(0)
        return None


class Barrier:
    """``threading.Barrier(parties).wait(timeout)`` over a condition of ``block``, in
    either mode; raises ``threading.BrokenBarrierError`` when the parties cannot all come
    (a deadlock, an abort, or ``timeout`` seconds)."""

    def __init__(self, block, parties):
        self.cond = block.condition()
        self.parties = parties
        self.count = 0
        self.generation = 0

    def wait(self, timeout):
        with self.cond:
            generation = self.generation
            self.count += 1
            if self.count == self.parties:
                self.count = 0
                self.generation += 1
                self.cond.notify_all()
                return
            deadline = time.monotonic() + timeout
            while generation == self.generation:
                left = deadline - time.monotonic()
                if left <= 0 or current_thread().abort:
                    raise threading.BrokenBarrierError
                try:
                    self.cond.wait(left)
                except Deadlock:
                    raise threading.BrokenBarrierError from None


def current_thread():
    """The simulated thread running now (numba's ``BlockThread``), in either mode."""
    sim = getattr(_greenlet.getcurrent(), "sim", None) if _greenlet is not None else None
    return sim if sim is not None else threading.current_thread()


def pause(seconds):
    """Let the other threads of the block run ahead of this one: in the cooperative mode
    it goes to the back of the queue of runnable threads, with OS threads it sleeps.
    ``time.sleep`` called by a simulated thread does the same (:func:`install`), so a
    delay put in a kernel to provoke a race does so in either mode."""
    g = _greenlet.getcurrent() if _greenlet is not None else None
    sim = getattr(g, "sim", None)
    if sim is None:
        _original_sleep(seconds)
        return
    block = sim._manager._block
    block.ready.append(g)
    block.main.switch()


class _ThreadingForNumba:
    """What numba's simulator sees as its module ``threading``: the same, except that
    ``current_thread()`` is the simulated thread (a greenlet shares its OS thread)."""

    def __getattr__(self, name):
        return getattr(threading, name)

    current_thread = staticmethod(current_thread)


_original_sleep = time.sleep


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


if _greenlet is not None:
    class _Greenlet(_greenlet.greenlet):
        """A simulated thread's greenlet; ``sim`` is its ``BlockThread``."""
        sim = None


def _run_greenlets(block, threads, reverse=False):
    """Cooperative mode: run the block's threads, each in a greenlet, until every one has
    ended or one has raised (the others are then killed where they wait). ``reverse``: the
    last thread starts first (a fixed order hides the races in which the earlier thread
    is the writer; blocks alternate the two orders, so a launch of two blocks or more
    meets either kind)."""
    greenlets = []
    for t in threads:
        g = _Greenlet(t.run, block.main)
        g.sim = t
        greenlets.append(g)
    ready = block.ready
    ready.extend(reversed(greenlets) if reverse else greenlets)
    while block.live and block.failed is None:
        if ready:
            ready.popleft().switch()
            continue
        waiter = block._first_waiter()
        if waiter is None:      # cannot happen: live threads are either runnable or waiting
            raise RuntimeError(f"simulator: {block.live} threads neither runnable nor waiting")
        waiter.throw(Deadlock("every live thread of the block waits and none can go on: the kernel is "
                              "deadlocked (a barrier, shuffle or mbarrier that some thread never reaches)"))
    if block.failed is not None:
        for t, g in zip(threads, greenlets):
            t.abort = True
            if g:               # started and not finished: end it where it waits
                g.throw()


def _manager_run(self, grid_point, *args):
    nthreads = int(np.prod(self._block_dim))
    block = self._block = _Block(nthreads, COOPERATIVE)

    def target():
        self._f(*args)

    threads = [_kernel.BlockThread(target, self, grid_point, point, self._debug)
               for point in np.ndindex(*self._block_dim)]
    if block.cooperative:
        _run_greenlets(block, threads, reverse=sum(grid_point) % 2 == 1)
        failed = block.failed
    else:
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
        with _gc_pause.paused():
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
    _kernelapi.threading = _ThreadingForNumba()
    time.sleep = pause          # (outside a simulated greenlet it sleeps, as before)
    _accept_launch_bounds()
