"""Context-parallel ring attention over ``torch.distributed``: sequences longer than one GPU holds.

Each rank of a process group holds a shard of the sequence, ``q, k, v (B, H, N / P, d)``
(PyTorch tensors; CUDA tensors under NCCL, CPU tensors under gloo, where numba_flash runs
its host path or the simulator). K/V shards travel around the ring of ranks
(``rank → rank + 1``) while each rank attends its queries to the shard it holds; the
partial results over disjoint key sets merge exactly through their log-sum-exp
(:func:`numba_flash.merge_attention`). The next shard's send and receive (one batched
``isend``/``irecv`` pair, K and V packed in one buffer) are posted before the current
shard's attention and waited for after it, so communication overlaps compute where the
backend runs it asynchronously.

Causal masks use the **zigzag** sharding: the sequence is cut into ``2P`` chunks and rank
``r`` holds chunks ``r`` and ``2P − 1 − r``, so every rank does the same work under the
mask (:func:`zigzag_shard`, :func:`zigzag_unshard`). Per ring step each of the rank's two
query chunks attends to each of the visiting two key chunks that it can see: an earlier
chunk entirely, its own chunk causally (the diagonal), a later chunk not at all (skipped).
Without ``causal`` any contiguous sharding works (the order of keys does not matter).

The backward (``torch.autograd``) recomputes per step with the final ``out`` and ``lse``
(:func:`numba_flash.attention_bwd` of each visible chunk pair gives that pair's exact
share of the gradients), accumulates ``dq`` locally and ``dk``/``dv`` in buffers that
travel with the K/V shard and return to its owner after the last step. Partial results
and gradients accumulate in float32 (float64 for float64 inputs) in a fixed order, so a
fixed world size gives bitwise-reproducible results.

Grouped heads (``Hq % Hkv == 0``) work as in :func:`numba_flash.attention`. Not yet:
windows, softcap, ALiBi and user functions on the ring (single-GPU calls have them).
"""
import torch
import torch.distributed as dist

from . import api
from .merge import merge_attention


def zigzag_shard(x, rank: int, world: int, dim: int = -2):
    """Rank ``rank``'s shard of a full sequence ``x`` for causal ring attention: chunks
    ``rank`` and ``2 · world − 1 − rank`` of ``2 · world`` equal chunks along ``dim``
    (the sequence length must divide by ``2 · world``)."""
    n = x.shape[dim]
    if n % (2 * world):
        raise ValueError(f"zigzag sharding cuts the sequence into 2 * world = {2 * world} equal chunks; "
                         f"its length {n} (axis {dim}) does not divide. Pad it to a multiple.")
    chunks = x.chunk(2 * world, dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim)


def zigzag_unshard(shards, dim: int = -2):
    """The full sequence from every rank's zigzag shard (``shards[r]`` from rank ``r``, e.g.
    from ``torch.distributed.all_gather``): the inverse of :func:`zigzag_shard`."""
    world = len(shards)
    halves = [s.chunk(2, dim) for s in shards]
    return torch.cat([halves[r][0] for r in range(world)] + [halves[r][1] for r in reversed(range(world))], dim)


def ring_attention(q, k, v, *, group=None, causal=False, scale=None, return_lse=False):
    """ring_attention(q, k, v, *, group=None, causal=False, scale=None, return_lse=False) -> out (or (out, lse))

    Exact attention of this rank's queries to the whole sequence, whose keys and values
    are spread over the ranks of ``group`` (default: the world), with autograd.

    Args:
        q: ``(B, Hq, n, d)``, k, v: ``(B, Hkv, n, d)``: this rank's shard (``n = N / P``,
            equal on every rank): with ``causal``, the zigzag shard (:func:`zigzag_shard`);
            otherwise any partition of the sequence. float32, float64, float16 or
            bfloat16, as :func:`numba_flash.attention`.
        group: a ``torch.distributed`` process group (None: the default group).
        causal: a causal mask over the whole sequence (zigzag shards).
        scale: as :func:`numba_flash.attention` (None: ``1/sqrt(d)``).
        return_lse: also return ``lse (B, Hq, n)`` (float32, float64 for float64; no
            gradient flows through it).

    Returns:
        ``out (B, Hq, n, d)``: this rank's rows of the attention output, in q's dtype.
    """
    out, lse = _Ring.apply(q, k, v, group, bool(causal), scale)
    return (out, lse) if return_lse else out


