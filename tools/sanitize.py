"""Every kernel family with every score rule, at small ragged shapes: a driver for
NVIDIA's compute-sanitizer (on a GPU machine)::

    compute-sanitizer --tool memcheck --report-api-errors no python tools/sanitize.py
    compute-sanitizer --tool racecheck python tools/sanitize.py
    compute-sanitizer --tool synccheck python tools/sanitize.py

Each call is checked against the float64 oracle as well, so a run that the sanitizer
passes also computed the right thing. Exits 1 on a wrong result. ``--quick``: the first
shape only (racecheck is slow); ``--transforms``: softcap and ALiBi on a grouped-head
shape, float32 and bfloat16 only; ``--low``: float16 and bfloat16 only (the tensor-core
kernels); ``--serving``: the packed-row kernels instead (a varlen batch forward and
backward, contiguous and paged KV caches with appends, the one-warp decoding kernel with
key splits forced, grouped query heads, merge_attention), every dtype they take (with
``--low``: float16 and bfloat16; with ``--hopper``: the varlen batch alone, on the Hopper
forward, at d = 64 or ``--d D``);
``--hopper``: the Hopper family forced (``NUMBA_FLASH_HOPPER=1``; on a cc 9.0 GPU), forward
and backward, at ragged shapes of the head dims it takes, float16 and bfloat16, the
forward on a grid of three persistent blocks (each takes several work items; ``--quick``: the first shape only),
then block masks (an exact one, masked by its rows' runs, and one with holes, whose
``mask_mod`` the kernel calls) on the first shape, forward and backward. ``--masks``: the
block masks alone (every dtype, or as ``--low``/``--hopper`` say), a run short enough for
racecheck. ``--backward``: the backward kernels alone (out and lse from the float64
oracle; no block masks), with the other flags' shapes and dtypes. ``--d D``: only the
shapes of head dim ``D`` (``--quick`` then takes the first of them). ``--pairs`` (with
``--hopper``): the Hopper forward's pairs schedule of causal rows forced wherever a grid
of three blocks has a whole round of pairs (``wgmma_schedule.paired_places``), at shapes
with an odd count of query tiles and rows that see no key, d = 128, d = 64 (whose
calls of few rows take 128-row blocks: ``forward_wgmma.NARROW_CAUSAL_ROWS``) and d = 256
(``forward_wgmma.PAIRS_HEAD_DIM``); forward only. ``--rules NAME``: only the score rules
that include option ``NAME`` and no block masks (e.g. ``softcap``: the calls a softcap
change touches, within a sanitizer's time limit). ``--set MODULE.NAME=VALUE`` (repeatable):
a numba_flash constant set first, e.g. ``--set kernels.forward_wgmma.PUBLISH_HEAD_DIM=0``.
racecheck and the Hopper forward's published items (``forward_wgmma.PUBLISH_HEAD_DIM``, on
for causal rows, windows, block masks and packed rows at d <= 128): racecheck reports the
consumers' reads of an item's slot against the producer's stores, which the slot's
mbarriers order; it does not take an mbarrier's arrival and phase wait as ordering plain
shared-memory accesses (``tools/mbarrier_probe.py`` shows it on the protocol alone). Run
racecheck of the Hopper forward with ``--set kernels.forward_wgmma.PUBLISH_HEAD_DIM=0``
for the rest of it; memcheck and synccheck run with the items on.
``--no-block-splits`` (with ``--serving``): the decoding kernel's key splits in blocks of
their own and the merge kernel, as where a block's shared memory does not hold them
(``registry.BLOCK_SPLITS`` off; on, the default, a few splits are the warps of one block,
merged in its shared memory).
"""
import os
import sys

import ml_dtypes
import numpy as np

import numba_flash
from numba_flash import reference

OPTIONS = [
    {},
    {"causal": True},
    {"window": (5, 3)},
    {"window": (0, 0), "causal": True},
    {"window": (7, None), "softcap": 3.0, "alibi": True},
    {"causal": True, "softcap": 2.0, "alibi": True},
    {"softcap": 20.0},                       # a softcap alone: its tanh's own path (the polynomial's where on)
    {"causal": True, "softcap": 1.0},        # the same where the tiles' scores exceed the polynomial's range
]
# (Hq, Hkv, Nq, Nk, d): ragged against every tile size, Nq > Nk and Nq < Nk, GQA and MQA
SHAPES = [(2, 2, 37, 53, 40), (4, 2, 70, 29, 64), (3, 1, 17, 131, 24)]
HOPPER_SHAPES = [(4, 2, 130, 200, 64), (2, 1, 70, 29, 128), (2, 2, 200, 330, 128), (2, 1, 150, 170, 256),
                 (2, 1, 90, 140, 96)]
