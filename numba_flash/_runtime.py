"""Choose between a real GPU and Numba's CUDA simulator, before numba is imported.

Numba reads ``NUMBA_ENABLE_CUDASIM`` once, at import time, so the choice has to be
made here, first thing in ``numba_flash/__init__.py``.

* If the user has set ``NUMBA_ENABLE_CUDASIM`` (to anything), we obey it.
* Otherwise we ask the CUDA driver (``libcuda``, through ctypes, without importing
  numba) whether a device exists. If not, we switch the simulator on and say so once
  with a :class:`SimulatorWarning`.

``SIMULATOR`` is the decision; every other module reads it from here.
"""
import ctypes
import os
import sys
import warnings


class SimulatorWarning(UserWarning):
    """numba_flash is running its kernels in Numba's CUDA simulator (slow, for tiny inputs)."""


def _gpu_present():
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        try:
            return lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0
        except AttributeError:
            return False
    return False


def _decide():
    if "NUMBA_ENABLE_CUDASIM" in os.environ:
        return os.environ["NUMBA_ENABLE_CUDASIM"] not in ("", "0")
    if _gpu_present():
        return False
    numba = sys.modules.get("numba")
    if numba is not None and not numba.config.ENABLE_CUDASIM:
        # numba was imported before us without the simulator: too late to switch it on.
        return False
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    warnings.warn(
        "numba_flash: no CUDA GPU found, so kernels run in Numba's CUDA simulator "
        "(correct but very slow: use tiny inputs). Set NUMBA_ENABLE_CUDASIM=0 to disable this.",
        SimulatorWarning, stacklevel=3)
    return True


def _thread_safe_static_shared_arrays():
    """Numba's simulator creates a block's static ``cuda.shared.array`` when the first of
    its threads asks for it, with no lock: two threads can each create one, and the block's
    threads then disagree on what is shared (a wrong answer now and then, in a kernel that
    is right). The same lookup, under a lock. Dynamic shared memory is unaffected."""
    import threading
    import traceback

    import numpy as np
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    shared = getattr(kernelapi, "FakeCUDAShared", None)
    original = getattr(shared, "array", None)
    if original is None or getattr(original, "thread_safe", False):
        return
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None or not hasattr(self, "_allocations"):
            return original(self, shape, dtype, alignment)
        caller = traceback.extract_stack(sys._getframe(1), limit=1)[-1][0:2]   # as the original keys it
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res

    array.thread_safe = True
    shared.array = array


SIMULATOR = _decide()
if SIMULATOR:
    _thread_safe_static_shared_arrays()
