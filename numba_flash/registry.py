"""The one list of kernel specialisations.

Everything that needs to know which kernels exist (the API's dispatch, the PTX
tests, the GPU test-suite, ``bench.py``) asks this module. A *variant* is a kernel
family with a tiling rule (``VARIANTS``); a *specialisation* is one compiled kernel:
variant × dtype × head dim × causal × load path (``specialisations()``).
"""
import dataclasses

import numpy as np

from ._runtime import SIMULATOR
from .kernels.backward import make_backward, make_delta
from .kernels.backward import smem_words as bwd_smem_words
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


def backward_tiling(dtype_name: str, d: int, simulator: bool = SIMULATOR) -> Tiling:
    """Tile shape of the CUDA-core backward kernels (``dkdv`` and ``dq`` share it).

    Rows (``RG·TM``) are the block's own keys (dK/dV) or queries (dQ); columns
    (``CG·TN``) the streamed ones. Two accumulators (dK and dV) per row and four
    operand tiles in shared memory make the tiles half the forward's.

    * float32, d <= 128: 64 × 64 tiles, 4 × 4 scores per thread, head dim resident.
    * float32, 128 < d <= 256: 32 × 32 tiles.
    * d > 256: 32 × 64 tiles, head dim streamed in 64-wide chunks, 256-wide output slices.
    * float64: 32 × 32 tiles; d > 64 streamed in 32-wide chunks with 64-wide slices.
    * In the simulator: tiny tiles, as for the forward.
    """
    if simulator:
        return Tiling(TM=2, TN=2, CG=4, RG=8, DK=16, DO=16)
    if dtype_name == "float32":
        if d <= 128:
            return Tiling(TM=4, TN=4, CG=16, RG=16, DK=_round_up(d, 8), DO=_round_up(d, 64))
        if d <= 256:
            return Tiling(TM=2, TN=2, CG=16, RG=16, DK=_round_up(d, 8), DO=_round_up(d, 64))
        return Tiling(TM=2, TN=4, CG=16, RG=16, DK=64, DO=256)
    if dtype_name == "float64":
        if d <= 64:
            return Tiling(TM=2, TN=2, CG=16, RG=16, DK=_round_up(d, 8), DO=64)
        return Tiling(TM=2, TN=2, CG=16, RG=16, DK=32, DO=64)
    raise KeyError(dtype_name)


def _a4(dtype, layout):
    return f"{dtype}[:, :, :, ::1]" if layout == "C" else f"{dtype}[:, :, :, :]"


@dataclasses.dataclass(frozen=True)
class Variant:
    """A kernel family: how to tile it, build it, size its shared memory and type it."""
    name: str
    title: str
    tiling: object          # (dtype, d, simulator) -> Tiling | None
    build: object           # Specialisation -> kernel
    smem_words: object      # (d, tiling) -> int
    signature: object       # (dtype, layout) -> numba signature string


def _sig_forward(dt, layout):
    a = _a4(dt, layout)
    return f"void({a}, {a}, {a}, {dt}[:, :, :, ::1], {dt}[:, :, ::1], {dt})"


def _sig_backward(dt, layout):
    a = _a4(dt, layout)
    return f"void({a}, {a}, {a}, {a}, {dt}[:, :, ::1], {dt}[:, :, ::1], {a}, {a}, {dt}, {dt})"


VARIANTS = {v.name: v for v in (
    Variant("forward_simt", "FlashAttention-2 forward on CUDA cores", forward_tiling,
            lambda s: make_forward(s.dtype, s.d, s.tiling, s.causal, s.use_async),
            smem_words, _sig_forward),
    Variant("backward_dkdv_simt", "backward: dK, dV (a block per key tile)", backward_tiling,
            lambda s: make_backward("dkdv", s.dtype, s.d, s.tiling, s.causal, s.use_async),
            lambda d, t: bwd_smem_words(d, t, "dkdv"), _sig_backward),
    Variant("backward_dq_simt", "backward: dQ (a block per query tile)", backward_tiling,
            lambda s: make_backward("dq", s.dtype, s.d, s.tiling, s.causal, s.use_async),
            lambda d, t: bwd_smem_words(d, t, "dq"), _sig_backward),
    Variant("backward_delta", "backward pre-pass: delta = rowsum(dO ∘ O)", lambda dt, d, sim: None,
            lambda s: make_delta(s.dtype), lambda d, t: 0,
            lambda dt, layout: f"void({_a4(dt, layout)}, {_a4(dt, layout)}, {dt}[:, :, ::1])"),
)}


@dataclasses.dataclass(frozen=True)
class Specialisation:
    """One compiled kernel: a variant at one dtype, head dim, causality and load path."""
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
        return VARIANTS[self.variant].smem_words(self.d, self.tiling) * np.dtype(self.dtype).itemsize

    def kernel(self):
        return VARIANTS[self.variant].build(self)

    def signature(self, layout="C"):
        """Numba signature string, for PTX compilation without a GPU."""
        return VARIANTS[self.variant].signature(self.dtype, layout)


def async_possible(dtype_name: str, d: int):
    """cp.async moves 16 bytes: rows of d elements must be a whole number of them."""
    return d % (16 // np.dtype(dtype_name).itemsize) == 0


def specialisation(variant: str, dtype_name: str, d: int, causal: bool = False, use_async: bool = False,
                   simulator: bool = SIMULATOR):
    """The specialisation the API launches for these inputs."""
    v = VARIANTS[variant]
    if v.tiling(dtype_name, d, simulator) is None:      # shape-independent kernels
        return Specialisation(variant, dtype_name, 0, False, False, None)
    return Specialisation(variant, dtype_name, d, causal, use_async and async_possible(dtype_name, d),
                          v.tiling(dtype_name, d, simulator))


def forward_specialisation(dtype_name, d, causal, use_async, simulator=SIMULATOR):
    return specialisation("forward_simt", dtype_name, d, causal, use_async, simulator)


def specialisations(simulator: bool = False):
    """One specialisation per distinct kernel shape the project builds, for the PTX checks.

    The API compiles a kernel per head dim on demand; kernels for head dims that share a
    tiling rule differ only in loop bounds, so each (variant, dtype, thread tile,
    resident-or-chunked head dim, causal, load path) appears once, at the first of
    ``HEAD_DIMS`` that produces it.
    """
    seen = set()
    for variant in VARIANTS:
        for dt in DTYPES:
            for d in HEAD_DIMS:
                for causal in (False, True):
                    for use_async in (True, False):
                        spec = specialisation(variant, dt, d, causal, use_async, simulator)
                        t = spec.tiling
                        key = (variant, dt, spec.causal, spec.use_async) + (
                            () if t is None else (t.TM, t.TN, t.CG, t.RG, d <= t.DK, d <= t.DO))
                        if key not in seen:
                            seen.add(key)
                            yield spec
