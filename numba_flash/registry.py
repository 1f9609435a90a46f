"""The one list of kernel specialisations.

Everything that needs to know which kernels exist (the API's dispatch, the PTX
tests, the GPU test-suite, ``bench.py``) asks this module. A *variant* is a kernel
family with a tiling rule; a *specialisation* is one compiled kernel: variant ×
dtype × head dim × causal.
"""
import dataclasses

import numpy as np

from ._runtime import SIMULATOR
from .kernels.forward import Tiling, make_forward, smem_words

# Head dims the GPU suite, the PTX tests and the benchmark exercise (any other d works too).
HEAD_DIMS = (32, 64, 96, 128, 256, 1024)
DTYPES = ("float32", "float64")


def _round_up(x, m):
    return -(-x // m) * m


def forward_tiling(dtype_name: str, d: int, simulator: bool = SIMULATOR) -> Tiling:
    """Tile shape of the CUDA-core forward for this dtype and head dim.

    The rules (measured on the H200, see docs/performance.md):

    * float32, d <= 64: 128 query rows × 64 keys per block, 8 × 8 scores and
      8 × d/8 outputs per thread; the whole head dim in shared memory.
    * float32, 64 < d <= 128: 128 query rows × 64 keys per block, 8 × 4 scores and
      8 × d/16 outputs per thread.
    * float32, 128 < d <= 256: 64 query rows per block (registers for 4 × d/16 outputs).
    * d > 256: the head dim is streamed in 64-wide chunks for S = Q Kᵀ and the output
      is split in 256-column slices across blocks (grid axis y).
    * float64: half the register tile of float32 (each double takes two registers).
    * In the simulator: 32-thread blocks with tiny tiles, chosen so that small test
      shapes still cross tile edges, head-dim chunks and output slices.
    """
    if simulator:
        return Tiling(TM=2, TN=2, CG=4, RG=8, DK=16, DO=16)
    if dtype_name == "float32":
        if d <= 64:
            return Tiling(TM=8, TN=8, CG=8, RG=16, DK=_round_up(d, 8), DO=_round_up(d, 32))
        if d <= 128:
            return Tiling(TM=8, TN=4, CG=16, RG=16, DK=_round_up(d, 8), DO=_round_up(d, 64))
        if d <= 256:
            return Tiling(TM=4, TN=4, CG=16, RG=16, DK=_round_up(d, 8), DO=_round_up(d, 64))
        return Tiling(TM=2, TN=4, CG=16, RG=16, DK=64, DO=256)
    if dtype_name == "float64":
        if d <= 64:
            return Tiling(TM=4, TN=4, CG=16, RG=16, DK=_round_up(d, 8), DO=64)
        return Tiling(TM=4, TN=2, CG=16, RG=16, DK=64, DO=64)
    raise KeyError(dtype_name)


@dataclasses.dataclass(frozen=True)
class Specialisation:
    """One compiled kernel."""
    variant: str
    dtype: str
    d: int
    causal: bool
    use_async: bool   # cp.async tile loads (needs 16-byte aligned rows and unit inner stride)
    tiling: Tiling

    @property
    def name(self):
        return (f"{self.variant}/{self.dtype}/d{self.d}/{'causal' if self.causal else 'full'}"
                f"/{'async' if self.use_async else 'plain'}")

    @property
    def smem_bytes(self):
        return smem_words(self.d, self.tiling) * (4 if self.dtype == "float32" else 8)

    def kernel(self):
        return make_forward(self.dtype, self.d, self.tiling, self.causal, self.use_async)

    def signature(self, layout="C"):
        """Numba signature string for PTX compilation (4-D q, k, v, out; 3-D lse)."""
        a4 = f"{self.dtype}[:, :, :, ::1]" if layout == "C" else f"{self.dtype}[:, :, :, :]"
        return f"void({a4}, {a4}, {a4}, {self.dtype}[:, :, :, ::1], {self.dtype}[:, :, ::1], {self.dtype})"


VARIANTS = {
    "forward_simt": "FlashAttention-2 forward on CUDA cores (float32, float64)",
}


def async_possible(dtype_name: str, d: int):
    """cp.async moves 16 bytes: rows of d elements must be a whole number of them."""
    return d % (16 // np.dtype(dtype_name).itemsize) == 0


def forward_specialisation(dtype_name: str, d: int, causal: bool, use_async: bool,
                           simulator: bool = SIMULATOR):
    return Specialisation("forward_simt", dtype_name, d, causal, use_async and async_possible(dtype_name, d),
                          forward_tiling(dtype_name, d, simulator))


def specialisations(simulator: bool = False):
    """Every specialisation the project builds for the GPU (or the simulator's tiny ones)."""
    for dt in DTYPES:
        for d in HEAD_DIMS:
            for causal in (False, True):
                for use_async in (True, False):
                    yield forward_specialisation(dt, d, causal, use_async, simulator)