PAIRS_SHAPES = [(2, 2, 300, 260, 128), (2, 2, 300, 260, 64), (2, 2, 300, 260, 256)]   # three query tiles, two heads of two batches
DTYPES = (("float32", 1e-4), ("float64", 1e-10), ("float16", 2e-2), ("bfloat16", 8e-2))   # and tolerances


def _report(name, dt, err, tol):
    ok = err <= tol
    print(f"{'ok ' if ok else 'BAD'} {dt:9s} {name} max err {err:.1e}", flush=True)
    return not ok


def _heads_first(x):
    return np.swapaxes(np.asarray(x, np.float64), 0, 1)


def serving(rng, hopper=False, low=False, head_dim=64):
    """The packed-row kernels at ragged shapes, each result against the oracle; ``hopper``:
    the varlen batch alone on the Hopper forward (d = 64, sequences across its 128-row
    tiles, three persistent blocks; causal, whose kernel issues an item's last P V with
    the next item's first product, and full rows, whose kernel does not: both clear the V
    rows of the next sequence in a tile that crosses a sequence's end), float16 and
    bfloat16; ``head_dim``: its head dim there; ``low``: float16 and bfloat16 only."""
    from numba_flash import registry
    bad = 0
    lens_q, lens_k = ([5, 0, 140, 1], [9, 3, 200, 0]) if hopper else ([5, 0, 37, 1], [9, 3, 70, 0])
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    splits = registry.forward_splits
    for dt, tol in DTYPES[2:] if hopper or low else DTYPES:
        npdt = ml_dtypes.bfloat16 if dt == "bfloat16" else np.dtype(dt)
        d = head_dim if hopper else 40
        for causal in (True, False) if hopper else (True,):
            q = rng.standard_normal((cu_q[-1], 4, d))
            k, v = (rng.standard_normal((cu_k[-1], 2, d)) for _ in range(2))
            out, lse = numba_flash.attention_varlen_fwd(*(x.astype(npdt) for x in (q, k, v)), cu_q, cu_k,
                                                        causal=causal)
            dout = rng.standard_normal(out.shape)
            grads = numba_flash.attention_varlen_bwd(*(x.astype(npdt) for x in (dout, q, k, v)), out, lse, cu_q,
                                                     cu_k, causal=causal)
            err = 0.0
            for b in range(len(lens_q)):
                rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
                qs, ks, vs, ds = (_heads_first(x) for x in (q[rq], k[rk], v[rk], dout[rq]))
                ks, vs = (np.repeat(x, 2, axis=0) for x in (ks, vs))
                ro = reference.attention(qs, ks, vs, causal=causal)
                err = max(err, float(np.abs(_heads_first(out[rq]) - ro).max(initial=0)))
                rg = reference.attention_bwd(ds, qs, ks, vs, causal=causal)
                got = [_heads_first(grads[0][rq]), _heads_first(grads[1][rk]), _heads_first(grads[2][rk])]
                rg = [rg[0]] + [r.reshape(2, 2, *r.shape[1:]).sum(1) for r in rg[1:]]   # K/V heads: the group's sum
                err = max(err, max(float(np.abs(g - r).max(initial=0)) / max(1, np.abs(r).max(initial=0))
                                   for g, r in zip(got, rg)))
            bad += _report(f"varlen forward and backward (4 sequences, GQA, {'causal' if causal else 'full'})", dt,
                           err, tol)
        if hopper:
            continue
        for page in (0, 7, 16):       # contiguous; pages read row step by row step; in 16-row pieces
            for forced in (None, 1, 3):
                registry.forward_splits = splits if forced is None else (lambda *a, z=forced: z)
                try:
                    bad += _kvcache(rng, npdt, dt, tol, page, forced)
                finally:
                    registry.forward_splits = splits
        parts = [(rng.standard_normal((3, 7, d)).astype(npdt), rng.standard_normal((3, 7)).astype(
            np.float64 if dt == "float64" else np.float32)) for _ in range(3)]
        from numba import cuda
        dev = [cuda.to_device(p[0].view(np.uint16)) if dt == "bfloat16" else cuda.to_device(p[0]) for p in parts]
        if dt != "bfloat16":
            o, l = numba_flash.merge_attention(dev, [cuda.to_device(p[1]) for p in parts])
            ho, hl = numba_flash.merge_attention([p[0] for p in parts], [p[1] for p in parts])
            err = float(np.abs(o.copy_to_host().astype(np.float64) - ho.astype(np.float64)).max())
            bad += _report("merge_attention (3 partials, device vs host)", dt, err, tol)
    return bad


