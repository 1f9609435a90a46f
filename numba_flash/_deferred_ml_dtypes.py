"""Load ``numba.cuda`` without importing ``ml_dtypes``, and tell numba-cuda about it later.

When ``numba.cuda`` loads, numba-cuda 0.30.4 imports ``ml_dtypes`` for one thing: the entry
of its bfloat16 dtype in ``numba.cuda.np.numpy_support.FROM_DTYPE`` (NumPy dtype -> Numba
type). Importing ``ml_dtypes`` takes 0.8-1.4 s on a slow host, half or more of ``import
numba_flash``, and numba_flash needs it only for bfloat16 host arrays and PyTorch bfloat16
tensors. So :func:`load_numba_cuda` imports ``numba.cuda`` with ``ml_dtypes`` hidden (its
optional-import path), and a finder on ``sys.meta_path`` makes the same entry when anything
imports ``ml_dtypes`` afterwards: a bfloat16 array cannot exist before that import, so every
such array meets the numba-cuda it would have met.

Where ``ml_dtypes`` or ``numba.cuda`` is already imported, numba-cuda is not the pinned
version or ``NUMBA_FLASH_DEFER_ML_DTYPES=0`` (``_runtime.pinned_numba_cuda``), nothing is
deferred.
"""
import importlib.abc
import importlib.util
import sys

NAME = "ml_dtypes"


def register(module):
    """numba-cuda's entry for ``module.bfloat16`` (what its import of ``ml_dtypes`` makes)."""
    import numpy as np
    from numba.cuda import types
    from numba.cuda.np import numpy_support
    numpy_support.FROM_DTYPE[np.dtype(module.bfloat16)] = types.bfloat16
    numpy_support.ml_dtypes = module


class _Loader(importlib.abc.Loader):
    """``ml_dtypes``' own loader, then :func:`register`."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        register(module)

    def __getattr__(self, name):      # get_data, get_resource_reader, ...: the wrapped loader's
        return getattr(self.loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``ml_dtypes`` as the other finders do, its loader wrapped (once)."""

    def find_spec(self, name, path=None, target=None):
        if name != NAME:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def load_numba_cuda():
    """Import ``numba.cuda`` with ``ml_dtypes`` deferred (see the module's docstring);
    returns whether it was."""
    if NAME in sys.modules or "numba.cuda" in sys.modules or importlib.util.find_spec(NAME) is None:
        return False
    sys.modules[NAME] = None            # `import ml_dtypes` raises ImportError: numba-cuda's optional path
    try:
        import numba.cuda  # noqa: F401
    finally:
        del sys.modules[NAME]
    sys.meta_path.insert(0, _Finder())
    return True
