"""The one list of kernel specialisations.

Everything that needs to know which kernels exist (the API's dispatch, the PTX
tests, the GPU test-suite, ``bench.py``) asks this module. A *variant* is a kernel
family with a tiling rule (``VARIANTS``); a *specialisation* is one compiled kernel:
variant × dtype × head dim × score rules × load path (``specialisations()``).
"""
import dataclasses

import numpy as np

from . import _kernel_cache
from ._runtime import SIMULATOR
from .scores import FULL, PACKED, PACKED_SPECS, PAGED_SPECS, RULE_SPECS, SCORE_SPECS, ScoreSpec
from .kernels.backward import make_backward, make_delta
from .kernels.backward import smem_words as bwd_smem_words
from .kernels.backward_mma import MmaBwdTiling, make_backward_mma
from .kernels.backward_mma import smem_elements as mma_bwd_smem_elements
from .kernels.copy import make_append, make_copy4
from .kernels.kv_metadata import make_kv_metadata
from .kernels.merge import make_merge_finish, make_merge_into
from .kernels.forward import MAX_SPLITS, Tiling, make_forward, make_merge, smem_words
from .kernels.forward_mma import MmaTiling, make_forward_mma
from .kernels.forward_mma import smem_elements as mma_smem_elements
from .kernels import backward_wgmma, forward_wgmma

# Head dims the GPU suite, the PTX tests and the benchmark exercise (any other d works too).
HEAD_DIMS = (32, 64, 96, 128, 256, 1024)
RULE_SPEC_D = 64      # the head dim at which specialisations() compiles scores.RULE_SPECS
RULE_LOW_DTYPE = "bfloat16"   # ... and the one 16-bit dtype it compiles them for
DTYPES = ("float32", "float64")            # CUDA-core kernels (forward and backward)
LOW_DTYPES = ("float16", "bfloat16")       # tensor-core kernels
MMA_MAX_D = 256                            # tensor-core kernels: d a multiple of 8, at most this


