"""What a call computes besides ``softmax(scale · q kᵀ) v``: one description, one set of rules.

A call's score rules are the causal mask, a sliding window, softcapping and ALiBi
(grouped K/V heads change which heads are read, not the scores: see ``api.py``).
Everything that needs a rule asks it here instead of writing the rule out:

* :class:`Scores` is a call's rules with their values (the window's sizes, the cap);
  :func:`parse` builds it from the public options, with the errors they deserve;
* :class:`ScoreSpec` is what a kernel is compiled for: which rules are on. The values
  are kernel *arguments*, so one kernel serves every window size and every cap;
* the float64 oracle and the tests' baselines use the host rules: :func:`visible_mask`
  and :func:`transform` (NumPy);
* every kernel family uses the device rules, :func:`device_rules`: "is key j visible to
  query i", "which keys can a tile of queries see" and "which queries can a tile of keys
  be seen by" (tiles outside these ranges are never loaded), "does this tile need the
  per-element test", and "the score after softcap and bias" with its derivative. They
  are ``inline="always"`` device functions (plain Python in the simulator) closed over
  the spec, so a rule the spec does not ask for folds away at compile time.

Coordinates: query ``i`` in ``[0, Nq)``, key ``j`` in ``[0, Nk)``, and ``diag = Nk − Nq``:
masks are aligned to the bottom-right corner (FlashAttention ≥ 2.1, KV-cache decoding).
With a window ``(left, right)`` query ``i`` sees key ``j`` iff
``i + diag − left <= j <= i + diag + right``; causal is ``right = 0``. Scores, in the
order they are applied (``s = scale · q·k``)::

    s ← c · tanh(s / c)                 softcap c
    s ← s − slope_h · |i + diag − j|    ALiBi, slope of query head h
    s ← −inf where j is not visible
"""
import dataclasses
import math
import numbers

import numpy as np

from . import ops
from ._runtime import SIMULATOR

LOG2E = 1.4426950408889634   # 1 / ln 2: exp(x) = exp2(x · log2 e)
# A window side that is not bounded, as the kernels take it (an int64 argument): far
# beyond any sequence length, with room for the sums the rules form.
UNBOUNDED = 1 << 40


@dataclasses.dataclass(frozen=True)
class Mods:
    """User functions compiled into the kernels (``score_mod``, ``mask_mod`` and, for the
    backward of a ``score_mod``, ``score_mod_grad``; each None or a plain Python function).
    Hashable by the functions' identity: kernels are compiled once per set of functions
    (and per the types of ``mod_args``, as Numba specialises on argument types).

    With ``s`` the score in natural units after softcap and ALiBi, and ``(b, h, i, j)`` the
    flattened leading index, the query head, the query and the key positions::

        s ← score_mod(s, b, h, i, j, *mod_args)
        s ← −inf where not mask_mod(b, h, i, j, *mod_args)   (and where causal/window hide j)
    """
    score_mod: object = None
    mask_mod: object = None
    score_mod_grad: object = None
    nargs: int = 0          # how many mod_args the kernels pass on (their types are the kernel's argument types)
    blocks: bool = False    # a block mask narrows each query tile's keys (numba_flash.blockmask)
    exact: bool = False     # ... and its rows' visible keys are runs: kernels that read its row
                            # ranges (device_rules' block_rows) mask by them, never calling mask_mod


@dataclasses.dataclass(frozen=True)
class ScoreSpec:
    """The rules a kernel is compiled for (hashable: kernel factories are cached on it).

    ``causal``: query ``i`` sees key ``j`` only if ``j <= i + Nk − Nq`` (no argument).
    ``window``: the band ``[i + diag − left, i + diag + right]``, ``left`` and ``right``
    kernel arguments (a causal window is ``right = 0``: ``causal`` is then off).
    ``softcap``: ``s ← c·tanh(s/c)``, ``c`` an argument. ``alibi``: a per-head slope array.
    ``packed``: the rows hold packed sequences (variable-length batches, KV caches): the
    kernel takes one more argument, a table ``seqs (S, 4)`` int32 of ``(q_start, q_len,
    k_start, k_len)`` per sequence; sequence ``z`` (grid axis z) attends its queries
    ``q_start .. q_start + q_len − 1`` to its keys ``k_start .. k_start + k_len − 1``, and
    the rules above apply within each sequence (``diag = k_len − q_len``).
    ``paged`` (with ``packed``): the keys are a paged KV cache's, key ``j`` of sequence
    ``z`` at row ``pages[z, j // page_size] · page_size + j % page_size`` (two more
    arguments: the page table and the page size; ``k_start`` is then 0).
    """
    causal: bool = False
    window: bool = False
    softcap: bool = False
    alibi: bool = False
    packed: bool = False
    paged: bool = False
    mods: Mods = None   # user functions (score_mod, mask_mod): see Mods

    @property
    def transforms(self) -> bool:
        """True if a score is more than ``scale · q·k`` (softcap, ALiBi, a score_mod or mask_mod)."""
        return self.softcap or self.alibi or self.mods is not None

    @property
    def masks_keys(self) -> bool:
        """True if some in-range key can be invisible to some query."""
        return self.causal or self.window

    @property
    def tag(self) -> str:
        """Short name, as used in kernel names (``full``, ``causal``, ``window+softcap``...)."""
        base = "window" if self.window else "causal" if self.causal else "full"
        return (base + "".join(f"+{n}" for n in ("softcap", "alibi", "packed", "paged") if getattr(self, n))
                + ("+mods" if self.mods is not None else ""))


