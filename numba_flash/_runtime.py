"""Choose between a real GPU and Numba's CUDA simulator, before ``numba.cuda`` is imported.

``numba.cuda`` reads ``NUMBA_ENABLE_CUDASIM`` once, when it is first imported, and
loads either the GPU driver bindings or the simulator; it cannot be switched afterwards.
So the choice is made here, first thing in ``numba_flash/__init__.py``:

* If the user has set ``NUMBA_ENABLE_CUDASIM`` (to anything), we obey it.
* Otherwise we ask the CUDA driver (``libcuda``, through ctypes, without importing
  numba) whether a device exists. If not, we switch the simulator on and say so once
  with a :class:`SimulatorWarning`, reported at the line that imported numba_flash;
  except in ``python -m numba_flash.ptx``, which only compiles (the simulator cannot).

The import order does not matter as long as ``numba.cuda`` comes after us: if only
``numba`` was imported before (``import numba``), its configuration is re-read so that
it agrees. If ``numba.cuda`` was already imported in the other mode, nothing can switch
it, and ``import numba_flash`` raises an ImportError that says what to do.

``SIMULATOR`` is the decision; every other module reads it from here.
"""
import ctypes
import os
import sys
import warnings

ENV = "NUMBA_ENABLE_CUDASIM"
_HERE = os.path.dirname(os.path.abspath(__file__))


class SimulatorWarning(UserWarning):
    """numba_flash is running its kernels in Numba's CUDA simulator (slow, for tiny inputs)."""


def pinned_numba_cuda(env):
    """Whether a change to numba-cuda's internals may be made: numba-cuda is the version
    this package pins (0.30.4, whose internals it was written against) and the environment
    variable ``env`` does not turn it off (``=0``)."""
    if os.environ.get(env, "1") == "0":
        return False
    try:
        from importlib.metadata import version
        return version("numba-cuda") == "0.30.4"
    except Exception:  # noqa: BLE001 - no metadata: another installation, leave it alone
        return False


def classes_named(name, modules):
    """The distinct classes called ``name`` in those of ``modules`` (dotted names) that
    import and have one: numba and numba-cuda each keep their own copy of some classes."""
    import importlib
    found = []
    for module in modules:
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            cls = None
        if cls is not None and cls not in found:
            found.append(cls)
    return found


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


def _loaded_mode():
    """How ``numba.cuda`` was imported before us: True (simulator), False (GPU), None (not yet)."""
    if "numba.cuda" not in sys.modules:
        return None
    return "numba.cuda.simulator_init" in sys.modules


def _sync_numba_config(simulator):
    """Make the numba configurations already imported (``numba.config``, numba-cuda's own)
    agree with ``NUMBA_ENABLE_CUDASIM``, so the ``numba.cuda`` imported next takes our mode."""
    for name in ("numba.core.config", "numba.cuda.core.config"):
        config = sys.modules.get(name)
        if config is not None and bool(getattr(config, "ENABLE_CUDASIM", simulator)) != simulator:
            config.reload_config()


def _too_late(loaded, wanted, reason):
    found = "Numba's CUDA simulator" if loaded else "GPU mode"
    return ImportError(
        f"numba_flash: numba.cuda was imported before numba_flash, in {found}, but {reason}, and "
        "numba.cuda cannot switch modes once imported. Either import numba_flash before anything "
        "imports numba.cuda (put `import numba_flash` above `from numba import cuda`), or set "
        f"{ENV}={1 if wanted else 0} before starting Python (e.g. `{ENV}={1 if wanted else 0} python "
        "your_script.py`).")


def _user_stacklevel():
    """``warnings.warn``'s stacklevel for the first frame outside numba_flash: the line
    that imported it. (``warnings`` itself skips importlib's frames, so they are not counted.)"""
    level, frame = 0, sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not ("importlib" in name and "_bootstrap" in name):
            level += 1
            if not name.startswith(_HERE + os.sep):
                break
        frame = frame.f_back
    return max(level, 1)


def _offline_compile():
    """True in ``python -m numba_flash.ptx`` (the command-line PTX compiler)."""
    argv = list(getattr(sys, "orig_argv", ()))
    return any(a == "-m" and b == "numba_flash.ptx" for a, b in zip(argv, argv[1:]))


def _decide():
    loaded = _loaded_mode()
    if ENV in os.environ:
        simulator = os.environ[ENV] not in ("", "0")
        if loaded is not None and loaded != simulator:
            raise _too_late(loaded, simulator, f"{ENV}={os.environ[ENV]} asks for "
                            + ("the simulator" if simulator else "a GPU"))
        _sync_numba_config(simulator)
        return simulator
    if loaded is not None:           # numba.cuda came first and chose; we can only follow it
        if not loaded and not sys.modules["numba.cuda"].is_available():
            raise _too_late(loaded, True, "this machine has no usable CUDA GPU")
        return loaded
    if _gpu_present():
        _sync_numba_config(False)
        return False
    if _offline_compile():           # compiles kernels to PTX; the simulator cannot, no GPU is needed
        os.environ[ENV] = "0"
        _sync_numba_config(False)
        return False
    os.environ[ENV] = "1"
    _sync_numba_config(True)
    warnings.warn(
        "numba_flash: no CUDA GPU found, so kernels run in Numba's CUDA simulator: correct but very "
        "slow, so use tiny inputs. (Where a CUDA GPU is present numba_flash uses it.) To choose the "
        f"simulator without this notice, set {ENV}=1 before starting Python.",
        SimulatorWarning, stacklevel=_user_stacklevel())
    return True


def _thread_safe_static_shared_arrays():
    """Numba's simulator creates a block's static ``cuda.shared.array`` when the first of
    its threads asks for it, with no lock: two threads can each create one, and the block's
    threads then disagree on what is shared (a wrong answer now and then, in a kernel that
    is right). The same lookup, under a lock. Dynamic shared memory is unaffected.

    The simulator also rejects ``alignment=``, which compiled kernels need (the Hopper
    kernels ask for 1024); here it is accepted and ignored: a simulated kernel computes no
    addresses from its arrays (``ops_hopper``'s twins hand out aligned fake ones)."""
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
        if shape == 0 or not hasattr(self, "_allocations"):
            return original(self, shape, dtype)
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
if pinned_numba_cuda("NUMBA_FLASH_DEFER_ML_DTYPES"):
    from . import _deferred_ml_dtypes
    _deferred_ml_dtypes.load_numba_cuda()     # `import numba_flash` 0.8-1.4 s sooner on a slow host
if SIMULATOR:
    _thread_safe_static_shared_arrays()
    from . import _simulator
    _simulator.install()          # an event-driven block manager: 1.3-2.6x faster simulator launches
