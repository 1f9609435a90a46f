"""The kernel ladder: FlashAttention forward in eight small steps, one file per rung.

A teaching sub-package. Every rung solves the seed problem of docs/ladder.md — one
head, ``O = softmax(Q Kᵀ / √d) V`` with Q, K, V of shape (N, d), float32, no mask —
and differs from the previous rung by one idea (``diff k03_*.py k04_*.py``)::

    >>> from numba_flash.ladder import RUNGS
    >>> for rung in RUNGS:
    ...     out = rung(q, k, v)        # 2-D float32, NumPy in -> NumPy out

The repetition between neighbouring rungs is deliberate: each file stands alone so
that a learner can read it top to bottom and ``diff`` it against the one before; the
production kernels, by contrast, share their building blocks (``kernels/tiles.py``).

``RUNGS`` is the one list: the tests, ``python bench.py ladder``, the tour example and
the tables of docs/ladder.md are generated from it. The production kernels live in
``numba_flash.kernels``; these are deliberately simpler.
"""
import dataclasses
import importlib
import types

import numpy as np

__all__ = ["RUNGS", "Rung", "rung", "seed_inputs"]


@dataclasses.dataclass(frozen=True)
class Rung:
    """One rung: ``rung(q, k, v) -> out``, equivalent to ``numba_flash.reference.attention``.

    ``ptx_claims``: PTX instructions its kernel must contain (checked offline by the
    tests). ``vector``: it moves rows 16 bytes at a time, so needs ``d % 4 == 0``.
    ``seed_h200_ms``: the seed's C++ original of this step, measured on an H200 (the
    target; None where the seed has no such kernel). ``local_memory``: None when its
    register tiles stay in registers (no ``.local`` in the PTX; checked for rungs 3-8),
    else why they do not.
    """
    number: int
    slug: str
    title: str
    change: str
    ptx_claims: tuple
    vector: bool
    seed_h200_ms: float
    local_memory: str
    module: types.ModuleType = dataclasses.field(repr=False, compare=False)

    @property
    def name(self):
        return f"k{self.number:02d}_{self.slug}"

    def __call__(self, q, k, v):
        return self.module.attention(q, k, v)

    def kernel(self, simulator=None):
        """The kernel (a Numba dispatcher, compiled on first launch) at the tiles of this mode,
        or at the GPU tiles (``simulator=False``) or the simulator's (``True``)."""
        m = self.module
        tiles = m.TILES if simulator is None else (m.SIM_TILES if simulator else m.GPU_TILES)
        return m.make_kernel(**tiles)


def _rung(number, slug, title, change, ptx_claims=(), vector=False, seed_h200_ms=None, local_memory=None):
    module = importlib.import_module(f"{__name__}.k{number:02d}_{slug}")
    return Rung(number, slug, title, change, tuple(ptx_claims), vector, seed_h200_ms, local_memory, module)


RUNGS = (
    _rung(1, "baseline", "Baseline tiling",
          "one thread per output element; scores from global memory; shared-memory reduction trees",
          seed_h200_ms=155.9),
    _rung(2, "smem_tiles", "Coalesced shared-memory tiles",
          "warp spans a tile row; Q, K, V staged in shared memory with coalesced loads",
          seed_h200_ms=15.9),
    _rung(3, "register_tiles", "Register tiling, warp shuffles",
          "a TM×TV tile of outputs per thread in registers; row max/sum by warp butterflies",
          ptx_claims=("shfl.sync",), seed_h200_ms=2.21),
    _rung(4, "buffer_reuse", "Q_i loaded once (buffer reuse)",
          "the whole Br × d block of Q copied to shared memory once and reused by every key tile",
          ptx_claims=("shfl.sync",), seed_h200_ms=2.57),
    _rung(5, "float4", "float4 vectorization",
          "128-bit global and shared loads/stores; K rows unpadded (16-byte aligned): 32-way bank conflict",
          ptx_claims=("shfl.sync", "ld.global.v4", "ld.shared.v4", "st.shared.v4"), vector=True,
          seed_h200_ms=2.20),
    _rung(6, "smem_layout", "Conflict-free shared-memory layout",
          "K rows padded by 4 words: 16-byte aligned and 4 banks apart, so 128-bit reads are conflict-free",
          ptx_claims=("shfl.sync", "ld.global.v4", "ld.shared.v4", "st.shared.v4"), vector=True,
          seed_h200_ms=1.56),
    _rung(7, "double_buffer", "Double-buffered pipeline",
          "cp.async copies; K chunk c+1 and V_j in flight while chunk c is computed",
          ptx_claims=("shfl.sync", "ld.shared.v4", "cp.async"), vector=True, seed_h200_ms=1.39),
    _rung(8, "tensor_cores", "Tensor cores (mma.sync TF32, 3×TF32)",
          "Q·Kᵀ and P·V as mma.sync m16n8k8 TF32, each fp32 product as 3 TF32 products (fp32 accuracy); "
          "warp pairs share query rows, so 256 output columns per block",
          ptx_claims=("shfl.sync", "cp.async", "mma.sync"), vector=True, seed_h200_ms=10.1),
)


def rung(key):
    """A rung by number (``3``), slug (``"register_tiles"``) or name (``"k03_register_tiles"``)."""
    for r in RUNGS:
        if key in (r.number, r.slug, r.name):
            return r
    raise KeyError(f"no rung {key!r}; the rungs are " + ", ".join(r.name for r in RUNGS))


def seed_inputs(n, d, seed=0):
    """q, k, v of shape (n, d), float32, drawn as the seed article draws them: each value is
    ``(r mod 5) + 0.01·(r′ mod 5)`` with a random sign, r and r′ random integers (so
    |values| <= 4.04, and logits of d = 1024 have a spread of ~6 after the 1/√d scale)."""
    rng = np.random.default_rng(seed)

    def one():
        r, r2 = rng.integers(0, 2**31 - 1, size=(2, n, d))
        sign = np.where(rng.random((n, d)) < 0.5, -1.0, 1.0)
        return (sign * ((r % 5) + 0.01 * (r2 % 5))).astype(np.float32)
    return one(), one(), one()