FULL = ScoreSpec()
CAUSAL = ScoreSpec(causal=True)
# The rule sets registry.specialisations() (the PTX checks) compiles: the two plain ones
# at every kernel shape; a window, and every rule at once, at one shape per kernel family
# and dtype (a rule's code does not depend on the tile shape, and each rule's code is
# independent of the others', so together they exercise what each does alone).
SCORE_SPECS = (FULL, CAUSAL)
RULE_SPECS = (ScoreSpec(window=True), ScoreSpec(causal=True, softcap=True, alibi=True),
              ScoreSpec(window=True, softcap=True, alibi=True))
# ... and for the families that take packed sequences (registry.Variant.packed) and paged
# caches (.paged): one rule set each, every rule with the packed rows (the packed code is
# independent of the rules'), causal with the page table.
PACKED_SPECS = (ScoreSpec(window=True, softcap=True, alibi=True, packed=True),)
PAGED_SPECS = (ScoreSpec(causal=True, packed=True, paged=True),)
PACKED = ScoreSpec(packed=True)     # helpers that take the sequence table but no rule (the split merge)


@dataclasses.dataclass(frozen=True)
class Scores:
    """A call's score rules with their values (host side; hashable).

    ``left``, ``right``: the window's sides (None: unbounded), with ``causal`` already
    folded into ``right``. ``softcap``: the cap ``c`` or None. ``alibi``: whether slopes
    are given (the slopes themselves are an array argument of the call).
    """
    left: int = None
    right: int = None
    softcap: float = None
    alibi: bool = False
    mods: Mods = None

    @property
    def spec(self) -> ScoreSpec:
        causal = self.left is None and self.right == 0
        window = not causal and (self.left is not None or self.right is not None)
        return ScoreSpec(causal=causal, window=window, softcap=self.softcap is not None, alibi=self.alibi,
                         mods=self.mods)

    def band(self):
        """``(left, right)`` as the kernels take them (unbounded: :data:`UNBOUNDED`)."""
        return (UNBOUNDED if self.left is None else self.left, UNBOUNDED if self.right is None else self.right)

    def cap_args(self, scale):
        """``(cap_in, cap_out)``: the kernels compute ``tanh(q·k · cap_in) · cap_out``, the
        capped score in log2 units (``cap_in = scale / c``, ``cap_out = c · log2 e``)."""
        if self.softcap is None:
            return 0.0, 0.0
        return scale / self.softcap, self.softcap * LOG2E


def parse(causal=False, window=None, softcap=None, alibi=False, score_mod=None, mask_mod=None,
          score_mod_grad=None, nargs=0, blocks=False, exact=False) -> Scores:
    """The :class:`Scores` of the public options, or a ``TypeError``/``ValueError`` that
    names the option and the fix."""
    mods = None
    for name, f in (("score_mod", score_mod), ("mask_mod", mask_mod), ("score_mod_grad", score_mod_grad)):
        if f is not None and not callable(f):
            raise TypeError(f"{name} must be a Python function or None, got {f!r}. Example: "
                            "score_mod=lambda s, b, h, i, j: s - 0.1 * abs(i - j).")
    if score_mod_grad is not None and score_mod is None:
        raise ValueError("score_mod_grad was given without a score_mod: pass the score_mod it differentiates.")
    if score_mod is not None or mask_mod is not None:
        mods = Mods(score_mod, mask_mod, score_mod_grad, nargs, bool(blocks), bool(blocks and exact))
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False, got {causal!r} ({type(causal).__name__}). "
                        "Pass causal=bool(...) if it is a flag of another type.")
    left = right = None
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(f"window must be a pair (left, right) of ints >= 0 or None, got {window!r}. "
                            "Example: window=(1024, 0) for a causal sliding window of 1025 keys.")
        left, right = (_window_side(x, name) for x, name in zip(window, ("left", "right")))
    if causal:
        right = 0 if right is None else min(right, 0)
    if softcap is not None:
        if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
            raise TypeError(f"softcap must be a positive float or None, got {softcap!r}. Example: softcap=30.0.")
        softcap = float(softcap)
        if not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"softcap must be finite and > 0, got {softcap}. Pass None for no softcapping.")
    return Scores(left, right, softcap, bool(alibi), mods)


