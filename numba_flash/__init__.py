"""numba_flash: exact FlashAttention forward and backward, written in Python with Numba CUDA.

>>> import numpy as np, numba_flash
>>> shape = (1, 2, 32, 16) if numba_flash.SIMULATOR else (2, 8, 1024, 64)   # no GPU: tiny inputs
>>> q = k = v = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
>>> out = numba_flash.attention(q, k, v, causal=True)        # shaped like q, float32
>>> out16 = numba_flash.attention(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16))

Without a CUDA GPU the kernels run in Numba's CUDA simulator (switched on at import,
with a :class:`SimulatorWarning`): correct, but seconds for the tiny shape above.
Import numba_flash before ``numba.cuda``.

float32 and float64 run on CUDA cores (forward and backward); float16 and bfloat16
(``ml_dtypes.bfloat16`` on the host) run on tensor cores (forward and backward).

Serving layouts: :func:`attention_varlen` (packed batches of sequences of different
lengths), :func:`attention_with_kvcache` (KV caches, appended in place) and
:func:`merge_attention` (partial results over disjoint key sets).

Programmable attention: ``score_mod`` / ``mask_mod`` / ``mod_args`` (plain Python
functions compiled into the kernels) and :func:`block_mask` (docs/programmable.md).

``numba_flash.reference`` is the float64 NumPy oracle with the same semantics.

Compiled kernels are kept on disk (``~/.cache/numba_flash``; ``NUMBA_FLASH_CACHE_DIR``
moves it, ``NUMBA_FLASH_CACHE=0`` turns it off), so a new process loads them instead of
compiling; :func:`warmup` compiles those a list of calls will need ahead of time.
"""
from ._runtime import SIMULATOR, SimulatorWarning  # first: decides the simulator before numba.cuda loads
from . import _fast_analysis, _gc_pause, _inline_copies, reference
from ._arrays import release_cached_memory, to_device
from .api import attention, attention_bwd, attention_fwd
from .blockmask import BlockMask, block_mask
from .merge import merge_attention
from .varlen import attention_varlen, attention_varlen_bwd, attention_varlen_fwd, attention_with_kvcache
from ._warmup import warmup

if not SIMULATOR:
    _inline_copies.install()    # 2x faster kernel compiles, the same code
    _fast_analysis.install()    # a further 20-30 % on the largest kernels, the same code
    _gc_pause.install()         # a further 7-10 %: fewer collector pauses in a compile

__version__ = "0.1.0"
__all__ = ["attention", "attention_fwd", "attention_bwd", "attention_varlen", "attention_varlen_fwd",
           "attention_varlen_bwd",
           "attention_with_kvcache", "merge_attention", "reference", "to_device",
           "release_cached_memory", "warmup", "block_mask", "BlockMask", "SIMULATOR",
           "SimulatorWarning"]