def _kvcache(rng, npdt, dt, tol, page, forced):
    """A KV cache with appended rows (contiguous, or paged with pages of ``page`` rows), one
    and 5 queries per sequence."""
    from numba import cuda
    bad = 0
    b, hq, hkv, d = 3, 4, 2, 24
    paged = page > 0
    lens = np.array([13, 0, 40])
    for nq in (1, 5):
        q = rng.standard_normal((b, nq, hq, d)).astype(npdt)
        kn, vn = (rng.standard_normal((b, 2, hkv, d)).astype(npdt) for _ in range(2))
        if paged:
            table = rng.permutation(b * 7).reshape(b, 7).astype(np.int32)
            kc, vc = (rng.standard_normal((b * 7, page, hkv, d)).astype(npdt) for _ in range(2))
            extra = {"block_table": table}
        else:
            kc, vc = (rng.standard_normal((b, 49, hkv, d)).astype(npdt) for _ in range(2))
            extra = {}
        args = [cuda.to_device(x.view(np.uint16)) if dt == "bfloat16" else cuda.to_device(x) for x in (q, kc, vc)]
        news = [cuda.to_device(x.view(np.uint16)) if dt == "bfloat16" else cuda.to_device(x) for x in (kn, vn)]
        if dt == "bfloat16":
            args = [numba_flash.to_device(x) for x in (q, kc, vc)]
            news = [numba_flash.to_device(x) for x in (kn, vn)]
        out = numba_flash.attention_with_kvcache(*args, lens.astype(np.int32), k_new=news[0], v_new=news[1],
                                                 causal=True, **extra)
        out = out.copy_to_host()
        kc2, vc2 = (a.copy_to_host() for a in args[1:])
        err = 0.0
        for i in range(b):
            n = lens[i] + 2
            rows = (lambda c: np.concatenate([c[p] for p in table[i]])) if paged else (lambda c: c[i])
            ks, vs = (np.repeat(_heads_first(rows(c)[:n]), 2, axis=0) for c in (kc2, vc2))
            ro = reference.attention(_heads_first(q[i]), ks, vs, causal=True)
            err = max(err, float(np.abs(_heads_first(out[i]) - ro).max()))
        name = f"KV cache{f' paged {page}' if paged else ''}, Nq={nq}, splits {forced or 'chosen'}"
        bad += _report(name, dt, err, tol)
    return bad


def doc_causal(b, h, i, j, docs):
    return docs[i] == docs[j] and j <= i


def doc_holes(b, h, i, j, docs):
    return docs[i] == docs[j] and (i - j) % 3 != 1


def gap_holes(b, h, i, j, docs):
    return (j < 128 or j >= 256) and (i + j) % 5 != 0


def block_masks(rng, shape, dtypes):
    """Block masks on one shape: each call against the oracle given the function; the
    last with 300 keys, of which 128..255 no query sees (whole empty key tiles inside the
    range: the tile lists)."""
    hq, hkv, nq, nk0, d = shape
    bad = 0
    for fn, nk in ((doc_causal, nk0), (doc_holes, nk0), (gap_holes, 300)):
        docs = np.sort(rng.integers(0, 3, max(nq, nk))).astype(np.int32)
        q = rng.standard_normal((2, hq, nq, d))
        k, v = (rng.standard_normal((2, hkv, nk, d)) for _ in range(2))
        dout = rng.standard_normal(q.shape)
        bm = numba_flash.block_mask(fn, 1, 1, nq, nk, mod_args=(docs,))
        opts = {"mask_mod": fn, "mod_args": (docs,)}
        ref_out, _ = reference.attention_fwd(q, k, v, **opts)
        ref_grads = reference.attention_bwd(dout, q, k, v, **opts)
        for dt, tol in dtypes:
            npdt = ml_dtypes.bfloat16 if dt == "bfloat16" else np.dtype(dt)
            args = [x.astype(npdt) for x in (q, k, v)]
            out, lse = numba_flash.attention_fwd(*args, block_mask=bm)
            errs = [float(np.abs(out.astype(np.float64) - ref_out).max())]
            grads = numba_flash.attention_bwd(dout.astype(npdt), *args, out, lse, block_mask=bm)
            errs += [float(np.abs(g.astype(np.float64) - r).max() / max(1, np.abs(r).max()))
                     for g, r in zip(grads, ref_grads)]
            bad += _report(f"{shape} block mask {fn.__name__} (exact: {bm.exact})", dt, max(errs), tol)
    return bad


def _few_blocks(blocks=3):
    """Report ``blocks`` multiprocessors to the launches, so the Hopper family's persistent
    blocks each take several work items at these small shapes."""
    from numba_flash import api
    facts = api._device_facts

    def few():
        _, smem, cc = facts()
        return blocks, smem, cc
    api._device_facts = few


