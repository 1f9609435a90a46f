"""Kernel compiles and simulated launches without pauses for Python's cyclic collector.

A compile makes hundreds of thousands of small objects (IR nodes and their copies, types,
llvmlite instructions) that live until it ends, and Python starts a collection every
few hundred allocations; every tenth of the second generation's turns, while the objects
that outlived collections keep growing, it traverses every tracked object of the
process, the compile's included. The Hopper forward (bf16, d = 128, full rows; what a
typical first call compiles) spent 0.75 of its 2.75 s front end in 863 collections, 0.65
s in six full ones (2-core x86-64, numba-cuda 0.30.4). A launch in Numba's CUDA simulator
(a greenlet or thread per GPU thread, a frame per device function call) is the same kind
of work: collections took a sixth of the simulator tests' time.

:func:`pause` turns the collector off for the outermost of nested holds and
:func:`resume` turns it back on when that hold ends, unless it was off when the hold
began. :func:`install` makes every hold of numba-cuda's compiler lock one (the compile of
a kernel, its inlined device functions' front ends inside it, and its code generation),
and the simulator's launches (``_simulator``) hold one each. What a hold left in
reference cycles is collected at the collector's next turn, as before, so the
collections are fewer, not gone (the Hopper forward's compile to PTX 3.21 -> 2.98 s);
reference counting frees the rest meanwhile. Memory grows by about the cycles of one
compile while it lasts and until the next full collection (compiling kernels one after
another, peak resident memory 330 -> 470 MB and no further; one kernel: +4 MB). Other
threads' compiles wait for the compiler lock; the count of holds is kept under a lock
of its own for the simulator's launches.

The compile's hold is installed for the numba-cuda this package pins (0.30.4); neither
applies when ``NUMBA_FLASH_GC_PAUSE=0``.
"""
import contextlib
import gc
import os
import threading

from ._runtime import pinned_numba_cuda

ENV = "NUMBA_FLASH_GC_PAUSE"
_originals = {}
_lock = threading.Lock()
_state = {"depth": 0, "was_enabled": False}


def pause():
    """Turn the collector off if this is the outermost hold (pair with :func:`resume`)."""
    with _lock:
        if _state["depth"] == 0:
            _state["was_enabled"] = gc.isenabled()
            gc.disable()
        _state["depth"] += 1


def resume():
    """End a hold: the collector back on after the outermost, if it was on before it."""
    with _lock:
        _state["depth"] -= 1
        if _state["depth"] == 0 and _state["was_enabled"]:
            gc.enable()


@contextlib.contextmanager
def paused():
    """A hold for the ``with`` block (none when ``NUMBA_FLASH_GC_PAUSE=0``)."""
    if os.environ.get(ENV, "1") == "0":
        yield
        return
    pause()
    try:
        yield
    finally:
        resume()


def _acquire(self):
    """numba-cuda's compiler lock taken, then a hold."""
    _originals["acquire"](self)
    pause()


def _release(self):
    """The hold ended, then the lock released."""
    resume()
    _originals["release"](self)


def install():
    """Hold the collector off while numba-cuda's compiler lock is held (once; True if it applies)."""
    if _originals:
        return True
    if not pinned_numba_cuda(ENV):
        return False
    from numba.cuda.core.compiler_lock import _CompilerLock
    _originals.update(acquire=_CompilerLock.acquire, release=_CompilerLock.release)
    _CompilerLock.acquire, _CompilerLock.release = _acquire, _release
    return True


def uninstall():
    """Undo :func:`install` (tests compare the two)."""
    if not _originals:
        return
    from numba.cuda.core.compiler_lock import _CompilerLock
    _CompilerLock.acquire, _CompilerLock.release = _originals["acquire"], _originals["release"]
    _originals.clear()