def _window_side(x, name):
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"window {name} must be an int >= 0 or None (unbounded), got {x!r}.")
    if x < 0:
        raise ValueError(f"window {name} must be >= 0 or None (unbounded), got {x}. The window is "
                         "(left, right): keys i + Nk - Nq - left .. i + Nk - Nq + right are visible to query i.")
    return min(int(x), UNBOUNDED)


def spec_of(causal: bool) -> ScoreSpec:
    """The spec of ``causal`` alone."""
    return CAUSAL if causal else FULL


# --------------------------------------------------------------------------- host (NumPy)
def visible_mask(scores, nq: int, nk: int) -> np.ndarray:
    """Boolean ``(nq, nk)``: True where query ``i`` sees key ``j`` (``scores``: a
    :class:`Scores`, or a :class:`ScoreSpec` without a window)."""
    lo, hi = key_bounds(scores, 0, nq, nq, nk)
    j = np.arange(nk)[None, :]
    return (j >= lo[:, None]) & (j <= hi[:, None])


def key_bounds(scores, r0: int, r1: int, nq: int, nk: int):
    """``(lo, hi)``, int64 arrays over queries ``r0 .. r1 − 1``: query ``i`` sees the keys
    ``lo[i] <= j <= hi[i]`` (none when ``hi < lo``). Host twin of the device ``row_keys``,
    for oracles that work on row blocks."""
    scores = _as_scores(scores)
    i = np.arange(r0, r1, dtype=np.int64) + (nk - nq)
    lo = np.zeros_like(i) if scores.left is None else np.maximum(0, i - scores.left)
    hi = np.full_like(i, nk - 1) if scores.right is None else np.minimum(nk - 1, i + scores.right)
    return lo, hi


def _as_scores(scores):
    if isinstance(scores, ScoreSpec):
        assert not scores.window, "a window's mask needs its sizes: pass a Scores"
        return Scores(None, 0 if scores.causal else None)
    return scores


def transform(scores: Scores, s, slopes=None):
    """``(s', dsʹ/ds)``: the scaled scores ``s (..., Nq, Nk)`` after softcap and ALiBi bias
    (before masking), and the softcap's derivative (1 without one); ``slopes``
    broadcasts against ``s.shape[:-2]`` (float64 oracle and test baselines)."""
    nq, nk = s.shape[-2], s.shape[-1]
    grad = np.ones_like(s)
    if scores.softcap is not None:
        t = np.tanh(s / scores.softcap)
        s = scores.softcap * t
        grad = 1 - t * t
    if scores.alibi:
        dist = np.abs(np.arange(nq)[:, None] + (nk - nq) - np.arange(nk)[None, :]).astype(s.dtype)
        s = s - np.asarray(slopes, s.dtype)[..., None, None] * dist
    return s, grad


def key_range(scores, q0: int, rows: int, nq: int, nk: int):
    """``(begin, end)``: the keys any of queries ``q0 .. q0 + rows − 1`` can see lie in
    ``[begin, end)`` (empty when ``end <= begin``). Host twin of the device rule."""
    scores = _as_scores(scores)
    diag = nk - nq
    begin, end = 0, nk
    if scores.left is not None:
        begin = max(0, q0 + diag - scores.left)
    if scores.right is not None:
        end = min(end, q0 + rows + diag + scores.right)
    return begin, max(end, 0)


def key_end(spec, q0: int, rows: int, nq: int, nk: int) -> int:
    """One past the last key any of queries ``q0 .. q0 + rows − 1`` can see."""
    return key_range(spec, q0, rows, nq, nk)[1]


def query_range(scores, k0: int, cols: int, nq: int, nk: int):
    """``(begin, end)``: the queries that can see any of keys ``k0 .. k0 + cols − 1``."""
    scores = _as_scores(scores)
    diag = nk - nq
    begin, end = 0, nq
    if scores.right is not None:
        begin = max(0, k0 - diag - scores.right)
    if scores.left is not None:
        end = min(nq, k0 + cols - diag + scores.left)
    return begin, max(end, 0)


