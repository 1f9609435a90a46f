"""The Hopper forward's persistent schedule: which block takes which work item.

The kernel (``forward_wgmma.make_forward_wgmma``) runs one block per multiprocessor, block
``b`` of ``G`` taking the items at places ``b, b + G, b + 2G, ...``; its ``work_item`` (and,
for packed sequences, ``packed_item``) turns a place into an item by the rules here, which
it compiles as device functions: :func:`longest_first_item` (rounds of ``G`` places dealt in
alternating directions), :func:`pairs_tail_tile` (the pairs schedule's tail, heaviest
first) and :func:`pair_place` (packed sequences' pairs of query tiles). The host's models
of every block's work under those deals (an item's key tiles plus :data:`ITEM_COST`) choose
among them per launch: :func:`paired_places` (the pairs schedule of causal rows, or not),
:func:`longest_first_flip` (which rounds of the longest-first deal go back), and
:func:`work_order` gives packed sequences their order. ``forward_wgmma.schedule`` says which
of them a call takes. The models and the kernel share each rule (the models call the same
Python functions, or a NumPy twin tested equal to them), so what is modelled is what runs.
docs/performance.md items 62, 75, 90 and 91 measured and chose them; docs/hopper.md draws
the deals.
"""
import functools


# The pairs schedule of causal rows (:func:`paired_places`): taken where the longest-first
# order's blocks would read more K and V at once than L2_KV_BYTES (every head's: its gain is
# heads at a time, as full attention goes) and the pairs' modelled makespan is within
# PAIRS_SLACK of that order's; ITEM_COST: an item's fixed work in key tiles' worth (first
# product and softmax, last P V, epilogue). docs/performance.md item 62.
L2_KV_BYTES = 32 << 20
PAIRS_SLACK = 0.03
ITEM_COST = 3


# Whole rounds of pairs the pairs schedule may leave to its tail (:func:`paired_places`)
TAIL_ROUNDS = 2


@functools.lru_cache(maxsize=1024)
def paired_places(n_qt, b, grid, kv_bytes):
    """The ``sched`` argument of the pairs schedule (the kernel's ``work_item``), or 0 for
    the longest-first order: that one where the K and V of all ``b`` leading indices
    (``kv_bytes``) fit in :data:`L2_KV_BYTES` or there is no whole round of the ``U = b ·
    floor(n_qt / 2)`` pairs, else whichever the model of every block's work (key tiles of a
    causal item plus :data:`ITEM_COST`) ends sooner, the pairs within :data:`PAIRS_SLACK`.
    The pairs' ``sched`` is ``4 U0 + 2 flip + 1``: ``U0`` pairs in whole rounds, ``U − U0``
    in the tail dealt as :func:`pairs_tail_tile` says (its rounds' parity ``flip``); of
    ``U0`` (0 to :data:`TAIL_ROUNDS` whole rounds fewer than there are) and ``flip`` the
    pair whose busiest block has least work."""
    import numpy as np
    P = n_qt // 2
    U = b * P
    W = U // grid                                 # whole rounds of pairs
    if W == 0 or kv_bytes <= L2_KV_BYTES:
        return 0
    costs = n_qt - np.arange(n_qt) + ITEM_COST    # longest first, as the deal has it (either parity)
    lpt = min(_deal_loads(costs, b, grid, flip).max() for flip in (0, 1))
    best = None
    for u0 in sorted({max(W - k, 1) * grid for k in range(TAIL_ROUNDS + 1)}, reverse=True):
        for flip in (0, 1):
            busiest = _pairs_loads(n_qt, b, grid, u0, flip).max()
            if best is None or busiest < best[0]:
                best = (busiest, 4 * u0 + 2 * flip + 1)
    return best[1] if best[0] <= lpt * (1 + PAIRS_SLACK) else 0


def pairs_tail_tile(s, n_qt, B, U0):
    """The pairs schedule's tail (the pairs ``U0 .. U − 1`` that do not make whole rounds, and
    the middle tiles of odd ``n_qt``) heaviest first: its ``s``-th tile ``(query tile,
    leading index)``. The first tiles of the pairs (``n_qt − 1 − p``, the heavier) by ``p``
    upwards, the middle tiles, then the second tiles (``p``) by ``p`` downwards; pair ``u``
    is leading index ``u // P``'s ``p = u mod P`` (``P = floor(n_qt / 2)``), and the tail's
    pairs with one ``p`` go leading indices upwards. A device function of the kernel
    (``work_item``, which deals the tail's tiles in rounds as :func:`longest_first_item`
    does) and the host's model (:func:`_pairs_loads`)."""
    P = n_qt >> 1
    firsts = B * P - U0
    mids = B if (n_qt & 1) == 1 else 0
    if s >= firsts and s < firsts + mids:
        return P, s - firsts
    k = s if s < firsts else firsts - 1 - (s - firsts - mids)
    h0 = U0 // P                                  # the first leading index with a pair in the tail
    s0 = U0 - h0 * P                              # its first p there; p < s0 start at h0 + 1
    m = B - 1 - h0
    if k < s0 * m:
        p = k // m
        b = h0 + 1 + (k - p * m)
    else:
        k -= s0 * m
        p = s0 + k // (m + 1)
        b = h0 + (k - (p - s0) * (m + 1))
    return (n_qt - 1 - p if s < firsts else p), b


