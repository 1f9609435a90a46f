"""What a call computes besides ``softmax(scale · q kᵀ) v``: one description, one set of rules.

:class:`ScoreSpec` is the single description of the score rules of a call — today the
causal mask; sliding windows, softcapping, ALiBi and grouped K/V heads join it as fields.
Everything that needs a rule asks it here instead of writing the rule out:

* the float64 oracle and the tests' baselines: :func:`visible_mask` (host, NumPy);
* every kernel family, on the device: :func:`device_rules` builds the helpers once per
  spec — "is key j visible to query i" and "which keys can a tile of queries see" (key
  tiles outside that range are never loaded) — as ``inline="always"`` device functions
  (plain Python in the simulator), so the rule is compiled into each kernel with no call.

Coordinates: query ``i`` in ``[0, Nq)``, key ``j`` in ``[0, Nk)``, and ``diag = Nk − Nq``:
the causal mask is aligned to the bottom-right corner, so query ``i`` sees key ``j`` iff
``j <= i + diag`` (FlashAttention ≥ 2.1; see :func:`numba_flash.reference.causal_mask`).
"""
import dataclasses

import numpy as np

from ._runtime import SIMULATOR


@dataclasses.dataclass(frozen=True)
class ScoreSpec:
    """The score rules of one call (hashable: kernel factories are cached on it).

    ``causal``: query ``i`` sees key ``j`` only if ``j <= i + Nk − Nq``.
    """
    causal: bool = False

    @property
    def masks_keys(self) -> bool:
        """True if some in-range key can be invisible to some query."""
        return self.causal

    @property
    def tag(self) -> str:
        """Short name, as used in kernel names (``full``, ``causal``)."""
        return "causal" if self.causal else "full"


FULL = ScoreSpec()
CAUSAL = ScoreSpec(causal=True)
# Every rule set a kernel is compiled for: registry.specialisations() (the PTX checks)
# enumerates these.
SCORE_SPECS = (FULL, CAUSAL)


def spec_of(causal: bool) -> ScoreSpec:
    """The spec of the public API's options."""
    return CAUSAL if causal else FULL


# --------------------------------------------------------------------------- host (NumPy)
def visible_mask(spec: ScoreSpec, nq: int, nk: int) -> np.ndarray:
    """Boolean ``(nq, nk)``: True where query ``i`` sees key ``j``."""
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    vis = np.ones((nq, nk), dtype=bool)
    if spec.causal:
        vis &= j <= i + (nk - nq)
    return vis


def key_end(spec: ScoreSpec, q0: int, rows: int, nq: int, nk: int) -> int:
    """One past the last key that any of queries ``q0 .. q0 + rows − 1`` can see (host twin
    of the device rule, for launch planning and tests)."""
    end = nk
    if spec.causal:
        end = min(end, q0 + rows + (nk - nq))
    return max(end, 0)


def query_begin(spec: ScoreSpec, k0: int, nq: int, nk: int) -> int:
    """The first query that can see key ``k0`` or a later one."""
    return max(0, k0 - (nk - nq)) if spec.causal else 0


# --------------------------------------------------------------------------- device
def device_rules(spec: ScoreSpec):
    """``(visible, key_end, query_begin, tile_needs_mask)`` for kernels, specialised on ``spec``.

    * ``visible(i, j, Nk, diag)``: key ``j`` exists (``j < Nk``) and query ``i`` sees it.
    * ``key_end(q0, rows, Nk, diag)``: one past the last key that queries ``q0 .. q0+rows−1``
      can see (may be ≤ 0: the tile sees no key).
    * ``query_begin(k0, diag)``: the first query that sees key ``k0`` or a later one.
    * ``tile_needs_mask(q0, rows, k0, cols, Nk, diag)``: False when every key of
      ``k0 .. k0+cols−1`` exists and is visible to every query of ``q0 .. q0+rows−1``, so
      the tile's scores need no per-element test.

    Rules that ``spec`` does not ask for fold away at compile time.
    """
    causal = spec.causal

    def visible(i, j, Nk, diag):
        return j < Nk and (not causal or j <= i + diag)

    def key_end_(q0, rows, Nk, diag):
        end = Nk
        if causal:
            end = min(end, q0 + rows + diag)
        return end

    def query_begin_(k0, diag):
        start = 0
        if causal:
            start = max(0, k0 - diag)
        return start

    def tile_needs_mask(q0, rows, k0, cols, Nk, diag):
        needs = k0 + cols > Nk
        if causal:
            needs = needs or k0 + cols - 1 > q0 + diag
        return needs

    fns = (visible, key_end_, query_begin_, tile_needs_mask)
    if SIMULATOR:
        return fns
    from numba import cuda
    return tuple(cuda.jit(device=True, inline="always")(f) for f in fns)