def apply_mods(scores: Scores, s, grad, mod_args=()):
    """``(s', grad', visible)``: the user's functions (``scores.mods``) applied to the scores
    ``s (..., H, Nq, Nk)`` after softcap and ALiBi, element by element in float64 (the
    oracle's twin of the device rules): ``s' = score_mod(s, b, h, i, j, *mod_args)``,
    ``grad' = grad · score_mod_grad(...)`` (unchanged without one), ``visible`` the
    ``mask_mod`` (None without one). ``b`` is the flattened index of the dims before the
    head axis (``H``; 0 when there are none), ``h`` the head."""
    mods = scores.mods
    if mods is None:
        return s, grad, None
    nq, nk = s.shape[-2:]
    heads = s.shape[-3] if s.ndim >= 3 else 1
    flat_s, flat_g = s.reshape(-1, nq, nk), grad.reshape(-1, nq, nk)
    out_s, out_g = flat_s.copy(), flat_g.copy()
    visible = np.ones(flat_s.shape, bool) if mods.mask_mod is not None else None
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    for f in range(flat_s.shape[0]):
        b, h = divmod(f, heads)
        if mods.score_mod is not None:
            # (np.vectorize hands over Python floats, which NumPy 2 lets a float32 operand
            # round: the user's function gets the score as a NumPy scalar of its dtype)
            dt = flat_s.dtype.type
            out_s[f] = np.vectorize(lambda x, i_, j_: float(mods.score_mod(dt(x), b, h, int(i_), int(j_), *mod_args)),
                                    otypes=[np.float64])(flat_s[f], i, j)
            if mods.score_mod_grad is not None:
                out_g[f] = flat_g[f] * np.vectorize(
                    lambda x, i_, j_: float(mods.score_mod_grad(dt(x), b, h, int(i_), int(j_), *mod_args)),
                    otypes=[np.float64])(flat_s[f], i, j)
        if visible is not None:
            visible[f] = np.vectorize(lambda i_, j_: bool(mods.mask_mod(b, h, int(i_), int(j_), *mod_args)),
                                      otypes=[bool])(i, j)
    shape = s.shape
    return out_s.reshape(shape), out_g.reshape(shape), None if visible is None else visible.reshape(shape)


def visible_pairs(scores, nq: int, nk: int) -> int:
    """How many (query, key) pairs are visible: the work of a call, for FLOP counts."""
    scores = _as_scores(scores)
    i = np.arange(nq, dtype=np.int64)
    lo = np.zeros(nq, np.int64) if scores.left is None else np.maximum(0, i + (nk - nq) - scores.left)
    hi = np.full(nq, nk, np.int64) if scores.right is None else np.minimum(nk, i + (nk - nq) + scores.right + 1)
    return int(np.maximum(hi - lo, 0).sum())


