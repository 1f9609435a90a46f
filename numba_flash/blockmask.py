"""Block masks: where a ``mask_mod`` lets each query look, computed once and reused.

``block_mask(mask_mod, B, H, Nq, Nk, mod_args=...)`` evaluates the mask on the device (a
kernel with one thread per query row, scanning every key; in the simulator the same kernel
on the CPU) and keeps, per ``(b, h, query row)``, the first visible key, one past the last,
and how many keys are visible; and per chunk of 32 query rows by 32 keys whether some
pair is visible and whether every pair is, from which :meth:`BlockMask.tile_classes`
says which tiles of any size are empty, partial or full. A call given ``block_mask=``
narrows each query tile's keys to the union of its rows' ranges: key tiles outside it are
never loaded or multiplied; for a mask with holes the forward kernels (every family) also
skip the empty key tiles inside it (the table's per-query-tile lists) and do not call
``mask_mod`` in its full ones, as the dQ kernels do, and the dK/dV kernels with each key
tile's list of query tiles.

When every row's visible keys are one run (:attr:`BlockMask.exact`: causal, windows,
documents, prefix-LM), the forward kernels of every family and the dQ kernels do not call
``mask_mod`` at all: they mask each row by its run, and only in the key tiles that some
row of the query tile sees in part (the others are all visible, as in the built-in
``causal``); the dK/dV kernels visit only the queries that see a key tile
(:meth:`BlockMask.key_tile_ranges`) and call ``mask_mod`` there.

One block mask serves every call with the same mask, shapes and mod_args values, in
every layer; the per-tile ranges of each kernel family's query tile height are derived
on the host once and cached in the object.
"""
import functools
import numbers

import numpy as np
from numba import cuda      # (numba_flash has chosen the simulator or the GPU before this import)

from . import scores as _scores
from .scores import LIST_FULL

THREADS = 128
CHUNK = 32          # the tile classes' grain: groups of 32 query rows by chunks of 32 keys
WORD = 32           # chunks per word of the chunk bitmaps (int64 words on the device, 32 bits used)
_FULL_WORD = (1 << WORD) - 1


