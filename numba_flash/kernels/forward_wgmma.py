"""FlashAttention forward on Hopper (sm_90a): TMA, mbarriers, warpgroup MMA, warp specialisation.

The design of FlashAttention-3, written with ``ops_hopper``'s instructions. A work item is
``BM`` query rows of one (batch, head) (128, or 192 at d = 64 where the rules allow:
:func:`tiling`; head dims 64, 128 and 256, the last in 64- or 80-key tiles with one Q buffer:
:data:`WIDE_HEAD_BN`, and the multiples of 8 between on the next one's kernel: :func:`takes`);
the grid is persistent (at most one block per
multiprocessor), each block taking items ``blockIdx.x, blockIdx.x + gridDim.x, ...`` in the
order of ``work_item`` (for causal rows, where it pays, pairs of query tiles that see
``n_qt + 1`` key tiles together, head by head, then the rest heaviest first:
:func:`wgmma_schedule.paired_places`), so a block's start (barriers, tensor maps, registers)
is paid once and the next item's Q and first K/V tiles load while the consumers finish the
last one.
A block has a producer warpgroup and ``BM / 64`` consumers (384 or 512 threads):

* warpgroup 0 produces: it gives registers up (``setmaxnreg``), and one thread issues the
  TMA loads of each item's Q (into one of ``QBUF`` buffers) and of its K and V tiles
  (``BN = 128`` keys) into two ``STAGES``-deep shared-memory rings, in the order the
  consumers use them: K_0, then K_j with V_{j−1}. Per Q buffer and per stage of each ring a
  ``full`` mbarrier says the tile landed (its transaction count is the tile's bytes) and an
  ``empty`` one that every consumer is done with it: K_j's stage frees as soon as S_j is
  computed, a product before V_j's, so the next K tiles load a whole tile earlier than
  with one barrier per stage (measured: with one, the consumers spent most of their stalls
  waiting for K/V). The rings' stages and phases run on across items.
* the other warpgroups consume, 64 query rows each, with the registers the producer gave up.
  Per key tile ``j``: S_j = Q K_jᵀ (``wgmma`` m64n128k16 from 128-byte-swizzled shared
  memory, d / 16 products), then O += P_{j−1} V_{j−1} (P from registers, V as a transposed
  B, one m64n{d}k16 per 16 keys: ``wgmma_parts.make_column_product``) issued before the
  softmax of S_j, so that the tensor cores multiply while the warpgroup computes
  exponentials (intra-warpgroup overlap; but in the SASS ptxas places the wait for P V
  before the softmax: docs/performance.md item 97; a wait kept after the softmax measured
  no faster, item 98: with ping-pong the partner's products fill that wait); with ``pingpong``
  the consumer warpgroups take turns to issue their products, in a ring, so that one's
  products run while the others compute their softmax. With
  ``overlap`` (causal rows, two consumers: :func:`overlaps`) an item's last P V is issued
  with the next item's S_0, whose softmax runs while it completes, and the item's rows are
  stored after that (else each item's first tile and last product wait alone).

Scores, softmax and accumulation in float32 (``exp2`` on log2-scaled scores), P rounded
to the input dtype, as the ``mma.sync`` forward (``forward_mma``) does; the score rules
come from ``scores.device_rules``. The online softmax with a delayed product: after the
softmax of tile ``j`` the accumulator holds the tiles up to ``j − 2`` plus ``P_{j−1}
V_{j−1}``, all relative to the running maximum ``m_{j−1}``; it is rescaled by
``2^(m_{j−1} − m_j)`` once that product has completed.

Arguments: the tensor maps of q (``BM``-row boxes), k and v (``BN``-row boxes) from
``ops_hopper.tensor_map_4d`` over the ``(B1, B2, N, d)`` views, ``out (B1, B2, Nq, D / 4)``
uint64 (the output's 16-bit values in fours: ``wgmma_parts.make_store_rows``), ``lse (B1, B2,
Nq)`` float32, ``nk``, ``group`` (query heads per K/V head), ``scale_log2``, the score
arguments of ``forward.make_forward`` and ``sched`` (int64, :func:`schedule`: the pairs
schedule's argument for causal rows that take it, −1 or 0 for the longest-first deal's
rounds). Launch with
``grid <= ceil(Nq / BM) · B1 · B2`` (any count: ``grid_size``), ``kernel.threads`` threads and
``kernel.smem_bytes`` of dynamic shared memory. Head dims 64, 128 and 256 (the multiples of 8
between on the next one's kernel, on tensor maps of the real ``d``).

Packed sequences (``scores.packed``: varlen batches, the rows of every sequence in one
``(B1, B2, tokens, d)`` view, back to back): in place of ``sched`` a last argument ``seqs
(S, 7)`` int32 gives per sequence ``q_start, q_len, k_start, k_len`` and, as its three last
columns, the order the work items take (:func:`wgmma_schedule.work_order`: each sequence's
query tiles in pairs from both ends, then the middle tiles of odd counts), and ``out``
and ``lse`` come row first, ``(B1, tokens, B2, D / 4)`` and ``(B1, tokens, B2)``,
C-contiguous (``_arrays.rows_first``: constant column offsets in the stores); launch with
``grid <= tiles · B1 · B2``. Each item reads its sequence's row of the table; its TMA boxes
are whole tiles of the packed arrays, so a sequence's last tiles load rows of the next
one: as keys they lie past the sequence's end (scores −inf, P exactly 0, and their V rows
cleared before that tile's P V, since 0 · inf is NaN: ``clear_tail``), as queries they
are not stored. (A KV cache's unused rows would be read the same way, so ``families``
gives KV caches with gaps to the ``mma.sync`` family.) Paged caches would need a TMA load
per page.
"""
import dataclasses
import functools
import math

import numba
from numba import cuda

from .. import ops, warp
from .. import ops_hopper as H
from ..scores import SOFTCAP_TANH, ScoreSpec, block_lists, block_row_rules, block_rules, device_rules, mask_rule
from . import wgmma_schedule
from .forward import LN2
from .wgmma_parts import (SUB, consumer_registers, make_column_product, make_row_product, o_columns,
                          make_row_stored, make_store_rows, padded, wait_phase)

BM, BN = 128, 128                 # query rows per block (64 per consumer), keys per tile
THREADS = 384
# Query rows per block: 64 per consumer warpgroup. At d = 64 a tile's products take about
# as long as its exponentials, and three consumers (192 rows) let two warpgroups' softmax
# run while the third's products do, where the rules leave their registers room (160 each
# beside a producer of 24: :func:`tiling`); else, and at d = 128, two.
BLOCK_ROWS = {64: 192, 128: 128}
# the producer's registers where its work item takes a table lookup (packed sequences) or the
# pairs schedule's arithmetic (causal rows): 24 otherwise. Those kernels have 128-row blocks
# (384 threads), whose consumers get 232 registers with a producer of 32 or 40
# (wgmma_parts.consumer_registers); at 32 the pairs' tail (pairs_tail_tile) spilled 96/204
# bytes in the causal d = 128 kernel, at 40 56/172 (52/140 before the tail), none in the
# loop over key tiles
SCHEDULE_PRODUCER_REGS = 40
# the pairs schedule's producer at d <= 128: 56, none spilled (ptxas 13: the causal d = 64
# and d = 128 kernels' 40/48 and 56/172 bytes at 40), its consumers 224 registers each;
# kernels alone on an H100, d = 64 causal (4, 32, 4096) 3-5% faster, d = 128 causal level
# to 1% faster, packed rows 0-2% slower at 56 (they keep 40): docs/performance.md item 123
PAIRS_PRODUCER_REGS = 56
# Whether causal rows in 192-row blocks (three consumers: d = 64 past NARROW_CAUSAL_ROWS)
# take the pairs schedule too (:func:`paired`), the producer then keeping
# WIDE_PAIRS_PRODUCER_REGS: the 512 threads' pool of 65536 less three consumers' 160 each.
# ptxas 13 (sm_90a, bf16, d = 64): 100/132 bytes spilled (the producer's per-item
# arithmetic), no serialised product. Without it 192-row blocks go longest first, every
# head's K and V read at once: on an H200 (4, 32, 4096, 64) causal 5.7% slower than in
# 128-row blocks on the pairs, where a call whose K and V fit L2 was 3% faster. Measured
# on an H100 (docs/performance.md item 140): causal d = 64 at (1, 32, 16384) and (2, 32,
# 8192) 4.0-4.1% faster; with NARROW_CAUSAL_ROWS 2048, (4, 32, 4096) 2.2% faster than its
# 128-row blocks on the pairs. A causal softcap's 192-row blocks (SOFTCAP_TILES) take them
# too (ptxas: 96 bytes spilled, as above): on an H100 (4, 32, 8192, 64) 6.7% faster, (1, 32,
# 16384, 64) 1.1%, (4, 16, 4096, 64) 1.6% (item 142).
PAIRS_WIDE = True
WIDE_PAIRS_PRODUCER_REGS = 32
HEAD_DIMS = (64, 128, 256)          # the kernels' head dims (``wgmma_parts.padded``)
# The head dims the family takes by default on a compute capability 9.0 GPU: every one it
# takes (:func:`takes`). Measured on an H100 at d = 96 and 256 1.8-3.0x the mma.sync
# family's speed on full and causal rows, a window and a softcap (docs/performance.md item
# 110); the others run the same two kernels on zero columns. Packed sequences (varlen
# batches; KV caches, whose unused rows a TMA box would read, stay on mma.sync) too: a
# causal varlen batch at d = 256 2.2x, at d = 96 1.8x (item 114;
# the packed d = 256 kernel spills 60/212 bytes, ptxas item 112, and is still the faster).
# The rest run on the mma.sync family unless forced (``NUMBA_FLASH_HOPPER=1``):
# :func:`by_default`.
DEFAULT_HEAD_DIMS = tuple(range(64, 257, 8))
# Keys per tile at d = 256, where O takes 128 of a consumer's registers: S and P of 64 keys
# beside it, in two ring stages beside one Q buffer (192 KiB). 80 keys, FlashAttention-3's
# choice, where no rule masks or transforms a score (:data:`WIDE_HEAD_FULL_BN`): measured on
# an H100 7% faster on full rows; under causal rows and windows 80 keys spilled (ptxas 13,
# 48-152 bytes) and were 2-4% slower on short causal rows and a window, under a softcap
# or ALiBi they spill 12-40 bytes (a softcap: level). docs/performance.md item 110.
WIDE_HEAD_BN = 64
WIDE_HEAD_FULL_BN = 80
# With a softcap every score takes two special-function instructions (tanh, then exp2).
# Moving half the exponentials to the FMA units (about ten instructions each: ops.exp2_fma)
# was measured 10-15 % slower on an H200 (docs/performance.md item 32): none by default; the
# factory's ``exp2_fma`` keeps the option, tested.
EXP2_FMA_SOFTCAP = 0
# A softcap alone: the tanh of a warp's tile by an odd polynomial on the FMA units where
# every one of its scores has |cap_in · s| <= TANH_POLY_RANGE (a vote of the warp; else
# tanh.approx as before), so that a softcapped score takes one special-function result
# (its exponential) as a plain one does, not two: the unit (16 results a clock a
# multiprocessor, shared by tanh and ex2) otherwise needs 1024 cycles a warpgroup's 64 x
# 128 tile, as long as the other warpgroup's two products at d = 128, and softcap / plain
# reads 1.18 (docs/performance.md items 32, 87, 102, 137). Per score, in place of a product and
# MUFU.TANH: a max (the vote's), a square, three FMAs and a product (SASS, sm_90a; no
# spill, no serialised product). x · P(x²) of degree 7 on [-1, 1]: largest error 3.3e-5,
# relative 3.1e-4 near 0, within the 2^-11 relative error the PTX manual allows
# tanh.approx (which the tests' tolerances assume). Tiles with a larger score (a small
# cap, or scores far out) take tanh.approx, the same in every lane of the warp. The value:
# of every four scores, how many take the polynomial (the rest tanh.approx), to balance the
# two units (make_forward_wgmma's ``tanh_poly``), per (padded) head dim; 0 where absent.
# Measured on an H100: level at d = 128 with every share (all four 3.5% slower: the issue
# of the polynomial's six instructions a score became the bound; item 138); at d = 64 in
# 192-row blocks (:data:`SOFTCAP_TILES`) 3 of 4 against none 12% faster at 16 heads
# (cap 30) and 2% slower at 32 heads (cap 50), in 128-row blocks (causal rows) 8-11%
# faster (item 139). Not the running maxima's path (a cap of 50 is beyond FIXED_MAX_LIMIT):
# the polynomial left out where the maxima run, 0.1-1.2% faster at a cap of 50, level at
# 30 (item 140; the option removed).
TANH_POLY = {64: 3}
TANH_POLY_RANGE = 1.0
TANH_POLY_COEFFS = (0.99969375, -0.32889187, 0.11541349, -0.02465389)
ROWS = 64                         # query rows per consumer warpgroup (one wgmma M)
# A traced kernel's stamps per item (``make_forward_wgmma``'s ``trace``): cycle counts at
# these phases of consumer warpgroup ``w``'s item in slots ``6 w ..`` (its start, Q landed,
# the first tile's softmax done, the later tiles done, the last P V and the rows' sums done,
# O stored), then the producer's (slot 18: the item's Q load issued, after its buffer was
# free; 19: its last V load issued), the item's key tiles (20) and each warpgroup's K_0
# landed (slot 21 + w: between Q landed and the first tile's softmax) and its item placed
# (slot 24 + w: the schedule's item, its rows and score constants worked out, before the
# wait for Q); 0 where a phase did not happen (an item without key tiles)
TRACE_PHASES = ("start", "q", "first", "loop", "last", "stored")
TRACE_PRODUCER, TRACE_TILES, TRACE_K0, TRACE_PLACED, TRACE_EVENTS = 18, 20, 21, 24, 27
SMEM_LIMIT = 227 * 1024           # dynamic shared memory per block on compute capability 9.0