def band_tiles(scores, rows: int, cols: int, nq: int, nk: int) -> int:
    """The most key tiles of ``cols`` keys (aligned to multiples of ``cols``) that one
    query tile of ``rows`` rows can see: what a key split divides."""
    scores = _as_scores(scores)
    all_tiles = -(-nk // cols)
    if scores.left is None or scores.right is None:
        return all_tiles
    return min(all_tiles, -(-(rows + scores.left + scores.right) // cols) + 1)


# --------------------------------------------------------------------------- device
# How each input dtype's kernels compute the softcap's tanh (``device_rules``): float64
# exactly; float32 with the special-function reciprocal (within a few units of the last
# place, as the exact form, and 11% faster in the float32 forward on the H200); float16
# and bfloat16 with the special-function tanh, whose error (2⁻¹¹ relative at most by the
# PTX manual, 2⁻¹⁶·⁶ measured on the H200) is below the rounding of P to 16 bits before
# P·V (docs/performance.md, item 22).
SOFTCAP_TANH = {"float64": "exact", "float32": "rcp", "float16": "approx", "bfloat16": "approx"}


def device_rules(spec: ScoreSpec, dtype_name: str = "float32", tanh: str = None, block_rows: bool = False,
                 mask_apart: bool = False):
    """``(row_keys, in_row, key_range, query_range, tile_needs_mask, score, score_consts)`` for kernels,
    specialised on ``spec``; ``dtype_name`` is the kernel's accumulator dtype. ``geo`` is
    the tuple ``(Nk, diag, left, right)`` (int64; ``left``, ``right`` the window's sides,
    read only when ``spec.window``).

    * ``row_keys(i, geo)``: ``(lo, hi)``, query ``i`` sees the existing keys ``lo <= j <= hi``
      (computed once per row; ``lo`` is read only for a window);
    * ``in_row(j, lo, hi)``: whether key ``j`` is among them (query ``i`` sees key ``j`` iff
      ``in_row(j, *row_keys(i, geo))``).
    * ``key_range(q0, rows, geo)``: ``(begin, end)``, the keys queries ``q0 .. q0+rows−1``
      can see (``begin >= 0``; ``end`` may be ``<= begin``: the tile sees no key).
    * ``query_range(k0, cols, Nq, geo)``: ``(begin, end)``, the queries that can see any of
      keys ``k0 .. k0+cols−1``.
    * ``tile_needs_mask(q0, rows, k0, cols, geo)``: False when every key of
      ``k0 .. k0+cols−1`` exists and is visible to every query of ``q0 .. q0+rows−1``.
    * ``score(x, i, j, diag, sc)``: ``(score, grad)`` for the raw product ``x = q_i·k_j``,
      with ``sc = (scale_log2, cap_in, cap_out, slope_log2)``: the score in log2 units
      after softcap and ALiBi (before masking), and ``d score / d (scale·x)`` in natural
      units over ``scale``'s (the softcap's ``1 − tanh²``; 1 without one).
    * ``score_consts(scale_log2, cap_in, cap_out, slopes, b1, b2)``: ``score``'s ``sc`` for
      leading index ``(b1, b2)`` (ALiBi's slope read from ``slopes[b1, b2, 0]`` only when
      the spec has ALiBi).

    ``tanh`` is how the softcap's tanh is computed (``SOFTCAP_TANH`` of the kernel's input
    dtype; default: that of ``dtype_name``): "exact" as ``1 − 2 / (e^{2u} + 1)`` with a
    correctly rounded division (a few units of the last place); "rcp" the same with the
    special-function reciprocal (``rcp.approx``, within 1 ulp: a few units of the last
    place too, in a handful of instructions fewer); "approx" the special-function tanh
    (``tanh.approx``, one instruction). The last two are float32 only.

    ``block_rows``: the kernel folds an exact block mask's row ranges into ``row_keys``'
    (``block_row_rules``) and masks the tiles it marks partial: with such a mask
    (``spec.mods.exact``) ``in_row`` then tests both ends and ``score`` leaves ``mask_mod``
    out.

    ``mask_apart``: the kernel applies ``mask_mod`` itself, through :func:`mask_rule`'s
    ``pair_visible`` (a set of bits per tile, so that a score loop without calls stays
    unrolled in registers): ``score`` leaves it out.
    """
    tanh = tanh or SOFTCAP_TANH[dtype_name]
    rows_given = block_rows and spec.mods is not None and spec.mods.exact
    assert tanh == "exact" or (tanh in ("rcp", "approx") and dtype_name == "float32"), (tanh, dtype_name)
    causal, window, softcap, alibi = spec.causal, spec.window, spec.softcap, spec.alibi
    DT = np.dtype(dtype_name).type
    ZERO, ONE, TWO, TWO_LOG2E, CLAMP, LOG2E_T = DT(0), DT(1), DT(2), DT(2 * LOG2E), DT(126), DT(LOG2E)

    def row_keys(i, geo):
        Nk, diag, left, right = geo
        lo = 0
        hi = Nk - 1
        if causal:
            hi = min(hi, i + diag)
        if window:
            lo = i + diag - left
            hi = min(hi, i + diag + right)
        return lo, hi

    def in_row(j, lo, hi):
        if window or rows_given:
            return j >= lo and j <= hi
        return j <= hi

    def key_range(q0, rows, geo):
        Nk, diag, left, right = geo
        begin = 0
        end = Nk
        if causal:
            end = min(end, q0 + rows + diag)
        if window:
            begin = max(0, q0 + diag - left)
            end = min(end, q0 + rows + diag + right)
        return begin, end

    def query_range(k0, cols, Nq, geo):
        Nk, diag, left, right = geo
        begin = 0
        end = Nq
        if causal:
            begin = max(0, k0 - diag)
        if window:
            begin = max(0, k0 - diag - right)
            end = min(Nq, k0 + cols - diag + left)
        return begin, end

    def tile_needs_mask(q0, rows, k0, cols, geo):
        Nk, diag, left, right = geo
        needs = k0 + cols > Nk
        if causal:
            needs = needs or k0 + cols - 1 > q0 + diag
        if window:
            needs = needs or k0 + cols - 1 > q0 + diag + right or k0 < q0 + rows - 1 + diag - left
        return needs

    def score(x, i, j, diag, sc):
        scale_log2, cap_in, cap_out, slope_log2 = sc
        return builtin_score(x, i, j, diag, scale_log2, cap_in, cap_out, slope_log2)

    def builtin_score(x, i, j, diag, scale_log2, cap_in, cap_out, slope_log2):
        grad = ONE
        if softcap:
            # tanh(u) = 1 − 2 / (e^{2u} + 1): one exp2 and one division, a few times
            # shorter than libdevice's tanh (whose size keeps the kernels' score loops
            # from unrolling); absolute error a few units of 1's last place, exact ±1 in
            # the tails.
            # (the exponent is clamped where t is already 1: no overflow to raise in the simulator)
            if tanh == "approx":
                t = ops.tanh_approx(x * cap_in)
            elif tanh == "rcp":
                t = ONE - TWO * ops.rcp_approx(math.exp2(min(x * cap_in * TWO_LOG2E, CLAMP)) + ONE)
            else:
                t = ONE - TWO / (math.exp2(min(x * cap_in * TWO_LOG2E, CLAMP)) + ONE)
            y = t * cap_out
            grad = ONE - t * t
        else:
            y = x * scale_log2
        if alibi:
            y -= slope_log2 * DT(abs(i + diag - j))
        return y, grad

    def score_consts(scale_log2, cap_in, cap_out, slopes, b1, b2):
        slope_log2 = slopes[b1, b2, 0] * LOG2E_T if alibi else ZERO
        return scale_log2, cap_in, cap_out, slope_log2

    (builtin_score,) = _device((builtin_score,))     # score's closure sees the device function
    if spec.mods is None:
        return _device((row_keys, in_row, key_range, query_range, tile_needs_mask, score, score_consts))
    score, score_consts = _mod_rules(spec, builtin_score, DT, rows_given or mask_apart)
    return _device((row_keys, in_row, key_range, query_range, tile_needs_mask)) + (score, score_consts)


def _block_table():
    """``block_table(slopes, b1, b2)``: a block mask's table and the row of leading index
    ``(b1, b2)`` in it (``slopes`` as :func:`block_rules` describes)."""
    def block_table(slopes, b1, b2):
        return slopes[2], int(slopes[0][b1, b2, 5])
    return _device((block_table,))[0]


def block_rules(spec: ScoreSpec):
    """``(block_keys, block_queries)``:

    * ``block_keys(slopes, b1, b2, qt, begin, end)``: the key range ``[begin, end)`` of
      query tile ``qt`` narrowed to where a block mask (``spec.mods.blocks``) says its rows
      can see anything;
    * ``block_queries(slopes, b1, b2, kt, begin, end)``: the query range ``[begin, end)`` of
      key tile ``kt`` narrowed to the rows that may see any of its keys.

    ``slopes`` is then the triple ``(ids, mod_args, table)``: ``ids`` as :func:`_mod_rules`
    reads it with ``ids[b1, b2, 5]`` the leading index's row of ``table``, the block mask's
    ``BlockMask.device_table`` for the kernels' query (and key) tile heights (``api`` passes
    them; its header, columns 1 and 2, says where the query and key tiles start). Without a
    block mask the ranges are returned as they are."""
    block_table = _block_table()
    if spec.mods is not None and spec.mods.blocks:
        def block_keys(slopes, b1, b2, qt, begin, end):
            table, t = block_table(slopes, b1, b2)
            at = table[t, 1] + 4 * qt
            return max(begin, int(table[t, at])), min(end, int(table[t, at + 1]))

        def block_queries(slopes, b1, b2, kt, begin, end):
            table, t = block_table(slopes, b1, b2)
            at = table[t, 2] + 2 * kt
            return max(begin, int(table[t, at])), min(end, int(table[t, at + 1]))
    else:
        def block_keys(slopes, b1, b2, qt, begin, end):
            return begin, end

        def block_queries(slopes, b1, b2, kt, begin, end):
            return begin, end
    return _device((block_keys, block_queries))


# In a block mask's list of key tiles (``BlockMask.device_table``): added to the tile's
# index when every pair of the tile is visible (its scores then skip ``mask_mod``)
LIST_FULL = 1 << 30     # (above any tile index: keys < 2**31, tiles of 32 keys or more)


def block_lists(spec: ScoreSpec):
    """``(key_tile_count, key_tile_at, key_tile_consts)`` for kernels that visit a query
    tile's key tiles from a list: with a block mask that is not exact (``spec.mods.blocks``
    and not ``exact``) the table's list of the tiles some pair of the query tile sees
    (``BlockMask.device_table``: its header's column 3 says where the lists start, one of
    ``n_kt + 1`` entries per query tile, the count first), so the empty tiles inside the
    range are neither loaded nor computed, and the full ones (:data:`LIST_FULL`) skip
    ``mask_mod``; otherwise the range as it is:

    * ``key_tile_count(slopes, b1, b2, qt, n_kt, count)``: how many tiles (``count``: the
      range's);
    * ``key_tile_at(slopes, b1, b2, qt, n_kt, kt0, j)``: the ``j``-th (``kt0 + j``);
    * ``key_tile_consts(slopes, b1, b2, qt, n_kt, j, sc)``: the score constants ``sc``
      (``score_consts``') for the ``j``-th tile's scores: told that the tile is full (no
      ``mask_mod`` to call), or ``sc`` as it is."""
    count, at, consts = block_key_lists(spec)

    def key_tile_count(slopes, b1, b2, qt, n_kt, n):
        return count(slopes, b1, b2, qt, 0, n_kt, n)

    def key_tile_at(slopes, b1, b2, qt, n_kt, kt0, j):
        return at(slopes, b1, b2, qt, 0, n_kt, kt0, j)

    def key_tile_consts(slopes, b1, b2, qt, n_kt, j, sc):
        return consts(slopes, b1, b2, qt, 0, n_kt, j, sc)
    return _device((key_tile_count, key_tile_at, key_tile_consts))


def block_key_lists(spec: ScoreSpec):
    """:func:`block_lists`' functions as :func:`block_query_lists` takes its arguments
    (``qt, n_qt, n_kt``: the query tile, how many query and key tiles there are)."""
    def start(table, t, qt, n_qt, n_kt):
        return table[t, 3] + qt * (n_kt + 1)
    return _tile_lists(spec, start)


def block_query_lists(spec: ScoreSpec):
    """``(query_tile_count, query_tile_at, query_tile_consts)``: as :func:`block_lists`
    for the dK/dV kernels, which visit a key tile's query tiles: the table's lists per key
    tile (its last ``n_kt · (n_qt + 1)`` columns, ``BlockMask.device_table``'s
    ``list_rows``), each function taking ``kt, n_kt, n_qt`` (the key tile, how many key
    and query tiles there are) where :func:`block_lists`' take ``qt, n_kt``."""
    def start(table, t, kt, n_kt, n_qt):
        return table.shape[1] - (n_kt - kt) * (n_qt + 1)
    return _tile_lists(spec, start)


def has_lists(spec: ScoreSpec) -> bool:
    """Whether the kernels of ``spec`` visit a block mask's lists of tiles (one that is
    not exact) rather than ranges."""
    return spec.mods is not None and spec.mods.blocks and not spec.mods.exact


def _tile_lists(spec, start):
    """``(count, at, consts)`` over a block mask's lists, the list of ``tile`` (of
    ``n_tiles``, each listing some of ``n_other`` tiles) at column ``start(table, t, tile,
    n_tiles, n_other)`` of the table's row ``t``; stand-ins for the range without lists."""
    block_table = _block_table()
    if has_lists(spec):
        (start,) = _device((start,))

        def entry(slopes, b1, b2, tile, n_tiles, n_other, j):
            table, t = block_table(slopes, b1, b2)
            return int(table[t, start(table, t, tile, n_tiles, n_other) + j])

        def count(slopes, b1, b2, tile, n_tiles, n_other, n):
            return entry(slopes, b1, b2, tile, n_tiles, n_other, 0)

        def at(slopes, b1, b2, tile, n_tiles, n_other, first, j):
            return entry(slopes, b1, b2, tile, n_tiles, n_other, 1 + j) & (LIST_FULL - 1)

        def consts(slopes, b1, b2, tile, n_tiles, n_other, j, sc):
            full = entry(slopes, b1, b2, tile, n_tiles, n_other, 1 + j) >= LIST_FULL
            return sc[0], sc[1], sc[2], sc[3], sc[4], sc[5], sc[6], sc[7], sc[8], full
        (entry,) = _device((entry,))
    else:
        def count(slopes, b1, b2, tile, n_tiles, n_other, n):
            return n

        def at(slopes, b1, b2, tile, n_tiles, n_other, first, j):
            return first + j

        def consts(slopes, b1, b2, tile, n_tiles, n_other, j, sc):
            return sc
    return _device((count, at, consts))


def block_row_rules(spec: ScoreSpec):
    """``(block_rows, block_tile)`` for kernels that mask by an exact block mask's rows
    (``spec.mods.exact``; ``device_rules(..., block_rows=True)``), else stand-ins that
    change nothing:

    * ``block_rows(slopes, b1, b2, i, lo, hi)``: ``row_keys``' ``(lo, hi)`` of query row ``i``
      (``i`` below the table's padded rows) narrowed to the mask's run of keys;
    * ``block_tile(slopes, b1, b2, qt, k0, cols)``: True unless every row of query tile
      ``qt`` sees every key ``k0 .. k0 + cols − 1`` by the mask (then no score of the tile
      needs masking for it)."""
    block_table = _block_table()
    if spec.mods is not None and spec.mods.exact:
        def block_rows(slopes, b1, b2, i, lo, hi):
            table, t = block_table(slopes, b1, b2)
            return max(lo, int(table[t, 4 + 2 * i])), min(hi, int(table[t, 5 + 2 * i]) - 1)

        def block_tile(slopes, b1, b2, qt, k0, cols):
            table, t = block_table(slopes, b1, b2)
            at = table[t, 1] + 4 * qt
            return k0 < table[t, at + 2] or k0 + cols > table[t, at + 3]
    else:
        def block_rows(slopes, b1, b2, i, lo, hi):
            return lo, hi

        def block_tile(slopes, b1, b2, qt, k0, cols):
            return False
    return _device((block_rows, block_tile))


def mask_rule(spec: ScoreSpec, dtype_name: str = "float32"):
    """``pair_visible(i, j, sc)`` for kernels that apply ``mask_mod`` apart from the scores
    (``device_rules(..., mask_apart=True)``): whether query ``i`` sees key ``j`` by the
    user's ``mask_mod``, with ``sc`` the score constants of the pair's tile (``_mod_rules``'
    ``score_consts``, its last item set by :func:`block_lists`). True without asking the
    function in a full tile and for padding rows and columns (``i >= Nq`` or ``j >= Nk``:
    the kernels mask or drop those themselves, and the function may index a table by
    position)."""
    mods = spec.mods
    mmod = _call_with_args(mods.mask_mod, False, mods.nargs)
    ZERO = np.dtype(dtype_name).type(0)

    def pair_visible(i, j, sc):
        scale_log2, cap_in, cap_out, slope_log2, b, h, nq, nk, margs, full = sc
        if full or i >= nq or j >= nk:
            return True
        return bool(mmod(ZERO, b, h, i, j, margs))
    return _device((pair_visible,))[0]


def _mod_rules(spec, builtin_score, DT, rows_given=False):
    """``score`` and ``score_consts`` with the user's functions (:class:`Mods`): ``slopes``
    is then the pair ``(ids, mod_args)``, ``ids (B1, B2, 5)`` holding per leading index the
    ALiBi slope, the flattened leading index ``b``, the head ``h``, ``Nq`` and ``Nk``
    (``api``), and ``mod_args`` the user's tuple; ``sc`` carries them on. The user's
    functions are called for existing (query, key) pairs only: kernels compute scores of
    padding rows and columns too (and mask or drop them), and a user function may index
    a table by position. ``rows_given``: the kernel masks by an exact block mask's rows
    instead of calling ``mask_mod``, or calls it apart (:func:`mask_rule`). The constants' last item says the scores' tile is
    full (every pair visible: ``mask_mod`` is not called); False from ``score_consts``
    (:func:`block_lists`' ``key_tile_consts`` sets it per tile)."""
    alibi = spec.alibi
    mods = spec.mods
    HAS_S, HAS_M, HAS_G = (f is not None for f in (mods.score_mod, mods.mask_mod, mods.score_mod_grad))
    HAS_M = HAS_M and not rows_given
    smod, gmod = (_call_with_args(f, True, mods.nargs) for f in (mods.score_mod, mods.score_mod_grad))
    mmod = _call_with_args(mods.mask_mod, False, mods.nargs)
    ZERO, LN2_T, LOG2E_T, NEG_INF = DT(0), DT(math.log(2)), DT(LOG2E), DT(-math.inf)

    def score(x, i, j, diag, sc):
        scale_log2, cap_in, cap_out, slope_log2, b, h, nq, nk, margs, full = sc
        y, grad = builtin_score(x, i, j, diag, scale_log2, cap_in, cap_out, slope_log2)
        if i >= nq or j >= nk:
            return y, grad
        if HAS_S:
            s = y * LN2_T
            y = DT(smod(s, b, h, i, j, margs)) * LOG2E_T
            if HAS_G:
                grad = grad * DT(gmod(s, b, h, i, j, margs))
        if HAS_M:
            if not full and not mmod(ZERO, b, h, i, j, margs):
                y = NEG_INF
                grad = ZERO
        return y, grad

    def score_consts(scale_log2, cap_in, cap_out, slopes, b1, b2):
        ids, margs = slopes[0], slopes[1]
        slope_log2 = ids[b1, b2, 0] * LOG2E_T if alibi else ZERO
        return (scale_log2, cap_in, cap_out, slope_log2, int(ids[b1, b2, 1]), int(ids[b1, b2, 2]),
                int(ids[b1, b2, 3]), int(ids[b1, b2, 4]), margs, False)

    return _device((score, score_consts))


def _call_with_args(f, with_score, nargs):
    """``call(s, b, h, i, j, margs)``: the user's function ``f`` called with the score
    (``with_score``: score_mod and its gradient; not mask_mod), the indices and the
    ``nargs`` items of the tuple ``margs`` spread out, as an inlined device function (Numba
    cannot inline a call with ``*args``, so the spread is written out, per ``nargs``).
    ``f`` None: a stand-in never called."""
    spread = "".join(f", m[{n}]" for n in range(nargs))
    body = "0" if f is None else f"f({'s, ' if with_score else ''}b, h, i, j{spread})"
    ns = {}
    if f is not None:
        f = getattr(f, "py_func", f)           # a Numba function: inline its Python source
        ns["f"] = f if SIMULATOR else _device((f,))[0]
    exec(f"def call(s, b, h, i, j, m):\n    return {body}\n", ns)
    return _device((ns["call"],))[0]


def _device(fns):
    if SIMULATOR:
        return fns
    from numba import cuda
    return tuple(cuda.jit(device=True, inline="always")(f) for f in fns)


def device_sequence(spec: ScoreSpec):
    """``sequence(seqs, z, nq, nk)``: ``(q_start, q_len, k_start, k_len)`` of sequence ``z``
    — row ``z`` of the table ``seqs`` when ``spec.packed``, else ``(0, nq, 0, nk)``: the
    whole of the kernel's views (``seqs`` is then not read)."""
    from numba import int64 as I64
    packed = spec.packed

    def sequence(seqs, z, nq, nk):
        if packed:        # (int64, as the rules' sums with the window sides need)
            return I64(seqs[z, 0]), I64(seqs[z, 1]), I64(seqs[z, 2]), I64(seqs[z, 3])
        return 0, nq, 0, nk

    return _device((sequence,))[0]


def _paged_row(pages, z, j, page_size):
    """Row ``j`` of sequence ``z`` of a paged KV cache (:class:`ScoreSpec` ``paged``): row
    ``j % page_size`` of page ``pages[z, j // page_size]``, as a row of the pages' rows."""
    page = j // page_size
    return pages[z, page] * page_size + j - page * page_size


paged_row = _device((_paged_row,))[0]