def _pairs_loads(n_qt, b, grid, U0, flip):
    """Every block's work under the pairs schedule with ``U0`` pairs in whole rounds and its
    tail's rounds of parity ``flip`` (each item: key tiles plus :data:`ITEM_COST`)."""
    import numpy as np
    loads = np.full(grid, U0 // grid * (n_qt + 1 + 2 * ITEM_COST), np.float64)
    n_tail = n_qt * b - 2 * U0
    for t in range(n_tail):
        qt, _ = pairs_tail_tile(longest_first_item(t, grid, n_tail, flip), n_qt, b, U0)
        loads[t % grid] += qt + 1 + ITEM_COST
    return loads


def longest_first_item(i, G, n, flip):
    """The longest-first deal of ``n`` items (longest first) to ``G`` persistent blocks: the
    item at place ``i`` (block ``i % G``'s ``i // G``-th). Rounds of ``G`` places, every
    whole round of parity ``1 − flip`` (the odd ones for ``flip`` 0, the even ones for 1)
    dealt from the last block down, the others from the first block up. The kernel's
    device function (``work_item``); the host's model takes its NumPy twin
    (:func:`_longest_first_items`: the branch-free form put the producer's schedule in
    vector registers and spilled 172 bytes in the d = 64 causal kernel, against 12)."""
    r = i // G
    if ((r + flip) & 1) == 1 and (r + 1) * G <= n:
        return r * G + (G - 1 - (i - r * G))
    return i


def _longest_first_items(places, G, n, flip):
    """:func:`longest_first_item` of every place in the NumPy array ``places``."""
    import numpy as np
    r = places // G
    back = (((r + flip) & 1) == 1) & ((r + 1) * G <= n)
    return np.where(back, r * G + (G - 1 - (places - r * G)), places)


def _deal_loads(costs, b, grid, flip):
    """Every block's work under the longest-first deal (:func:`longest_first_item`):
    ``costs[k]`` the cost of an item of the ``k``-th longest query tile, ``b`` leading
    indices fastest."""
    import numpy as np
    n = len(costs) * b
    place = np.arange(n)
    w = _longest_first_items(place, grid, n, flip)
    return np.bincount(place % grid, np.asarray(costs, np.float64)[w // b], grid)


@functools.lru_cache(maxsize=1024)
def longest_first_flip(left, right, nq, nk, bm, b, grid, bn, aligned=False):
    """1 where the longest-first deal of rows a mask shortens (a causal mask, a window:
    ``left``, ``right`` the band's sides as ``scores.Scores`` has them) ends sooner in the
    model of every block's work (an item's key tiles plus :data:`ITEM_COST`) with the even
    rounds dealt from the last block down, else 0 (the odd ones). The rounds alternate so
    that every block gets as much work; which rounds go back decides where the last whole
    round's light items fall, and the blocks that take the last, partial round are the
    first ones: they should be the ones the round before left lightest. At (1, 16, 16384,
    128) with a window of 1024 keys the busiest block has 3.4% more work than the mean
    with the odd rounds back, 1.2% with the even ones (docs/performance.md item 90).
    ``aligned``: the query tiles aligned to the rows' end (``forward_wgmma.aligns_end``)."""
    import numpy as np
    from .. import scores as S
    n_qt = -(-nq // bm)
    pad = n_qt * bm - nq if aligned else 0
    tiles = []
    for qt in range(n_qt - 1, -1, -1):           # longest first: the last query tile first
        begin, end = S.key_range(S.Scores(left, right), qt * bm - pad, bm, nq, nk)
        tiles.append(max(-(-end // bn) - begin // bn, 0) if end > begin else 0)
    costs = np.asarray(tiles, np.float64) + ITEM_COST
    return int(_deal_loads(costs, b, grid, 1).max() < _deal_loads(costs, b, grid, 0).max())


def pair_place(i, G, units):
    """Packed sequences' pairs of query tiles: the unit and half ``(v, h)`` at place ``i``
    of the persistent schedule (block ``i % G``'s ``i // G``-th item), for ``units`` units
    of two items each. Units go to the blocks in rounds of ``G``, the rounds in alternating
    directions, and a block takes both halves of its unit in two consecutive items; the
    last ``units mod G`` units, after the whole rounds, go half by half. A bijection of
    ``[0, 2 · units)``."""
    whole = units - units % G
    if i < 2 * whole:
        m = i // G
        k = i - m * G
        r = m >> 1
        return r * G + (k if (r & 1) == 0 else G - 1 - k), m & 1
    j = i - 2 * whole
    return whole + (j >> 1), j & 1


def work_order(lens_q, lens_k, block_q):
    """Packed sequences' query tiles in the order the Hopper forward takes them, as the
    sequence table's three last columns ``(S, 3)`` int32: at position ``p``, the running
    count of query tiles up to and including the ``p``-th sequence of the order, that
    sequence's row in the table, and the running count of its pairs of tiles (``floor(tiles
    / 2)``). The order: most query tiles first, then most keys. The kernel
    (``packed_item``) takes every sequence's tiles in pairs from both ends, a pair on one
    block (:func:`pair_place`), then the middle tiles of odd counts: under a causal mask
    the pairs of a sequence cost alike, so with the sequences longest first the rounds of
    the persistent blocks end together (its tiles last-first, dealt one by one, gave the
    busiest block 9% more work than the mean on a causal batch of 16 sequences of 256-4096
    rows: docs/performance.md item 75)."""
    import numpy as np
    lens_q, lens_k = np.asarray(lens_q, np.int64), np.asarray(lens_k, np.int64)
    if lens_q.size and (lens_q == lens_q[0]).all():      # decoding: one sort key (the same order)
        order = np.argsort(-lens_k, kind="stable")
    else:
        order = np.lexsort((-lens_k, -lens_q)) if lens_q.size else np.zeros(0, np.int64)
    tiles = -(-lens_q[order] // block_q)
    return np.stack([np.cumsum(tiles), order, np.cumsum(tiles >> 1)], axis=1).astype(np.int32)
