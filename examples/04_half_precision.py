"""float16 and bfloat16 on tensor cores: NumPy, Numba device arrays and (with a GPU) PyTorch.

    python examples/04_half_precision.py

The 16-bit forward computes scores, softmax and sums in float32 and rounds P to the
input dtype for the P·V product, so its error is that of the 16-bit output itself.
bfloat16 on the host is ``ml_dtypes.bfloat16`` (NumPy has none of its own).
"""
import ml_dtypes
import numpy as np

import numba_flash
from numba_flash import reference

B, H, N, D = (1, 2, 40, 32) if numba_flash.SIMULATOR else (2, 8, 2048, 128)
rng = np.random.default_rng()

for dtype in (np.float16, ml_dtypes.bfloat16):
    q, k, v = (rng.standard_normal((B, H, N, D)).astype(dtype) for _ in range(3))
    out, lse = numba_flash.attention_fwd(q, k, v, causal=True)        # NumPy in, NumPy out
    want, _ = reference.attention_fwd(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
    err = np.abs(out.astype(np.float64) - want).max()
    eps = float(ml_dtypes.finfo(dtype).eps)
    print(f"{np.dtype(dtype).name}: out {out.dtype}, lse {lse.dtype}, max error {err:.1e} "
          f"(unit roundoff of the dtype: {eps / 2:.1e})")
    assert out.dtype == dtype and lse.dtype == np.float32
    assert err < 4 * eps * max(1.0, np.abs(want).max())

    # Device arrays in, device arrays out. numba.cuda.to_device cannot read a bfloat16
    # buffer; numba_flash.to_device can (it copies the bits and views them back).
    qd, kd, vd = (numba_flash.to_device(x) for x in (q, k, v))
    out_d, lse_d = numba_flash.attention_fwd(qd, kd, vd, causal=True)
    assert out_d.dtype == dtype
    np.testing.assert_array_equal(out_d.copy_to_host().view(np.uint16), out.view(np.uint16))
    print(f"{np.dtype(dtype).name}: device arrays give the same bits")

try:
    import torch
    have_torch_gpu = torch.cuda.is_available()
except ImportError:
    have_torch_gpu = False
if have_torch_gpu and not numba_flash.SIMULATOR:
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, _ = numba_flash.attention_fwd(q, k, v, causal=True)   # on torch's current stream; a bfloat16 tensor back
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    print(f"PyTorch bfloat16: max |ours - SDPA| = {float((out.float() - ref.float()).abs().max()):.1e}")