def main():
    rng = np.random.default_rng(0)
    sets = [sys.argv[n + 1] for n, a in enumerate(sys.argv[:-1]) if a == "--set"]
    if sets:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from ab import set_constants                 # (beside this file)
        set_constants(sets)
    if "--no-block-splits" in sys.argv:
        from numba_flash import registry
        registry.BLOCK_SPLITS = False
    if "--serving" in sys.argv:
        if "--hopper" in sys.argv:
            os.environ["NUMBA_FLASH_HOPPER"] = "1"
            _few_blocks()
        head_dim = int(sys.argv[sys.argv.index("--d") + 1]) if "--d" in sys.argv else 64
        return 1 if serving(rng, "--hopper" in sys.argv, "--low" in sys.argv, head_dim) else 0
    bad = 0
    shapes, options, dtypes = SHAPES, OPTIONS, DTYPES
    if "--transforms" in sys.argv:
        shapes, options, dtypes = SHAPES[1:2], OPTIONS[4:], DTYPES[::3]
    if "--hopper" in sys.argv:
        os.environ["NUMBA_FLASH_HOPPER"] = "1"
        shapes = HOPPER_SHAPES
        _few_blocks()
    pairs = "--pairs" in sys.argv
    if pairs:
        from numba_flash.kernels import wgmma_schedule
        wgmma_schedule.L2_KV_BYTES, wgmma_schedule.PAIRS_SLACK = 0, float("inf")
        wgmma_schedule.paired_places.cache_clear()
        shapes, options = PAIRS_SHAPES, [o for o in options if o.get("causal") and "window" not in o]
    if "--d" in sys.argv:
        head_dim = int(sys.argv[sys.argv.index("--d") + 1])
        shapes = [s for s in shapes if s[-1] == head_dim]
    if "--rules" in sys.argv:
        rule = sys.argv[sys.argv.index("--rules") + 1]
        options = [o for o in options if rule in o]
        if not options:
            sys.exit(f"sanitize.py: --rules {rule!r}: no score rule has it (options: {sorted(set().union(*OPTIONS))})")
    if "--quick" in sys.argv and "--transforms" not in sys.argv:
        shapes = shapes[:1]
    if "--low" in sys.argv or "--hopper" in sys.argv:
        dtypes = [(dt, tol) for dt, tol in dtypes if dt in ("float16", "bfloat16")]
    if "--masks" in sys.argv:
        return 1 if block_masks(rng, shapes[0], dtypes) else 0
    backward_only = "--backward" in sys.argv
    forward_only = pairs
    for (hq, hkv, nq, nk, d) in shapes:
        for opts in options:
            opts = dict(opts)
            q = rng.standard_normal((2, hq, nq, d))
            k, v = (rng.standard_normal((2, hkv, nk, d)) for _ in range(2))
            if opts.pop("alibi", False):
                opts["alibi_slopes"] = (2.0 ** -rng.uniform(0.5, 6, hq)).astype(np.float32)
            ref_out, ref_lse = reference.attention_fwd(q, k, v, **opts)
            dout = rng.standard_normal(ref_out.shape)
            ref_grads = reference.attention_bwd(dout, q, k, v, **opts)
            for dt, tol in dtypes:
                if dt in ("float16", "bfloat16") and d % 8:
                    continue
                npdt = ml_dtypes.bfloat16 if dt == "bfloat16" else np.dtype(dt)
                args = [x.astype(npdt) for x in (q, k, v)]
                if backward_only:                    # out and lse from the oracle
                    out, errs = ref_out.astype(npdt), []
                    lse = ref_lse.astype(np.float64 if dt == "float64" else np.float32)
                else:
                    out, lse = numba_flash.attention_fwd(*args, **opts)
                    errs = [float(np.abs(out.astype(np.float64) - ref_out).max())]
                if not forward_only:
                    grads = numba_flash.attention_bwd(dout.astype(npdt), *args, out, lse, **opts)
                    errs += [float(np.abs(g.astype(np.float64) - r).max() / max(1, np.abs(r).max()))
                             for g, r in zip(grads, ref_grads)]
                ok = max(errs) <= tol
                bad += not ok
                print(f"{'ok ' if ok else 'BAD'} {dt:9s} {(hq, hkv, nq, nk, d)} {opts if 'alibi_slopes' not in opts else {**opts, 'alibi_slopes': '...'}} "
                      f"max err {max(errs):.1e}", flush=True)
    if "--hopper" in sys.argv and not backward_only and not pairs and "--rules" not in sys.argv:
        bad += block_masks(rng, shapes[0], dtypes)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
