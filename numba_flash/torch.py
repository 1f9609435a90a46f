"""PyTorch integration: custom ops with autograd, ``torch.compile`` support and an SDPA drop-in.

``import numba_flash.torch`` (needs PyTorch: ``pip install numba_flash[torch]``) registers
three operators with ``torch.library.custom_op``::

    torch.ops.numba_flash.attention_fwd(q, k, v, causal, scale, window_left, window_right,
                                         softcap, alibi_slopes) -> (out, lse)
    torch.ops.numba_flash.attention_bwd(dout, q, k, v, out, lse, causal, scale, window_left,
                                         window_right, softcap, alibi_slopes) -> (dq, dk, dv)
    torch.ops.numba_flash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new,
        v_new, block_table, causal, scale, window_left, window_right, softcap, alibi_slopes,
        check_metadata) -> (out, lse)      # mutates k_cache and v_cache (the appends)

each with a fake (meta) implementation, so ``torch.compile`` and ``torch.export`` trace
them without running them, and the forward with its autograd formula (the backward op),
so ``loss.backward()`` reaches q, k and v. A window side of ``-1`` means unbounded (None
in :func:`numba_flash.attention_fwd`). ``lse`` carries no gradient.

The functions to call: :func:`attention` and :func:`attention_fwd` (numba_flash's
semantics and options: bottom-right causal, windows, softcap, ALiBi, grouped heads),
:func:`attention_with_kvcache` (a decoding step: no gradient; with ``check_metadata=False``
and CUDA tensors nothing in it waits for the GPU, what ``torch.compile``'s CUDA graphs need), and
:func:`scaled_dot_product_attention`, a drop-in for ``torch.nn.functional.
scaled_dot_product_attention`` with its semantics (top-left ``is_causal``).

Devices: CUDA tensors run on the GPU on PyTorch's current stream; CPU tensors go through
the host path (a copy to the GPU and back, or Numba's simulator where no GPU exists,
which is how the tests exercise autograd, ``opcheck`` and ``gradcheck`` without one).
"""
from typing import Optional

import torch
from torch import Tensor

from . import api, varlen

__all__ = ["attention", "attention_fwd", "attention_with_kvcache", "scaled_dot_product_attention"]


def _window(left: int, right: int):
    return None if left < 0 and right < 0 else (None if left < 0 else left, None if right < 0 else right)


def _sides(window):
    if window is None:
        return -1, -1
    left, right = window
    return -1 if left is None else int(left), -1 if right is None else int(right)


@torch.library.custom_op("numba_flash::attention_fwd", mutates_args=())
def _fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: Optional[float], window_left: int,
         window_right: int, softcap: Optional[float], alibi_slopes: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return api.attention_fwd(q, k, v, causal=causal, scale=scale, window=_window(window_left, window_right),
                             softcap=softcap, alibi_slopes=alibi_slopes)


@_fwd.register_fake
def _fwd_fake(q, k, v, causal, scale, window_left, window_right, softcap, alibi_slopes):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=acc)


@torch.library.custom_op("numba_flash::attention_bwd", mutates_args=())
def _bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
         scale: Optional[float], window_left: int, window_right: int, softcap: Optional[float],
         alibi_slopes: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    return api.attention_bwd(dout, q, k, v, out, lse, causal=causal, scale=scale,
                             window=_window(window_left, window_right), softcap=softcap,
                             alibi_slopes=alibi_slopes)


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, causal, scale, window_left, window_right, softcap, alibi_slopes):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, window_left, window_right, softcap, alibi_slopes = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes)
    ctx.options = (causal, scale, window_left, window_right, softcap)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = _bwd(dout, q, k, v, out, lse, *ctx.options, alibi_slopes)
    return dq, dk, dv, None, None, None, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention_fwd(q, k, v, *, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None):
    """:func:`numba_flash.attention_fwd` as a differentiable PyTorch op: ``(out, lse)``
    tensors; gradients flow to q, k and v through ``out`` (``lse`` carries none)."""
    return _fwd(q, k, v, bool(causal), None if scale is None else float(scale), *_sides(window),
                None if softcap is None else float(softcap), alibi_slopes)