def _pairs(rank, src, world, causal):
    """The visible (query chunk, key chunk, diagonal) pairs of rank ``rank``'s queries and
    rank ``src``'s keys: chunk indices 0/1 within each shard (zigzag chunk ids ``r`` and
    ``2P − 1 − r``); without ``causal`` the whole shards, as one pair ``(None, None, False)``."""
    if not causal:
        return [(None, None, False)]
    ids_q, ids_k = (rank, 2 * world - 1 - rank), (src, 2 * world - 1 - src)
    found = []
    for a, qi in enumerate(ids_q):
        for b, ki in enumerate(ids_k):
            if ki <= qi:
                found.append((a, b, ki == qi))
    return found


def _chunk(x, which):
    return x if which is None else x.chunk(2, -2)[which]


def _step_exchange(buf, group, rank, world):
    """Post the send of ``buf`` to the next rank and the receive of the previous rank's into
    a new buffer; returns ``(requests, received)``."""
    def peer(r):                  # P2P operations name global ranks
        return dist.get_global_rank(group, r % world) if group else r % world
    got = torch.empty_like(buf)
    ops = [dist.P2POp(dist.isend, buf, peer(rank + 1), group), dist.P2POp(dist.irecv, got, peer(rank - 1), group)]
    return dist.batch_isend_irecv(ops), got


def _tensor(x, like):
    """A result as a tensor on ``like``'s device (host results of CPU tensors come back as
    NumPy arrays)."""
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x, device=like.device)


def _acc_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        _check(q, k, v, world, causal)
        acc = _acc_dtype(q)
        kv = torch.stack([k, v]).contiguous()
        parts = {}                                   # query chunk -> [(out, lse)] in step order
        for step in range(world):
            src = (rank - step) % world
            reqs, nxt = _step_exchange(kv, group, rank, world) if step + 1 < world else ([], None)
            for a, b, diag in _pairs(rank, src, world, causal):
                o, lse = api.attention_fwd(_chunk(q, a), _chunk(kv[0], b), _chunk(kv[1], b), causal=diag, scale=scale)
                parts.setdefault(a, []).append((o.to(acc), lse))
            for r in reqs:
                r.wait()
            kv = nxt
        outs, lses = [], []
        for a in ([None] if not causal else [0, 1]):
            o, lse = parts[a][0] if len(parts[a]) == 1 else merge_attention([p[0] for p in parts[a]],
                                                                              [p[1] for p in parts[a]])
            outs.append(_tensor(o, q))
            lses.append(_tensor(lse, q))
        out = (outs[0] if not causal else torch.cat(outs, -2)).to(q.dtype)
        lse = lses[0] if not causal else torch.cat(lses, -1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        acc = _acc_dtype(q)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=acc, device=k.device)   # the visiting shard's dK, dV so far
        for step in range(world):
            src = (rank - step) % world
            reqs, nxt = _step_exchange(kv, group, rank, world) if step + 1 < world else ([], None)
            for a, b, diag in _pairs(rank, src, world, causal):
                gq, gk, gv = api.attention_bwd(_chunk(dout, a), _chunk(q, a), _chunk(kv[0], b), _chunk(kv[1], b),
                                               _chunk(out, a), lse if a is None else lse.chunk(2, -1)[a],
                                               causal=diag, scale=scale)
                _chunk(dq, a).add_(gq.to(acc))
                _chunk(dkv[0], b).add_(gk.to(acc))
                _chunk(dkv[1], b).add_(gv.to(acc))
            # dK/dV go where K/V go next (after the last step: home, to their owner)
            dreqs, dnxt = _step_exchange(dkv, group, rank, world)
            for r in reqs + dreqs:
                r.wait()
            kv, dkv = nxt, dnxt
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def _check(q, k, v, world, causal):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D torch tensor (B, H, n, d): this rank's shard, got "
                             f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))}.")
    if k.shape != v.shape or q.shape[-2] != k.shape[-2]:
        raise ValueError(f"q, k, v must be shards of one sequence (equal lengths, k and v alike), got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}.")
    if causal and q.shape[-2] % 2:
        raise ValueError(f"a causal ring takes zigzag shards (two equal chunks per rank): the shard length "
                         f"{q.shape[-2]} must be even (numba_flash.distributed.zigzag_shard).")
