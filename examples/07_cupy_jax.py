"""CuPy and JAX arrays in, CuPy and JAX arrays out (on a GPU with CuPy or JAX installed).

    python examples/07_cupy_jax.py

numba_flash reads device arrays in place (``__cuda_array_interface__`` or DLPack) and
returns results of q's kind: a CuPy array for CuPy inputs, a JAX array for JAX inputs.
Each result is checked against the float64 oracle. Without a GPU there is nothing to
show: the script says so and stops.
"""
import importlib.util

import numpy as np

import numba_flash
from numba_flash import reference

B, H, N, D = 2, 4, 512, 64
shown = 0
if numba_flash.SIMULATOR:
    print("no GPU: CuPy and JAX device arrays need one (NumPy and PyTorch CPU tensors work in the simulator)")
else:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, N, D), dtype=np.float32) for _ in range(3))
    want = reference.attention(q, k, v, causal=True)
    if importlib.util.find_spec("cupy"):
        import cupy as cp
        out = numba_flash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=True)
        assert isinstance(out, cp.ndarray)
        err = float(np.abs(cp.asnumpy(out) - want).max())
        print(f"CuPy in, {type(out).__module__}.{type(out).__name__} out: max error {err:.1e}")
        assert err < 1e-4
        shown += 1
    if importlib.util.find_spec("jax"):
        import jax.numpy as jnp
        out = numba_flash.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True)
        assert "jax" in type(out).__module__, type(out)
        err = float(np.abs(np.asarray(out) - want).max())
        print(f"JAX in, {type(out).__module__}.{type(out).__name__} out: max error {err:.1e}")
        assert err < 1e-4
        shown += 1
    if not shown:
        print("neither CuPy nor JAX is installed: nothing to show")
