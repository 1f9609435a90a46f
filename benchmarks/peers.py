"""The PyTorch peers: SDPA restricted to one backend at a time, and FlexAttention under
``torch.compile`` (the variants mode)."""
import warnings

from numba_flash import registry


# Peers: PyTorch SDPA backends. JSON key -> (table label, torch.nn.attention.SDPBackend member),
# and the dtypes each is timed for (FlashAttention-2 and cuDNN take only 16-bit inputs; MATH on
# 16-bit inputs would only measure its O(N^2) score matrices).
PEERS = {"sdpa_flash": ("flash", "FLASH_ATTENTION"), "sdpa_cudnn": ("cudnn", "CUDNN_ATTENTION"),
         "sdpa_efficient": ("eff", "EFFICIENT_ATTENTION"), "sdpa_math": ("math", "MATH")}
PEER_DTYPES = {"sdpa_flash": registry.LOW_DTYPES, "sdpa_cudnn": registry.LOW_DTYPES,
               "sdpa_efficient": registry.DTYPES + registry.LOW_DTYPES, "sdpa_math": registry.DTYPES}
def peer_unavailable(bench, cfg):
    if bench.torch is None:
        return "not run: torch not importable (or no GPU)"
    if not bench.peers:
        return "not run: --no-peers"
    s = cfg["shape"]
    if cfg["causal"] and s.Nq != s.Nk:
        return "SDPA is_causal is top-left aligned: differs from ours when Nq != Nk"
    return None


def run_peer(name, bench, body):
    """``body()`` (-> record) with SDPA restricted to peer ``name``'s backend.

    An unsupported backend ("No available kernel") or running out of memory gives
    ``{"error": ...}``; torch's cache is emptied after either way (MATH's score matrices).
    """
    torch = bench.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        with warnings.catch_warnings(), sdpa_kernel(getattr(SDPBackend, PEERS[name][1])):
            warnings.simplefilter("ignore")   # "memory efficient kernel not used because ..."
            rec = body()
    except Exception as exc:  # noqa: BLE001 - unsupported or out of memory
        rec = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    finally:
        torch.cuda.empty_cache()
    return rec


def add_peers(rec, cfg, bench, time_peer):
    """Fill ``rec["peers"]``: ``time_peer(name)`` for each SDPA backend, or why it was not run."""
    reason = peer_unavailable(bench, cfg)
    for name in PEERS:
        why = reason or (None if cfg["dtype"] in PEER_DTYPES[name] else f"not run for {cfg['dtype']}")
        peer = {"error": why} if why else time_peer(name)
        peer["backend"] = PEERS[name][1]
        peer["ratio"] = ratio(rec["ours"], peer)
        rec["peers"][name] = peer


def ratio(ours, peer):
    if ours and peer and ours.get("tflops") and peer.get("tflops"):
        return ours["tflops"] / peer["tflops"]
    return None


def variant_peers(r, q, k, v, slopes, torch, flex):
    """{name: call} of the PyTorch peers that compute this row: SDPA (GQA through
    ``enable_gqa``, a window as a boolean ``attn_mask``, ALiBi as a float ``attn_mask``
    bias; softcap it cannot express) and FlexAttention under ``torch.compile`` (``flex``)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    peers = {}
    n = r.N
    i = torch.arange(n, device="cuda")[:, None]
    j = torch.arange(n, device="cuda")[None, :]
    if getattr(r, "mask", None):         # a mask_mod row: causal, or equal documents
        return _mask_peers(r, q, k, v, torch, flex, sdpa, i, j)
    if r.softcap is None:
        if r.window is not None:
            left, right = r.window
            mask = (j <= i + (0 if r.causal else right)) & (j >= i - left)
            peers["sdpa mask"] = lambda: sdpa(q, k, v, attn_mask=mask)
        elif r.alibi:
            bias = (-slopes[:, None, None] * (i - j).abs()).to(q.dtype)[None]
            peers["sdpa bias"] = lambda: sdpa(q, k, v, attn_mask=bias, is_causal=False)
        else:
            peers["sdpa"] = lambda: sdpa(q, k, v, is_causal=r.causal, enable_gqa=r.Hq != r.Hkv)
    if flex is not None:
        fa, create_block_mask = flex
        block_mask = None
        if r.window is not None or r.causal:
            left = None if r.window is None else r.window[0]
            block_mask = create_block_mask(
                lambda b, h, qi, kj: (qi >= kj) & ((qi - kj <= left) if left is not None else (qi >= 0)),
                None, None, n, n)
        cap = r.softcap

        def score_mod(score, b, h, qi, kj):
            if cap is not None:
                score = cap * torch.tanh(score / cap)
            if r.alibi:
                score = score - slopes[h] * (qi - kj).abs()
            return score
        mod = score_mod if (cap is not None or r.alibi) else None
        peers["flex"] = lambda: fa(q, k, v, score_mod=mod, block_mask=block_mask, enable_gqa=r.Hq != r.Hkv)
    return peers


def _mask_peers(r, q, k, v, torch, flex, sdpa, i, j):
    """Peers of a mask_mod row: SDPA (``is_causal``, or a boolean ``attn_mask`` of the
    documents) and FlexAttention with the same mask as its block mask."""
    n = r.N
    peers = {}
    if r.mask == "causal":
        peers["sdpa"] = lambda: sdpa(q, k, v, is_causal=True)
        mask_fn = lambda b, h, qi, kj: qi >= kj  # noqa: E731
    else:
        docs = (torch.arange(n, device="cuda") * r.docs) // n
        shared = r.mask == "shared"          # every query also sees the first document
        dense = (docs[:, None] == docs[None, :]) | ((docs[None, :] == 0) & shared)
        peers["sdpa mask"] = lambda: sdpa(q, k, v, attn_mask=dense)
        mask_fn = lambda b, h, qi, kj: (docs[qi] == docs[kj]) | ((docs[kj] == 0) & shared)  # noqa: E731
    if flex is not None:
        fa, create_block_mask = flex
        block_mask = create_block_mask(mask_fn, None, None, n, n)
        peers["flex"] = lambda: fa(q, k, v, block_mask=block_mask)
    return peers


def _flex(torch):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        # every row (shape, score_mod, block mask) compiles its own graph: past dynamo's
        # recompile limit (8) the calls would run flex_attention uncompiled (its dense
        # reference path), orders of magnitude slower
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(256, getattr(torch._dynamo.config, name)))
        return torch.compile(flex_attention), create_block_mask
    except Exception:  # noqa: BLE001 - an older torch
        return None