def _round_up(x, m):
    return -(-x // m) * m


def itemsize(dtype_name: str) -> int:
    """Bytes per element (bfloat16 has no NumPy name of its own)."""
    return 2 if dtype_name in LOW_DTYPES else np.dtype(dtype_name).itemsize


def forward_tiling(dtype_name: str, d: int, simulator: bool = SIMULATOR) -> Tiling:
    """Tile shape of the CUDA-core forward for this dtype and head dim.

    The rules (measured on the H200, see docs/performance.md):

    * float32, d <= 64: 128 query rows × 64 keys per block, 8 × 8 scores and
      8 × d/8 outputs per thread; the whole head dim in shared memory.
    * float32, 64 < d <= 128: 128 query rows × 64 keys per block, 8 × 4 scores and
      8 × d/16 outputs per thread.
    * float32, 128 < d <= 256: 64 query rows per block (registers for 4 × d/16 outputs).
    * float32, d > 256: 32 query rows × 32 keys per block, 2 × 2 scores and 2 × 64
      outputs per thread; the head dim streamed in 64-wide chunks for S = Q Kᵀ, and the
      output in 1024-column slices (grid axis y; one slice up to d = 1024, so S is never
      recomputed).
    * GPUs whose shared memory per block cannot hold these tiles (an A100's 163 KiB:
      float32 with d > 64 needs up to 211 KiB here) get ``forward_tiling_compact``.
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
        return Tiling(TM=2, TN=2, CG=16, RG=16, DK=64, DO=1024)
    if dtype_name == "float64":
        if d <= 64:
            return Tiling(TM=4, TN=4, CG=16, RG=16, DK=_round_up(d, 8), DO=64)
        return Tiling(TM=4, TN=2, CG=16, RG=16, DK=64, DO=64)
    raise KeyError(dtype_name)


def forward_tiling_compact(dtype_name: str, d: int, simulator: bool = SIMULATOR) -> Tiling:
    """``forward_tiling`` for GPUs with less shared memory per block than that rule's
    choice needs (the A100's 163 KiB; an H200 has 227). float32 only (float64's tiles
    need at most 139 KiB): d <= 128 with 64-row blocks (118 KiB), larger d streamed in
    64-wide chunks with 256-column output slices (124 KiB). Correct on any GPU; only
    the first rule's tilings are measured (docs/performance.md)."""
    if dtype_name == "float32" and d > 64 and not simulator:
        if d <= 128:
            return Tiling(TM=4, TN=4, CG=16, RG=16, DK=_round_up(d, 8), DO=_round_up(d, 64))
        return Tiling(TM=2, TN=4, CG=16, RG=16, DK=64, DO=256)
    return forward_tiling(dtype_name, d, simulator)


def mma_tiling(dtype_name: str, d: int, simulator: bool = SIMULATOR) -> MmaTiling:
    """Tile shape of the tensor-core forward (float16, bfloat16; d a multiple of 8, <= 256).

    Each warp owns ``16 · MT`` query rows. The rules (a sweep on the H200, bfloat16,
    (4, 16 or 32, 4096, d), docs/performance.md):

    * d <= 64: 8 warps × 32 rows (256 query rows) × 64-key tiles; Q's fragments stay in
      registers (136 TFLOP/s; 4 warps × 16 rows: 105).
    * d <= 128: 8 warps × 16 rows (128 query rows) × 64-key tiles, Q in registers (160;
      4 warps: 140; 128-key tiles: 96). Two row blocks per warp do not fit the registers.
    * d <= 256: 8 warps × 16 rows × 32-key tiles; Q re-read from shared memory per tile,
      the registers go to the 16 × 256 output accumulators (159; 4 warps: 145).
    * In the simulator: one warp × 16-key tiles, so tiny shapes cross tile edges (the
      other branches are tested there with explicit tilings).
    """
    if simulator:
        return MmaTiling(WARPS=1, BN=16, Q_IN_REGS=d <= 32)
    if d <= 64:
        return MmaTiling(WARPS=8, BN=64, Q_IN_REGS=True, MT=2)
    if d <= 128:
        return MmaTiling(WARPS=8, BN=64, Q_IN_REGS=True)
    return MmaTiling(WARPS=8, BN=32, Q_IN_REGS=False)


# Query rows per sequence (per query tile of the grid) up to which the tensor-core forward
# runs one warp per block with key splits (forward_mma_split): decoding and short chunks.
SPLIT_ROWS = 16


def mma_split_tiling(dtype_name: str, d: int, simulator: bool = SIMULATOR) -> MmaTiling:
    """Tile shape of the tensor-core forward for at most ``SPLIT_ROWS`` query rows: one warp
    (16 rows, the M of one ``mma``) per block, so that a block's products are not spent on
    padding rows and the keys, split across blocks, are read at the memory's pace.

    * d <= 64: 64-key tiles, Q in registers (ptxas, sm_90: 164 registers, 38 KiB of
      shared memory: five blocks per SM on an H200);
    * d <= 128: 32-key tiles, Q in registers (204 registers, 38 KiB; 64-key tiles need
      255 registers and spill);
    * d <= 256: 16-key tiles, Q re-read from shared memory per tile (238 registers,
      41 KiB; 32-key tiles need 255).
    * In the simulator: 16-key tiles, as ``mma_tiling``.

    (Chosen from ptxas's counts and the byte counts, not yet a sweep on a GPU.)
    """
    if simulator:
        return MmaTiling(WARPS=1, BN=16, Q_IN_REGS=d <= 32)
    if d <= 64:
        return MmaTiling(WARPS=1, BN=64, Q_IN_REGS=True)
    if d <= 128:
        return MmaTiling(WARPS=1, BN=32, Q_IN_REGS=True)
    return MmaTiling(WARPS=1, BN=16, Q_IN_REGS=False)


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


def mma_backward_tiling(kind: str):
    """The tiling rule of the tensor-core backward kernel ``kind`` ("dkdv", "dq"):
    ``(dtype, d, simulator) -> MmaBwdTiling``.

    * 4 warps × 16 rows (64 keys or queries per block); streamed tiles of 32 columns for
      dK/dV (its two 16 × d accumulators per warp take the registers: at d = 64, 64
      columns ran 10% faster but spilt with softcap and ALiBi), 64 for dQ up to d = 128
      (H200, bf16 (4, 16, 4096, d), kernels alone: at d = 128 dQ 2.86 ms with 64 columns,
      3.21 with 32, 3.05 with 8 warps; dK/dV 3.99 ms with 4 warps × 32 columns, 4.33 with
      8 warps, 4.67 with 16 columns; at d = 64 dK/dV 2.18 ms with 32 columns, 1.96 with
      64, 2.49 with 8 warps; dQ 1.56 with 4 warps, 1.81 with 8);
    * the head dim's outputs in one block up to d = 128, in 128-column slices beyond
      (grid axis y; each slice recomputes S and dP).
    * In the simulator: one warp, 16-column tiles and 32-column output slices, so that
      tiny shapes cross tile edges and slices.
    """
    def rule(dtype_name: str, d: int, simulator: bool = SIMULATOR) -> MmaBwdTiling:
        if simulator:
            return MmaBwdTiling(WARPS=1, BC=16, DO=32)
        dp = _round_up(d, 16)
        return MmaBwdTiling(WARPS=4, BC=64 if kind == "dq" and d <= 128 else 32, DO=min(dp, 128))
    return rule


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
    dtypes: tuple = DTYPES
    head_dims: object = lambda d: True   # d -> whether this variant supports it
    # (d, scores) -> whether a GPU of its ``arch`` takes it by default (None: ``head_dims``);
    # the others only where forced (``hopper_choice``)
    default_dims: object = None
    direction: str = None   # "forward" / "backward": a family computing that direction (None: a helper)
    compact: object = None  # (dtype, d, simulator) -> Tiling for GPUs with less shared memory
    plain_compact: object = None  # (dtype, d) -> whether plain-load kernels take the compact tiling
    async_only: bool = False      # cp.async loads only (the API gives such kernels aligned rows)
    arch: str = None        # "sm_90a": Hopper instructions, built and run for compute capability 9.0 only
    packed: bool = False    # takes packed sequences (scores.ScoreSpec.packed: varlen batches, KV caches)
    paged: bool = False     # takes paged KV caches (scores.ScoreSpec.paged)
    ptx_dims: tuple = None  # the head dims specialisations() builds it at (None: HEAD_DIMS)
    ptx_rules: bool = True  # specialisations() builds it with scores.RULE_SPECS too
    # (dtype, d, scores, rows) -> Tiling: the tiling where it depends on the rules or on the
    # call's query rows per sequence (``rows``; None where unknown)
    rules_tiling: object = None


def _sig_scores(acc):
    """The score arguments every attention kernel ends with (``numba_flash.scores``):
    window sides, softcap factors, ALiBi slopes (a stride-0 view: layout A)."""
    return f"int64, int64, {acc}, {acc}, {acc}[:, :, :]"


def _sig_forward(dt, layout, packed=False):
    a = _a4(dt, layout)
    o, l = (f"{dt}[:, :, :, :]", f"{dt}[:, :, :]") if packed else (f"{dt}[:, :, :, ::1]", f"{dt}[:, :, ::1]")
    return f"void({a}, {a}, {a}, {o}, {l}, {dt}, int64, {_sig_scores(dt)}{_SEQS if packed else ''})"


_SEQS = ", int32[:, ::1], int32[:, ::1], int64"   # packed rows: sequence table, page table, page size


def _sig_forward_merge(dt, layout, packed=False):
    acc, o = ("float32", "uint16") if dt in LOW_DTYPES else (dt, dt)
    if packed:
        return f"void({acc}[:, :, :, ::1], {acc}[:, :, ::1], {o}[:, :, :, :], {acc}[:, :, :], int32[:, ::1])"
    return f"void({acc}[:, :, :, ::1], {acc}[:, :, ::1], {o}[:, :, :, ::1], {acc}[:, :, ::1])"


def _sig_forward_mma(dt, layout, packed=False):
    a = _a4("uint16", layout)
    o, l = ("uint16[:, :, :, :]", "float32[:, :, :]") if packed else ("uint16[:, :, :, ::1]", "float32[:, :, ::1]")
    return f"void({a}, {a}, {a}, {o}, {l}, float32, {_sig_scores('float32')}{_SEQS if packed else ''})"


def _sig_forward_mma_split(dt, layout, packed=False):
    a = _a4("uint16", layout)
    o, l = ("uint16[:, :, :, :]", "float32[:, :, :]") if packed else ("uint16[:, :, :, ::1]", "float32[:, :, ::1]")
    return (f"void({a}, {a}, {a}, float32[:, :, :, ::1], float32[:, :, ::1], {o}, {l}, float32, int64, "
            f"{_sig_scores('float32')}{_SEQS if packed else ''})")


def _sig_forward_wgmma(dt, layout, packed=False):
    # (packed sequences: out and lse as (B1, tokens, heads, ·) views, C-contiguous as well)
    o, l = "uint64[:, :, :, ::1]", "float32[:, :, ::1]"
    return (f"void(uint8[::1], uint8[::1], uint8[::1], {o}, {l}, int64, int64, "
            f"float32, {_sig_scores('float32')}, {'int32[:, ::1]' if packed else 'int64'})")


def _sig_backward_wgmma(dt, layout):
    return (f"void(uint8[::1], uint8[::1], uint8[::1], uint8[::1], float32[:, :, :, ::1], uint64[:, :, :, ::1], "
            f"uint64[:, :, :, ::1], int64, int64, int64, float32, float32, {_sig_scores('float32')})")


def _merge_types(dt):
    acc = "float32" if dt in LOW_DTYPES else dt
    return acc, _a4(acc, "A"), _a4("uint16" if dt in LOW_DTYPES else dt, "A"), f"{acc}[:, :, :]"


def _sig_merge_into(dt, layout):
    acc, a4, s4, r3 = _merge_types(dt)
    return f"void({a4}, {s4}, {r3}, {r3}, {r3}, boolean)"


def _sig_merge_finish(dt, layout):
    acc, a4, s4, r3 = _merge_types(dt)
    return f"void({a4}, {r3}, {r3}, {s4}, {r3})"


def _sig_backward(dt, layout):
    acc = "float32" if dt in LOW_DTYPES else dt
    a = _a4("uint16" if dt in LOW_DTYPES else dt, layout)
    return (f"void({a}, {a}, {a}, {a}, {acc}[:, :, ::1], {acc}[:, :, ::1], {a}, {a}, {acc}, {acc}, "
            f"{_sig_scores(acc)}, int64)")


def _sig_backward_mma(dt, layout):
    a = _a4("uint16", layout)
    return (f"void({a}, {a}, {a}, {a}, float32[:, :, :, ::1], {a}, {a}, float32, float32, "
            f"{_sig_scores('float32')}, int64)")


def _sig_delta(dt, layout):
    a = _a4(dt, layout)
    return f"void({a}, {a}, {dt}[:, :, ::1])"


def _sig_stats(dt, layout):
    a = _a4("uint16", layout)
    return f"void({a}, {a}, float32[:, :, ::1], float32[:, :, :, ::1])"


VARIANTS = {v.name: v for v in (
    Variant("forward_simt", "FlashAttention-2 forward on CUDA cores", forward_tiling,
            lambda s: make_forward(s.dtype, s.d, s.tiling, s.scores, s.use_async),
            smem_words, _sig_forward, compact=forward_tiling_compact, direction="forward", packed=True, paged=True,
            # ptxas: the plain-load kernel of the d > 256 tiling spills 0.5 KiB per thread
            plain_compact=lambda dt, d: dt == "float32" and d > 256),
    Variant("forward_merge", "forward: combine the (O, lse) of key splits", lambda dt, d, sim: None,
            lambda s: make_merge(s.dtype, s.scores.packed), lambda d, t: 0, _sig_forward_merge, DTYPES + LOW_DTYPES,
            packed=True),
    Variant("forward_mma", "FlashAttention-2 forward on tensor cores (mma.sync m16n8k16)", mma_tiling,
            lambda s: make_forward_mma(s.dtype, s.d, s.tiling, s.scores),
            mma_smem_elements, _sig_forward_mma, LOW_DTYPES, lambda d: d % 8 == 0 and 8 <= d <= MMA_MAX_D,
            direction="forward", async_only=True, packed=True, paged=True),
    Variant("forward_mma_split", "forward on tensor cores for few query rows (decoding): one warp, key splits",
            mma_split_tiling, lambda s: make_forward_mma(s.dtype, s.d, s.tiling, s.scores, split=True),
            mma_smem_elements, _sig_forward_mma_split, LOW_DTYPES, lambda d: d % 8 == 0 and 8 <= d <= MMA_MAX_D,
            direction="forward", async_only=True, packed=True, paged=True,
            ptx_dims=(128,), ptx_rules=False),    # forward_mma's code: its shapes and rules are checked there
    Variant("forward_wgmma", "FlashAttention-3 forward on Hopper (TMA, mbarriers, wgmma, warp specialisation)",
            lambda dt, d, sim: forward_wgmma.tiling(d, FULL),
            # (the flags passed, so that the factory's cache keys on them)
            lambda s: forward_wgmma.make_forward_wgmma(s.dtype, s.d, s.scores, bn=s.tiling.BN, bm=s.tiling.BM,
                                                       fixed_max=forward_wgmma.FIXED_MAX_SOFTCAP),
            lambda d, t: forward_wgmma.smem_bytes(d, bn=t.BN, bm=t.BM) // 2, _sig_forward_wgmma, LOW_DTYPES,
            forward_wgmma.takes, direction="forward", async_only=True, arch="sm_90a", packed=True,
            rules_tiling=lambda dt, d, scores, rows: forward_wgmma.tiling(d, scores, rows),
            default_dims=forward_wgmma.by_default),
    Variant("backward_dkdv_simt", "backward: dK, dV (a block per key tile)", backward_tiling,
            lambda s: make_backward("dkdv", s.dtype, s.d, s.tiling, s.scores, s.use_async),
            lambda d, t: bwd_smem_words(d, t, "dkdv"), _sig_backward, direction="backward"),
    Variant("backward_dq_simt", "backward: dQ (a block per query tile)", backward_tiling,
            lambda s: make_backward("dq", s.dtype, s.d, s.tiling, s.scores, s.use_async),
            lambda d, t: bwd_smem_words(d, t, "dq"), _sig_backward, direction="backward"),
    Variant("backward_dkdv_mma", "backward on tensor cores (mma.sync m16n8k16): dK, dV", mma_backward_tiling("dkdv"),
            lambda s: make_backward_mma("dkdv", s.dtype, s.d, s.tiling, s.scores),
            mma_bwd_smem_elements, _sig_backward_mma, LOW_DTYPES, lambda d: d % 8 == 0 and 8 <= d <= MMA_MAX_D,
            direction="backward", async_only=True),
    Variant("backward_dq_mma", "backward on tensor cores (mma.sync m16n8k16): dQ", mma_backward_tiling("dq"),
            lambda s: make_backward_mma("dq", s.dtype, s.d, s.tiling, s.scores),
            mma_bwd_smem_elements, _sig_backward_mma, LOW_DTYPES, lambda d: d % 8 == 0 and 8 <= d <= MMA_MAX_D,
            direction="backward", async_only=True),
    # (PTX checks at its kernels' head dims only: those between are d = 128's kernels with
    # stores clipped, run by the simulator's tests)
    Variant("backward_dkdv_wgmma", "backward on Hopper (TMA, wgmma): dK, dV",
            lambda dt, d, sim: backward_wgmma.TILING,
            lambda s: backward_wgmma.make_backward_wgmma("dkdv", s.dtype, s.d, s.scores),
            lambda d, t: backward_wgmma.smem_bytes(d) // 2, _sig_backward_wgmma, LOW_DTYPES,
            backward_wgmma.takes, direction="backward", async_only=True, arch="sm_90a",
            default_dims=backward_wgmma.by_default, ptx_dims=backward_wgmma.HEAD_DIMS),
    Variant("backward_dq_wgmma", "backward on Hopper (TMA, wgmma): dQ",
            lambda dt, d, sim: backward_wgmma.TILING,
            lambda s: backward_wgmma.make_backward_wgmma("dq", s.dtype, s.d, s.scores),
            lambda d, t: backward_wgmma.smem_bytes(d) // 2, _sig_backward_wgmma, LOW_DTYPES,
            backward_wgmma.takes, direction="backward", async_only=True, arch="sm_90a",
            default_dims=backward_wgmma.by_default, ptx_dims=backward_wgmma.HEAD_DIMS),
    Variant("backward_delta", "backward pre-pass: delta = rowsum(dO ∘ O)", lambda dt, d, sim: None,
            lambda s: make_delta(s.dtype), lambda d, t: 0, _sig_delta, DTYPES),
    Variant("backward_stats", "tensor-core backward pre-pass: delta and lse in log2 units, padded rows",
            lambda dt, d, sim: None, lambda s: make_delta(s.dtype, stats=True), lambda d, t: 0, _sig_stats,
            LOW_DTYPES),
    Variant("copy_rows", "strided -> contiguous copy of 16-bit inputs the tensor cores cannot read in place",
            lambda dt, d, sim: None, lambda s: make_copy4(), lambda d, t: 0,
            lambda dt, layout: f"void({_a4('uint16', 'A')}, {_a4('uint16', 'C')})", ("uint16",)),
    Variant("cache_append", "KV caches: new rows written in place at each sequence's length",
            lambda dt, d, sim: None, lambda s: make_append(), lambda d, t: 0,
            lambda dt, layout: f"void({_a4(dt, 'A')}, {_a4(dt, 'A')}, int32[::1])", ("uint16", "float32", "float64")),
    Variant("cache_append_paged", "paged KV caches: new rows written in place through the page table",
            lambda dt, d, sim: None, lambda s: make_append(paged=True), lambda d, t: 0,
            lambda dt, layout: f"void({_a4(dt, 'A')}, {_a4(dt, 'A')}, int32[::1], int32[:, ::1], int64)",
            ("uint16", "float32", "float64")),
    Variant("kv_metadata", "KV caches: device metadata made into the sequence table and append rows",
            lambda dt, d, sim: None, lambda s: make_kv_metadata(), lambda d, t: 0,
            lambda dt, layout: f"void({dt}[:], int32[:, ::1], int32[::1], int64, int64)", ("int32", "int64")),
    Variant("kv_metadata_paged", "paged KV caches: device metadata made into the sequence, page and append tables",
            lambda dt, d, sim: None, lambda s: make_kv_metadata(paged=True), lambda d, t: 0,
            lambda dt, layout: f"void({dt}[:], {dt}[:, :], int32[:, ::1], int32[::1], int32[:, ::1], int64, int64, "
                               "int64, int64)", ("int32", "int64")),
    Variant("merge_into", "merge_attention: fold one partial (out, lse) into a running softmax",
            lambda dt, d, sim: None, lambda s: make_merge_into(s.dtype), lambda d, t: 0, _sig_merge_into,
            DTYPES + LOW_DTYPES),
    Variant("merge_finish", "merge_attention: the merged out and lse from the running softmax",
            lambda dt, d, sim: None, lambda s: make_merge_finish(s.dtype), lambda d, t: 0, _sig_merge_finish,
            DTYPES + LOW_DTYPES),
)}


DIRECTIONS = ("forward", "backward")


def dtypes(direction: str) -> tuple:
    """The dtypes the package computes ``direction`` ("forward", "backward") in: those of
    the kernel families registered for it, in registry order. Tests, ``bench.py`` and the
    API's input checks ask here."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    found = []
    for v in VARIANTS.values():
        if v.direction == direction:
            found += [dt for dt in v.dtypes if dt not in found]
    return tuple(found)


@dataclasses.dataclass(frozen=True)
class Specialisation:
    """One compiled kernel: a variant at one dtype, head dim, score rules and load path."""
    variant: str
    dtype: str
    d: int
    scores: ScoreSpec   # the score rules compiled in (numba_flash.scores)
    use_async: bool   # cp.async tile loads (needs 16-byte aligned rows and unit inner stride)
    tiling: Tiling
    compact: bool = False   # the variant's tiling for GPUs with less shared memory
    rows_tag: str = ""      # "/rows<BM>" where the call's query rows chose the tiling (``rules_tiling``)

    @property
    def name(self):
        key_warps = getattr(self.tiling, "KEY_WARPS", 1)
        return (f"{self.variant}/{self.dtype}/d{self.d}/{self.scores.tag}"
                f"/{'async' if self.use_async else 'plain'}{'/compact' if self.compact else ''}{self.rows_tag}"
                + ("/keywarps" if key_warps > 1 else ""))

    @property
    def smem_bytes(self):
        return VARIANTS[self.variant].smem_words(self.d, self.tiling) * itemsize(self.dtype)

    def kernel(self):
        """The variant's kernel for this specialisation, tagged with its identity for the
        on-disk kernel cache (``numba_flash._kernel_cache``)."""
        kern = VARIANTS[self.variant].build(self)
        if self.scores.mods is not None:      # a user's functions: no key can see inside them
            return kern
        return _kernel_cache.tag(kern, self.name, self)

    def signature(self, layout="C"):
        """Numba signature string, for PTX compilation without a GPU."""
        if self.scores.packed:
            return VARIANTS[self.variant].signature(self.dtype, layout, packed=True)
        return VARIANTS[self.variant].signature(self.dtype, layout)


def async_possible(dtype_name: str, d: int):
    """cp.async moves 16 bytes: rows of d elements must be a whole number of them."""
    return d % (16 // itemsize(dtype_name)) == 0


def specialisation(variant: str, dtype_name: str, d: int, scores: ScoreSpec = FULL, use_async: bool = False,
                   simulator: bool = SIMULATOR, smem_limit: int = None, compact: bool = False, rows: int = None):
    """The specialisation the API launches for these inputs: the variant's tiling, or its
    compact one when ``compact`` is set, when the first needs more than ``smem_limit``
    bytes of shared memory per block (the GPU's opt-in maximum), or for plain loads where
    the variant says so (``plain_compact``). ``rows``: the call's query rows per sequence,
    for a variant whose tiling depends on them (``rules_tiling``; its name then says the
    block's rows where they differ from those of unknown ``rows``)."""
    v = VARIANTS[variant]
    if scores.packed and not v.packed or scores.paged and not v.paged:
        raise ValueError(f"{variant} does not take {'paged caches' if scores.paged else 'packed sequences'} "
                         f"(scores {scores.tag})")
    t = v.tiling(dtype_name, d, simulator)
    rows_tag = ""
    if t is not None and v.rules_tiling is not None:
        t = v.rules_tiling(dtype_name, d, scores, rows)
        if rows is not None and t != v.rules_tiling(dtype_name, d, scores, None):
            rows_tag = f"/rows{t.BM}"
    if t is None:                                       # shape-independent kernels
        return Specialisation(variant, dtype_name, 0, PACKED if scores.packed else FULL, False, None)
    use_async = (use_async or v.async_only) and async_possible(dtype_name, d)
    spec = Specialisation(variant, dtype_name, d, scores, use_async, t, rows_tag=rows_tag)
    if v.compact is not None and (compact or smem_limit is not None and spec.smem_bytes > smem_limit
                                  or not use_async and v.plain_compact and v.plain_compact(dtype_name, d)):
        tc = v.compact(dtype_name, d, simulator)
        if tc != t:
            spec = Specialisation(variant, dtype_name, d, scores, use_async, tc, compact=True)
    return spec


HOPPER_ENV = "NUMBA_FLASH_HOPPER"


def hopper_choice():
    """``NUMBA_FLASH_HOPPER``, read at each call: "0" never uses the Hopper family, "1"
    always where it applies (in the simulator too, which runs it through its twins),
    unset or "auto" on compute capability 9.0 GPUs."""
    import os
    value = os.environ.get(HOPPER_ENV, "auto")
    if value not in ("0", "1", "auto"):
        raise ValueError(f"{HOPPER_ENV} must be 0, 1 or auto, got {value!r}")
    return value


def uses_hopper(dtype_name, d, cc, simulator=SIMULATOR, variant="forward_wgmma", scores=FULL):
    """Whether these inputs run on the Hopper family (``variant``: ``forward_wgmma``, or
    the backward's ``backward_dkdv_wgmma``): 16-bit inputs, a head dim it takes, and
    ``hopper_choice()`` with the device's compute capability ``cc`` (by default only where
    the variant's ``default_dims`` says so for ``d`` and the rules ``scores``)."""
    v = VARIANTS[variant]
    if dtype_name not in LOW_DTYPES or not v.head_dims(d):
        return False
    choice = hopper_choice()
    return choice == "1" or (choice == "auto" and not simulator and cc is not None and tuple(cc[:2]) == (9, 0)
                             and (v.default_dims is None or v.default_dims(d, scores)))


def forward_specialisation(dtype_name, d, scores, use_async, simulator=SIMULATOR, smem_limit=None, cc=None,
                           rows=None):
    """The forward kernel for these inputs: for 16-bit dtypes with at most ``SPLIT_ROWS``
    query rows per sequence (``rows``; decoding) the one-warp tensor-core kernel with key
    splits; else on a Hopper GPU (``cc`` 9.0) the Hopper family where :func:`uses_hopper`
    says so, tensor cores (``mma.sync``) for 16-bit dtypes (which always load with
    cp.async: the API gives them aligned rows), CUDA cores otherwise."""
    if dtype_name in LOW_DTYPES and rows is not None and rows <= SPLIT_ROWS:
        return specialisation("forward_mma_split", dtype_name, d, scores, True, simulator)
    if not scores.paged and uses_hopper(dtype_name, d, cc, simulator, scores=scores):
        return specialisation("forward_wgmma", dtype_name, d, scores, True, simulator, rows=rows)
    if dtype_name in LOW_DTYPES:
        return specialisation("forward_mma", dtype_name, d, scores, True, simulator)
    return specialisation("forward_simt", dtype_name, d, scores, use_async, simulator, smem_limit)


# Key splits (forward_simt, and forward_mma_split for few query rows): at most MAX_SPLITS,
# each covering at least MIN_SPLIT_TILES key tiles (the one-warp kernel's tiles are small:
# MIN_SPLIT_TILES_ONE_WARP, about 128 KiB of K and V at every head dim it takes), and only
# where the cost model predicts a SPLIT_GAIN-fold speed-up (the partial results cost
# memory, and the merge a pass over them). Measured on the H200: docs/performance.md
# (items 77 and 80).
MIN_SPLIT_TILES = 2
MIN_SPLIT_TILES_ONE_WARP = 8
SPLIT_GAIN = 1.25
SPLIT_BLOCK_COST = 2   # a block's own work beyond its key tiles (Q in, O out), in key tiles


def forward_splits(blocks: int, n_key_tiles: int, slots: int, causal: bool = False,
                   min_tiles: int = MIN_SPLIT_TILES) -> int:
    """How many key splits a forward launch uses (1: none).

    ``blocks``: the launch's blocks without splits; ``n_key_tiles``: key tiles per
    query tile; ``slots``: blocks the GPU runs at once (SMs × resident blocks per SM);
    ``min_tiles``: the fewest key tiles a split covers.
    Cost model, in key tiles on the critical path, each block costing its tiles plus
    ``SPLIT_BLOCK_COST`` (the merge is ignored, but a split must beat no split by
    ``SPLIT_GAIN``, and a tie keeps fewer splits): non-causal blocks are all alike, so
    they run in whole waves and the cost is ``waves · (per + SPLIT_BLOCK_COST)``; causal
    blocks differ (the last query tile is the heaviest, and runs first), so the cost is
    the longest block or the average load per slot, whichever is larger.
    """
    best, best_cost = 1, None
    for z in range(1, MAX_SPLITS + 1):
        per = -(-n_key_tiles // z) if n_key_tiles else 0
        if z > 1 and (per < min_tiles or -(-n_key_tiles // per) != z):
            continue                              # too short, or the same split as a smaller z
        if causal:
            cost = max(per + SPLIT_BLOCK_COST, (blocks * z * SPLIT_BLOCK_COST + blocks * n_key_tiles / 2) / slots)
        else:
            cost = -(-blocks * z // slots) * (per + SPLIT_BLOCK_COST)
        if best_cost is None:
            best_cost = cost / SPLIT_GAIN           # splitting must beat this
        elif cost < best_cost:
            best, best_cost = z, cost
    return best


# The one-warp kernel's key splits as the warps of one block, merged in its shared memory
# (``forward_mma.MmaTiling.KEY_WARPS``: no partial results in memory, no merge launch,
# whose 3-6 µs item 67 measured in grouped-query decoding), where the block's shared memory
# holds the call's splits (five at most at d = 128). Measured on an H100 2.9% faster in
# grouped-query decoding (16, 32/8, 8192, 128), level elsewhere (docs/performance.md items
# 113, 114).
BLOCK_SPLITS = True


# The most key warps of a block: the key-warps kernel's launch bound (256 threads leave a
# thread its 255 registers), one kernel for every count up to it
MAX_KEY_WARPS = 8


def block_splits(z: int, smem_bytes: int, smem_limit) -> int:
    """The key warps of a block for a launch of ``z`` key splits of the one-warp kernel
    (``smem_bytes`` of shared memory each, ``smem_limit`` a block's most, None: unknown):
    ``z`` where :data:`BLOCK_SPLITS` is on, ``z <=`` :data:`MAX_KEY_WARPS` and ``z``
    warps' memory fits, else 1 (a block per split, and the merge kernel)."""
    if BLOCK_SPLITS and 2 <= z <= MAX_KEY_WARPS and (smem_limit is None or z * smem_bytes <= smem_limit):
        return z
    return 1


MMA_FAST_DIMS = (64, 128)   # the tensor-core fast paths, checked one by one


def _shape_key(t, d):
    """What distinguishes compiled kernel shapes of one variant beyond the loop bounds.
    (The tensor-core kernel unrolls its head-dim loops completely, so its fast-path head
    dims are distinct shapes of their own.)"""
    if t is None:
        return (t,)
    if isinstance(t, (MmaTiling, MmaBwdTiling)):
        return (t, d if d in MMA_FAST_DIMS else None)
    if isinstance(t, (forward_wgmma.WgmmaTiling, backward_wgmma.WgmmaBwdTiling)):
        return (t, d)
    return (t.TM, t.TN, t.CG, t.RG, d <= t.DK, d <= t.DO)


def specialisations(simulator: bool = False):
    """One specialisation per distinct kernel shape the project builds, for the PTX checks.

    The API compiles a kernel per head dim on demand; kernels for head dims that share a
    tiling rule differ only in loop bounds, so each (variant, dtype, thread tile,
    resident-or-chunked head dim, score rules, load path) appears once, at the first of
    ``HEAD_DIMS`` that produces it, for the rule sets of ``scores.SCORE_SPECS``; those of
    ``scores.RULE_SPECS`` (windows, softcap, ALiBi), ``PACKED_SPECS`` and ``PAGED_SPECS``
    once per variant and dtype (of the 16-bit dtypes, ``RULE_LOW_DTYPE`` only: the rule
    code does not depend on which), at ``RULE_SPEC_D`` with cp.async loads. A variant whose
    tiling depends on the call's query rows (``rules_tiling``) also appears with the tiling
    of short sequences (``rows = 1``) where that differs.
    """
    seen = set()
    for variant, v in VARIANTS.items():
        for dt in v.dtypes:
            for d in v.ptx_dims or HEAD_DIMS:
                if not v.head_dims(d):
                    continue
                for scores in SCORE_SPECS:
                    for use_async in (True,) if v.async_only else (True, False):
                        for compact, rows in ((False, None), (True, None), (False, 1)):
                            if compact and not v.compact or rows is not None and not v.rules_tiling:
                                continue
                            spec = specialisation(variant, dt, d, scores, use_async, simulator, compact=compact,
                                                  rows=rows)
                            if compact and not spec.compact:
                                continue
                            key = (variant, dt, spec.scores, spec.use_async) + _shape_key(spec.tiling, d)
                            if key not in seen:
                                seen.add(key)
                                yield spec
    for variant, v in VARIANTS.items():      # the other rule sets: at RULE_SPEC_D only
        for dt in v.dtypes:
            if v.tiling(dt, RULE_SPEC_D, simulator) is None and v.packed:    # a helper's packed form
                yield specialisation(variant, dt, 0, PACKED, simulator=simulator)
            if dt in LOW_DTYPES and dt != RULE_LOW_DTYPE:
                continue           # the rules' code is the same for both 16-bit dtypes
            if v.tiling(dt, RULE_SPEC_D, simulator) is not None and v.head_dims(RULE_SPEC_D):
                rules = RULE_SPECS if v.ptx_rules else ()
                for scores in rules + (PACKED_SPECS if v.packed else ()) + (PAGED_SPECS if v.paged else ()):
                    yield specialisation(variant, dt, RULE_SPEC_D, scores, True, simulator)
    # the one-warp kernel's key splits as one block's warps (BLOCK_SPLITS)
    yield key_warps_specialisation(specialisation("forward_mma_split", RULE_LOW_DTYPE, RULE_SPEC_D, FULL, True,
                                                  simulator))


def key_warps_specialisation(one: Specialisation) -> Specialisation:
    """The one-warp split kernel ``one`` as the kernel of a block of key warps, up to
    :data:`MAX_KEY_WARPS` (:func:`block_splits`)."""
    return dataclasses.replace(one, tiling=dataclasses.replace(one.tiling, KEY_WARPS=MAX_KEY_WARPS))