@dataclasses.dataclass(frozen=True)
class WgmmaTiling:
    """The family's tile shape, in the registry's terms: ``BM`` query rows per block,
    ``BN`` keys per tile, ``threads`` per block (a producer warpgroup and ``BM / 64``
    consumers), ``DO`` head-dim columns per block (all)."""
    BM: int = BM
    BN: int = BN
    threads: int = THREADS
    DO: int = 256


# Causal rows at d = 64 with at most this many query rows per sequence take 128-row blocks
# rather than 192: measured on an H200 5-13% faster at N = 1024-4096, 2-5% slower at N =
# 8192-16384 (docs/performance.md item 63), when 192-row blocks could not take the pairs
# schedule (:data:`PAIRS_WIDE`); with it, on an H100, 192 rows at N = 4096 2.2-2.6% faster
# (item 140), level at N = 2048 without it (item 139); with end-aligned tiles
# (:data:`END_ALIGNED_CAUSAL`) 192 rows at N = 2048 0.8% faster (item 142)
NARROW_CAUSAL_ROWS = 1024

# Causal rows' query tiles aligned to the sequence's end rather than its start
# (:func:`aligns_end`): where the query rows are not a multiple of the block's, the ragged
# tile is the first (rows from ``Nq - n_qt · BM``, the ones before 0 zero-filled by the TMA,
# never stored), which sees fewest keys, not the last, which sees them all. At N = 4096 in
# 192-row blocks the last tile holds 64 rows: two of its three warpgroups work through
# all 32 key tiles on rows past the sequence, 4.7% of the call's modelled work (key
# tiles and ITEM_COST a warpgroup; 1.3-1.4% at 8192-16384). In blocks of more than ``BM``
# rows only (three consumers): on an H100 (4, 32, 4096, 64) causal 2.5-3.5% faster, (4, 32,
# 3000, 64) 0.7%, 8192-16384 rows level; the 128-row kernel spills 28 bytes with it (ptxas
# 13) and was 2.7% slower at (8, 32, 2048, 64), whose rows are a multiple of its blocks
# (docs/performance.md items 141, 142).
END_ALIGNED_CAUSAL = True

# The blocks of a softcap (query rows, keys per tile) by (padded) head dim, where no other
# rule narrows them (:func:`tiling`); absent: 128 rows. A softcapped score takes two
# special-function results (tanh, exp2): at d = 64 a warpgroup's softmax (about 1024 of
# the unit's cycles a 64 x 128 tile) is twice its products (512 tensor cycles), so with two
# consumers the softmax bounds the loop; three give the tensor cores a third warpgroup's
# products to run under it. ptxas 13 (sm_90a, bf16): no spill at 192 rows, with or without
# the polynomial tanh (:data:`TANH_POLY`). Measured on an H100 (docs/performance.md item
# 139), softcapped full rows at d = 64: 6-8% faster than in 128-row blocks; with the
# polynomial for three of four scores too, 17% and 7% faster than 128 rows without it (an
# earlier H200 measurement, item 60, before the rows' maxima were fixed at the cap: no
# faster). Causal rows of up to NARROW_CAUSAL_ROWS keep 128-row blocks. At d = 128 three
# consumers fit with 64-key tiles (O's 64 registers, S's 32: ptxas 13, no spill, with the
# polynomial too), measured 4-11% slower without the polynomial (item 99), and again on
# an H100 with ``{64: (192, 128), 128: (192, 64)}``: softcapped full rows at (4, 16,
# 4096, 128) 1.2% slower, with the polynomial for three of four scores 4.2% (item 140).
SOFTCAP_TILES = {64: (192, BN)}

# A softcap bounds every score: with the cap c, ``cap_out · tanh(·) <= cap_out`` (c log2 e,
# the scores' log2 units), so each row's maximum may be taken as ``cap_out`` from the start
# (the exponentials' arguments in [-2 cap_out, 0]): no maxima taken (a FMNMX a score and
# the quad's shuffles between the tanh and the exponentials, the softmax's serial part),
# O never rescaled (a FMUL a score at d = 128), the rows' sums as before. Where the
# smallest exponential a row can have as its largest, 2^(-2 cap_out), keeps P's precision:
# a normal number in float32 and bfloat16 down to 2^-120 (cap_out <= 60: c <= 41.5), in
# float16 down to 2^-12 (cap_out <= 6: c <= 4.1); otherwise the running maxima, a branch
# on the launch's cap_out. Measured on an H100 2.7-3.0% faster on full rows with c = 30,
# 1.2% on causal rows (docs/performance.md items 94, 99).
FIXED_MAX_SOFTCAP = True
FIXED_MAX_LIMIT = {"bfloat16": 60.0, "float16": 6.0}

# Rows' maxima raised lazily: a row keeps its running maximum until a tile's maximum passes
# it by more than this (log2 units: a factor 2^8), so P's values reach at most 2^8 (well
# inside float32's, bfloat16's and float16's range, at their full relative precision: the
# sums and O divide it out exactly) and O is rescaled only where a row's maximum moved: a
# thread skips its rescale (64 multiplications a tile at d = 128, 128 at d = 256) where
# neither of its rows did, which after an item's first tiles is nearly always (the
# threshold of FlashAttention-4's softmax). A negative value: every rise of a maximum
# rescales. With a warp vote measured level to 5% slower at d = 64 and 128 on an H200
# (docs/performance.md item 86); rebuilt without the vote (item 111), measured on an H100
# 6.4% faster at d = 256 on full rows, 4.6% on causal rows, 1.4% at d = 64 and level at
# d = 128 (item 114): on at every head dim.
RESCALE_SLACK = 8.0


def takes(d):
    """Whether the family takes head dim ``d``: a multiple of 8 (the TMA's 16-byte rows)
    from 64 to 256, run by the kernel of ``wgmma_parts.padded``'s head dim."""
    return d % 8 == 0 and 64 <= d <= 256


def by_default(d, scores):
    """Whether a compute capability 9.0 GPU runs head dim ``d`` under the rules ``scores``
    on this family unless told otherwise (:data:`DEFAULT_HEAD_DIMS`; the rules ``scores``
    do not matter)."""
    return d in DEFAULT_HEAD_DIMS


def longest_first(scores):
    """Whether the kernel for ``scores`` deals its items longest first (``work_item``):
    where a mask makes rows see different numbers of keys (causal rows, a window, a block
    mask); full rows go head by head."""
    return bool(scores.causal or scores.window or (scores.mods is not None and scores.mods.blocks))


def tiling(D, scores, rows=None):
    """The tile shape at head dim ``D`` for the rules ``scores``: :data:`BLOCK_ROWS` rows,
    or ``BM`` for a window (192-row tiles would cover more of the band's masked corners:
    3-5% slower at d = 64), a softcap where :data:`SOFTCAP_TILES` has no tiles of its own
    (at d = 64 192 rows: 6-8% faster on an H100, item 139), ALiBi, user functions and packed
    sequences (their consumers would spill registers at 192 rows: 16-144 bytes, ptxas 13),
    and causal rows where the call's query rows per sequence (``rows``, where known) are at
    most :data:`NARROW_CAUSAL_ROWS`. Measured on an H200: docs/performance.md items 60 and
    63. (A softcap at d = 128 in 192 rows of 64-key tiles, three consumers: 4-11% slower on
    an H100 without the polynomial tanh, item 99; full rows of up to 2048 per sequence at
    d = 64 in 128-row blocks: level at 1024 rows, 10% slower at 2048 on an H100, item 102.)"""
    capped = SOFTCAP_TILES.get(padded(D)) if scores.softcap else None
    narrow = (scores.window or scores.softcap and capped is None or scores.alibi
              or scores.packed or scores.mods is not None
              or scores.causal and rows is not None and rows <= NARROW_CAUSAL_ROWS)
    if capped and not narrow:
        return WgmmaTiling(BM=capped[0], BN=capped[1], threads=threads_for(capped[0]))
    bm = BM if narrow else BLOCK_ROWS.get(padded(D), BM)
    plain = not (scores.masks_keys or scores.transforms or scores.packed)
    bn = (WIDE_HEAD_FULL_BN if plain else WIDE_HEAD_BN) if padded(D) == 256 else BN
    return WgmmaTiling(BM=bm, BN=bn, threads=threads_for(bm))