@functools.lru_cache(maxsize=64)
def _rows_kernel(mask_mod, nargs):
    """The kernel that scans each query row's keys with ``mask_mod`` (``nargs`` mod_args)."""
    from .scores import _call_with_args
    call = _call_with_args(mask_mod, False, nargs)

    def rows(out, seen, every, B, H, Nq, Nk, margs):
        t = cuda.grid(1)
        if t >= B * H * Nq:
            return
        b = t // (H * Nq)
        rest = t - b * (H * Nq)
        h = rest // Nq
        i = rest - h * Nq
        bh = b * H + h
        g = i // CHUNK
        lo = Nk
        hi = 0
        n = 0
        seen_w = 0                  # this word's chunks: some key visible / every key visible
        every_w = _FULL_WORD
        for j in range(Nk):
            bit = 1 << ((j // CHUNK) % WORD)
            if call(0.0, b, h, i, j, margs):
                lo = min(lo, j)
                hi = j + 1
                n += 1
                seen_w |= bit
            else:
                every_w &= _FULL_WORD ^ bit
            if j % (CHUNK * WORD) == CHUNK * WORD - 1 or j == Nk - 1:
                w = j // (CHUNK * WORD)
                if seen_w != 0:
                    cuda.atomic.or_(seen, (bh, g, w), seen_w)
                if every_w != _FULL_WORD:
                    cuda.atomic.and_(every, (bh, g, w), every_w)
                seen_w = 0
                every_w = _FULL_WORD
        out[t, 0] = lo
        out[t, 1] = hi
        out[t, 2] = n
    return cuda.jit(rows)


EMPTY, PARTIAL, FULL = 0, 1, 2      # BlockMask.tile_classes


class BlockMask:
    """Where ``mask_mod`` lets each query row of a ``(B, H, Nq, Nk)`` problem look (see the
    module docstring). ``B`` is the flattened index of the leading dims before the head
    axis, ``H`` the heads; either may be 1, for a mask that does not depend on it (it is
    then evaluated at 0 and applied to every index). Pass it to :func:`numba_flash.attention`
    (and ``attention_fwd`` / ``attention_bwd``) as ``block_mask=``; its ``mask_mod`` and
    ``mod_args`` are the call's unless the call gives them (the same function)."""

    def __init__(self, mask_mod, shape, mod_args, rows, device_args=None, chunks=None):
        self.mask_mod, self.shape, self.mod_args = mask_mod, shape, tuple(mod_args)
        self.device_args = device_args  # mod_args as kernel arguments (NumPy arrays copied once)
        self._rows = rows               # (B, H, Nq, 3) int64: first key, one past the last, count
        self._chunks = chunks           # (seen, every): (B·H, groups, words) uint32 bitmaps (block_mask)
        self._tiles = {}
        self._tables = {}
        count = rows[..., 2]
        self.exact = bool(np.all((count == 0) | (count == rows[..., 1] - rows[..., 0])))
        """True if every row's visible keys are one run (see the module docstring)."""

    @property
    def density(self) -> float:
        """The fraction of (query, key) pairs the mask leaves visible."""
        B, H, Nq, Nk = self.shape
        return float(self._rows[..., 2].sum()) / max(1, B * H * Nq * Nk)

    def row_ranges(self):
        """``(B, H, Nq, 2)``: per query row the first visible key and one past the last
        (``Nk, 0`` for a row that sees none)."""
        return self._rows[..., :2].copy()

    def tile_ranges(self, rows: int):
        """``(B, H, ceil(Nq / rows), 2)`` int64: per tile of ``rows`` query rows the first key
        any of its rows sees and one past the last any sees (cached per ``rows``)."""
        found = self._tiles.get(rows)
        if found is None:
            B, H, Nq, Nk = self.shape
            n = -(-Nq // rows)
            pad = np.empty((B, H, n * rows, 2), np.int64)
            pad[..., 0], pad[..., 1] = Nk, 0            # padding rows see nothing
            pad[:, :, :Nq] = self._rows[..., :2]
            pad = pad.reshape(B, H, n, rows, 2)
            found = self._tiles[rows] = np.stack([pad[..., 0].min(-1), pad[..., 1].max(-1)], axis=-1)
        return found

    def tile_classes(self, rows: int, keys: int):
        """``(B, H, ceil(Nq / rows), ceil(Nk / keys))`` int8: per tile of ``rows`` query rows
        by ``keys`` keys, :data:`EMPTY` (no pair visible), :data:`PARTIAL` or :data:`FULL`
        (every pair of the tile's rows and keys that exist is visible). Exact when ``rows``
        and ``keys`` are multiples of 32 (the mask is kept per 32 × 32 chunk, in bits);
        otherwise a chunk that straddles two tiles counts in both, so a tile may be called
        partial that is empty or full, never the other way round."""
        B, H, Nq, Nk = self.shape
        nq, nk, chunks = -(-Nq // rows), -(-Nk // keys), -(-Nk // CHUNK)
        seen, every = (self._unpack(w) for w in self._chunks)
        if rows % CHUNK == 0 and keys % CHUNK == 0:       # whole chunks per tile: one reduction
            r, c = rows // CHUNK, keys // CHUNK
            pad = [(0, 0), (0, 0), (0, nq * r - seen.shape[2]), (0, nk * c - chunks)]
            seen = np.pad(seen, pad, constant_values=False).reshape(B, H, nq, r, nk, c).any(axis=(3, 5))
            every = np.pad(every, pad, constant_values=True).reshape(B, H, nq, r, nk, c).all(axis=(3, 5))
            return np.where(every, FULL, np.where(seen, PARTIAL, EMPTY)).astype(np.int8)
        out = np.empty((B, H, nq, nk), np.int8)
        for qt in range(nq):
            g = slice(qt * rows // CHUNK, -(-min((qt + 1) * rows, Nq) // CHUNK))
            for kt in range(nk):
                c = slice(kt * keys // CHUNK, -(-min((kt + 1) * keys, Nk) // CHUNK))
                any_seen = seen[:, :, g, c].any(axis=(2, 3))
                all_seen = every[:, :, g, c].all(axis=(2, 3))
                out[:, :, qt, kt] = np.where(all_seen, FULL, np.where(any_seen, PARTIAL, EMPTY))
        return out

    def _unpack(self, words):
        """``(B, H, groups, chunks)`` bool of one of the chunk bitmaps."""
        B, H, Nq, Nk = self.shape
        bits = (words[..., None] >> np.arange(WORD, dtype=np.uint32)) & 1
        return bits.reshape(B, H, words.shape[1], -1)[..., :-(-Nk // CHUNK)].astype(bool)

    def key_tile_ranges(self, keys: int):
        """``(B, H, ceil(Nk / keys), 2)`` int64: per tile of ``keys`` keys the first query
        that sees any of them and one past the last (``Nq, 0``: none does). From the rows'
        ranges, so for a mask with holes a superset (the rows whose range overlaps the tile)."""
        B, H, Nq, Nk = self.shape
        n = -(-Nk // keys)
        c0 = np.arange(n) * keys
        out = np.empty((B, H, n, 2), np.int64)
        for b in range(B):
            for h in range(H):
                lo, hi, count = self._rows[b, h].T
                touch = ((count > 0)[:, None] & (lo[:, None] < (c0 + keys)[None, :])
                         & (hi[:, None] > c0[None, :]))                    # (Nq, n)
                seen = touch.any(0)
                out[b, h, :, 0] = np.where(seen, touch.argmax(0), Nq)
                out[b, h, :, 1] = np.where(seen, Nq - touch[::-1].argmax(0), 0)
        return out

    def device_table(self, rows: int, keys: int = 0, list_keys: int = None, list_rows: int = 0, rules=None):
        """What the kernels read (``scores.block_rules``), for query tiles of ``rows`` rows
        and (``keys`` > 0) key tiles of ``keys`` keys, on the device (built once per
        combination; ``list_keys``: the lists' key tiles, when not ``keys``, as the
        backward's dQ and dK/dV kernels' differ; ``list_rows``: see below):
        int32 ``(B · H, W)``, a row per ``(b, h)`` (``b · H + h``): a header of 4 columns
        (where the rows, the query tiles and the key tiles start), then per row ``i`` of the
        ``n · rows`` padded rows its first visible key and one past its last (``Nk, 0`` for a
        row that sees none, padding rows included), per query tile its first and
        one-past-last key any row sees and the first and one-past-last key every row sees
        (``0, 0`` unless :attr:`exact`), per key tile :meth:`key_tile_ranges`; with ``keys``
        and a mask that is not exact, per query tile the list of the key tiles it does not
        leave empty (:meth:`tile_classes`), ``ceil(Nk / keys) + 1`` columns: the count, then
        the tiles in order, ``scores.LIST_FULL`` added to a full one's (header column 3:
        where the lists start; 0 without them); with ``list_rows`` and a mask that is not
        exact, last, the same per key tile of ``keys`` keys: the query tiles of
        ``list_rows`` rows it does not leave empty (``scores.block_query_lists``). ``rules``:
        the call's built-in rules (``scores.Scores``): the lists leave out the tiles a
        causal mask or a window hides whole, as the kernels' ranges do without lists."""
        list_keys = keys if list_keys is None else list_keys
        band = None if rules is None or (rules.left is None and rules.right is None) else (rules.left, rules.right)
        found = self._tables.get((rows, keys, list_keys, list_rows, band))
        if found is None:
            B, H, Nq, Nk = self.shape
            n = -(-Nq // rows)
            ends = np.empty((B, H, n * rows, 2), np.int64)
            ends[..., 0], ends[..., 1] = Nk, 0
            ends[:, :, :Nq] = self._rows[..., :2]
            inner = np.zeros((B, H, n, 2), np.int64)
            if self.exact:
                real = (np.arange(n * rows) < Nq)[None, None, :]       # padding rows are never written
                lo = np.where(real, ends[..., 0], -1).reshape(B, H, n, rows).max(-1)
                hi = np.where(real, ends[..., 1], Nk + 1).reshape(B, H, n, rows).min(-1)
                inner[..., 0], inner[..., 1] = lo, np.maximum(hi, lo)
            tiles = np.concatenate([self.tile_ranges(rows), inner], axis=-1)
            parts = [ends.reshape(B * H, -1), tiles.reshape(B * H, -1)]
            if keys:
                parts.append(self.key_tile_ranges(keys).reshape(B * H, -1))
            if list_keys and not self.exact:
                parts.append(_tile_lists(self._listed_classes(rows, list_keys, rules, band)).reshape(B * H, -1))
            starts = np.cumsum([4] + [p.shape[1] for p in parts])
            head = np.broadcast_to(np.array([starts[0], starts[1], starts[2],
                                             starts[3] if list_keys and not self.exact else 0]), (B * H, 4))
            if keys and list_rows and not self.exact:          # (after the header's starts)
                classes = self._listed_classes(list_rows, keys, rules, band)
                parts.append(_tile_lists(np.swapaxes(classes, 2, 3)).reshape(B * H, -1))
            table = np.concatenate([head] + parts, axis=1)
            found = self._tables[(rows, keys, list_keys, list_rows, band)] = cuda.to_device(
                np.ascontiguousarray(table, dtype=np.int32))
        return found

    def _listed_classes(self, rows, keys, rules, band):
        """:meth:`tile_classes`, the tiles the built-in ``rules`` hide whole (``band`` not
        None: a causal mask or a window) made empty."""
        classes = self.tile_classes(rows, keys)
        if band is None:
            return classes
        return np.where(_rule_tiles(rules, rows, keys, *self.shape[2:]), classes, EMPTY)

    def __repr__(self):
        B, H, Nq, Nk = self.shape
        name = getattr(self.mask_mod, "__qualname__", repr(self.mask_mod))
        return f"BlockMask({name}, B={B}, H={H}, Nq={Nq}, Nk={Nk}, density={self.density:.3f})"


def _rule_tiles(rules, rows, keys, nq, nk):
    """``(n, m)`` bool: whether the built-in ``rules`` (causal, window) let some pair of query
    tile ``i`` (``rows`` rows) and key tile ``j`` (``keys`` keys) through: the tile range of
    ``scores.key_range``, the ranges the kernels visit without lists."""
    n, m = -(-nq // rows), -(-nk // keys)
    seen = np.zeros((n, m), bool)
    for i in range(n):
        begin, end = _scores.key_range(rules, i * rows, rows, nq, nk)
        if end > begin:
            seen[i, begin // keys:-(-end // keys)] = True
    return seen


def _tile_lists(classes):
    """``(B, H, n, m + 1)`` int64 of tile classes ``(B, H, n, m)``: per tile of the third
    axis how many of the fourth it does not leave empty, then those, in order, each plus
    ``scores.LIST_FULL`` when full (then zeros)."""
    seen = classes != EMPTY
    lists = np.zeros(seen.shape[:3] + (seen.shape[3] + 1,), np.int64)
    lists[..., 0] = seen.sum(-1)
    order = np.argsort(~seen, axis=-1, kind="stable")            # the seen tiles first, in order
    order += np.where(np.take_along_axis(classes, order, -1) == FULL, LIST_FULL, 0)
    lists[..., 1:] = np.where(np.arange(seen.shape[3]) < lists[..., :1], order, 0)
    return lists


def block_mask(mask_mod, B, H, Nq, Nk, *, mod_args=()):
    """block_mask(mask_mod, B, H, Nq, Nk, *, mod_args=()) -> BlockMask

    Evaluate ``mask_mod(b, h, q_idx, kv_idx, *mod_args)`` over a ``(B, H, Nq, Nk)`` problem
    once, on the device, and keep where each query row can look (:class:`BlockMask`), so
    that calls with ``block_mask=`` skip the key tiles no row of a query tile sees.

    Args:
        mask_mod: a plain Python function returning a bool (False: hidden), as for
            :func:`numba_flash.attention`'s ``mask_mod``.
        B, H: the flattened leading index (dims before the head axis) and the heads the
            mask is built for; 1 for a mask independent of that index (then built at 0).
        Nq, Nk: the query and key lengths of the calls it will serve.
        mod_args: arrays and numbers the function reads (as in the calls).

    Cost: ``B · H · Nq · Nk`` calls of ``mask_mod``, one thread per query row (on an H200
    about the time of one attention forward of that size; in the simulator slow: keep
    shapes tiny there).
    """
    from . import api, launch
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be a Python function, got {mask_mod!r}.")
    for name, x, low in (("B", B, 1), ("H", H, 1), ("Nq", Nq, 0), ("Nk", Nk, 0)):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral) or x < low:
            raise ValueError(f"{name} must be an int >= {low}, got {x!r}.")
    if not isinstance(mod_args, (tuple, list)):
        raise TypeError(f"mod_args must be a tuple of arrays and numbers, got {type(mod_args).__name__}.")
    B, H, Nq, Nk = int(B), int(H), int(Nq), int(Nk)
    n = B * H * Nq
    rows = np.empty((B, H, Nq, 3), np.int64)
    margs = api._device_mod_args(tuple(mod_args), 0)
    groups, chunks = -(-Nq // CHUNK), -(-Nk // CHUNK)
    words = np.zeros((2, B * H, groups, -(-chunks // WORD)), np.int64)
    words[1] = _FULL_WORD
    if n:
        out = cuda.device_array((n, 3), np.int64)
        seen, every = cuda.to_device(words[0]), cuda.to_device(words[1])
        kern = _rows_kernel(mask_mod, len(mod_args))
        launch.launch(kern, -(-n // THREADS), THREADS, 0, (out, seen, every, B, H, Nq, Nk, margs))
        rows[...] = out.copy_to_host().reshape(B, H, Nq, 3)
        words[0], words[1] = seen.copy_to_host(), every.copy_to_host()
    packed = words.astype(np.uint32)                           # (the low 32 bits hold the chunks)
    return BlockMask(mask_mod, (B, H, Nq, Nk), mod_args, rows, margs, (packed[0], packed[1]))