def attention(q, k, v, *, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None):
    """:func:`numba_flash.attention` as a differentiable PyTorch op (same arguments and
    semantics: ``causal`` is bottom-right aligned when ``Nq != Nk``)."""
    return attention_fwd(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                         alibi_slopes=alibi_slopes)[0]


@torch.library.custom_op("numba_flash::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def _kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, k_new: Optional[Tensor],
             v_new: Optional[Tensor], block_table: Optional[Tensor], causal: bool, scale: Optional[float],
             window_left: int, window_right: int, softcap: Optional[float], alibi_slopes: Optional[Tensor],
             check_metadata: bool) -> tuple[Tensor, Tensor]:
    return varlen.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new=k_new, v_new=v_new,
                                         block_table=block_table, causal=causal, scale=scale,
                                         window=_window(window_left, window_right), softcap=softcap,
                                         alibi_slopes=alibi_slopes, return_lse=True, check_metadata=check_metadata)


@_kvcache.register_fake
def _kvcache_fake(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, scale, window_left,
                  window_right, softcap, alibi_slopes, check_metadata):
    return _fwd_fake(q, k_cache, v_cache, causal, scale, window_left, window_right, softcap, alibi_slopes)


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None, block_table=None,
                           causal=False, scale=None, window=None, softcap=None, alibi_slopes=None, return_lse=False,
                           check_metadata=True):
    """:func:`numba_flash.attention_with_kvcache` as a PyTorch op (the same arguments and
    semantics; ``cache_seqlens`` and ``block_table`` as tensors): ``torch.compile`` traces
    it, the caches' appends declared as its mutations. No gradient."""
    out, lse = _kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, bool(causal),
                        None if scale is None else float(scale), *_sides(window),
                        None if softcap is None else float(softcap), alibi_slopes, bool(check_metadata))
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """A drop-in for ``torch.nn.functional.scaled_dot_product_attention`` with its semantics:
    ``query (..., Hq, L, E)``, ``key, value (..., Hkv, S, E)``; ``is_causal`` top-left
    aligned (query ``i`` sees key ``j`` iff ``j <= i``); ``scale`` None means ``1/sqrt(E)``;
    ``enable_gqa`` lets ``Hq`` be a multiple of ``Hkv``. Differentiable.

    Not supported (a ValueError says so): a tensor ``attn_mask`` (use :func:`attention`'s
    window, softcap and ALiBi options), ``dropout_p > 0``, a value head dim other than
    the query's.
    """
    if attn_mask is not None:
        raise ValueError("attn_mask is not supported by numba_flash's SDPA drop-in: pass is_causal, or use "
                         "numba_flash.torch.attention with its window, softcap and alibi_slopes options.")
    if dropout_p:
        raise ValueError(f"dropout_p must be 0 (numba_flash computes exact attention without dropout), got "
                         f"{dropout_p}.")
    if value.shape[-1] != query.shape[-1]:
        raise ValueError(f"value must have the query's head dim E={query.shape[-1]} (last axis), got "
                         f"{tuple(value.shape)}: zero-pad value to E and drop the extra output columns.")
    if query.dim() >= 3 and key.shape[-3] != query.shape[-3] and not enable_gqa:
        raise ValueError(f"query has {query.shape[-3]} heads and key {key.shape[-3]}: pass enable_gqa=True for "
                         "grouped-query attention (as torch's SDPA requires).")
    n_q, n_k = query.shape[-2], key.shape[-2]
    if not is_causal:
        return attention(query, key, value, scale=scale)
    if n_q < n_k:       # top-left: keys past the last query's position are never seen
        key, value = key[..., :n_q, :], value[..., :n_q, :]
        n_k = n_q
    if n_q == n_k:
        return attention(query, key, value, causal=True, scale=scale)
    # n_q > n_k: numba_flash aligns the diagonal bottom-right (offset n_k - n_q); move it to
    # the top-left with a window reaching n_q - n_k keys to the right of that diagonal.
    return attention(query, key, value, window=(None, n_q - n_k), scale=scale)