def threads_for(bm):
    """Threads per block for ``bm`` query rows: the producer warpgroup and one consumer
    warpgroup per 64 rows."""
    return 128 * (1 + bm // ROWS)


def grid_size(nq, b, sm_count, bm=BM):
    """The persistent grid: one block per multiprocessor (``sm_count``), or one per work
    item (``ceil(nq / bm) · b`` of them) when there are fewer."""
    return max(min(-(-nq // bm) * b, sm_count), 1)


# The largest (padded) head dim whose causal kernel takes the pairs schedule (:func:`paired`).
# At 256 O holds 128 of a consumer's registers, and with the pairs' producer of 40 registers
# the consumers spill 76/192 bytes (ptxas 13), none of it in the loop over key tiles (per
# item: SASS); without the pairs the longest-first deal's first round takes the longest
# query tile of every head at once, whose K and V overflow L2 where the pairs' heads share
# them (the causal (16, 8, 1024, 256) bf16 call took longer than full rows on an H100: 0.297
# against 0.246 ms). With the pairs at 256, measured on an H100: (16, 8, 1024, 256) causal
# 30% faster, (4, 8, 4096, 256) causal 5% (docs/performance.md items 115, 121).
PAIRS_HEAD_DIM = 256


def paired(scores, bm, d=128):
    """Whether the kernel for ``scores`` at ``bm`` rows takes the pairs schedule where its
    launch asks for it: causal rows without a window, user functions or packed sequences,
    at 128 rows (at 192 with :data:`PAIRS_WIDE`), head dim ``d`` at most
    :data:`PAIRS_HEAD_DIM` (padded)."""
    return bool(causal_alone(scores) and (bm == BM or PAIRS_WIDE and bm == BLOCK_ROWS[64])
                and padded(d) <= PAIRS_HEAD_DIM)


def causal_alone(scores):
    """Causal rows without a window, user functions or packed sequences: the rows whose
    query tiles :func:`paired` and :func:`aligns_end` may place as they choose."""
    return bool(scores.causal and not scores.window and scores.mods is None and not scores.packed)


def aligns_end(scores, bm):
    """Whether the kernel for ``scores`` in blocks of ``bm`` query rows aligns its query
    tiles to the sequence's end (:data:`END_ALIGNED_CAUSAL`): :func:`causal_alone` rows
    (packed sequences' rows before a sequence are another's) in blocks of more than ``BM``
    rows."""
    return bool(END_ALIGNED_CAUSAL and causal_alone(scores) and bm > BM)


def schedule(rules, bm, nq, nk, b, grid, kv_bytes, bn=BN, d=128):
    """The Hopper forward's ``sched`` argument for a call of score rules ``rules``
    (``scores.Scores``) in blocks of ``bm`` query rows (not packed), head dim ``d``: the pairs schedule's
    (:func:`wgmma_schedule.paired_places`, positive) where causal rows take it, else where
    rows differ in length ``−1`` for the longest-first deal with its even rounds back
    (:func:`wgmma_schedule.longest_first_flip`), 0 for the odd ones; for full rows 0."""
    spec = rules.spec
    if paired(spec, bm, d):
        places = wgmma_schedule.paired_places(-(-nq // bm), b, grid, kv_bytes)
        if places:
            return places
    if longest_first(spec):
        if spec.mods is not None and spec.mods.blocks:
            return 0                          # (a block mask's items: costs the model does not know)
        return -wgmma_schedule.longest_first_flip(rules.left, rules.right, nq, nk, bm, b, grid, bn, aligns_end(spec, bm))
    return 0


def buffers(D, bn=BN):
    """``(Q buffers, ring stages)`` for head dim ``D``, within 227 KiB per block. Two Q
    buffers at every head dim, so that the next item's Q has landed when the consumers
    reach it: at d = 128 that leaves room for two stages, against one Q buffer and three
    stages before, measured on an H200 6-13% faster on causal rows of 256-1024 keys, 1-3%
    at 2048-4096 and on full rows, level at 8192 (docs/performance.md item 67). Tiles of
    fewer keys than ``BN`` (``bn``) take as many more stages, the same keys in flight
    (64 keys at d = 128: four stages, 225 KiB). At d = 256 a 128-row Q tile takes 64 KiB:
    one Q buffer, two stages."""
    D = padded(D)
    if D == 256:
        return 1, 2
    qbuf, stages = (2, 2) if D > 64 else (2, 4)
    return qbuf, stages * BN // bn if bn < BN else stages


def _layout(D, qbuf, stages, bn=BN, bm=BM):
    nsub = padded(D) // 64
    sub_q, sub_k = bm * SUB, bn * SUB          # bytes of one 64-column sub-tile
    q_off = 0
    k_off = q_off + qbuf * nsub * sub_q
    v_off = k_off + stages * nsub * sub_k
    bar_off = v_off + stages * nsub * sub_k
    return nsub, sub_q, sub_k, q_off, k_off, v_off, bar_off


def smem_bytes(D, qbuf=None, stages=None, bn=BN, bm=BM, publish=None, ahead=None):
    """Q's buffers (``bm`` rows each), the K and V rings, the mbarriers (full and empty per
    Q buffer, per K stage and per V stage), with ``publish`` the placed items' slots and their
    mbarriers, and room to align the base to 1024 bytes. By default the slots are counted
    wherever a kernel at head dim ``D`` may publish (:func:`publishes` without rules: 96
    bytes a full-rows kernel leaves unused), so that a kernel's size follows from its head
    dim and tiling alone (the registry's). ``ahead``: with the slots' key rows (by default
    wherever a kernel at ``D`` may publish its items ahead: :func:`publishes_ahead` without
    rules; 32 bytes)."""
    qbuf, stages = buffers(D, bn) if qbuf is None else (qbuf, stages)
    if ahead is None:
        ahead = publishes(D) and publishes_ahead()
    item_bars, _, end = _item_layout(_layout(D, qbuf, stages, bn, bm)[-1], qbuf, stages, ahead)
    return (end if (publishes(D) if publish is None else publish) else item_bars) + 1024


# Each work item placed once, by the producer (``make_forward_wgmma``'s ``publish``): its
# schedule's item, rows and key tiles, which the producer works out for its loads anyway,
# written to one of ITEM_SLOTS slots of ITEM_WORDS int32 in shared memory (b1, b2, the
# first query row, the first key tile, the key tiles, the sequence's first query row, its
# query rows and keys), each slot with a full mbarrier (the producer's arrival, after its
# stores) and an empty one (one arrival per consumer warpgroup, after its reads). The
# consumers then read an item rather than work it out themselves: the trace of the Hopper
# forward (tools/trace_items.py, H100) had each consumer spend 1.6 key tiles' worth an item
# placing it for a window of 1024 keys, 1.0 for the varlen batch (docs/performance.md items
# 123, 124), about 380 instructions of 32-bit divisions and their fix-ups beside the other
# consumer's softmax. Up to the (padded) head dim PUBLISH_HEAD_DIM: at 256 the packed
# kernel's products serialise (ptxas 13). Measured on an H100 (kernels alone): short causal
# rows at d = 128 9% faster, a window of 1024 keys 4% at d = 64 and 1% at d = 128, causal
# d = 64 1%; full rows 2% slower (:data:`PUBLISH_FULL_ROWS`) (docs/performance.md item 125).
PUBLISH_HEAD_DIM = 128
# whether full rows publish their items too: measured on an H100 2.1% slower at (4, 16,
# 4096, 128) (their placing is a division of the item's place by the query tiles per head,
# once per 32 key tiles; docs/performance.md item 125)
PUBLISH_FULL_ROWS = False
ITEM_SLOTS = 2
ITEM_WORDS = 8
# The producer publishes each item one item ahead (``make_forward_wgmma``'s
# ``publish_ahead``): item ``m + 1`` is placed and published once item ``m``'s Q and first K
# tile are on their way, not after item ``m``'s last loads, and the producer reads item
# ``m + 1`` back from its slot when it gets there (a word per slot more: the sequence's
# first key row, which the consumers do not read). The consumers then find the next item
# published when they reach it: on an H100 a packed batch's consumers waited 880 cycles
# between an item's stores and the next item's start against 431 for the padded kernel
# on the same problem (the packed item is placed by a search of the sequence table, whose
# loads the producer waits for; docs/performance.md item 132), and the time saved in
# their stores went into that wait. Measured on an H100 (item 135): the varlen batch of
# bench.py serving 1.0-1.2% faster (the 450 cycles less wait an item, over its 33 items a
# block), windows 0.9-1.6% slower (their producer spills 4-32 bytes with it); causal rows at
# d = 64 up to 4.5% slower, at d = 128 level (item 138): on for packed
# rows (PUBLISH_AHEAD_PACKED), off for the others (PUBLISH_AHEAD). :func:`publishes_ahead`.
PUBLISH_AHEAD = False
PUBLISH_AHEAD_PACKED = True

# Packed sequences' units (a pair of a sequence's query tiles and a head, ``packed_item``)
# in the table's order of sequences: heads fastest (False), so that a round of the
# persistent blocks' units reads one sequence's K and V of every head at once (16 heads of
# 4096 keys at d = 128: 33.5 MB), or head by head (True), each head's pairs together, as
# the padded batch's pairs schedule goes (about half that in flight). Under a causal mask
# or none every unit of a sequence costs the same, so the deal's costs do not change. On an
# H100 the packed kernel read 1.89 GB from DRAM for sixteen causal 4096-row sequences of
# 16 heads against the padded kernel's 0.84 GB for the same problem, and ran 8.7% more
# cycles (docs/performance.md item 132). Head by head: 3.0% less time on that batch and on
# bench.py serving's varlen batch, the same bits (item 135).
PACKED_HEAD_MAJOR = True


def _item_layout(bar_off, qbuf, stages, ahead=False):
    """After the Q buffers' and rings' mbarriers (from ``bar_off``): the placed items'
    mbarriers (each slot's full one, then each slot's empty one) and their slots, then with
    ``ahead`` a key row per slot, as ``(the items' mbarriers, the slots, the end)`` in
    bytes."""
    item_bars = bar_off + 8 * (2 * qbuf + 4 * stages)
    item_off = item_bars + 16 * ITEM_SLOTS
    return item_bars, item_off, item_off + (4 * ITEM_WORDS + (16 if ahead else 0)) * ITEM_SLOTS


def publishes_ahead(scores=None):
    """Whether a kernel that publishes its items (:func:`publishes`) publishes each one item
    ahead (``make_forward_wgmma``'s ``publish_ahead``): packed rows with
    :data:`PUBLISH_AHEAD_PACKED`, every rule with :data:`PUBLISH_AHEAD`. Without
    ``scores``: whether any kernel does."""
    return bool(PUBLISH_AHEAD or PUBLISH_AHEAD_PACKED and (scores is None or scores.packed))


def publishes(d, scores=None):
    """Whether the kernel at head dim ``d`` for the rules ``scores`` has its producer place
    the work items (``make_forward_wgmma``'s ``publish``): up to :data:`PUBLISH_HEAD_DIM`,
    where rows differ in length (:func:`longest_first`) or sequences are packed, and on full
    rows with :data:`PUBLISH_FULL_ROWS`. Without ``scores``: whether any kernel at ``d`` does."""
    if padded(d) > PUBLISH_HEAD_DIM:
        return False
    return scores is None or PUBLISH_FULL_ROWS or longest_first(scores) or bool(scores.packed)


# The largest (padded) head dim at which windows take the item overlap (:func:`overlaps`):
# a window's items of about nine key tiles (a band of 1024 keys) pay an item's fixed cost
# often, as short causal rows do. Measured (window 1024 at N = 16384): d = 64 3.8% faster
# on an H100, 1.3% on an H200; d = 128 level on both (+0.3%, +0.4%), where the overlap's
# longer compile is not worth it (docs/performance.md items 86, 120, 121)
OVERLAP_WINDOW_HEAD_DIM = 64
# The largest (padded) head dim at which full rows take the item overlap (:func:`overlaps`;
# 0: none): measured 1-3% slower on an H200 (docs/performance.md item 72), before the
# producer placed work items and the schedules changed; ptxas: no spill, no serialised
# product at d = 128 (sm_90a). Each full-rows item's fixed cost is about 1.5 of its 33.5
# key tiles at (4, 16, 4096, 128) (item 133), what the overlap would take part of; at 128
# on an H100 since: 1.1-1.3% slower at the three full-rows anchor shapes (item 135).
OVERLAP_FULL_HEAD_DIM = 0


def overlaps(scores, bm, d):
    """Whether the kernel for ``scores`` at head dim ``d`` in blocks of ``bm`` query rows
    issues an item's last P V with the next item's first Q Kᵀ (``make_forward_wgmma``'s
    ``overlap``): for causal rows (packed or not) with two consumer warpgroups at d = 64,
    for windows up to :data:`OVERLAP_WINDOW_HEAD_DIM` and full rows up to
    :data:`OVERLAP_FULL_HEAD_DIM`. Measured on an H200 2-3% faster
    for causal rows at d = 64, level for causal rows at d = 128, 1-3% slower for full rows
    (docs/performance.md item 72); the overlap's code also takes Numba's front end 5.7 s
    longer for a kernel (13.2 against 7.5 s, on a 2-core x86-64 machine), which a first
    call pays (item 73). Packed rows at d = 128 took it too (2-3% faster on an H200 in item
    72); measured again on an H100 with the kernel as it is now (the producer placing the
    work items among the changes since, item 124), 5.0% slower for the causal varlen batch
    of bench.py serving and 3.0% for sixteen 4096-row sequences (item 132). Three consumer warpgroups (160 registers each) spilled in the
    loop over key tiles (up to 300 bytes); so did packed rows at d = 256 (368/704 bytes,
    60/212 without)."""
    if bm // ROWS != 2:
        return False
    if scores.window and padded(d) <= OVERLAP_WINDOW_HEAD_DIM:
        return True
    if (not (scores.causal or scores.window or scores.packed) and scores.mods is None
            and padded(d) <= OVERLAP_FULL_HEAD_DIM):
        return True
    return scores.causal and padded(d) == 64


@functools.lru_cache(maxsize=None)
def make_forward_wgmma(dtype_name: str, D: int, scores: ScoreSpec, pingpong: bool = True, qbuf: int = None,
                       stages: int = None, exp2_fma: int = None, bn: int = BN, bm: int = None,
                       overlap: bool = None, fixed_max: bool = None, slack: float = None, trace: bool = False,
                       publish: bool = None, head_major: bool = None, publish_ahead: bool = None,
                       tanh_poly: int = None, end_aligned: bool = None):
    """The kernel for one dtype, head dim and score rules; ``pingpong``: the consumer
    warpgroups take turns to issue their products (below), else they issue freely;
    ``qbuf``, ``stages``: Q buffers and ring stages (default: :func:`buffers`);
    ``exp2_fma``: of every four exponentials of the softmax, how many ``ops.exp2_fma``
    computes on the FMA units rather than the special-function unit (default
    :data:`EXP2_FMA_SOFTCAP` with a softcap, whose tanh is a second special-function
    instruction per score, else 0); ``bn``: keys per tile (a multiple of 16 up to 256; the
    registry's tiling is :data:`BN`: 192 at d = 64 and 176 at d = 128 were no faster on an
    H200, docs/performance.md item 57); ``bm``: query rows per block, 64 per consumer
    warpgroup (default :func:`tiling`'s; launch with :func:`threads_for` threads);
    ``overlap``: an item's last P V issued with the next item's first Q Kᵀ (default:
    :func:`overlaps`); ``fixed_max``: under a softcap alone, each row's maximum taken as the
    cap where :data:`FIXED_MAX_LIMIT` allows (default :data:`FIXED_MAX_SOFTCAP`); ``slack``:
    how far a tile's maximum may pass a row's before the row's is raised and O rescaled
    (default :data:`RESCALE_SLACK`; negative: at every rise); ``trace``: the kernel takes a
    last argument ``trace`` (int64, ``(G, items per block, TRACE_EVENTS)``) and stamps each
    item's phases there with the multiprocessor's cycle counter (:data:`TRACE_PHASES`; the
    item overlap off: ``tools/trace_items.py``); ``publish``: the producer places each work
    item for the consumers, who read it from shared memory (default :func:`publishes`);
    ``head_major``: packed sequences' units head by head within a sequence (default
    :data:`PACKED_HEAD_MAJOR`); ``publish_ahead``: with ``publish``, each item published
    one item ahead (default :func:`publishes_ahead`); ``tanh_poly``: under a softcap alone,
    of every four scores' tanh how many (0-4) :data:`TANH_POLY_COEFFS` computes, where a
    warp's tile is within :data:`TANH_POLY_RANGE` (default :data:`TANH_POLY`);
    ``end_aligned``: query tiles aligned to the sequence's end (default :func:`aligns_end`;
    causal rows only)."""
    BM = tiling(D, scores).BM if bm is None else bm
    assert takes(D), D
    D, COLS = padded(D), D                # the kernel's head dim; the output's columns
    assert D in HEAD_DIMS and bn % 16 == 0 and 16 <= bn <= 256 and BM % ROWS == 0 and 64 <= BM <= 256, (D, bn, BM)
    BN = bn
    NWG = BM // ROWS                      # consumer warpgroups
    TRACE = trace
    OVERLAP = False if TRACE else overlaps(scores, BM, D) if overlap is None else overlap
    THREADS = threads_for(BM)
    TURN0 = 1 + NWG                       # named barriers: 1..NWG release stages, then the turns,
    CLEAR = TURN0 + NWG                   # then the consumers' meeting over a cleared V tile (packed)
    QBUF, STAGES = buffers(D, bn) if qbuf is None else (qbuf, stages)
    PINGPONG = pingpong
    mods = scores.mods
    PACKED = scores.packed                # packed sequences: a table gives each item's rows
    pairs = cuda.jit(device=True, inline=True)(wgmma_schedule.pair_place)
    deal = cuda.jit(device=True, inline=True)(wgmma_schedule.longest_first_item)
    tail_tile = cuda.jit(device=True, inline=True)(wgmma_schedule.pairs_tail_tile)
    assert not scores.paged, "the TMA reads a paged cache's rows only page by page: not this family"
    # rows see different numbers of keys (packed sequences: ``packed_item``'s order instead)
    LONGEST_FIRST = longest_first(scores)
    # causal rows: the pairs schedule where the launch asks for it (:func:`paired`)
    PAIRED = paired(scores, BM, D)
    # query tiles from the sequence's end: the first one ragged, its rows before 0 not stored
    END_ALIGNED = aligns_end(scores, BM) if end_aligned is None else bool(end_aligned)
    assert not END_ALIGNED or causal_alone(scores), "end_aligned: causal rows alone"
    # a block mask with holes: its partial tiles' pairs are asked of mask_mod into a set of
    # bits, then masked (one loop calling the function per score kept the scores in local
    # memory: a 416-byte stack)
    MASK_APART = mods is not None and mods.mask_mod is not None and not mods.exact
    # scores are scale · q·k (an exact block mask's rows are masked like a window's, a
    # holed one's pairs apart): the scale joins exp2's FMA
    RAW = not (scores.softcap or scores.alibi or (mods is not None and mods.score_mod is not None))
    # a softcap alone: the scores are cap_out · tanh(cap_in · q·k); the tanh is taken first
    # and cap_out (positive, the scale's log2 units included) joins exp2's FMA as the scale does
    TANH_RAW = scores.softcap and not scores.alibi and mods is None
    SCALED = RAW or TANH_RAW          # s holds the scores over a positive factor, sl
    # the rows' maxima taken as the cap (FIXED_MAX_SOFTCAP), where the launch's cap allows
    FIXED_MAX = TANH_RAW and (FIXED_MAX_SOFTCAP if fixed_max is None else fixed_max)
    # the tanh by a polynomial where a warp's scores allow it (TANH_POLY)
    POLY_OF4 = (TANH_POLY.get(D, 0) if tanh_poly is None else int(tanh_poly)) if TANH_RAW else 0
    assert 0 <= POLY_OF4 <= 4, ("tanh_poly", POLY_OF4)
    POLY = POLY_OF4 > 0
    # the rows' maxima raised lazily (RESCALE_SLACK): O rescaled only where one moved
    SLACK = RESCALE_SLACK if slack is None else slack
    LAZY = SLACK >= 0
    # ALiBi's distances in float32 arithmetic: positions passed to the score rule as floats
    # (exact below 2**24) rather than one 64-bit integer-to-float conversion per score, a
    # slow instruction on the multi-function unit the exponentials need (user functions
    # take the integer positions)
    FLOAT_POS = scores.alibi and scores.mods is None
    CAPPED = bool(scores.softcap)
    EXP2_FMA = (EXP2_FMA_SOFTCAP if scores.softcap else 0) if exp2_fma is None else exp2_fma
    NSUB, SUB_Q, SUB_K, Q_OFF, K_OFF, V_OFF, BAR_OFF = _layout(D, QBUF, STAGES, BN, BM)
    PUBLISH = publishes(D, scores) if publish is None else publish
    HEAD_MAJOR = PACKED_HEAD_MAJOR if head_major is None else head_major
    AHEAD = PUBLISH and (publishes_ahead(scores) if publish_ahead is None else publish_ahead)
    # the placed items' mbarriers and slots, and where (AHEAD) each slot's first key row (16 bytes) begins
    ITEM_BARS, ITEM_OFF, ITEM_KS = _item_layout(BAR_OFF, QBUF, STAGES)
    SMEM = smem_bytes(D, QBUF, STAGES, BN, BM, PUBLISH or None, AHEAD or None)
    assert SMEM <= SMEM_LIMIT, ("shared memory", D, QBUF, STAGES, BN, BM)
    NS = BN // 2                          # S accumulator elements per thread
    NS_FMA = NS * EXP2_FMA // 4           # the first NS_FMA of them by ops.exp2_fma
    NS_POLY = NS * POLY_OF4 // 4          # (TANH_POLY) the first NS_POLY tanh by the polynomial
    NP = NS // 2                          # the same, packed in 16-bit pairs
    qk = make_row_product(dtype_name, D, BN, SUB_Q, SUB_K, COLS)  # S = Q Kᵀ of one key tile (k-steps to d)
    pv = make_column_product(dtype_name, D, BN, SUB_K, COLS)      # O += P V of one key tile (N to d's atoms)
    C0, C1 = o_columns(D, COLS)           # O's halves' columns (o1: 64 at d <= 192 in the d = 256 kernel)
    zeros_o, zeros_o1 = H.accumulator(C0), H.accumulator(C1)
    # the producer's registers (SCHEDULE_PRODUCER_REGS where its work items take more: the
    # pairs, and packed rows' key ranges, but at d = 256, where 24 leave the consumers the 240
    # their O of 128 needs: ptxas 13, causal packed rows' spill 60/212 -> 24/56 bytes, the
    # general rules' 168/372 -> 132/320, none in the producer; docs/performance.md items 112,
    # 118), and the consumers' share of the rest of the block's pool (consumer_registers)
    PRODUCER_REGS = (WIDE_PAIRS_PRODUCER_REGS if PAIRED and BM > 128 else
                     PAIRS_PRODUCER_REGS if PAIRED and D <= 128 else
                     SCHEDULE_PRODUCER_REGS if PAIRED or PACKED and D < 256 else 24)
    give = H.setmaxnreg(PRODUCER_REGS, False)
    take = H.setmaxnreg(consumer_registers(PRODUCER_REGS, THREADS), True)
    wait0, wait1 = H.wgmma_wait(0), H.wgmma_wait(1)
    pack = ops.pack_bf16x2 if dtype_name == "bfloat16" else ops.pack_f16x2
    # packed sequences: out and lse as (B1, tokens, heads, ·), C-contiguous (make_store_rows)
    store_rows = make_store_rows(dtype_name, D, COLS, rows_first=PACKED, from_zero=END_ALIGNED)
    row_stored = make_row_stored(END_ALIGNED)       # (the lse's rows: the same as O's)
    row_keys, in_row, key_range, _, tile_needs_mask, score, score_consts = device_rules(
        scores, "float32", SOFTCAP_TANH[dtype_name], block_rows=True, mask_apart=MASK_APART)
    pair_visible = mask_rule(scores) if MASK_APART else None
    block_keys, _ = block_rules(scores)
    key_tile_count, key_tile_at, key_tile_consts = block_lists(scores)
    block_rows, block_tile = block_row_rules(scores)
    F32 = numba.float32
    ZERO, ONE, NEG_INF, LN2_T = F32(0), F32(1), F32(-math.inf), F32(LN2)
    SLACK_T = F32(max(SLACK, 0.0))
    FIXED_LIMIT = F32(FIXED_MAX_LIMIT.get(dtype_name, 0.0))
    POLY_RANGE = F32(TANH_POLY_RANGE)
    A1, A3, A5, A7 = (F32(a) for a in TANH_POLY_COEFFS)
    TILE_BYTES = NSUB * SUB_K             # K or V of one stage

    @cuda.jit(device=True, inline=True)
    def release(ct, empty):
        """The consumer warpgroup is done reading a stage: one arrival on its ``empty``."""
        H.named_barrier(1 + (ct >> 7), 128)
        if (ct & 127) == 0:
            H.mbarrier_arrive(empty)

    @cuda.jit(device=True, inline=True)
    def tail_rows(q0, kt0, tiles, geo, slopes, b1, b2):
        """The rows of an item's last key tile that lie in its sequence (``BN`` where the
        tile is whole)."""
        return min(geo[0] - key_at(q0, kt0, tiles - 1, geo, slopes, b1, b2), BN)

    @cuda.jit(device=True, inline=True)
    def clear_tail(smf, sm_at, ring, base, ct, valid):
        """Packed sequences: before an item's last P V, the rows of its last V tile past its
        sequence's end (``valid`` rows lie in it) set to zero. The TMA clips a box at the
        packed array's end only, so those rows are the next sequence's values: P is 0
        there, but 0 · inf and 0 · NaN are NaN, and one sequence's non-finite values would
        reach its neighbours' outputs. The consumer warpgroups clear a share each (whole
        128-byte rows of each 64-column sub-tile, which the swizzle leaves in place), make
        the stores visible to the tensor cores' reads (``fence.proxy.async``) and meet on a
        named barrier. The tile where a sequence's keys end is the last of any item that
        visits it (an item's key tiles go upwards), and its other tiles are whole."""
        if PACKED and valid < BN:
            _, _, _, _, full_v, _ = barriers(base)
            _, _, av, bv = ring
            wait_phase(full_v + 8 * av, bv)             # (the TMA's bytes landed before the zeros)
            first = (base - sm_at + V_OFF + av * NSUB * SUB_K + valid * SUB) >> 2    # float32 words
            words = (BN - valid) * (SUB >> 2)
            for sub in range(NSUB):
                at = first + sub * (SUB_K >> 2)
                for c in range(4 * ct, words, 4 * 128 * NWG):
                    ops.st_shared_x4(smf, at + c, ZERO, ZERO, ZERO, ZERO)
            H.fence_async_shared()
            H.named_barrier(CLEAR, 128 * NWG)

    @cuda.jit(device=True, inline=True)
    def my_turn(wg):
        """Ping-pong: wait until the consumer warpgroup before this one (in a ring) has
        issued its products."""
        if PINGPONG:
            H.named_barrier(TURN0 + wg, 256)

    @cuda.jit(device=True, inline=True)
    def their_turn(wg):
        """Ping-pong: let the next consumer warpgroup issue its products."""
        if PINGPONG:
            H.named_arrive(TURN0 + (wg + 1) % NWG, 256)

    @cuda.jit(device=True, inline=True)
    def relative(bound, c0):
        """A row's key bound relative to the key ``c0``, clamped to ``[-1, BN]`` (int32)."""
        return numba.int32(min(max(bound - c0, -1), BN))

    @cuda.jit(device=True, inline=True)
    def frozen(sc):
        """Whether the rows' maxima are the cap (:data:`FIXED_MAX_SOFTCAP`): the launch's
        ``cap_out`` within :data:`FIXED_MAX_LIMIT` (one value for the whole launch)."""
        if FIXED_MAX:
            return sc[2] <= FIXED_LIMIT
        return False

    @cuda.jit(device=True, inline=True)
    def softmax(s, k0, row0, tq4, r0, m0, m1, l0, l1, geo, diag, sc, slopes, b1, b2):
        """One key tile's online softmax on the raw products ``s`` (two rows per thread, a
        quad per row): scores in log2 units, masks, the new maxima, ``s`` replaced by the
        exponentials. Returns the maxima, the partial sums and the old-to-new factors.
        Without softcap and ALiBi the scores are ``scale_log2 · s``: the maxima are taken
        on ``s`` (the scale is positive) and the scale is applied inside the exponent's
        argument, one FMA per element; with a softcap alone likewise on ``tanh(cap_in · s)``
        with ``cap_out``."""
        sl = sc[2] if TANH_RAW else sc[0]
        add0, add1 = ZERO, ZERO      # (ALiBi) each row's part of its scores, left out of s
        if FLOAT_POS:
            rf = F32(row0 + diag - k0 - 2 * tq4)          # the distance to the thread's first key
            left = k0 + BN - 1 <= r0 + diag               # every key at or before every row's diagonal
            if left or k0 >= r0 + ROWS - 1 + diag:        # or every key at or after it
                # on one side of the diagonal the distance is linear, ±(rf + 8 [row 1] − o) for
                # the key c0 + o: the bias splits into a row's part, added to its maximum and
                # subtracted from its exponentials' argument, and a key's, one product per
                # key shared by the two rows; per score one FMA, as against three. (The
                # rows' parts are taken against the tile's first key k0, not c0, so that
                # the quad sharing a row agrees on it: the maxima are reduced over the quad.)
                ss = sc[3] if left else -sc[3]
                add0 = -ss * F32(row0 + diag - k0)
                add1 = add0 - ss * F32(8)
                base = ss * F32(2 * tq4)
                unbiased = (sc[0], sc[1], sc[2], ZERO)
                for c in range(NS // 4):
                    for e in range(2):
                        kb = cuda.fma(ss, F32(8 * c + e), base)
                        for r in range(2):
                            i = 4 * c + e + 2 * r
                            if CAPPED:
                                y, _ = score(s[i], ZERO, ZERO, ZERO, unbiased)
                                s[i] = y + kb
                            else:        # (an explicit FMA: contracted, kb's product was made per score)
                                s[i] = cuda.fma(s[i], sc[0], kb)
            else:
                for i in range(NS):
                    s[i], _ = score(s[i], rf + F32(8 * ((i >> 1) & 1)), F32(8 * (i >> 2) + (i & 1)), ZERO, sc)
        elif TANH_RAW:
            cin = sc[1]
            poly = False
            if POLY:                        # every score of the warp's tile in range
                big = ZERO
                for i in range(NS_POLY):
                    big = max(big, abs(s[i]))
                poly = warp.all_sync(warp.FULL_MASK, big * cin <= POLY_RANGE)
            if poly:
                # tanh(cin · y) = y · P(y²), P's coefficients A_k · cin^k
                c2 = cin * cin
                b1, b3 = A1 * cin, A3 * cin * c2
                b5 = A5 * cin * c2 * c2
                b7 = A7 * cin * c2 * c2 * c2
                for i in range(NS):
                    if i < NS_POLY:
                        u = s[i] * s[i]
                        s[i] = s[i] * cuda.fma(u, cuda.fma(u, cuda.fma(u, b7, b5), b3), b1)
                    else:
                        s[i] = ops.tanh_approx(s[i] * cin)
            else:
                for i in range(NS):
                    s[i] = ops.tanh_approx(s[i] * cin)
        elif not RAW:
            for i in range(NS):
                s[i], _ = score(s[i], row0 + 8 * ((i >> 1) & 1), k0 + 8 * (i >> 2) + 2 * tq4 + (i & 1), diag, sc)
        if tile_needs_mask(r0, ROWS, k0, BN, geo) or block_tile(slopes, b1, b2, r0 // BM, k0, BN):
            # the thread's keys are c0 + o, o = 8 (i >> 2) + (i & 1) (a constant once unrolled):
            # the rows' bounds are taken relative to c0 and clamped to [-1, BN], which leaves
            # every comparison with an o in [0, BN) as it was, in 32 bits (the absolute 64-bit
            # keys took eight instructions a score: carries, paired compares, predicates
            # saved to registers and back)
            # (the rows' bounds are taken here, for the few tiles that need them, rather than
            # held in registers across the item: at d = 64 three consumer warpgroups have
            # 160 registers each, and eight more spilled)
            lo0, hi0 = row_keys(row0, geo)
            lo1, hi1 = row_keys(row0 + 8, geo)
            lo0, hi0 = block_rows(slopes, b1, b2, row0, lo0, hi0)
            lo1, hi1 = block_rows(slopes, b1, b2, row0 + 8, lo1, hi1)
            c0 = k0 + 2 * tq4
            lo0r, hi0r = relative(lo0, c0), relative(hi0, c0)
            lo1r, hi1r = relative(lo1, c0), relative(hi1, c0)
            for i in range(NS):
                o = numba.int32(8 * (i >> 2) + (i & 1))
                seen = in_row(o, lo1r, hi1r) if (i >> 1) & 1 else in_row(o, lo0r, hi0r)
                if not seen:
                    s[i] = NEG_INF
        if MASK_APART:
            if not sc[9]:                    # a partial tile of the block mask
                bits = numba.uint64(0)
                for i in range(NS):
                    if pair_visible(row0 + 8 * ((i >> 1) & 1), k0 + 8 * (i >> 2) + 2 * tq4 + (i & 1), sc):
                        bits |= numba.uint64(1) << numba.uint64(i)
                for i in range(NS):
                    if (bits >> numba.uint64(i)) & numba.uint64(1) == 0:
                        s[i] = NEG_INF
        if frozen(sc):
            # every score at most the cap, cap_out (sl) in log2 units: the rows' maxima (a row
            # with no visible key keeps a zero sum: 0 and -inf as ever)
            mn0, mn1, mu0, mu1, alpha0, alpha1 = sl, sl, sl, sl, ONE, ONE
        else:
            mx0, mx1 = NEG_INF, NEG_INF
            for i in range(NS):
                if (i >> 1) & 1:
                    mx1 = max(mx1, s[i])
                else:
                    mx0 = max(mx0, s[i])
            for off in (1, 2):
                mx0 = max(mx0, warp.shfl_xor_sync(warp.FULL_MASK, mx0, off))
                mx1 = max(mx1, warp.shfl_xor_sync(warp.FULL_MASK, mx1, off))
            if SCALED:
                mx0, mx1 = mx0 * sl, mx1 * sl
            if FLOAT_POS:
                mx0, mx1 = mx0 + add0, mx1 + add1
            mn0, mn1 = max(m0, mx0), max(m1, mx1)
            if LAZY:                     # the old maxima kept within the slack (false for -inf)
                keep0, keep1 = mn0 - m0 <= SLACK_T, mn1 - m1 <= SLACK_T
                mn0, mn1 = m0 if keep0 else mn0, m1 if keep1 else mn1
            mu0 = ZERO if mn0 == NEG_INF else mn0     # a row with no visible key yet: against 0
            mu1 = ZERO if mn1 == NEG_INF else mn1
            alpha0, alpha1 = ops.exp2_approx(m0 - mu0), ops.exp2_approx(m1 - mu1)
            if LAZY:
                alpha0, alpha1 = ONE if keep0 else alpha0, ONE if keep1 else alpha1
        if FLOAT_POS:
            mu0, mu1 = mu0 - add0, mu1 - add1      # against s, which lacks the rows' parts
        rs0, rs1 = ZERO, ZERO
        for i in range(NS_FMA):              # (two loops: each unrolls, with one kind of exp2)
            e = ops.exp2_fma((s[i] * sl if SCALED else s[i]) - (mu1 if (i >> 1) & 1 else mu0))
            if (i >> 1) & 1:
                rs1 += e
            else:
                rs0 += e
            s[i] = e
        for i in range(NS_FMA, NS):
            x = s[i] * sl if SCALED else s[i]
            if (i >> 1) & 1:
                e = ops.exp2_approx(x - mu1)
                rs1 += e
            else:
                e = ops.exp2_approx(x - mu0)
                rs0 += e
            s[i] = e
        return mn0, mn1, l0 * alpha0 + rs0, l1 * alpha1 + rs1, alpha0, alpha1

    @cuda.jit(device=True, inline=True)
    def mark(trace, i, G, slot):
        """A traced kernel's stamp (``trace``): the cycle counter into ``slot`` of the block's
        item at place ``i``, by every thread that gets here (a warpgroup's: the last of its
        warps to arrive leaves its count; no branch, which would keep the products in flight
        around it from running asynchronously)."""
        trace[cuda.blockIdx.x, (i - cuda.blockIdx.x) // G, slot] = H.clock64()

    @cuda.jit(device=True, inline=True)
    def work_item(i, G, n_qt, B, sched):
        """The work item at place ``i`` of the persistent schedule (block ``i % G``'s
        ``i // G``-th): ``(query tile, leading index)``. Without a mask that shortens rows
        the items are alike and go head by head, query tiles fastest, so the blocks
        running at once share K and V in L2; with one (causal, window), longest tiles
        first and leading indices fastest, each whole round of ``G`` items dealt in
        alternating directions so that every block gets as much work: the odd rounds from
        the last block down, or the even ones where ``sched`` is −1 (the host's
        :func:`schedule`). Where the launch asks for it (causal rows: ``sched`` from
        :func:`wgmma_schedule.paired_places`, ``4 U0 + 2 flip + 1``) the first ``U0`` of the
        ``U = B · floor(n_qt / 2)`` pairs go in whole rounds, a block taking query tiles
        ``n_qt − 1 − p`` and ``p`` of one head in two consecutive rounds, ``n_qt + 1`` key
        tiles together whatever ``p``: the pairs go head by head as full attention's items
        do (at (16, 16, 4096, 128) the longest tiles of every head at once had 7% L2 hits);
        then the tail, the other pairs' tiles and the middle tiles of odd ``n_qt``, heaviest
        first (:func:`wgmma_schedule.pairs_tail_tile`), in rounds as the longest-first deal
        has them (parity ``flip``). (Packed sequences: :func:`packed_item`.)"""
        if PAIRED and sched > 0:
            P = n_qt >> 1
            U0 = sched >> 2                   # pairs in whole rounds
            if i < 2 * U0:
                r = i // G
                u = (r >> 1) * G + (i - r * G)
                b = u // P
                p = u - b * P
                return (p if (r & 1) == 1 else n_qt - 1 - p), b
            t = i - 2 * U0                    # the tail: its tiles heaviest first, dealt in rounds
            return tail_tile(deal(t, G, n_qt * B - 2 * U0, (sched >> 1) & 1), n_qt, B, U0)
        if LONGEST_FIRST:
            w = deal(i, G, n_qt * B, -sched)       # (sched −1: the even rounds back)
            qt = n_qt - 1 - w // B
            return qt, w - (w // B) * B
        b = i // n_qt
        return i - b * n_qt, b

    @cuda.jit(device=True, inline=True)
    def key_tiles(q0, geo, slopes, b1, b2):
        """``(first key tile, tile count)`` that query tile ``q0`` of ``(b1, b2)`` must visit."""
        kv_begin, kv_end = key_range(q0, BM, geo)
        kv_begin, kv_end = block_keys(slopes, b1, b2, q0 // BM, kv_begin, kv_end)
        kt0 = kv_begin // BN
        n_kt = (geo[0] + BN - 1) // BN
        return kt0, key_tile_count(slopes, b1, b2, q0 // BM, n_kt, max((max(kv_end, 0) + BN - 1) // BN - kt0, 0))

    @cuda.jit(device=True, inline=True)
    def key_at(q0, kt0, j, geo, slopes, b1, b2):
        """The first key of the ``j``-th key tile query tile ``q0`` visits."""
        return key_tile_at(slopes, b1, b2, q0 // BM, (geo[0] + BN - 1) // BN, kt0, j) * BN

    @cuda.jit(device=True, inline=True)
    def consts_at(q0, j, geo, slopes, b1, b2, sc):
        """The score constants of that tile (a full one's scores skip ``mask_mod``)."""
        return key_tile_consts(slopes, b1, b2, q0 // BM, (geo[0] + BN - 1) // BN, j, sc)

    @cuda.jit(device=True, inline=True)
    def load(ring, tmap, full0, empty0, count, k0, b2k, b1):
        """The producer's load of the ``count``-th K or V tile (``ring``: the ring's first
        byte) into its stage once the consumers released the stage's previous tile; returns
        ``count + 1``. (The stage and its phase follow from ``count``: two registers fewer
        across an item for the producer, whose few the schedule's arithmetic shares.)"""
        r = count // STAGES
        st = count - r * STAGES
        if count >= STAGES:
            wait_phase(empty0 + 8 * st, (r - 1) & 1)
        H.mbarrier_arrive_expect_tx(full0 + 8 * st, TILE_BYTES)
        for sub in range(NSUB):
            H.tma_load_4d(ring + (st * NSUB + sub) * SUB_K, tmap, 64 * sub, k0, b2k, b1, full0 + 8 * st)
        return count + 1

    @cuda.jit(device=True, inline=True)
    def load_q(tmap, n_q, base, row, b2, b1, trace, i, G):
        """The producer's load of the block's ``n_q``-th Q tile (rows ``row ..`` of
        ``(b1, b2)``, place ``i``) into its buffer once both consumers are done with the
        buffer's last one; returns ``n_q + 1``."""
        q_full, q_empty, _, _, _, _ = barriers(base)
        buf = n_q % QBUF
        if n_q >= QBUF:
            wait_phase(q_empty + 8 * buf, ((n_q // QBUF) - 1) & 1)
        if TRACE:
            mark(trace, i, G, TRACE_PRODUCER)
        H.mbarrier_arrive_expect_tx(q_full + 8 * buf, NSUB * SUB_Q)
        for sub in range(NSUB):
            H.tma_load_4d(base + Q_OFF + (buf * NSUB + sub) * SUB_Q, tmap, 64 * sub, row, b2, b1, q_full + 8 * buf)
        return n_q + 1

    @cuda.jit(device=True, inline=True)
    def advance(st, phase):
        st += 1
        if st == STAGES:
            return 0, phase ^ 1
        return st, phase

    @cuda.jit(device=True, inline=True)
    def running(seqs, r, singles):
        """The table's running count at position ``r`` of its order
        (:func:`wgmma_schedule.work_order`): of pairs of query tiles, or with ``singles`` of
        lone middle tiles."""
        return seqs[r, 4] - 2 * seqs[r, 6] if singles else seqs[r, 6]

    @cuda.jit(device=True, inline=True)
    def packed_item(i, G, B, seqs):
        """Packed sequences: work item ``i`` as ``(sequence, query tile, leading index)``.
        Units are a pair of one sequence's query tiles (the last and the first, the second
        last and the second, ...: under a causal mask every pair of a sequence costs the
        same) and a leading index, in the table's order (sequences longest first), within
        a sequence leading indices fastest or, with ``HEAD_MAJOR``, each one's pairs
        together: :func:`wgmma_schedule.pair_place` gives both tiles of a unit to one
        block, one after the other. Then the middle tiles of sequences with an odd count,
        one by one (one a leading index: the orders agree)."""
        last = seqs.shape[0] - 1
        fu = seqs[last, 6] * B                   # units of pairs
        singles = i >= 2 * fu
        half = 0
        if singles:
            v = i - 2 * fu
        else:
            v, half = pairs(i, G, fu)
        lo, hi = 0, last
        while lo < hi:                           # the first position whose units pass v
            mid = (lo + hi) >> 1
            if running(seqs, mid, singles) * B > v:
                hi = mid
            else:
                lo = mid + 1
        before = running(seqs, lo - 1, singles) if lo > 0 else 0
        w = v - before * B                       # the unit's place among its sequence's
        if HEAD_MAJOR:
            n = running(seqs, lo, singles) - before
            b = w // n
            k = w - b * n
        else:
            k = w // B
            b = w - k * B
        z = seqs[lo, 5]
        nt = (seqs[z, 1] + BM - 1) // BM
        if singles:
            return z, nt >> 1, b
        return z, (nt - 1 - k if half == 0 else k), b

    @cuda.jit(device=True, inline=True)
    def place(i, G, n_qt, B, B2, sched, geo, slopes, seqs):
        """Work item ``i`` (:func:`work_item`, with the launch's ``sched``) as both roles
        need it: ``(b1, b2, first query row, first key tile, key tiles, the sequence's first
        query row and first key row, its query rows, its geometry)`` (one sequence of ``Nq``
        rows and ``geo`` unless packed)."""
        if PACKED:
            z, qt, b = packed_item(i, G, B, seqs)
        else:
            qt, b = work_item(i, G, n_qt, B, sched)
        b1 = b // B2
        b2 = b - b1 * B2
        qs, ks, nq, g = numba.int32(0), numba.int32(0), geo[0] - geo[1], geo
        if PACKED:
            qs, nq, ks, nk = seqs[z, 0], seqs[z, 1], seqs[z, 2], numba.int64(seqs[z, 3])
            g = (nk, nk - nq, geo[2], geo[3])
        q0 = qt * BM
        if END_ALIGNED:                          # the first tile ragged (rows before 0)
            q0 -= n_qt * BM - nq
        kt0, tiles = key_tiles(q0, g, slopes, b1, b2)
        return b1, b2, q0, kt0, tiles, qs, ks, nq, g

    @cuda.jit(device=True, inline=True)
    def put_lse(lse, b1, b2, row, value):
        """Row ``row`` of head ``b2``'s lse (packed sequences: ``lse (B1, tokens, heads)``)."""
        if PACKED:
            lse[b1, row, b2] = value
        else:
            lse[b1, b2, row] = value

    @cuda.jit(device=True, inline=True)
    def row_sums(lse, b1, b2, qs, row0, nq, m0, m1, l0, l1, tq4):
        """The first half of a work item's epilogue for the thread's two rows, which O is not
        needed for: the rows' sums over their quads, lse = (m + log2 l) ln 2 stored (a row
        with no visible key: −inf); returns ``1 / l`` of each row (0 for such a row)."""
        for off in (1, 2):
            l0 += warp.shfl_xor_sync(warp.FULL_MASK, l0, off)
            l1 += warp.shfl_xor_sync(warp.FULL_MASK, l1, off)
        if tq4 == 0:
            if row_stored(row0, nq):
                put_lse(lse, b1, b2, qs + row0, NEG_INF if l0 == ZERO else (m0 + math.log2(l0)) * LN2_T)
            if row_stored(row0 + 8, nq):
                put_lse(lse, b1, b2, qs + row0 + 8, NEG_INF if l1 == ZERO else (m1 + math.log2(l1)) * LN2_T)
        return ZERO if l0 == ZERO else F32(1) / l0, ZERO if l1 == ZERO else F32(1) / l1

    @cuda.jit(device=True, inline=True)
    def finish(out, lse, b1, b2, qs, row0, nq, o0, o1, m0, m1, l0, l1, tq4):
        """A work item's epilogue for the thread's two rows: :func:`row_sums`, then O / l
        stored (a row with no visible key: 0)."""
        inv0, inv1 = row_sums(lse, b1, b2, qs, row0, nq, m0, m1, l0, l1, tq4)
        store_rows(out, b1, b2, qs + row0, qs + nq, o0, o1, inv0, inv1, tq4)

    @cuda.jit(device=True, inline=True)
    def next_item(i, G, n_qt, B, B2, sched, geo, slopes, seqs, out, lse, wg, w, g, tq4, items):
        """The consumers' first work item at or after place ``i`` with a key tile to visit:
        ``(i, b1, b2, first query row, first key tile, key tiles, the sequence's first query
        row, its query rows, its geometry)``, ``i`` past the items when none is left, and
        ``items`` (:func:`take_item`) after them. The rows of the items passed over see no
        key: 0 and −inf, written here."""
        n_items = n_qt * B
        while i < n_items:
            (b1, b2, q0, kt0, tiles, qs, _, nq, gi), items = take_item(i, G, n_qt, B, B2, sched, geo, slopes, seqs,
                                                                       items)
            if tiles > 0:
                return (i, b1, b2, q0, kt0, tiles, qs, nq, gi), items
            finish(out, lse, b1, b2, qs, q0 + ROWS * wg + 16 * w + g, nq, zeros_o(), zeros_o1(),
                   NEG_INF, NEG_INF, ZERO, ZERO, tq4)
            i += G
        return (i, 0, 0, 0, 0, 0, 0, 0, geo), items

    @cuda.jit(device=True, inline=True)
    def item_slot(base, n_i):
        """The ``n_i``-th published item's slot: its full and empty mbarriers and its words'
        shared address (:func:`_item_layout`)."""
        slot = n_i % ITEM_SLOTS
        return (base + ITEM_BARS + 8 * slot, base + ITEM_BARS + 8 * (ITEM_SLOTS + slot),
                base + ITEM_OFF + 4 * ITEM_WORDS * slot)

    @cuda.jit(device=True, inline=True)
    def item_key_row(base, n_i):
        """``AHEAD``: the shared address of the ``n_i``-th published item's first key row."""
        return base + ITEM_KS + 16 * (n_i % ITEM_SLOTS)

    @cuda.jit(device=True, inline=True)
    def publish_item(base, n_i, b1, b2, q0, kt0, tiles, qs, nq, nk, ks):
        """``PUBLISH``: the producer's ``n_i``-th work item written to its slot (two 16-byte
        stores; with ``AHEAD`` a third, of the first key row ``ks``, for the producer
        itself) once both consumers have read the slot's last one, and the slot's full
        mbarrier arrived on (a release: the consumers' wait sees the stores); returns
        ``n_i + 1``."""
        full, empty, at = item_slot(base, n_i)
        if n_i >= ITEM_SLOTS:
            wait_phase(empty, ((n_i // ITEM_SLOTS) - 1) & 1)
        H.st_shared_v4(at, b1, b2, q0, kt0)
        H.st_shared_v4(at + 16, tiles, qs, nq, nk)
        if AHEAD:
            H.st_shared_v4(item_key_row(base, n_i), ks, 0, 0, 0)
        H.mbarrier_arrive(full)
        return n_i + 1

    @cuda.jit(device=True, inline=True)
    def publish_place(base, n_i, i, G, n_qt, B, B2, sched, geo, slopes, seqs):
        """``AHEAD``: the item at place ``i`` (:func:`place`) published; returns ``n_i + 1``."""
        b1, b2, q0, kt0, tiles, qs, ks, nq, g = place(i, G, n_qt, B, B2, sched, geo, slopes, seqs)
        return publish_item(base, n_i, b1, b2, q0, kt0, tiles, qs, nq, g[0], ks)

    @cuda.jit(device=True, inline=True)
    def published(base, n_i, geo):
        """``AHEAD``: the producer's ``n_i``-th published item read back from its slot, as
        :func:`place` gives it (the consumers may have read and released the slot: the
        producer writes it again only after this)."""
        _, _, at = item_slot(base, n_i)
        ks, _, _, _ = H.ld_shared_v4(item_key_row(base, n_i))
        return slot_item(at, ks, geo)

    @cuda.jit(device=True, inline=True)
    def slot_item(at, ks, geo):
        """The item in the slot at ``at`` (two 16-byte loads) as :func:`place` gives it, its
        first key row ``ks`` (packed sequences'; 0 otherwise)."""
        b1, b2, q0, kt0 = H.ld_shared_v4(at)
        tiles, qs, nq, nk = H.ld_shared_v4(at + 16)
        b1, b2, q0, kt0, tiles = numba.int64(b1), numba.int64(b2), numba.int64(q0), numba.int64(kt0), numba.int64(tiles)
        if PACKED:
            return b1, b2, q0, kt0, tiles, qs, ks, nq, (numba.int64(nk), numba.int64(nk) - nq, geo[2], geo[3])
        return b1, b2, q0, kt0, tiles, numba.int32(0), numba.int32(0), geo[0] - geo[1], geo

    @cuda.jit(device=True, inline=True)
    def first_items(base, ct):
        """A consumer's ``items`` for :func:`take_item` before its first item (0 without
        ``PUBLISH``: nothing to carry)."""
        if PUBLISH:
            return (base, 0, ct)
        return 0

    @cuda.jit(device=True, inline=True)
    def take_item(i, G, n_qt, B, B2, sched, geo, slopes, seqs, items):
        """A consumer's work item at place ``i`` as :func:`place` gives it (the first key row
        0: the consumers do not use it), and ``items`` after it: ``(base, n_i, ct)``, the
        consumer's count of items taken. With ``PUBLISH`` read from the producer's slot
        (:func:`publish_item`: two 16-byte loads), the slot released; else worked out here."""
        if not PUBLISH:
            return place(i, G, n_qt, B, B2, sched, geo, slopes, seqs), items
        base, n_i, ct = items
        full, empty, at = item_slot(base, n_i)
        wait_phase(full, (n_i // ITEM_SLOTS) & 1)
        item = slot_item(at, numba.int32(0), geo)
        release(ct, empty)
        return item, (base, n_i + 1, ct)

    @cuda.jit(device=True, inline=True)
    def barriers(base):
        """The mbarriers' addresses: ``(q_full, q_empty, full_k, empty_k, full_v, empty_v)``,
        one per Q buffer or ring stage each, from the first (the layout's ``BAR_OFF``)."""
        q_full = base + BAR_OFF
        q_empty = q_full + 8 * QBUF
        full_k = q_empty + 8 * QBUF
        empty_k = full_k + 8 * STAGES
        full_v = empty_k + 8 * STAGES
        return q_full, q_empty, full_k, empty_k, full_v, full_v + 8 * STAGES

    @cuda.jit(device=True, inline=True)
    def item_rows(q0, wg, w, g, n_q, base, scale_log2, cap_in, cap_out, slopes, b1, b2):
        """A consumer's view of a work item: ``(r0, row0, Q buffer, Q's address, score
        constants)`` (the warpgroup's first row, the thread's first of two rows)."""
        r0 = q0 + ROWS * wg                    # this warpgroup's first row
        row0 = r0 + 16 * w + g                 # this thread's two rows: row0 and row0 + 8
        buf = n_q % QBUF
        q_at = base + Q_OFF + buf * NSUB * SUB_Q + ROWS * wg * SUB
        return r0, row0, buf, q_at, score_consts(scale_log2, cap_in, cap_out, slopes, b1, b2)

    @cuda.jit(device=True, inline=True)
    def begin_item(q0, wg, w, g, n_q, base, q_full, scale_log2, cap_in, cap_out, slopes, b1, b2):
        """A consumer's start of a work item with keys: :func:`item_rows` and ``n_q + 1``
        once its Q tile has landed."""
        r0, row0, buf, q_at, sc = item_rows(q0, wg, w, g, n_q, base, scale_log2, cap_in, cap_out, slopes, b1, b2)
        wait_phase(q_full + 8 * buf, (n_q // QBUF) & 1)
        return r0, row0, buf, q_at, sc, n_q + 1

    @cuda.jit(device=True, inline=True)
    def first_tile(s, p, q_at, ring, base, ct, wg, q0, kt0, geo, row0, tq4, r0, sc, slopes, b1, b2):
        """An item's key tile 0 alone: S = Q Kᵀ waited for, its softmax, P packed in ``p``.
        Returns the rows' maxima and sums, zero O accumulators and the rings' places
        (``ring``: the K ring's stage and phase, the V ring's)."""
        ak, bk, av, bv = ring
        _, _, full_k, empty_k, _, _ = barriers(base)
        wait_phase(full_k + 8 * ak, bk)
        my_turn(wg)
        H.wgmma_fence()
        acc = qk(q_at, base + K_OFF + ak * NSUB * SUB_K)
        H.wgmma_commit()
        their_turn(wg)
        wait0()
        release(ct, empty_k + 8 * ak)
        ak, bk = advance(ak, bk)
        H.to_array(acc, s)
        m0, m1, l0, l1, _, _ = softmax(s, key_at(q0, kt0, 0, geo, slopes, b1, b2), row0, tq4, r0, NEG_INF, NEG_INF,
                                       ZERO, ZERO, geo, geo[1], consts_at(q0, 0, geo, slopes, b1, b2, sc), slopes,
                                       b1, b2)
        pack_p(s, p)
        return m0, m1, l0, l1, zeros_o(), zeros_o1(), (ak, bk, av, bv)

    @cuda.jit(device=True, inline=True)
    def next_tile(s, o0, o1, p, q_at, ring, base, ct, wg, j, q0, kt0, geo, row0, tq4, r0, sc, slopes, b1, b2,
                  m0, m1, l0, l1):
        """Key tile ``j`` of an item after a tile whose P is in ``p``: S_j = Q Kᵀ and that
        tile's O += P V issued in one turn (:func:`issue_tile`); once S_j is done, its softmax
        (on the rows' ``m0 .. l1``) while P V runs; then P V waited for (:func:`tile_done`).
        Returns the softmax's results, the accumulators and the rings' places; ``p`` is
        free, O not yet rescaled."""
        acc, o0, o1 = issue_tile(o0, o1, p, q_at, ring, base, wg)
        m0, m1, l0, l1, alpha0, alpha1, ring = tile_done(acc, s, ring, base, ct, j, q0, kt0, geo, row0, tq4, r0, sc,
                                                         slopes, b1, b2, m0, m1, l0, l1)
        return m0, m1, l0, l1, alpha0, alpha1, o0, o1, ring

    @cuda.jit(device=True, inline=True)
    def issue_tile(o0, o1, p, q_at, ring, base, wg):
        """The first half of :func:`next_tile`: S_j = Q Kᵀ (its accumulator returned in
        flight) and the tile before's O += P V issued in one turn."""
        ak, bk, av, bv = ring
        _, _, full_k, _, full_v, _ = barriers(base)
        wait_phase(full_k + 8 * ak, bk)
        my_turn(wg)
        H.wgmma_fence()
        acc = qk(q_at, base + K_OFF + ak * NSUB * SUB_K)
        H.wgmma_commit()
        wait_phase(full_v + 8 * av, bv)            # the tile before's V
        o0, o1 = pv(o0, o1, p, base + V_OFF + av * NSUB * SUB_K)
        H.wgmma_commit()
        their_turn(wg)
        return acc, o0, o1

    @cuda.jit(device=True, inline=True)
    def tile_done(acc, s, ring, base, ct, j, q0, kt0, geo, row0, tq4, r0, sc, slopes, b1, b2, m0, m1, l0, l1):
        """The second half of :func:`next_tile`: S_j waited for (K_j's stage released), its
        softmax while the tile before's P V runs, then P V waited for. Returns the softmax's
        results and the rings' places."""
        ak, bk, av, bv = ring
        _, _, _, empty_k, _, empty_v = barriers(base)
        wait1()                                    # S_j done: K_j's stage is free
        release(ct, empty_k + 8 * ak)
        ak, bk = advance(ak, bk)
        H.to_array(acc, s)
        m0, m1, l0, l1, alpha0, alpha1 = softmax(s, key_at(q0, kt0, j, geo, slopes, b1, b2), row0, tq4, r0, m0, m1,
                                                 l0, l1, geo, geo[1], consts_at(q0, j, geo, slopes, b1, b2, sc),
                                                 slopes, b1, b2)
        wait0()                                    # P V done: its stage is free, p may change
        release(ct, empty_v + 8 * av)
        av, bv = advance(av, bv)
        return m0, m1, l0, l1, alpha0, alpha1, (ak, bk, av, bv)

    @cuda.jit(device=True, inline=True)
    def later_tiles(s, o0, o1, p, q_at, ring, base, buf, ct, wg, tiles, q0, kt0, geo, row0, tq4, r0, sc, slopes, b1, b2,
                    m0, m1, l0, l1):
        """An item's key tiles 1 .. tiles − 1 after :func:`first_tile` (:func:`next_tile`
        each, O rescaled and P packed after it), then Q's buffer released (every Q Kᵀ of the
        item has completed). Returns the rows' statistics, O and the rings' places, the last
        tile's P V still owed."""
        for j in range(1, tiles):
            m0, m1, l0, l1, alpha0, alpha1, o0, o1, ring = next_tile(
                s, o0, o1, p, q_at, ring, base, ct, wg, j, q0, kt0, geo, row0, tq4, r0, sc, slopes, b1, b2,
                m0, m1, l0, l1)
            # (a fixed maximum: O is never rescaled; lazy maxima: only where one moved)
            if not frozen(sc) and (not LAZY or alpha0 != ONE or alpha1 != ONE):
                o0 = H.scale_rows(o0, alpha0, alpha1)
                o1 = H.scale_rows(o1, alpha0, alpha1)
            pack_p(s, p)
        _, q_empty, _, _, _, _ = barriers(base)
        release(ct, q_empty + 8 * buf)
        return m0, m1, l0, l1, o0, o1, ring

    @cuda.jit(device=True, inline=True)
    def last_tile(o0, o1, p, ring, base, ct, lse, b1, b2, qs, row0, nq, m0, m1, l0, l1, tq4):
        """An item's last O += P V alone, issued; while it runs, the rows' sums and lse
        (:func:`row_sums`, which it does not hold); then it is waited for and its V stage
        released. Returns O, ``1 / l`` of the thread's two rows and the rings' places (O / l
        is the caller's to store)."""
        ak, bk, av, bv = ring
        _, _, _, _, full_v, empty_v = barriers(base)
        wait_phase(full_v + 8 * av, bv)
        H.wgmma_fence()
        o0, o1 = pv(o0, o1, p, base + V_OFF + av * NSUB * SUB_K)
        H.wgmma_commit()
        inv0, inv1 = row_sums(lse, b1, b2, qs, row0, nq, m0, m1, l0, l1, tq4)
        wait0()
        release(ct, empty_v + 8 * av)
        av, bv = advance(av, bv)
        return o0, o1, inv0, inv1, (ak, bk, av, bv)

    @cuda.jit(device=True, inline=True)
    def pack_p(s, p):
        for k in range(NP):
            p[k] = pack(s[2 * k], s[2 * k + 1])

    @cuda.jit(device=True, inline=True)
    def forward_body(tq, tk, tv, out, lse, nk, group, scale_log2, left, right, cap_in, cap_out, slopes, seqs, sched,
                     trace):
        if PACKED:                       # (B1, tokens, heads, ·)
            Nq, B2 = out.shape[1], out.shape[2]
        else:
            Nq, B2 = out.shape[2], out.shape[1]
        B = out.shape[0] * B2
        n_qt = (Nq + BM - 1) // BM
        if PACKED:                       # query tiles of every sequence
            n_qt = seqs[seqs.shape[0] - 1, 4] if seqs.shape[0] > 0 else 0
        n_items = n_qt * B
        G = cuda.gridDim.x
        geo = (nk, nk - Nq, left, right)
        geo0 = geo

        sm = cuda.shared.array(0, numba.uint8, alignment=1024)
        smf = cuda.shared.array(0, numba.float32, alignment=1024)     # the same memory, as float32
        tid = cuda.threadIdx.x
        sm_at = H.shared_address(sm)
        base = (sm_at + 1023) & ~1023
        q_full, q_empty, full_k, empty_k, full_v, empty_v = barriers(base)
        if tid == 0:
            for buf in range(QBUF):
                H.mbarrier_init(q_full + 8 * buf, 1)
                H.mbarrier_init(q_empty + 8 * buf, NWG)          # one arrival per consumer
            for st in range(STAGES):
                H.mbarrier_init(full_k + 8 * st, 1)              # the producer's expect_tx
                H.mbarrier_init(empty_k + 8 * st, NWG)           # one arrival per consumer
                H.mbarrier_init(full_v + 8 * st, 1)
                H.mbarrier_init(empty_v + 8 * st, NWG)
            if PUBLISH:
                for slot in range(ITEM_SLOTS):
                    full, empty, _ = item_slot(base, slot)
                    H.mbarrier_init(full, 1)                  # the producer's
                    H.mbarrier_init(empty, NWG)               # one per consumer
            H.fence_mbarrier_init()
        cuda.syncthreads()

        if tid < 128:                    # ---- producer warpgroup ---------------------------------
            give()
            if tid == 0:
                H.tensormap_acquire(H.global_address(tq))
                H.tensormap_acquire(H.global_address(tk))
                H.tensormap_acquire(H.global_address(tv))
                ck, cv = 0, 0            # K and V tiles loaded (all items)
                n_q = 0                  # Q tiles loaded so far
                n_i = 0                  # items published so far (PUBLISH)
                if AHEAD and cuda.blockIdx.x < n_items:
                    n_i = publish_place(base, n_i, cuda.blockIdx.x, G, n_qt, B, B2, sched, geo, slopes, seqs)
                for i in range(cuda.blockIdx.x, n_items, G):
                    if AHEAD:
                        b1, b2, q0, kt0, tiles, qs, ks, nq, g = published(base, (i - cuda.blockIdx.x) // G, geo)
                    else:
                        b1, b2, q0, kt0, tiles, qs, ks, nq, g = place(i, G, n_qt, B, B2, sched, geo, slopes, seqs)
                        if PUBLISH:
                            n_i = publish_item(base, n_i, b1, b2, q0, kt0, tiles, qs, nq, g[0], ks)
                    if TRACE:
                        trace[cuda.blockIdx.x, (i - cuda.blockIdx.x) // G, TRACE_TILES] = tiles
                    b2k = b2 // group
                    if tiles > 0:
                        n_q = load_q(H.global_address(tq), n_q, base, qs + q0, b2, b1, trace, i, G)
                        # K_0, then K_j with V_{j-1}: the order the consumers use them in
                        ck = load(base + K_OFF, H.global_address(tk), full_k, empty_k,
                                  ck, ks + key_at(q0, kt0, 0, g, slopes, b1, b2), b2k, b1)
                    if AHEAD and i + G < n_items:   # the next item, once this one's first loads are out
                        n_i = publish_place(base, n_i, i + G, G, n_qt, B, B2, sched, geo, slopes, seqs)
                    if tiles > 0:
                        for j in range(1, tiles):
                            ck = load(base + K_OFF, H.global_address(tk), full_k, empty_k,
                                      ck, ks + key_at(q0, kt0, j, g, slopes, b1, b2), b2k, b1)
                            cv = load(base + V_OFF, H.global_address(tv), full_v, empty_v,
                                      cv, ks + key_at(q0, kt0, j - 1, g, slopes, b1, b2), b2k, b1)
                        cv = load(base + V_OFF, H.global_address(tv), full_v, empty_v,
                                  cv, ks + key_at(q0, kt0, tiles - 1, g, slopes, b1, b2), b2k, b1)
                        if TRACE:
                            mark(trace, i, G, TRACE_PRODUCER + 1)
            return

        # ---- consumer warpgroups: 64 query rows each ----------------------------------------------
        take()
        ct = tid - 128
        wg = ct >> 7
        w = (ct >> 5) & 3
        g = (ct & 31) >> 2
        tq4 = ct & 3
        s = cuda.local.array(NS, numba.float32)
        p = cuda.local.array(NP, numba.uint32)
        ring = (0, 0, 0, 0)                      # the K ring's stage and phase, the V ring's, across items
        n_q = 0
        items = first_items(base, ct)
        # Ping-pong turns run on across items (warpgroup 0 first): both warpgroups take one
        # per key tile of the same items. (Starting them afresh per item let warpgroup 1,
        # run ahead, arrive twice on the barrier warpgroup 0 had yet to sync on for the item
        # before: the two arrivals completed it without warpgroup 0, a deadlock.)
        if wg == NWG - 1:
            their_turn(wg)
        # Per item: tile 0 alone, then per tile j, S_j and P_{j-1} V_{j-1} in flight during the
        # softmax of S_j (no branch around a product, so the compiler keeps the products
        # asynchronous), the last tile's P V after them. K_j's stage is released once S_j is
        # done, V_j's once P_j V_j is, Q's once the item's last S is. With OVERLAP an item's
        # last P V is issued with the next item's S_0 (the first item's S_0 alone), whose
        # softmax runs while it completes, and the item's rows are finished after that.
        if OVERLAP:
            (i, b1, b2, q0, kt0, tiles, qs, nq, geo), items = next_item(cuda.blockIdx.x, G, n_qt, B, B2, sched,
                                                                       geo0, slopes, seqs, out, lse, wg, w, g,
                                                                       tq4, items)
            if i < n_items:
                r0, row0, buf, q_at, sc, n_q = begin_item(q0, wg, w, g, n_q, base, q_full, scale_log2, cap_in,
                                                          cap_out, slopes, b1, b2)
                m0, m1, l0, l1, o0, o1, ring = first_tile(s, p, q_at, ring, base, ct, wg, q0, kt0, geo, row0, tq4, r0,
                                                          sc, slopes, b1, b2)
                while True:
                    m0, m1, l0, l1, o0, o1, ring = later_tiles(s, o0, o1, p, q_at, ring, base, buf, ct, wg, tiles,
                                                               q0, kt0, geo, row0, tq4, r0, sc, slopes, b1, b2, m0,
                                                               m1, l0, l1)
                    fb1, fb2, fqs, frow0, fnq = b1, b2, qs, row0, nq     # the item the last P V is of
                    fvalid = tail_rows(q0, kt0, tiles, geo, slopes, b1, b2)
                    (i, b1, b2, q0, kt0, tiles, qs, nq, geo), items = next_item(i + G, G, n_qt, B, B2, sched,
                                                                               geo0, slopes, seqs, out, lse, wg,
                                                                               w, g, tq4, items)
                    if i >= n_items:
                        break
                    r0, row0, buf, q_at, sc, n_q = begin_item(q0, wg, w, g, n_q, base, q_full, scale_log2,
                                                              cap_in, cap_out, slopes, b1, b2)
                    # the next item's S_0 with this one's last P V; while they run, this item's
                    # rows' sums and lse; its O stored once its last P V is done
                    clear_tail(smf, sm_at, ring, base, ct, fvalid)
                    acc, o0, o1 = issue_tile(o0, o1, p, q_at, ring, base, wg)
                    inv0, inv1 = row_sums(lse, fb1, fb2, fqs, frow0, fnq, m0, m1, l0, l1, tq4)
                    n0, n1, k0l, k1l, _, _, ring = tile_done(acc, s, ring, base, ct, 0, q0, kt0, geo, row0, tq4, r0,
                                                             sc, slopes, b1, b2, NEG_INF, NEG_INF, ZERO, ZERO)
                    store_rows(out, fb1, fb2, fqs + frow0, fqs + fnq, o0, o1, inv0, inv1, tq4)
                    o0 = zeros_o()
                    o1 = zeros_o1()
                    m0, m1, l0, l1 = n0, n1, k0l, k1l
                    pack_p(s, p)
                clear_tail(smf, sm_at, ring, base, ct, fvalid)
                o0, o1, inv0, inv1, ring = last_tile(o0, o1, p, ring, base, ct, lse, fb1, fb2, fqs, frow0, fnq,
                                                     m0, m1, l0, l1, tq4)
                store_rows(out, fb1, fb2, fqs + frow0, fqs + fnq, o0, o1, inv0, inv1, tq4)
        else:
            for i in range(cuda.blockIdx.x, n_items, G):
                if TRACE:
                    mark(trace, i, G, 6 * wg)
                (b1, b2, q0, kt0, tiles, qs, _, nq, geo), items = take_item(i, G, n_qt, B, B2, sched, geo, slopes,
                                                                            seqs, items)
                r0, row0, buf, q_at, sc = item_rows(q0, wg, w, g, n_q, base, scale_log2, cap_in, cap_out, slopes,
                                                    b1, b2)
                o0 = zeros_o()
                o1 = zeros_o1()
                if tiles == 0:                          # no key tile: 0 and -inf
                    inv0, inv1 = row_sums(lse, b1, b2, qs, row0, nq, NEG_INF, NEG_INF, ZERO, ZERO, tq4)
                else:
                    if TRACE:
                        mark(trace, i, G, TRACE_PLACED + wg)
                    wait_phase(q_full + 8 * buf, (n_q // QBUF) & 1)
                    if TRACE:
                        mark(trace, i, G, 6 * wg + 1)
                        # K_0 landed (first_tile's own wait on it then passes at once: the stage
                        # is not released before this warpgroup's S_0 is done)
                        wait_phase(full_k + 8 * ring[0], ring[1])
                        mark(trace, i, G, TRACE_K0 + wg)
                    n_q += 1
                    m0, m1, l0, l1, o0, o1, ring = first_tile(s, p, q_at, ring, base, ct, wg, q0, kt0, geo, row0, tq4,
                                                              r0, sc, slopes, b1, b2)
                    if TRACE:
                        mark(trace, i, G, 6 * wg + 2)
                    m0, m1, l0, l1, o0, o1, ring = later_tiles(s, o0, o1, p, q_at, ring, base, buf, ct, wg, tiles,
                                                               q0, kt0, geo, row0, tq4, r0, sc, slopes, b1, b2, m0, m1,
                                                               l0, l1)
                    if TRACE:
                        mark(trace, i, G, 6 * wg + 3)
                    clear_tail(smf, sm_at, ring, base, ct, tail_rows(q0, kt0, tiles, geo, slopes, b1, b2))
                    o0, o1, inv0, inv1, ring = last_tile(o0, o1, p, ring, base, ct, lse, b1, b2, qs, row0, nq,
                                                         m0, m1, l0, l1, tq4)
                    if TRACE:
                        mark(trace, i, G, 6 * wg + 4)
                store_rows(out, b1, b2, qs + row0, qs + nq, o0, o1, inv0, inv1, tq4)
                if TRACE:
                    mark(trace, i, G, 6 * wg + 5)
        if wg == 0:
            my_turn(wg)          # the last warpgroup's last turn: no barrier is left half-arrived

    if PACKED and TRACE:
        @cuda.jit(launch_bounds=(THREADS, 1))
        def forward(tq, tk, tv, out, lse, nk, group, scale_log2, left, right, cap_in, cap_out, slopes, seqs, trace):
            forward_body(tq, tk, tv, out, lse, nk, group, scale_log2, left, right, cap_in, cap_out, slopes, seqs, 0,
                         trace)
    elif PACKED:
        @cuda.jit(launch_bounds=(THREADS, 1))
        def forward(tq, tk, tv, out, lse, nk, group, scale_log2, left, right, cap_in, cap_out, slopes, seqs):
            forward_body(tq, tk, tv, out, lse, nk, group, scale_log2, left, right, cap_in, cap_out, slopes, seqs, 0,
                         slopes)
    elif TRACE:
        @cuda.jit(launch_bounds=(THREADS, 1))
        def forward(tq, tk, tv, out, lse, nk, group, scale_log2, left, right, cap_in, cap_out, slopes, sched, trace):
            forward_body(tq, tk, tv, out, lse, nk, group, scale_log2, left, right, cap_in, cap_out, slopes, slopes,
                         sched, trace)
    else:
        @cuda.jit(launch_bounds=(THREADS, 1))
        def forward(tq, tk, tv, out, lse, nk, group, scale_log2, left, right, cap_in, cap_out, slopes, sched):
            forward_body(tq, tk, tv, out, lse, nk, group, scale_log2, left, right, cap_in, cap_out, slopes, slopes,
                         sched, slopes)

    forward.smem_bytes = SMEM
    forward.publish = PUBLISH
    forward.head_major = HEAD_MAJOR
    forward.publish_ahead = AHEAD
    forward.overlap = OVERLAP             # as resolved (a test forces it the other way)
    forward.tanh_poly = POLY_OF4         # of every four tanh, how many by the polynomial
    forward.end_aligned = END_ALIGNED
    forward.threads = THREADS
    return forward
