"""``numba_flash.warmup``: compile (and so cache on disk) the kernels some calls will need."""
import numpy as np

from . import _kernel_cache, api, registry
from . import scores as _scores
from .launch import launch


def _dtype(name):
    if str(name) == "bfloat16":
        import ml_dtypes
        return "bfloat16", np.dtype(ml_dtypes.bfloat16)
    dt = np.dtype(name)
    return dt.name, dt


def warmup(shapes, dtypes=("float32",), causal=(False,), backward=False):
    """warmup(shapes, dtypes=('float32',), causal=(False,), backward=False) -> names

    Compile now the kernels that :func:`attention` / :func:`attention_fwd` (and with
    ``backward=True`` :func:`attention_bwd`) will launch for inputs of these shapes,
    dtypes and causal flags, so that the first real call does not wait for Numba; on a
    GPU each kernel also lands in the on-disk kernel cache (README, "Compiled kernels
    on disk"), so later processes load it instead of compiling it.

    It runs each described call once on small arrays, which launch the kernels the
    described call would: the kernel choice depends on the dtype, the head dim ``d``,
    the causal flag, whether a sequence has at most ``registry.SPLIT_ROWS`` query rows
    (16-bit decoding runs its own kernel) and the device, not on the batch, the heads or
    the key count. CUDA-core dtypes (float32, float64) and 16-bit decoding also run with
    key splits, so the merge kernel that large-grid-starved calls need is compiled too
    (16-bit decoding: also the kernel of key splits as one block's warps).

    Args:
        shapes: shapes of ``q``, ``(..., Nq, d)`` each, e.g. ``[(B, H, N, d)]``
            (prefill/training) or ``[(B, H, 1, d)]`` (decoding).
        dtypes: names or NumPy dtypes: ``"float32"``, ``"float64"``, ``"float16"``,
            ``"bfloat16"``.
        causal: the causal flags to cover, e.g. ``(False, True)``.
        backward: also run the backward (after each forward).

    Returns:
        The names of the kernel specialisations it ran (``registry.Specialisation.name``),
        sorted.

    Covers inputs whose k and v have q's head count, and C-contiguous (or, for device
    arrays, 16-byte aligned unit-stride-row) layouts, without window, softcap or ALiBi.
    Other calls (grouped heads, other strides, score rules, packed sequences, KV caches)
    may need kernels it does not compile: those compile on their first call, and are
    cached then. In the simulator it runs too (on tiny arrays; nothing is cached there).
    """
    names = set()
    for shape in shapes:
        shape = tuple(int(n) for n in shape)
        if len(shape) < 2:
            raise ValueError(f"warmup: shapes are q's, (..., Nq, d); got {shape}")
        nq, d = shape[-2:]
        for dt in dtypes:
            name, dtype = _dtype(dt)
            for c in causal:
                names |= _warm(name, dtype, nq, d, bool(c), backward)
    return sorted(names)


def _warm(name, dtype, nq, d, causal, backward):
    """Run the forward (and backward) of one description on small host arrays; the names
    of the kernels launched."""
    low = name in registry.LOW_DTYPES
    # decoding (<= SPLIT_ROWS rows) picks its own kernel for 16-bit inputs; any other count
    # the same one: the smallest such, to keep the arrays small
    rows = max(nq, 1) if nq <= registry.SPLIT_ROWS else registry.SPLIT_ROWS + 1
    _, smem_limit, cc = api._device_facts()
    rules = _scores.ScoreSpec(causal=causal)
    spec = registry.forward_specialisation(name, d, rules, True, smem_limit=smem_limit, cc=cc, rows=rows)
    # key splits: two (16-bit decoding: as two warps of one block, registry.BLOCK_SPLITS),
    # and for 16-bit decoding more than a block holds (blocks of their own and the merge)
    splits = (2, registry.MAX_KEY_WARPS + 1) if spec.variant == "forward_mma_split" else (None,) if low else (2,)
    keys = max(2, *(z or 0 for z in splits)) * spec.tiling.BN      # a key tile per split
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, rows, d)).astype(dtype)
    k, v = (rng.standard_normal((1, 1, keys, d)).astype(dtype) for _ in range(2))
    ran = set()
    for z in splits:
        result, launches = api.plan_forward(q, k, v, causal, splits=z)
        for args in launches:
            launch(*args)
            ran.add(_kernel_cache.kernel_name(args[0]))
        out, lse = result()
    if backward:
        dout = rng.standard_normal(out.shape).astype(dtype)
        result, launches = api.plan_backward(dout, q, k, v, out, lse, causal)
        for args in launches:
            launch(*args)
            ran.add(_kernel_cache.kernel_name(args[0]))
        result()
    ran.discard(None)
    return ran
